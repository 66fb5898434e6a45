"""Capability list layout and the registers of PM, MSI, MSI-X and PCI Express."""

from __future__ import annotations

import pytest

from qemu_device import capabilities as caps_mod
from qemu_device.bars import BarSpec
from qemu_device.capabilities import CAP_ID_MSI, CAP_ID_MSIX, CAP_ID_PCIE, CAP_ID_PM, CapabilityList, walk_capabilities
from qemu_device.config_space import ConfigSpace
from qemu_device.device import IrqConfig, PciFunction
from qemu_device.header import PciIdentity

IDENTITY = PciIdentity(0x1B36, 0x10F0, 0xFF0000)


def function(**irq) -> PciFunction:
    return PciFunction(IDENTITY, [BarSpec(0, 4096)], IrqConfig(**irq))


def guest_walk(dev: PciFunction) -> list[tuple[int, int]]:
    """Walk the list through guest config reads only, from 0x34 like a driver."""
    assert dev.config.read(0x06, 2) & 0x10, "Status.Capabilities List must be set"
    found, offset = [], dev.config.read(0x34, 1) & ~3
    while offset:
        assert 0x40 <= offset < 0x100 and len(found) < 48
        found.append((offset, dev.config.read(offset, 1)))
        offset = dev.config.read(offset + 1, 1) & ~3
    return found


def test_walk_from_0x34_reaches_every_capability_and_terminates():
    dev = function(msi_vectors=4, msix_vectors=8, msix_bar=0, msix_table_offset=0x800)
    walk = guest_walk(dev)
    assert [cap for _, cap in walk] == [CAP_ID_PM, CAP_ID_MSI, CAP_ID_MSIX, CAP_ID_PCIE]
    assert walk[0][0] == 0x40
    assert walk == walk_capabilities(dev.config)
    assert {cap: off for off, cap in walk} == dev.caps.offsets
    # capabilities don't overlap: each ends before the next begins
    lengths = {CAP_ID_PM: 8, CAP_ID_MSI: 0x10, CAP_ID_MSIX: 12, CAP_ID_PCIE: 0x3C}
    for (off, cap), (next_off, _) in zip(walk, walk[1:]):
        assert off + lengths[cap] <= next_off


def test_list_pointers_are_read_only():
    dev = function(msi_vectors=1)
    before = guest_walk(dev)
    dev.config.write(0x34, 1, 0x80)
    for off, _ in before:
        dev.config.write(off, 2, 0xFFFF)
    assert guest_walk(dev) == before


def test_conventional_function_has_no_pcie_cap_and_no_extended_space():
    dev = PciFunction(IDENTITY, [], IrqConfig(msi_vectors=2), config_size=256, pcie=False)
    assert [cap for _, cap in guest_walk(dev)] == [CAP_ID_PM, CAP_ID_MSI]
    with pytest.raises(ValueError):
        dev.region_read(7, 0x100, 4)


def test_extended_list_terminated_by_zero_header():
    dev = function()
    assert dev.config.size == 4096
    assert dev.region_read(7, 0x100, 4) == bytes(4)
    dev.region_write(7, 0x100, b"\xff" * 4)
    assert dev.region_read(7, 0x100, 4) == bytes(4)


def test_each_capability_once_and_layout_packed_from_0x40():
    caps = CapabilityList(ConfigSpace(256))
    assert caps.add_pcie_endpoint() == 0x40
    assert caps.add_msi(32, per_vector_masking=True) == 0x7C
    assert caps.add_msix(4, 0, 0, 0, 0x40) == 0x94
    assert caps.add_power_management() == 0xA0
    with pytest.raises(ValueError, match="already in the list"):
        caps.add_msi(1)


def test_power_management_d0_d3hot_and_unsupported_states_discarded():
    dev = function()
    pm = dev.caps.offsets[CAP_ID_PM]
    assert dev.config.read(pm + 2, 2) & 0b111 == 0b011          # PM 1.2
    assert dev.config.read(pm + 4, 2) == 0x0008                  # D0, No_Soft_Reset
    dev.region_write(7, pm + 4, (3).to_bytes(2, "little"))
    assert dev.caps.power_state() == 3
    dev.region_write(7, pm + 4, (1).to_bytes(2, "little"))       # D1: not supported
    assert dev.caps.power_state() == 3
    dev.region_write(7, pm + 4, (0xFFF0).to_bytes(2, "little"))  # RO bits, D0
    assert dev.config.read(pm + 4, 2) == 0x0008


@pytest.mark.parametrize("vectors,mmc", [(1, 0), (2, 1), (4, 2), (8, 3), (16, 4), (32, 5)])
def test_msi_multiple_message_capable_encoding(vectors, mmc):
    dev = function(msi_vectors=vectors)
    control = dev.config.read(dev.caps.offsets[CAP_ID_MSI] + 2, 2)
    assert (control >> 1) & 0b111 == mmc
    assert control & 0x80                                        # 64-bit address capable
    assert not control & 0x100                                   # no per-vector masking


@pytest.mark.parametrize("vectors", [0, 3, 64])
def test_msi_bad_vector_counts(vectors):
    with pytest.raises(ValueError, match="MSI vectors"):
        CapabilityList(ConfigSpace(256)).add_msi(vectors)


def test_msi_registers_and_state():
    dev = function(msi_vectors=8, msi_per_vector_masking=True)
    msi = dev.caps.offsets[CAP_ID_MSI]
    state = dev.caps.msi_state()
    assert (state.enabled, state.vectors, state.address, state.data) == (False, 1, 0, 0)
    dev.config.write(msi + 2, 2, 0xFFFF)          # only enable and MME are writable
    assert dev.config.read(msi + 2, 2) == 0x0100 | 0x80 | (3 << 1) | (7 << 4) | 1
    dev.config.write(msi + 2, 2, (2 << 4) | 1)    # MME=2 -> 4 vectors
    dev.config.write(msi + 4, 4, 0xFEE0_1003)     # low address bits are RO 0
    dev.config.write(msi + 8, 4, 0x1)
    dev.config.write(msi + 0xC, 2, 0x4040)
    dev.config.write(msi + 0x10, 4, 0xFFFF_FFFF)  # mask bits: only the 8 offered
    dev.config.write(msi + 0x14, 4, 0xFFFF_FFFF)  # pending bits are RO
    state = dev.caps.msi_state()
    assert state.enabled and state.vectors == 4
    assert state.address == 0x1_FEE0_1000 and state.data == 0x4040
    assert state.masked == 0xFF and state.pending == 0


def test_msi_mme_beyond_capable_is_capped():
    dev = function(msi_vectors=2)
    dev.config.write(dev.caps.offsets[CAP_ID_MSI] + 2, 2, (5 << 4) | 1)
    assert dev.caps.msi_state().vectors == 2


def test_msix_capability_registers():
    dev = function(msix_vectors=16, msix_bar=0, msix_table_offset=0x400, msix_pba_offset=0xC00)
    off = dev.caps.offsets[CAP_ID_MSIX]
    assert dev.config.read(off + 2, 2) == 15                    # table size N-1
    assert dev.config.read(off + 4, 4) == 0x400                 # offset | BIR 0
    assert dev.config.read(off + 8, 4) == 0xC00
    assert not dev.caps.msix_enabled() and not dev.caps.msix_function_masked()
    dev.config.write(off + 2, 2, 0xFFFF)
    assert dev.config.read(off + 2, 2) == 0xC000 | 15
    assert dev.caps.msix_enabled() and dev.caps.msix_function_masked()
    dev.config.write(off + 4, 4, 0xFFFF_FFFF)
    assert dev.config.read(off + 4, 4) == 0x400


def test_msix_placement_validated():
    with pytest.raises(ValueError, match="8-byte aligned"):
        CapabilityList(ConfigSpace(256)).add_msix(4, 0, 0x804, 0, 0xC00)
    with pytest.raises(ValueError, match="msix_bar"):
        function(msix_vectors=4)
    with pytest.raises(ValueError, match="does not fit"):
        function(msix_vectors=4, msix_bar=0, msix_table_offset=0xFF8)
    with pytest.raises(ValueError, match="overlap"):
        function(msix_vectors=4, msix_bar=0, msix_table_offset=0x800, msix_pba_offset=0x808)


def test_pcie_endpoint_capability():
    cfg = ConfigSpace(4096)
    caps = CapabilityList(cfg)
    off = caps.add_pcie_endpoint(max_payload=256, link_width=8, link_generation=3)
    assert cfg.read(off + 2, 2) & 0xFF == 0x02                  # v2, endpoint (type 0)
    assert cfg.read(off + 4, 4) & 0b111 == 1                    # MPS supported 256
    lnkcap = cfg.read(off + 0xC, 4)
    assert (lnkcap & 0xF, (lnkcap >> 4) & 0x3F) == (3, 8)       # 8 GT/s x8
    assert cfg.read(off + 0x2C, 4) == 0b1110                    # 2.5, 5, 8 GT/s supported
    lnksta = cfg.read(off + 0x12, 2)
    assert (lnksta & 0xF, (lnksta >> 4) & 0x3F) == (3, 8)
    cfg.write(off + 0x12, 2, 0)
    assert cfg.read(off + 0x12, 2) == lnksta                    # link status is RO
    assert cfg.read(off + 8, 2) == 0x2810                       # MRRS 512, RO and NS on
    cfg.write(off + 8, 2, 0xFFFF)
    assert cfg.read(off + 8, 2) == caps_mod.DEVCTL_RW
    cfg.write(off + 8, 2, 1 << 5)                               # MPS 256
    assert (cfg.read(off + 8, 2) >> 5) & 0b111 == 1
    cfg.set_u16(off + 0xA, 0x0035)                              # errors + transactions pending
    cfg.write(off + 0xA, 2, 0xFFFF)
    assert cfg.read(off + 0xA, 2) == 0x0030                     # W1C errors cleared, RO kept


@pytest.mark.parametrize("kwargs", [dict(max_payload=100), dict(link_width=3),
                                    dict(link_generation=7)])
def test_pcie_parameters_validated(kwargs):
    with pytest.raises(ValueError):
        CapabilityList(ConfigSpace(4096)).add_pcie_endpoint(**kwargs)
