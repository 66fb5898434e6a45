"""Issue 18 item 8: a box's replies and its device description are checked against what
was asked and what the device described, never trusted. Fake boxes on loopback
(tests/hostile_box.py) against the manager's box client and the host proxy (its link and
vfio-user server, our client in QEMU's place); the host side runs over both link streams."""

from __future__ import annotations

import errno
import json
import random
import struct
import threading
import time

import pytest
from fakes import map_guest_memory
from hostile_box import TESTDEV, DeviceBox, HostileBox, reply

from dxpu_vfio.hostproxy.forwarder import RemoteAttachError, connect_remote
from dxpu_vfio.link.protocol import FEATURE_DMA_READV, FEATURE_DMA_WRITEV, READV_HEAD, READV_RANGE, LinkCommand
from dxpu_vfio.pool.boxes import MAX_SCREENSHOT, BoxUnreachable, fetch_inventory, fetch_screenshot
from dxpu_vfio.vfio_user import protocol as vp
from dxpu_vfio.vfio_user.client import ClientError, VfioUserClient
from dxpu_vfio.vfio_user.connection import ConnectionClosed
from dxpu_vfio.vfio_user.server import VfioUserServer

GUEST, MEM = 0x100000, 1 << 20


# --- the manager's box client (pool/boxes.py) ---------------------------------------------

class ScreenshotBox(HostileBox):
    """Answers every SCREENSHOT request with ``piece(n)`` (n: pieces sent so far), counting them."""

    def __init__(self, piece) -> None:
        self.piece, self.sent = piece, 0
        super().__init__(self._serve)

    def _serve(self, conn, msg) -> None:
        while msg.header.command == LinkCommand.SCREENSHOT and self.sent < 200:
            reply(conn, msg, self.piece(self.sent))
            self.sent += 1
            msg = conn.receive()


def piece(total: int, size: int = 1 << 20) -> bytes:
    return total.to_bytes(8, "little") + b"\x89" * size


@pytest.mark.parametrize("case, answer, error", [
    ("offers more than the cap", lambda n: piece(1 << 62), "offered a screenshot of .* at most"),
    ("total grows with every piece", lambda n: piece((n + 2) << 20), "disagree on the size"),
    ("sends more than it offered", lambda n: piece((3 << 20) + 5), "more screenshot than"),
    ("empty pieces for ever", lambda n: (5 << 20).to_bytes(8, "little"), "ended the screenshot at 0 of"),
    ("a piece without its size", lambda n: b"\x01\x02", "a piece of 2 bytes"),
])
def test_an_endless_or_oversized_screenshot_is_refused_early(case, answer, error):
    box = ScreenshotBox(answer)
    try:
        with pytest.raises(BoxUnreachable, match=error):
            fetch_screenshot(box.address, None, "fb0", timeout=10)
        assert box.sent <= 4, f"the manager took {box.sent} MiB of a screenshot that was never going to end"
    finally:
        box.close()


@pytest.mark.parametrize("code, says", [(errno.ENODEV, "no such device"),
                                        (errno.EIO, r"Input/output error \(errno 5\)"), (0xFFFF, "error code 65535")])
def test_a_refused_screenshot_says_what_the_box_answered(code, says):
    """An error reply names its errno in words (those a box means something by, else the
    system's), never a bare number."""
    box = HostileBox(lambda conn, msg: conn.send(vp.error_reply(msg.header.msg_id, msg.header.command, code)))
    try:
        with pytest.raises(BoxUnreachable, match=f"refused the screenshot request: {says}"):
            fetch_screenshot(box.address, None, "fb0", timeout=10)
    finally:
        box.close()


def test_a_trickled_screenshot_is_cut_at_its_deadline():
    def trickle(conn, msg):
        head = vp.message(msg.header.msg_id, msg.header.command, piece(1 << 20), reply=True)
        for i in range(0, len(head), 64):
            conn.sock.sendall(head[i:i + 64])
            time.sleep(0.05)
    box = HostileBox(trickle)
    try:
        started = time.monotonic()
        with pytest.raises(BoxUnreachable, match="within 1.0 s"):
            fetch_screenshot(box.address, None, "fb0", timeout=1.0)
        assert time.monotonic() - started < 3
    finally:
        box.close()


def test_an_honest_screenshot_of_the_largest_size_still_comes_whole():
    total = MAX_SCREENSHOT
    box = ScreenshotBox(lambda n: piece(total, min(1 << 20, total - (n << 20))))
    try:
        assert len(fetch_screenshot(box.address, None, "fb0", timeout=30)) == total
    finally:
        box.close()


def device(**fields) -> dict:
    return {"id": "td0", "class": "testdev", "vendor": "1b36", "model": "10f0", "capacity": 4096,
            "in_use": False, **fields}


@pytest.mark.parametrize("inventory, error", [
    ({"box": "b", "devices": [device(capacity="lots")]}, "'capacity' must be an integer"),
    ({"box": "b", "devices": [device(capacity=True)]}, "'capacity' must be an integer"),
    ({"box": "b", "devices": [{k: v for k, v in device().items() if k != "vendor"}]}, "'vendor' must be a string"),
    ({"box": "b", "devices": [device(id=["td0"])]}, "'id' must be a string"),
    ({"box": "b", "devices": [device(), device()]}, "appears twice"),
    ({"box": "b", "devices": [device(id=f"d{i}") for i in range(2000)]}, "2000 devices; at most 1024"),
    ({"box": ["b"], "devices": []}, "no box name"),
    ({"box": "b", "devices": [7]}, "device 0 is not an object"),
])
def test_an_inventory_is_checked_before_the_manager_keeps_it(inventory, error):
    box = HostileBox(lambda conn, msg: reply(conn, msg, json.dumps(inventory).encode()))
    try:
        with pytest.raises(BoxUnreachable, match=f"bad inventory: .*{error}"):
            fetch_inventory(box.address, None)
    finally:
        box.close()


def test_an_oversized_inventory_reply_is_refused_before_it_is_read():
    sent = []

    def endless(conn, msg):  # a header that says 1 GiB, then bytes for as long as we take them
        conn.sock.sendall(vp.HEADER.pack(msg.header.msg_id, msg.header.command, 1 << 30, vp.TYPE_REPLY, 0))
        while len(sent) < 256:
            conn.sock.sendall(b"\0" * (1 << 20))
            sent.append(1)
    box = HostileBox(endless)
    try:
        with pytest.raises(BoxUnreachable, match="bad inventory: message size 1073741824 exceeds"):
            fetch_inventory(box.address, None)
        assert len(sent) < 16
    finally:
        box.close()


# --- the host proxy (hostproxy/forwarder.py, vfio_user/server.py, native/forward.c) -------------

@pytest.mark.parametrize("change, error", [
    ({"irqs": {**TESTDEV["irqs"], "nmi": 1}}, "interrupt 'nmi'"),
    ({"irqs": {"msi": 4096}}, "'msi' with 4096 vectors"),
    ({"regions": TESTDEV["regions"][:3]}, "3 regions; vfio-user has 9"),
    ({"regions": [TESTDEV["regions"][1], TESTDEV["regions"][0], *TESTDEV["regions"][2:]]}, "region 0 is numbered 1"),
    ({"regions": [[0, -4096, True, True], *TESTDEV["regions"][1:]]}, "region 0: size -4096"),
    ({"regions": [*TESTDEV["regions"][:7], [7, 12, True, True], TESTDEV["regions"][8]]}, "configuration space of 12"),
    ({"regions": "all of them"}, "regions"),
    ({"mappable": [7]}, "mappable region 7: only BARs 0-5"),
    ({"mappable": [1]}, "mappable region 1 of 0 bytes"),  # the test device has no BAR1
    ({"mappable": "0"}, "mappable regions '0' are not a list"),
])
def test_a_device_description_the_server_cannot_serve_refuses_the_device(stream, change, error):
    box = DeviceBox({**TESTDEV, **change})
    try:
        with pytest.raises(RemoteAttachError, match=error) as refused:
            connect_remote(box.address, "td0", "t", None, timeout=3)
        assert refused.value.errno == errno.EPROTO
    finally:
        box.close()


class BadIrqs:
    """A device whose interrupt names the server does not know (as a box described once)."""

    lock = threading.RLock()
    event_source = None
    native_forward = None
    coalesce_posted = False
    wants_dma_windows = False
    attach_error = None

    def close(self) -> None:
        pass

    def irq_counts(self) -> dict:
        return {"msi": 1, "nmi": 1}

    def attach(self, dma, irq) -> None:
        pass


def test_a_session_the_server_cannot_build_is_refused_and_the_next_client_is_accepted(tmp_path):
    server = VfioUserServer(BadIrqs(), tmp_path / "bad.sock", name="bad").start()
    try:
        for _ in range(2):
            with pytest.raises((ClientError, ConnectionClosed)):  # closed at once, not left without a reply
                VfioUserClient(server.socket_path, timeout=2).negotiate()
        assert server._accept_thread.is_alive() and server.rejected_connections == 2
    finally:
        server.stop()


@pytest.fixture
def host(tmp_path, stream):
    """A hostile box, the host proxy linked to it, our client in QEMU's place with guest RAM."""
    box = DeviceBox()
    device = connect_remote(box.address, "td0", "t", None, completion_timeout=0.5)
    server = VfioUserServer(device, tmp_path / "host.sock", name="fwd").start()
    client = VfioUserClient(server.socket_path)
    ram = map_guest_memory(client, GUEST, MEM)
    assert box.linked.wait(2)
    yield box, device, server, client, ram
    client.close()
    server.stop()
    ram.close()
    box.close()


@pytest.mark.parametrize("case, answer", [
    ("twice the bytes", lambda req: vp.RegionAccess(req.region, req.offset, req.count * 2, b"\x11" * req.count * 2).pack()),
    ("half the bytes", lambda req: vp.RegionAccess(req.region, req.offset, req.count // 2, b"\x11" * (req.count // 2)).pack()),
    ("another offset", lambda req: vp.RegionAccess(req.region, req.offset + 4, req.count, b"\x11" * req.count).pack()),
    ("another region", lambda req: vp.RegionAccess(2, req.offset, req.count, b"\x11" * req.count).pack()),
    ("unframed", lambda req: b"\x01\x02\x03"),
])
def test_a_read_answered_with_something_else_never_reaches_qemu_and_breaks_the_link(host, case, answer):
    box, device, _, client, _ = host
    assert client.read(0, 0x08, 4) == b"\x5a" * 4
    box.answer_read = answer
    got = client.read(0, 0x08, 4)
    assert got == b"\xff" * 4, f"QEMU was handed {got!r} for a read of 4 bytes"
    assert not device.link_up, "the link that answered another access is still trusted"
    assert device.stats()["bad_completions"] >= 1
    assert client.read(0, 0x08, 4) == b"\xff" * 4  # from now on: a device that fell off the bus


def test_the_box_dma_is_refused_while_bus_master_enable_is_off(host):
    box, device, server, client, ram = host
    ram[0:8] = b"\0" * 8
    box.dma_write(GUEST, b"written!")
    read = box.dma_read(GUEST, 8)
    assert read.header.is_error and read.header.error == errno.EFAULT
    assert ram[0:8] == b"\0" * 8, "the box wrote guest memory while the guest had Bus Master Enable off"
    assert server.snapshot()["dma"]["refused"] >= 2
    client.write(vp.REGION_CONFIG, 4, (6).to_bytes(2, "little"))  # memory + bus master on
    box.dma_write(GUEST, b"written!")
    read = box.dma_read(GUEST, 8)
    assert not read.header.is_error and bytes(read.payload[16:]) == b"written!"
    assert ram[0:8] == b"written!"
    client.write(vp.REGION_CONFIG, 4, (2).to_bytes(2, "little"))  # bus master off again
    box.dma_write(GUEST, b"too late")
    assert box.dma_read(GUEST, 8).header.is_error and ram[0:8] == b"written!"
    client.write(vp.REGION_CONFIG, 4, (6).to_bytes(2, "little"))
    client.reset()  # a reset turns it off, as on the device
    assert box.dma_read(GUEST, 8).header.is_error


# --- DMA_READV: a box's scatter-list reads (link/protocol.py) ---------------------------------

def readv(*ranges: tuple[int, int]) -> bytes:
    return READV_HEAD.pack(len(ranges), 0) + b"".join(READV_RANGE.pack(a, n, 0) for a, n in ranges)


def test_the_host_offers_dma_readv_and_answers_a_scatter_list_with_its_bytes_in_order(host):
    box, device, server, client, ram = host
    assert FEATURE_DMA_READV in box.features
    ram[:] = bytes(range(256)) * (MEM // 256)
    client.write(vp.REGION_CONFIG, 4, (6).to_bytes(2, "little"))
    ranges = [(GUEST + 0x3000, 100), (GUEST, 4096), (GUEST + MEM - 1, 1), (GUEST + 0x10001, 8191)]
    got = box.dma_readv(readv(*ranges))
    assert not got.header.is_error
    assert bytes(got.payload) == b"".join(ram[a - GUEST:a - GUEST + n] for a, n in ranges)
    whole = box.dma_readv(readv(*[(GUEST + i * 4096, 4096) for i in range(256)]))  # the largest: 1 MiB
    assert bytes(whole.payload) == bytes(ram)
    assert server.snapshot()["dma"]["bytes_read"] >= sum(n for _, n in ranges) + MEM


@pytest.mark.parametrize("case, payload", [
    ("shorter than its head", b"\x01\x00"),
    ("no ranges", READV_HEAD.pack(0, 0)),
    ("more ranges than allowed", READV_HEAD.pack(257, 0) + READV_RANGE.pack(GUEST, 1, 0) * 257),
    ("a count the payload disagrees with", READV_HEAD.pack(3, 0) + READV_RANGE.pack(GUEST, 8, 0) * 2),
    ("an empty range", readv((GUEST, 8), (GUEST + 64, 0))),
    ("a range that wraps", readv((GUEST, 8), ((1 << 64) - 4, 8))),
    ("more than one reply holds", readv((GUEST, 8192), *[(GUEST, 4096)] * 255)),
    ("a range outside the windows", readv((GUEST, 8), (GUEST + MEM, 8))),
    ("a range past a window's end", readv((GUEST + MEM - 4, 8))),
])
def test_a_malformed_or_rogue_dma_readv_is_an_error_reply_and_the_link_serves_on(host, case, payload):
    box, device, server, client, ram = host
    ram[0:8] = b"intact!!"
    client.write(vp.REGION_CONFIG, 4, (6).to_bytes(2, "little"))
    got = box.dma_readv(payload)
    assert got.header.is_error, f"{case}: answered with {len(got.payload)} bytes"
    rogue = case.startswith("a range") and "wraps" not in case
    assert got.header.error == (errno.EFAULT if rogue else errno.EINVAL), case
    assert device.link_up and client.read(0, 0x08, 4) == b"\x5a" * 4
    assert bytes(box.dma_readv(readv((GUEST, 8))).payload) == b"intact!!"


def test_random_dma_readv_payloads_get_an_answer_each_and_the_link_serves_on(host):
    """A small fuzz of the host's DMA_READV parser (forward.c and Python's): mutated scatter
    lists, each answered (data of the right size, or an error), never a dead link."""
    box, device, server, client, ram = host
    client.write(vp.REGION_CONFIG, 4, (6).to_bytes(2, "little"))
    rng = random.Random(13)
    for _ in range(300):
        ranges = [(GUEST + rng.randrange(MEM), rng.choice((1, 8, 4096, rng.randrange(1, 1 << 16))))
                  for _ in range(rng.randint(1, 8))]
        payload = bytearray(readv(*ranges))
        for _ in range(rng.randint(0, 3)):
            payload[rng.randrange(len(payload))] = rng.randrange(256)
        if rng.random() < 0.2:
            payload = payload[:rng.randrange(len(payload) + 1)]
        got = box.dma_readv(bytes(payload))
        if not got.header.is_error:
            count = struct.unpack_from("<I", payload)[0]
            asked = sum(struct.unpack_from("<I", payload, 8 + 16 * i + 8)[0] for i in range(count))
            assert len(got.payload) == asked
    assert device.link_up and client.read(0, 0x08, 4) == b"\x5a" * 4


# --- DMA_WRITEV: a box's scatter-list writes (link/protocol.py) --------------------------------

def test_the_host_offers_dma_writev_and_writes_a_scatter_list_where_its_ranges_say(host):
    box, device, server, client, ram = host
    assert FEATURE_DMA_WRITEV in box.features
    client.write(vp.REGION_CONFIG, 4, (6).to_bytes(2, "little"))
    ranges = [(GUEST + 0x3000, 100), (GUEST, 4096), (GUEST + MEM - 1, 1), (GUEST + 0x10001, 8191)]
    data = [bytes([i + 1]) * n for i, (_, n) in enumerate(ranges)]
    box.dma_writev(readv(*ranges) + b"".join(data))
    box.dma_read(GUEST, 1)  # non-posted: answered after the write before it was done
    for (a, n), d in zip(ranges, data):
        assert ram[a - GUEST:a - GUEST + n] == d
    assert ram[0x1000:0x3000] == bytes(0x2000)  # between the ranges: untouched
    box.dma_writev(readv(*[(GUEST + i * 4096, 4092) for i in range(256)]) + b"\x77" * (4092 * 256))  # the largest
    box.dma_read(GUEST, 1)
    assert ram[0:4092] == b"\x77" * 4092 and ram[MEM - 4096:MEM - 4] == b"\x77" * 4092


@pytest.mark.parametrize("case, payload", [
    ("shorter than its head", b"\x01\x00"),
    ("no ranges", READV_HEAD.pack(0, 0)),
    ("more ranges than allowed", READV_HEAD.pack(257, 0) + READV_RANGE.pack(GUEST, 1, 0) * 257 + b"\xee" * 257),
    ("a count the payload disagrees with", READV_HEAD.pack(3, 0) + READV_RANGE.pack(GUEST, 8, 0) * 2 + b"\xee" * 24),
    ("fewer bytes than the ranges", readv((GUEST, 8), (GUEST + 64, 8)) + b"\xee" * 12),
    ("more bytes than the ranges", readv((GUEST, 8)) + b"\xee" * 9),
    ("an empty range", readv((GUEST, 8), (GUEST + 64, 0)) + b"\xee" * 8),
    ("a range that wraps", readv((GUEST, 8), ((1 << 64) - 4, 8)) + b"\xee" * 16),
    ("a range outside the windows", readv((GUEST, 8), (GUEST + MEM, 8)) + b"\xee" * 16),
    ("a range past a window's end", readv((GUEST, 8), (GUEST + MEM - 4, 8)) + b"\xee" * 16),
])
def test_a_malformed_or_rogue_dma_writev_writes_nothing_and_the_link_serves_on(host, case, payload):
    """Checked whole before anything is written: the first range is good, and it is still
    not written when another is wrong (both in forward.c and in Python)."""
    box, device, server, client, ram = host
    ram[0:8] = b"intact!!"
    client.write(vp.REGION_CONFIG, 4, (6).to_bytes(2, "little"))
    box.dma_writev(payload)
    assert bytes(box.dma_read(GUEST, 8).payload)[16:] == b"intact!!", case
    assert ram[0:8] == b"intact!!" and ram[64:72] == bytes(8)
    assert device.link_up and client.read(0, 0x08, 4) == b"\x5a" * 4


def test_random_dma_writev_payloads_never_write_outside_the_windows_or_break_the_link(host):
    """A small fuzz of the host's DMA_WRITEV parser (forward.c and Python's): mutated
    scatter lists (the bytes after them left alone) and sizes; guest memory only ever gets
    bytes the box sent (0xab), the link serves on."""
    box, device, server, client, ram = host
    client.write(vp.REGION_CONFIG, 4, (6).to_bytes(2, "little"))
    rng = random.Random(17)
    for _ in range(300):
        ranges = [(GUEST + rng.randrange(MEM), rng.choice((1, 8, 4096, rng.randrange(1, 1 << 14))))
                  for _ in range(rng.randint(1, 8))]
        head = readv(*ranges)
        payload = bytearray(head + b"\xab" * sum(n for _, n in ranges))
        for _ in range(rng.randint(0, 3)):
            payload[rng.randrange(len(head))] = rng.randrange(256)
        if rng.random() < 0.2:
            payload = payload[:rng.randrange(len(payload) + 1)]
        box.dma_writev(bytes(payload))
    assert not box.dma_read(GUEST, 8).header.is_error
    assert set(bytes(ram)) == {0, 0xab} and device.link_up and client.read(0, 0x08, 4) == b"\x5a" * 4
