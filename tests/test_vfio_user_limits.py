"""The vfio-user server against a hostile client: descriptors it did not ask for, eventfds
that cannot take a signal, and messages built to break the decoder. The session keeps
being served (or the next one is), and every malformed message gets an error reply."""

from __future__ import annotations

import errno
import logging
import os
import time

import pytest

from dxpu_vfio.vfio_user import protocol as p
from dxpu_vfio.vfio_user.client import ClientError, VfioUserClient
from dxpu_vfio.vfio_user.connection import ConnectionClosed
from dxpu_vfio.vfio_user.handlers import MAX_DMA_WINDOW
from dxpu_vfio.vfio_user.server import VfioUserServer
from dxpu_vfio.vfio_user.session import MAX_DMA_MAPS
from qemu_device.testdev import TestDevice

BAR0 = 0


@pytest.fixture
def server(tmp_path):
    srv = VfioUserServer(TestDevice(memory_size=1 << 20), tmp_path / "dev.sock", name="t").start()
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    c = VfioUserClient(server.socket_path, timeout=3.0)
    c.negotiate()
    yield c
    c.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def still_served(client: VfioUserClient) -> None:
    client.write32(BAR0, 0x08, 0x5A5A)
    assert client.read32(BAR0, 0x08) == 0x5A5A


def test_descriptors_a_command_does_not_take_are_refused_and_closed(client):
    extra = [os.eventfd(0) for _ in range(p.MAX_MSG_FDS)]
    before = open_fds()
    try:
        for command, payload in [(p.Command.DEVICE_GET_INFO, p.DEVICE_INFO.pack(16, 0, 0, 0)),
                                 (p.Command.REGION_READ, p.RegionAccess(BAR0, 8, 4).pack())]:
            with pytest.raises(ClientError) as exc:
                client.request(command, payload, fds=extra)
            assert exc.value.errno == errno.EINVAL
        with pytest.raises(ClientError) as exc:
            client.request(p.Command.DMA_MAP, p.DmaMap(3, 0, 0x100000, 4096).pack(), fds=extra[:2])
        assert exc.value.errno == errno.EINVAL
        time.sleep(0.1)
        assert open_fds() == before  # the server kept none of them
    finally:
        for fd in extra:
            os.close(fd)
    still_served(client)


def test_dma_maps_are_bounded_by_what_the_server_advertised(client):
    assert client.server_caps["max_dma_maps"] == MAX_DMA_MAPS
    before = open_fds()
    memfd = os.memfd_create("guest")
    os.ftruncate(memfd, 4096)
    try:
        for i in range(MAX_DMA_MAPS):
            client.dma_map(0x100000 + i * 0x2000, 4096, fd=memfd)
        with pytest.raises(ClientError) as exc:
            client.dma_map(0x100000 + MAX_DMA_MAPS * 0x2000, 4096, fd=memfd)
        assert exc.value.errno == errno.EINVAL
    finally:
        os.close(memfd)
    assert open_fds() - before <= MAX_DMA_MAPS
    still_served(client)


def irq_set(index: int, flags: int, start: int = 0, count: int = 1) -> bytes:
    return p.SetIrqs(flags, index, start, count).pack()


def test_a_pipe_handed_to_set_irqs_is_refused(client, server):
    r, w = os.pipe()
    try:
        with pytest.raises(ClientError) as exc:
            client.set_irqs(p.IRQ_MSI, [w])
        assert exc.value.errno == errno.EINVAL
        for _ in range(10000):  # more than a pipe holds: nothing may block
            client.request(p.Command.DEVICE_SET_IRQS, irq_set(p.IRQ_MSI, p.IRQ_DATA_NONE | p.IRQ_ACTION_TRIGGER),
                           no_reply=True)
        still_served(client)
    finally:
        os.close(r)
        os.close(w)


def test_a_saturated_eventfd_never_wedges_the_server(client, server):
    efd = os.eventfd(0)
    client.set_irqs(p.IRQ_MSI, [efd])
    os.eventfd_write(efd, 0xFFFF_FFFF_FFFF_FFFE)  # the most it holds: one more write would block
    client.request(p.Command.DEVICE_SET_IRQS, irq_set(p.IRQ_MSI, p.IRQ_DATA_NONE | p.IRQ_ACTION_TRIGGER))
    still_served(client)
    assert server.session.irqs.lost == 1
    client.close()
    assert server.wait_idle(5)
    os.close(efd)
    again = VfioUserClient(server.socket_path, timeout=3.0)  # and the next session is served
    again.negotiate()
    still_served(again)
    again.close()


def test_deeply_nested_version_json_gets_an_error_reply(server):
    c = VfioUserClient(server.socket_path, timeout=3.0)
    try:
        depth = 100_000
        caps = b'{"capabilities": ' + b"[" * depth + b"]" * depth + b"}\0"
        with pytest.raises(ClientError) as exc:
            c.request(p.Command.VERSION, p.VERSION.pack(0, 0) + caps)
        assert exc.value.errno == errno.EINVAL
        c.negotiate()  # the session goes on
        still_served(c)
    finally:
        c.close()


@pytest.mark.parametrize("offset, size", [(0, 1 << 63), (1 << 63, 4096), ((1 << 63) - 4096, 8192),
                                          ((1 << 64) - 4096, 4096)])
def test_dma_map_near_2_63_gets_an_error_reply(client, offset, size):
    memfd = os.memfd_create("guest")
    try:
        with pytest.raises(ClientError) as exc:
            client.dma_map(0x100000, size, fd=memfd, offset=offset)
        assert exc.value.errno in (errno.EINVAL, errno.EOVERFLOW, errno.ENOMEM, errno.ENXIO)
    finally:
        os.close(memfd)
    still_served(client)


def test_the_accept_loop_survives_running_out_of_descriptors(server):
    import gc
    import resource
    import socket
    gc.collect()  # no socket closed by the collector while the table is full
    waiting = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    filler: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(open_fds(), 64) + 16, hard))
    try:
        while True:  # every descriptor number taken: the server's next accept() fails with EMFILE
            try:
                filler.append(os.dup(waiting.fileno()))
            except OSError as exc:
                assert exc.errno == errno.EMFILE
                break
        waiting.connect(str(server.socket_path))
        deadline = time.monotonic() + 5
        while not getattr(server, "accept_errors", 0) and server._accept_thread.is_alive() \
                and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    waiting.close()  # (a thread already in accept() had its descriptor: this one may have been served)
    assert server.wait_idle(5)
    again = VfioUserClient(server.socket_path, timeout=3.0)  # once descriptors are free, sessions are served
    try:
        again.negotiate()
        still_served(again)
    finally:
        again.close()
    assert server._accept_thread.is_alive() and server.accept_errors >= 1


def test_dma_windows_over_8_tib_are_refused_like_libvfio_user_does(client, server):
    """Our server is the project's stand-in for external servers: it refuses what
    libvfio-user refuses (MAX_DMA_SIZE), so a client that maps too much fails here too."""
    def dma_map(size):  # descriptor-less, without the client keeping memory for it
        client.request(p.Command.DMA_MAP, p.DmaMap(3, 0, 0, size).pack())
    with pytest.raises(ClientError) as exc:
        dma_map(1 << 48)  # what the remote proxy once mapped into external servers
    assert exc.value.errno == errno.EINVAL
    dma_map(MAX_DMA_WINDOW)  # 8 TiB itself is fine
    assert server.snapshot()["dma"]["maps"] == [[0, MAX_DMA_WINDOW, 3, False]]
    still_served(client)


@pytest.mark.parametrize("fastlink", ["1", "0"])
def test_descriptors_sent_behind_unread_bytes_reach_their_own_message(tmp_path, monkeypatch, fastlink):
    import threading
    monkeypatch.setenv("DXPU_FASTLINK", fastlink)
    device = TestDevice(memory_size=1 << 20)
    srv = VfioUserServer(device, tmp_path / "dev.sock", name="t").start()
    c = VfioUserClient(srv.socket_path, timeout=3.0)
    efd = os.eventfd(0)
    try:
        c.negotiate()
        with device.lock:  # the server's reader stalls in the next handler, so what follows waits unread
            stalled = threading.Thread(target=c.write32, args=(BAR0, 0x08, 1))
            stalled.start()
            time.sleep(0.2)
            c.write32(BAR0, 0x0C, 2, posted=True)  # bytes without descriptors...
            wired = threading.Thread(target=c.set_irqs, args=(p.IRQ_MSI, [efd]))  # ...then an eventfd
            wired.start()
            time.sleep(0.2)
        stalled.join(5)
        wired.join(5)
        assert srv.session.irqs.fd_count() == 1, "the SET_IRQS eventfd went to the posted write before it"
    finally:
        os.close(efd)
        c.close()
        srv.stop()


def test_more_descriptors_than_a_read_takes_end_the_session_which_says_why(stream, server, caplog):
    """A message with more descriptors than ``max_msg_fds``: the kernel truncates them, so
    the rest of the stream's descriptors can no longer be matched to their messages and
    the session ends (docs/limits.md). The server's log says why, on both streams, every
    descriptor is closed, and the next client is served."""
    client = VfioUserClient(server.socket_path, timeout=3.0)
    client.negotiate()
    extra = [os.eventfd(0) for _ in range(p.MAX_MSG_FDS + 1)]
    before = open_fds()
    try:
        with caplog.at_level(logging.WARNING, logger="dxpu.vfio_user.server"):
            with pytest.raises((ClientError, ConnectionClosed)):
                client.request(p.Command.DEVICE_SET_IRQS,
                               p.SetIrqs(p.IRQ_DATA_EVENTFD | p.IRQ_ACTION_TRIGGER, p.IRQ_MSI, 0, 17).pack(), fds=extra)
            assert server.wait_idle(5), "the session did not end"
    finally:
        for fd in extra:
            os.close(fd)
        client.close()
    assert f"more than {p.MAX_MSG_FDS} descriptors in one message" in caplog.text, caplog.text
    assert open_fds() <= before - len(extra), "the server kept descriptors of the ended session"
    again = VfioUserClient(server.socket_path, timeout=3.0)
    again.negotiate()
    try:
        still_served(again)
    finally:
        again.close()
