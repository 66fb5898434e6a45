"""Memory a device shares with whoever maps its BAR: a sealed memfd, mmapped here.

A BAR declared host-mappable (:class:`~qemu_device.bars.BarSpec` ``host_mappable``) is
mapped by QEMU straight into the guest, so guest stores reach this memory at memory
speed with no message. The memfd is sealed against shrinking and growing (and further
sealing): the peer that maps it can never be made to touch pages past its end (SIGBUS),
which is the same rule our own DMA table applies to QEMU's memfds.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import weakref

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class MappedMemory:
    """``size`` bytes of zeroed, shareable memory: ``fd`` to hand out, ``buf`` to use here."""

    def __init__(self, size: int, name: str = "dxpu-bar") -> None:
        if size <= 0 or size % mmap.PAGESIZE:
            raise ValueError(f"mapped memory must be a positive multiple of {mmap.PAGESIZE} bytes, not {size}")
        self.size = size
        self.areas: list[tuple[int, int]] | None = None  # (offset, size) QEMU may map; None: all of it
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
            self.buf = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        # a model nobody closes (a display made in a unit test) gives its descriptor back when collected
        self._fd_closer = weakref.finalize(self, os.close, self.fd)

    def __len__(self) -> int:
        return self.size

    def close(self) -> None:
        """Unmap and close; a peer's own mapping stays valid until it unmaps."""
        if self.fd >= 0:
            try:
                self.buf.close()
            except BufferError:  # a view of it is still alive: the mapping goes with it
                pass
            self._fd_closer()
            self.fd = -1
