"""The DMA map table: which guest memory the device may touch, and how to reach it.

QEMU tells the server, with DMA_MAP and DMA_UNMAP, which guest-physical ranges the
device may access (the IOMMU view) and with which rights. Ranges backed by a shared
memfd come with a descriptor and are mmapped: DMA is then a memcpy. Ranges without a
descriptor are reached with DMA_READ/DMA_WRITE messages to QEMU (``fallback``).
Anything outside the table, or against its rights, is refused and counted, never served.
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Callable

from dxpu_vfio.vfio_user.protocol import DMA_FLAG_READ, DMA_FLAG_WRITE, PAGE_SIZE
from qemu_device.ports import DmaError


@dataclass
class Mapping:
    address: int
    size: int
    flags: int
    memory: mmap.mmap | None  # None: reached through DMA_READ/DMA_WRITE messages
    map_delta: int = 0  # where ``address`` sits inside ``memory`` (fd offset not page-aligned)
    fd: int | None = None  # the memfd behind ``memory``, kept for the native forwarder's pread/pwrite
    file_offset: int = 0  # where ``address`` sits in the file

    @property
    def end(self) -> int:
        return self.address + self.size


# fallback(address, length_or_data, write) -> bytes | None
Fallback = Callable[[int, "int | bytes", bool], "bytes | None"]


class DmaTable:
    """Thread-safe map of DMA windows; also the device's :class:`DmaPort` on the server."""

    def __init__(self, fallback: Fallback | None = None, max_maps: int = 65535) -> None:
        self._maps: list[Mapping] = []  # sorted by address, never overlapping
        self._lock = threading.RLock()
        self._fallback = fallback
        self.max_maps = max_maps
        self.refused = 0  # accesses outside the table or against its rights
        self.bytes_read = 0
        self.bytes_written = 0

    # --- control (from DMA_MAP / DMA_UNMAP) ---------------------------------------
    def add(self, address: int, size: int, flags: int, fd: int | None, offset: int) -> None:
        """Add a window; takes ownership of ``fd`` (closed here after mmap)."""
        try:
            with self._lock:
                if len(self._maps) >= self.max_maps:
                    raise ValueError(f"more than {self.max_maps} DMA maps")
                i = bisect.bisect_left([m.address for m in self._maps], address)
                if (i > 0 and self._maps[i - 1].end > address) or \
                        (i < len(self._maps) and self._maps[i].address < address + size):
                    raise ValueError(f"DMA map {address:#x}+{size:#x} overlaps an existing map")
                memory, delta, kept = None, 0, None
                if fd is not None:
                    delta = offset % PAGE_SIZE
                    prot = (mmap.PROT_READ if flags & DMA_FLAG_READ else 0) | \
                           (mmap.PROT_WRITE if flags & DMA_FLAG_WRITE else 0)
                    memory = mmap.mmap(fd, size + delta, mmap.MAP_SHARED, prot or mmap.PROT_READ,
                                       offset=offset - delta)
                    kept, fd = fd, None  # the window owns it now
                self._maps.insert(i, Mapping(address, size, flags, memory, delta, kept, offset))
        finally:
            if fd is not None:
                os.close(fd)

    def remove(self, address: int, size: int) -> int:
        """Remove the windows inside [address, address+size); returns how many."""
        with self._lock:
            keep, gone = [], []
            for m in self._maps:
                (gone if address <= m.address and m.end <= address + size else keep).append(m)
            self._maps = keep
        for m in gone:
            if m.memory is not None:
                m.memory.close()
            if m.fd is not None:
                os.close(m.fd)
        return len(gone)

    def clear(self) -> None:
        self.remove(0, 1 << 64)

    def native_windows(self) -> list[tuple[int, int, int, int, int]]:
        """(address, size, flags, fd, file offset) of the windows with a memfd, sorted, for
        the native forwarder (which borrows the fds: call again after every change)."""
        with self._lock:
            return [(m.address, m.size, m.flags, m.fd, m.file_offset) for m in self._maps if m.fd is not None]

    def windows(self) -> list[tuple[int, int, int, bool]]:
        """(address, size, flags, has_fd) of every window, for stats and tests."""
        with self._lock:
            return [(m.address, m.size, m.flags, m.memory is not None) for m in self._maps]

    # --- access (the device's DmaPort) ---------------------------------------------
    def _pieces(self, address: int, length: int, need: int) -> list[tuple[Mapping, int, int]]:
        """Split an access into (mapping, offset in mapping, length) or refuse it whole."""
        pieces = []
        with self._lock:
            starts = [m.address for m in self._maps]
            pos, left = address, length
            while left > 0:
                i = bisect.bisect_right(starts, pos) - 1
                m = self._maps[i] if i >= 0 else None
                if m is None or pos >= m.end:
                    self.refused += 1
                    raise DmaError(f"DMA to {pos:#x} is outside every mapped window")
                if not m.flags & need:
                    self.refused += 1
                    kind = "write" if need == DMA_FLAG_WRITE else "read"
                    raise DmaError(f"DMA {kind} at {pos:#x} is not allowed by the map's flags")
                n = min(left, m.end - pos)
                pieces.append((m, pos - m.address, n))
                pos, left = pos + n, left - n
        return pieces

    def read(self, address: int, length: int) -> bytes:
        pieces = self._pieces(address, length, DMA_FLAG_READ)
        self.bytes_read += length
        if len(pieces) == 1 and pieces[0][0].memory is not None:  # the common case: one copy
            m, off, n = pieces[0]
            start = m.map_delta + off
            return m.memory[start:start + n]
        out = bytearray()
        for m, off, n in pieces:
            if m.memory is not None:
                start = m.map_delta + off
                out += m.memory[start:start + n]
            else:
                out += self._fallback_access(m.address + off, n, False)
        return bytes(out)

    def write(self, address: int, data: bytes | memoryview) -> None:
        view = memoryview(data)
        done = 0
        for m, off, n in self._pieces(address, len(view), DMA_FLAG_WRITE):
            chunk = view[done:done + n]
            if m.memory is not None:
                start = m.map_delta + off
                m.memory[start:start + n] = chunk
            else:
                self._fallback_access(m.address + off, chunk, True)
            done += n
        self.bytes_written += len(data)

    def _fallback_access(self, address: int, what: int | bytes, write: bool) -> bytes:
        if self._fallback is None:
            raise DmaError(f"DMA at {address:#x}: window has no fd and no message path")
        result = self._fallback(address, what, write)
        return result if result is not None else b""
