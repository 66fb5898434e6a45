"""PciFunction: regions, BAR dispatch, INTx/MSI/MSI-X signalling, reset."""

from __future__ import annotations

import pytest
from fakes import RecordingIrqPort

from qemu_device.bars import BarSpec
from qemu_device.capabilities import CAP_ID_MSI, CAP_ID_MSIX
from qemu_device.device import IrqConfig, PciFunction
from qemu_device.header import PciIdentity
from qemu_device.ports import DmaError, NullDmaPort, NullIrqPort

IDENTITY = PciIdentity(0x1B36, 0x10F0, 0xFF0000, revision=1)
CONFIG = 7


class RegisterFile(PciFunction):
    """A minimal model: BAR0 is 64 bytes of RAM-like registers; counts resets."""

    def __init__(self, irq: IrqConfig = IrqConfig(), **kwargs) -> None:
        super().__init__(IDENTITY, [BarSpec(0, 4096), BarSpec(2, 1 << 32, "mem64")], irq,
                         **kwargs)
        self.regs = bytearray(64)
        self.resets = 0
        self.hook_saw_lock = None

    def bar_read(self, index, offset, size):
        self.hook_saw_lock = self.lock._is_owned()
        if index == 2:
            return offset & 0xFF     # an int, converted by the base class
        return bytes(self.regs[offset:offset + size]).ljust(size, b"\0")

    def bar_write(self, index, offset, data):
        self.regs[offset:offset + len(data)] = data

    def reset_registers(self):
        self.regs[:] = bytes(64)
        self.resets += 1


def cfg_write(dev: PciFunction, offset: int, size: int, value: int) -> None:
    dev.region_write(CONFIG, offset, value.to_bytes(size, "little"))


def cfg_read(dev: PciFunction, offset: int, size: int) -> int:
    return int.from_bytes(dev.region_read(CONFIG, offset, size), "little")


def attached(dev: PciFunction) -> RecordingIrqPort:
    irq = RecordingIrqPort()
    dev.attach(NullDmaPort(), irq)
    return irq


def enable_msi(dev: PciFunction, mme: int) -> None:
    cfg_write(dev, dev.caps.offsets[CAP_ID_MSI] + 2, 2, mme << 4 | 1)


def msix_control(dev: PciFunction, enable: bool, function_mask: bool) -> None:
    cfg_write(dev, dev.caps.offsets[CAP_ID_MSIX] + 2, 2,
              (enable << 15) | (function_mask << 14))


# -- regions ---------------------------------------------------------------------

def test_regions_and_irq_counts():
    dev = RegisterFile(IrqConfig(intx=True, msi_vectors=4))
    infos = dev.regions()
    assert [r.index for r in infos] == list(range(9))
    assert [r.size for r in infos] == [4096, 0, 1 << 32, 0, 0, 0, 0, 4096, 0]
    assert infos[0].flags == 0b011 and not infos[0].mappable
    assert infos[3].flags == 0 and infos[6].flags == 0      # absent BAR, no ROM
    assert dev.irq_counts() == {"intx": 1, "msi": 4, "msix": 0, "err": 1, "req": 1}
    no_intx = RegisterFile(IrqConfig(intx=False, msix_vectors=8, msix_bar=0))
    assert no_intx.irq_counts() == {"intx": 0, "msi": 0, "msix": 8, "err": 1, "req": 1}
    assert no_intx.config.read(0x3D, 1) == 0


def test_bar_accesses_dispatch_to_hooks_with_lock_held():
    dev = RegisterFile()
    dev.region_write(0, 8, b"\x01\x02\x03\x04")
    assert dev.region_read(0, 8, 4) == b"\x01\x02\x03\x04"
    assert dev.hook_saw_lock is True
    assert dev.region_read(2, 0xFFFF_FF05, 2) == b"\x05\x00"


@pytest.mark.parametrize("index,offset,size", [
    (1, 0, 4), (6, 0, 4), (8, 0, 4), (9, 0, 4),     # absent BAR, ROM, VGA, beyond
    (0, 4096, 1), (0, 4094, 4), (0, -1, 1), (0, 0, 0),
    (2, (1 << 32) - 2, 4), (CONFIG, 4093, 4), (CONFIG, 0, 0),
])
def test_out_of_range_accesses_raise(index, offset, size):
    dev = RegisterFile()
    with pytest.raises(ValueError):
        dev.region_read(index, offset, size)
    with pytest.raises(ValueError):
        dev.region_write(index, offset, b"\0" * size)


def test_bars_served_with_memory_space_disabled():
    dev = RegisterFile()
    assert cfg_read(dev, 0x04, 2) & 0x2 == 0
    dev.region_write(0, 0, b"\x42")
    assert dev.region_read(0, 0, 1) == b"\x42"


def test_config_validation():
    with pytest.raises(ValueError, match="pcie=True"):
        RegisterFile(config_size=4096, pcie=False)
    with pytest.raises(ValueError, match="msi_vectors"):
        RegisterFile(IrqConfig(msi_vectors=3))


def test_null_ports_until_attached():
    dev = RegisterFile(IrqConfig(intx=True))
    assert isinstance(dev.irq, NullIrqPort)
    dev.raise_interrupt()
    assert dev.irq.dropped["intx"] == 1
    cfg_write(dev, 0x04, 2, 0x4)
    with pytest.raises(DmaError, match="no DMA port attached"):
        dev.dma_read(0x1000, 4)


def test_dma_refused_without_bus_master():
    dev = RegisterFile()
    with pytest.raises(DmaError, match="bus master"):
        dev.dma_write(0x1000, b"x")


# -- INTx --------------------------------------------------------------------------

def test_intx_status_and_line():
    dev = RegisterFile(IrqConfig(intx=True))
    irq = attached(dev)
    dev.raise_interrupt()
    assert cfg_read(dev, 0x06, 2) & 0x08
    assert irq.take() == [("intx", True)]
    dev.raise_interrupt()
    assert irq.take() == []                       # a level, not an edge
    cfg_write(dev, 0x06, 2, 0x08)                 # guest cannot clear Interrupt Status
    assert cfg_read(dev, 0x06, 2) & 0x08
    dev.lower_interrupt()
    assert not cfg_read(dev, 0x06, 2) & 0x08
    assert irq.take() == [("intx", False)]


def test_intx_disable_masks_and_unmask_reasserts():
    dev = RegisterFile(IrqConfig(intx=True))
    irq = attached(dev)
    cfg_write(dev, 0x04, 2, 1 << 10)
    dev.raise_interrupt()
    assert cfg_read(dev, 0x06, 2) & 0x08 and irq.take() == []
    cfg_write(dev, 0x04, 2, 0)                    # guest clears INTx Disable
    assert irq.take() == [("intx", True)]
    cfg_write(dev, 0x04, 2, 1 << 10)              # and sets it again
    assert irq.take() == [("intx", False)]
    assert cfg_read(dev, 0x06, 2) & 0x08          # status survives masking
    dev.lower_interrupt()
    cfg_write(dev, 0x04, 2, 0)
    assert irq.take() == []


def test_no_intx_pin_means_no_interrupt():
    dev = RegisterFile(IrqConfig(intx=False))
    irq = attached(dev)
    dev.raise_interrupt()
    assert irq.take() == [] and dev.suppressed_interrupts == 1
    assert not cfg_read(dev, 0x06, 2) & 0x08


# -- MSI ---------------------------------------------------------------------------

def test_msi_vectors_gated_by_multiple_message_enable():
    dev = RegisterFile(IrqConfig(intx=True, msi_vectors=8))
    irq = attached(dev)
    enable_msi(dev, mme=1)                        # 2 vectors granted
    for vector in range(4):
        dev.raise_interrupt(vector)
    assert irq.take() == [("msi", 0), ("msi", 1)]
    assert dev.suppressed_interrupts == 2
    assert not cfg_read(dev, 0x06, 2) & 0x08      # INTx untouched while MSI is on
    enable_msi(dev, mme=3)                        # 8 vectors
    dev.raise_interrupt(7)
    assert irq.take() == [("msi", 7)]


def test_msi_disabled_falls_back_to_intx():
    dev = RegisterFile(IrqConfig(intx=True, msi_vectors=4))
    irq = attached(dev)
    assert dev.intx_in_use()
    dev.raise_interrupt(2)
    assert irq.take() == [("intx", True)]
    enable_msi(dev, mme=0)                        # enabling MSI releases the INTx pin
    assert irq.take() == [("intx", False)]
    assert not dev.intx_in_use()                  # what NVMe asks before each completion
    dev.raise_interrupt(0)
    assert irq.take() == [("msi", 0)]


def test_msi_per_vector_mask_holds_then_delivers():
    dev = RegisterFile(IrqConfig(intx=False, msi_vectors=4, msi_per_vector_masking=True))
    irq = attached(dev)
    msi = dev.caps.offsets[CAP_ID_MSI]
    enable_msi(dev, mme=2)
    cfg_write(dev, msi + 0x10, 4, 0b0010)         # mask vector 1
    dev.raise_interrupt(1)
    dev.raise_interrupt(0)
    assert irq.take() == [("msi", 0)]
    assert cfg_read(dev, msi + 0x14, 4) == 0b0010  # pending
    cfg_write(dev, msi + 0x10, 4, 0)
    assert irq.take() == [("msi", 1)]
    assert cfg_read(dev, msi + 0x14, 4) == 0


# -- MSI-X -------------------------------------------------------------------------

def msix_device() -> tuple[RegisterFile, RecordingIrqPort]:
    dev = RegisterFile(IrqConfig(intx=True, msi_vectors=2, msix_vectors=4, msix_bar=0,
                                 msix_table_offset=0x800, msix_pba_offset=0xC00))
    return dev, attached(dev)


def unmask_entry(dev: PciFunction, vector: int, masked: bool = False) -> None:
    dev.region_write(0, 0x800 + 16 * vector + 12, int(masked).to_bytes(4, "little"))


def pba(dev: PciFunction) -> int:
    return int.from_bytes(dev.region_read(0, 0xC00, 8), "little")


def test_msix_table_entries_are_read_write_and_start_masked():
    dev, _ = msix_device()
    assert dev.region_read(0, 0x800 + 12, 4) == (1).to_bytes(4, "little")
    entry = (0xFEE0_0000).to_bytes(4, "little") + (0x1).to_bytes(4, "little") \
        + (0x4021).to_bytes(4, "little") + (0xFFFF_FFFF).to_bytes(4, "little")
    dev.region_write(0, 0x810, entry)
    assert dev.region_read(0, 0x810, 16) == entry[:12] + (1).to_bytes(4, "little")
    assert dev.msix.entry(1) == (0x1_FEE0_0000, 0x4021)
    dev.region_write(0, 0xC00, b"\xff" * 8)       # PBA is read-only
    assert pba(dev) == 0
    assert dev.region_read(0, 0x0, 4) == bytes(4)  # outside table/PBA: the model's BAR
    with pytest.raises(ValueError, match="straddles"):
        dev.region_read(0, 0x7FC, 8)


def test_msix_masked_vector_sets_pba_then_fires_on_unmask():
    dev, irq = msix_device()
    enable_msi(dev, mme=1)
    msix_control(dev, enable=True, function_mask=False)
    dev.raise_interrupt(2)                        # entry still masked
    assert irq.take() == [] and pba(dev) == 0b100
    unmask_entry(dev, 2)
    assert irq.take() == [("msix", 2)] and pba(dev) == 0
    dev.raise_interrupt(2)
    assert irq.take() == [("msix", 2)]            # MSI-X wins over the enabled MSI
    dev.raise_interrupt(4)                        # beyond the table
    assert irq.take() == [] and dev.suppressed_interrupts == 1


def test_msix_function_mask_holds_all_vectors():
    dev, irq = msix_device()
    for vector in range(4):
        unmask_entry(dev, vector)
    msix_control(dev, enable=True, function_mask=True)
    dev.raise_interrupt(0)
    dev.raise_interrupt(3)
    assert irq.take() == [] and pba(dev) == 0b1001
    assert dev.caps.msix_function_masked()
    msix_control(dev, enable=True, function_mask=False)
    assert sorted(irq.take()) == [("msix", 0), ("msix", 3)]
    assert pba(dev) == 0


def test_msix_disabled_uses_intx():
    dev, irq = msix_device()
    unmask_entry(dev, 0)
    dev.raise_interrupt(0)
    assert irq.take() == [("intx", True)]
    msix_control(dev, enable=True, function_mask=False)
    assert irq.take() == [("intx", False)]


# -- reset -------------------------------------------------------------------------

def test_reset_restores_power_on_config_and_calls_hook():
    dev, irq = msix_device()
    power_on = dev.region_read(CONFIG, 0, 4096)
    cfg_write(dev, 0x10, 4, 0xFEB0_0000)          # assign BAR0
    cfg_write(dev, 0x18, 4, 0x0)
    cfg_write(dev, 0x1C, 4, 0x1)
    cfg_write(dev, 0x04, 2, 0x0006)
    unmask_entry(dev, 1)
    dev.region_write(0, 0, b"\x99")
    dev.raise_interrupt(0)                        # INTx asserted
    enable_msi(dev, mme=1)
    msix_control(dev, enable=False, function_mask=True)
    assert dev.region_read(CONFIG, 0, 4096) != power_on
    irq.take()
    dev.reset()
    assert dev.region_read(CONFIG, 0, 4096) == power_on
    assert cfg_read(dev, 0x10, 4) == 0 and cfg_read(dev, 0x04, 2) == 0
    assert dev.msix.is_masked(1)
    assert dev.region_read(0, 0, 1) == b"\x00" and dev.resets == 1
    dev.raise_interrupt(0)
    assert irq.take() == [("intx", True)]         # back to INTx, MSI/MSI-X off


def test_reset_deasserts_a_raised_intx():
    dev = RegisterFile(IrqConfig(intx=True))
    irq = attached(dev)
    dev.raise_interrupt()
    dev.reset()
    assert irq.take() == [("intx", True), ("intx", False)]
    assert not cfg_read(dev, 0x06, 2) & 0x08
