"""PCI configuration space: bytes plus per-bit write masks.

The guest and the device see the same bytes through different doors: guest
writes (``write``, ``write_bytes``) honour the masks - read-write bits take the
written value, write-1-to-clear bits clear where a 1 is written, every other
bit is read-only - while the device's own setters (``set_u8`` ...) ignore the
masks, because read-only bits are exactly the ones the device owns.
"""

from __future__ import annotations

import struct
from typing import Callable

WriteHook = Callable[[int, int], None]

VALID_SIZES = (256, 4096)
ACCESS_SIZES = (1, 2, 4)
_U16, _U32 = struct.Struct("<H"), struct.Struct("<I")


class ConfigSpace:
    """One function's configuration space (256 bytes conventional, 4096 PCIe)."""

    def __init__(self, size: int = 256) -> None:
        if size not in VALID_SIZES:
            raise ValueError(f"config space size must be 256 or 4096, not {size}")
        self.size = size
        self.data = bytearray(size)
        self._rw = bytearray(size)
        self._w1c = bytearray(size)
        self._hooks: list[WriteHook] = []

    # -- guest side -----------------------------------------------------------

    def read(self, offset: int, size: int) -> int:
        """Guest read of a naturally aligned 1, 2 or 4 byte register."""
        self._check_access(offset, size)
        return int.from_bytes(self.data[offset:offset + size], "little")

    def write(self, offset: int, size: int, value: int) -> None:
        """Guest write of a naturally aligned 1, 2 or 4 byte register, honouring masks."""
        self._check_access(offset, size)
        if not 0 <= value < 1 << (8 * size):
            raise ValueError(f"value {value:#x} does not fit in {size} byte(s)")
        self._apply(offset, value.to_bytes(size, "little"))
        self._notify(offset, size)

    def read_bytes(self, offset: int, length: int) -> bytes:
        """Guest read of any length: vfio-user config accesses can have any count."""
        self._check_range(offset, length)
        return bytes(self.data[offset:offset + length])

    def write_bytes(self, offset: int, data: bytes) -> None:
        """Guest write of any length, applied byte by byte through the masks."""
        self._check_range(offset, len(data))
        self._apply(offset, data)
        self._notify(offset, len(data))

    def on_write(self, callback: WriteHook) -> None:
        """Call ``callback(offset, size)`` after every guest write (device reacts to it)."""
        self._hooks.append(callback)

    # -- device side (masks ignored) ----------------------------------------

    def get_u8(self, offset: int) -> int:
        return self._get(offset, 1)

    def get_u16(self, offset: int) -> int:  # unpacked in place: an interrupt's path reads a few
        if not 0 <= offset <= self.size - 2:
            self._check_range(offset, 2)
        return _U16.unpack_from(self.data, offset)[0]

    def get_u32(self, offset: int) -> int:
        if not 0 <= offset <= self.size - 4:
            self._check_range(offset, 4)
        return _U32.unpack_from(self.data, offset)[0]

    def set_u8(self, offset: int, value: int) -> None:
        self._set(offset, 1, value)

    def set_u16(self, offset: int, value: int) -> None:
        self._set(offset, 2, value)

    def set_u32(self, offset: int, value: int) -> None:
        self._set(offset, 4, value)

    def set_mask(self, offset: int, size: int, rw: int = 0, w1c: int = 0) -> None:
        """Declare which bits of ``size`` bytes at ``offset`` the guest may write or clear."""
        self._check_range(offset, size)
        limit = 1 << (8 * size)
        if not (0 <= rw < limit and 0 <= w1c < limit):
            raise ValueError(f"mask does not fit in {size} byte(s) at {offset:#x}")
        if rw & w1c:
            raise ValueError(f"bits {rw & w1c:#x} at {offset:#x} cannot be both RW and W1C")
        self._rw[offset:offset + size] = rw.to_bytes(size, "little")
        self._w1c[offset:offset + size] = w1c.to_bytes(size, "little")

    def rw_mask(self, offset: int, size: int) -> int:
        """The guest-writable bits of ``size`` bytes at ``offset`` (for tests and tools)."""
        self._check_range(offset, size)
        return int.from_bytes(self._rw[offset:offset + size], "little")

    def w1c_mask(self, offset: int, size: int) -> int:
        self._check_range(offset, size)
        return int.from_bytes(self._w1c[offset:offset + size], "little")

    def snapshot(self) -> bytes:
        """The current bytes, to restore at reset (masks never change after build)."""
        return bytes(self.data)

    def restore(self, image: bytes) -> None:
        """Put back bytes taken by ``snapshot`` (device side: no masks, no hooks)."""
        if len(image) != self.size:
            raise ValueError(f"config image is {len(image)} bytes, config space is {self.size}")
        self.data[:] = image

    # -- internals ------------------------------------------------------------

    def _apply(self, offset: int, data: bytes) -> None:
        for i, byte in enumerate(data):
            pos = offset + i
            rw, w1c = self._rw[pos], self._w1c[pos]
            old = self.data[pos]
            new = (old & ~rw) | (byte & rw)
            new &= ~(byte & w1c)
            self.data[pos] = new & 0xFF

    def _notify(self, offset: int, size: int) -> None:
        for hook in list(self._hooks):
            hook(offset, size)

    def _get(self, offset: int, size: int) -> int:
        self._check_range(offset, size)
        return int.from_bytes(self.data[offset:offset + size], "little")

    def _set(self, offset: int, size: int, value: int) -> None:
        self._check_range(offset, size)
        if not 0 <= value < 1 << (8 * size):
            raise ValueError(f"value {value:#x} does not fit in {size} byte(s)")
        self.data[offset:offset + size] = value.to_bytes(size, "little")

    def _check_access(self, offset: int, size: int) -> None:
        if size not in ACCESS_SIZES:
            raise ValueError(f"config access size must be 1, 2 or 4, not {size}")
        if offset % size:
            raise ValueError(f"unaligned {size}-byte config access at {offset:#x}")
        self._check_range(offset, size)

    def _check_range(self, offset: int, length: int) -> None:
        if length < 0 or offset < 0 or offset + length > self.size:
            raise ValueError(
                f"config access [{offset:#x}, +{length}) outside {self.size}-byte config space")


def overlaps(offset: int, size: int, start: int, length: int) -> bool:
    """True when access [offset, offset+size) touches register [start, start+length)."""
    return offset < start + length and start < offset + size
