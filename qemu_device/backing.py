"""What a block device model does to its backing file, with the failure semantics a
disk owes its guest: a write either reached the file whole or raises, and blocks
that are deallocated or zeroed read back zero without writing gigabytes of zeros.

The kernel may write less than asked (a full disk, a signal): ``write_all`` writes the
rest and raises :class:`OSError` (ENOSPC, EIO, ...) when the file takes no more, so the
caller completes the command with an error, never with success. ``punch_hole`` frees
the blocks (``fallocate(PUNCH_HOLE | KEEP_SIZE)``); ``zero_range`` zeroes them in place
(``fallocate(ZERO_RANGE | KEEP_SIZE)``). Where the file system has neither (EOPNOTSUPP),
both write zeros in bounded chunks, so the blocks still read zero.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10
ZERO_CHUNK = 1 << 20  # the fallback's zeros are written this much at a time

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
_libc.fallocate.restype = ctypes.c_int


def write_all(fd: int, pieces: list[bytes] | list[memoryview], offset: int) -> None:
    """Write ``pieces`` back to back at ``offset``, all of them or raise OSError.

    A short write is continued where it stopped; a write that makes no progress raises
    ENOSPC (the kernel returns 0 only when it cannot place a byte)."""
    total = sum(len(piece) for piece in pieces)
    done = os.pwritev(fd, pieces, offset)
    if done >= total:
        return
    rest, pos = memoryview(b"".join(pieces))[done:], offset + done
    while rest:
        n = os.pwrite(fd, rest, pos)  # raises ENOSPC/EIO where the file takes no more
        if n <= 0:
            raise OSError(errno.ENOSPC, f"pwrite wrote nothing at {pos}")
        rest, pos = rest[n:], pos + n


def _fallocate(fd: int, mode: int, offset: int, length: int) -> bool:
    """True if done; False where this file system cannot (EOPNOTSUPP); other errors raise."""
    if _libc.fallocate(fd, mode, offset, length) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS):
        return False
    raise OSError(err, f"fallocate(mode={mode:#x}, {offset}, {length}): {os.strerror(err)}")


def _write_zeros(fd: int, offset: int, length: int) -> None:
    zeros = bytes(min(length, ZERO_CHUNK))
    end = offset + length
    while offset < end:
        n = min(len(zeros), end - offset)
        write_all(fd, [memoryview(zeros)[:n]], offset)
        offset += n


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Deallocate [offset, offset+length): the blocks read zero and cost no disk."""
    if length > 0 and not _fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length):
        _write_zeros(fd, offset, length)


def zero_range(fd: int, offset: int, length: int) -> None:
    """Zero [offset, offset+length) and keep it allocated (a write of zeros, done by the file system)."""
    if length > 0 and not _fallocate(fd, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, offset, length):
        _write_zeros(fd, offset, length)
