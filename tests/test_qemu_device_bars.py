"""BAR sizing as Linux's __pci_read_base() does it, layout validation, SparseMemory."""

from __future__ import annotations

import pytest

from qemu_device.bars import BarSpec, SparseMemory, bar_address, bar_register, install_bars
from qemu_device.config_space import ConfigSpace
from qemu_device.header import COMMAND, PciIdentity, install_type0_header

MEM_MASK = 0xFFFF_FFF0     # PCI_BASE_ADDRESS_MEM_MASK
GiB = 1 << 30


def pci_size(base: int, maxbase: int, mask: int) -> int:
    """drivers/pci/probe.c pci_size()."""
    size = maxbase & mask
    if not size:
        return 0
    size = size & ~(size - 1)
    if base == maxbase and ((base | (size - 1)) & mask) != mask:
        return 0
    return size


def linux_read_base(cfg: ConfigSpace, slot: int) -> tuple[int, bool, bool]:
    """__pci_read_base() for a memory BAR: (size, is_64bit, prefetchable), via guest accesses."""
    pos = bar_register(slot)
    orig_cmd = cfg.read(COMMAND, 2)
    cfg.write(COMMAND, 2, orig_cmd & ~0x3)          # decode off while sizing
    low = cfg.read(pos, 4)
    cfg.write(pos, 4, low | 0xFFFF_FFFF)
    sz = cfg.read(pos, 4)
    cfg.write(pos, 4, low)
    if sz == 0xFFFF_FFFF:
        sz = 0
    assert low & 1 == 0, "memory BAR expected"
    is_64 = (low >> 1) & 0b11 == 0b10
    prefetch = bool(low & 0x8)
    l64, sz64, mask64 = low & MEM_MASK, sz & MEM_MASK, MEM_MASK
    if is_64:
        high = cfg.read(pos + 4, 4)
        cfg.write(pos + 4, 4, 0xFFFF_FFFF)
        sz_high = cfg.read(pos + 4, 4)
        cfg.write(pos + 4, 4, high)
        l64 |= high << 32
        sz64 |= sz_high << 32
        mask64 |= 0xFFFF_FFFF << 32
    cfg.write(COMMAND, 2, orig_cmd)
    return pci_size(l64, sz64, mask64), is_64, prefetch


def config_with(specs: list[BarSpec]) -> ConfigSpace:
    cfg = ConfigSpace(256)
    install_type0_header(cfg, PciIdentity(0x1B36, 0x10F0, 0xFF0000), intx=True)
    install_bars(cfg, specs)
    return cfg


@pytest.mark.parametrize("spec", [
    BarSpec(0, 4096, "mem32"),
    BarSpec(1, 4096, "mem32", prefetchable=True),
    BarSpec(0, 2 * GiB, "mem32"),
    BarSpec(0, 4096, "mem64"),
    BarSpec(2, 4 * GiB, "mem64", prefetchable=True),
    BarSpec(4, 64 * GiB, "mem64", prefetchable=True),
    BarSpec(0, 16, "mem32"),
], ids=lambda s: f"bar{s.index}-{s.size:#x}-{s.kind.value}{'-pref' if s.prefetchable else ''}")
def test_linux_sizing_reads_back_size_and_type(spec):
    cfg = config_with([spec])
    size, is_64, prefetch = linux_read_base(cfg, spec.index)
    assert (size, is_64, prefetch) == (spec.size, spec.is_64bit, spec.prefetchable)
    # the BAR is left as it was found: unassigned, type bits intact
    assert cfg.read(bar_register(spec.index), 4) == spec.type_bits


def test_sizing_masks_are_exact_for_4k_4g_64g():
    cfg = config_with([BarSpec(0, 4096, "mem32"), BarSpec(2, 4 * GiB, "mem64", True),
                       BarSpec(4, 64 * GiB, "mem64", True)])
    for slot in range(6):
        cfg.write(bar_register(slot), 4, 0xFFFF_FFFF)
    assert cfg.read(0x10, 4) == 0xFFFF_F000
    assert cfg.read(0x18, 4) == 0x0000_000C       # 4 GiB: no low address bits, 64-bit prefetch
    assert cfg.read(0x1C, 4) == 0xFFFF_FFFF
    assert cfg.read(0x20, 4) == 0x0000_000C
    assert cfg.read(0x24, 4) == 0xFFFF_FFF0       # 64 GiB: bits 35:32 are size bits
    assert cfg.read(0x14, 4) == 0                 # unimplemented slot reads zero


def test_assigned_address_is_kept_and_reported():
    spec = BarSpec(2, 4 * GiB, "mem64", prefetchable=True)
    cfg = config_with([spec])
    cfg.write(0x18, 4, 0x1234_5678)
    cfg.write(0x1C, 4, 0x0000_0008)
    assert bar_address(cfg, spec) == 0x8_0000_0000   # low address bits below 4 GiB are RO 0
    assert cfg.read(0x18, 4) == 0xC


def test_absent_slots_size_to_zero_like_linux_expects():
    cfg = config_with([BarSpec(0, 4096)])
    assert linux_read_base(cfg, 3)[0] == 0


@pytest.mark.parametrize("kwargs,message", [
    (dict(index=0, size=3000), "power of two"),
    (dict(index=0, size=8), "power of two"),
    (dict(index=0, size=4 * GiB, kind="mem32"), "at most 2 GiB"),
    (dict(index=0, size=128 * GiB, kind="mem64"), "64 GiB"),
    (dict(index=5, size=4096, kind="mem64"), "BAR 5 cannot be 64-bit"),
    (dict(index=6, size=4096), "0-5"),
    (dict(index=0, size=4096, kind="io"), "mem32' or 'mem64"),
])
def test_bar_spec_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BarSpec(**kwargs)


def test_overlapping_slots_rejected():
    with pytest.raises(ValueError, match="BAR 1 .* overlaps the upper half of 64-bit BAR 0"):
        config_with([BarSpec(0, 4096, "mem64"), BarSpec(1, 4096)])
    with pytest.raises(ValueError, match="overlaps BAR 2"):
        config_with([BarSpec(2, 4096), BarSpec(2, 8192)])


def test_sparse_memory_costs_only_written_pages():
    mem = SparseMemory(64 * GiB)
    mem.write(60 * GiB, b"\x5a")
    assert mem.resident_bytes == 4096
    assert mem.read(60 * GiB - 1, 3) == b"\x00\x5a\x00"
    assert mem.read(10 * GiB, 1 << 16) == bytes(1 << 16)      # reads allocate nothing
    assert mem.resident_bytes == 4096


def test_sparse_memory_spans_pages_and_zero_writes_stay_sparse():
    mem = SparseMemory(1 << 20)
    data = bytes(range(256)) * 40                                 # 10240 bytes
    mem.write(4000, data)
    assert mem.read(4000, len(data)) == data
    assert mem.resident_bytes == 4 * 4096                         # pages 0..3
    mem.write(0x80000, bytes(8192))
    assert mem.resident_bytes == 4 * 4096
    mem.clear()
    assert mem.resident_bytes == 0 and mem.read(4000, 4) == bytes(4)


@pytest.mark.parametrize("offset,length", [(-1, 1), ((1 << 20) - 1, 2), (1 << 20, 1)])
def test_sparse_memory_bounds(offset, length):
    mem = SparseMemory(1 << 20)
    with pytest.raises(ValueError, match="outside"):
        mem.read(offset, length)
    with pytest.raises(ValueError, match="outside"):
        mem.write(offset, b"\1" * length)


def test_sparse_memory_with_larger_pages():
    mem = SparseMemory(1 << 30, page_size=64 << 10)
    mem.write(100, bytes(1 << 20))                       # zeros: nothing allocated
    assert mem.resident_bytes == 0
    mem.write((64 << 10) - 1, b"\x01\x02")              # straddles two pages
    assert mem.resident_bytes == 128 << 10
    assert mem.read((64 << 10) - 2, 4) == b"\x00\x01\x02\x00"
    with pytest.raises(ValueError, match="power of two"):
        SparseMemory(1 << 20, page_size=3000)


def test_sparse_memory_views_are_the_bytes_without_a_copy():
    """views(): what read() gives, as views of the pages (absent ones as zeros), without
    allocating; a write to a present page shows through its view."""
    mem = SparseMemory(1 << 20)
    data = bytes(range(256)) * 40
    mem.write(4000, data)
    views = mem.views(100, 20000)
    assert b"".join(views) == mem.read(100, 20000)
    assert [len(v) for v in views] == [3996, 4096, 4096, 4096, 3716] and mem.resident_bytes == 4 * 4096
    mem.write(4096, b"\xff")
    assert views[1][0] == 0xFF
    with pytest.raises(ValueError):
        mem.views((1 << 20) - 1, 2)


def test_sparse_memory_read_into_a_kept_buffer():
    """read_into(): what read() gives, into the caller's buffer (absent pages as zeros,
    whatever the buffer held before), and refused outside the memory."""
    mem = SparseMemory(1 << 20)
    data = bytes(range(256)) * 40
    mem.write(4000, data)
    out = bytearray(b"\xaa" * 20000)
    mem.read_into(100, memoryview(out))
    assert bytes(out) == mem.read(100, 20000)
    assert out[:3900] == bytes(3900)                     # zeros before the data, none of the old bytes
    with pytest.raises(ValueError, match="outside"):
        mem.read_into((1 << 20) - 1, memoryview(bytearray(2)))
