"""Host-mappable BARs through the vfio-user server, driven by our client the way QEMU 11.1
asks (no VM): the reply's flags, its memfd, the sparse-mmap capability and its argsz
round trip; stores into the mapping are what the model shows."""

import fcntl
import mmap
import os
import struct

import pytest

from dxpu_vfio.vfio_user import protocol as p
from dxpu_vfio.vfio_user.client import VfioUserClient
from dxpu_vfio.vfio_user.server import ServerOptions, VfioUserServer
from qemu_device.bars import BarSpec
from qemu_device.display import DisplayAdapter
from qemu_device.mapped_memory import SEALS, MappedMemory

FB = 16 << 20


def serve(tmp_path, device, **options):
    return VfioUserServer(device, tmp_path / "d.sock", name="m", options=ServerOptions(**options)).start()


def connect(srv) -> VfioUserClient:
    client = VfioUserClient(srv.socket_path)
    client.negotiate()
    return client


def set_mode(client, xres, yres):
    for reg, value in ((4, 0), (3, 32), (1, xres), (2, yres), (6, xres), (9, 0), (4, 0x41)):
        client.write(2, 0x500 + 2 * reg, value.to_bytes(2, "little"))


@pytest.mark.parametrize("native", [True, False], ids=["native-stream", "python-stream"])
def test_framebuffer_is_offered_mappable_and_stores_reach_the_model(tmp_path, monkeypatch, native):
    """The stores never become messages: the server sees no REGION_WRITE for BAR0, and the
    screenshot is the pattern, pixel for pixel."""
    if not native:
        monkeypatch.setenv("DXPU_FASTLINK", "0")
    dev = DisplayAdapter(mapped=True)
    srv = serve(tmp_path, dev)
    client = connect(srv)
    try:
        size, flags, offset, areas, fd = client.region_mapping(0)
        assert (size, offset, areas) == (FB, 0, None) and fd is not None
        assert flags & p.REGION_FLAG_MMAP and flags & p.REGION_FLAG_READ and flags & p.REGION_FLAG_WRITE
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS  # QEMU's mapping can never SIGBUS
        assert os.fstat(fd).st_size == FB
        with mmap.mmap(fd, FB) as fb:
            set_mode(client, 64, 32)
            for y in range(32):
                fb[y * 256:(y + 1) * 256] = struct.pack("<I", 0x00102030 + y) * 64
            img = dev.scanout()
            assert img.size == (64, 32)
            assert [img.getpixel((5, y)) for y in (0, 31)] == [(0x10, 0x20, 0x30), (0x10, 0x20, 0x30 + 31)]
        os.close(fd)
        assert srv.snapshot()["commands"]["REGION_WRITE"]["count"] == 7  # the mode's registers, nothing else
        assert client.region_mapping(2)[4] is None and not client.region_mapping(2)[1] & p.REGION_FLAG_MMAP
    finally:
        client.close()
        srv.stop()


def test_the_trapped_path_stays_an_option(tmp_path):
    """mapped=False (the default), or a server that maps nothing: no MMAP flag, no fd."""
    for dev, options in ((DisplayAdapter(mapped=False), {}), (DisplayAdapter(mapped=True), {"map_regions": False})):
        srv = serve(tmp_path, dev, **options)
        client = connect(srv)
        try:
            size, flags, _offset, _areas, fd = client.region_mapping(0)
            assert size == FB and fd is None and not flags & p.REGION_FLAG_MMAP
            client.write(0, 8, b"\x01\x02\x03\x04")
            assert bytes(dev.vram[8:12]) == b"\x01\x02\x03\x04"
        finally:
            client.close()
            srv.stop()
            dev.close()


class _Partly(DisplayAdapter):
    """A framebuffer of which only the first and last MiB may be mapped."""

    def __init__(self):
        super().__init__(mapped=True)
        self.memory.areas = [(0, 1 << 20), (FB - (1 << 20), 1 << 20)]


def test_a_partly_mappable_bar_gets_the_sparse_mmap_capability_after_qemus_argsz_round_trip(tmp_path):
    srv = serve(tmp_path, _Partly())
    client = connect(srv)
    try:
        # QEMU's first ask is 32 bytes and it takes no longer reply: the server says how much it needs
        reply = client.request_message(p.Command.DEVICE_GET_REGION_INFO, p.REGION_INFO.pack(32, 0, 0, 0, 0, 0))
        assert len(reply.payload) == 32
        needed, flags = struct.unpack_from("<II", reply.payload)
        assert needed == 32 + 8 + 8 + 2 * 16 and not flags & p.REGION_FLAG_CAPS
        reply.close_fds()
        size, flags, _offset, areas, fd = client.region_mapping(0)
        assert flags & p.REGION_FLAG_CAPS and flags & p.REGION_FLAG_MMAP and fd is not None
        assert areas == [(0, 1 << 20), (FB - (1 << 20), 1 << 20)]
        os.close(fd)
    finally:
        client.close()
        srv.stop()


def test_only_a_prefetchable_whole_page_bar_can_be_host_mappable():
    with pytest.raises(ValueError, match="prefetchable"):
        BarSpec(0, 1 << 20, host_mappable=True)
    with pytest.raises(ValueError, match="whole pages"):
        BarSpec(0, 256, prefetchable=True, host_mappable=True)
    mem = MappedMemory(1 << 20)
    with pytest.raises(OSError):
        os.ftruncate(mem.fd, 4096)  # sealed: nobody can shrink what a peer mapped
    mem.close()
