"""vfio-user message codec: every message QEMU 11.1 sends or answers, both directions.

Layouts follow QEMU's ``docs/interop/vfio-user.rst`` and ``hw/vfio-user/protocol.h``
(checked against QEMU 11.1 on the wire; see docs/architecture.md, "QEMU"). All integers are
little-endian. This module only turns bytes into typed values and back: it does no I/O
and keeps no state, so it can be tested exhaustively and reused by the server, the
client and the network link.

Decoding never trusts a length: a payload shorter than its command needs raises
:class:`ProtocolError` carrying the errno to answer with.
"""

from __future__ import annotations

import enum
import errno
import json
import struct
from dataclasses import dataclass, field

HEADER = struct.Struct("<HHIII")  # msg_id, command, size (incl. header), flags, error
HEADER_SIZE = HEADER.size  # 16

# Header flags
TYPE_MASK = 0xF
TYPE_COMMAND = 0x0
TYPE_REPLY = 0x1
FLAG_NO_REPLY = 0x10
FLAG_ERROR = 0x20

MAX_DATA_XFER = 1 << 20  # what we advertise as max_data_xfer_size
MAX_MESSAGE = MAX_DATA_XFER + 4096  # anything larger is refused before it is read
MAX_MSG_FDS = 16
PAGE_SIZE = 4096


class Command(enum.IntEnum):
    VERSION = 1
    DMA_MAP = 2
    DMA_UNMAP = 3
    DEVICE_GET_INFO = 4
    DEVICE_GET_REGION_INFO = 5
    DEVICE_GET_REGION_IO_FDS = 6
    DEVICE_GET_IRQ_INFO = 7
    DEVICE_SET_IRQS = 8
    REGION_READ = 9
    REGION_WRITE = 10
    DMA_READ = 11
    DMA_WRITE = 12
    DEVICE_RESET = 13
    DIRTY_PAGES = 14
    REGION_WRITE_MULTI = 15


class ProtocolError(Exception):
    """A message we cannot accept; ``errno`` is what the error reply carries."""

    def __init__(self, message: str, err: int = errno.EINVAL) -> None:
        super().__init__(message)
        self.errno = err


@dataclass
class Header:
    msg_id: int
    command: int
    size: int
    flags: int = 0
    error: int = 0

    @property
    def is_reply(self) -> bool:
        return self.flags & TYPE_MASK == TYPE_REPLY

    @property
    def no_reply(self) -> bool:
        return bool(self.flags & FLAG_NO_REPLY)

    @property
    def is_error(self) -> bool:
        return bool(self.flags & FLAG_ERROR)

    def pack(self) -> bytes:
        return HEADER.pack(self.msg_id, self.command, self.size, self.flags, self.error)

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> "Header":
        if len(data) < HEADER_SIZE:
            raise ProtocolError(f"header of {len(data)} bytes, need {HEADER_SIZE}")
        return cls(*HEADER.unpack_from(data))


def message(msg_id: int, command: int, payload: bytes = b"", *, reply: bool = False,
            no_reply: bool = False) -> bytes:
    """Frame a payload with its header."""
    flags = (TYPE_REPLY if reply else TYPE_COMMAND) | (FLAG_NO_REPLY if no_reply else 0)
    return HEADER.pack(msg_id, command, HEADER_SIZE + len(payload), flags, 0) + payload


def message_parts(msg_id: int, command: int, parts: tuple, *, reply: bool = False,
                  no_reply: bool = False) -> bytes:
    """Frame a payload given as several buffers (e.g. a DMA header and the data): one copy
    of the data, where ``message(..., a + b)`` would make two."""
    flags = (TYPE_REPLY if reply else TYPE_COMMAND) | (FLAG_NO_REPLY if no_reply else 0)
    size = HEADER_SIZE + sum(len(part) for part in parts)
    return b"".join((HEADER.pack(msg_id, command, size, flags, 0), *parts))


def error_reply(msg_id: int, command: int, err: int) -> bytes:
    return HEADER.pack(msg_id, command, HEADER_SIZE, TYPE_REPLY | FLAG_ERROR, err)


def _need(payload: bytes | memoryview, size: int, what: str) -> None:
    if len(payload) < size:
        raise ProtocolError(f"{what}: payload of {len(payload)} bytes, need {size}")


# --- VERSION ---------------------------------------------------------------------

VERSION = struct.Struct("<HH")


@dataclass
class Version:
    major: int
    minor: int
    capabilities: dict = field(default_factory=dict)

    def pack(self) -> bytes:
        caps = json.dumps({"capabilities": self.capabilities}).encode() + b"\0"
        return VERSION.pack(self.major, self.minor) + caps

    @classmethod
    def unpack(cls, payload: bytes | memoryview) -> "Version":
        _need(payload, VERSION.size, "VERSION")
        major, minor = VERSION.unpack_from(payload)
        raw = bytes(payload[VERSION.size:]).split(b"\0", 1)[0]
        caps: dict = {}
        if raw:
            try:
                caps = json.loads(raw).get("capabilities", {})
            except (ValueError, AttributeError, RecursionError) as exc:  # RecursionError: nested too deep
                raise ProtocolError(f"VERSION capabilities are not usable JSON: {raw[:80]!r}") from exc
            if not isinstance(caps, dict):
                raise ProtocolError("VERSION capabilities is not an object")
        return cls(major, minor, caps)


# --- DMA_MAP / DMA_UNMAP -----------------------------------------------------------

DMA_MAP = struct.Struct("<IIQQQ")  # argsz, flags, offset, address, size
DMA_UNMAP = struct.Struct("<IIQQ")  # argsz, flags, address, size
DMA_FLAG_READ = 1 << 0
DMA_FLAG_WRITE = 1 << 1
DMA_UNMAP_GET_DIRTY = 1 << 0
DMA_UNMAP_ALL = 1 << 1


@dataclass
class DmaMap:
    flags: int
    offset: int
    address: int
    size: int

    @classmethod
    def unpack(cls, payload: bytes | memoryview) -> "DmaMap":
        _need(payload, DMA_MAP.size, "DMA_MAP")
        _argsz, flags, offset, address, size = DMA_MAP.unpack_from(payload)
        if size == 0 or address + size > 1 << 64:
            raise ProtocolError(f"DMA_MAP of bad range {address:#x}+{size:#x}")
        return cls(flags, offset, address, size)

    def pack(self) -> bytes:
        return DMA_MAP.pack(DMA_MAP.size, self.flags, self.offset, self.address, self.size)


@dataclass
class DmaUnmap:
    flags: int
    address: int
    size: int

    @classmethod
    def unpack(cls, payload: bytes | memoryview) -> "DmaUnmap":
        _need(payload, DMA_UNMAP.size, "DMA_UNMAP")
        _argsz, flags, address, size = DMA_UNMAP.unpack_from(payload)
        if flags & DMA_UNMAP_GET_DIRTY:
            raise ProtocolError("DMA_UNMAP dirty bitmaps are not supported", errno.ENOTSUP)
        return cls(flags, address, size)

    def pack(self) -> bytes:
        return DMA_UNMAP.pack(DMA_UNMAP.size, self.flags, self.address, self.size)


# --- device, region and irq info -----------------------------------------------------

DEVICE_INFO = struct.Struct("<IIII")  # argsz, flags, num_regions, num_irqs
DEVICE_FLAGS_RESET = 1 << 0
DEVICE_FLAGS_PCI = 1 << 1

REGION_INFO = struct.Struct("<IIIIQQ")  # argsz, flags, index, cap_offset, size, offset
REGION_FLAG_READ = 1 << 0
REGION_FLAG_WRITE = 1 << 1
REGION_FLAG_MMAP = 1 << 2
REGION_FLAG_CAPS = 1 << 3
REGION_INFO_CAP_SPARSE_MMAP = 1  # capability id (version 1): the parts of a region that may be mapped
CAP_HEADER = struct.Struct("<HHI")  # id, version, next (offset from the start of the info; 0: last)
SPARSE_HEADER = struct.Struct("<II")  # nr_areas, reserved
SPARSE_AREA = struct.Struct("<QQ")  # offset, size

IRQ_INFO = struct.Struct("<IIII")  # argsz, flags, index, count
IRQ_INFO_EVENTFD = 1 << 0
IRQ_INFO_MASKABLE = 1 << 1
IRQ_INFO_AUTOMASKED = 1 << 2
IRQ_INFO_NORESIZE = 1 << 3

# vfio-pci region and irq indexes
REGION_CONFIG = 7
NUM_REGIONS = 9  # BAR0-5, ROM, config, VGA
IRQ_INTX, IRQ_MSI, IRQ_MSIX, IRQ_ERR, IRQ_REQ = range(5)
NUM_IRQS = 5


def device_info_reply(num_regions: int = NUM_REGIONS, num_irqs: int = NUM_IRQS) -> bytes:
    return DEVICE_INFO.pack(DEVICE_INFO.size, DEVICE_FLAGS_PCI | DEVICE_FLAGS_RESET,
                            num_regions, num_irqs)


def unpack_index(payload: bytes | memoryview, what: str) -> int:
    """The ``index`` field of a GET_REGION_INFO / GET_IRQ_INFO request."""
    _need(payload, 12, what)
    return struct.unpack_from("<I", payload, 8)[0]


def region_info_reply(index: int, size: int, flags: int, *, offset: int = 0,
                      areas: list[tuple[int, int]] | None = None, argsz: int = REGION_INFO.size) -> bytes:
    """GET_REGION_INFO's reply. ``offset``: where the region starts in the file descriptor
    sent with a mappable region's reply; ``areas``: the (offset, size) parts that may be
    mapped, when not the whole region (a VFIO_REGION_INFO_CAP_SPARSE_MMAP capability).

    ``argsz`` is the client's: QEMU first asks with 32 bytes and takes no longer reply
    ("reply larger than recv buffer"), so a reply whose capability does not fit says how
    much it needs in ``argsz`` and carries no capability; QEMU asks again with that much."""
    if areas is None:
        return REGION_INFO.pack(REGION_INFO.size, flags, index, 0, size, offset)
    cap = (CAP_HEADER.pack(REGION_INFO_CAP_SPARSE_MMAP, 1, 0) + SPARSE_HEADER.pack(len(areas), 0)
           + b"".join(SPARSE_AREA.pack(o, n) for o, n in areas))
    needed = REGION_INFO.size + len(cap)
    if argsz < needed:
        return REGION_INFO.pack(needed, flags, index, 0, size, offset)
    return REGION_INFO.pack(needed, flags | REGION_FLAG_CAPS, index, REGION_INFO.size, size, offset) + cap


def unpack_sparse_areas(reply: bytes | memoryview) -> list[tuple[int, int]] | None:
    """The sparse-mmap areas of a GET_REGION_INFO reply (None: no such capability)."""
    _need(reply, REGION_INFO.size, "GET_REGION_INFO reply")
    argsz, flags, _index, cap_offset, _size, _offset = REGION_INFO.unpack_from(reply)
    seen = set()
    while flags & REGION_FLAG_CAPS and cap_offset and cap_offset not in seen:
        seen.add(cap_offset)
        _need(reply, cap_offset + CAP_HEADER.size + SPARSE_HEADER.size, "region capability")
        cap_id, _version, following = CAP_HEADER.unpack_from(reply, cap_offset)
        if cap_id == REGION_INFO_CAP_SPARSE_MMAP:
            count, _ = SPARSE_HEADER.unpack_from(reply, cap_offset + CAP_HEADER.size)
            start = cap_offset + CAP_HEADER.size + SPARSE_HEADER.size
            _need(reply, start + count * SPARSE_AREA.size, "sparse mmap areas")
            return [SPARSE_AREA.unpack_from(reply, start + i * SPARSE_AREA.size) for i in range(count)]
        cap_offset = following
    return None


def irq_info_reply(index: int, count: int, flags: int) -> bytes:
    return IRQ_INFO.pack(IRQ_INFO.size, flags, index, count)


# --- SET_IRQS ------------------------------------------------------------------------

IRQ_SET = struct.Struct("<IIIII")  # argsz, flags, index, start, count
IRQ_DATA_NONE = 1 << 0
IRQ_DATA_BOOL = 1 << 1
IRQ_DATA_EVENTFD = 1 << 2
IRQ_ACTION_MASK = 1 << 3
IRQ_ACTION_UNMASK = 1 << 4
IRQ_ACTION_TRIGGER = 1 << 5
IRQ_DATA_TYPES = IRQ_DATA_NONE | IRQ_DATA_BOOL | IRQ_DATA_EVENTFD
IRQ_ACTIONS = IRQ_ACTION_MASK | IRQ_ACTION_UNMASK | IRQ_ACTION_TRIGGER


@dataclass
class SetIrqs:
    flags: int
    index: int
    start: int
    count: int
    bools: bytes = b""

    @property
    def data_type(self) -> int:
        return self.flags & IRQ_DATA_TYPES

    @property
    def action(self) -> int:
        return self.flags & IRQ_ACTIONS

    @classmethod
    def unpack(cls, payload: bytes | memoryview) -> "SetIrqs":
        _need(payload, IRQ_SET.size, "SET_IRQS")
        _argsz, flags, index, start, count = IRQ_SET.unpack_from(payload)
        data, action = flags & IRQ_DATA_TYPES, flags & IRQ_ACTIONS
        if bin(data).count("1") != 1 or bin(action).count("1") != 1:
            raise ProtocolError(f"SET_IRQS flags {flags:#x}: need one data type and one action")
        if index >= NUM_IRQS:
            raise ProtocolError(f"SET_IRQS index {index} out of range")
        if start + count > 2048:
            raise ProtocolError(f"SET_IRQS range {start}+{count} out of range")
        bools = b""
        if data == IRQ_DATA_BOOL:
            _need(payload, IRQ_SET.size + count, "SET_IRQS bools")
            bools = bytes(payload[IRQ_SET.size:IRQ_SET.size + count])
        return cls(flags, index, start, count, bools)

    def pack(self) -> bytes:
        return IRQ_SET.pack(IRQ_SET.size + len(self.bools), self.flags, self.index,
                            self.start, self.count) + self.bools


# --- region access ---------------------------------------------------------------------

REGION_RW = struct.Struct("<QII")  # offset, region, count
WRITE_ONE = struct.Struct("<QII8s")  # offset, region, count, data[8]
MULTI_MAX = 200


@dataclass
class RegionAccess:
    region: int
    offset: int
    count: int
    data: bytes = b""

    @classmethod
    def unpack(cls, payload: bytes | memoryview, *, write: bool) -> "RegionAccess":
        _need(payload, REGION_RW.size, "REGION_READ/WRITE")
        offset, region, count = REGION_RW.unpack_from(payload)
        if count > MAX_DATA_XFER:
            raise ProtocolError(f"region access of {count} bytes", errno.E2BIG)
        data = b""
        if write:
            if len(payload) != REGION_RW.size + count:
                raise ProtocolError(f"REGION_WRITE count {count} but {len(payload) - REGION_RW.size} data bytes")
            data = bytes(payload[REGION_RW.size:])
        return cls(region, offset, count, data)

    def pack(self) -> bytes:
        return REGION_RW.pack(self.offset, self.region, self.count) + self.data


def iter_write_multi(payload: bytes | memoryview):
    """(offset, region, count, data[8]) of each write of a REGION_WRITE_MULTI, checked."""
    _need(payload, 8, "REGION_WRITE_MULTI")
    (n,) = struct.unpack_from("<Q", payload)
    if n > MULTI_MAX or len(payload) < 8 + n * WRITE_ONE.size:
        raise ProtocolError(f"REGION_WRITE_MULTI of {n} writes in {len(payload)} bytes")
    for entry in WRITE_ONE.iter_unpack(memoryview(payload)[8:8 + n * WRITE_ONE.size]):
        if not 0 < entry[2] <= 8:
            raise ProtocolError(f"REGION_WRITE_MULTI entry of {entry[2]} bytes")
        yield entry


def unpack_write_multi(payload: bytes | memoryview) -> list[RegionAccess]:
    return [RegionAccess(region, offset, count, data[:count])
            for offset, region, count, data in iter_write_multi(payload)]


def pack_write_multi(writes: list[RegionAccess]) -> bytes:
    return struct.pack("<Q", len(writes)) + b"".join(
        WRITE_ONE.pack(w.offset, w.region, w.count, w.data.ljust(8, b"\0")) for w in writes)


# --- DMA_READ / DMA_WRITE (server -> client) -----------------------------------------
# Spec layout: address u64, count u64, data. (QEMU's struct has a u32 count and
# padding: the same bytes for counts below 4 GiB.)

DMA_RW = struct.Struct("<QQ")


@dataclass
class DmaAccess:
    address: int
    count: int
    data: bytes = b""

    @classmethod
    def unpack(cls, payload: bytes | memoryview, *, with_data: bool) -> "DmaAccess":
        _need(payload, DMA_RW.size, "DMA_READ/WRITE")
        address, count = DMA_RW.unpack_from(payload)
        count &= 0xFFFFFFFF
        if count > MAX_DATA_XFER:
            raise ProtocolError(f"DMA access of {count} bytes", errno.E2BIG)
        data: bytes | memoryview = b""
        if with_data:
            data = memoryview(payload)[DMA_RW.size:DMA_RW.size + count]  # a view: no copy of the data
            if len(data) != count:
                raise ProtocolError(f"DMA data of {len(data)} bytes, expected {count}")
        return cls(address, count, data)

    @classmethod
    def answer(cls, payload: bytes | memoryview, address: int, count: int) -> memoryview:
        """The data of a DMA_READ reply, if it answers the read of ``count`` bytes at
        ``address`` (that address, that many bytes); else ProtocolError. A device must never
        get a short buffer to parse (scripts/fuzz.py found one: 2 bytes for a 64-byte fetch)."""
        got = cls.unpack(payload, with_data=True)
        if got.address != address or got.count != count:
            raise ProtocolError(f"a DMA read of {count} bytes at {address:#x} answered with "
                                f"{got.count} bytes at {got.address:#x}")
        return got.data  # type: ignore[return-value]

    def pack(self) -> bytes:
        return DMA_RW.pack(self.address, self.count) + self.data

    def parts(self) -> tuple:
        """The payload as (header, data) for :func:`message_parts`."""
        return DMA_RW.pack(self.address, self.count), self.data
