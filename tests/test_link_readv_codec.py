"""The DMA_READV codec (link/protocol.py) and the HELLO's feature list: what a peer sends
is checked whole before anything is read, and nothing but a ProtocolError comes out of
bytes that are not a scatter list."""

from __future__ import annotations

import random
import struct

import pytest

from dxpu_vfio.link.protocol import (FEATURE_DMA_READV, MAX_PUSH_BYTES, MAX_READV_BYTES, MAX_READV_RANGES,
                                     MAX_RING_ENTRIES, MAX_RING_SLOTS, MAX_WRITEV_BYTES, READV_HEAD, READV_RANGE, Hello,
                                     RingWatch, pack_push, pack_readv, pack_writev, unpack_push, unpack_readv,
                                     unpack_writev)
from dxpu_vfio.vfio_user.protocol import ProtocolError


def test_a_scatter_list_round_trips():
    ranges = [(0x1000, 4096), ((1 << 64) - 8, 8), (0, 1)]
    assert unpack_readv(pack_readv(ranges)) == ranges
    full = [(i << 12, 4096) for i in range(MAX_READV_RANGES)]
    assert unpack_readv(pack_readv(full)) == full and sum(n for _, n in full) == MAX_READV_BYTES


@pytest.mark.parametrize("ranges", [[], [(0, 4096)] * (MAX_READV_RANGES + 1), [(0, MAX_READV_BYTES + 1)]])
def test_the_box_never_packs_a_scatter_list_the_host_must_refuse(ranges):
    with pytest.raises(ValueError):
        pack_readv(ranges)


@pytest.mark.parametrize("payload, why", [
    (b"", "shorter than its head"),
    (READV_HEAD.pack(0, 0), "0 ranges"),
    (READV_HEAD.pack(MAX_READV_RANGES + 1, 0) + READV_RANGE.pack(0, 1, 0) * (MAX_READV_RANGES + 1), "257 ranges"),
    (READV_HEAD.pack(2, 0) + READV_RANGE.pack(0, 1, 0), "2 ranges in 24 bytes"),
    (READV_HEAD.pack(1, 0) + READV_RANGE.pack(0, 1, 0) + b"\0", "1 ranges in 25 bytes"),
    (READV_HEAD.pack(1, 0) + READV_RANGE.pack(0x1000, 0, 0), "range 0: 0 bytes"),
    (READV_HEAD.pack(1, 0) + READV_RANGE.pack((1 << 64) - 4, 8, 0), "range 0: 8 bytes"),
    (READV_HEAD.pack(2, 0) + READV_RANGE.pack(0, MAX_READV_BYTES, 0) + READV_RANGE.pack(0, 1, 0), "1048577 bytes"),
])
def test_a_malformed_scatter_list_is_refused_naming_what_is_wrong(payload, why):
    with pytest.raises(ProtocolError, match=why):
        unpack_readv(payload)


def test_random_bytes_give_a_scatter_list_or_a_protocol_error_nothing_else():
    rng = random.Random(7)
    good = pack_readv([(0x1000 * i, 4096) for i in range(8)])
    parsed = 0
    for _ in range(20000):
        payload = bytearray(good if rng.random() < 0.7 else rng.randbytes(rng.randrange(64)))
        for _ in range(rng.randint(0, 4)):
            if payload:
                payload[rng.randrange(len(payload))] = rng.randrange(256)
        if rng.random() < 0.2:
            payload = payload[:rng.randrange(len(payload) + 1)]
        try:
            ranges = unpack_readv(bytes(payload))
        except ProtocolError:
            continue
        parsed += 1
        assert 0 < len(ranges) <= MAX_READV_RANGES and sum(n for _, n in ranges) <= MAX_READV_BYTES
        assert all(n > 0 and a + n <= 1 << 64 for a, n in ranges)
        assert len(payload) == 8 + 16 * struct.unpack_from("<I", payload)[0]
    assert parsed > 1000  # the mutations kept enough lists whole to reach the range checks


def test_the_hello_carries_the_host_features_and_an_older_hello_has_none():
    hello = Hello("nv0", "ab" * 32, "cd" * 32, features=(FEATURE_DMA_READV,))
    assert Hello.unpack(hello.pack()).features == (FEATURE_DMA_READV,)
    assert Hello.unpack(b'{"version": 2, "device": "nv0"}').features == ()
    for bad in (b'{"version": 2, "device": "nv0", "features": "dma-readv"}',
                b'{"version": 2, "device": "nv0", "features": [' + b'"x",' * 40 + b'"x"]}'):
        with pytest.raises(ProtocolError, match="features"):
            Hello.unpack(bad)


# --- DMA_WRITEV: the same scatter list, then its bytes -----------------------------------------

def test_a_writev_round_trips_and_its_bytes_follow_the_ranges():
    ranges = [(0x1000, 3), ((1 << 64) - 8, 8), (0, 1)]
    got, data = unpack_writev(pack_writev(ranges) + b"abc" + b"12345678" + b"z")
    assert got == ranges and bytes(data) == b"abc12345678z"
    full = [(i << 12, MAX_WRITEV_BYTES // MAX_READV_RANGES) for i in range(MAX_READV_RANGES)]
    assert unpack_writev(pack_writev(full) + bytes(sum(n for _, n in full)))[0] == full


@pytest.mark.parametrize("ranges", [[], [(0, 8)] * (MAX_READV_RANGES + 1), [(0, MAX_WRITEV_BYTES + 1)]])
def test_the_box_never_packs_a_writev_the_host_must_refuse(ranges):
    with pytest.raises(ValueError):
        pack_writev(ranges)


@pytest.mark.parametrize("payload, why", [
    (b"\x01", "shorter than its head"),
    (READV_HEAD.pack(0, 0), "0 ranges"),
    (READV_HEAD.pack(2, 0) + READV_RANGE.pack(0, 8, 0), "2 ranges in"),
    (pack_writev([(0, 8)]) + b"1234567", "of 8 bytes carries 7"),
    (pack_writev([(0, 8)]) + b"123456789", "of 8 bytes carries 9"),
    (READV_HEAD.pack(1, 0) + READV_RANGE.pack((1 << 64) - 4, 8, 0) + bytes(8), "range 0"),
])
def test_a_malformed_writev_is_a_protocol_error_naming_what_is_wrong(payload, why):
    with pytest.raises(ProtocolError, match=why):
        unpack_writev(payload)


def test_random_bytes_are_a_writev_or_a_protocol_error():
    rng = random.Random(5)
    for _ in range(3000):
        ranges = [(rng.randrange(1 << 40), rng.randrange(1, 64)) for _ in range(rng.randint(1, 4))]
        tail = sum(n for _, n in ranges) if rng.random() < 0.5 else rng.randrange(300)  # the right size, or not
        payload = bytearray(pack_writev(ranges) + bytes(tail))
        for _ in range(rng.randint(0, 4)):
            payload[rng.randrange(len(payload))] = rng.randrange(256)
        try:
            ranges, data = unpack_writev(bytes(payload))
        except ProtocolError:
            continue
        assert len(data) == sum(n for _, n in ranges)


# --- RING_WATCH and DMA_PUSH ------------------------------------------------------------------

def test_a_ring_watch_and_a_push_round_trip():
    watch = RingWatch(5, 0, 0x1028, 0x7000_0000, 64, 1024, 17)
    assert RingWatch.unpack(watch.pack()) == watch
    assert RingWatch.unpack(RingWatch(5).pack()) == RingWatch(5)          # withdrawn: nothing else counts
    slot, ranges, data, pointed, unknown = unpack_push(pack_push(5, [(0x7000_0000, 128), (0x7000_1000, 64)])
                                                       + bytes(192))
    assert (slot, ranges, len(data), pointed, unknown) == (5, [(0x7000_0000, 128), (0x7000_1000, 64)], 192, [], False)
    assert unpack_push(pack_push(1, [])).ranges == []                       # empty: forget what was pushed


def test_a_ring_watch_with_a_shadow_doorbell_round_trips_and_a_bad_one_is_refused():
    watch = RingWatch(2, 0, 0x1010, 0x7000_0000, 64, 32, 3, 32, 256, shadow=0x9000_0008, event_index=0x9100_0008)
    assert len(watch.pack()) == 56 and RingWatch.unpack(watch.pack()) == watch
    assert len(RingWatch(2, 0, 0x1010, 0x7000_0000, 64, 32).pack()) == 40  # none: the older, shorter message
    for bad in (dict(shadow=0x9000_0008), dict(event_index=0x9100_0008), dict(shadow=0x9000_0006, event_index=8),
                dict(shadow=(1 << 64) - 4, event_index=8)):
        with pytest.raises(ProtocolError, match="shadow"):
            RingWatch.unpack(RingWatch(2, 0, 0x1010, 0x7000_0000, 64, 32, **bad).pack())
    with pytest.raises(ProtocolError, match="shadow"):  # only on a ring
        RingWatch.unpack(RingWatch(2, shadow=8, event_index=16).pack())
    with pytest.raises(ProtocolError, match="want 40 or 56"):
        RingWatch.unpack(watch.pack()[:48])


def test_a_ring_watch_with_a_pointer_and_a_push_with_what_entries_point_to_round_trip():
    """An NVMe SQ's watch names PRP2 (offset 32) and 256 bytes; its push carries the entries,
    then for each entry's pointer the bytes there (empty: the host could not read them)."""
    watch = RingWatch(2, 0, 0x1010, 0x7000_0000, 64, 32, 3, pointer_offset=32, pointer_bytes=256)
    assert RingWatch.unpack(watch.pack()) == watch
    entries, lists = bytes(range(128)), b"\xaa" * 256 + b"\xbb" * 16
    push = unpack_push(pack_push(2, [(0x7000_0000, 128)], [(0x5000, 256), (0x6FF0, 16), (0x9000, 0)], True)
                       + entries + lists)
    assert (push.slot, push.ranges, bytes(push.data), push.pointed_unknown) == (2, [(0x7000_0000, 128)], entries, True)
    assert [(a, bytes(d)) for a, d in push.pointed] == [(0x5000, b"\xaa" * 256), (0x6FF0, b"\xbb" * 16), (0x9000, b"")]


@pytest.mark.parametrize("watch, why", [
    (RingWatch(MAX_RING_SLOTS, 0, 0, 0, 64, 8), "slot"),
    (RingWatch(0, 0, 0, 0, 0, 8), "entries of 0 bytes"),
    (RingWatch(0, 0, 0, 0, 64, 8, 8), "tail 8"),
    (RingWatch(0, 0, 0, (1 << 64) - 64, 64, 8), "entries of 64 bytes"),
    (RingWatch(0, 0, 0, 0, 64, MAX_RING_ENTRIES + 1), "entries of 64 bytes"),
    (RingWatch(0, 0, 0, 0, 64, 8, pointer_offset=60, pointer_bytes=256), "pointer of 256 bytes at offset 60"),
    (RingWatch(0, 0, 0, 0, 64, 8, pointer_offset=32, pointer_bytes=4097), "pointer of 4097 bytes"),
])
def test_a_ring_the_host_cannot_watch_is_refused_naming_what_is_wrong(watch, why):
    with pytest.raises(ProtocolError, match=why):
        RingWatch.unpack(watch.pack())


@pytest.mark.parametrize("payload, why", [
    (b"\0" * 7, "shorter than its head"),
    (pack_push(MAX_RING_SLOTS, []), "slot"),
    (struct.pack("<II", 0, 3) + struct.pack("<QII", 0, 64, 0) * 3 + bytes(192), "range 2: 64 bytes"),  # 3 ring ranges
    (pack_push(0, [(0, 64)]) + bytes(63), "carries 63"),
    (pack_push(0, [(0, 64)])[:20], "in 20 bytes"),
    (pack_push(0, [(0, MAX_PUSH_BYTES + 64)]) + bytes(MAX_PUSH_BYTES + 64), "of 524352 bytes"),
    (pack_push(0, [((1 << 64) - 8, 64)]) + bytes(64), "range 0"),
    (pack_push(0, [(0, 64)], [(0x1F00, 512)]) + bytes(576), "range 1: 512 bytes at 0x1f00"),  # crosses a page
    (struct.pack("<II", 0, 2) + struct.pack("<QII", 0x1000, 8, 1) + struct.pack("<QII", 0, 64, 0)
     + bytes(72), "range 1: 64 bytes at 0x0, kind 0"),                                        # ring after pointed
    (pack_push(0, [(0, 64)])[:8] + struct.pack("<QII", 0, 64, 2) + bytes(64), "kind 2"),
    (pack_push(0, [(0, 64)], [(0x1000, 8)] * 65) + bytes(64 + 65 * 8), "65 pointed ranges"),
    (pack_push(0, [(0, 64)], [(0x1000, 8)]) + bytes(64 + 7), "carries 71"),
])
def test_a_malformed_push_is_a_protocol_error_naming_what_is_wrong(payload, why):
    with pytest.raises(ProtocolError, match=why):
        unpack_push(payload)


def test_random_bytes_are_a_push_or_a_watch_or_a_protocol_error():
    rng = random.Random(13)
    for _ in range(20000):
        blob = rng.randbytes(rng.choice((8, 24, 40, 41, rng.randrange(100))))
        for parse in (unpack_push, RingWatch.unpack):
            try:
                parse(blob)
            except ProtocolError:
                pass
