"""The vfio-user server with the test device, driven by our Python client (no VM).

Guest memory here is a real memfd passed with SCM_RIGHTS, exactly as QEMU passes it;
fd-less windows are served by our client answering DMA_READ/DMA_WRITE, as QEMU does.
"""

import errno
import fcntl
import mmap
import os
import select
import socket
import struct
import threading
import time
import zlib

import pytest

from dxpu_vfio.vfio_user import protocol as p
from dxpu_vfio.vfio_user.client import ClientError, VfioUserClient
from dxpu_vfio.vfio_user.server import ServerOptions, SocketInUse, VfioUserServer
from qemu_device.testdev import TestDevice

BAR0 = 0
MEM = 1 << 20
GUEST_BASE = 0x100000


@pytest.fixture
def server(tmp_path):
    srv = VfioUserServer(TestDevice(memory_size=1 << 30), tmp_path / "dev.sock", name="t").start()
    yield srv
    srv.stop()


@pytest.fixture
def guest_ram():
    fd = os.memfd_create("guest-ram")
    os.ftruncate(fd, MEM)
    view = mmap.mmap(fd, MEM)
    yield fd, view
    view.close()
    os.close(fd)


def connect(server) -> VfioUserClient:
    client = VfioUserClient(server.socket_path)
    client.negotiate()
    return client


def enable_bus_master(client) -> None:
    cmd = int.from_bytes(client.read(p.REGION_CONFIG, 4, 2), "little")
    client.write(p.REGION_CONFIG, 4, (cmd | 0x6).to_bytes(2, "little"))


def wait_dma(client, timeout=5.0) -> int:
    deadline = time.monotonic() + timeout
    while (status := client.read32(BAR0, 0x38)) == 1:
        assert time.monotonic() < deadline, "DMA did not finish"
        time.sleep(0.001)
    return status


def test_handshake_and_device_description(server):
    client = connect(server)
    assert client.server_caps["max_msg_fds"] == p.MAX_MSG_FDS
    flags, regions, irqs = client.device_info()
    assert flags & p.DEVICE_FLAGS_PCI and (regions, irqs) == (9, 5)
    assert client.region_info(0) == (4096, p.REGION_FLAG_READ | p.REGION_FLAG_WRITE)
    assert client.region_info(2)[0] == 1 << 30
    assert client.region_info(7)[0] == 4096
    assert client.region_info(1)[0] == 0
    assert client.irq_info(p.IRQ_MSI)[0] == 4
    assert client.irq_info(p.IRQ_INTX)[1] & p.IRQ_INFO_AUTOMASKED
    assert client.read(p.REGION_CONFIG, 0, 4) == struct.pack("<HH", 0x1b36, 0x10f0)
    client.close()


def test_registers_posted_writes_and_ordering(server):
    client = connect(server)
    assert client.read32(BAR0, 0) == 0xD0C50001
    for value in range(100):
        client.write32(BAR0, 0x08, value, posted=True)  # no replies ...
    assert client.read32(BAR0, 0x08) == 99  # ... but a read never passes them
    assert client.read32(BAR0, 0x10) + 1 == client.read32(BAR0, 0x10)
    client.close()


class RecordingDevice(TestDevice):
    """The test device, noting the size of every write it is given."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.writes: list[tuple[int, int, int]] = []

    def region_write(self, index, offset, data, posted=False):
        self.writes.append((index, offset, len(data)))
        return super().region_write(index, offset, data, posted)


def test_posted_writes_to_adjacent_registers_stay_separate(tmp_path):
    """A register block sees each write on its own: NVMe's SQ tail and CQ head
    doorbells are adjacent dwords, and one 8-byte write would ring only the first."""
    device = RecordingDevice(memory_size=1 << 20)
    srv = VfioUserServer(device, tmp_path / "rec.sock", name="rec").start()
    try:
        client = connect(srv)
        client.write32(BAR0, 0x08, 1, posted=True)
        client.write32(BAR0, 0x0C, 2, posted=True)
        client.read32(BAR0, 0x08)  # flushes the posted writes first
        assert [w for w in device.writes if w[0] == BAR0] == [(BAR0, 0x08, 4), (BAR0, 0x0C, 4)]
        client.close()
    finally:
        srv.stop()


def test_dma_through_the_memfd_mapping(server, guest_ram):
    fd, ram = guest_ram
    client = connect(server)
    client.dma_map(GUEST_BASE, MEM, fd=fd)
    enable_bus_master(client)
    src, dst = 0x1000, 0x20000
    payload = os.urandom(40000)
    ram[src:src + len(payload)] = payload
    for reg, value in ((0x20, GUEST_BASE + src), (0x24, 0), (0x28, GUEST_BASE + dst), (0x2C, 0),
                       (0x30, len(payload)), (0x34, 1)):
        client.write32(BAR0, reg, value)
    assert wait_dma(client) == 2
    assert ram[dst:dst + len(payload)] == payload
    client.write32(BAR0, 0x34, 3)  # checksum of src
    assert wait_dma(client) == 2
    assert client.read32(BAR0, 0x3C) == zlib.crc32(payload)
    client.close()


def copy_by_dma(client, src: int, dst: int, length: int) -> int:
    """The test device copies guest memory ``src`` -> ``dst`` (offsets in the window); its status."""
    for reg, value in ((0x20, GUEST_BASE + src), (0x24, 0), (0x28, GUEST_BASE + dst), (0x2C, 0),
                       (0x30, length), (0x34, 1)):
        client.write32(BAR0, reg, value)
    return wait_dma(client)


def test_dma_map_past_the_end_of_its_fd_is_refused(server, guest_ram):
    fd, _ = guest_ram
    client = connect(server)
    with pytest.raises(ClientError) as exc:
        client.dma_map(GUEST_BASE, 2 * MEM, fd=fd)
    assert exc.value.errno == errno.EINVAL and server.session.dma.windows() == []
    client.dma_map(GUEST_BASE, MEM, fd=fd)  # the session goes on
    client.close()


@pytest.mark.parametrize("sealed", [False, True], ids=["unsealed", "sealed"])
def test_a_client_shrinking_its_mapped_memfd_gets_dma_errors_not_a_dead_server(server, sealed):
    """An unsealed memfd shrunk after DMA_MAP: the DMA past its new end is an error and the
    server lives on (it used to die of SIGBUS). A memfd sealed against shrinking (QEMU's
    default) is used through mmap; the client cannot shrink it."""
    fd = os.memfd_create("guest-ram", os.MFD_ALLOW_SEALING if sealed else 0)
    os.ftruncate(fd, MEM)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    client = connect(server)
    client.dma_map(GUEST_BASE, MEM, fd=fd)
    enable_bus_master(client)
    os.pwrite(fd, b"x" * 4096, 0)
    assert copy_by_dma(client, 0, 0x8000, 4096) == 2
    assert os.pread(fd, 4096, 0x8000) == b"x" * 4096
    if sealed:
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 4096)
        assert copy_by_dma(client, 0, MEM - 4096, 4096) == 2
    else:
        os.ftruncate(fd, 0x10000)
        assert copy_by_dma(client, 0, MEM - 4096, 4096) == 3  # write past the new end
        assert copy_by_dma(client, MEM - 4096, 0, 4096) == 3  # read past it
        assert os.fstat(fd).st_size == 0x10000, "the DMA grew the client's file"
        assert copy_by_dma(client, 0, 0x4000, 4096) == 2  # inside it: still served
    client.close()
    os.close(fd)
    assert server.wait_idle(5)
    again = connect(server)  # the server still takes sessions
    assert again.read32(BAR0, 0) == 0xD0C50001
    again.close()


def test_dma_without_fd_uses_messages(server):
    client = connect(server)
    client.dma_map(GUEST_BASE, 65536)  # no fd: the server must ask us
    enable_bus_master(client)
    client.memory[GUEST_BASE][0:5000] = b"z" * 5000
    for reg, value in ((0x20, GUEST_BASE), (0x28, GUEST_BASE + 8192), (0x30, 5000), (0x34, 1)):
        client.write32(BAR0, reg, value)
    assert wait_dma(client) == 2
    assert client.memory[GUEST_BASE][8192:13192] == b"z" * 5000
    assert client.dma_requests >= 2
    client.close()


@pytest.mark.parametrize("reply", ["short data", "another count"])
def test_a_message_dma_read_answered_wrong_is_a_dma_error_for_the_device(server, reply):
    """Found by scripts/fuzz.py: a client answered an NVMe queue fetch's DMA_READ with 2
    bytes and the controller's worker died parsing them. A reply that does not answer
    what was asked is a DMA error for the device (the copy engine's status 3), and the
    server goes on."""
    client = connect(server)
    client.dma_map(GUEST_BASE, 65536)  # no fd: the server asks us by message
    enable_bus_master(client)
    send = client.conn.send

    def answer_wrong(data: bytes, *rest) -> None:
        header = p.Header.unpack(data[:p.HEADER_SIZE])
        if header.command == p.Command.DMA_READ and header.is_reply and not header.is_error:
            body = data[p.HEADER_SIZE:]
            address, count = p.DMA_RW.unpack_from(body)
            cut = 2 if reply == "another count" else count
            body = p.DMA_RW.pack(address, cut) + body[p.DMA_RW.size:p.DMA_RW.size + 2]
            data = p.message(header.msg_id, header.command, body, reply=True)
        send(data, *rest)

    client.conn.send = answer_wrong
    for reg, value in ((0x20, GUEST_BASE), (0x28, GUEST_BASE + 8192), (0x30, 64), (0x34, 1)):
        client.write32(BAR0, reg, value)
    assert wait_dma(client) == 3
    client.conn.send = send
    client.write32(BAR0, 0x34, 1)
    assert wait_dma(client) == 2  # the same copy, answered right
    client.close()


def test_dma_outside_the_windows_is_refused_and_counted(server, guest_ram):
    fd, ram = guest_ram
    client = connect(server)
    client.dma_map(GUEST_BASE, MEM, fd=fd, flags=p.DMA_FLAG_READ)  # read-only window
    enable_bus_master(client)
    for reg, value in ((0x20, 0x10), (0x28, GUEST_BASE), (0x30, 64), (0x34, 1)):
        client.write32(BAR0, reg, value)  # src below the window
    assert wait_dma(client) == 3 and client.read32(BAR0, 0x3C) == 3
    client.write32(BAR0, 0x20, GUEST_BASE)
    client.write32(BAR0, 0x34, 1)  # dst in a read-only window
    assert wait_dma(client) == 3
    assert ram[0:64] == b"\0" * 64
    assert server.session.dma.refused == 2
    client.close()


def test_msi_vectors_ring_their_eventfds(server):
    client = connect(server)
    efds = [os.eventfd(0, os.EFD_NONBLOCK) for _ in range(4)]
    client.set_irqs(p.IRQ_MSI, efds)
    # The guest enables 4 MSI vectors: Message Control at cap + 2 (MSI cap found by walking).
    cap = client.read(p.REGION_CONFIG, 0x34, 1)[0]
    while client.read(p.REGION_CONFIG, cap, 1)[0] != 0x05:
        cap = client.read(p.REGION_CONFIG, cap + 1, 1)[0]
    ctrl = int.from_bytes(client.read(p.REGION_CONFIG, cap + 2, 2), "little")
    client.write(p.REGION_CONFIG, cap + 2, (ctrl | 1 | (2 << 4)).to_bytes(2, "little"))
    for vector in (0, 3, 3):
        client.write32(BAR0, 0x14, vector)
    ready, _, _ = select.select(efds, [], [], 2)
    assert set(ready) == {efds[0], efds[3]}
    assert os.eventfd_read(efds[3]) == 2 and os.eventfd_read(efds[0]) == 1
    client.close()
    for fd in efds:
        os.close(fd)


def test_intx_is_automasked_until_unmask(server):
    client = connect(server)
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    client.set_irqs(p.IRQ_INTX, [efd])
    client.write32(BAR0, 0x14, 0)  # raise: line goes high, one edge
    assert os.eventfd_read(efd) == 1
    client.request(p.Command.DEVICE_SET_IRQS,
                   p.SetIrqs(p.IRQ_DATA_NONE | p.IRQ_ACTION_UNMASK, p.IRQ_INTX, 0, 1).pack())
    assert os.eventfd_read(efd) == 1  # still high after EOI: signalled again
    client.write32(BAR0, 0x18, 1)  # guest acks ISR: line drops
    client.request(p.Command.DEVICE_SET_IRQS,
                   p.SetIrqs(p.IRQ_DATA_NONE | p.IRQ_ACTION_UNMASK, p.IRQ_INTX, 0, 1).pack())
    with pytest.raises(BlockingIOError):
        os.eventfd_read(efd)
    client.close()
    os.close(efd)


def raw_session(server) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(server.socket_path))
    sock.settimeout(5)
    sock.sendall(p.message(1, p.Command.VERSION, p.Version(0, 0, {}).pack()))
    hdr = p.Header.unpack(sock.recv(4096))
    assert hdr.is_reply and not hdr.is_error
    return sock


def reply_to(sock: socket.socket, data: bytes) -> p.Header:
    sock.sendall(data)
    return p.Header.unpack(sock.recv(4096))


def test_unknown_and_truncated_messages_get_error_replies(server):
    sock = raw_session(server)
    assert reply_to(sock, p.message(2, 99, b"")).error == errno.ENOSYS
    assert reply_to(sock, p.message(3, p.Command.REGION_READ, b"\0" * 8)).error == errno.EINVAL
    assert reply_to(sock, p.message(4, p.Command.REGION_READ,
                                    p.RegionAccess(0, 0x2000, 4).pack())).is_error  # beyond BAR0
    assert reply_to(sock, p.message(5, p.Command.REGION_READ,
                                    p.RegionAccess(5, 0, 4).pack())).is_error  # absent BAR
    assert reply_to(sock, p.message(6, p.Command.DEVICE_SET_IRQS,
                                    p.SetIrqs(p.IRQ_DATA_EVENTFD | p.IRQ_ACTION_TRIGGER, 1, 3, 4).pack())).is_error  # beyond 4 MSI
    ok = reply_to(sock, p.message(7, p.Command.REGION_READ, p.RegionAccess(0, 0, 4).pack()))
    assert ok.is_reply and not ok.is_error  # the session survived all of that
    sock.close()


@pytest.mark.parametrize("garbage", [
    struct.pack("<HHIII", 1, 9, 8, 0, 0),  # size smaller than a header
    struct.pack("<HHIII", 1, 9, 1 << 30, 0, 0),  # oversized
])
def test_unframeable_message_drops_only_that_client(server, garbage):
    sock = raw_session(server)
    sock.sendall(garbage)
    assert sock.recv(4096) == b""  # disconnected
    sock.close()
    assert server.wait_idle(5)
    client = connect(server)  # the server still serves the next client
    assert client.read32(BAR0, 0) == 0xD0C50001
    client.close()


def test_commands_before_version_are_refused(server):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(server.socket_path))
    sock.settimeout(5)
    assert reply_to(sock, p.message(1, p.Command.REGION_READ, p.RegionAccess(0, 0, 4).pack())).error == errno.EPROTO
    sock.close()


def test_one_client_at_a_time_and_clean_replug(server, guest_ram):
    fd, _ = guest_ram
    fds_before = len(os.listdir("/proc/self/fd"))
    threads_before = threading.active_count()
    for _ in range(10):
        client = connect(server)
        sent = [os.dup(fd)] + [os.eventfd(0) for _ in range(4)]
        client.dma_map(GUEST_BASE, MEM, fd=sent[0])
        client.set_irqs(p.IRQ_MSI, sent[1:])
        for mine in sent:  # the server holds its own copies now
            os.close(mine)
        second = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        second.connect(str(server.socket_path))
        second.settimeout(5)
        assert second.recv(16) == b""  # refused while the first is plugged
        second.close()
        client.write32(BAR0, 0x08, 0x1234)
        client.close()
        assert server.wait_idle(5)
    assert server.rejected_connections == 10
    assert server.sessions_served == 10
    time.sleep(0.1)
    assert threading.active_count() <= threads_before
    assert len(os.listdir("/proc/self/fd")) == fds_before  # every received fd and mapping released
    client = connect(server)
    assert client.read32(BAR0, 0x08) == 0  # device was reset between sessions
    client.close()


def test_socket_in_use_and_stale_socket(tmp_path, server):
    with pytest.raises(SocketInUse):
        VfioUserServer(TestDevice(memory_size=4096 * 16), server.socket_path).start()
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()  # file left behind, nobody listening
    srv = VfioUserServer(TestDevice(memory_size=4096 * 16), stale).start()
    srv.stop()
    assert not stale.exists()


def test_msix_needs_an_explicit_option(tmp_path):
    with pytest.raises(ValueError, match="MSI-X"):
        VfioUserServer(TestDevice(msix=True), tmp_path / "x.sock")
    srv = VfioUserServer(TestDevice(msix=True), tmp_path / "x.sock", options=ServerOptions(allow_msix=True))
    srv.start()
    client = connect(srv)
    assert client.irq_info(p.IRQ_MSIX)[0] == 4
    client.close()
    srv.stop()


def test_reset_request(server):
    client = connect(server)
    client.write32(BAR0, 0x0C, 77)
    client.reset()
    assert client.read32(BAR0, 0x0C) == 0
    with pytest.raises(ClientError):
        client.read(9, 0, 4)
    client.close()


def test_eventfd_trigger_without_fds_unassigns(server):
    """QEMU tears an index down with DATA_EVENTFD and no descriptors."""
    client = connect(server)
    client.set_irqs(p.IRQ_ERR, [os.eventfd(0)])
    assert server.session.irqs.fd_count() == 1
    client.request(p.Command.DEVICE_SET_IRQS,
                   p.SetIrqs(p.IRQ_DATA_EVENTFD | p.IRQ_ACTION_TRIGGER, p.IRQ_ERR, 0, 1).pack())
    assert server.session.irqs.fd_count() == 0
    client.close()
