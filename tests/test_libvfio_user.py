"""Peer software: a libvfio-user server behind a box. libvfio-user refuses DMA windows
over 8 TiB and reaches windows without a descriptor by DMA_READ/DMA_WRITE messages; the
server is our small DMA engine on it (tests/peers/lvu_dma.c: by messages, or with -d
directly in fd-mapped memory, which a box cannot give). No Debian suite packages
libvfio-user: scripts/build_libvfio_user.sh builds it, and the peer, from a checkout."""

import errno
import os
import select
import subprocess

import pytest
from external_box import BOX, Box, Host

from dxpu_vfio.hostproxy.forwarder import RemoteAttachError
from dxpu_vfio.link.transport import make_certs
from dxpu_vfio.paths import cache_dir
from dxpu_vfio.testing import eventually
from dxpu_vfio.vfio_user import protocol as p
from dxpu_vfio.vfio_user.client import ClientError, VfioUserClient

pytestmark = pytest.mark.peer

BAR0 = 0
GUEST = 0x100000
MEM = 1 << 20
MAGIC = 0x3155564C  # "LVU1"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    make_certs(d, ["host", BOX])
    return d


class Peer:
    def __init__(self, binary, sock, log, direct: bool) -> None:
        self.socket_path, self.log_path = sock, log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([str(binary), *(["-d"] if direct else []), str(sock)],
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        eventually(lambda: "serving" in self.log() or self.proc.poll() is not None, what="the peer listens")
        assert self.proc.poll() is None, self.log()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def peer(tmp_path):
    """``peer(direct=False)``: the libvfio-user DMA engine on a socket of its own."""
    binary = cache_dir() / "libvfio-user" / "lvu-dma"
    if not binary.exists():
        pytest.fail(f"the libvfio-user peer is missing ({binary}): get libvfio-user's source "
                    "(git clone https://github.com/nutanix/libvfio-user ~/.cache/dxpu-vfio/src/libvfio-user, "
                    "or set LIBVFIO_USER_SRC) and run scripts/build_libvfio_user.sh")
    started = []

    def start(direct: bool = False) -> Peer:
        started.append(Peer(binary, tmp_path / f"lvu{len(started)}.sock", tmp_path / f"lvu{len(started)}.log", direct))
        return started[-1]
    yield start
    for one in started:
        one.stop()


def program_copy(client, src: int, dst: int, length: int) -> None:
    for off, value, size in ((0x08, src, 8), (0x10, dst, 8), (0x18, length, 4), (0x20, 1, 4)):
        client.write(BAR0, off, value.to_bytes(size, "little"), posted=True)


def test_libvfio_user_refuses_the_window_the_box_used_to_map(peer):
    """The limit our own server copies (MAX_DMA_WINDOW), checked against the real one."""
    lvu = peer()
    client = VfioUserClient(lvu.socket_path)
    client.negotiate()
    with pytest.raises(ClientError):
        client.request(p.Command.DMA_MAP, p.DmaMap(3, 0, 0, 1 << 48).pack())
    client.request(p.Command.DMA_MAP, p.DmaMap(3, 0, GUEST, MEM).pack())
    assert "window 0x100000 0x100000 nofd" in lvu.log()
    client.close()


def test_a_box_serves_a_libvfio_user_server_whose_dma_goes_by_messages(tmp_path, certs, peer):
    """The box starts (it used to map one 2^48-byte window, which libvfio-user refuses, and
    exit), the server gets QEMU's window without a descriptor, copies guest memory by
    DMA messages over the link, raises INTx, and sees the window go with the session."""
    lvu = peer()
    box = Box(tmp_path, certs, lvu.socket_path)
    try:
        host = Host(tmp_path, box)
        assert host.client.read32(p.REGION_CONFIG, 0) == 0x10FE1B36
        ram = host.map(GUEST, MEM)
        assert "window 0x100000 0x100000 nofd" in lvu.log()
        cmd = int.from_bytes(host.client.read(p.REGION_CONFIG, 4, 2), "little")
        host.client.write(p.REGION_CONFIG, 4, (cmd | 6).to_bytes(2, "little"))
        intx = os.eventfd(0, os.EFD_NONBLOCK)
        host.client.set_irqs(p.IRQ_INTX, [intx])
        assert host.client.read32(BAR0, 0) == MAGIC
        data = os.urandom(100_000)
        ram[0:len(data)] = data
        program_copy(host.client, GUEST, GUEST + 0x80000, len(data))
        assert select.select([intx], [], [], 10)[0], lvu.log()  # the copy is done: INTx
        assert host.client.read32(BAR0, 0x1C) == 2, lvu.log()
        assert ram[0x80000:0x80000 + len(data)] == data
        assert f"copy 0x100000 -> 0x180000 {len(data)}: done" in lvu.log()
        assert host.device.stats()["dma_bytes_read"] == host.device.stats()["dma_bytes_written"] == len(data)
        host.close()
        eventually(lambda: "unmapped 0x100000 0x100000" in lvu.log(), what="the session's window unmapped")
        assert lvu.proc.poll() is None
        ram.close()
        os.close(intx)
        box.assert_clean_log()
    finally:
        box.proc.stop()


def test_a_libvfio_user_server_that_needs_fd_mapped_memory_dies_and_the_box_says_so(tmp_path, certs, peer):
    """It takes the window (libvfio-user cannot refuse it) and exits at its first DMA,
    which needs the memory mapped: the box takes the link down naming it, no proxy thread
    dies with ConnectionClosed, and the next attach is refused with the reason."""
    lvu = peer(direct=True)
    box = Box(tmp_path, certs, lvu.socket_path)
    try:
        host = Host(tmp_path, box)
        ram = host.map(GUEST, MEM)
        cmd = int.from_bytes(host.client.read(p.REGION_CONFIG, 4, 2), "little")
        host.client.write(p.REGION_CONFIG, 4, (cmd | 6).to_bytes(2, "little"))
        program_copy(host.client, GUEST, GUEST + 0x80000, 4096)
        eventually(lambda: lvu.proc.poll() is not None, what="the peer's direct DMA")
        assert "is not fd-mapped" in lvu.log()
        eventually(lambda: not host.device.link_up, what="the box takes the link down")
        box.assert_link_down_blames(lvu.socket_path)
        host.close()
        with pytest.raises(RemoteAttachError) as refused:
            box.connect()
        assert refused.value.errno == errno.ENXIO and "went away" in str(refused.value)
        ram.close()
        box.assert_clean_log()
    finally:
        box.proc.stop()
