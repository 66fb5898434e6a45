"""Config space write masks and the type-0 header as the guest sees them."""

from __future__ import annotations

import pytest

from qemu_device import header
from qemu_device.config_space import ConfigSpace
from qemu_device.header import PciIdentity, install_type0_header


def test_read_only_bytes_ignore_guest_writes_but_device_setters_work():
    cfg = ConfigSpace(256)
    cfg.set_u32(0x40, 0x12345678)
    cfg.write(0x40, 4, 0xFFFFFFFF)
    assert cfg.read(0x40, 4) == 0x12345678
    cfg.set_u16(0x40, 0xBEEF)          # device side ignores the masks
    assert cfg.get_u32(0x40) == 0x1234BEEF


def test_rw_bits_round_trip_and_other_bits_stay():
    cfg = ConfigSpace(256)
    cfg.set_u16(0x50, 0xA000)
    cfg.set_mask(0x50, 2, rw=0x00FF)
    cfg.write(0x50, 2, 0x5A5A)
    assert cfg.read(0x50, 2) == 0xA05A
    cfg.write(0x50, 1, 0x00)
    assert cfg.read(0x50, 2) == 0xA000


def test_w1c_clears_only_the_ones_written():
    cfg = ConfigSpace(256)
    cfg.set_mask(0x60, 2, w1c=0xFF00)
    cfg.set_u16(0x60, 0xF00F)
    cfg.write(0x60, 2, 0x3000 | 0x000F)     # 1s on two W1C bits and on RO bits
    assert cfg.read(0x60, 2) == 0xC00F
    cfg.write(0x60, 2, 0x0000)              # writing zeros clears nothing
    assert cfg.read(0x60, 2) == 0xC00F


def test_write_bytes_applies_masks_per_byte_and_calls_hooks_once():
    cfg = ConfigSpace(4096)
    cfg.set_mask(0x101, 2, rw=0xFFFF)
    seen = []
    cfg.on_write(lambda offset, size: seen.append((offset, size)))
    cfg.write_bytes(0x100, b"\x11\x22\x33\x44\x55")
    assert cfg.read_bytes(0x100, 5) == b"\x00\x22\x33\x00\x00"
    assert seen == [(0x100, 5)]


def test_rw_and_w1c_cannot_overlap():
    with pytest.raises(ValueError, match="both RW and W1C"):
        ConfigSpace(256).set_mask(0x40, 1, rw=0x3, w1c=0x2)


@pytest.mark.parametrize("offset,size", [(0x41, 2), (0x42, 4), (0x40, 3), (0xFE, 4), (-1, 1)])
def test_bad_accesses_raise(offset, size):
    cfg = ConfigSpace(256)
    with pytest.raises(ValueError):
        cfg.read(offset, size)
    with pytest.raises(ValueError):
        cfg.write(offset, size, 0)


def test_arbitrary_length_accesses_are_bounded_by_the_space():
    cfg = ConfigSpace(256)
    assert len(cfg.read_bytes(0, 256)) == 256
    with pytest.raises(ValueError):
        cfg.read_bytes(0x80, 0x81)
    with pytest.raises(ValueError):
        cfg.write_bytes(0xFF, b"\0\0")
    with pytest.raises(ValueError):
        ConfigSpace(512)


def identity_header() -> ConfigSpace:
    cfg = ConfigSpace(256)
    install_type0_header(cfg, PciIdentity(0x1B36, 0x10F0, 0xFF0000, revision=1), intx=True)
    return cfg


def test_type0_header_identity():
    cfg = ConfigSpace(256)
    install_type0_header(cfg, PciIdentity(0x8086, 0x1234, 0x010802, revision=7,
                                          subsystem_vendor_id=0x1AF4, subsystem_id=0x1100),
                         intx=False)
    assert cfg.read(0x00, 4) == 0x1234_8086
    assert cfg.read(0x08, 4) == 0x0108_0207       # class 01/08/02, revision 7
    assert cfg.read(0x0E, 1) == 0
    assert cfg.read(0x2C, 4) == 0x1100_1AF4
    assert cfg.read(0x3D, 1) == 0                 # no INTx pin
    cfg2 = identity_header()
    assert cfg2.read(0x2C, 4) == 0x10F0_1B36       # subsystem defaults to vendor/device
    assert cfg2.read(0x3D, 1) == 1                # INTA#
    cfg2.write(0x00, 4, 0xFFFFFFFF)
    assert cfg2.read(0x00, 4) == 0x10F0_1B36


def test_command_register_writable_bits():
    cfg = identity_header()
    cfg.write(header.COMMAND, 2, 0xFFFF)
    assert cfg.read(header.COMMAND, 2) == 0x0407   # IO, MEM, BUS MASTER, INTx DISABLE
    cfg.write(header.COMMAND, 2, 0x0002)
    assert cfg.read(header.COMMAND, 2) == 0x0002


def test_status_register_w1c_errors_and_read_only_bits():
    cfg = identity_header()
    header.set_status_bits(cfg, header.STATUS_INTX | header.STATUS_CAP_LIST | 0xF900, True)
    cfg.write(header.STATUS, 2, header.STATUS_INTX | header.STATUS_CAP_LIST
              | header.STATUS_RECEIVED_MASTER_ABORT)
    status = cfg.read(header.STATUS, 2)
    assert status == (0xF900 & ~header.STATUS_RECEIVED_MASTER_ABORT) | 0x18
    cfg.write(header.STATUS, 2, 0xFFFF)
    assert cfg.read(header.STATUS, 2) == 0x18     # only the RO INTx and cap-list bits remain


def test_identity_validation():
    with pytest.raises(ValueError, match="class_code"):
        PciIdentity(0x1B36, 0x1, 0x1000000)
    with pytest.raises(ValueError, match="no device"):
        PciIdentity(0xFFFF, 0x1, 0)
