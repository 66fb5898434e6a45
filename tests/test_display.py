"""The display adapter (bochs-display compatible) on its trapped path (``mapped = false``:
every framebuffer store a message; the default, mapped, is test_display_mapped.py) with
the guest's own bochs DRM driver (full image, generic kernel), served locally and from a
GPU box over the lab network with mutual TLS; and the model's own scanout rendering.

Every guest test runs twice, ``local`` (our vfio-user server runs the model) and
``remote`` (the model and its framebuffer live in a remote proxy in a GPU-box network
namespace; the host proxy forwards, coalescing posted writes). The device's state and
screenshots are asked of whoever holds the framebuffer (:class:`DisplayProbe`)."""

import struct
import subprocess
import sys

import pytest

from dxpu_vfio.lab import hotplug
from dxpu_vfio.lab import kms as guest_kms
from dxpu_vfio.lab.display_probe import DisplayProbe, png_pixels
from dxpu_vfio.testing import Serve

BOX, DEVICE = "gpubox", "fb0"


@pytest.fixture(scope="module")
def served_specs():
    return [Serve("display", DEVICE, BOX, settings={"mapped": False})]  # the trapped path, asked for


@pytest.fixture
def plug(served_device, full_vm):
    """plug() -> (attachment, probe); everything plugged is unplugged at the end."""
    dev = served_device
    plugged = []

    def do_plug():
        att = hotplug.attach(full_vm, **dev.attach_args())
        plugged.append(att)
        return att, DisplayProbe.of(att, dev.lab, dev.box, dev.device)
    yield do_plug
    for att in plugged:
        hotplug.detach(att)


def driver_of(vm, bdf: str) -> str:
    return vm.run(f"basename $(readlink /sys/bus/pci/devices/{bdf}/driver)").stdout.strip()


@pytest.mark.vm
def test_bochs_driver_binds_sets_its_mode_and_the_device_renders_it(full_vm, plug, served_device):
    att, probe = plug()
    m = probe.wait_mode()
    assert (m["xres"], m["yres"], m["bpp"]) == (1024, 768, 32)
    assert driver_of(full_vm, att.guest_bdf) == "bochs-drm"
    assert full_vm.run("ls /dev/dri/card0 /dev/fb0 && cat /sys/class/graphics/fb0/virtual_size").stdout.endswith("1024,768\n")
    assert "Found EDID data blob" in full_vm.run("dmesg").stdout  # the driver read our EDID
    assert png_pixels(probe.screenshot())[:2] == (1024, 768)  # rendered where the framebuffer lives
    out = full_vm.workdir / "shot.png"
    name = served_device.name or att.device_id  # BOX/DEVICE when served from the box
    cli = subprocess.run([sys.executable, "-m", "dxpu_vfio.cli", "screenshot", name, str(out)],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert png_pixels(out.read_bytes())[:2] == (1024, 768)


@pytest.mark.vm
def test_pattern_written_to_fb0_appears_pixel_exact(full_vm, plug):
    """Through the driver's fbdev emulation: the pattern lands in its shadow buffer and
    the driver's damage worker copies it to VRAM with posted writes. The console is
    unbound from the framebuffer first so that its cursor does not blink into it."""
    att, probe = plug()
    probe.wait_mode()
    assert not probe.state()["framebuffer_mapped"]  # the trapped path, as asked
    kms = guest_kms.install(full_vm)
    full_vm.run(f"python3 {kms} --mode 1024x768 --pattern-file /tmp/pattern.raw", timeout=120)
    guest_kms.bind_console(full_vm, False)
    try:
        full_vm.run("dd if=/tmp/pattern.raw of=/dev/fb0 bs=1M 2>&1", timeout=60)
        probe.wait_pixels(1024, 768, guest_kms.pattern_rgb(1024, 768), timeout=120)
    finally:
        guest_kms.bind_console(full_vm, True)
    assert probe.state()["framebuffer_bytes"] >= 1024 * 768 * 4


@pytest.mark.vm
def test_mode_change_through_kms_reaches_the_device(full_vm, plug):
    """A KMS client (dxpu_kms.py: dumb buffer, ADDFB, SETCRTC) sets 800x600 and draws the
    pattern straight into the mapped VRAM; the device's DISPI registers follow, the
    scanout shows the pattern; when the client exits the fbdev mode comes back."""
    att, probe = plug()
    probe.wait_mode()
    kms = guest_kms.install(full_vm)
    full_vm.run("rm -f /tmp/kms.stop")
    pid = full_vm.spawn(f"python3 {kms} --mode 800x600 --hold 240 --until /tmp/kms.stop")
    try:
        m = probe.wait_mode(lambda m: (m["xres"], m["yres"]) == (800, 600), timeout=120)
        assert m["enabled"] and m["bpp"] == 32
        probe.wait_pixels(800, 600, guest_kms.pattern_rgb(800, 600), timeout=120)
    finally:
        full_vm.run("touch /tmp/kms.stop")
    result = full_vm.wait(pid, 60)
    assert result.rc == 0, result
    assert '"mode": "800x600"' in result.stdout and "800x600" in result.stdout
    probe.wait_mode(lambda m: (m["xres"], m["yres"]) == (1024, 768), timeout=60)


@pytest.mark.vm
def test_unplug_and_replug(full_vm, plug):
    att, probe = plug()
    probe.wait_mode()
    hotplug.detach(att)
    assert not att.server.alive()
    assert full_vm.run(f"test -e /sys/bus/pci/devices/{att.guest_bdf}", check=False).rc != 0
    assert full_vm.run("test -e /dev/fb0", check=False).rc != 0
    again, probe = plug()
    m = probe.wait_mode()
    assert (m["xres"], m["yres"]) == (1024, 768)
    assert driver_of(full_vm, again.guest_bdf) == "bochs-drm"
    assert full_vm.run("ls /dev/dri/card0 /dev/fb0", check=False).rc == 0


@pytest.mark.vm
def test_screenshot_through_the_pool(full_vm, served_lab, tmp_path):
    """The pool manager gives the guest the box's display; `dxpu screenshot LEASE --pool`
    has the box render it (SCREENSHOT over the mutual-TLS link) and matches what the box
    itself shows; a wrong name gets a clear error."""
    from dxpu_vfio.pool.service import ManagerClient, ManagerProcess
    db = tmp_path / "pool.db"
    manager = ManagerProcess(db, netns=served_lab.host_netns).start()
    pool = ManagerClient(db)
    try:
        pool.post("/v1/boxes", name=BOX, address=served_lab.box(BOX).endpoint, tls_dir=str(served_lab.certs))
        [lease] = pool.post("/v1/attach", vm=str(full_vm.admin_qmp_path), **{"class": "display"})
        probe = DisplayProbe.in_box(served_lab, BOX, DEVICE)
        probe.wait_mode(lambda m: m["enabled"] and m["xres"] == 1024)
        out = tmp_path / "pool.png"
        cli = subprocess.run([sys.executable, "-m", "dxpu_vfio.cli", "screenshot", lease["lease"], str(out),
                              "--pool", "--db", str(db)], capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        assert png_pixels(out.read_bytes())[:2] == (1024, 768)
        assert png_pixels(pool.get("/v1/screenshot", device=f"{BOX}/{DEVICE}"))[:2] == (1024, 768)
        cli = subprocess.run([sys.executable, "-m", "dxpu_vfio.cli", "screenshot", "nosuch", str(out),
                              "--pool", "--db", str(db)], capture_output=True, text=True, timeout=60)
        assert cli.returncode == 1 and "no device 'nosuch' in the pool" in cli.stderr
        pool.post("/v1/detach", vm=str(full_vm.admin_qmp_path), all=True)
    finally:
        manager.stop()


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


def test_edid_offers_the_modes_a_kms_client_can_pick():
    from qemu_device.display import DisplayAdapter
    edid = DisplayAdapter().edid
    assert sum(edid) % 256 == 0 and edid[:8] == b"\x00\xff\xff\xff\xff\xff\xff\x00"
    assert edid[35] & 0x21 == 0x21 and edid[36] & 0x08  # 640x480@60, 800x600@60, 1024x768@60


def set_mode(dev, xres: int, yres: int, *, bpp: int = 32, virt_width: int = 0, y_offset: int = 0) -> None:
    for reg, value in ((4, 0), (3, bpp), (1, xres), (2, yres), (6, virt_width or xres), (9, y_offset), (4, 0x41)):
        dev.region_write(2, 0x500 + 2 * reg, value.to_bytes(2, "little"))


@pytest.mark.parametrize("mode", [dict(xres=65535, yres=65535), dict(xres=1024, yres=768, virt_width=65535),
                                  dict(xres=2048, yres=2049), dict(xres=1024, yres=768, y_offset=5000)],
                         ids=["65535x65535", "wide-lines", "one-line-past-vram", "offset-past-vram"])
def test_a_mode_beyond_the_limits_or_vram_is_refused_not_allocated(mode):
    """A guest's 65535x65535 once made a screenshot allocate 17 GB: an invalid mode
    raises DisplayModeError at once, and the stats say why."""
    import tracemalloc

    from qemu_device.display import DisplayAdapter, DisplayModeError
    dev = DisplayAdapter()  # 16 MiB
    set_mode(dev, **mode)
    tracemalloc.start()
    try:
        with pytest.raises(DisplayModeError):
            dev.render_png()
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()
    assert dev.stats()["mode_error"]
    set_mode(dev, 2048, 2048)  # exactly 16 MiB: fits
    assert dev.stats()["mode_error"] is None and png_pixels(dev.render_png())[:2] == (2048, 2048)


def test_getcaps_reports_the_mode_limits():
    from qemu_device import display
    dev = display.DisplayAdapter()
    dev.region_write(2, 0x500 + 2 * 4, display.GETCAPS.to_bytes(2, "little"))
    limits = [int.from_bytes(dev.region_read(2, 0x500 + 2 * reg, 2), "little") for reg in (1, 2, 3)]
    assert limits == [display.MAX_XRES, display.MAX_YRES, display.MAX_BPP]
    dev.region_write(2, 0x500 + 2 * 4, (0).to_bytes(2, "little"))
    assert int.from_bytes(dev.region_read(2, 0x500 + 2 * 1, 2), "little") == 0  # the mode's own again
