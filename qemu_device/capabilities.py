"""The capability list: Power Management, MSI, MSI-X and PCI Express.

Capabilities are laid out from 0x40 in the order they are added, each linked
from the previous one's next pointer (the first from 0x34), and Status bit 4
says the list exists. Each ``add_*`` sets the capability's registers and
write masks and returns its offset; readers give the device the state the
guest programmed (MSI enable and vector count, MSI-X enable and function mask)
so it knows how to signal an interrupt.

Extended capabilities (0x100 and up, 4 KiB config only) are not offered: the
list there is terminated by an all-zero header, which Linux reads as "none".
"""

from __future__ import annotations

from dataclasses import dataclass

from .config_space import ConfigSpace, overlaps
from .header import CAPABILITIES_POINTER, STATUS, STATUS_CAP_LIST, set_status_bits

CAP_ID_PM = 0x01
CAP_ID_MSI = 0x05
CAP_ID_PCIE = 0x10
CAP_ID_MSIX = 0x11

FIRST_CAPABILITY = 0x40
STANDARD_CONFIG_END = 0x100
EXTENDED_CAPABILITIES = 0x100

# Power Management (PCI PM 1.2)
PM_PMC = 0x02
PM_PMCSR = 0x04
PM_LENGTH = 0x08
PM_VERSION_1_2 = 0b011
PMCSR_POWER_STATE = 0b11
PMCSR_NO_SOFT_RESET = 1 << 3
D0, D3HOT = 0, 3

# MSI, 64-bit layout
MSI_CONTROL = 0x02
MSI_ADDRESS_LO = 0x04
MSI_ADDRESS_HI = 0x08
MSI_DATA = 0x0C
MSI_MASK_BITS = 0x10
MSI_PENDING_BITS = 0x14
MSI_CTRL_ENABLE = 1 << 0
MSI_CTRL_MMC_SHIFT = 1
MSI_CTRL_MME_SHIFT = 4
MSI_CTRL_MME = 0b111 << MSI_CTRL_MME_SHIFT
MSI_CTRL_64BIT = 1 << 7
MSI_CTRL_PER_VECTOR_MASK = 1 << 8
MSI_VECTOR_COUNTS = (1, 2, 4, 8, 16, 32)

# MSI-X
MSIX_CONTROL = 0x02
MSIX_TABLE = 0x04
MSIX_PBA = 0x08
MSIX_LENGTH = 0x0C
MSIX_CTRL_FUNCTION_MASK = 1 << 14
MSIX_CTRL_ENABLE = 1 << 15

# PCI Express capability, version 2, Endpoint
PCIE_CAPS = 0x02
PCIE_DEVCAP = 0x04
PCIE_DEVCTL = 0x08
PCIE_DEVSTA = 0x0A
PCIE_LNKCAP = 0x0C
PCIE_LNKCTL = 0x10
PCIE_LNKSTA = 0x12
PCIE_DEVCAP2 = 0x24
PCIE_DEVCTL2 = 0x28
PCIE_LNKCAP2 = 0x2C
PCIE_LNKCTL2 = 0x30
PCIE_LENGTH = 0x3C
PCIE_VERSION_2 = 2
PCIE_TYPE_ENDPOINT = 0
DEVCAP_ROLE_BASED_ERROR = 1 << 15
DEVCTL_RW = 0x79FF        # error reporting, relaxed ordering, MPS, ext tag, no snoop, MRRS
DEVCTL_DEFAULT = 0x2810   # MRRS 512, no snoop and relaxed ordering enabled (spec defaults)
DEVSTA_W1C = 0x000F       # correctable, non-fatal, fatal, unsupported request detected
LNKCTL_RW = 0x00CB        # ASPM control, RCB, common clock, extended synch
LNKSTA_SLOT_CLOCK = 1 << 12
MAX_PAYLOAD_SIZES = (128, 256, 512, 1024, 2048, 4096)
LINK_WIDTHS = (1, 2, 4, 8, 12, 16)
LINK_GENERATIONS = (1, 2, 3, 4, 5)     # 2.5, 5, 8, 16, 32 GT/s

MAX_LIST_LENGTH = (STANDARD_CONFIG_END - FIRST_CAPABILITY) // 4


@dataclass(frozen=True)
class MsiState:
    """What the guest programmed into the MSI capability."""

    enabled: bool
    vectors: int       # vectors the device may use: 2**MME, capped at what it offers
    address: int
    data: int
    masked: int        # per-vector mask bits (0 without per-vector masking)
    pending: int       # per-vector pending bits


class CapabilityList:
    """Builds and reads one function's capability list in its config space."""

    def __init__(self, config: ConfigSpace) -> None:
        self.config = config
        self.offsets: dict[int, int] = {}
        self.msi_vectors = 0
        self.msi_per_vector_masking = False
        self._next_free = FIRST_CAPABILITY
        self._last: int | None = None
        self._power_state = D0
        if config.size > STANDARD_CONFIG_END:
            config.set_u32(EXTENDED_CAPABILITIES, 0)   # an empty extended list

    # -- building ---------------------------------------------------------------

    def add_power_management(self) -> int:
        """PM 1.2: D0 and D3hot only, no PME; state survives D3hot (No_Soft_Reset)."""
        offset = self._add(CAP_ID_PM, PM_LENGTH)
        self.config.set_u16(offset + PM_PMC, PM_VERSION_1_2)
        self.config.set_u16(offset + PM_PMCSR, PMCSR_NO_SOFT_RESET | D0)
        self.config.set_mask(offset + PM_PMCSR, 2, rw=PMCSR_POWER_STATE)
        self.config.on_write(self._discard_unsupported_power_state)
        return offset

    def add_msi(self, vectors: int, per_vector_masking: bool = False) -> int:
        """MSI with a 64-bit address and ``vectors`` (1-32, a power of two) messages."""
        if vectors not in MSI_VECTOR_COUNTS:
            raise ValueError(f"MSI vectors must be one of {MSI_VECTOR_COUNTS}, not {vectors}")
        length = MSI_PENDING_BITS + 4 if per_vector_masking else MSI_DATA + 4
        offset = self._add(CAP_ID_MSI, length)
        control = MSI_CTRL_64BIT | (vectors.bit_length() - 1) << MSI_CTRL_MMC_SHIFT
        if per_vector_masking:
            control |= MSI_CTRL_PER_VECTOR_MASK
        self.config.set_u16(offset + MSI_CONTROL, control)
        self.config.set_mask(offset + MSI_CONTROL, 2, rw=MSI_CTRL_ENABLE | MSI_CTRL_MME)
        self.config.set_mask(offset + MSI_ADDRESS_LO, 4, rw=0xFFFF_FFFC)   # DWORD aligned
        self.config.set_mask(offset + MSI_ADDRESS_HI, 4, rw=0xFFFF_FFFF)
        self.config.set_mask(offset + MSI_DATA, 2, rw=0xFFFF)
        if per_vector_masking:
            self.config.set_mask(offset + MSI_MASK_BITS, 4, rw=(1 << vectors) - 1)
        self.msi_vectors = vectors
        self.msi_per_vector_masking = per_vector_masking
        return offset

    def add_msix(self, table_size: int, table_bar: int, table_offset: int,
                 pba_bar: int, pba_offset: int) -> int:
        """MSI-X with ``table_size`` vectors; table and PBA placed in the named BARs."""
        if not 1 <= table_size <= 2048:
            raise ValueError(f"MSI-X table size must be 1-2048, not {table_size}")
        for what, bar, where in (("table", table_bar, table_offset), ("PBA", pba_bar, pba_offset)):
            if not 0 <= bar <= 5:
                raise ValueError(f"MSI-X {what} BAR must be 0-5, not {bar}")
            if where % 8 or where < 0:
                raise ValueError(f"MSI-X {what} offset {where:#x} must be 8-byte aligned")
        offset = self._add(CAP_ID_MSIX, MSIX_LENGTH)
        self.config.set_u16(offset + MSIX_CONTROL, table_size - 1)
        self.config.set_mask(offset + MSIX_CONTROL, 2,
                             rw=MSIX_CTRL_FUNCTION_MASK | MSIX_CTRL_ENABLE)
        self.config.set_u32(offset + MSIX_TABLE, table_offset | table_bar)
        self.config.set_u32(offset + MSIX_PBA, pba_offset | pba_bar)
        return offset

    def add_pcie_endpoint(self, max_payload: int = 256, link_width: int = 1,
                          link_generation: int = 1) -> int:
        """PCI Express capability v2 of an Endpoint; the link is reported trained at its max."""
        if max_payload not in MAX_PAYLOAD_SIZES:
            raise ValueError(f"max payload must be one of {MAX_PAYLOAD_SIZES}, not {max_payload}")
        if link_width not in LINK_WIDTHS:
            raise ValueError(f"link width must be one of {LINK_WIDTHS}, not x{link_width}")
        if link_generation not in LINK_GENERATIONS:
            raise ValueError(f"link generation must be 1-5, not {link_generation}")
        offset = self._add(CAP_ID_PCIE, PCIE_LENGTH)
        config = self.config
        config.set_u16(offset + PCIE_CAPS, PCIE_VERSION_2 | PCIE_TYPE_ENDPOINT << 4)
        mps_code = MAX_PAYLOAD_SIZES.index(max_payload)
        config.set_u32(offset + PCIE_DEVCAP, mps_code | DEVCAP_ROLE_BASED_ERROR)
        config.set_u16(offset + PCIE_DEVCTL, DEVCTL_DEFAULT)
        config.set_mask(offset + PCIE_DEVCTL, 2, rw=DEVCTL_RW)
        config.set_mask(offset + PCIE_DEVSTA, 2, w1c=DEVSTA_W1C)
        config.set_u32(offset + PCIE_LNKCAP, link_generation | link_width << 4)
        config.set_mask(offset + PCIE_LNKCTL, 2, rw=LNKCTL_RW)
        config.set_u16(offset + PCIE_LNKSTA,
                       link_generation | link_width << 4 | LNKSTA_SLOT_CLOCK)
        supported_speeds = ((1 << link_generation) - 1) << 1
        config.set_u32(offset + PCIE_LNKCAP2, supported_speeds)
        config.set_u16(offset + PCIE_LNKCTL2, link_generation)   # target speed
        return offset

    def _add(self, cap_id: int, length: int) -> int:
        offset = self._next_free
        if offset + length > STANDARD_CONFIG_END:
            raise ValueError(f"capability {cap_id:#04x} ({length} bytes) does not fit below "
                             f"0x100 (next free offset {offset:#x})")
        if cap_id in self.offsets:
            raise ValueError(f"capability {cap_id:#04x} is already in the list")
        self.config.set_u8(offset, cap_id)
        self.config.set_u8(offset + 1, 0)
        if self._last is None:
            self.config.set_u8(CAPABILITIES_POINTER, offset)
            set_status_bits(self.config, STATUS_CAP_LIST, True)
        else:
            self.config.set_u8(self._last + 1, offset)
        self._last = offset
        self._next_free = (offset + length + 3) & ~3
        self.offsets[cap_id] = offset
        return offset

    # -- reading what the guest programmed ------------------------------------------

    def msi_state(self) -> MsiState:
        offset = self._offset(CAP_ID_MSI)
        vectors, masked = self.msi_vectors_masked()
        address = (self.config.get_u32(offset + MSI_ADDRESS_HI) << 32
                   | self.config.get_u32(offset + MSI_ADDRESS_LO))
        pending = self.config.get_u32(offset + MSI_PENDING_BITS) if self.msi_per_vector_masking else 0
        return MsiState(enabled=self.msi_enabled(), vectors=vectors, address=address,
                        data=self.config.get_u16(offset + MSI_DATA), masked=masked, pending=pending)

    def msi_vectors_masked(self) -> tuple[int, int]:
        """(vectors Multiple Message Enable grants, per-vector mask bits): what raising an
        MSI asks, in one or two config reads where :meth:`msi_state` makes six (a device
        raises one per batch of completions)."""
        offset = self._offset(CAP_ID_MSI)
        control = self.config.get_u16(offset + MSI_CONTROL)
        # Software must not enable more than offered; if it does, we use what we offer.
        vectors = min(1 << ((control & MSI_CTRL_MME) >> MSI_CTRL_MME_SHIFT), self.msi_vectors)
        masked = self.config.get_u32(offset + MSI_MASK_BITS) if self.msi_per_vector_masking else 0
        return vectors, masked

    def set_msi_pending(self, vector: int, pending: bool) -> None:
        """Device side: hold back (or release) a per-vector-masked MSI message."""
        if not self.msi_per_vector_masking:
            raise ValueError("MSI has no per-vector masking, so no pending bits")
        where = self._offset(CAP_ID_MSI) + MSI_PENDING_BITS
        bits = self.config.get_u32(where)
        self.config.set_u32(where, bits | 1 << vector if pending else bits & ~(1 << vector))

    def msi_enabled(self) -> bool:
        """MSI Enable: one read of Message Control, where :meth:`msi_state` makes six (an
        interrupt's path asks this once per completion)."""
        return CAP_ID_MSI in self.offsets and bool(
            self.config.get_u16(self.offsets[CAP_ID_MSI] + MSI_CONTROL) & MSI_CTRL_ENABLE)

    def msix_enabled(self) -> bool:
        return bool(self._msix_control() & MSIX_CTRL_ENABLE)

    def msix_function_masked(self) -> bool:
        return bool(self._msix_control() & MSIX_CTRL_FUNCTION_MASK)

    def power_state(self) -> int:
        """0 for D0, 3 for D3hot."""
        return self.config.get_u16(self._offset(CAP_ID_PM) + PM_PMCSR) & PMCSR_POWER_STATE

    def has(self, cap_id: int) -> bool:
        return cap_id in self.offsets

    def _msix_control(self) -> int:
        return self.config.get_u16(self._offset(CAP_ID_MSIX) + MSIX_CONTROL)

    def _offset(self, cap_id: int) -> int:
        try:
            return self.offsets[cap_id]
        except KeyError:
            raise ValueError(f"capability {cap_id:#04x} is not in the list") from None

    def _discard_unsupported_power_state(self, offset: int, size: int) -> None:
        """D1/D2 are not supported: per PM 1.2 such a write completes but changes nothing."""
        pmcsr = self.offsets[CAP_ID_PM] + PM_PMCSR
        if not overlaps(offset, size, pmcsr, 1):
            return
        value = self.config.get_u16(pmcsr)
        state = value & PMCSR_POWER_STATE
        if state in (D0, D3HOT):
            self._power_state = state
        else:
            self.config.set_u16(pmcsr, (value & ~PMCSR_POWER_STATE) | self._power_state)

    def reset_shadow_state(self) -> None:
        """Forget state kept outside config bytes (called at function reset)."""
        self._power_state = D0


def walk_capabilities(config: ConfigSpace) -> list[tuple[int, int]]:
    """(offset, cap id) of each capability, following next pointers from 0x34 as Linux does."""
    found: list[tuple[int, int]] = []
    if not config.get_u16(STATUS) & STATUS_CAP_LIST:
        return found
    offset = config.get_u8(CAPABILITIES_POINTER) & ~3
    while offset and len(found) < MAX_LIST_LENGTH:
        found.append((offset, config.get_u8(offset)))
        offset = config.get_u8(offset + 1) & ~3
    if offset:
        raise ValueError("capability list does not terminate (loop?)")
    return found
