"""The host's C forwarder (native/forward.c) pushing a watched ring's entries and what they
point to, driven directly: this test is QEMU on one socket and the box on the other, guest
memory a memfd window (kind 0) and a file window (kind 1). What the box gets is parsed with
the same ``unpack_push`` the box uses. Runs under ASan/UBSan in ``scripts/sanitize.sh``."""

from __future__ import annotations

import mmap
import os
import socket
import struct
import threading

import pytest

from dxpu_vfio.link.protocol import MAX_POINTED, LinkCommand, Push, unpack_push
from dxpu_vfio.native import stream as native_stream
from dxpu_vfio.vfio_user import protocol as vp

MEM, FILE, WRITE_ONLY = 0x1_0000_0000, 0x2_0000_0000, 0x3_0000_0000  # the windows' guest addresses
SIZE = 1 << 20
RING, ENTRIES, ES, DOORBELL = MEM, 16, 64, 0x1008  # an NVMe-like SQ in the memfd window
POINTER, BYTES = 32, 256                              # PRP2, a 128 KiB transfer's list


class Harness:
    """A Forwarder between this test's ends; ``doorbell(tail)`` returns the push it sent."""

    def __init__(self, tmp_path) -> None:
        module = native_stream.require()
        qemu_end, proxy_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with socket.create_server(("127.0.0.1", 0)) as listener:
            self.box = socket.create_connection(listener.getsockname())
            link_end, _ = listener.accept()
        self.qemu = qemu_end
        self.qemu_conn = native_stream.unix(proxy_end)
        self.link_conn = native_stream.tcp(link_end, None, True, 5.0)
        self.box_conn = native_stream.tcp(self.box, None, False, 5.0)
        self.forwarder = module.Forwarder(self.qemu_conn.stream, self.link_conn.stream, 1.0)
        fd = os.memfd_create("guest-ram", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, SIZE)
        self.ram = mmap.mmap(fd, SIZE)
        os.close(fd)
        self.file = open(tmp_path / "window", "w+b")
        self.file.truncate(SIZE)
        rw = vp.DMA_FLAG_READ | vp.DMA_FLAG_WRITE
        self.forwarder.set_windows([(MEM, SIZE, rw, 0, self.ram, 0), (FILE, SIZE, rw, 1, self.file.fileno(), 0),
                                    (WRITE_ONLY, SIZE, vp.DMA_FLAG_WRITE, 0, self.ram, 0)])
        self.forwarder.set_ring(3, 0, DOORBELL, RING, ES, ENTRIES, 0, POINTER, BYTES)
        self.thread = threading.Thread(target=self.forwarder.serve, daemon=True)
        self.thread.start()

    def entries(self, first: int, pointers: list[int]) -> None:
        for i, p in enumerate(pointers):
            struct.pack_into("<Q", self.ram, (first + i) * ES + POINTER, p)

    def doorbell(self, tail: int) -> Push:
        payload = struct.pack("<QII", DOORBELL, 0, 4) + struct.pack("<I", tail)
        self.qemu.sendall(vp.message(7, vp.Command.REGION_WRITE, payload, no_reply=True))
        push = self.box_conn.receive(timeout=5)
        assert push.header.command == LinkCommand.DMA_PUSH, push.header
        assert self.box_conn.receive(timeout=5).header.command == vp.Command.REGION_WRITE
        return unpack_push(push.payload)

    def close(self) -> None:
        self.qemu.close()
        self.box_conn.close()
        self.thread.join(5)
        self.link_conn.close()
        self.qemu_conn.close()
        self.file.close()


@pytest.fixture
def harness(tmp_path):
    if not native_stream.built():
        pytest.fail("the native link stream is not built: run scripts/setup.sh")
    h = Harness(tmp_path)
    yield h
    h.close()


def test_each_entrys_pointer_brings_its_bytes_clipped_at_the_page_and_a_null_one_nothing(harness):
    harness.ram[0x8000:0x8100] = b"\x11" * 256                    # a whole list in the memfd
    harness.ram[0x9FC0:0xA000] = b"\x22" * 64                     # 64 bytes left in its page
    with open(harness.file.name, "r+b") as f:                     # a list behind a file window
        f.seek(0x3000)
        f.write(b"\x33" * 256)
    harness.entries(0, [MEM + 0x8000, 0, MEM + 0x9FC0, FILE + 0x3000])
    push = harness.doorbell(4)
    assert push.ranges == [(RING, 4 * ES)] and not push.pointed_unknown
    assert [(a, bytes(d)) for a, d in push.pointed] == [
        (MEM + 0x8000, b"\x11" * 256), (MEM + 0x9FC0, b"\x22" * 64), (FILE + 0x3000, b"\x33" * 256)]
    assert harness.forwarder.counters()["pointed"] == 3


def test_a_pointer_outside_the_windows_is_an_empty_range_and_too_many_are_unknown(harness):
    harness.entries(0, [0xDEAD_0000, WRITE_ONLY + 0x8000, MEM + SIZE - 8])  # nowhere; no read rights; the end
    push = harness.doorbell(3)
    assert [(a, len(d)) for a, d in push.pointed] == [(0xDEAD_0000, 0), (WRITE_ONLY + 0x8000, 0), (MEM + SIZE - 8, 8)]
    # a ring of 16 cannot announce more than 15 at once: a second ring with room for more
    harness.forwarder.set_ring(4, 0, DOORBELL + 8, MEM + 0x10000, ES, 256, 0, POINTER, BYTES)
    harness.ram[0x10000:0x10000 + 100 * ES] = bytes(100 * ES)  # (ring 3's tail is 3 now: no push for it)
    for i in range(MAX_POINTED + 1):
        struct.pack_into("<Q", harness.ram, 0x10000 + i * ES + POINTER, MEM + 0x8000)
    payload = struct.pack("<QII", DOORBELL + 8, 0, 4) + struct.pack("<I", MAX_POINTED + 1)
    harness.qemu.sendall(vp.message(8, vp.Command.REGION_WRITE, payload, no_reply=True))
    push = unpack_push(harness.box_conn.receive(timeout=5).payload)
    assert push.slot == 4 and push.pointed == [] and push.pointed_unknown
    assert push.ranges == [(MEM + 0x10000, (MAX_POINTED + 1) * ES)]


def test_a_ring_watched_without_a_pointer_pushes_entries_only(harness):
    harness.forwarder.set_ring(3, 0, DOORBELL, RING, ES, ENTRIES, 0)
    harness.entries(0, [MEM + 0x8000])
    push = harness.doorbell(1)
    assert push.ranges == [(RING, ES)] and push.pointed == [] and not push.pointed_unknown


@pytest.mark.parametrize("offset, size", [(60, 256), (32, 4097)])
def test_a_pointer_the_forwarder_cannot_honour_is_refused(harness, offset, size):
    with pytest.raises(ValueError, match="pointer"):
        harness.forwarder.set_ring(5, 0, 0x2000, RING, ES, ENTRIES, 0, offset, size)
