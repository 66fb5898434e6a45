"""The box's native reader takes a DMA_PUSH into its ring's mirror itself (native/serve.c
push_mirrored), without the Python callback the cold interpreter made slow. It must leave
every mirror exactly as RingMirror.push would, for every push a host (or a hostile one)
can send: the same pushes go to one port through Python and to another through C, and
their mirrors are compared after each."""

from __future__ import annotations

import random

import pytest
from fakes import host_and_box_streams

from dxpu_vfio.link.protocol import MAX_PUSH_BYTES, LinkCommand, RingWatch, pack_push
from dxpu_vfio.native import stream as native
from dxpu_vfio.remoteproxy.ports import LinkDmaPort, RingMirror
from dxpu_vfio.vfio_user import protocol as vp

RING, ENTRIES, ES = 0x40000, 16, 64


@pytest.fixture
def stream_pair():
    host, box = host_and_box_streams()
    yield host, box
    host.close()
    box.close()


def watched_port(pointer_bytes: int = 0) -> LinkDmaPort:
    """A port with rings in slots 3 and 5 (nothing is sent: its endpoint is never used)."""
    port = LinkDmaPort(None, ring_push=True)  # type: ignore[arg-type]
    for slot in (3, 5):
        port.mirrors[slot] = RingMirror(RingWatch(slot, 0, 0x3C, RING * slot, ES, ENTRIES, 0,
                                                  32 if pointer_bytes else 0, pointer_bytes))
    return port


def state(port: LinkDmaPort) -> tuple:
    return port.pushes, {s: (bytes(m.data), bytes(m.valid), dict(m.pointed)) for s, m in port.mirrors.items()}


def serve(box, port: LinkDmaPort, python_pushes: list) -> None:
    """What the box's reader does (LinkEndpoint._serve_region_access), until nothing is there."""
    def push(payload: bytes) -> None:
        python_pushes.append(payload)
        try:
            port.pushed(memoryview(payload))
        except Exception:  # noqa: BLE001 - as the box's callback: a bad push is dropped
            pass
    while native.require().serve_requests(box.stream, None, None, 0.5, push, port) is not None:
        pass


def random_push(rng: random.Random) -> bytes:
    """Mostly what a host sends (one or two runs of whole entries of slot 3 or 5, the second
    the wrap to the ring's start), else one that breaks a rule: past the ring, misaligned,
    a third range, an unwatched slot, pointed bytes, POINTED_UNKNOWN, bytes that lie."""
    slot = rng.choice((3, 5))
    base, broken = RING * slot, rng.random() < 0.4
    first = rng.randrange(ENTRIES)
    count = rng.randrange(1, ENTRIES - first + 1)
    ranges = [(base + first * ES, count * ES)]
    if rng.random() < 0.3:
        ranges.append((base, rng.randrange(1, first + 1) * ES) if first else (base, ES))
    pointed, unknown = [], False
    if broken:
        how = rng.randrange(7)
        if how == 0:
            ranges[0] = (ranges[0][0] + ES * ENTRIES, ranges[0][1])
        elif how == 1:
            ranges[-1] = (ranges[-1][0] + 8, ranges[-1][1])
        elif how == 2:
            ranges = ranges * 2
        elif how == 3:
            slot = 7
        elif how == 4:
            pointed = [(0x9000, rng.choice((0, 16, 64)))]
        elif how == 5:
            unknown = True
        else:
            ranges = []
    data = rng.randbytes(sum(n for _, n in ranges + pointed))
    if broken and rng.random() < 0.3:
        data = data[:rng.randrange(len(data) + 1)] + b"\x99" * rng.randrange(3)
    return pack_push(slot, ranges, pointed, unknown) + data


@pytest.mark.parametrize("pointer_bytes", [0, 256])
def test_pushes_taken_in_c_leave_the_mirrors_as_python_would(stream_pair, pointer_bytes):
    host, box = stream_pair
    rng = random.Random(1234 + pointer_bytes)
    by_python, by_c, python_pushes = watched_port(pointer_bytes), watched_port(pointer_bytes), []
    for i in range(400):
        payload = random_push(rng)
        try:
            by_python.pushed(memoryview(payload))
        except Exception:  # noqa: BLE001 - a malformed push is dropped by both
            pass
        host.send(vp.message(0x8000 | i, LinkCommand.DMA_PUSH, payload, no_reply=True))
        serve(box, by_c, python_pushes)
        assert state(by_c) == state(by_python), f"push {i} ({payload[:8 + 16 * 3].hex()}...) left them apart"
        if i % 7 == 0:  # the device reads some entries: both mirrors forget them the same way
            first = rng.randrange(ENTRIES)
            got = [p.mirrors[3].take(RING * 3 + first * ES, ES) for p in (by_python, by_c)]
            assert got[0] == got[1]
    if pointer_bytes:
        assert len(python_pushes) == 400, "a ring whose entries point to pushed bytes is Python's"
    else:
        assert 80 < len(python_pushes) < 240, "C took the well-formed pushes and left the others"
        assert by_c.pushes > 240


def test_a_push_into_a_ring_taken_in_c_is_served_to_the_device_without_a_round_trip(stream_pair):
    host, box = stream_pair
    port = watched_port()
    entries = bytes(range(3 * ES))
    host.send(vp.message(0x8001, LinkCommand.DMA_PUSH, pack_push(3, [(RING * 3 + 14 * ES, 2 * ES), (RING * 3, ES)])
                         + entries, no_reply=True))
    python_pushes: list = []
    serve(box, port, python_pushes)
    assert python_pushes == [] and port.pushes == 1
    # the device's fetch of the wrapped batch: both pieces from the push, no request sent
    assert port._from_pushes([(RING * 3 + 14 * ES, 2 * ES), (RING * 3, ES)]) == [entries[:2 * ES], entries[2 * ES:]]
    assert port.requests == 0


def test_the_largest_push_a_host_may_send_is_taken_and_a_larger_one_is_not(stream_pair):
    host, box = stream_pair
    port = LinkDmaPort(None, ring_push=True)  # type: ignore[arg-type]
    big = MAX_PUSH_BYTES // ES
    port.mirrors[1] = RingMirror(RingWatch(1, 0, 0x3C, RING, ES, big * 2, 0))
    python_pushes: list = []
    for n, taken in ((big, True), (big + 1, False)):
        host.send(vp.message(0x8002, LinkCommand.DMA_PUSH, pack_push(1, [(RING, n * ES)]) + b"\x5a" * (n * ES),
                             no_reply=True))
        serve(box, port, python_pushes)
        assert (port.pushes == 1) and (len(python_pushes) == (0 if taken else 1))
    # the one too large is malformed: Python drops it, and the ring keeps what it had
    assert bytes(port.mirrors[1].valid) == b"\1" * big + bytes(big)
