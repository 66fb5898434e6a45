"""Backing store for large BARs that costs memory only for pages written.

A device can advertise a 64 GiB BAR (a GPU's VRAM, say) on a host with far
less RAM: pages are allocated on the first write of non-zero data, and
unwritten bytes read as zero, like freshly cleared device memory.
"""

from __future__ import annotations

PAGE_SIZE = 4096


class SparseMemory:
    """``size`` bytes of zero-initialised memory, stored as a dict of pages (4 KiB by
    default; a device that moves megabytes at a time, the accelerator's VRAM, takes
    larger ones: fewer pages to visit per access)."""

    def __init__(self, size: int, page_size: int = PAGE_SIZE) -> None:
        if size <= 0:
            raise ValueError(f"memory size must be positive, not {size}")
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page size must be a power of two, not {page_size}")
        self.size = size
        self.page_size = page_size
        self._zero_page = bytes(page_size)
        self._pages: dict[int, bytearray] = {}

    @property
    def resident_bytes(self) -> int:
        """Bytes actually allocated (whole pages)."""
        return len(self._pages) * self.page_size

    def read(self, offset: int, length: int) -> bytes:
        self._check(offset, length)
        out = bytearray(length)
        for pos, page_index, page_offset, chunk in self._chunks(offset, length):
            page = self._pages.get(page_index)
            if page is not None:
                out[pos:pos + chunk] = page[page_offset:page_offset + chunk]
        return bytes(out)

    def read_into(self, offset: int, out: memoryview) -> None:
        """The ``len(out)`` bytes at ``offset`` copied into ``out`` (absent pages as zeros):
        a reader that keeps its buffer pays no allocation and no page faults per read, where
        a fresh multi-megabyte ``bytes`` costs a fault for every 4 KiB of it."""
        self._check(offset, len(out))
        for pos, page_index, page_offset, chunk in self._chunks(offset, len(out)):
            page = self._pages.get(page_index)
            if page is None:
                out[pos:pos + chunk] = self._zero_page[:chunk]
            else:
                out[pos:pos + chunk] = memoryview(page)[page_offset:page_offset + chunk]

    def views(self, offset: int, length: int) -> list[memoryview]:
        """The bytes at ``offset`` as views of the pages themselves (absent ones as zeros),
        back to back: for sending them without a copy. A later write shows through a view
        of a present page, as it would through a device's memory."""
        self._check(offset, length)
        out = []
        for _, page_index, page_offset, chunk in self._chunks(offset, length):
            page = self._pages.get(page_index)
            out.append(memoryview(self._zero_page if page is None else page)[page_offset:page_offset + chunk])
        return out

    def write(self, offset: int, data: bytes) -> None:
        self._check(offset, len(data))
        view = memoryview(data)
        for pos, page_index, page_offset, chunk in self._chunks(offset, len(data)):
            piece = view[pos:pos + chunk]
            page = self._pages.get(page_index)
            if page is None:
                if piece.tobytes() == (self._zero_page if chunk == self.page_size else bytes(chunk)):
                    continue   # zeros onto an absent page change nothing: stay sparse
                page = self._pages[page_index] = bytearray(self.page_size)
            page[page_offset:page_offset + chunk] = piece

    def clear(self) -> None:
        """Back to all zeros, releasing every page."""
        self._pages.clear()

    def _chunks(self, offset: int, length: int):
        """Yield (position in buffer, page index, offset in page, chunk length)."""
        pos = 0
        while pos < length:
            address = offset + pos
            page_index, page_offset = divmod(address, self.page_size)
            chunk = min(self.page_size - page_offset, length - pos)
            yield pos, page_index, page_offset, chunk
            pos += chunk

    def _check(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(
                f"memory access [{offset:#x}, +{length:#x}) outside {self.size:#x}-byte memory")
