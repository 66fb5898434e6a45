"""Posted writes combined into runs, the way a write-combining buffer would.

Posted MMIO writes (a framebuffer fill arrives as millions of 1-, 4- or 8-byte writes)
are kept in arrival order as *runs*: a write that continues the last run (same region,
next offset) extends it (only with ``merge``: for memory such as a framebuffer, never
for registers), any other write starts a new run. Whoever holds a
:class:`WriteRuns` flushes it, in order, before anything that must not pass a posted
write (a read, a config access, a reset, a completion) and whenever it would otherwise
wait; nothing is ever reordered, only glued together.

The link carries several runs in one message as WRITE_BATCH (docs/link-protocol.md):
a sequence of ``offset u64, region u32, count u32, data[count]`` entries, the layout of
a vfio-user REGION_WRITE payload, back to back.
"""

from __future__ import annotations

from dxpu_vfio.vfio_user.protocol import MAX_DATA_XFER, REGION_RW, ProtocolError, iter_write_multi

Run = tuple[int, int, bytearray]  # region, offset, data


class WriteRuns:
    """Pending posted writes. ``add`` returns True once the batch is full (its encoded
    size reached ``max_bytes``): the caller flushes then."""

    def __init__(self, max_bytes: int = MAX_DATA_XFER, merge: bool = True) -> None:
        self.max_bytes = max_bytes
        # Gluing adjacent writes into one is right for memory (a framebuffer) only: a
        # register block sees each write on its own (NVMe's SQ tail and CQ head doorbells
        # are adjacent dwords). Without ``merge`` the writes are only batched.
        self.merge = merge
        self.runs: list[Run] = []
        self.size = 0  # encoded size: data plus one entry header per run
        self.writes = 0  # writes since the last take()

    def __bool__(self) -> bool:
        return bool(self.runs)

    def add(self, region: int, offset: int, data: bytes | memoryview) -> bool:
        self.writes += 1
        runs = self.runs
        if runs and self.merge:
            last_region, last_offset, buf = runs[-1]
            if last_region == region and last_offset + len(buf) == offset:
                buf += data
                self.size += len(data)
                return self.size >= self.max_bytes
        runs.append((region, offset, bytearray(data)))
        self.size += REGION_RW.size + len(data)
        return self.size >= self.max_bytes

    def add_multi(self, payload: bytes | memoryview) -> bool:
        """Every write of a REGION_WRITE_MULTI payload, in order (``add``, inlined: a
        framebuffer fill brings millions of them)."""
        if not self.merge:
            full = False
            for offset, region, count, data in iter_write_multi(payload):
                full = self.add(region, offset, data[:count]) or full
            return full
        runs, size = self.runs, self.size
        last_region, end, buf = (runs[-1][0], runs[-1][1] + len(runs[-1][2]), runs[-1][2]) if runs else (-1, -1, None)
        writes = 0
        try:
            for offset, region, count, data in iter_write_multi(payload):
                writes += 1
                if region == last_region and offset == end:
                    buf += data[:count]
                    size += count
                else:
                    buf = bytearray(data[:count])
                    runs.append((region, offset, buf))
                    last_region = region
                    size += REGION_RW.size + count
                end = offset + count
        finally:  # a bad entry ends the message; the writes before it stay, counted
            self.size, self.writes = size, self.writes + writes
        return size >= self.max_bytes

    def take(self) -> list[Run]:
        runs, self.runs, self.size, self.writes = self.runs, [], 0, 0
        return runs


def pack_batch(runs: list[Run]) -> bytes:
    return b"".join(REGION_RW.pack(offset, region, len(data)) + data for region, offset, data in runs)


def unpack_batch(payload: bytes | memoryview) -> list[tuple[int, int, memoryview]]:
    """The runs of a WRITE_BATCH payload; never trusts a count."""
    view, pos, runs = memoryview(payload), 0, []
    while pos < len(view):
        if len(view) - pos < REGION_RW.size:
            raise ProtocolError(f"WRITE_BATCH: {len(view) - pos} stray bytes at {pos}")
        offset, region, count = REGION_RW.unpack_from(view, pos)
        pos += REGION_RW.size
        if count == 0 or count > len(view) - pos:
            raise ProtocolError(f"WRITE_BATCH entry of {count} bytes with {len(view) - pos} left")
        runs.append((region, offset, view[pos:pos + count]))
        pos += count
    return runs
