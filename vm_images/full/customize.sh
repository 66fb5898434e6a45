#!/bin/sh
# mmdebstrap customize hook for the full image: $1 is the root being built,
# $2 the directory holding the guest tools built on the host.
set -e
root=$1
tools=$2
echo dxpu-full > "$root/etc/hostname"
echo "/dev/vda / ext4 defaults 0 1" > "$root/etc/fstab"
chroot "$root" passwd -d root
install -m 0755 "$tools"/* "$root/usr/local/bin/"
# Nothing in the lab needs these; they only slow a TCG boot.
for unit in apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer \
            systemd-timesyncd.service man-db.timer dpkg-db-backup.timer; do
    chroot "$root" systemctl mask "$unit" >/dev/null 2>&1 || true
done
# The guest agent starts on the virtio-serial port's udev event; make sure it is wanted.
chroot "$root" systemctl enable qemu-guest-agent.service >/dev/null 2>&1 || true
