"""Accel: a compute accelerator whose PCIe behaviour looks like a GPU's.

BAR0 (4 KiB) holds the registers; BAR2 is VRAM, a 64-bit prefetchable BAR (1 GiB by
default) backed by sparse memory, held wherever the device is served (on a GPU box, in
the box). Work reaches it as it reaches a real GPU: the driver writes fixed-size
command entries into a ring in guest memory and writes the new tail to DOORBELL; the
device fetches every entry between head and tail by DMA (one ``read_many`` per batch,
so a doorbell costs one round trip on a remote port), runs them in order on its worker
thread, and completes by DMA-writing a fence value to guest memory and raising an
interrupt when the entry asks. Kernels run through :mod:`qemu_device.accel_kernels`.

A bad command (unknown opcode, VRAM range outside VRAM, a shape that does not fit, a
DMA outside the guest's windows) stops the ring at that entry with an error the driver
reads from ERROR_* and clears with ERROR_CLEAR (which skips the entry and resumes);
nothing a guest writes can crash whoever serves the device. The register map and the
command format are in docs/devices/accel.md.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from dataclasses import dataclass
from typing import ContextManager

import numpy as np

from .accel_kernels import KernelBackend, from_bf16, get_backend, to_bf16
from .bars import BarSpec
from .device import BegunFetch, IrqConfig, PciFunction
from .header import PciIdentity
from .ports import DmaError, Ring
from .registers import read_registers, write_registers
from .sparse_memory import SparseMemory
from .worker import DeviceWorker

log = logging.getLogger(__name__)

VENDOR_ID = 0x1B36
DEVICE_ID = 0x10F2
CLASS_CODE = 0x120000   # processing accelerator
REVISION = 1

REGISTER_BAR = 0
VRAM_BAR = 2
REGISTER_BAR_SIZE = 4096
DEFAULT_VRAM_SIZE = 1 << 30
VRAM_PAGE = 64 << 10             # VRAM is allocated on first write, in pieces of this size
VECTORS = 4

# BAR0 registers (32-bit; 64-bit values as LO/HI pairs)
REG_ID = 0x000
REG_VERSION = 0x004
REG_CAPS = 0x008
REG_ENTRY_SIZE = 0x00C
REG_VRAM_SIZE_LO = 0x010
REG_VRAM_SIZE_HI = 0x014
REG_MAX_RING = 0x018
REG_MAX_SG = 0x01C
REG_CONTROL = 0x020
REG_STATUS = 0x024
REG_RING_BASE_LO = 0x028
REG_RING_BASE_HI = 0x02C
REG_RING_SIZE = 0x030
REG_RING_HEAD = 0x034
REG_RING_TAIL = 0x038
REG_DOORBELL = 0x03C
REG_IRQ_CAUSE = 0x040
REG_IRQ_MASK = 0x044
REG_ERROR_CODE = 0x048
REG_ERROR_INDEX = 0x04C
REG_ERROR_OPCODE = 0x050
REG_ERROR_CLEAR = 0x054
REG_ERROR_INFO_LO = 0x058
REG_ERROR_INFO_HI = 0x05C
REG_COMPLETED_LO = 0x060
REG_COMPLETED_HI = 0x064
REG_FENCE_LO = 0x068
REG_FENCE_HI = 0x06C
REG_TIME_LO = 0x070
REG_TIME_HI = 0x074
REG_ERROR_COUNT = 0x078

ID_VALUE = 0xD0C5AC01
VERSION_VALUE = 0x00010000
CAP_GEMM_FP32, CAP_BF16, CAP_TIMESTAMP, CAP_SCATTER, CAP_TRAINING, CAP_INLINE = (1 << n for n in range(6))
CAPS_VALUE = CAP_GEMM_FP32 | CAP_BF16 | CAP_TIMESTAMP | CAP_SCATTER | CAP_TRAINING | CAP_INLINE

CONTROL_ENABLE = 1 << 0
CONTROL_RESET = 1 << 1           # engine reset: ring, error, counters (VRAM kept)
STATUS_ENABLED, STATUS_BUSY, STATUS_ERROR = 1 << 0, 1 << 1, 1 << 2
CAUSE_COMPLETION, CAUSE_ERROR = 1 << 0, 1 << 1

ENTRY_SIZE = 64
MAX_RING = 1 << 16               # entries
MAX_FETCH = 8192                 # entries fetched per DMA batch (512 KiB: room for a whole inline copy)
MAX_INLINE = 256 << 10           # bytes of one COPY_INLINE (4096 entries of data)
MAX_SG = 4096                    # scatter-list entries per copy
SG_ENTRY = 16                    # u64 guest address, u64 length
COPY_BATCH = 16 << 20            # bytes per read_many/write_many of a copy (bounds the box's memory)
MAX_DIM = 1 << 24                # any one dimension of a kernel

# Command entry: u8 opcode, u8 flags, u8 vector, u8 dtype, u32 reserved, u64 args[7]
ENTRY = struct.Struct("<BBBBI7Q")
assert ENTRY.size == ENTRY_SIZE

OP_NOP = 0x00
OP_COPY_H2D = 0x01      # a0 host addr (SG: list addr), a1 length (SG: entries), a2 VRAM dst
OP_COPY_D2H = 0x02      # a0 host addr (SG: list addr), a1 length (SG: entries), a2 VRAM src
OP_COPY_D2D = 0x03      # a0 VRAM src, a1 VRAM dst, a2 length
OP_FILL = 0x04          # a0 VRAM dst, a1 length, a2 u32 pattern (little-endian, repeated)
OP_FENCE = 0x05         # a0 guest addr, a1 u64 value written there
OP_TIMESTAMP = 0x06     # a0 guest addr: u64 device time in ns written there
OP_COPY_INLINE = 0x07   # a0 VRAM dst, a1 length: the bytes are the ring's next ceil(a1 / 64) entries
OP_GEMM = 0x10          # a0 A, a1 B, a2 C, a3 M, a4 N, a5 K: C(MxN) = op(A) @ op(B) (+ C)
OP_BIAS_ADD = 0x11      # a0 X, a1 bias, a2 Y, a3 rows, a4 cols
OP_ADD = 0x12           # a0 X, a1 Y, a2 Z, a3 n
OP_MUL = 0x13           # a0 X, a1 Y, a2 Z, a3 n
OP_RELU = 0x14          # a0 X, a2 Y, a3 n
OP_GELU = 0x15          # a0 X, a2 Y, a3 n
OP_SOFTMAX = 0x16       # a0 X, a2 Y, a3 rows, a4 cols
OP_LAYER_NORM = 0x17    # a0 X, a1 gamma, a2 Y, a3 rows, a4 cols, a5 beta, a6 eps (f32 bits; 0: 1e-5)
OP_RELU_GRAD = 0x18     # a0 X, a1 dY, a2 dX, a3 n
OP_AXPY = 0x19          # a0 X, a1 Y, a2 Z, a3 n, a4 alpha (f32 bits): Z = X + alpha * Y
OP_SUM_ROWS = 0x1A      # a0 X, a2 Y, a3 rows, a4 cols: Y(cols) = column sums of X

FLAG_INTERRUPT = 1 << 0  # raise the entry's vector (IRQ_CAUSE.COMPLETION) when done
FLAG_SG = 1 << 1         # copies: a0/a1 name a scatter list
FLAG_ACCUMULATE = 1 << 2  # GEMM: C += A @ B
FLAG_TRANS_A = 1 << 3    # GEMM: A is stored K x M
FLAG_TRANS_B = 1 << 4    # GEMM: B is stored N x K
FLAG_AFFINE = 1 << 5     # layer norm: apply gamma and beta

DTYPE_F32, DTYPE_BF16 = 0, 1
DTYPE_BYTES = {DTYPE_F32: 4, DTYPE_BF16: 2}

# ERROR_CODE values
ERR_NONE = 0
ERR_BAD_OPCODE = 1
ERR_VRAM_RANGE = 2
ERR_BAD_SHAPE = 3
ERR_DMA_FAULT = 4
ERR_BAD_RING = 5
ERR_BAD_DOORBELL = 6
ERR_BAD_DTYPE = 7
ERR_BAD_SG = 8
ERR_BAD_INLINE = 9
ERR_INTERNAL = 0xFF

U32 = 0xFFFF_FFFF
U64 = (1 << 64) - 1


class CommandError(Exception):
    """A command the device refuses: ``code`` (ERR_*) and ``info`` (the offending
    address, offset or size) go to ERROR_CODE / ERROR_INFO."""

    def __init__(self, code: int, info: int = 0, why: str = "") -> None:
        super().__init__(why or f"error {code}")
        self.code, self.info = code, info & U64


class _Cancelled(Exception):
    """The device was reset while the command ran: drop its results."""


POSTING_OPS = frozenset({OP_NOP, OP_COPY_D2H, OP_FENCE, OP_TIMESTAMP})
"""Entries that only post to the guest (DMA writes, the interrupts they ask for): a run of
them leaves together (a copy back, then its fence: one network write on a box)."""

AWAITED_OPS = frozenset({OP_COPY_D2H, OP_FENCE})
"""Posting entries a driver waits for (data, a fence value); timestamps and NOPs it only
reads after a fence, so they may wait in a run for the next fence."""


class _PostedRuns:
    """The worker's posted-together block over a run of :data:`POSTING_OPS` entries, ended
    at the batch's end and before any other entry (a kernel computes for milliseconds, a
    copy in waits on the guest) once the run holds something a driver waits for
    (:data:`AWAITED_OPS`, an interrupt) or the entry asks for an interrupt itself: those
    must not wait with it. A run of only timestamps stays open across kernels: on a box a
    pass's first timestamp then leaves with its copy back and fence, not alone (one write
    less, and one wake-up less of the host's forwarder while the box computes)."""

    def __init__(self, device: PciFunction) -> None:
        self._device = device
        self._block: ContextManager[None] | None = None
        self._awaited = False   # the open run holds data, a fence or an interrupt

    def before(self, entry: "Entry") -> None:
        if entry.opcode not in POSTING_OPS:
            if self._awaited or entry.flags & FLAG_INTERRUPT:
                self.end()
            return
        if self._block is None:
            self._block = self._device.dma_posted_together()
            self._block.__enter__()
        self._awaited = self._awaited or entry.opcode in AWAITED_OPS or bool(entry.flags & FLAG_INTERRUPT)

    def end(self) -> None:
        block, self._block, self._awaited = self._block, None, False
        if block is not None:
            block.__exit__(None, None, None)


@dataclass(frozen=True)
class Entry:
    opcode: int
    flags: int
    vector: int
    dtype: int
    args: tuple[int, ...]

    @classmethod
    def decode(cls, raw: bytes) -> "Entry":
        opcode, flags, vector, dtype, _, *args = ENTRY.unpack(raw)
        return cls(opcode, flags, vector, dtype, tuple(args))


def encode_entry(opcode: int, *args: int, flags: int = 0, vector: int = 0, dtype: int = DTYPE_F32) -> bytes:
    """One 64-byte command entry (for drivers and tests); missing args are 0."""
    padded = [a & U64 for a in args] + [0] * (7 - len(args))
    return ENTRY.pack(opcode, flags, vector, dtype, 0, *padded)


def _cut(pieces: list[tuple[int, int]], views: list[memoryview]):
    """(guest address, bytes) for DMA writes of ``views`` (back to back) into ``pieces``:
    each piece cut where a view ends and each view where a piece ends."""
    views = iter(views)
    view = memoryview(b"")
    for addr, length in pieces:
        done = 0
        while done < length:
            if not view:
                view = next(views)
            n = min(len(view), length - done)
            yield addr + done, view[:n]
            view, done = view[n:], done + n


def f32_bits(value: float) -> int:
    """A float32's bit pattern, as the kernels' float arguments take it."""
    return struct.unpack("<I", struct.pack("<f", value))[0]


def _bits_f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & U32))[0]


class OperandBuffers:
    """The buffers a kernel's operands are loaded into, kept from one entry to the next.

    Why: a fresh multi-megabyte buffer per operand (a 4 MiB weight, every GEMM) is a page
    fault for each 4 KiB of it once glibc hands the memory back between entries: 4.6-4.8
    ms to load 4 MiB against 0.3 ms into a buffer kept, and how often it happened depended
    on the heap's history, so one process ran a pass 1.5-2x slower than another. Only the
    device's worker loads operands, one entry at a time: ``release`` at each entry makes
    every buffer free again (a kernel's inputs are dead once its result is stored)."""

    def __init__(self) -> None:
        self._buffers: list[np.ndarray] = []
        self._used = 0

    def release(self) -> None:
        self._used = 0

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 array of ``nbytes``, not handed out since the last ``release``."""
        if self._used == len(self._buffers):
            self._buffers.append(np.empty(0, dtype=np.uint8))
        buffer = self._buffers[self._used]
        if buffer.size < nbytes:
            buffer = self._buffers[self._used] = np.empty(max(nbytes, 2 * buffer.size), dtype=np.uint8)
        self._used += 1
        return buffer[:nbytes]


class AccelDevice(PciFunction):
    """The accelerator (1b36:10f2, class 120000). ``close()`` stops its worker.

    ``vram_size``: VRAM bytes (a power of two, 64 KiB to 64 GiB); ``backend``: the
    kernels' backend (numpy, cupy, torch); ``threads``: numpy's BLAS threads.
    """

    def __init__(self, *, vram_size: int = DEFAULT_VRAM_SIZE, backend: str = "numpy", threads: int = 1,
                 config_size: int = 4096, pcie: bool = True) -> None:
        vram_size = int(vram_size)
        if vram_size < 1 << 16:
            raise ValueError(f"vram_size must be at least 64 KiB, not {vram_size}")
        identity = PciIdentity(VENDOR_ID, DEVICE_ID, CLASS_CODE, REVISION)
        bars = [BarSpec(REGISTER_BAR, REGISTER_BAR_SIZE, "mem32"),
                BarSpec(VRAM_BAR, vram_size, "mem64", prefetchable=True)]
        super().__init__(identity, bars, IrqConfig(intx=True, msi_vectors=VECTORS),
                         config_size=config_size, pcie=pcie)
        threads = int(threads)
        if threads < 1:
            raise ValueError(f"threads must be at least 1, not {threads}")
        self.backend: KernelBackend = get_backend(str(backend), threads)
        self.vram_size = vram_size
        self.vram = SparseMemory(vram_size, VRAM_PAGE)
        self._operands = OperandBuffers()
        self.worker = DeviceWorker(f"accel-{id(self):x}")
        self._idle = threading.Condition(self.lock)
        self._t0 = time.monotonic_ns()
        self._generation = 0
        self.counters = {"doorbells": 0, "fetches": 0, "entries": 0, "errors": 0,
                         "doorbells_ignored": 0, "h2d_bytes": 0, "d2h_bytes": 0,
                         "inline_copies": 0, "inline_bytes": 0,
                         "kernel_ns": 0, "dma_ns": 0, "fetch_ns": 0, "copy_reads": 0, "copy_writes": 0,
                         "interrupts": 0}
        self.opcode_counts: dict[int, int] = {}
        with self.lock:
            self.reset_registers()

    def close(self, timeout: float = 2.0) -> bool:
        """Stop the worker; True if it ended within ``timeout`` seconds."""
        return self.worker.close(timeout)

    def capacity_bytes(self) -> int:
        """What the pool's inventory reports: the VRAM."""
        return self.vram_size

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """Wait until the ring is drained or stopped on an error; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._scheduled, timeout)

    def stats(self) -> dict:
        with self.lock:
            return {**self.counters, "completed": self._completed, "error": self._error_code,
                    "vram_resident_bytes": self.vram.resident_bytes, "backend": self.backend.name,
                    "suppressed_interrupts": self.suppressed_interrupts,
                    "opcodes": {f"{op:#04x}": n for op, n in sorted(self.opcode_counts.items())}}

    def device_time_ns(self) -> int:
        return time.monotonic_ns() - self._t0

    # -- PciFunction hooks ---------------------------------------------------------------

    def reset_registers(self) -> None:
        """Power-on values; VRAM is cleared, so nothing leaks from one lease to the next."""
        self._reset_engine()
        self._irq_mask = 0
        self._cause = 0
        self.vram.clear()

    def _reset_engine(self) -> None:
        self._generation += 1          # cancels whatever the worker is running
        self._enabled = False
        self._ring_base = 0
        self._ring_size = 0
        self._head = self._tail = 0
        self._error_code = ERR_NONE
        self._error_index = self._error_opcode = self._error_info = 0
        self._error_count = 0
        self._error_skip = 1           # entries ERROR_CLEAR skips: an inline copy's data with it
        self._completed = 0
        self._fence = 0
        self._time_hi = 0
        self._scheduled = False
        self._fetch_begun: BegunFetch | None = None   # the first fetch, begun by the doorbell
        self._idle.notify_all()
        self.dma_watch_ring(0, None)

    def bar_read(self, index: int, offset: int, size: int) -> int | bytes:
        if index == VRAM_BAR:
            return self.vram.read(offset, size)
        return read_registers(self._read_register, offset, size)

    def bar_write(self, index: int, offset: int, data: bytes) -> None:
        if index == VRAM_BAR:
            self.vram.write(offset, data)
            return
        write_registers(self._write_register, offset, data)

    # -- registers -------------------------------------------------------------------------

    def _status(self) -> int:
        return ((STATUS_ENABLED if self._enabled else 0) | (STATUS_BUSY if self._scheduled else 0)
                | (STATUS_ERROR if self._error_code else 0))

    def _read_register(self, reg: int) -> int:
        if reg == REG_TIME_LO:
            now = self.device_time_ns()
            self._time_hi = now >> 32       # reading LO latches HI, so the pair is consistent
            return now & U32
        fixed = {
            REG_ID: ID_VALUE, REG_VERSION: VERSION_VALUE, REG_CAPS: CAPS_VALUE,
            REG_ENTRY_SIZE: ENTRY_SIZE, REG_VRAM_SIZE_LO: self.vram_size & U32,
            REG_VRAM_SIZE_HI: self.vram_size >> 32, REG_MAX_RING: MAX_RING, REG_MAX_SG: MAX_SG,
            REG_CONTROL: CONTROL_ENABLE if self._enabled else 0, REG_STATUS: self._status(),
            REG_RING_BASE_LO: self._ring_base & U32, REG_RING_BASE_HI: self._ring_base >> 32,
            REG_RING_SIZE: self._ring_size, REG_RING_HEAD: self._head, REG_RING_TAIL: self._tail,
            REG_IRQ_CAUSE: self._cause, REG_IRQ_MASK: self._irq_mask,
            REG_ERROR_CODE: self._error_code, REG_ERROR_INDEX: self._error_index,
            REG_ERROR_OPCODE: self._error_opcode, REG_ERROR_INFO_LO: self._error_info & U32,
            REG_ERROR_INFO_HI: self._error_info >> 32, REG_COMPLETED_LO: self._completed & U32,
            REG_COMPLETED_HI: self._completed >> 32 & U32, REG_FENCE_LO: self._fence & U32,
            REG_FENCE_HI: self._fence >> 32, REG_TIME_HI: self._time_hi & U32,
            REG_ERROR_COUNT: self._error_count & U32,
        }
        return fixed.get(reg, 0)   # write-only (DOORBELL, ERROR_CLEAR) and unused offsets: 0

    def _write_register(self, reg: int, value: int, lanes: int) -> None:
        if reg in (REG_RING_BASE_LO, REG_RING_BASE_HI, REG_RING_SIZE):
            if self._enabled:
                return       # the ring is fixed while enabled
            if reg == REG_RING_SIZE:
                self._ring_size = (self._ring_size & ~lanes) | (value & lanes)
            else:
                shift = 32 if reg == REG_RING_BASE_HI else 0
                old = self._ring_base >> shift & U32
                new = (old & ~lanes) | (value & lanes)
                self._ring_base = (self._ring_base & ~(U32 << shift)) | (new << shift)
        elif reg == REG_CONTROL:
            if not lanes & 0xFF:
                return       # the control bits live in the low byte
            if value & CONTROL_RESET:
                self._reset_engine()
            elif value & CONTROL_ENABLE:
                if not self._enabled:
                    self._enable()
            else:
                self._enabled = False   # the worker stops after the entry it runs
        elif reg == REG_DOORBELL:
            self._doorbell(value)
        elif reg == REG_IRQ_CAUSE:
            self._cause &= ~value
            if not self._cause:
                self.lower_interrupt()
        elif reg == REG_IRQ_MASK:
            self._irq_mask = (self._irq_mask & ~lanes) | (value & lanes)
        elif reg == REG_ERROR_CLEAR:
            if value & 1 and self._error_code:
                self._clear_error()
        # read-only and unused registers ignore writes

    def _enable(self) -> None:
        size, base = self._ring_size, self._ring_base
        if not 2 <= size <= MAX_RING or size & (size - 1) or base % ENTRY_SIZE or base + size * ENTRY_SIZE > 1 << 64:
            self._set_error(0, 0, ERR_BAD_RING, base if base % ENTRY_SIZE else size)
            return
        self._enabled = True
        self._head = self._tail = 0
        # on a box the host then sends a doorbell's entries with it: the fetch waits for no round trip
        self.dma_watch_ring(0, Ring(0, REG_DOORBELL, base, ENTRY_SIZE, size))

    def _doorbell(self, tail: int) -> None:
        self.counters["doorbells"] += 1
        if not self._enabled:
            self.counters["doorbells_ignored"] += 1
            return
        if tail >= self._ring_size:
            self._set_error(self._head, 0, ERR_BAD_DOORBELL, tail)
            return
        self._tail = tail
        self._kick()

    def _clear_error(self) -> None:
        """ERROR_CLEAR: forget the error, skip the entry that caused it, go on."""
        if self._enabled and self._error_index == self._head and self._error_code not in (
                ERR_BAD_RING, ERR_BAD_DOORBELL):
            self._head = (self._head + self._error_skip) % self._ring_size
        self._error_skip = 1
        self._error_code = ERR_NONE
        self._error_index = self._error_opcode = self._error_info = 0
        self._cause &= ~CAUSE_ERROR
        if not self._cause:
            self.lower_interrupt()
        self._kick()

    def _set_error(self, index: int, opcode: int, code: int, info: int, skip: int = 1) -> None:
        if self._error_code == ERR_NONE:   # the first error is what the driver reads
            self._error_code, self._error_index, self._error_opcode = code, index, opcode
            self._error_info = info & U64
            self._error_skip = skip
        self._error_count += 1
        self.counters["errors"] += 1
        self._signal(CAUSE_ERROR, 0)

    def _signal(self, cause: int, vector: int) -> None:
        self._cause |= cause
        if not self._irq_mask & cause:
            self.counters["interrupts"] += 1
            self.raise_interrupt(vector)

    # -- the ring ----------------------------------------------------------------------------

    def _kick(self) -> None:
        """Schedule the worker if there is work and it is not already on it (lock held)."""
        if self._scheduled or not self._enabled or self._error_code or self._head == self._tail:
            return
        self._scheduled = True
        generation = self._generation
        # on a network the fetch's requests leave from the thread that took the doorbell:
        # the worker's wake-up overlaps their round trip instead of preceding it
        head, count = self._head, min((self._tail - self._head) % self._ring_size, MAX_FETCH)
        self._fetch_begun = self.dma_fetch_begin(head, count, self._ring_pieces(head, count))
        self.worker.submit(lambda: self._drain(generation))

    def _ring_pieces(self, head: int, count: int) -> list[tuple[int, int]]:
        """The guest ranges of ``count`` entries from ``head``: two where they wrap."""
        base, size = self._ring_base, self._ring_size
        first = min(count, size - head)
        pieces = [(base + head * ENTRY_SIZE, first * ENTRY_SIZE)]
        if count > first:
            pieces.append((base, (count - first) * ENTRY_SIZE))
        return pieces

    def _drain(self, generation: int) -> None:
        """Worker: fetch and run entries until the ring is empty, stopped or reset."""
        while True:
            with self.lock:
                if generation != self._generation:
                    return
                if not self._enabled or self._error_code or self._head == self._tail:
                    self._scheduled = False
                    self._idle.notify_all()
                    return
                head, size, base = self._head, self._ring_size, self._ring_base
                count = min((self._tail - head) % size, MAX_FETCH)
                begun, self._fetch_begun = self._fetch_begun, None
                if begun is not None and begun.covers(head, count):
                    count, finish = begun.count, begun.finish   # what the doorbell fetched; the rest next round
                else:
                    pieces = self._ring_pieces(head, count)
                    finish = lambda: self.dma_read_many(pieces)   # noqa: E731
            try:
                started = time.monotonic_ns()
                raw = b"".join(finish())
                spent = time.monotonic_ns() - started
                self.counters["dma_ns"] += spent
                self.counters["fetch_ns"] += spent
            except DmaError as exc:
                log.debug("accel ring fetch fault: %s", exc)
                with self.lock:
                    if generation == self._generation:
                        self._set_error(head, 0, ERR_DMA_FAULT, base + head * ENTRY_SIZE)
                continue
            self.counters["fetches"] += 1
            runs = _PostedRuns(self)   # entries that only post to the guest leave as one write
            try:
                i = 0
                while i < count:
                    index = (head + i) % size
                    entry = Entry.decode(raw[i * ENTRY_SIZE:(i + 1) * ENTRY_SIZE])
                    runs.before(entry)
                    used = 1       # ring entries this command takes: an inline copy's data too
                    try:
                        if entry.opcode == OP_COPY_INLINE:
                            used += self._inline_entries(entry)
                            if i + used > count:
                                if i > 0 or count < MAX_FETCH:
                                    break      # fetch again from this entry: its data is past the batch
                                raise CommandError(ERR_BAD_INLINE, entry.args[1], "inline data past the fetch")
                            self._op_copy_inline(entry, memoryview(raw)[(i + 1) * ENTRY_SIZE:(i + used) * ENTRY_SIZE],
                                                 generation)   # a view: VRAM takes the only copy
                        else:
                            self._execute(entry, generation)
                    except _Cancelled:
                        return
                    except CommandError as exc:
                        log.debug("accel command %#x at %d refused: %s", entry.opcode, index, exc)
                        with self.lock:
                            if generation == self._generation:
                                self._set_error(index, entry.opcode, exc.code, exc.info, used)
                        break
                    with self.lock:
                        if generation != self._generation:
                            return
                        i += used
                        self._head = (index + used) % size
                        self._completed += 1
                        self.counters["entries"] += 1
                        self.opcode_counts[entry.opcode] = self.opcode_counts.get(entry.opcode, 0) + 1
                        if entry.flags & FLAG_INTERRUPT:
                            self._signal(CAUSE_COMPLETION, entry.vector)
                        if not self._enabled:
                            break       # CONTROL.ENABLE cleared: the rest of the batch waits
                else:
                    continue
            finally:
                runs.end()
            with self.lock:     # stopped inside the batch: an error, a disable, or an inline copy
                if generation == self._generation and self._head == head and not self._error_code \
                        and self._enabled and (self._tail - head) % size == count:
                    # an inline copy's data not yet doorbelled: the driver rang a tail inside it
                    self._set_error(head, OP_COPY_INLINE, ERR_BAD_INLINE, count)

    # -- commands ---------------------------------------------------------------------------

    def _execute(self, entry: Entry, generation: int) -> None:
        """Run one entry; CommandError for anything the device refuses."""
        try:
            handler = self._HANDLERS.get(entry.opcode)
            if handler is None:
                raise CommandError(ERR_BAD_OPCODE, entry.opcode, f"unknown opcode {entry.opcode:#x}")
            self._operands.release()
            handler(self, entry, generation)
        except (CommandError, _Cancelled):
            raise
        except DmaError as exc:
            raise CommandError(ERR_DMA_FAULT, getattr(exc, "addr", 0), str(exc)) from exc
        except Exception as exc:   # a bug must not take the box down: report it as an error
            log.exception("accel command %#x failed", entry.opcode)
            raise CommandError(ERR_INTERNAL, 0, str(exc)) from exc

    def _check_vram(self, offset: int, length: int) -> None:
        if length < 0 or offset < 0 or offset + length > self.vram_size:
            raise CommandError(ERR_VRAM_RANGE, offset,
                               f"VRAM [{offset:#x}, +{length:#x}) outside {self.vram_size:#x} bytes")

    def _vram_write(self, generation: int, offset: int, data: bytes | memoryview) -> None:
        with self.lock:
            if generation != self._generation:
                raise _Cancelled()
            self.vram.write(offset, data)

    def _vram_read_into(self, generation: int, offset: int, out: memoryview) -> None:
        with self.lock:
            if generation != self._generation:
                raise _Cancelled()
            self.vram.read_into(offset, out)

    def _vram_views(self, generation: int, offset: int, length: int) -> list[memoryview]:
        with self.lock:
            if generation != self._generation:
                raise _Cancelled()
            return self.vram.views(offset, length)

    def _host_pieces(self, entry: Entry) -> list[tuple[int, int]]:
        """The guest ranges of a copy: one (a0, a1), or the scatter list at a0 of a1 entries."""
        a0, a1 = entry.args[0], entry.args[1]
        if not entry.flags & FLAG_SG:
            if a1 < 1:
                raise CommandError(ERR_BAD_SG, a1, "a copy of 0 bytes")
            return [(a0, a1)]
        if not 1 <= a1 <= MAX_SG:
            raise CommandError(ERR_BAD_SG, a1, f"scatter list of {a1} entries (1 to {MAX_SG})")
        raw = self.dma_read(a0, a1 * SG_ENTRY)
        pieces = list(struct.iter_unpack("<QQ", raw))
        for addr, length in pieces:
            if length < 1 or addr + length > 1 << 64:
                raise CommandError(ERR_BAD_SG, length, f"scatter-list entry {addr:#x}+{length:#x}")
        return pieces

    @staticmethod
    def _batches(pieces: list[tuple[int, int]]):
        """Split pieces into groups of at most COPY_BATCH bytes, cutting large pieces:
        (position in the copy, [(addr, length), ...]) per group."""
        group: list[tuple[int, int]] = []
        group_pos = pos = filled = 0
        for addr, length in pieces:
            done = 0
            while done < length:
                n = min(length - done, COPY_BATCH - filled)
                group.append((addr + done, n))
                done += n
                filled += n
                if filled == COPY_BATCH:
                    yield group_pos, group
                    group, group_pos, filled = [], pos + done, 0
            pos += length
        if group:
            yield group_pos, group

    def _op_copy_h2d(self, entry: Entry, generation: int) -> None:
        """Each completion goes into VRAM as it arrives (``dma_read_into``): on a box no
        16 MiB buffer to fill, zero and copy out again."""
        pieces = self._host_pieces(entry)
        dst = entry.args[2]
        self._check_vram(dst, sum(length for _, length in pieces))
        for pos, group in self._batches(pieces):
            started = time.monotonic_ns()
            at = dst + pos
            self.dma_read_into(group, lambda off, data: self._vram_write(generation, at + off, data))
            self.counters["dma_ns"] += time.monotonic_ns() - started
            self.counters["copy_reads"] += 1
            self.counters["h2d_bytes"] += sum(n for _, n in group)

    def _inline_entries(self, entry: Entry) -> int:
        """The ring entries an inline copy's data takes (checked: 1 to MAX_INLINE bytes)."""
        length = entry.args[1]
        if not 1 <= length <= MAX_INLINE:
            raise CommandError(ERR_BAD_INLINE, length, f"an inline copy of {length} bytes (1 to {MAX_INLINE})")
        return -(-length // ENTRY_SIZE)

    def _op_copy_inline(self, entry: Entry, data: bytes | memoryview, generation: int) -> None:
        """Bytes that came with the ring fetch (I2M, like a GPU's inline-to-memory
        method): a small host-to-VRAM copy without a DMA read of its own, so on a GPU box
        without a round trip of its own."""
        dst, length = entry.args[0], entry.args[1]
        self._check_vram(dst, length)
        self._vram_write(generation, dst, memoryview(data)[:length])
        self.counters["h2d_bytes"] += length
        self.counters["inline_copies"] += 1
        self.counters["inline_bytes"] += length

    def _op_copy_d2h(self, entry: Entry, generation: int) -> None:
        """Sent from the VRAM pages themselves (views, cut at the guest's pieces): no copy
        of the batch before the DMA writes."""
        pieces = self._host_pieces(entry)
        src = entry.args[2]
        self._check_vram(src, sum(length for _, length in pieces))
        for pos, group in self._batches(pieces):
            views = self._vram_views(generation, src + pos, sum(n for _, n in group))
            out = list(_cut(group, views))
            started = time.monotonic_ns()
            self.dma_write_many(out)
            self.counters["dma_ns"] += time.monotonic_ns() - started
            self.counters["copy_writes"] += 1
            self.counters["d2h_bytes"] += sum(n for _, n in group)

    def _op_copy_d2d(self, entry: Entry, generation: int) -> None:
        src, dst, length = entry.args[:3]
        self._check_vram(src, length)
        self._check_vram(dst, length)
        for pos in range(0, length, COPY_BATCH):
            n = min(COPY_BATCH, length - pos)
            piece = memoryview(self._operands.take(n))
            self._vram_read_into(generation, src + pos, piece)
            self._vram_write(generation, dst + pos, piece)
            self._operands.release()

    def _op_fill(self, entry: Entry, generation: int) -> None:
        dst, length, pattern = entry.args[:3]
        self._check_vram(dst, length)
        word = (pattern & U32).to_bytes(4, "little")
        block = word * (min(COPY_BATCH, length) // 4 + 1)
        for pos in range(0, length, COPY_BATCH):
            n = min(COPY_BATCH, length - pos)
            self._vram_write(generation, dst + pos, block[:n])   # COPY_BATCH is a multiple of 4

    def _op_fence(self, entry: Entry, generation: int) -> None:
        addr, value = entry.args[:2]
        self.dma_write(addr, value.to_bytes(8, "little"))
        with self.lock:
            if generation != self._generation:
                raise _Cancelled()
            self._fence = value

    def _op_timestamp(self, entry: Entry, generation: int) -> None:
        self.dma_write(entry.args[0], self.device_time_ns().to_bytes(8, "little"))

    def _op_nop(self, entry: Entry, generation: int) -> None:
        pass

    # -- kernels -----------------------------------------------------------------------------

    @staticmethod
    def _dims(*dims: int) -> tuple[int, ...]:
        for d in dims:
            if not 1 <= d <= MAX_DIM:
                raise CommandError(ERR_BAD_SHAPE, d, f"dimension {d} (1 to {MAX_DIM})")
        return dims

    def _esize(self, entry: Entry) -> int:
        try:
            return DTYPE_BYTES[entry.dtype]
        except KeyError:
            raise CommandError(ERR_BAD_DTYPE, entry.dtype, f"dtype {entry.dtype}") from None

    def _load(self, entry: Entry, generation: int, offset: int, shape: tuple[int, ...]) -> np.ndarray:
        """A float32 array of ``shape`` from VRAM at ``offset`` (range checked first)."""
        esize = self._esize(entry)
        count = 1
        for d in shape:
            count *= d
        self._check_vram(offset, count * esize)
        raw = self._operands.take(count * esize)
        self._vram_read_into(generation, offset, memoryview(raw))
        if entry.dtype == DTYPE_BF16:
            return from_bf16(raw.view("<u2")).reshape(shape)
        return raw.view("<f4").reshape(shape)

    def _check_out(self, entry: Entry, offset: int, shape: tuple[int, ...]) -> None:
        count = 1
        for d in shape:
            count *= d
        self._check_vram(offset, count * self._esize(entry))

    def _store(self, entry: Entry, generation: int, offset: int, result: np.ndarray) -> None:
        result = np.asarray(result, dtype=np.float32)
        data = to_bf16(result) if entry.dtype == DTYPE_BF16 else result.astype("<f4", copy=False)
        self._vram_write(generation, offset, memoryview(np.ascontiguousarray(data)).cast("B"))

    def _timed(self, compute):
        started = time.monotonic_ns()
        with np.errstate(all="ignore"):   # inf and NaN are results, as on a GPU, not warnings
            result = compute()
        self.counters["kernel_ns"] += time.monotonic_ns() - started
        return result

    def _op_gemm(self, entry: Entry, generation: int) -> None:
        a_off, b_off, c_off, m, n, k = entry.args[:6]
        m, n, k = self._dims(m, n, k)
        self._check_out(entry, c_off, (m, n))
        a = self._load(entry, generation, a_off, (k, m) if entry.flags & FLAG_TRANS_A else (m, k))
        b = self._load(entry, generation, b_off, (n, k) if entry.flags & FLAG_TRANS_B else (k, n))
        if entry.flags & FLAG_TRANS_A:
            a = a.T
        if entry.flags & FLAG_TRANS_B:
            b = b.T
        c = self._timed(lambda: self.backend.gemm(np.ascontiguousarray(a), np.ascontiguousarray(b)))
        if entry.flags & FLAG_ACCUMULATE:
            c = self._timed(lambda: self.backend.add(self._load(entry, generation, c_off, (m, n)), c))
        self._store(entry, generation, c_off, c)

    def _op_bias_add(self, entry: Entry, generation: int) -> None:
        x_off, b_off, y_off, rows, cols = entry.args[:5]
        rows, cols = self._dims(rows, cols)
        self._check_out(entry, y_off, (rows, cols))
        x = self._load(entry, generation, x_off, (rows, cols))
        bias = self._load(entry, generation, b_off, (cols,))
        self._store(entry, generation, y_off, self._timed(lambda: self.backend.bias_add(x, bias)))

    def _binary(self, entry: Entry, generation: int, kernel) -> None:
        x_off, y_off, z_off, n = entry.args[:4]
        (n,) = self._dims(n)
        self._check_out(entry, z_off, (n,))
        x = self._load(entry, generation, x_off, (n,))
        y = self._load(entry, generation, y_off, (n,))
        self._store(entry, generation, z_off, self._timed(lambda: kernel(x, y)))

    def _unary(self, entry: Entry, generation: int, kernel) -> None:
        x_off, _, y_off, n = entry.args[:4]
        (n,) = self._dims(n)
        self._check_out(entry, y_off, (n,))
        x = self._load(entry, generation, x_off, (n,))
        self._store(entry, generation, y_off, self._timed(lambda: kernel(x)))

    def _rows(self, entry: Entry, generation: int, kernel) -> None:
        x_off, _, y_off, rows, cols = entry.args[:5]
        rows, cols = self._dims(rows, cols)
        self._check_out(entry, y_off, (rows, cols))
        x = self._load(entry, generation, x_off, (rows, cols))
        self._store(entry, generation, y_off, self._timed(lambda: kernel(x)))

    def _op_add(self, entry: Entry, generation: int) -> None:
        self._binary(entry, generation, self.backend.add)

    def _op_mul(self, entry: Entry, generation: int) -> None:
        self._binary(entry, generation, self.backend.mul)

    def _op_relu_grad(self, entry: Entry, generation: int) -> None:
        self._binary(entry, generation, self.backend.relu_grad)

    def _op_axpy(self, entry: Entry, generation: int) -> None:
        alpha = _bits_f32(entry.args[4])
        self._binary(entry, generation, lambda x, y: self.backend.axpy(x, y, alpha))

    def _op_relu(self, entry: Entry, generation: int) -> None:
        self._unary(entry, generation, self.backend.relu)

    def _op_gelu(self, entry: Entry, generation: int) -> None:
        self._unary(entry, generation, self.backend.gelu)

    def _op_softmax(self, entry: Entry, generation: int) -> None:
        self._rows(entry, generation, self.backend.softmax)

    def _op_layer_norm(self, entry: Entry, generation: int) -> None:
        x_off, g_off, y_off, rows, cols, beta_off, eps_bits = entry.args
        rows, cols = self._dims(rows, cols)
        eps = _bits_f32(eps_bits) if eps_bits & U32 else 1e-5
        if not eps > 0 or eps != eps or eps == float("inf"):
            raise CommandError(ERR_BAD_SHAPE, eps_bits, f"layer-norm epsilon {eps}")
        self._check_out(entry, y_off, (rows, cols))
        x = self._load(entry, generation, x_off, (rows, cols))
        gamma = beta = None
        if entry.flags & FLAG_AFFINE:
            gamma = self._load(entry, generation, g_off, (cols,))
            beta = self._load(entry, generation, beta_off, (cols,))
        self._store(entry, generation, y_off,
                    self._timed(lambda: self.backend.layer_norm(x, gamma, beta, eps)))

    def _op_sum_rows(self, entry: Entry, generation: int) -> None:
        x_off, _, y_off, rows, cols = entry.args[:5]
        rows, cols = self._dims(rows, cols)
        self._check_out(entry, y_off, (cols,))
        x = self._load(entry, generation, x_off, (rows, cols))
        self._store(entry, generation, y_off, self._timed(lambda: self.backend.sum_rows(x)))

    _HANDLERS = {
        OP_NOP: _op_nop, OP_COPY_H2D: _op_copy_h2d, OP_COPY_D2H: _op_copy_d2h,
        OP_COPY_D2D: _op_copy_d2d, OP_FILL: _op_fill, OP_FENCE: _op_fence,
        OP_TIMESTAMP: _op_timestamp, OP_GEMM: _op_gemm, OP_BIAS_ADD: _op_bias_add,
        OP_ADD: _op_add, OP_MUL: _op_mul, OP_RELU: _op_relu, OP_GELU: _op_gelu,
        OP_SOFTMAX: _op_softmax, OP_LAYER_NORM: _op_layer_norm, OP_RELU_GRAD: _op_relu_grad,
        OP_AXPY: _op_axpy, OP_SUM_ROWS: _op_sum_rows,
    }


OPCODES = frozenset(AccelDevice._HANDLERS) | {OP_COPY_INLINE}   # inline copies: run by _drain itself
