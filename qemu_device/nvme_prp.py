"""PRPs: how an NVMe Read or Write names the guest memory of its data (PRP1, PRP2 and
PRP lists), walked into (guest address, length) segments, adjacent pages merged.

The guest programs PRPs, so they are checked, and a walk through PRP lists is bounded
by the transfer: PRP1 dword aligned, PRP2 a page (one more page) or a qword-aligned list
pointer, every list entry (and the pointer to a next list in a page's last entry) page
aligned, else Invalid PRP Offset. Every list page then yields an entry, so a list that
points back at itself still ends. Pure functions but for ``read``, the controller's DMA
read of a list page.
"""

from __future__ import annotations

import itertools
import operator
import struct
from collections.abc import Callable

from .nvme_identity import LBA_SHIFT, MDTS, PAGE
from .nvme_spec import CommandError, IoOpcode, Status

PAGE_MASK = PAGE - 1
TRANSFER_FIELDS = struct.Struct("<QQ8xI")  # from an entry's PRP1: PRP1, PRP2, CDW12


def transfer(sqe: memoryview) -> tuple[int, int, int]:
    """A Read's or Write's (PRP1, PRP2, length in bytes), unchecked."""
    prp1, prp2, cdw12 = TRANSFER_FIELDS.unpack_from(sqe, 24)
    return prp1, prp2, ((cdw12 & 0xFFFF) + 1) << LBA_SHIFT


def first_list_page(sqe: memoryview) -> tuple[tuple[int, int], bool] | None:
    """The first PRP list page a Read or Write reads, as (address, length) (what
    :func:`segments` reads first), and whether its list goes on in another page; None for
    a command without a list, or one :func:`segments` refuses before reading."""
    if sqe[0] not in (IoOpcode.READ, IoOpcode.WRITE):
        return None
    prp1, prp2, length = transfer(sqe)
    left = length - min(length, PAGE - (prp1 % PAGE))
    if left <= PAGE or prp2 & 7 or length > (PAGE << MDTS):
        return None
    needed, room = (left + PAGE - 1) // PAGE, (PAGE - prp2 % PAGE) // 8
    return (prp2, min(room, needed) * 8), needed > room


def segments(prp1: int, prp2: int, length: int, read: Callable[[int, int], bytes],
             lists: dict[tuple[int, int], bytes] | None = None) -> list[tuple[int, int]]:
    """(guest address, length) pieces of a PRP transfer of ``length`` bytes; a list page
    is taken from ``lists`` (prefetched with its batch: the first page only) or ``read``."""

    if prp1 & 3:
        raise CommandError(Status.INVALID_PRP_OFFSET)
    first = min(length, PAGE - (prp1 % PAGE))
    pages = [(prp1, first)]
    left = length - first
    if 0 < left <= PAGE:
        if prp2 % PAGE:
            raise CommandError(Status.INVALID_PRP_OFFSET)
        pages.append((prp2, left))
    elif left > 0:
        if prp2 & 7:
            raise CommandError(Status.INVALID_PRP_OFFSET)
        needed = (left + PAGE - 1) // PAGE
        entries: list[int] = []
        list_addr = prp2
        for _ in range(needed + 1):  # the first page may hold only the pointer to the next
            room = (PAGE - list_addr % PAGE) // 8
            want = needed - len(entries)
            key = (list_addr, min(room, want) * 8)
            raw = lists.pop(key, None) if lists and not entries else None  # prefetched: the first page only
            chunk = struct.unpack(f"<{min(room, want)}Q", raw if raw is not None else read(*key))
            if want > room:  # the page's last entry points to the next list page
                entries.extend(chunk[:-1])
                list_addr = chunk[-1]
                if list_addr % PAGE:
                    raise CommandError(Status.INVALID_PRP_OFFSET)
            else:
                entries.extend(chunk)
                break
        if len(entries) != needed:
            raise CommandError(Status.INVALID_PRP_OFFSET)
        if any(map(PAGE_MASK.__and__, entries)):
            raise CommandError(Status.INVALID_PRP_OFFSET)
        pages.extend(zip(entries, itertools.repeat(PAGE)))  # whole pages but the last:
        pages[-1] = (pages[-1][0], left - (needed - 1) * PAGE)  # left covers them all
        # no two pages adjacent (a guest's mostly are not): nothing to merge. Checked by
        # builtins: this walk is per command, and 32 pages in a Python loop were a tenth
        # of a box's Python per 128 KiB Read
        if prp1 + first != entries[0] and PAGE not in map(operator.sub, entries[1:], entries):
            return pages
    merged: list[tuple[int, int]] = [pages[0]]
    start, size = pages[0]
    for addr, n in pages[1:]:  # adjacent pages merged, in one pass
        if start + size == addr:
            size += n
            merged[-1] = (start, size)
        else:
            start, size = addr, n
            merged.append((start, size))
    return merged

