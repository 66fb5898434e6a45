"""The DMA map table: which guest memory the device may touch, and how to reach it.

QEMU tells the server, with DMA_MAP and DMA_UNMAP, which guest-physical ranges the
device may access (the IOMMU view) and with which rights. Ranges backed by a shared
memfd come with a descriptor and are mmapped: DMA is then a memcpy. Ranges without a
descriptor are reached with DMA_READ/DMA_WRITE messages to QEMU (``fallback``).
Anything outside the table, or against its rights, is refused and counted, never served.

A client may shrink its memfd after DMA_MAP; touching a mapping past the file's end
would kill this process with SIGBUS. So a window must lie inside its fd at DMA_MAP
(else EINVAL), and only a memfd sealed against shrinking (F_SEAL_SHRINK: QEMU's
memory-backend-memfd, seal=on by default) is accessed through mmap. Any other fd is
kept open and accessed with pread/pwrite, which see a shrunk file as a short transfer
(a DmaError, so the DMA is answered with an error); an fd that cannot be read and
written that way (hugetlbfs) is mmapped and its size checked before every access, which
leaves a client that shrinks it between that check and the copy a window for SIGBUS
(docs/architecture.md, "Facts the code depends on").
"""

from __future__ import annotations

import bisect
import fcntl
import mmap
import os
import stat
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

from dxpu_vfio.native import stream as native
from dxpu_vfio.vfio_user.protocol import DMA_FLAG_READ, DMA_FLAG_WRITE, PAGE_SIZE
from qemu_device.backing import write_all
from qemu_device.ports import DmaError, ScatterByPieces

IOV_MAX = 1024  # buffers per preadv/pwritev (Linux UIO_MAXIOV)


@dataclass
class Mapping:
    address: int
    size: int
    flags: int
    memory: mmap.mmap | None  # None: reached through ``fd`` or DMA_READ/DMA_WRITE messages
    map_delta: int = 0  # where ``address`` sits inside ``memory`` (fd offset not page-aligned)
    fd: int | None = None  # kept where the file may shrink: pread/pwrite, or a size check before mmap access
    offset: int = 0  # of ``address`` in ``fd``

    @property
    def end(self) -> int:
        return self.address + self.size


# fallback(address, length_or_data, write) -> bytes | None
Fallback = Callable[[int, "int | bytes", bool], "bytes | None"]


class DmaTable(ScatterByPieces):
    """Thread-safe map of DMA windows; also the device's :class:`DmaPort` on the server."""

    def __init__(self, fallback: Fallback | None = None, max_maps: int = 65535) -> None:
        self._maps: list[Mapping] = []  # sorted by address, never overlapping
        self._lock = threading.RLock()
        self._fallback = fallback
        self.max_maps = max_maps
        self.refused = 0  # accesses outside the table or against its rights
        # False: every access is refused (and counted), the native forwarder gets no windows.
        # The host proxy's box device clears it while the guest has Bus Master Enable off:
        # the box is not trusted to keep PCI's rule itself (local models check it themselves).
        self.bus_master = True
        self.refused_bus_master = 0
        self.bytes_read = 0
        self.bytes_written = 0
        # a transfer between a file and one sealed mapping in C (DXPU_FASTLINK=0: Python)
        self._native_file_io = native.require().mapped_file_io if native.enabled() else None

    # --- control (from DMA_MAP / DMA_UNMAP) ---------------------------------------
    def add(self, address: int, size: int, flags: int, fd: int | None, offset: int) -> None:
        """Add a window; takes ownership of ``fd`` (closed here after mmap)."""
        try:
            with self._lock:
                if len(self._maps) >= self.max_maps:
                    raise ValueError(f"more than {self.max_maps} DMA maps")
                i = bisect.bisect_left(self._maps, address, key=_start)
                if (i > 0 and self._maps[i - 1].end > address) or \
                        (i < len(self._maps) and self._maps[i].address < address + size):
                    raise ValueError(f"DMA map {address:#x}+{size:#x} overlaps an existing map")
                mapping = Mapping(address, size, flags, None)
                if fd is not None:
                    mapping = _fd_mapping(mapping, fd, offset)
                    if mapping.fd is not None:
                        fd = None  # the mapping owns it now
                self._maps.insert(i, mapping)
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

    def native_windows(self) -> list[tuple[int, int, int, int, object, int]]:
        """(address, size, flags, kind, handle, offset) of every window, sorted, for the
        native forwarder, which borrows the handles (the session thread gives it the table
        again after every change, before it runs again): kind 0, a mapping that cannot shrink
        (the mmap, and where ``address`` sits in it); kind 1, an fd for pread/pwrite (and
        where ``address`` sits in the file); kind 2, one the forwarder leaves to this table."""
        out = []
        with self._lock:
            if not self.bus_master:
                return out  # the forwarder refuses (and counts) every DMA then
            for m in self._maps:
                if m.memory is not None and m.fd is None:
                    out.append((m.address, m.size, m.flags, 0, m.memory, m.map_delta))
                elif m.memory is None and m.fd is not None:
                    out.append((m.address, m.size, m.flags, 1, m.fd, m.offset))
                else:
                    out.append((m.address, m.size, m.flags, 2, None, 0))
        return out

    def windows(self) -> list[tuple[int, int, int, bool]]:
        """(address, size, flags, has_fd) of every window, for stats and tests."""
        with self._lock:
            return [(m.address, m.size, m.flags, m.memory is not None) for m in self._maps]

    # --- access (the device's DmaPort) ---------------------------------------------
    def _pieces(self, address: int, length: int, need: int) -> list[tuple[Mapping, int, int]]:
        """Split an access into (mapping, offset in mapping, length) or refuse it whole."""
        return self._pieces_many([(address, length)], need)

    def _pieces_many(self, ranges: list[tuple[int, int]], need: int) -> list[tuple[Mapping, int, int]]:
        """:meth:`_pieces` of a scatter list, in order, with one look at the table: all
        of it is checked before any of it is touched. The window of the last piece is
        tried first (a 128 KiB transfer is up to 32 pages, mostly in one window of RAM):
        a window is searched for, and its rights checked, only when a piece leaves it."""
        pieces = []
        with self._lock:
            if not self.bus_master:
                self.refused += 1
                self.refused_bus_master += 1
                raise DmaError(f"DMA at {ranges[0][0] if ranges else 0:#x} while the guest has Bus Master Enable off")
            m, start, end = None, 0, 0  # the window in use: [start, end)
            for address, length in ranges:
                pos, left = address, length
                while left > 0:
                    if not start <= pos < end:
                        m = self._window_at(pos)
                        if m is None:
                            self.refused += 1
                            raise DmaError(f"DMA to {pos:#x} is outside every mapped window")
                        if not m.flags & need:
                            self.refused += 1
                            kind = "write" if need == DMA_FLAG_WRITE else "read"
                            raise DmaError(f"DMA {kind} at {pos:#x} is not allowed by the map's flags")
                        start, end = m.address, m.end
                    n = left if pos + left <= end else end - pos
                    pieces.append((m, pos - start, n))
                    pos, left = pos + n, left - n
        return pieces

    def check_writable(self, ranges: list[tuple[int, int]]) -> None:
        """DmaError (counted) unless the device may write all of ``ranges``: for a
        scatter list that is written whole or not at all."""
        self._pieces_many(ranges, DMA_FLAG_WRITE)

    def write_from_file(self, pieces: list[tuple[int, int]], fd: int, offset: int,
                        then: Sequence[tuple[int, bytes]] = ()) -> None:
        """The file read straight into guest memory: one preadv over the mapped pieces,
        then ``then``'s writes."""
        done = self._file_io(pieces, fd, offset, DMA_FLAG_WRITE, then)
        if done is None:
            super().write_from_file(pieces, fd, offset, then)
        elif done is False and then:
            self.write_many(then)

    def read_into_file(self, pieces: list[tuple[int, int]], fd: int, offset: int) -> None:
        """Guest memory written to the file straight from the mapping: one pwritev."""
        if self._file_io(pieces, fd, offset, DMA_FLAG_READ) is None:
            super().read_into_file(pieces, fd, offset)

    def _file_io(self, ranges: list[tuple[int, int]], fd: int, offset: int, need: int,
                 then: Sequence[tuple[int, bytes]] = ()) -> bool | None:
        """preadv (``need`` WRITE: file to guest) or pwritev (READ: guest to file) on views
        of the mappings; None (nothing done) where a piece is not plain mapped memory.
        The table's lock is held throughout, so a DMA_UNMAP waits for the transfer to end
        before it closes a mapping the views point into (closing it under them would fail).
        Where the native module is built, a transfer inside one sealed mapping (a guest's
        pages in its RAM: the common case) is one call into C (``mapped_io.c``), with
        ``then``'s writes (True: those are done too); anything else, or anything it finds
        outside the window, takes the general path below (False: ``then`` is left to the caller)."""
        with self._lock:
            if self._native_file_io is not None and ranges:
                m = self._sealed_window(ranges[0][0], 0, need)  # (the C code checks every range)
                if m is not None:
                    done = self._native_file_io(fd, offset, m.memory, m.address, m.map_delta, ranges,
                                                need == DMA_FLAG_WRITE, list(then))
                    if done is not None:
                        if need == DMA_FLAG_WRITE:
                            self.bytes_written += done + sum(len(data) for _, data in then)
                        else:
                            self.bytes_read += done
                        return True
            pieces = self._pieces_many(ranges, need)
            whole: dict[int, memoryview] = {}  # a view of each mapping the pieces lie in
            views: list[memoryview] = []
            try:
                for m, off, n in pieces:  # one pass: up to 32 pieces for 128 KiB
                    mapped = whole.get(id(m))
                    if mapped is None:
                        if m.memory is None or m.fd is not None:
                            return None  # an fd to pread/pwrite, a size to check, or messages to QEMU
                        mapped = whole[id(m)] = memoryview(m.memory)
                    at = m.map_delta + off
                    views.append(mapped[at:at + n])
                if need == DMA_FLAG_WRITE:
                    _preadv_all(fd, views, offset)
                else:
                    write_all(fd, views, offset)
            finally:
                for view in views:
                    view.release()
                for view in whole.values():
                    view.release()
            total = sum(n for _, n in ranges)
            if need == DMA_FLAG_WRITE:
                self.bytes_written += total
            else:
                self.bytes_read += total
        return False

    def _window_at(self, address: int) -> Mapping | None:
        """The window holding ``address`` (lock held), or None."""
        i = bisect.bisect_right(self._maps, address, key=_start) - 1
        m = self._maps[i] if i >= 0 else None
        return m if m is not None and address < m.end else None

    def _sealed_window(self, address: int, length: int, need: int) -> Mapping | None:
        """The window holding all of [address, address + length) if it is a mapping that
        cannot shrink and grants ``need``, and Bus Master is on (lock held): there an access
        is a plain copy, checked here in one look (most DMA is a guest's RAM). Else None,
        for the general path, which splits, refuses and counts."""
        if not self.bus_master or length < 0:
            return None
        m = self._window_at(address)
        if m is None or m.memory is None or m.fd is not None or not m.flags & need or address + length > m.end:
            return None
        return m

    def read(self, address: int, length: int) -> bytes:
        with self._lock:
            m = self._sealed_window(address, length, DMA_FLAG_READ)
            if m is not None:
                start = m.map_delta + address - m.address
                self.bytes_read += length
                return m.memory[start:start + length]  # type: ignore[index]
        pieces = self._pieces(address, length, DMA_FLAG_READ)
        if len(pieces) == 1 and pieces[0][0].memory is not None:  # the common case: one copy
            m, off, n = pieces[0]
            _check_size(m, off, n)
            start = m.map_delta + off
            data = m.memory[start:start + n]
        else:
            data = b"".join(self._read_piece(m, off, n) for m, off, n in pieces)
        self.bytes_read += length
        return data

    def _read_piece(self, m: Mapping, off: int, n: int) -> bytes:
        if m.memory is not None:
            _check_size(m, off, n)
            start = m.map_delta + off
            return m.memory[start:start + n]
        if m.fd is not None:
            data = os.pread(m.fd, n, m.offset + off)
            if len(data) < n:
                raise DmaError(f"DMA read at {m.address + off:#x}: the client shrank the window's file")
            return data
        return self._fallback_access(m.address + off, n, False)

    def write(self, address: int, data: bytes | memoryview) -> None:
        with self._lock:
            m = self._sealed_window(address, len(data), DMA_FLAG_WRITE)
            if m is not None:
                start = m.map_delta + address - m.address
                m.memory[start:start + len(data)] = data  # type: ignore[index]
                self.bytes_written += len(data)
                return
        view = memoryview(data)
        done = 0
        for m, off, n in self._pieces(address, len(view), DMA_FLAG_WRITE):
            chunk = view[done:done + n]
            if m.memory is not None:
                _check_size(m, off, n)
                start = m.map_delta + off
                m.memory[start:start + n] = chunk
            elif m.fd is not None:
                _check_size(m, off, n)  # a pwrite past the end would grow the client's file
                if os.pwrite(m.fd, chunk, m.offset + off) < n:
                    raise DmaError(f"DMA write at {m.address + off:#x}: the client shrank the window's file")
            else:
                self._fallback_access(m.address + off, chunk, True)
            done += n
        self.bytes_written += len(data)

    def _fallback_access(self, address: int, what: int | bytes, write: bool) -> bytes:
        if self._fallback is None:
            raise DmaError(f"DMA at {address:#x}: window has no fd and no message path")
        result = self._fallback(address, what, write)
        return result if result is not None else b""


def _start(m: Mapping) -> int:
    return m.address


def _fd_mapping(m: Mapping, fd: int, offset: int) -> Mapping:
    """How to reach a window backed by ``fd`` (see the module docstring); ValueError
    (EINVAL to the client) when the window does not lie inside the fd."""
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and offset + m.size > st.st_size:
        raise ValueError(f"DMA map {m.address:#x}+{m.size:#x} at fd offset {offset:#x} ends past "
                         f"the end of its fd ({st.st_size:#x} bytes)")
    try:
        sealed = bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK)
    except OSError:  # not a memfd
        sealed = False
    if not sealed and stat.S_ISREG(st.st_mode) and _pread_pwrite_work(fd, offset):
        m.fd, m.offset = fd, offset
        return m
    delta = offset % PAGE_SIZE
    prot = (mmap.PROT_READ if m.flags & DMA_FLAG_READ else 0) | (mmap.PROT_WRITE if m.flags & DMA_FLAG_WRITE else 0)
    m.memory = mmap.mmap(fd, m.size + delta, mmap.MAP_SHARED, prot or mmap.PROT_READ, offset=offset - delta)
    m.map_delta = delta
    if not sealed and stat.S_ISREG(st.st_mode):
        m.fd, m.offset = fd, offset  # kept for the size check before each access
    return m


def _pread_pwrite_work(fd: int, offset: int) -> bool:
    """Whether the file takes read(2)/write(2) (shmem does, hugetlbfs does not write)."""
    try:
        os.pread(fd, 0, offset)
        os.pwrite(fd, b"", offset)
    except OSError:
        return False
    return True


def _preadv_all(fd: int, views: list[memoryview], offset: int) -> None:
    """Fill ``views`` from ``fd`` at ``offset``, continuing short reads; zeroes past the
    file's end (a namespace file shorter than its size reads as zeroes)."""
    for first in range(0, len(views), IOV_MAX):
        batch = views[first:first + IOV_MAX]
        want = sum(map(len, batch))
        done = os.preadv(fd, batch, offset)
        while done < want:
            at, rest = done, []
            for v in batch:  # the views not yet full, the first one from where it stopped
                if at >= len(v):
                    at -= len(v)
                    continue
                rest.append(v[at:])
                at = 0
            n = os.preadv(fd, rest, offset + done)
            if n <= 0:  # the end of the file: the rest reads as zeroes
                for v in rest:
                    v[:] = bytes(len(v))
                break
            done += n
        offset += want


def _check_size(m: Mapping, off: int, n: int) -> None:
    """Refuse an access past the end of a file that may have shrunk (SIGBUS otherwise)."""
    if m.fd is not None and os.fstat(m.fd).st_size < m.offset + off + n:
        raise DmaError(f"DMA at {m.address + off:#x}: the client shrank the window's file")
