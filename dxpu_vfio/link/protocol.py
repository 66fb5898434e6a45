"""The link protocol between a host proxy and a remote proxy (docs/link-protocol.md).

One ordered stream (TCP, normally TLS) per attached device, framed exactly like
vfio-user (16-byte header: id, command, size, flags, error) so region accesses and DMA
reuse vfio-user's payload layouts unchanged. Link-only commands are numbered from 0x100.
Posted traffic (MMIO writes, DMA writes, interrupts, heartbeats) carries the no-reply
flag; because everything of one device shares one stream, a read never passes an
earlier write and an interrupt never passes the DMA writes before it.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import hmac
import itertools
import json
import operator
import secrets
import struct
from dataclasses import dataclass, field
from typing import NamedTuple

from dxpu_vfio.vfio_user.protocol import MAX_DATA_XFER, ProtocolError

LINK_VERSION = 2  # 2: HELLO is a challenge and a proof of the lease token, never the token


class LinkCommand(enum.IntEnum):
    # reused from vfio-user, same payloads
    DMA_MAP = 2  # host -> remote, non-posted: a DMA window QEMU mapped (never an fd); only if the description asks
    DMA_UNMAP = 3  # host -> remote, non-posted: a window QEMU unmapped (flag DMA_UNMAP_ALL: every window)
    REGION_READ = 9  # host -> remote, non-posted
    REGION_WRITE = 10  # host -> remote, posted or non-posted (config writes)
    DMA_READ = 11  # remote -> host, non-posted
    DMA_WRITE = 12  # remote -> host, posted
    DEVICE_RESET = 13  # host -> remote, non-posted
    # link only
    HELLO = 0x100  # host -> remote, twice: version, device (JSON); reply: a nonce; then the same with the
    # nonce and a proof of the lease token (HMAC); reply: device description
    IRQ = 0x101  # remote -> host, posted: kind, vector, level
    HEARTBEAT = 0x102  # both ways, posted
    WRITE_BATCH = 0x103  # host -> remote, posted: coalesced posted writes (REGION_WRITE payloads back to back)
    INVENTORY = 0x104  # manager -> remote, instead of HELLO: the box's devices (JSON); then the link closes
    SCREENSHOT = 0x105  # manager -> remote, instead of HELLO: a display's scanout as PNG, in pieces
    SYNC = 0x106  # host -> remote, non-posted, empty: completed once everything before it was done
    GRANT = 0x107  # manager -> remote, instead of HELLO: a fresh lease token for one device (JSON)
    REVOKE = 0x108  # manager -> remote, instead of HELLO: that device's token is void (JSON)
    FAULT = 0x109  # manager -> remote, instead of HELLO: arm, clear or list test faults (JSON)
    DMA_READV = 0x10A  # remote -> host, non-posted: a scatter list (pack_readv); reply: its bytes back to
    # back. Only to a host whose HELLO offered FEATURE_DMA_READV.
    DMA_WRITEV = 0x10B  # remote -> host, posted: a scatter list and its bytes (pack_writev). Only to a host
    # whose HELLO offered FEATURE_DMA_WRITEV.
    RING_WATCH = 0x10C  # remote -> host, posted: a doorbell register that announces a ring's new tail
    # (RingWatch); entries 0 withdraws it. Only to a host whose HELLO offered FEATURE_RING_PUSH.
    DMA_PUSH = 0x10D  # host -> remote, posted: the ring entries a watched doorbell announced, sent just
    # before it (pack_push); no ranges: none were pushed, forget what was


IRQ_MSG = struct.Struct("<III")  # kind, vector, level
IRQ_INTX, IRQ_MSI, IRQ_MSIX = 0, 1, 2


NONCE_BYTES = 32

# Optional features a host offers in its HELLO; the box uses one only if it was offered
# (never probed), so either side may be older than the other.
FEATURE_DMA_READV = "dma-readv"
FEATURE_DMA_WRITEV = "dma-writev"
FEATURE_RING_PUSH = "ring-push"  # offered only where the host's C forwarder sees every posted write
# and, with it, a watched ring's shadow doorbell read by the host (RingWatch.shadow): the C
# forwarder also applies every DMA write of the box, so it sees each event index written
FEATURE_SHADOW_DOORBELLS = "shadow-doorbells"
HOST_FEATURES = (FEATURE_DMA_READV, FEATURE_DMA_WRITEV)


@dataclass
class Hello:
    """A HELLO: the first (``nonce`` and ``proof`` empty) asks the box for a challenge; the
    second answers it. The lease token itself never crosses the link."""

    device: str
    nonce: str = ""  # hex, as the box sent it
    proof: str = ""  # hex: hello_proof(token, device, nonce)
    version: int = LINK_VERSION
    features: tuple[str, ...] = ()  # what the host can serve beyond the base protocol (HOST_FEATURES)

    def pack(self) -> bytes:
        body: dict = {"version": self.version, "device": self.device}
        if self.proof:
            body.update(nonce=self.nonce, proof=self.proof)
        if self.features:
            body["features"] = list(self.features)
        return json.dumps(body).encode()

    @classmethod
    def unpack(cls, payload: bytes | memoryview) -> "Hello":
        try:
            data = json.loads(bytes(payload))
            features = data.get("features", [])
            if not isinstance(features, list) or len(features) > 32:
                raise ValueError("features must be a list of at most 32 names")
            return cls(device=str(data["device"]), nonce=str(data.get("nonce", "")),
                       proof=str(data.get("proof", "")), version=int(data["version"]),
                       features=tuple(str(f)[:64] for f in features))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise ProtocolError(f"bad HELLO: {exc!r}") from exc


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def hello_proof(token: str, device: str, nonce: str) -> str:
    """HMAC-SHA256 keyed with the lease token over the device and the box's fresh nonce:
    proves the token without sending it, and is worth nothing on another connection."""
    message = b"dxpu-hello\0" + device.encode() + b"\0" + nonce.encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def proof_matches(proof: str, token: str, device: str, nonce: str) -> bool:
    return hmac.compare_digest(proof.encode(), hello_proof(token, device, nonce).encode())


def challenge(nonce: str) -> bytes:
    return json.dumps({"nonce": nonce}).encode()


def unpack_challenge(payload: bytes | memoryview) -> str:
    try:
        nonce = json.loads(bytes(payload))["nonce"]
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise ProtocolError(f"bad HELLO challenge: {exc!r}") from exc
    if not isinstance(nonce, str) or len(nonce) != 2 * NONCE_BYTES:
        raise ProtocolError("bad HELLO challenge: no nonce")
    return nonce


@dataclass
class DeviceDescription:
    """What the host proxy needs to answer QEMU's GET_INFO questions without the network."""

    model: str
    regions: list[tuple[int, int, bool, bool]]  # index, size, readable, writable
    irqs: dict[str, int]
    coalesce: bool = False  # the device's posted writes come in floods: combine them
    dma_windows: bool = False  # the box wants QEMU's DMA windows (DMA_MAP/DMA_UNMAP): an external server
    mappable: list[int] = field(default_factory=list)  # host-mappable BARs: the host shadows them (hostproxy/shadow.py)

    def pack(self) -> bytes:
        return json.dumps({"model": self.model, "regions": self.regions, "irqs": self.irqs,
                           "coalesce": self.coalesce, "dma_windows": self.dma_windows,
                           "mappable": self.mappable}).encode()

    @classmethod
    def unpack(cls, payload: bytes | memoryview) -> "DeviceDescription":
        try:
            data = json.loads(bytes(payload))
            return cls(data["model"], [tuple(r) for r in data["regions"]], dict(data["irqs"]),
                       bool(data.get("coalesce", False)), bool(data.get("dma_windows", False)),
                       data.get("mappable", []))  # checked by the host (hostproxy/description.py)
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(f"bad device description: {exc}") from exc


def pack_irq(kind: int, vector: int, level: bool = True) -> bytes:
    return IRQ_MSG.pack(kind, vector, int(level))


def unpack_irq(payload: bytes | memoryview) -> tuple[int, int, bool]:
    if len(payload) < IRQ_MSG.size:
        raise ProtocolError("short IRQ message")
    kind, vector, level = IRQ_MSG.unpack_from(payload)
    if kind > IRQ_MSIX:
        raise ProtocolError(f"IRQ kind {kind}")
    return kind, vector, bool(level)


# --- DMA_READV: one request for a whole scatter list -------------------------------------
READV_HEAD = struct.Struct("<II")  # ranges, reserved (0)
READV_RANGE = struct.Struct("<QII")  # address, length, reserved (0)
MAX_READV_RANGES = 256  # a 1 MiB scatter list of 4 KiB pages fits
MAX_READV_BYTES = MAX_DATA_XFER  # the reply (the data) stays one message the stream allows


def pack_readv(ranges: list[tuple[int, int]]) -> bytes:
    """A DMA_READV request: ``ranges`` of (guest address, length), read in order."""
    if not 0 < len(ranges) <= MAX_READV_RANGES or sum(map(operator.itemgetter(1), ranges)) > MAX_READV_BYTES:
        raise ValueError(f"a DMA_READV takes 1..{MAX_READV_RANGES} ranges of {MAX_READV_BYTES} bytes in all")
    return READV_HEAD.pack(len(ranges), 0) + _pack_ranges(ranges)


def _pack_ranges(ranges: list[tuple[int, int]] | tuple, kind: int = 0) -> bytes:
    """(address, length) ranges as READV_RANGEs (the third field ``kind``), packed in one
    call: DMA_READV's, DMA_WRITEV's and DMA_PUSH's lists. The pairs go to ``struct`` as
    they are, the third field padding or a repeat: no Python loop per range (an NVMe Read's
    32 pages, on every command)."""
    if kind == 0:
        return _ranges_struct(len(ranges), "4x").pack(*itertools.chain.from_iterable(ranges))
    return _ranges_struct(len(ranges), "I").pack(*(x for a, n in ranges for x in (a, n, kind)))


@functools.lru_cache(maxsize=2 * (MAX_READV_RANGES + 1))
def _ranges_struct(count: int, third: str) -> struct.Struct:
    return struct.Struct("<" + ("QI" + third) * count)


def unpack_readv(payload: bytes | memoryview) -> list[tuple[int, int]]:
    """The ranges of a DMA_READV, checked before anything is read: the count agrees with
    the payload's size, no range is empty or wraps the address space, and the total fits
    one reply. (The host's windows check each range's address and rights afterwards.)"""
    return _unpack_ranges(payload, "DMA_READV", whole=True)


def _unpack_ranges(payload: bytes | memoryview, name: str, whole: bool) -> list[tuple[int, int]]:
    """The scatter list at the start of ``payload`` (all of it if ``whole``)."""
    if len(payload) < READV_HEAD.size:
        raise ProtocolError(f"{name} of {len(payload)} bytes: shorter than its head")
    count, _ = READV_HEAD.unpack_from(payload)
    if not 0 < count <= MAX_READV_RANGES:
        raise ProtocolError(f"{name} of {count} ranges (1..{MAX_READV_RANGES})")
    head = READV_HEAD.size + count * READV_RANGE.size
    if len(payload) < head or (whole and len(payload) != head):
        raise ProtocolError(f"{name} of {count} ranges in {len(payload)} bytes")
    ranges, total = [], 0
    for i in range(count):
        address, length, _ = READV_RANGE.unpack_from(payload, READV_HEAD.size + i * READV_RANGE.size)
        if length == 0 or address + length > 1 << 64:
            raise ProtocolError(f"{name} range {i}: {length} bytes at {address:#x}")
        total += length
        ranges.append((address, length))
    if total > MAX_READV_BYTES:
        raise ProtocolError(f"{name} of {total} bytes (at most {MAX_READV_BYTES})")
    return ranges


# --- DMA_WRITEV: one posted message for a whole scatter list -----------------------------
# The same head and ranges as DMA_READV, then the ranges' bytes back to back.
MAX_WRITEV_BYTES = MAX_DATA_XFER - READV_HEAD.size - MAX_READV_RANGES * READV_RANGE.size  # the message stays
# within what a stream allows, whatever its ranges


def pack_writev(ranges: list[tuple[int, int]]) -> bytes:
    """The head of a DMA_WRITEV: ``ranges`` of (guest address, length), written in order
    from the bytes that follow it."""
    if not 0 < len(ranges) <= MAX_READV_RANGES or sum(map(operator.itemgetter(1), ranges)) > MAX_WRITEV_BYTES:
        raise ValueError(f"a DMA_WRITEV takes 1..{MAX_READV_RANGES} ranges of {MAX_WRITEV_BYTES} bytes in all")
    return READV_HEAD.pack(len(ranges), 0) + _pack_ranges(ranges)


def unpack_writev(payload: bytes | memoryview) -> tuple[list[tuple[int, int]], memoryview]:
    """The ranges of a DMA_WRITEV and the bytes they get, checked before anything is
    written: the ranges as :func:`unpack_readv` checks them, and exactly their total of
    bytes after them."""
    view = memoryview(payload)
    ranges = _unpack_ranges(view, "DMA_WRITEV", whole=False)
    head = READV_HEAD.size + len(ranges) * READV_RANGE.size
    total = sum(map(operator.itemgetter(1), ranges))
    if len(view) - head != total:
        raise ProtocolError(f"DMA_WRITEV of {total} bytes carries {len(view) - head}")
    return ranges, view[head:]


# --- RING_WATCH / DMA_PUSH: ring entries that travel with their doorbell -------------------
RING_WATCH_MSG = struct.Struct("<IIQQIIII")  # slot, region, doorbell offset, base, entry size, entries, tail,
# pointer (offset in the entry, low 16 bits; bytes to push at it, high 16 bits; 0: none)
RING_WATCH_SHADOW_MSG = struct.Struct("<IIQQIIIIQQ")  # the same, then the shadow doorbell and event index
# addresses (only to a host that offered FEATURE_SHADOW_DOORBELLS)
PUSH_HEAD = struct.Struct("<II")  # slot, ranges (ring ranges 0..2, then pointed ones) | POINTED_UNKNOWN
MAX_RING_SLOTS = 64  # watched rings per device (an NVMe controller's I/O queues)
MAX_RING_ENTRIES = 1 << 16
MAX_ENTRY_SIZE = 4096
# an accelerator's 256 KiB inline copy and the rest of its pass; a doorbell announcing more is pushed empty
# (the box fetches it)
MAX_PUSH_BYTES = 512 << 10
POINTED_PAGE = 4096  # pointed bytes never cross this boundary (an NVMe PRP list page's)
MAX_POINTED = 64  # pointed ranges a push carries at most (more: POINTED_UNKNOWN)
RANGE_RING, RANGE_POINTED = 0, 1  # a push range's third field: entries of the ring, or bytes an entry points to
POINTED_UNKNOWN = 1 << 31  # in the ranges count: this push's entries point to bytes it does not carry


@dataclass(frozen=True)
class RingWatch:
    """A ring in guest memory whose new tail the driver writes to a doorbell register (a 4-byte
    posted write of the tail index at ``offset`` of BAR ``region``): the host, seeing that
    write, sends the entries from the tail it saw last to the new one as a DMA_PUSH just
    before it, so the device's fetch of them is not a round trip. ``entries`` 0: no ring.

    With ``pointer_bytes``, each entry's little-endian u64 at ``pointer_offset`` names memory
    the device reads next (an NVMe command's PRP list): the push carries up to that many bytes
    there too (not past the end of their 4 KiB page; nothing for a null pointer), so that
    read is no round trip either.

    With ``shadow`` (and ``event_index``), the driver writes each new tail to that guest
    address first and rings the register only when the u32 the device keeps at
    ``event_index`` asks (NVMe's shadow doorbells, Doorbell Buffer Config). The host, which
    reads guest memory without a round trip, reads the shadow for the device: a doorbell
    goes to the box carrying the shadow's tail (the driver writes the shadow first, so it
    is never behind the register's value), and after each DMA write of the box that covers
    the event index (a device going idle) the host reads the shadow again and, if it moved
    past the tail sent last, sends a push and a doorbell of its own. So a device on a box
    learns of every entry without reading the shadow over the network, and the driver rings
    the register only while the device is idle."""

    slot: int
    region: int = 0
    offset: int = 0
    base: int = 0
    entry_size: int = 0
    entries: int = 0
    tail: int = 0
    pointer_offset: int = 0
    pointer_bytes: int = 0
    shadow: int = 0
    event_index: int = 0

    def pack(self) -> bytes:
        fields = (self.slot, self.region, self.offset, self.base, self.entry_size, self.entries, self.tail,
                  self.pointer_bytes << 16 | self.pointer_offset)
        if self.shadow or self.event_index:
            return RING_WATCH_SHADOW_MSG.pack(*fields, self.shadow, self.event_index)
        return RING_WATCH_MSG.pack(*fields)

    def check(self) -> "RingWatch":
        """Itself, if the host can watch it (the rules the C forwarder's set_ring enforces
        again); else ProtocolError naming what is wrong."""
        if self.slot >= MAX_RING_SLOTS:
            raise ProtocolError(f"RING_WATCH slot {self.slot} (at most {MAX_RING_SLOTS - 1})")
        if self.entries and not (0 < self.entry_size <= MAX_ENTRY_SIZE and self.entries <= MAX_RING_ENTRIES
                                 and self.tail < self.entries
                                 and self.base + self.entries * self.entry_size <= 1 << 64):
            raise ProtocolError(f"RING_WATCH of {self.entries} entries of {self.entry_size} bytes at "
                                f"{self.base:#x}, tail {self.tail}")
        if self.pointer_bytes and not (self.pointer_bytes <= POINTED_PAGE
                                       and self.pointer_offset + 8 <= self.entry_size):
            raise ProtocolError(f"RING_WATCH pointer of {self.pointer_bytes} bytes at offset "
                                f"{self.pointer_offset} of {self.entry_size}-byte entries")
        if (self.shadow or self.event_index) and not (self.entries and self.shadow and self.event_index
                                                      and not self.shadow % 4 and not self.event_index % 4
                                                      and max(self.shadow, self.event_index) < (1 << 64) - 4):
            raise ProtocolError(f"RING_WATCH shadow doorbell at {self.shadow:#x}, event index at "
                                f"{self.event_index:#x} (both, dword aligned, of a ring)")
        return self

    @classmethod
    def unpack(cls, payload: bytes | memoryview) -> "RingWatch":
        if len(payload) == RING_WATCH_SHADOW_MSG.size:
            *fields, pointer, shadow, event_index = RING_WATCH_SHADOW_MSG.unpack(payload)
        elif len(payload) == RING_WATCH_MSG.size:
            *fields, pointer = RING_WATCH_MSG.unpack(payload)
            shadow = event_index = 0
        else:
            raise ProtocolError(f"RING_WATCH of {len(payload)} bytes (want {RING_WATCH_MSG.size} "
                                f"or {RING_WATCH_SHADOW_MSG.size})")
        return cls(*fields, pointer_offset=pointer & 0xFFFF, pointer_bytes=pointer >> 16, shadow=shadow,
                   event_index=event_index).check()


class Push(NamedTuple):
    """A DMA_PUSH, checked: ``ranges`` of ring entries and their ``data``; ``pointed``, the
    bytes those entries point to as (address, bytes), empty bytes where the host could not
    read them (forget what was pushed there before); ``pointed_unknown``: the entries point
    to bytes the push does not carry (forget every pointed range of the ring)."""

    slot: int
    ranges: list[tuple[int, int]]
    data: memoryview
    pointed: list[tuple[int, memoryview]]
    pointed_unknown: bool


def pack_push(slot: int, ranges: list[tuple[int, int]], pointed: list[tuple[int, int]] = (),
              pointed_unknown: bool = False) -> bytes:
    """The head of a DMA_PUSH: ``slot``, then ``ranges`` and ``pointed`` (address, length) as a
    DMA_READV lists them (the third field RANGE_RING or RANGE_POINTED); their bytes follow
    back to back, the ring's first."""
    count = len(ranges) + len(pointed) | (POINTED_UNKNOWN if pointed_unknown else 0)
    return PUSH_HEAD.pack(slot, count) + _pack_ranges(ranges, RANGE_RING) + _pack_ranges(pointed, RANGE_POINTED)


def unpack_push(payload: bytes | memoryview) -> Push:
    """A DMA_PUSH, checked: at most two ring ranges (a ring's interval wraps once), none
    empty, then at most MAX_POINTED pointed ranges (empty allowed: not readable), none of
    them wrapping the address space or a pointed one crossing a 4 KiB page, at most
    MAX_PUSH_BYTES of ring entries, and exactly the ranges' total of bytes after them.
    Whether the ring ranges lie in the watched ring is the box's check."""
    view = memoryview(payload)
    if len(view) < PUSH_HEAD.size:
        raise ProtocolError(f"DMA_PUSH of {len(view)} bytes: shorter than its head")
    slot, word = PUSH_HEAD.unpack_from(view)
    count = word & ~POINTED_UNKNOWN
    if slot >= MAX_RING_SLOTS or count > 2 + MAX_POINTED:
        raise ProtocolError(f"DMA_PUSH for slot {slot} with {count} ranges")
    head = PUSH_HEAD.size + count * READV_RANGE.size
    if len(view) < head:
        raise ProtocolError(f"DMA_PUSH of {count} ranges in {len(view)} bytes")
    ranges: list[tuple[int, int]] = []
    spans: list[tuple[int, int]] = []
    for i in range(count):
        address, length, kind = READV_RANGE.unpack_from(view, PUSH_HEAD.size + i * READV_RANGE.size)
        if address + length > 1 << 64 or kind not in (RANGE_RING, RANGE_POINTED) or (
                kind == RANGE_RING and (length == 0 or spans or len(ranges) == 2)) or (
                kind == RANGE_POINTED and length and (address % POINTED_PAGE) + length > POINTED_PAGE):
            raise ProtocolError(f"DMA_PUSH range {i}: {length} bytes at {address:#x}, kind {kind}")
        (ranges if kind == RANGE_RING else spans).append((address, length))
    if len(spans) > MAX_POINTED:
        raise ProtocolError(f"DMA_PUSH with {len(spans)} pointed ranges (at most {MAX_POINTED})")
    total = sum(map(operator.itemgetter(1), ranges))
    pointed_total = sum(map(operator.itemgetter(1), spans))
    if total > MAX_PUSH_BYTES or len(view) - head != total + pointed_total:
        raise ProtocolError(f"DMA_PUSH of {total + pointed_total} bytes carries {len(view) - head}")
    at = head + total
    pointed = []
    for address, length in spans:
        pointed.append((address, view[at:at + length]))
        at += length
    return Push(slot, ranges, view[head:head + total], pointed, bool(word & POINTED_UNKNOWN))
