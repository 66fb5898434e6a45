"""The type-0 (endpoint) configuration header: identity, Command and Status.

Offsets and bits follow the PCI Local Bus spec; only what an endpoint model
needs is writable: Command keeps I/O, Memory, Bus Master and INTx Disable,
Status has the error bits as write-1-to-clear and reports INTx and the
capability list read-only.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config_space import ConfigSpace

VENDOR_ID = 0x00
DEVICE_ID = 0x02
COMMAND = 0x04
STATUS = 0x06
REVISION_ID = 0x08
CLASS_CODE = 0x09          # 3 bytes: programming interface, subclass, base class
CACHE_LINE_SIZE = 0x0C
LATENCY_TIMER = 0x0D
HEADER_TYPE = 0x0E
BIST = 0x0F
BAR0 = 0x10                # six 32-bit BAR registers, 0x10..0x27
CARDBUS_CIS = 0x28
SUBSYSTEM_VENDOR_ID = 0x2C
SUBSYSTEM_ID = 0x2E
EXPANSION_ROM = 0x30
CAPABILITIES_POINTER = 0x34
INTERRUPT_LINE = 0x3C
INTERRUPT_PIN = 0x3D
MIN_GNT = 0x3E
MAX_LAT = 0x3F

CMD_IO = 1 << 0
CMD_MEMORY = 1 << 1
CMD_BUS_MASTER = 1 << 2
CMD_INTX_DISABLE = 1 << 10
COMMAND_RW = CMD_IO | CMD_MEMORY | CMD_BUS_MASTER | CMD_INTX_DISABLE

STATUS_INTX = 1 << 3
STATUS_CAP_LIST = 1 << 4
STATUS_MASTER_DATA_PARITY_ERROR = 1 << 8
STATUS_SIGNALED_TARGET_ABORT = 1 << 11
STATUS_RECEIVED_TARGET_ABORT = 1 << 12
STATUS_RECEIVED_MASTER_ABORT = 1 << 13
STATUS_SIGNALED_SYSTEM_ERROR = 1 << 14
STATUS_DETECTED_PARITY_ERROR = 1 << 15
STATUS_W1C = (STATUS_MASTER_DATA_PARITY_ERROR | STATUS_SIGNALED_TARGET_ABORT
              | STATUS_RECEIVED_TARGET_ABORT | STATUS_RECEIVED_MASTER_ABORT
              | STATUS_SIGNALED_SYSTEM_ERROR | STATUS_DETECTED_PARITY_ERROR)

INTERRUPT_PIN_INTA = 1


@dataclass(frozen=True)
class PciIdentity:
    """What the guest's driver matches on. Subsystem ids default to vendor/device."""

    vendor_id: int
    device_id: int
    class_code: int
    revision: int = 0
    subsystem_vendor_id: int | None = None
    subsystem_id: int | None = None

    def __post_init__(self) -> None:
        for name, bits in (("vendor_id", 16), ("device_id", 16), ("class_code", 24),
                           ("revision", 8)):
            _check_bits(name, getattr(self, name), bits)
        for name in ("subsystem_vendor_id", "subsystem_id"):
            if getattr(self, name) is not None:
                _check_bits(name, getattr(self, name), 16)
        if self.vendor_id in (0x0000, 0xFFFF):
            raise ValueError(f"vendor id {self.vendor_id:#06x} means 'no device' to the guest")


def _check_bits(name: str, value: int, bits: int) -> None:
    if not 0 <= value < 1 << bits:
        raise ValueError(f"{name} {value:#x} does not fit in {bits} bits")


def install_type0_header(config: ConfigSpace, identity: PciIdentity, *, intx: bool) -> None:
    """Write the identity and set the header's write masks (BARs are done by bars.py)."""
    config.set_u16(VENDOR_ID, identity.vendor_id)
    config.set_u16(DEVICE_ID, identity.device_id)
    config.set_u8(REVISION_ID, identity.revision)
    config.set_u8(CLASS_CODE, identity.class_code & 0xFF)
    config.set_u16(CLASS_CODE + 1, identity.class_code >> 8)
    config.set_u8(HEADER_TYPE, 0x00)   # type 0, single function
    sub_vendor = identity.subsystem_vendor_id
    sub_id = identity.subsystem_id
    config.set_u16(SUBSYSTEM_VENDOR_ID, identity.vendor_id if sub_vendor is None else sub_vendor)
    config.set_u16(SUBSYSTEM_ID, identity.device_id if sub_id is None else sub_id)
    config.set_u8(INTERRUPT_PIN, INTERRUPT_PIN_INTA if intx else 0)

    config.set_mask(COMMAND, 2, rw=COMMAND_RW)
    config.set_mask(STATUS, 2, w1c=STATUS_W1C)
    # Software writes these two for its own bookkeeping; they change nothing in the device.
    config.set_mask(CACHE_LINE_SIZE, 1, rw=0xFF)
    config.set_mask(INTERRUPT_LINE, 1, rw=0xFF)


def command(config: ConfigSpace) -> int:
    return config.get_u16(COMMAND)


def bus_master_enabled(config: ConfigSpace) -> bool:
    """Bus Master Enable (Command bit 2). Read from the byte itself: every DMA asks."""
    return bool(config.data[COMMAND] & CMD_BUS_MASTER)


def intx_disabled(config: ConfigSpace) -> bool:
    return bool(command(config) & CMD_INTX_DISABLE)


def set_status_bits(config: ConfigSpace, bits: int, on: bool) -> None:
    """Device-side update of read-only Status bits (INTx status, capability list)."""
    status = config.get_u16(STATUS)
    config.set_u16(STATUS, (status | bits) if on else (status & ~bits))
