"""The display with its framebuffer BAR host-mapped (``mapped = true``, the default), with
the guest's own bochs DRM driver (full image), served locally and from a GPU box.

Locally QEMU maps the model's memfd into the guest: stores reach the framebuffer with
no message. From a box the host proxy keeps the shadow QEMU maps and writes what changed
back to the box (``hostproxy/shadow.py``): the box's screenshot is the guest's frame within
one write-back period. The trapped path keeps its tests in test_display.py."""

import time

import pytest

from dxpu_vfio.lab import hotplug
from dxpu_vfio.lab import kms as guest_kms
from dxpu_vfio.lab.display_probe import DisplayProbe, png_pixels
from dxpu_vfio.testing import Serve

BOX, DEVICE = "gpubox", "fbm"


@pytest.fixture(scope="module")
def served_specs():
    return [Serve("display", DEVICE, BOX)]  # mapped: the default


def region_writes(att) -> int:
    return att.server.stats()["server"]["commands"].get("REGION_WRITE", {}).get("count", 0)


def wait_exact(probe, width, height, rgb, timeout):
    """Seconds until the screenshot is ``rgb``, polled every 10 ms."""
    started = time.monotonic()
    while True:
        w, h, got = png_pixels(probe.screenshot())
        if (w, h) == (width, height) and got == rgb:
            return time.monotonic() - started
        assert time.monotonic() - started < timeout, f"{w}x{h}: not the pattern after {timeout} s"
        time.sleep(0.01)


@pytest.mark.vm
def test_patterns_through_fb0_and_kms_appear_pixel_exact_without_messages(full_vm, served_device):
    """/dev/fb0 (the driver's fbdev shadow copied to VRAM by its damage worker) and a KMS
    dumb buffer at 800x600 (the client's stores straight into the mapped VRAM) both show
    pixel for pixel in the screenshot of whoever holds the framebuffer, and the frame's
    megabytes never crossed the host proxy's vfio-user socket as messages."""
    dev = served_device
    att = hotplug.attach(full_vm, **dev.attach_args())
    try:
        probe = DisplayProbe.of(att, dev.lab, dev.box, dev.device)
        probe.wait_mode()
        assert probe.state()["framebuffer_mapped"]
        kms = guest_kms.install(full_vm)
        full_vm.run(f"python3 {kms} --mode 1024x768 --pattern-file /tmp/pattern.raw", timeout=120)
        before = region_writes(att)
        guest_kms.bind_console(full_vm, False)
        try:
            full_vm.run("dd if=/tmp/pattern.raw of=/dev/fb0 bs=1M 2>&1", timeout=60)
            probe.wait_pixels(1024, 768, guest_kms.pattern_rgb(1024, 768), timeout=60)
            if dev.remote:  # the console is unbound: nothing changes, so nothing may cross the link
                time.sleep(0.5)
                sent = shadow_stats(att)
                time.sleep(1)
                now = shadow_stats(att)
                assert now["bytes_sent"] == sent["bytes_sent"] and now["periodic"] > sent["periodic"] + 30
        finally:
            guest_kms.bind_console(full_vm, True)
        assert region_writes(att) - before < 1000  # 3 MiB trapped is ~100k writes
        full_vm.run("rm -f /tmp/kms.stop")
        pid = full_vm.spawn(f"python3 {kms} --mode 800x600 --hold 240 --until /tmp/kms.stop")
        try:
            probe.wait_mode(lambda m: (m["xres"], m["yres"]) == (800, 600), timeout=120)
            late = wait_exact(probe, 800, 600, guest_kms.pattern_rgb(800, 600), timeout=60)
        finally:
            full_vm.run("touch /tmp/kms.stop")
        assert full_vm.wait(pid, 60).rc == 0
        print(f"KMS pattern seen {late * 1000:.0f} ms after the mode")
    finally:
        hotplug.detach(att)


def shadow_stats(att) -> dict:
    return att.server.stats()["device"]["shadows"]["0"]


@pytest.mark.vm
@pytest.mark.parametrize("served", ["remote"], indirect=True, scope="module")  # only a box's device writes back
def test_from_a_box_unplug_flushes_the_last_frame(full_vm, served_device):
    """No periodic write-back (writeback_hz = 0), so only ordering carries frames: the
    KMS client's pattern, drawn after its mode set, reaches the box when device_del
    takes the device while the client still shows it (the driver's last register
    writes, or the session's reset, flush first)."""
    dev = served_device
    assert dev.remote
    att = hotplug.attach(full_vm, **dev.attach_args(writeback_hz=0))
    detached = False
    try:
        probe = DisplayProbe.of(att, dev.lab, dev.box, dev.device)
        probe.wait_mode()
        kms = guest_kms.install(full_vm)
        full_vm.run("rm -f /tmp/kms.stop /tmp/kms.out")
        pid = full_vm.spawn(f"python3 {kms} --mode 800x600 --hold 240 --until /tmp/kms.stop > /tmp/kms.out")
        probe.wait_mode(lambda m: (m["xres"], m["yres"]) == (800, 600), timeout=120)
        deadline = time.monotonic() + 120
        while "fill_s" not in full_vm.run("cat /tmp/kms.out", check=False).stdout:  # drawn: it holds now
            assert time.monotonic() < deadline, "the KMS client never drew"
            time.sleep(1)
        box_bytes = probe.state()["framebuffer_bytes"]
        hotplug.detach(att)
        detached = True
        after = probe.state()["framebuffer_bytes"]
        assert after - box_bytes >= 800 * 600 * 4, "the last frame did not reach the box at unplug"
        full_vm.run("touch /tmp/kms.stop")
        full_vm.wait(pid, 60)  # the client outlives its card
    finally:
        full_vm.run("touch /tmp/kms.stop", check=False)
        if not detached:
            hotplug.detach(att)
