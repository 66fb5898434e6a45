"""The display adapter (bochs-display compatible) with the guest's own bochs DRM driver
(full image, generic kernel), and its screenshot rendering."""

import struct
import subprocess
import sys
import time
import zlib

import pytest

from dxpu_vfio import hotplug



def png_pixels(png: bytes) -> tuple[int, int, bytes]:
    """Decode the plain 8-bit RGB PNGs the adapter writes (no filters)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, w, h = 8, b"", 0, 0
    while pos < len(png):
        length, kind = struct.unpack(">I4s", png[pos:pos + 8])
        data = png[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            w, h = struct.unpack(">II", data[:8])
        elif kind == b"IDAT":
            idat += data
        pos += 12 + length
    raw = zlib.decompress(idat)
    return w, h, b"".join(raw[y * (w * 3 + 1) + 1:(y + 1) * (w * 3 + 1)] for y in range(h))


def wait_mode(att, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while not (mode := att.server.stats()["device"]["mode"])["enabled"]:
        assert time.monotonic() < deadline, "the driver never enabled a mode"
        time.sleep(1)
    return mode


@pytest.mark.vm
def test_bochs_driver_binds_sets_its_mode_and_the_device_renders_it(full_vm):
    att = hotplug.attach(full_vm, "display")
    try:
        bdf = att.guest_bdf
        mode = wait_mode(att)
        assert (mode["xres"], mode["yres"], mode["bpp"]) == (1024, 768, 32)
        driver = full_vm.run(f"basename $(readlink /sys/bus/pci/devices/{bdf}/driver)").stdout.strip()
        assert driver == "bochs-drm"
        assert full_vm.run("ls /dev/dri/card0 /dev/fb0 && cat /sys/class/graphics/fb0/virtual_size").stdout.endswith("1024,768\n")
        assert "Found EDID data blob" in full_vm.run("dmesg").stdout  # the driver read our EDID
        w, h, _ = png_pixels(att.server.screenshot())
        assert (w, h) == (1024, 768)  # the scanout the driver set, rendered on the device side
        out = full_vm.workdir / "shot.png"
        cli = subprocess.run([sys.executable, "-m", "dxpu_vfio.cli", "screenshot", att.device_id, str(out)],
                             capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        assert png_pixels(out.read_bytes())[:2] == (1024, 768)
    finally:
        hotplug.detach(att)


def test_display_model_renders_its_scanout_pixel_exact():
    """The model alone (driven as the bochs driver drives it): what is in VRAM at the
    scanout offset is, pixel for pixel, what the screenshot shows."""
    from qemu_device.display import DisplayAdapter
    dev = DisplayAdapter()
    for reg, value in ((3, 32), (1, 64), (2, 48), (6, 64), (9, 2), (4, 0x41)):  # BPP, XRES, YRES, VIRT_WIDTH, Y_OFFSET, ENABLE
        dev.region_write(2, 0x500 + 2 * reg, value.to_bytes(2, "little"))
    stride = 64 * 4
    for y in range(48):
        color = [0x00FF0000, 0x0000FF00, 0x000000FF][y % 3]
        dev.region_write(0, (y + 2) * stride, struct.pack("<I", color) * 64)
    w, h, rgb = png_pixels(dev.render_png())
    assert (w, h) == (64, 48)
    for y in range(48):
        assert rgb[y * 192:(y + 1) * 192] == bytes.fromhex(["ff0000", "00ff00", "0000ff"][y % 3]) * 64
