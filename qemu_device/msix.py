"""The MSI-X table and Pending Bit Array that live inside one of a device's BARs.

The base device serves them so models don't have to: table entries are
read-write (address, data, and the per-vector mask bit, set at reset), the
PBA is read-only to the guest and set by the device when it has to hold back
a masked vector's message.
"""

from __future__ import annotations

ENTRY_SIZE = 16
ENTRY_ADDR_LO = 0x0
ENTRY_ADDR_HI = 0x4
ENTRY_DATA = 0x8
ENTRY_VECTOR_CONTROL = 0xC
VECTOR_MASKED = 1 << 0
MAX_VECTORS = 2048


def table_bytes(vectors: int) -> int:
    return vectors * ENTRY_SIZE


def pba_bytes(vectors: int) -> int:
    """One bit per vector, in whole QWORDs."""
    return (vectors + 63) // 64 * 8


class MsixTable:
    """``vectors`` table entries and their pending bits."""

    def __init__(self, vectors: int) -> None:
        if not 1 <= vectors <= MAX_VECTORS:
            raise ValueError(f"MSI-X table size must be 1-{MAX_VECTORS}, not {vectors}")
        self.vectors = vectors
        self.table_size = table_bytes(vectors)
        self.pba_size = pba_bytes(vectors)
        self._table = bytearray(self.table_size)
        self._pending = 0
        self.reset()

    def reset(self) -> None:
        """Every entry zero and masked, nothing pending (PCI power-on state)."""
        self._table[:] = bytes(self.table_size)
        for vector in range(self.vectors):
            self._table[vector * ENTRY_SIZE + ENTRY_VECTOR_CONTROL] = VECTOR_MASKED
        self._pending = 0

    # -- guest side ------------------------------------------------------------

    def read_table(self, offset: int, length: int) -> bytes:
        self._check(offset, length, self.table_size, "table")
        return bytes(self._table[offset:offset + length])

    def write_table(self, offset: int, data: bytes) -> None:
        """Guest write: only the mask bit of Vector Control is writable there."""
        self._check(offset, len(data), self.table_size, "table")
        for i, byte in enumerate(data):
            pos = offset + i
            field = pos % ENTRY_SIZE
            if field == ENTRY_VECTOR_CONTROL:
                byte &= VECTOR_MASKED
            elif field > ENTRY_VECTOR_CONTROL:
                continue          # reserved bits of Vector Control read as zero
            self._table[pos] = byte

    def read_pba(self, offset: int, length: int) -> bytes:
        self._check(offset, length, self.pba_size, "PBA")
        return self._pending.to_bytes(self.pba_size, "little")[offset:offset + length]

    # -- device side -----------------------------------------------------------

    def is_masked(self, vector: int) -> bool:
        self._check_vector(vector)
        return bool(self._table[vector * ENTRY_SIZE + ENTRY_VECTOR_CONTROL] & VECTOR_MASKED)

    def entry(self, vector: int) -> tuple[int, int]:
        """(message address, message data) of ``vector``."""
        self._check_vector(vector)
        base = vector * ENTRY_SIZE
        address = int.from_bytes(self._table[base:base + 8], "little")
        data = int.from_bytes(self._table[base + 8:base + 12], "little")
        return address, data

    def is_pending(self, vector: int) -> bool:
        self._check_vector(vector)
        return bool(self._pending >> vector & 1)

    def set_pending(self, vector: int, pending: bool) -> None:
        self._check_vector(vector)
        if pending:
            self._pending |= 1 << vector
        else:
            self._pending &= ~(1 << vector)

    def pending_vectors(self) -> list[int]:
        return [v for v in range(self.vectors) if self._pending >> v & 1]

    def _check_vector(self, vector: int) -> None:
        if not 0 <= vector < self.vectors:
            raise ValueError(f"MSI-X vector {vector} outside table of {self.vectors}")

    @staticmethod
    def _check(offset: int, length: int, size: int, what: str) -> None:
        if offset < 0 or length < 0 or offset + length > size:
            raise ValueError(f"MSI-X {what} access [{offset:#x}, +{length}) outside "
                             f"{size} bytes")
