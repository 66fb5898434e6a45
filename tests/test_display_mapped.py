"""The display with its framebuffer BAR host-mapped (``mapped = true``), with the guest's
own bochs DRM driver (full image), served locally and from a GPU box.

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
    return [Serve("display", DEVICE, BOX, settings={"mapped": True})]


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
