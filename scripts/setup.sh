#!/usr/bin/env bash
# Everything a fresh Debian machine of this kind lacks, idempotent and with visible
# progress: Debian packages, the Python venv (.venv) with the project installed,
# a QEMU with vfio-user-pci (private sysroot from Debian testing when the system one
# is too old) and the guest images. Re-running it does only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

PACKAGES=(
    mmdebstrap            # QEMU sysroot and the full guest rootfs
    cpio gzip xz-utils    # tiny initramfs
    e2fsprogs             # mke2fs -d for the full guest disk
    gcc make libc6-dev    # static guest tools
    python3-dev           # the native link stream (scripts/build_native.py; its OpenSSL is Debian testing's)
    clang libclang-rt-14-dev  # its libFuzzer harness (scripts/fuzz_native.sh)
    iproute2              # network namespaces for the lab
    iptables              # NAT for the lab's extra host namespaces (--hosts)
    libvirt-daemon-system libvirt-clients libvirt-dev pkg-config  # libvirt + what libvirt-python builds against
    etcd-server etcd-client  # the multi-host pool's store (3.4 on Debian 12); tests start their own members
    meson libjson-c-dev libcmocka-dev  # libvfio-user's samples, peer software (scripts/build_libvfio_user.sh)
    python3-venv
)

step "Debian packages"
missing=()
for pkg in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    echo "installing: ${missing[*]}"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
else
    echo "all present"
fi

step "Python environment (.venv)"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.dxpu-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    .venv/bin/pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
    .venv/bin/pip install -q -e '.[test]' 2>&1 | grep -v '^WARNING: Location' || true
    .venv/bin/python -c 'import dxpu_vfio, qemu.qmp, libvirt, pyudev, pyroute2, etcd3gw, pytest' \
        || { echo "setup: Python dependencies failed to install" >&2; exit 1; }
    echo "$want" > "$stamp"
else
    echo "up to date"
fi

step "Native stream (C: framing and TLS of the data path)"
src=dxpu_vfio/native
so=$(ls dxpu_vfio/native/_fastlink*.so 2>/dev/null | head -1 || true)
if [ -z "$so" ] || [ -n "$(find "$src" scripts/build_native.py -newer "$so" \( -name '*.[ch]' -o -name build_native.py \) 2>/dev/null)" ]; then
    .venv/bin/python scripts/build_native.py
else
    echo "up to date"
fi

step "libvfio-user samples (peer software: an external vfio-user server that is not ours)"
# No Debian package: built from a source checkout when there is one; without it the
# peer tests (tests/test_libvfio_user.py) fail naming what to fetch.
rc=0; scripts/build_libvfio_user.sh || rc=$?
if [ "$rc" -eq 2 ]; then
    echo "skipped: no libvfio-user source (see above); tests/test_libvfio_user.py will fail until it is there"
elif [ "$rc" -ne 0 ]; then
    exit "$rc"
fi

step "libvirt: QEMU runs as root (dxpu vm define)"
# libvirt runs and probes QEMU as qemu.conf's user (Debian: libvirt-qemu), which cannot
# enter /root where the QEMU sysroot and guest images live. Our block sets root:root,
# appended once; libvirt takes the first setting of a key, so earlier user/group lines
# are commented out (marked "#dxpu-vfio#").
conf=/etc/libvirt/qemu.conf
if [ -f "$conf" ] && ! grep -q '^# dxpu-vfio: begin' "$conf"; then
    sed -i -E 's/^([[:space:]]*(user|group)[[:space:]]*=)/#dxpu-vfio# \1/' "$conf"
    printf '\n# dxpu-vfio: begin (scripts/setup.sh; see docs/libvirt.md)\nuser = "root"\ngroup = "root"\n# dxpu-vfio: end\n' >> "$conf"
    echo "set user/group \"root\" in $conf"
    if [ -S /run/libvirt/libvirt-sock ] && [ -f /run/libvirtd.pid ]; then
        echo "libvirtd (pid $(cat /run/libvirtd.pid)) runs with the old settings: restart it (kill PID && libvirtd -d)"
    fi
else
    echo "already configured"
fi

step "QEMU with vfio-user-pci"
.venv/bin/dxpu setup qemu

step "Guest images"
.venv/bin/dxpu setup images "$@"

step "Done"
.venv/bin/dxpu doctor || true
