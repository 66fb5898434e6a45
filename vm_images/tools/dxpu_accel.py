"""dxpu_accel: a userspace driver and a small CUDA-like runtime for the dxpu accelerator
(``accel``, PCI 1b36:10f2, class 1200; docs/devices/accel.md).

There is no Linux driver for a device we invent, so, like SPDK, the driver lives in the
process: BAR0 through sysfs (``resource0``, mmapped; every register access a single
32-bit load or store), DMA buffers from pinned anonymous memory whose physical
addresses come from ``/proc/self/pagemap`` (2 MiB huge pages when the guest has them,
else 4 KiB pages described to the device by scatter lists), and completions by polling
a fence the device DMA-writes into guest memory (no interrupt, so no kernel module).

Standard library only: the host copies this file into a guest
(``dxpu_vfio.lab.accel.install``) and runs it with the guest's python3. The same runtime
drives the device from host tests through a vfio-user client (any object with
``read32``/``write32`` as the MMIO, and any :class:`Memory` as the DMA memory).

API, after CUDA's: ``Accel.open()``; ``malloc``/``free`` (VRAM), ``host_alloc`` (pinned
memory), ``memcpy_htod``/``memcpy_dtoh``; ``stream()`` whose commands (copies, kernels,
fills) are batched and go to the device with one doorbell at ``flush``/``synchronize``;
``record()`` gives an :class:`Event` to wait on. All streams share the device's one
ring, so they run in the order they were flushed.

    python3 dxpu_accel.py [--bdf BDF] info|selftest [--sizes 4096,1048576,...]
    python3 dxpu_accel.py [--bdf BDF] mlp [--batch 64 --width 256 --layers 3 --repeat 5]

prints ``key=value`` lines and exits 0 (ok), 1 (a check failed) or 2 (no device).
"""

from __future__ import annotations

import argparse
import array
import collections
import ctypes
import errno
import math
import mmap
import os
import random
import struct
import sys
import time

VENDOR_ID, DEVICE_ID = 0x1B36, 0x10F2
ID_VALUE = 0xD0C5AC01

# registers (BAR0), as qemu_device/accel.py (tests/test_accel_runtime.py checks they agree)
REG_ID, REG_VERSION, REG_CAPS, REG_ENTRY_SIZE = 0x000, 0x004, 0x008, 0x00C
REG_VRAM_SIZE_LO, REG_VRAM_SIZE_HI, REG_MAX_RING, REG_MAX_SG = 0x010, 0x014, 0x018, 0x01C
REG_CONTROL, REG_STATUS, REG_RING_BASE_LO, REG_RING_BASE_HI = 0x020, 0x024, 0x028, 0x02C
REG_RING_SIZE, REG_RING_HEAD, REG_RING_TAIL, REG_DOORBELL = 0x030, 0x034, 0x038, 0x03C
REG_IRQ_CAUSE, REG_IRQ_MASK, REG_ERROR_CODE, REG_ERROR_INDEX = 0x040, 0x044, 0x048, 0x04C
REG_ERROR_OPCODE, REG_ERROR_CLEAR, REG_ERROR_INFO_LO, REG_ERROR_INFO_HI = 0x050, 0x054, 0x058, 0x05C
REG_COMPLETED_LO, REG_FENCE_LO, REG_TIME_LO, REG_TIME_HI = 0x060, 0x068, 0x070, 0x074
CONTROL_ENABLE, CONTROL_RESET = 1, 2
STATUS_ENABLED, STATUS_BUSY, STATUS_ERROR = 1, 2, 4

OP_NOP, OP_COPY_H2D, OP_COPY_D2H, OP_COPY_D2D, OP_FILL, OP_FENCE, OP_TIMESTAMP, OP_COPY_INLINE = range(8)
(OP_GEMM, OP_BIAS_ADD, OP_ADD, OP_MUL, OP_RELU, OP_GELU, OP_SOFTMAX, OP_LAYER_NORM,
 OP_RELU_GRAD, OP_AXPY, OP_SUM_ROWS) = range(0x10, 0x1B)
FLAG_INTERRUPT, FLAG_SG, FLAG_ACCUMULATE, FLAG_TRANS_A, FLAG_TRANS_B, FLAG_AFFINE = (1 << n for n in range(6))
DTYPE_F32, DTYPE_BF16 = 0, 1
CAP_INLINE = 1 << 5                      # COPY_INLINE: a copy's bytes in the ring
INLINE_MAX = 256 << 10                   # the device's limit for one inline copy
RING_ENTRIES = 16384                     # the ring's size where memory allows (1 MiB)
ERROR_NAMES = {1: "bad opcode", 2: "VRAM range", 3: "bad shape", 4: "DMA fault", 5: "bad ring",
               6: "bad doorbell", 7: "bad dtype", 8: "bad scatter list", 9: "bad inline copy", 0xFF: "internal"}

ENTRY = struct.Struct("<BBBBI7Q")
ENTRY_SIZE = 64
SG_ENTRY = struct.Struct("<QQ")
PAGE = 4096
HUGE = 2 << 20
SG_PER_LIST = PAGE // SG_ENTRY.size      # one 4 KiB page of scatter list per copy command
ALL_ONES = 0xFFFF_FFFF
MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)
MAP_HUGE_2MB = 21 << 26
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)


class FineSleep:
    """Naps as short as asked: Linux lets a thread's timer fire up to its timer slack late
    (50 µs by default), so a 50 µs ``time.sleep`` took 125-180 µs, and a fence polled that way
    was seen 50 µs late on average (a remote 4 KiB copy: 535-550 → 474-491 µs median).
    The slack is this thread's (``PR_SET_TIMERSLACK``), set to 1 µs only while the first nap
    waits and given back when the block ends; where prctl is missing, plain sleeps."""

    PR_SET_TIMERSLACK, PR_GET_TIMERSLACK, SLACK_NS = 29, 30, 1000

    def __init__(self) -> None:
        self._saved: int | None = None

    def __enter__(self) -> "FineSleep":
        return self

    def __call__(self, seconds: float) -> None:
        if self._saved is None:
            self._saved = _prctl(self.PR_GET_TIMERSLACK, 0)
            if self._saved > 0:
                _prctl(self.PR_SET_TIMERSLACK, self.SLACK_NS)
        time.sleep(seconds)

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None and self._saved > 0:
            _prctl(self.PR_SET_TIMERSLACK, self._saved)


_libc: "ctypes.CDLL | None" = None


def _prctl(option: int, arg: int) -> int:
    """prctl(2) through libc; -1 where it cannot be called (no libc, not Linux)."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        return _libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    except (OSError, AttributeError):
        return -1


class AccelError(Exception):
    """The device refused a command (``code``, ``index`` in the ring, ``opcode``, ``info``)
    or did not answer."""

    def __init__(self, message: str, code: int = 0, index: int = 0, opcode: int = 0, info: int = 0) -> None:
        super().__init__(message)
        self.code, self.index, self.opcode, self.info = code, index, opcode, info


class DeviceGone(AccelError):
    """Registers read all-ones: the device was unplugged or its server is gone."""


def f32_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


# -- MMIO -------------------------------------------------------------------------------

def find_devices() -> list[str]:
    """BDFs of every accel device the guest kernel enumerated."""
    found = []
    base = "/sys/bus/pci/devices"
    for bdf in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        try:
            with open(f"{base}/{bdf}/vendor") as v, open(f"{base}/{bdf}/device") as d:
                if int(v.read(), 16) == VENDOR_ID and int(d.read(), 16) == DEVICE_ID:
                    found.append(bdf)
        except OSError:
            continue
    return found


class SysfsMmio:
    """BAR0 of a PCI device through sysfs: enabled, Memory Space + Bus Master set, and
    ``resource0`` mmapped; each access is one 32-bit load or store (ctypes), never a
    byte-wise copy that would ring a doorbell four times."""

    def __init__(self, bdf: str, size: int = 4096) -> None:
        self.bdf = bdf
        path = f"/sys/bus/pci/devices/{bdf}"
        try:
            with open(f"{path}/enable", "w") as f:
                f.write("1")
        except OSError as exc:
            if exc.errno != errno.EBUSY:  # EBUSY: a driver is bound and owns enabling
                raise
        fd = os.open(f"{path}/config", os.O_RDWR)
        try:
            command = int.from_bytes(os.pread(fd, 2, 4), "little")
            os.pwrite(fd, (command | 0x6).to_bytes(2, "little"), 4)   # memory + bus master
        finally:
            os.close(fd)
        fd = os.open(f"{path}/resource0", os.O_RDWR | os.O_SYNC)
        try:
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))

    def read32(self, offset: int) -> int:
        return ctypes.c_uint32.from_address(self._base + offset).value

    def write32(self, offset: int, value: int) -> None:
        ctypes.c_uint32.from_address(self._base + offset).value = value & ALL_ONES


# -- DMA memory -------------------------------------------------------------------------

class HostBuffer:
    """Pinned host memory the device can DMA: ``view`` (a writable memoryview) and its
    ``segments``, the (bus address, length) pieces it is made of."""

    def __init__(self, view: memoryview, segments: list[tuple[int, int]], owner: object = None) -> None:
        self.view, self.segments, self.owner = view, segments, owner
        self.size = len(view)

    @property
    def address(self) -> int:
        """The bus address of a buffer in one piece (the ring, fences, scatter lists)."""
        if len(self.segments) != 1:
            raise ValueError("buffer is not physically contiguous")
        return self.segments[0][0]

    def pieces(self, offset: int, length: int) -> list[tuple[int, int]]:
        """The segments covering [offset, offset + length)."""
        out, pos = [], 0
        for addr, n in self.segments:
            lo, hi = max(offset, pos), min(offset + length, pos + n)
            if lo < hi:
                out.append((addr + lo - pos, hi - lo))
            pos += n
        return out


class Memory:
    """Where DMA buffers come from: ``alloc(size, contiguous)`` -> HostBuffer."""

    contiguous_max = PAGE

    def alloc(self, size: int, contiguous: bool = False) -> HostBuffer:
        raise NotImplementedError


class PagemapMemory(Memory):
    """Anonymous memory, populated and locked, translated through /proc/self/pagemap.
    2 MiB huge pages when ``/proc/sys/vm/nr_hugepages`` has some free (then a buffer of
    up to 2 MiB is contiguous), else 4 KiB pages."""

    def __init__(self, huge: bool | None = None) -> None:
        self._pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.huge = self._huge_pages_free() if huge is None else huge
        self.contiguous_max = HUGE if self.huge else PAGE
        self._maps: list[mmap.mmap] = []

    @staticmethod
    def _huge_pages_free() -> bool:
        try:
            with open("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages") as f:
                return int(f.read()) > 0
        except (OSError, ValueError):
            return False

    def alloc(self, size: int, contiguous: bool = False) -> HostBuffer:
        huge = self.huge and size > PAGE   # a page is contiguous anyway: keep huge pages for more
        page = HUGE if huge else PAGE
        if contiguous and size > page:
            raise ValueError(f"a contiguous buffer can be at most {page} bytes here")
        length = -(-size // page) * page
        flags = mmap.MAP_PRIVATE | MAP_POPULATE | ((MAP_HUGETLB | MAP_HUGE_2MB) if huge else 0)
        try:
            m = mmap.mmap(-1, length, flags=flags)
        except OSError:
            if not huge:
                raise
            self.huge, self.contiguous_max = False, PAGE   # out of huge pages: small ones from now on
            return self.alloc(size, contiguous)
        view = memoryview(m)
        holder = ctypes.c_char.from_buffer(m)
        va = ctypes.addressof(holder)
        del holder
        for pos in range(0, length, page):   # fault every page in for writing (no shared zero page)
            view[pos] = 0
        self._libc.mlock(ctypes.c_void_p(va), ctypes.c_size_t(length))
        self._maps.append(m)
        return HostBuffer(view[:size], self._segments(va, length, page)[:], m)

    def _segments(self, va: int, length: int, page: int) -> list[tuple[int, int]]:
        first, count = va // PAGE, length // PAGE
        raw = os.pread(self._pagemap, count * 8, first * 8)
        entries = array.array("Q", raw)
        segments: list[list[int]] = []
        for i in range(0, count, page // PAGE):
            entry = entries[i]
            if not entry >> 63:
                raise AccelError(f"page at {va + i * PAGE:#x} is not present")
            pfn = entry & ((1 << 55) - 1)
            if not pfn:
                raise AccelError("/proc/self/pagemap gives PFN 0: run as root")
            phys = pfn * PAGE
            if segments and segments[-1][0] + segments[-1][1] == phys:
                segments[-1][1] += page
            else:
                segments.append([phys, page])
        return [(a, n) for a, n in segments]


class MappedMemory(Memory):
    """DMA memory that is one contiguous window at bus address ``base`` (``view`` is it):
    for host tests, where a memfd stands in for guest RAM. A bump allocator."""

    def __init__(self, view, base: int, page: int = PAGE) -> None:
        self.view, self.base, self.page = memoryview(view), base, page
        self.contiguous_max = len(self.view)
        self._next = 0

    def alloc(self, size: int, contiguous: bool = False) -> HostBuffer:
        start = -(-self._next // self.page) * self.page
        if start + size > len(self.view):
            raise MemoryError(f"DMA memory of {len(self.view)} bytes exhausted")
        self._next = start + size
        return HostBuffer(self.view[start:start + size], [(self.base + start, size)])


# -- VRAM allocation --------------------------------------------------------------------

class VramAllocator:
    """First fit over the VRAM, ``align``-byte granules; ``free`` merges neighbours."""

    def __init__(self, size: int, align: int = 256) -> None:
        self.align = align
        self._free: list[list[int]] = [[0, size]]    # sorted [offset, length]
        self._used: dict[int, int] = {}

    def malloc(self, nbytes: int) -> int:
        need = max(self.align, -(-nbytes // self.align) * self.align)
        for hole in self._free:
            if hole[1] >= need:
                ptr = hole[0]
                hole[0] += need
                hole[1] -= need
                if not hole[1]:
                    self._free.remove(hole)
                self._used[ptr] = need
                return ptr
        raise MemoryError(f"out of VRAM: no free {need} bytes")

    def free(self, ptr: int) -> None:
        size = self._used.pop(ptr)
        self._free.append([ptr, size])
        self._free.sort()
        merged: list[list[int]] = []
        for hole in self._free:
            if merged and merged[-1][0] + merged[-1][1] == hole[0]:
                merged[-1][1] += hole[1]
            else:
                merged.append(hole)
        self._free = merged


# -- the device -------------------------------------------------------------------------

class Event:
    """A point in the ring: done once the device wrote fence ``value``."""

    def __init__(self, dev: "Accel", value: int) -> None:
        self.dev, self.value = dev, value

    def query(self) -> bool:
        return self.dev._fence_done(self.value)

    def synchronize(self, timeout: float | None = None) -> None:
        self.dev._wait_fence(self.value, timeout)


class Accel:
    """An opened accelerator: its ring, fences and allocators."""

    def __init__(self, mmio, memory: Memory, ring_entries: int | None = None, timeout: float = 60.0,
                 inline_max: int | None = None) -> None:
        self.mmio, self.memory, self.timeout = mmio, memory, timeout
        ident = mmio.read32(REG_ID)
        if ident == ALL_ONES:
            raise DeviceGone("the device reads all-ones: not there (unplugged, or its server is gone)")
        if ident != ID_VALUE:
            raise AccelError(f"not a dxpu accelerator: ID {ident:#010x}")
        self.caps = mmio.read32(REG_CAPS)
        self.vram_size = mmio.read32(REG_VRAM_SIZE_HI) << 32 | mmio.read32(REG_VRAM_SIZE_LO)
        if ring_entries is None:   # 1 MiB (in one huge page): a quarter of it holds a 256 KiB inline copy
            ring_entries = min(RING_ENTRIES, memory.contiguous_max // ENTRY_SIZE)
        self.ring_size = ring_entries
        # copies of at most this many bytes travel in the ring (COPY_INLINE): no DMA read of
        # their own, so on a GPU box no round trip of their own; a quarter of the ring at most
        room = ring_entries // 4 * ENTRY_SIZE
        self.inline_max = 0 if not self.caps & CAP_INLINE else min(
            INLINE_MAX, room, INLINE_MAX if inline_max is None else inline_max)
        self.ring = memory.alloc(ring_entries * ENTRY_SIZE, contiguous=True)
        self.fences = memory.alloc(PAGE, contiguous=True)   # slot 0: the fence; 1..: timestamps
        self._pool: list[HostBuffer] = []   # DMA buffers for staging and scatter lists, smallest first
        self.vram = VramAllocator(self.vram_size)
        self._seq = 0
        self._ts_slot = 0
        self.doorbells = 0
        self.default = Stream(self)
        self.reset()

    @classmethod
    def open(cls, bdf: str | None = None, **kw) -> "Accel":
        """The device at ``bdf`` (default: the first accel in /sys/bus/pci)."""
        if bdf is None:
            found = find_devices()
            if not found:
                raise AccelError("no dxpu accelerator (1b36:10f2) in /sys/bus/pci/devices")
            bdf = found[0]
        return cls(SysfsMmio(bdf), PagemapMemory(), **kw)

    # -- device state --------------------------------------------------------------------

    def reset(self) -> None:
        """Engine reset, then the ring programmed and enabled (VRAM is kept)."""
        m = self.mmio
        m.write32(REG_CONTROL, CONTROL_RESET)
        m.write32(REG_RING_BASE_LO, self.ring.address & ALL_ONES)
        m.write32(REG_RING_BASE_HI, self.ring.address >> 32)
        m.write32(REG_RING_SIZE, self.ring_size)
        m.write32(REG_CONTROL, CONTROL_ENABLE)
        m.write32(REG_IRQ_MASK, ALL_ONES)          # this runtime polls
        self.fences.view[:8] = bytes(8)
        self._seq = 0
        self._tail = self._head = 0
        self._fenced: collections.deque[tuple[int, int]] = collections.deque()   # (fence value, ring index after it)
        self.check()

    def check(self) -> None:
        """Raise the device's error (AccelError) or DeviceGone, if any."""
        status = self.mmio.read32(REG_STATUS)
        if status == ALL_ONES:
            raise DeviceGone("the device reads all-ones: unplugged, or its server is gone")
        if status & STATUS_ERROR:
            m = self.mmio
            code, index, opcode = m.read32(REG_ERROR_CODE), m.read32(REG_ERROR_INDEX), m.read32(REG_ERROR_OPCODE)
            info = m.read32(REG_ERROR_INFO_HI) << 32 | m.read32(REG_ERROR_INFO_LO)
            raise AccelError(f"device error {code} ({ERROR_NAMES.get(code, '?')}) at ring entry {index}, "
                             f"opcode {opcode:#x}, info {info:#x}", code, index, opcode, info)
        if not status & STATUS_ENABLED:
            raise AccelError("the device's ring is not enabled: the device was reset (by another "
                             "process, or by its unplug) and the work queued on it is gone")

    def clear_error(self) -> None:
        """Skip the refused entry and let the device go on."""
        self.mmio.write32(REG_ERROR_CLEAR, 1)

    def device_time_ns(self) -> int:
        lo = self.mmio.read32(REG_TIME_LO)
        return self.mmio.read32(REG_TIME_HI) << 32 | lo

    # -- memory --------------------------------------------------------------------------

    def malloc(self, nbytes: int) -> int:
        return self.vram.malloc(nbytes)

    def free(self, ptr: int) -> None:
        self.vram.free(ptr)

    def host_alloc(self, nbytes: int) -> HostBuffer:
        """Pinned host memory (cudaMallocHost): copies from it need no staging."""
        return self.memory.alloc(nbytes)

    def stream(self) -> "Stream":
        return Stream(self)

    def memcpy_htod(self, dst: int, src) -> None:
        """Copy ``src`` (bytes-like, or a HostBuffer) to VRAM at ``dst``; returns when done."""
        self.default.memcpy_htod(dst, src)
        self.default.synchronize()

    def memcpy_dtoh(self, src: int, nbytes: int) -> bytes:
        """``nbytes`` of VRAM at ``src``; returns when they are here."""
        stream = self.default
        staging = self._take_staging(nbytes, stream._in_use)
        stream.memcpy_dtoh(staging, src, nbytes)
        stream.synchronize()
        return bytes(staging.view[:nbytes])

    def synchronize(self) -> None:
        self.default.synchronize()

    # -- the ring ------------------------------------------------------------------------

    def _take_staging(self, nbytes: int, in_use: list[HostBuffer], contiguous: bool = False) -> HostBuffer:
        """A buffer of at least ``nbytes`` from the pool (or new), lent until the stream
        that took it is synchronized."""
        for i, buf in enumerate(self._pool):
            if buf.size >= nbytes and (len(buf.segments) == 1 or not contiguous):
                del self._pool[i]
                break
        else:
            buf = self.memory.alloc(nbytes if contiguous else max(nbytes, 64 << 10), contiguous)
        in_use.append(buf)
        return buf

    def _give_back(self, buffers: list[HostBuffer]) -> None:
        self._pool.extend(buffers)
        self._pool.sort(key=lambda b: b.size)

    def _submit(self, commands: list[bytes]) -> None:
        """Write ``commands`` into the ring and ring the doorbell (more than once only when
        the ring has no room for all of them). A command is one entry, or an inline copy's
        entry and its data: never split by a doorbell (the device would refuse it)."""
        view, size = self.ring.view, self.ring_size
        pending = 0
        for command in commands:
            need = len(command) // ENTRY_SIZE
            while (self._head - self._tail - 1) % size < need and not self._passed_fences(need):
                if pending:
                    self._doorbell()
                    pending = 0
                self._wait_room()
            pos = self._tail * ENTRY_SIZE
            first = min(len(command), size * ENTRY_SIZE - pos)
            view[pos:pos + first] = command[:first]
            if first < len(command):        # wraps: the rest at the ring's start
                view[:len(command) - first] = command[first:]
            self._tail = (self._tail + need) % size
            pending += need
        if pending:
            self._doorbell()

    def _doorbell(self) -> None:
        self.mmio.write32(REG_DOORBELL, self._tail)
        self.doorbells += 1

    def _passed_fences(self, need: int) -> bool:
        """Move our HEAD past the fences the device has written (free: guest memory, where
        reading RING_HEAD is an MMIO read, a round trip); True if ``need`` entries fit now."""
        done = self._fence_value()
        while self._fenced and self._fenced[0][0] <= done:
            self._head = self._fenced.popleft()[1]
        return (self._head - self._tail - 1) % self.ring_size >= need

    def _wait_room(self) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            head = self.mmio.read32(REG_RING_HEAD)
            if head == ALL_ONES:
                raise DeviceGone("the device reads all-ones: unplugged, or its server is gone")
            if head != self._head:
                self._head = head
                return
            self.check()
            if time.monotonic() > deadline:
                raise AccelError(f"the ring stayed full for {self.timeout} s")
            time.sleep(0.0002)

    def _next_fence(self) -> int:
        self._seq += 1
        return self._seq

    def _fenced_at(self, value: int) -> None:
        """Fence ``value`` is the last entry submitted: once it is written, HEAD is here."""
        self._fenced.append((value, self._tail))
        if len(self._fenced) > 1024:
            self._fenced.popleft()

    def _fence_value(self) -> int:
        return struct.unpack_from("<Q", self.fences.view, 0)[0]

    def _fence_done(self, value: int) -> bool:
        return self._fence_value() >= value

    def _wait_fence(self, value: int, timeout: float | None = None) -> None:
        """Poll the fence in guest memory (free), the device's status now and then (an MMIO
        read: a round trip), so an error or a vanished device ends the wait. A few hundred
        polls first, each giving the CPU to whatever else is ready on it (``sched_yield``):
        the device's server, or the proxy carrying the doorbell, may share this CPU, and a
        poll that spins keeps them waiting for its time slice. Then naps of 50 µs at a
        timer slack of 1 µs (:class:`FineSleep`)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        spins, next_check = 0, time.monotonic() + 0.02
        with FineSleep() as nap:
            while self._fence_value() < value:
                spins += 1
                if spins > 200:
                    nap(0.00005)
                else:
                    os.sched_yield()
                now = time.monotonic()
                if now >= next_check:
                    self.check()
                    next_check = now + 0.02
                if now > deadline:
                    self.check()
                    raise AccelError(f"fence {value} not written in time (the device is at {self._fence_value()})")


class Stream:
    """Commands batched on the host; ``flush`` hands them to the device with one doorbell."""

    def __init__(self, dev: Accel) -> None:
        self.dev = dev
        self._entries: list[bytes] = []
        self._in_use: list[HostBuffer] = []   # scatter lists and staging of unfinished copies

    def _push(self, opcode: int, *args: int, flags: int = 0, dtype: int = DTYPE_F32) -> None:
        padded = [a & 0xFFFF_FFFF_FFFF_FFFF for a in args] + [0] * (7 - len(args))
        self._entries.append(ENTRY.pack(opcode, flags, 0, dtype, 0, *padded))

    def flush(self) -> None:
        entries, self._entries = self._entries, []
        if entries:
            self.dev._submit(entries)

    def record(self) -> Event:
        """An event done when everything pushed so far is (it is flushed now)."""
        value = self.dev._next_fence()
        self._push(OP_FENCE, self.dev.fences.address, value)
        self.flush()
        self.dev._fenced_at(value)
        return Event(self.dev, value)

    def synchronize(self, timeout: float | None = None) -> None:
        self.record().synchronize(timeout)
        self.dev._give_back(self._in_use)
        self._in_use = []

    # -- copies --------------------------------------------------------------------------

    def _copy(self, opcode: int, host: HostBuffer, offset: int, nbytes: int, vram: int) -> None:
        pieces = host.pieces(offset, nbytes)
        pos = 0
        for i in range(0, len(pieces), SG_PER_LIST):
            group = pieces[i:i + SG_PER_LIST]
            length = sum(n for _, n in group)
            if len(group) == 1:
                self._push(opcode, group[0][0], group[0][1], vram + pos)
            else:
                page = self.dev._take_staging(PAGE, self._in_use, contiguous=True)
                page.view[:len(group) * SG_ENTRY.size] = b"".join(SG_ENTRY.pack(a, n) for a, n in group)
                self._push(opcode, page.address, len(group), vram + pos, flags=FLAG_SG)
            pos += length

    def memcpy_htod(self, dst: int, src, nbytes: int | None = None, offset: int = 0) -> None:
        """Host to VRAM. ``src`` a HostBuffer (used in place: keep it unchanged until the
        stream is synchronized) or bytes-like (staged now, so the caller may reuse it).
        A copy of at most ``inline_max`` bytes goes in the ring itself (taken now)."""
        view = src.view if isinstance(src, HostBuffer) else memoryview(src).cast("B")
        count = len(view) - offset if nbytes is None else nbytes
        if 0 < count <= self.dev.inline_max:
            data = view[offset:offset + count]
            pad = -count % ENTRY_SIZE
            self._entries.append(ENTRY.pack(OP_COPY_INLINE, 0, 0, 0, 0, dst, count, 0, 0, 0, 0, 0)
                                 + bytes(data) + bytes(pad))
            return
        if not isinstance(src, HostBuffer):
            data = memoryview(src).cast("B")
            staging = self.dev._take_staging(len(data), self._in_use)
            staging.view[:len(data)] = data
            src, nbytes, offset = staging, len(data), 0
        self._copy(OP_COPY_H2D, src, offset, src.size - offset if nbytes is None else nbytes, dst)

    def memcpy_dtoh(self, dst: HostBuffer, src: int, nbytes: int | None = None, offset: int = 0) -> None:
        """VRAM to a HostBuffer (its data is there after synchronize)."""
        self._copy(OP_COPY_D2H, dst, offset, dst.size - offset if nbytes is None else nbytes, src)

    def memcpy_dtod(self, dst: int, src: int, nbytes: int) -> None:
        self._push(OP_COPY_D2D, src, dst, nbytes)

    def fill(self, dst: int, nbytes: int, pattern: int = 0) -> None:
        self._push(OP_FILL, dst, nbytes, pattern)

    def timestamp(self) -> "Timestamp":
        """The device's clock when the device reaches this point (read it after synchronize)."""
        dev = self.dev
        dev._ts_slot = dev._ts_slot % (PAGE // 8 - 1) + 1
        self._push(OP_TIMESTAMP, dev.fences.address + 8 * dev._ts_slot)
        return Timestamp(dev, dev._ts_slot)

    # -- kernels -------------------------------------------------------------------------

    def gemm(self, c: int, a: int, b: int, m: int, n: int, k: int, *, trans_a: bool = False,
             trans_b: bool = False, accumulate: bool = False, bf16: bool = False) -> None:
        """C (m x n) = A (m x k) @ B (k x n), row-major; ``accumulate``: C +=."""
        flags = (FLAG_TRANS_A if trans_a else 0) | (FLAG_TRANS_B if trans_b else 0) \
            | (FLAG_ACCUMULATE if accumulate else 0)
        self._push(OP_GEMM, a, b, c, m, n, k, flags=flags, dtype=DTYPE_BF16 if bf16 else DTYPE_F32)

    def bias_add(self, y: int, x: int, bias: int, rows: int, cols: int) -> None:
        self._push(OP_BIAS_ADD, x, bias, y, rows, cols)

    def add(self, z: int, x: int, y: int, n: int) -> None:
        self._push(OP_ADD, x, y, z, n)

    def mul(self, z: int, x: int, y: int, n: int) -> None:
        self._push(OP_MUL, x, y, z, n)

    def axpy(self, z: int, x: int, y: int, n: int, alpha: float) -> None:
        """z = x + alpha * y."""
        self._push(OP_AXPY, x, y, z, n, f32_bits(alpha))

    def relu(self, y: int, x: int, n: int) -> None:
        self._push(OP_RELU, x, 0, y, n)

    def gelu(self, y: int, x: int, n: int) -> None:
        self._push(OP_GELU, x, 0, y, n)

    def relu_grad(self, dx: int, x: int, dy: int, n: int) -> None:
        self._push(OP_RELU_GRAD, x, dy, dx, n)

    def softmax(self, y: int, x: int, rows: int, cols: int) -> None:
        self._push(OP_SOFTMAX, x, 0, y, rows, cols)

    def layer_norm(self, y: int, x: int, rows: int, cols: int, gamma: int | None = None,
                   beta: int | None = None, eps: float = 1e-5) -> None:
        affine = gamma is not None and beta is not None
        self._push(OP_LAYER_NORM, x, gamma or 0, y, rows, cols, beta or 0, f32_bits(eps),
                   flags=FLAG_AFFINE if affine else 0)

    def sum_rows(self, y: int, x: int, rows: int, cols: int) -> None:
        self._push(OP_SUM_ROWS, x, 0, y, rows, cols)

    def raw(self, opcode: int, *args: int, flags: int = 0, dtype: int = DTYPE_F32) -> None:
        """Any entry, as the device takes it (tests of its error handling)."""
        self._push(opcode, *args, flags=flags, dtype=dtype)


class Timestamp:
    def __init__(self, dev: Accel, slot: int) -> None:
        self.dev, self.slot = dev, slot

    @property
    def ns(self) -> int:
        return struct.unpack_from("<Q", self.dev.fences.view, 8 * self.slot)[0]


# -- self-test (pure Python references: the guest may have no numpy) ---------------------

def _floats(values) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def _unfloats(data: bytes) -> list[float]:
    return list(struct.unpack(f"<{len(data) // 4}f", data))


def _matmul(a: list[float], b: list[float], m: int, n: int, k: int) -> list[float]:
    return [math.fsum(a[i * k + j] * b[j * n + col] for j in range(k)) for i in range(m) for col in range(n)]


def selftest(dev: Accel, sizes: list[int], out=print) -> bool:
    """Copies of each size round-trip exactly; GEMM, bias + ReLU and softmax match pure
    Python; a ring that wraps; an out-of-range command is an error, and the device works
    on after ERROR_CLEAR. Prints key=value lines; True if every check passed."""
    ok = True
    rng = random.Random(16)

    def check(name: str, passed: bool, detail: str = "") -> None:
        nonlocal ok
        ok &= passed
        out(f"{name}={'ok' if passed else 'FAIL'}{' ' + detail if detail else ''}")

    for size in sizes:
        data = os.urandom(size)
        ptr = dev.malloc(size)
        started = time.monotonic()
        dev.memcpy_htod(ptr, data)
        back = dev.memcpy_dtoh(ptr, size)
        seconds = time.monotonic() - started
        check(f"copy_{size}", back == data, f"round_trip_s={seconds:.4f} MBps={2 * size / seconds / 1e6:.1f}")
        dev.free(ptr)
    m, n, k = 8, 12, 16
    a = [rng.uniform(-1, 1) for _ in range(m * k)]
    b = [rng.uniform(-1, 1) for _ in range(k * n)]
    bias = [rng.uniform(-1, 1) for _ in range(n)]
    pa, pb, pc, pbias, py = (dev.malloc(4 * x) for x in (m * k, k * n, m * n, n, m * n))
    s = dev.stream()
    s.memcpy_htod(pa, _floats(a))
    s.memcpy_htod(pb, _floats(b))
    s.memcpy_htod(pbias, _floats(bias))
    s.gemm(pc, pa, pb, m, n, k)
    s.bias_add(py, pc, pbias, m, n)
    s.relu(py, py, m * n)
    s.synchronize()
    want = _matmul(a, b, m, n, k)
    got = _unfloats(dev.memcpy_dtoh(pc, 4 * m * n))
    check("gemm", all(abs(x - y) < 1e-4 for x, y in zip(got, want)), f"m={m} n={n} k={k}")
    relu = [max(0.0, want[i] + bias[i % n]) for i in range(m * n)]
    got = _unfloats(dev.memcpy_dtoh(py, 4 * m * n))
    check("bias_relu", all(abs(x - y) < 1e-4 for x, y in zip(got, relu)))
    s.softmax(py, pc, m, n)
    s.synchronize()
    got = _unfloats(dev.memcpy_dtoh(py, 4 * m * n))
    rows_ok = True
    for r in range(m):
        row = want[r * n:(r + 1) * n]
        e = [math.exp(v - max(row)) for v in row]
        rows_ok &= all(abs(x - v / sum(e)) < 1e-5 for x, v in zip(got[r * n:(r + 1) * n], e))
    check("softmax", rows_ok)
    before = dev.doorbells
    t0, t1 = s.timestamp(), None
    for i in range(dev.ring_size + 10):          # more than the ring holds: it wraps
        s.fill(pc, 4, i)
    t1 = s.timestamp()
    s.synchronize()
    last = struct.unpack("<I", dev.memcpy_dtoh(pc, 4))[0]
    check("ring_wrap", last == dev.ring_size + 9, f"entries={dev.ring_size + 12} doorbells={dev.doorbells - before - 1} "
          f"device_ns={t1.ns - t0.ns}")
    s.fill(dev.vram_size - 4, 8, 0)              # runs past the end of VRAM
    try:
        s.synchronize(timeout=10)
        check("error_state", False, "an out-of-range fill completed")
    except AccelError as exc:
        check("error_state", exc.code == 2, f"code={exc.code}")
        dev.clear_error()
        s.synchronize(timeout=10)                # the fence after the bad entry runs now
    s.fill(pc, 4, 7)
    s.synchronize()
    check("recovered", struct.unpack("<I", dev.memcpy_dtoh(pc, 4))[0] == 7)
    for p in (pa, pb, pc, pbias, py):
        dev.free(p)
    return ok


def mlp_inference(dev: Accel, batch: int, width: int = 256, layers: int = 3, repeat: int = 5,
                  seed: int = 16) -> dict:
    """An MLP (``layers`` x [GEMM width x width, bias, ReLU]) on the device: weights uploaded
    once, then ``repeat`` timed forward passes of ``batch`` rows (input copied in, output
    copied out, one doorbell per pass). The first row is checked against pure Python."""
    rng = random.Random(seed)
    scale = 1 / math.sqrt(width)
    weights = [[rng.uniform(-scale, scale) * 1.7 for _ in range(width * width)] for _ in range(layers)]
    biases = [[rng.uniform(-0.1, 0.1) for _ in range(width)] for _ in range(layers)]
    x = [rng.uniform(-1, 1) for _ in range(batch * width)]
    pw = [dev.malloc(4 * width * width) for _ in range(layers)]
    pb = [dev.malloc(4 * width) for _ in range(layers)]
    act = [dev.malloc(4 * batch * width) for _ in range(2)]
    s = dev.stream()
    for i in range(layers):
        s.memcpy_htod(pw[i], _floats(weights[i]))
        s.memcpy_htod(pb[i], _floats(biases[i]))
    s.synchronize()
    host_in, host_out = dev.host_alloc(4 * batch * width), dev.host_alloc(4 * batch * width)
    host_in.view[:] = _floats(x)
    times = []
    for _ in range(repeat):
        started = time.monotonic()
        s.memcpy_htod(act[0], host_in)
        for i in range(layers):
            src, dst = act[i % 2], act[(i + 1) % 2]
            s.gemm(dst, src, pw[i], batch, width, width)
            s.bias_add(dst, dst, pb[i], batch, width)
            s.relu(dst, dst, batch * width)
        s.memcpy_dtoh(host_out, act[layers % 2])
        s.synchronize()
        times.append(time.monotonic() - started)
    row = x[:width]
    for i in range(layers):
        row = [max(0.0, v + biases[i][c]) for c, v in enumerate(_matmul(row, weights[i], 1, width, width))]
    got = _unfloats(bytes(host_out.view[:4 * width]))
    error = max(abs(a - b) for a, b in zip(got, row))
    for p in (*pw, *pb, *act):
        dev.free(p)
    times.sort()
    return {"batch": batch, "width": width, "layers": layers, "median_ms": round(1000 * times[len(times) // 2], 3),
            "min_ms": round(1000 * times[0], 3), "max_abs_error": error,
            "nonzero": sum(1 for v in row if v), "match": error < 1e-3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bdf", help="the device (default: the first accel in sysfs)")
    parser.add_argument("command", choices=["info", "selftest", "mlp"])
    parser.add_argument("--batch", type=int, default=64, help="mlp: rows per forward pass")
    parser.add_argument("--width", type=int, default=256, help="mlp: layer width")
    parser.add_argument("--layers", type=int, default=3, help="mlp: layers")
    parser.add_argument("--repeat", type=int, default=5, help="mlp: timed forward passes")
    parser.add_argument("--sizes", default="4096,65536,1048576", help="copy sizes for selftest (bytes, comma separated)")
    args = parser.parse_args(argv)
    try:
        dev = Accel.open(args.bdf)
    except (AccelError, OSError) as exc:
        print(f"error={exc}")
        return 2
    for key, value in (("bdf", dev.mmio.bdf), ("vram", dev.vram_size), ("caps", f"{dev.caps:#x}"),
                       ("ring", dev.ring_size), ("huge_pages", int(getattr(dev.memory, "huge", False)))):
        print(f"{key}={value}")
    if args.command == "info":
        return 0
    try:
        if args.command == "mlp":
            result = mlp_inference(dev, args.batch, args.width, args.layers, args.repeat)
            for key, value in result.items():
                print(f"mlp_{key}={value}")
            return 0 if result["match"] else 1
        return 0 if selftest(dev, [int(x) for x in args.sizes.split(",") if x]) else 1
    except AccelError as exc:
        print(f"error={exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
