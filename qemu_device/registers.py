"""A BAR of 32-bit registers reached by accesses of any size and alignment.

Guests (and the vfio-user client) may read or write 1, 2, 4 or 8 bytes at any offset; a
device model thinks in whole 32-bit registers. A read is assembled from the registers it
covers; a write reaches each covered register with a byte-lane mask, so a 1-byte write
changes only its lane (read-modify-write semantics are the model's, not guessed here).
"""

from __future__ import annotations

from typing import Callable


def read_registers(read_register: Callable[[int], int], offset: int, size: int) -> bytes:
    """``size`` bytes at ``offset`` from the 32-bit registers ``read_register(reg)`` returns."""
    first, last = offset & ~3, (offset + size - 1) & ~3
    words = b"".join(read_register(reg).to_bytes(4, "little") for reg in range(first, last + 4, 4))
    return words[offset - first:offset - first + size]


def write_registers(write_register: Callable[[int, int, int], None], offset: int, data: bytes) -> None:
    """Each 32-bit register ``data`` covers gets ``write_register(reg, value, lanes)``,
    ``lanes`` the mask (0xFF per byte) of the bytes written."""
    if len(data) == 4 and not offset & 3:  # the common access (a doorbell): no loop over lanes
        write_register(offset, int.from_bytes(data, "little"), 0xFFFFFFFF)
        return
    end = offset + len(data)
    for reg in range(offset & ~3, end, 4):
        value = lanes = 0
        for lane in range(4):
            pos = reg + lane
            if offset <= pos < end:
                value |= data[pos - offset] << (8 * lane)
                lanes |= 0xFF << (8 * lane)
        write_register(reg, value, lanes)
