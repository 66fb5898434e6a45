"""Base Address Registers: what a device declares, and how the guest sizes them.

Sizing is done purely with write masks: the address bits below the BAR's size
are read-only zero, so when firmware or Linux (``__pci_read_base``) writes all
ones it reads back the size mask, and the low type bits (read-only) tell it
32/64-bit and prefetchable. A 64-bit BAR uses the next slot as its upper half.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .config_space import ConfigSpace
from .header import BAR0
from .sparse_memory import SparseMemory

__all__ = ["BarKind", "BarSpec", "SparseMemory", "validate_bar_layout", "install_bars",
           "bar_register", "bar_address", "MIN_BAR_SIZE", "MAX_MEM32_BAR", "MAX_MEM64_BAR"]

MIN_BAR_SIZE = 16
MAX_MEM32_BAR = 2 << 30
MAX_MEM64_BAR = 64 << 30
BAR_SLOTS = 6

TYPE_MEM64 = 0b10 << 1
PREFETCHABLE = 1 << 3
MEM_ADDRESS_MASK = 0xFFFF_FFF0


class BarKind(str, enum.Enum):
    MEM32 = "mem32"
    MEM64 = "mem64"


@dataclass(frozen=True)
class BarSpec:
    """One memory BAR: slot ``index`` (0-5), power-of-two ``size`` in bytes.

    ``host_mappable``: the BAR is memory written only by the CPU (a framebuffer), which
    whoever serves the device may let the VMM map into the guest, so that guest stores
    never become messages; the model then keeps the BAR in a
    :class:`~qemu_device.mapped_memory.MappedMemory` (``PciFunction.bar_memory``). Only a
    prefetchable BAR may be: reads have no side effects and writes may be merged."""

    index: int
    size: int
    kind: BarKind = BarKind.MEM32
    prefetchable: bool = False
    host_mappable: bool = False

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", BarKind(self.kind))
        except ValueError:
            raise ValueError(f"BAR {self.index}: kind must be 'mem32' or 'mem64', "
                             f"not {self.kind!r}") from None
        if not 0 <= self.index < BAR_SLOTS:
            raise ValueError(f"BAR index must be 0-5, not {self.index}")
        if self.size < MIN_BAR_SIZE or self.size & (self.size - 1):
            raise ValueError(f"BAR {self.index}: size {self.size:#x} must be a power of two "
                             f">= {MIN_BAR_SIZE}")
        if self.kind is BarKind.MEM32 and self.size > MAX_MEM32_BAR:
            raise ValueError(f"BAR {self.index}: a 32-bit BAR can be at most 2 GiB, "
                             f"not {self.size:#x}; use kind='mem64'")
        if self.host_mappable and not self.prefetchable:
            raise ValueError(f"BAR {self.index}: only a prefetchable BAR can be host-mappable")
        if self.host_mappable and self.size % 4096:
            raise ValueError(f"BAR {self.index}: a host-mappable BAR is whole pages (4 KiB or more)")
        if self.kind is BarKind.MEM64:
            if self.size > MAX_MEM64_BAR:
                raise ValueError(f"BAR {self.index}: size {self.size:#x} exceeds the "
                                 f"64 GiB limit for 64-bit BARs")
            if self.index == BAR_SLOTS - 1:
                raise ValueError("BAR 5 cannot be 64-bit: its upper half would need slot 6")

    @property
    def is_64bit(self) -> bool:
        return self.kind is BarKind.MEM64

    @property
    def slots(self) -> tuple[int, ...]:
        """The BAR register slots this BAR occupies (two for 64-bit)."""
        return (self.index, self.index + 1) if self.is_64bit else (self.index,)

    @property
    def type_bits(self) -> int:
        """Read-only low bits of the BAR register: memory space, type, prefetchable."""
        return (TYPE_MEM64 if self.is_64bit else 0) | (PREFETCHABLE if self.prefetchable else 0)


def validate_bar_layout(specs: list[BarSpec]) -> dict[int, BarSpec]:
    """Check that no two BARs share a slot; return them by index."""
    owner: dict[int, BarSpec] = {}
    for spec in specs:
        for slot in spec.slots:
            if slot in owner:
                other = owner[slot]
                what = (f"the upper half of 64-bit BAR {other.index}"
                        if slot != other.index else f"BAR {other.index}")
                raise ValueError(f"BAR {spec.index} (slot {slot}) overlaps {what}")
            owner[slot] = spec
    return {spec.index: spec for spec in specs}


def bar_register(slot: int) -> int:
    """Config offset of BAR register ``slot``."""
    return BAR0 + 4 * slot


def install_bars(config: ConfigSpace, specs: list[BarSpec]) -> None:
    """Set each BAR's type bits and sizing masks; BARs start unassigned (address 0)."""
    validate_bar_layout(specs)
    for spec in specs:
        low = bar_register(spec.index)
        config.set_u32(low, spec.type_bits)
        config.set_mask(low, 4, rw=MEM_ADDRESS_MASK & ~(spec.size - 1))
        if spec.is_64bit:
            high = bar_register(spec.index + 1)
            config.set_u32(high, 0)
            config.set_mask(high, 4, rw=0xFFFF_FFFF & ~((spec.size - 1) >> 32))


def bar_address(config: ConfigSpace, spec: BarSpec) -> int:
    """The address the guest assigned to the BAR (0 while unassigned)."""
    address = config.get_u32(bar_register(spec.index)) & MEM_ADDRESS_MASK
    if spec.is_64bit:
        address |= config.get_u32(bar_register(spec.index + 1)) << 32
    return address
