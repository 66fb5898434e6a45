"""The host's C forwarder (native/forward.c) driven directly: this test is QEMU on one socket
and the box on the other, guest memory a memfd window (kind 0) and a file window (kind 1).
It pushes a watched ring's entries and what they point to (what the box gets is parsed with
the same ``unpack_push`` the box uses), it writes the box's DMA_WRITEVs into guest memory
however their bytes arrive, and it spins for a read's completion only while reads come back
quickly. Runs under ASan/UBSan in ``scripts/sanitize.sh``."""

from __future__ import annotations

import mmap
import os
import random
import socket
import struct
import threading
import time

import pytest

from dxpu_vfio.link.protocol import (MAX_POINTED, MAX_RING_SLOTS, LinkCommand, Push, RingWatch, pack_writev,
                                     unpack_push)
from dxpu_vfio.native import stream as native_stream
from dxpu_vfio.procs import wait_until
from dxpu_vfio.vfio_user.connection import Connection, ReceiveTimeout
from dxpu_vfio.vfio_user import protocol as vp

MEM, FILE, WRITE_ONLY = 0x1_0000_0000, 0x2_0000_0000, 0x3_0000_0000  # the windows' guest addresses
SIZE = 1 << 20
RING, ENTRIES, ES, DOORBELL = MEM, 16, 64, 0x1008  # an NVMe-like SQ in the memfd window
POINTER, BYTES = 32, 256                              # PRP2, a 128 KiB transfer's list
SHADOW, EVENT = MEM + 0xF000, MEM + 0xF800           # the SQ's shadow doorbell and event index


class Harness:
    """A Forwarder between this test's ends; ``doorbell(tail)`` returns the push it sent."""

    def __init__(self, tmp_path, read_spin_us: float = 0.0) -> None:
        module = native_stream.require()
        qemu_end, proxy_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with socket.create_server(("127.0.0.1", 0)) as listener:
            self.box = socket.create_connection(listener.getsockname())
            link_end, _ = listener.accept()
        self.qemu = qemu_end
        self.qemu.settimeout(5)  # a reply that never comes fails the test instead of hanging it
        self.qemu_reader = Connection(qemu_end)  # QEMU's side of the replies (the project's codec)
        self.qemu_conn = native_stream.unix(proxy_end)
        self.link_conn = native_stream.tcp(link_end, None, True, 5.0)
        self.box_conn = native_stream.tcp(self.box, None, False, 5.0)
        self.forwarder = module.Forwarder(self.qemu_conn.stream, self.link_conn.stream, 1.0,
                                          read_spin_us=read_spin_us)
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
        self.to_python: list[tuple] = []  # what serve() left to Python (a RING_WATCH after it took it)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:  # as the host's session thread does: Python takes what C leaves to it
            out = self.forwarder.serve()
            self.to_python.append(out)
            if out[0] != "link":
                return

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

    def read(self, msg_id: int, offset: int, box_delay: float = 0.0) -> bytes:
        """QEMU reads 4 bytes of BAR0; the box answers after ``box_delay`` s. The data read."""
        self.qemu.sendall(vp.message(msg_id, vp.Command.REGION_READ, struct.pack("<QII", offset, 0, 4)))
        request = self.box_conn.receive(timeout=5)
        assert request.header.command == vp.Command.REGION_READ, request.header
        time.sleep(box_delay)
        self.box_conn.send_message(request.header.msg_id, vp.Command.REGION_READ, vp.TYPE_REPLY,
                                   bytes(request.payload[:16]) + struct.pack("<I", offset ^ 0x5A5A5A5A))
        reply = self.qemu_reader.receive()
        assert reply.header.msg_id == msg_id and not reply.header.is_error, reply.header
        return bytes(reply.payload[16:])

    def send_box(self, command: int, payload: bytes) -> None:
        """A posted message from the box."""
        self.box_conn.send_message(0x10, command, vp.FLAG_NO_REPLY, payload)

    def event_write(self, value: int) -> None:
        """The box's device writes its event index (a posted DMA_WRITE)."""
        self.send_box(LinkCommand.DMA_WRITE, struct.pack("<QQ", EVENT, 4) + struct.pack("<I", value))

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


# --- shadow doorbells read for the box (RingWatch.shadow) ----------------------------------------

def shadow_tail(harness, tail: int) -> None:
    struct.pack_into("<I", harness.ram, SHADOW - MEM, tail)


def next_doorbell(harness) -> int:
    """The tail of the next REGION_WRITE the box gets (after a push, if one comes first)."""
    msg = harness.box_conn.receive(timeout=5)
    if msg.header.command == LinkCommand.DMA_PUSH:
        msg = harness.box_conn.receive(timeout=5)
    assert msg.header.command == vp.Command.REGION_WRITE, msg.header
    offset, region, count, tail = struct.unpack("<QIII", bytes(msg.payload))
    assert (offset, region, count) == (DOORBELL, 0, 4)
    return tail


def test_a_doorbell_of_a_ring_with_a_shadow_carries_the_shadows_tail(harness):
    """The driver writes the shadow before the register: the newer tail goes to the box, with
    the entries up to it (QEMU's register write may be older than the shadow already)."""
    harness.forwarder.set_ring(3, 0, DOORBELL, RING, ES, ENTRIES, 0, POINTER, BYTES, SHADOW, EVENT)
    shadow_tail(harness, 5)
    push = harness.doorbell(3)
    assert push.ranges == [(RING, 5 * ES)]
    counters = harness.forwarder.counters()
    assert counters["shadow_tails"] == 1 and counters["shadow_doorbells"] == 0
    shadow_tail(harness, ENTRIES + 1)  # past the ring: not taken, QEMU's value goes as before
    payload = struct.pack("<QII", DOORBELL, 0, 4) + struct.pack("<I", 6)
    harness.qemu.sendall(vp.message(9, vp.Command.REGION_WRITE, payload, no_reply=True))
    assert next_doorbell(harness) == 6


def test_the_box_writing_its_event_index_makes_the_host_ring_when_the_shadow_moved(harness):
    """The device publishes the tail it has seen and goes idle; the host then reads the shadow
    (as the device would: write the index, read the shadow) and rings for it if the guest went
    on without ringing. No move, nothing sent."""
    harness.doorbell(2)
    harness.forwarder.set_ring(3, 0, DOORBELL, RING, ES, ENTRIES, 2, POINTER, BYTES, SHADOW, EVENT)
    shadow_tail(harness, 2)
    harness.event_write(2)
    shadow_tail(harness, 4)  # the guest queued two more and did not ring (the index said so)
    harness.event_write(2)
    push = unpack_push(harness.box_conn.receive(timeout=5).payload)
    assert push.ranges == [(RING + 2 * ES, 2 * ES)]
    assert next_doorbell(harness) == 4
    assert struct.unpack_from("<I", harness.ram, EVENT - MEM)[0] == 2  # the box's write landed first
    harness.event_write(4)  # nothing new: nothing sent; QEMU's next doorbell is the next message
    shadow_tail(harness, 4)
    payload = struct.pack("<QII", DOORBELL, 0, 4) + struct.pack("<I", 4)
    harness.qemu.sendall(vp.message(9, vp.Command.REGION_WRITE, payload, no_reply=True))
    assert next_doorbell(harness) == 4
    assert harness.forwarder.counters()["shadow_doorbells"] == 1


def test_a_ring_watch_from_the_box_is_applied_before_the_writes_behind_it(harness):
    """The box adds the shadow to a watched ring and goes idle at once: its event index write,
    right behind the RING_WATCH, already finds the shadow watched (C applies the watch as it
    takes it, then hands it to Python); the same ring watched again keeps the tail pushed."""
    harness.doorbell(2)
    shadow_tail(harness, 3)
    watch = RingWatch(3, 0, DOORBELL, RING, ES, ENTRIES, 2, POINTER, BYTES, SHADOW, EVENT)
    harness.send_box(LinkCommand.RING_WATCH, watch.pack())
    harness.event_write(2)
    push = unpack_push(harness.box_conn.receive(timeout=5).payload)
    assert push.ranges == [(RING + 2 * ES, ES)] and next_doorbell(harness) == 3
    assert any(out[0] == "link" and RingWatch.unpack(out[1][0][4]) == watch for out in harness.to_python)


@pytest.mark.parametrize("shadow, event", [(SHADOW, 0), (0, EVENT), (SHADOW + 2, EVENT), (SHADOW, (1 << 64) - 4)])
def test_a_shadow_the_forwarder_cannot_honour_is_refused(harness, shadow, event):
    with pytest.raises(ValueError, match="shadow"):
        harness.forwarder.set_ring(3, 0, DOORBELL, RING, ES, ENTRIES, 0, POINTER, BYTES, shadow, event)


def test_random_ring_watches_and_event_writes_never_break_the_forwarder(harness):
    """A small fuzz of what a box sends the C forwarder about rings (RING_WATCH of both
    sizes, any fields; event index writes; doorbells): it keeps serving, every push it
    makes parses, and guest memory outside the box's own writes is untouched."""
    rng = random.Random(11)
    harness.ram[0:SIZE] = bytes(SIZE)
    for _ in range(200):
        fields = [rng.randrange(MAX_RING_SLOTS + 2), rng.choice([0, 1]), rng.choice([DOORBELL, rng.randrange(1 << 64)]),
                  rng.choice([RING, WRITE_ONLY, rng.randrange(1 << 64)]), rng.choice([ES, 0, 4097, rng.randrange(1 << 32)]),
                  rng.choice([ENTRIES, 0, 1 << 17, rng.randrange(1 << 32)]), rng.choice([0, 3, rng.randrange(1 << 32)]),
                  rng.choice([0, BYTES << 16 | POINTER, rng.randrange(1 << 32)])]
        shadow = [rng.choice([SHADOW, 0, WRITE_ONLY, rng.randrange(1 << 64)]),
                  rng.choice([EVENT, 0, rng.randrange(1 << 64)])]
        payload = struct.pack("<IIQQIIII", *fields) + (struct.pack("<QQ", *shadow) if rng.random() < 0.7 else b"")
        if rng.random() < 0.1:
            payload = payload[:rng.randrange(len(payload))]
        harness.send_box(LinkCommand.RING_WATCH, payload)
        harness.event_write(rng.randrange(1 << 32))
        if rng.random() < 0.3:
            doorbell = struct.pack("<QII", fields[2] if rng.random() < 0.5 else DOORBELL, fields[1], 4)
            harness.qemu.sendall(vp.message(9, vp.Command.REGION_WRITE,
                                            doorbell + struct.pack("<I", rng.randrange(ENTRIES + 2)), no_reply=True))
        struct.pack_into("<I", harness.ram, SHADOW - MEM, rng.randrange(ENTRIES + 2))
    pushes = 0
    while True:  # what the forwarder sent the box: every push parses
        try:
            msg = harness.box_conn.receive(timeout=1)
        except ReceiveTimeout:
            break
        if msg.header.command == LinkCommand.DMA_PUSH:
            unpack_push(msg.payload)  # raises if the forwarder built a bad one
            pushes += 1
    assert harness.thread.is_alive() and pushes > 0
    untouched = bytearray(harness.ram[0:SIZE])  # but for the event index the box wrote, and the shadow
    untouched[EVENT - MEM:EVENT - MEM + 4] = untouched[SHADOW - MEM:SHADOW - MEM + 4] = bytes(4)
    assert not any(untouched)


# --- the box's DMA_WRITEVs, however their bytes arrive -----------------------------------

def writev(ranges: list[tuple[int, bytes]], msg_id: int = 0x20) -> bytes:
    """A posted DMA_WRITEV from the box, framed: its ranges, then their bytes."""
    return vp.message_parts(msg_id, LinkCommand.DMA_WRITEV,
                            (pack_writev([(a, len(d)) for a, d in ranges]), *(d for _, d in ranges)), no_reply=True)


def send_in_pieces(harness, data: bytes, cuts: list[int], pause: float = 0.02) -> None:
    """The box's bytes as several sends with pauses between them: the forwarder sees a
    message's head before its bytes, and the next message's start behind its end."""
    edges = [0, *sorted(cuts), len(data)]
    for a, b in zip(edges, edges[1:]):
        harness.box_conn.stream.send(data[a:b])
        time.sleep(pause)


def wait_written(harness, total: int, timeout: float = 5.0) -> dict:
    """The forwarder's counters once it has written ``total`` bytes (or the timeout passed)."""
    wait_until(lambda: harness.forwarder.counters()["dma_bytes_written"] >= total, timeout, 0.005)
    return harness.forwarder.counters()


def scattered(rng: random.Random, count: int, size: int = 4096, base: int = 0) -> list[tuple[int, bytes]]:
    """``count`` ranges of ``size`` at distinct page-aligned places of the memfd window."""
    pages = rng.sample(range(base // 4096, SIZE // 4096 - 1), count)
    return [(MEM + p * 4096, rng.randbytes(size)) for p in pages]


def test_a_large_dma_writev_arriving_in_pieces_lands_in_guest_memory(harness):
    """An NVMe Read's shape: 32 scattered pages and a completion entry behind them; the head
    and a little data arrive first. Every byte lands where its range says."""
    rng = random.Random(1)
    harness.ram[0:SIZE] = bytes(SIZE)
    ranges = scattered(rng, 32) + [(MEM + 0xF_F000, rng.randbytes(16))]
    message = writev(ranges)
    send_in_pieces(harness, message, [16 + 8 + 33 * 16 + 100, 60_000])
    total = sum(len(d) for _, d in ranges)
    counters = wait_written(harness, total)
    assert counters["dma_bytes_written"] == total and counters["dma_refused"] == 0
    for addr, data in ranges:
        assert harness.ram[addr - MEM:addr - MEM + len(data)] == data
    assert harness.thread.is_alive()


def test_dma_writevs_into_a_file_window_outside_the_windows_and_small_ones(harness):
    """A file window (pwrite), a range outside the windows (the whole message dropped and
    counted, nothing of it written), and a small one."""
    rng = random.Random(2)
    harness.ram[0:SIZE] = bytes(SIZE)
    to_file = [(FILE + 0x1000 * i, rng.randbytes(4096)) for i in range(1, 17)]
    refused = scattered(rng, 16) + [(0xDEAD_0000, bytes(4096))]
    small = scattered(rng, 2, base=0x8_0000)
    for ranges in (to_file, refused, small):
        send_in_pieces(harness, writev(ranges), [100])
    total = sum(len(d) for _, d in to_file + small)
    counters = wait_written(harness, total)
    assert counters["dma_bytes_written"] == total and counters["dma_refused"] == 1
    with open(harness.file.name, "rb") as f:
        for addr, data in to_file:
            f.seek(addr - FILE)
            assert f.read(len(data)) == data
    for addr, data in small:
        assert harness.ram[addr - MEM:addr - MEM + len(data)] == data
    assert not any(any(harness.ram[addr - MEM:addr - MEM + 4096]) for addr, _ in refused[:-1])


def test_the_box_closing_in_the_middle_of_a_large_dma_write_ends_the_link_and_writes_none_of_it(harness):
    harness.ram[0:SIZE] = bytes(SIZE)
    message = writev(scattered(random.Random(3), 32))
    harness.box_conn.stream.send(message[:20_000])
    time.sleep(0.05)
    harness.box_conn.close()
    harness.thread.join(5)
    assert not harness.thread.is_alive()
    assert harness.to_python[-1][0] == "link-closed" and "closed" in harness.to_python[-1][1]
    assert not any(harness.ram[0:SIZE])  # a message cut short is not applied


@pytest.mark.parametrize("seed", range(4))
def test_messages_cut_anywhere_around_large_dma_writevs_land_in_order(harness, seed):
    """A run of large and small DMA_WRITEVs and 4-byte DMA_WRITEs over overlapping memory,
    the bytes cut at random places: guest memory ends as the writes applied in order say."""
    rng = random.Random(seed)
    harness.ram[0:SIZE] = bytes(SIZE)
    want = bytearray(SIZE)
    stream, total = b"", 0
    for i in range(12):
        kind = rng.choice(["large", "small", "word"])
        if kind == "word":
            addr = MEM + rng.randrange(0, SIZE - 4, 4)
            data = rng.randbytes(4)
            stream += vp.message(0x30 + i, LinkCommand.DMA_WRITE, struct.pack("<QQ", addr, 4) + data, no_reply=True)
            ranges = [(addr, data)]
        else:
            pages = rng.sample(range(SIZE // 4096), rng.randrange(9, 40) if kind == "large" else rng.randrange(1, 4))
            ranges = [(MEM + p * 4096 + rng.randrange(0, 64, 4), rng.randbytes(rng.randrange(3000, 4033)))
                      for p in pages]
            stream += writev(ranges, 0x30 + i)
        for addr, data in ranges:
            want[addr - MEM:addr - MEM + len(data)] = data
            total += len(data)
    send_in_pieces(harness, stream, rng.sample(range(1, len(stream)), 12), pause=0.005)
    counters = wait_written(harness, total)
    assert counters["dma_bytes_written"] == total
    assert harness.ram[0:SIZE] == bytes(want)
    assert harness.thread.is_alive()


def test_reads_are_spun_for_only_while_their_completions_come_within_the_spin(tmp_path):
    """The forwarder may spin for a read (QEMU's vCPU is stopped on it), but a link whose
    reads take longer than the spin must not cost it a spun CPU per read."""
    if not native_stream.built():
        pytest.fail("the native link stream is not built: run scripts/setup.sh")
    h = Harness(tmp_path, read_spin_us=2000)
    try:
        spun = lambda: h.forwarder.counters()["reads_spun"]  # noqa: E731
        for i in range(5):  # quick reads: every one spun for, and answered as the box said
            assert h.read(100 + i, 4 * i) == struct.pack("<I", 4 * i ^ 0x5A5A5A5A)
        assert spun() == 5
        for i in range(30):  # the box takes 20 ms: the average of the waits passes 2 ms
            h.read(200 + i, 0, box_delay=0.02)
        assert spun() < 5 + 10, "the forwarder went on spinning for reads that take 10 times its spin"
        before = spun()
        h.read(300, 0, box_delay=0.02)
        assert spun() == before
        for i in range(60):  # quick again: the average falls under the spin, and it spins again
            h.read(400 + i, 8)
        assert spun() > before
        # (counted just after QEMU's answer left)
        assert wait_until(lambda: h.forwarder.counters()["reads"] == 96, 5), h.forwarder.counters()
    finally:
        h.close()


def test_a_forwarder_without_read_spin_never_spins_and_a_bad_spin_is_refused(harness):
    for i in range(3):
        assert harness.read(10 + i, 0) == struct.pack("<I", 0x5A5A5A5A)
    assert harness.forwarder.counters()["reads_spun"] == 0
    for bad in (-1.0, 2e6, float("nan")):
        with pytest.raises(ValueError, match="read_spin_us"):
            native_stream.require().Forwarder(harness.qemu_conn.stream, harness.link_conn.stream, 1.0,
                                              read_spin_us=bad)
