"""The vfio-user codec: round trips, and refusal of every malformed shape."""

import errno
import struct

import pytest

from dxpu_vfio.vfio_user import protocol as p


def test_header_round_trip_and_flags():
    raw = p.message(7, p.Command.REGION_READ, b"x" * 16, no_reply=True)
    hdr = p.Header.unpack(raw)
    assert (hdr.msg_id, hdr.command, hdr.size) == (7, 9, 32)
    assert hdr.no_reply and not hdr.is_reply and not hdr.is_error
    err = p.Header.unpack(p.error_reply(7, 9, errno.EFAULT))
    assert err.is_reply and err.is_error and err.error == errno.EFAULT and err.size == 16


def test_short_header_is_refused():
    with pytest.raises(p.ProtocolError):
        p.Header.unpack(b"\0" * 15)


def test_version_caps_round_trip():
    v = p.Version(0, 0, {"max_msg_fds": 8, "write_multiple": True})
    back = p.Version.unpack(v.pack())
    assert back.capabilities == {"max_msg_fds": 8, "write_multiple": True}


@pytest.mark.parametrize("caps", [b"{not json", b"[1,2]", b'{"capabilities": 5}'])
def test_version_with_bad_capabilities_is_refused(caps):
    with pytest.raises(p.ProtocolError):
        p.Version.unpack(struct.pack("<HH", 0, 0) + caps + b"\0")


def test_version_without_capabilities_is_fine():
    assert p.Version.unpack(struct.pack("<HH", 0, 0)).capabilities == {}


def test_dma_map_round_trip_and_bad_ranges():
    m = p.DmaMap(p.DMA_FLAG_READ, 0x1000, 0x10000, 0x2000)
    assert p.DmaMap.unpack(m.pack()) == m
    with pytest.raises(p.ProtocolError):
        p.DmaMap.unpack(p.DmaMap(3, 0, 0x1000, 0).pack())  # empty
    with pytest.raises(p.ProtocolError):
        p.DmaMap.unpack(p.DmaMap(3, 0, (1 << 64) - 4096, 8192).pack())  # wraps
    with pytest.raises(p.ProtocolError):
        p.DmaMap.unpack(m.pack()[:-1])


def test_dma_unmap_with_dirty_bitmap_is_not_supported():
    with pytest.raises(p.ProtocolError) as err:
        p.DmaUnmap.unpack(p.DmaUnmap(p.DMA_UNMAP_GET_DIRTY, 0, 4096).pack())
    assert err.value.errno == errno.ENOTSUP


def test_set_irqs_validation():
    ok = p.SetIrqs(p.IRQ_DATA_EVENTFD | p.IRQ_ACTION_TRIGGER, p.IRQ_MSI, 0, 4)
    assert p.SetIrqs.unpack(ok.pack()) == ok
    for flags in (p.IRQ_DATA_EVENTFD, p.IRQ_ACTION_TRIGGER,
                  p.IRQ_DATA_EVENTFD | p.IRQ_DATA_BOOL | p.IRQ_ACTION_TRIGGER):
        with pytest.raises(p.ProtocolError):
            p.SetIrqs.unpack(p.SetIrqs(flags, 1, 0, 1).pack())
    with pytest.raises(p.ProtocolError):
        p.SetIrqs.unpack(p.SetIrqs(p.IRQ_DATA_NONE | p.IRQ_ACTION_TRIGGER, 9, 0, 0).pack())
    with pytest.raises(p.ProtocolError):  # bools promised but missing
        p.SetIrqs.unpack(p.IRQ_SET.pack(20, p.IRQ_DATA_BOOL | p.IRQ_ACTION_TRIGGER, 1, 0, 4))


def test_region_write_count_must_match_data():
    w = p.RegionAccess(0, 0x10, 4, b"\1\2\3\4")
    assert p.RegionAccess.unpack(w.pack(), write=True) == w
    with pytest.raises(p.ProtocolError):
        p.RegionAccess.unpack(p.REGION_RW.pack(0x10, 0, 8) + b"\1\2\3\4", write=True)
    with pytest.raises(p.ProtocolError) as err:
        p.RegionAccess.unpack(p.REGION_RW.pack(0, 0, 1 << 30), write=False)
    assert err.value.errno == errno.E2BIG


def test_write_multi_round_trip_and_limits():
    writes = [p.RegionAccess(0, 4 * i, 4, bytes([i] * 4)) for i in range(5)]
    assert p.unpack_write_multi(p.pack_write_multi(writes)) == writes
    with pytest.raises(p.ProtocolError):
        p.unpack_write_multi(struct.pack("<Q", 3) + b"\0" * 24)  # says 3, carries 1
    with pytest.raises(p.ProtocolError):
        p.unpack_write_multi(struct.pack("<Q", 201) + b"\0" * 24 * 201)


def test_dma_access_layout_is_address_count_data():
    raw = p.DmaAccess(0x1000, 3, b"abc").pack()
    assert raw[:16] == struct.pack("<QQ", 0x1000, 3) and raw[16:] == b"abc"
    assert p.DmaAccess.unpack(raw, with_data=True).data == b"abc"
    with pytest.raises(p.ProtocolError):
        p.DmaAccess.unpack(raw[:-1], with_data=True)
