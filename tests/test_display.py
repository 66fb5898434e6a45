"""The display adapter (bochs-display compatible) on its trapped path (``mapped = false``:
every framebuffer store a message; the default, mapped, is test_display_mapped.py) with
the guest's own bochs DRM driver (full image, generic kernel), served locally and from a
GPU box over the lab network with mutual TLS; and the model's own scanout rendering.

Every guest test runs twice, ``local`` (our vfio-user server runs the model) and
``remote`` (the model and its framebuffer live in a remote proxy in a GPU-box network
namespace; the host proxy forwards, coalescing posted writes). The device's state and
screenshots are asked of whoever holds the framebuffer (:class:`DisplayProbe`)."""

import os
import struct
import subprocess
import sys
import time

import pytest

from dxpu_vfio.lab import fault_results, hotplug
from dxpu_vfio.lab import kms as guest_kms
from dxpu_vfio.lab.display_probe import DisplayProbe, png_pixels
from dxpu_vfio.testing.served import Serve

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


class _ClientRegions:
    """A vfio-user client's region writes as ``set_mode`` makes them on a model."""

    def __init__(self, client) -> None:
        self.client = client

    def region_write(self, index: int, offset: int, data: bytes) -> None:
        self.client.write(index, offset, data)


def test_a_screenshot_of_a_mode_that_cannot_be_shown_says_why_at_once(tmp_path):
    """`dxpu screenshot` of a locally served display whose guest set an invalid mode
    waited 30 s and then asked whether the device was a display: the host proxy now
    writes why next to the PNG it cannot write, and the asker says so at once. A valid
    mode after it is shot as before."""
    from dxpu_vfio.hostproxy.process import HostProxyError, HostProxyProcess
    from dxpu_vfio.vfio_user.client import VfioUserClient
    name = f"shot{os.getpid()}"
    host = HostProxyProcess("display", tmp_path / "fb.sock", name=name).start()
    try:
        client = VfioUserClient(host.socket_path)
        client.negotiate()
        set_mode(_ClientRegions(client), 65535, 65535)
        started = time.monotonic()
        with pytest.raises(HostProxyError, match="cannot show its display: mode 65535x65535"):
            host.screenshot(timeout=30)
        cli = subprocess.run([sys.executable, "-m", "dxpu_vfio.cli", "screenshot", name, str(tmp_path / "shot.png")],
                             capture_output=True, text=True, timeout=60)
        assert time.monotonic() - started < 20, "the asker waited for a file that would not come"
        assert cli.returncode == 1 and "shows nothing a screenshot can take: mode 65535x65535" in cli.stderr, cli.stderr
        set_mode(_ClientRegions(client), 640, 480)
        assert png_pixels(host.screenshot(timeout=30))[:2] == (640, 480)
        client.close()
    finally:
        host.stop()
    # the socket, its stats, the PNG and the error file went with the process; its log stays
    assert [p.name for p in tmp_path.iterdir()] == ["fb.log"], list(tmp_path.iterdir())

def test_getcaps_reports_the_mode_limits():
    from qemu_device import display
    dev = display.DisplayAdapter()
    dev.region_write(2, 0x500 + 2 * 4, display.GETCAPS.to_bytes(2, "little"))
    limits = [int.from_bytes(dev.region_read(2, 0x500 + 2 * reg, 2), "little") for reg in (1, 2, 3)]
    assert limits == [display.MAX_XRES, display.MAX_YRES, display.MAX_BPP]
    dev.region_write(2, 0x500 + 2 * 4, (0).to_bytes(2, "little"))
    assert int.from_bytes(dev.region_read(2, 0x500 + 2 * 1, 2), "little") == 0  # the mode's own again


# --- faults in the box (issue 17): what bochs-drm and the guest see ---------------------------------
# Remote only (a box's device is where the faults are armed); each test writes what it saw
# for docs/faults.md (dxpu_vfio.lab.fault_results).

remote_only = pytest.mark.parametrize("served", ["remote"], indirect=True, scope="module")


def bound_driver(vm, bdf: str) -> str:
    return vm.run(f"d=$(readlink /sys/bus/pci/devices/{bdf}/driver) && basename $d || echo none").stdout.strip()


def drm_log(vm) -> list[tuple[float, str]]:
    """The guest kernel's bochs/drm/fb lines since the last call, (its clock, the line),
    and clear."""
    out = []
    for line in vm.run("dmesg -c 2>/dev/null | grep -iE 'bochs|drm|fb' || true").stdout.splitlines():
        stamp, _, text = line.partition("] ")
        try:
            out.append((float(stamp.strip("[ ")), text.strip()))
        except ValueError:
            out.append((float("nan"), line.strip()))
    return out


def drm_lines(vm) -> list[str]:
    """As :func:`drm_log`, the lines only."""
    return [text for _, text in drm_log(vm)]


def probe_seconds(log: list[tuple[float, str]]) -> float | None:
    """The driver's probe by the guest kernel's clock: from enabling the device to its
    verdict on the DISPI ID (``Found bochs VGA`` or ``ID mismatch``)."""
    start = next((t for t, text in log if "enabling device" in text), None)
    end = next((t for t, text in log if "Found bochs VGA" in text or "ID mismatch" in text), None)
    return None if start is None or end is None else round(end - start, 3)


def wait_probed(vm, bdf: str, timeout: int = 60) -> str:
    """Until bochs-drm has bound the device and made /dev/fb0, or said why it would not
    (its ID check): the driver bound then (``none``)."""
    vm.run(f"i=0; while [ $i -lt {timeout * 10} ]; do [ -e /sys/bus/pci/devices/{bdf}/driver ] && [ -e /dev/fb0 ] "
           "&& break; dmesg | grep -q 'ID mismatch' && break; sleep 0.1; i=$((i+1)); done", timeout=timeout + 10)
    return bound_driver(vm, bdf)


def detach_left(*attachments) -> None:
    """Unplug what a fault test still has plugged (the module's guest is shared)."""
    for a in attachments:
        if a is not None and a.state is not hotplug.AttachmentState.DETACHED:
            hotplug.detach(a)


def plug_again(vm, dev, tries: int = 10):
    """Attach the box's display again; the box may hold the old link for a moment (EBUSY)."""
    for attempt in range(tries):
        try:
            return hotplug.attach(vm, **dev.attach_args())
        except hotplug.HotplugError:
            if attempt == tries - 1:
                raise
            time.sleep(1)


PROBE_FAULTS = {  # name: (kind, arm arguments, what it is)
    "display-abort": ("abort", {"count": 1}, "completer abort on the driver's first MMIO read (its ID check)"),
    "display-stall": ("stall", {"ms": 500, "count": 2},
                      "the driver's first 2 MMIO reads stalled 500 ms each (under the 1 s completion timeout)"),
    "display-stall-long": ("stall", {"ms": 3000, "count": 1},
                           "the driver's first MMIO read stalled 3 s (past the host's 1 s completion timeout)"),
}


@pytest.mark.vm
@remote_only
@pytest.mark.parametrize("name", list(PROBE_FAULTS))
def test_faulted_register_reads_at_the_drivers_probe(full_vm, served_device, lab_faults, name):
    """Faults armed before the plug hit bochs-drm's probe, whose first MMIO read is the
    DISPI ID: all-ones (an abort, or a master abort after a stall past the completion
    timeout) fails the ID check and the driver leaves the device alone, the VM fine; a
    stall under the timeout only delays the bind. A re-plug, the fault spent, binds (after
    the abort; a re-plug after a link down is the cut test's)."""
    dev = served_device
    kind, bounds, what = PROBE_FAULTS[name]
    faults = lab_faults(dev.lab, dev.box, dev.device)
    drm_lines(full_vm)
    before = faults.list()["hits"].get(dev.device, {})  # the lab is shared: count this test's hits only
    faults.arm(kind, "mmio-read", duration=600, **bounds)  # count ends it; a loaded TCG guest plugs slowly
    started = time.monotonic()
    att = hotplug.attach(full_vm, **dev.attach_args())
    again = None
    try:
        driver = wait_probed(full_vm, att.guest_bdf)
        probed_s = round(time.monotonic() - started, 1)
        link = (att.server.stats().get("device") or {}).get("link") or {}
        stamped = drm_log(full_vm)
        log, probe_s = [text for _, text in stamped], probe_seconds(stamped)
        alive = full_vm.guest_alive() and full_vm.run("echo alive").stdout == "alive\n"
        now = faults.list()["hits"].get(dev.device, {})
        hits = {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}
        record = {"device": "display", "mode": "remote", "fault": what,
                  "facts": {"driver bound": driver, "the probe's ID check took (s, guest clock)": probe_s,
                            "plug to probe outcome (s, host)": probed_s,
                            "host proxy's link": {k: link.get(k) for k in ("up", "down_reason") if k in link},
                            "box fault hits": hits}, "dmesg": log, "dmesg_of": "bochs/drm/fb lines"}
        recovery = None
        if name == "display-abort":  # the recovery: a re-plug (after a link down too: see the cut test)
            hotplug.detach(att)
            healed = time.monotonic()
            again = plug_again(full_vm, dev)
            record["facts"]["driver after a re-plug"] = wait_probed(full_vm, again.guest_bdf)
            mode = DisplayProbe.of(again, dev.lab, dev.box, dev.device).wait_mode(timeout=60)
            record["facts"]["mode after a re-plug"] = f"{mode['xres']}x{mode['yres']}"
            recovery = round(time.monotonic() - healed, 1)
        record.update({
            "driver": (f"bound and set its mode; its ID check took {probe_s} s" if driver == "bochs-drm" else
                       "refused the device: " + (" / ".join(line for line in log if "ID mismatch" in line)
                                                 or "no message") + "; no DRM card, no fbdev"),
            "application": f"{'a console on /dev/fb0' if driver == 'bochs-drm' else 'no display'}; VM up: {alive}",
            "recovery_s": 0 if driver == "bochs-drm" else recovery})
        fault_results.observe(name, record)
        assert alive, "the VM stopped answering"
        assert hits.get(f"{kind}:mmio-read") == bounds["count"], hits
        if name == "display-stall":
            assert driver == "bochs-drm" and probe_s is not None and probe_s >= 1.0, record  # 2 x 500 ms
        else:
            assert driver == "none" and any("ID mismatch" in line for line in log), record
        if name == "display-stall-long":
            assert record["facts"]["host proxy's link"]["up"] is False, record  # a master abort: down for good
        if name == "display-abort":
            assert record["facts"]["host proxy's link"]["up"] is True, record  # an answer, if an error one
            assert record["facts"]["driver after a re-plug"] == "bochs-drm", record
            assert record["facts"]["mode after a re-plug"] == "1024x768", record
    finally:
        detach_left(again, att)


@pytest.mark.vm
@remote_only
def test_a_cut_link_under_a_bound_display_goes_unnoticed_by_the_guest_and_a_replug_recovers(
        full_vm, served_device, lab_faults):
    """bochs-drm only writes (posted) once its mode is set, so a cut link costs the guest
    nothing it can see: writes to /dev/fb0 succeed, the driver stays bound, the kernel
    says nothing; the box reset its device when the link went (no mode, nothing shown).
    A re-plug (a new link) sets the mode again."""
    dev = served_device
    att = hotplug.attach(full_vm, **dev.attach_args())
    again = None
    try:
        probe = DisplayProbe.of(att, dev.lab, dev.box, dev.device)
        probe.wait_mode()
        faults = lab_faults(dev.lab, dev.box, dev.device, attachment=att)
        drm_lines(full_vm)
        faults.cut()
        deadline = time.monotonic() + 10
        while (att.server.stats().get("device") or {}).get("link", {}).get("up") is not False:
            assert time.monotonic() < deadline, "the host proxy did not see the link go"
            time.sleep(0.1)
        box_bytes = probe.state()["framebuffer_bytes"]
        wrote = full_vm.run("dd if=/dev/urandom of=/dev/fb0 bs=64k count=16 2>/tmp/fbcut.err; echo $?; "
                            "tail -1 /tmp/fbcut.err", timeout=60).stdout.split("\n", 1)
        driver = bound_driver(full_vm, att.guest_bdf)
        alive = full_vm.guest_alive() and full_vm.run("echo alive").stdout == "alive\n"
        box = probe.state()
        box_mode, box_took = box["mode"], box["framebuffer_bytes"] - box_bytes
        log = drm_lines(full_vm)
        hotplug.detach(att)
        cut_done = time.monotonic()
        again = plug_again(full_vm, dev)
        mode = DisplayProbe.of(again, dev.lab, dev.box, dev.device).wait_mode(timeout=60)
        recovery = round(time.monotonic() - cut_done, 1)
        facts = {"dd to /dev/fb0 after the cut": wrote[1].strip(), "dd rc": wrote[0].strip(),
                 "bytes of it the box's framebuffer took": box_took,
                 "driver after": driver, "box's device after (enabled, xres x yres)":
                 f"{box_mode.get('enabled')}, {box_mode.get('xres')}x{box_mode.get('yres')}",
                 "mode after a re-plug": f"{mode['xres']}x{mode['yres']}"}
        fault_results.observe("display-cut", {
            "device": "display", "mode": "remote", "fault": "link cut under a bound display (fbcon on it)",
            "driver": f"noticed nothing (driver {driver}; " + (" / ".join(log[:3]) or "no kernel message") + ")",
            "application": f"writes to /dev/fb0 succeed (dd rc {facts['dd rc']}) and go nowhere; VM up: {alive}; "
                           "a re-plug shows the console again",
            "recovery_s": recovery, "facts": facts, "dmesg": log, "dmesg_of": "bochs/drm/fb lines"})
        assert alive, "the VM stopped answering"
        assert facts["dd rc"] == "0" and driver == "bochs-drm", facts
        assert box_mode["enabled"] is False, f"the box kept the guest's mode after the link went: {box_mode}"
        assert box_took == 0, f"{box_took} bytes written after the cut reached the box"
        assert (mode["xres"], mode["yres"]) == (1024, 768)
    finally:
        detach_left(again, att)


@pytest.mark.vm
@remote_only
def test_surprise_removal_of_the_display_under_a_writer_then_device_del_and_a_replug(
        full_vm, served_device, lab_faults):
    """The box withdraws the display while a writer fills /dev/fb0; device_del follows
    after 1 s: bochs-drm lets go and the DRM card goes; the writer is not left hanging:
    it gets an error once /dev/fb0 goes, or, where the fbdev node outlives the card, its
    writes still land in fbdev's shadow buffer and it ends when told (dd with
    conv=nocreat: an earlier version's dd made a regular file /dev/fb0 once the node went,
    and "kept writing" into it, which then stood in the next display's way); the VM answers, the
    box no longer lists the display; the fault over, a re-plug brings the display back."""
    dev = served_device
    att = hotplug.attach(full_vm, **dev.attach_args())
    again = None
    try:
        DisplayProbe.of(att, dev.lab, dev.box, dev.device).wait_mode()
        faults = lab_faults(dev.lab, dev.box, dev.device, attachment=att)
        drm_lines(full_vm)
        full_vm.run("rm -f /tmp/fbw.rc /tmp/fbw.stop /tmp/fbw.i; (rc=0; i=0; while [ $i -lt 100000 ] && "
                    "[ ! -e /tmp/fbw.stop ]; do dd if=/dev/zero of=/dev/fb0 bs=64k count=48 conv=nocreat 2>/tmp/fbw.err "
                    "|| { rc=$?; break; }; i=$((i+1)); echo $i > /tmp/fbw.i; done; "
                    "echo \"$rc $i $(cut -d' ' -f1 /proc/uptime)\" > /tmp/fbw.rc) > /dev/null 2>&1 &")
        time.sleep(1)
        running = full_vm.run("[ -e /tmp/fbw.rc ] && echo ended || echo running").stdout.strip()
        t_removed = float(full_vm.run("cut -d' ' -f1 /proc/uptime").stdout)
        started = time.monotonic()
        faults.remove(grace=1.0, duration=120, unplug_timeout=60)  # returns once device_del is done
        unplugged_s = round(time.monotonic() - started, 1)
        listed = faults.listed()
        wait_rc = ("i=0; while [ ! -e /tmp/fbw.rc ] && [ $i -lt {n} ]; do sleep 0.1; i=$((i+1)); done; "
                   "cat /tmp/fbw.rc 2>/dev/null || echo none")
        by_itself = full_vm.run(wait_rc.format(n=80), timeout=40).stdout.split()  # 8 s
        progress = full_vm.run("a=$(cat /tmp/fbw.i 2>/dev/null || echo 0); sleep 1; "
                               "b=$(cat /tmp/fbw.i 2>/dev/null || echo 0); echo $((b - a))").stdout.strip()
        states = full_vm.run("for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null | grep -q "
                             "'^dd .*of=/dev/fb0' && echo \"$(cut -d' ' -f3 $p/stat):$(cat $p/wchan)\"; done; true"
                             ).stdout.split()
        full_vm.run("touch /tmp/fbw.stop")
        told = by_itself if by_itself != ["none"] else full_vm.run(wait_rc.format(n=300), timeout=60).stdout.split()
        said = full_vm.run("tr '\\n' ' ' < /tmp/fbw.err", check=False).stdout.strip()
        nodes = full_vm.run("for f in /dev/fb0 /dev/dri/card0; do [ -c $f ] && echo $f-present || "
                            "{ [ -e $f ] && echo $f-not-a-device || echo $f-gone; }; done").stdout.split()
        alive = full_vm.guest_alive() and full_vm.run("echo alive").stdout == "alive\n"
        log = drm_lines(full_vm)
        faults.clear()
        cleared = time.monotonic()
        again = plug_again(full_vm, dev)
        mode = DisplayProbe.of(again, dev.lab, dev.box, dev.device).wait_mode(timeout=60)
        recovery = round(time.monotonic() - cleared, 1)
        outcome = ("error" if by_itself != ["none"] and by_itself[0] != "0" else
                   "hung" if told == ["none"] else "kept writing")
        error_after = round(float(by_itself[2]) - t_removed, 1) if outcome == "error" else None
        facts = {"writer running at the removal": running == "running", "device_del done after (s)": unplugged_s,
                 "writer": outcome, "writer's rc, runs, guest clock": " ".join(told),
                 "writer's error after the removal (s)": error_after, "writer said": said[:120],
                 "dd runs a second after that wait": progress, "dd states": " ".join(states) or "none",
                 "nodes after": " ".join(nodes), "box's INVENTORY listed it while removed": listed,
                 "... and after the fault": faults.listed(), "mode after a re-plug": f"{mode['xres']}x{mode['yres']}"}
        application = {
            "error": f"an error (rc {by_itself[0]}, {said[:60]!r}) {error_after} s after the removal",
            "kept writing": (f"no error: writes to /dev/fb0 (still there: {nodes[0]}) kept succeeding into fbdev's "
                             f"shadow ({progress} dd runs a second), the writer ended when told"),
            "hung": "the writer HUNG"}[outcome]
        fault_results.observe("display-surprise-removal", {
            "device": "display", "mode": "remote",
            "fault": "surprise removal under a writer to /dev/fb0 (device_del 1 s later)",
            "driver": "let go at device_del: " + (" / ".join(log[:3]) or "no kernel message")
                      + f"; {' '.join(nodes)}",
            "application": f"{application}; VM up: {alive}; a re-plug brings the display back",
            "recovery_s": recovery, "facts": facts, "dmesg": log, "dmesg_of": "bochs/drm/fb lines"})
        assert running == "running", "the writer had ended before the removal"
        assert outcome != "hung", f"the writer hung: {facts}"
        assert nodes[1] == "/dev/dri/card0-gone", nodes
        if outcome == "error":
            assert "No such device" in said or "No such file" in said, facts
        assert alive, "the VM stopped answering"
        assert not listed and facts["... and after the fault"], "the box's INVENTORY did not follow the removal"
        assert (mode["xres"], mode["yres"]) == (1024, 768)
        assert nodes[0] != "/dev/fb0-not-a-device", nodes  # conv=nocreat: the writer made no file there
    finally:
        full_vm.run("touch /tmp/fbw.stop", check=False)
        detach_left(again, att)
