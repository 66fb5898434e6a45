"""A box's host-mappable framebuffer through the host proxy's shadow (no VM): a real
remote proxy process on loopback (TCP + mutual TLS), the host proxy in forward mode, and
our vfio-user client in QEMU's place, mapping the shadow's memfd as QEMU maps it."""

import mmap
import os
import signal
import socket
import struct
import threading
import time

import numpy as np
import pytest

from dxpu_vfio.hostproxy.forwarder import connect_remote
from dxpu_vfio.hostproxy.shadow import ShadowBar
from dxpu_vfio.lab.display_probe import png_pixels
from dxpu_vfio.link.transport import TlsFiles, make_certs
from dxpu_vfio.pool.boxes import fetch_screenshot
from dxpu_vfio.remoteproxy.process import RemoteProxyProcess
from dxpu_vfio.vfio_user import protocol as p
from dxpu_vfio.vfio_user.client import VfioUserClient
from dxpu_vfio.vfio_user.server import VfioUserServer

BOX = f"sbox{os.getpid()}"
FB = 16 << 20
W, H = 64, 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_box(d, name: str = BOX) -> RemoteProxyProcess:
    make_certs(d / "certs", ["host", name])
    port = free_port()
    config = d / f"{name}.toml"
    config.write_text(f'name = "{name}"\nlisten = "127.0.0.1"\nport = {port}\ntls_dir = "{d / "certs"}"\n'
                      '[[device]]\nid = "fb0"\nmodel = "display"\nlease = "lease-fb0"\n'
                      'settings = { mapped = true }\n')
    proc = RemoteProxyProcess(config).start()
    proc.address, proc.certs = f"127.0.0.1:{port}", d / "certs"
    return proc


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    proc = start_box(tmp_path_factory.mktemp("shadow"))
    yield proc
    proc.stop()


def plug(tmp_path, box, **settings):
    """(client, the shadow as the client mapped it, device, server)."""
    device = connect_remote(box.address, "fb0", "lease-fb0", TlsFiles.in_dir(box.certs, "host"), **settings)
    server = VfioUserServer(device, tmp_path / "host.sock", name="fwd").start()
    client = VfioUserClient(server.socket_path)
    client.negotiate()
    size, flags, offset, areas, fd = client.region_mapping(0)
    assert flags & p.REGION_FLAG_MMAP and (size, offset, areas) == (FB, 0, None)
    fb = mmap.mmap(fd, FB)
    os.close(fd)
    set_mode(client)
    return client, fb, device, server


@pytest.fixture
def shadowed(tmp_path, box):
    """A plugged shadow, write-back at 20 Hz."""
    client, fb, device, server = plug(tmp_path, box, writeback_hz=20)
    yield client, fb, device, server
    fb.close()
    client.close()
    server.stop()


def test_a_link_failure_leaves_the_guest_its_framebuffer(tmp_path):
    """The box dies: register reads master-abort within the completion timeout, but the
    guest's framebuffer (the shadow) still takes stores and reads, and the write-back
    neither raises nor sends."""
    own = start_box(tmp_path, f"dbox{os.getpid()}")
    client, fb, device, server = plug(tmp_path, own, writeback_hz=20, completion_timeout=0.5)
    try:
        draw(fb, 5)
        client.read(2, 0x500, 2)
        own.signal(signal.SIGKILL)
        deadline = time.monotonic() + 5
        while client.read(2, 0x500, 2) != b"\xff\xff":
            assert time.monotonic() < deadline, "register reads never master-aborted"
        sent = device.shadows[0].counters["bytes_sent"]
        fb[0:4] = b"\x01\x02\x03\x04"
        assert client.read(0, 0, 4) == b"\x01\x02\x03\x04"
        time.sleep(0.2)  # four periods
        assert device.shadows[0].counters["bytes_sent"] == sent and not device.link_up
    finally:
        fb.close()
        client.close()
        server.stop()
        own.stop()


def set_mode(client) -> None:
    for reg, value in ((4, 0), (3, 32), (1, W), (2, H), (6, W), (9, 0), (4, 0x41)):
        client.write(2, 0x500 + 2 * reg, value.to_bytes(2, "little"))


def writes_posted(device) -> int:
    posted = device.endpoint.stats()["posted"]
    return posted.get("REGION_WRITE", 0) + posted.get("WRITE_BATCH", 0)


def box_pixels(box) -> bytes:
    w, h, rgb = png_pixels(fetch_screenshot(box.address, str(box.certs), "fb0"))
    assert (w, h) == (W, H)
    return rgb


def draw(fb, seed: int) -> bytes:
    """A frame of pixel value seed + y at every pixel of line y; its RGB as the box renders it."""
    rgb = b""
    for y in range(H):
        value = (seed * 7919 + y * 131) & 0xFFFFFF
        fb[y * W * 4:(y + 1) * W * 4] = struct.pack("<I", value) * W
        rgb += bytes([(value >> 16) & 255, (value >> 8) & 255, value & 255]) * W
    return rgb


def test_stores_reach_the_box_at_the_next_register_access_and_a_static_screen_costs_nothing(box, shadowed):
    client, fb, device, _ = shadowed
    want = draw(fb, 1)
    client.read(2, 0x500, 2)  # a non-posted access: the shadow's changes go first
    assert box_pixels(box) == want
    shadow = device.shadows[0]
    time.sleep(0.2)  # a few periods: everything sent
    sent = dict(shadow.counters)
    posted = writes_posted(device)
    time.sleep(0.5)  # ten periods of a static screen
    assert shadow.counters["bytes_sent"] == sent["bytes_sent"] and shadow.counters["periodic"] > sent["periodic"]
    assert writes_posted(device) == posted  # heartbeats only
    draw(fb, 2)
    client.read(2, 0x500, 2)
    assert shadow.counters["bytes_sent"] - sent["bytes_sent"] == H * W * 4 // 4096 * 4096  # the changed pages only


def test_accesses_of_the_bar_that_reach_the_host_proxy_are_served_by_the_shadow(box, shadowed):
    """QEMU maps the BAR, but an access it still sends (a failed mmap, x-no-mmap) is the
    shadow's: a read never crosses the link, a write leaves with the next flush."""
    client, fb, device, _ = shadowed
    fb[0:4] = b"\x11\x22\x33\x44"
    reads = device.stats()["reads"]
    assert client.read(0, 0, 4) == b"\x11\x22\x33\x44" and device.stats()["reads"] == reads
    client.write(0, 4, b"\x55\x66\x77\x00")
    assert fb[4:8] == b"\x55\x66\x77\x00"
    client.read(2, 0x500, 2)
    assert box_pixels(box)[3:6] == bytes([0x77, 0x66, 0x55])  # pixel 1 (BGRX in memory)


def test_the_box_follows_within_a_period_without_any_access(box, shadowed):
    """The periodic write-back alone (20 Hz here): the box shows the frame within two periods."""
    _, fb, device, _ = shadowed
    want = draw(fb, 3)
    written = time.monotonic()
    while box_pixels(box) != want:
        assert time.monotonic() - written < 2 * 0.05 + 0.5, "the box never showed the frame"
        time.sleep(0.005)
    assert device.shadows[0].last_sent - written < 2 * 0.05


def test_unplug_flushes_the_last_frame(box, shadowed):
    """With the periodic write-back stopped, only the session's end (QEMU's unplug: a reset)
    can carry the frame; a replug that sets the mode again, and sends nothing more, shows it."""
    client, fb, device, server = shadowed
    shadow = device.shadows[0]
    shadow._stop.set()
    shadow._thread.join(2)
    client.read(2, 0x500, 2)
    before = shadow.counters["bytes_sent"]
    want = draw(fb, 4)
    client.close()  # QEMU goes: the session ends with a reset, which flushes first
    assert server.wait_idle(5)
    after = shadow.counters["bytes_sent"]
    assert after - before == H * W * 4
    again = VfioUserClient(server.socket_path)
    try:
        again.negotiate()
        set_mode(again)
        assert box_pixels(box) == want and shadow.counters["bytes_sent"] == after
    finally:
        again.close()


def test_the_write_back_waits_for_the_box_without_holding_the_device(tmp_path, box):
    """The periodic write-back of whole frames waits for the box to catch up (a SYNC after
    each posted-bytes window) without the device's lock: the vfio-user session thread reads
    the link for everyone and may be waiting for that lock (QEMU's register read), and the
    SYNC's completion would then reach no one until its timeout took the link down (as
    `dxpu demo` did while QEMU was still probing the display)."""
    client, fb, device, server = plug(tmp_path, box, writeback_hz=60)
    try:
        rng = np.random.default_rng(7)
        frames = [rng.integers(0, 256, FB, np.uint8).tobytes() for _ in range(2)]
        for n in range(12):
            fb[:] = frames[n % 2]  # every page changes: 16 MiB for the next flush, four windows
            time.sleep(1 / 60)  # the periodic flush is under way
            started = time.monotonic()
            client.read(2, 0x500, 2)
            assert device.link_up, f"frame {n}: {device.endpoint.down_reason}"
            assert time.monotonic() - started < 0.9, f"frame {n}: a register read waited for the write-back"
        assert box_pixels(box) == _rgb(frames[1])
        assert device.shadows[0].counters["periodic"] > 0 and device.endpoint.timeouts == 0
    finally:
        fb.close()
        client.close()
        server.stop()


def _rgb(frame: bytes) -> bytes:
    """The box's rendering (RGB) of the W x H top-left of a BGRX frame."""
    px = np.frombuffer(frame[:W * H * 4], np.uint8).reshape(-1, 4)
    return px[:, [2, 1, 0]].tobytes()


def test_snapshot_compare_finds_exactly_the_changed_pages():
    sent = []
    shadow = ShadowBar(0, FB, lambda runs: sent.extend((o, bytes(d)) for _, o, d in runs), threading.RLock(),
                       rate_hz=0)
    try:
        assert shadow.flush() == FB and sum(len(d) for _, d in sent) == FB  # a new link: all of it
        sent.clear()
        assert shadow.flush() == 0 and not sent  # nothing changed
        shadow.write(4096 * 10 + 5, b"x")
        shadow.write(4096 * 11, b"y")
        shadow.write(FB - 1, b"z")
        assert shadow.flush() == 3 * 4096
        assert [(o, len(d)) for o, d in sent] == [(4096 * 10, 8192), (FB - 4096, 4096)]
        assert sent[0][1][5:6] == b"x" and sent[1][1][-1:] == b"z"
        shadow.resend_all()
        assert shadow.flush() == FB
    finally:
        shadow.close()


def test_scan_cost_of_a_static_16_mib_framebuffer():
    """What one write-back period costs when nothing changed (printed; bounded loosely)."""
    shadow = ShadowBar(0, FB, lambda runs: None, threading.RLock(), rate_hz=0)
    try:
        shadow.flush()
        np.frombuffer(shadow.memory.buf, np.uint8)[::4096] = 1  # every page touched once
        shadow.flush()
        times = []
        for _ in range(10):
            t = time.perf_counter()
            shadow.flush()
            times.append(time.perf_counter() - t)
        median = sorted(times)[5]
        print(f"static 16 MiB scan: {median * 1000:.2f} ms")
        assert median < 0.05
    finally:
        shadow.close()
