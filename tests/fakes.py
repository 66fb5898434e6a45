"""Fakes shared by the unit tests (real ports are tested with QEMU elsewhere)."""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import threading

from qemu_device.ports import DmaError, ScatterByPieces

def host_and_box_streams():
    """(the host's Python end, the box's native stream) over TCP, as the link is, without
    TLS: the box's reader code (native/serve.c) is what these tests drive. The host end
    times out after 5 s, so a reply that never comes fails a test instead of hanging it."""
    from dxpu_vfio.native import stream as native
    from dxpu_vfio.vfio_user.connection import Connection
    if not native.enabled():
        raise AssertionError("the native stream is not built: run scripts/setup.sh")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        host_sock = socket.create_connection(listener.getsockname())
        box_sock, _ = listener.accept()
    host_sock.settimeout(5)
    return Connection(host_sock), native.tcp(box_sock, None, server=True, handshake_timeout=5)


RAM_BASE = 0x1_0000_0000
RAM_SIZE = 4 << 20


class RecordingIrqPort:
    """Records every interrupt the device signals, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []

    def msi(self, vector: int) -> None:
        self.events.append(("msi", vector))

    def msix(self, vector: int) -> None:
        self.events.append(("msix", vector))

    def intx(self, level: bool) -> None:
        self.events.append(("intx", level))

    def take(self) -> list[tuple[str, object]]:
        events, self.events = self.events, []
        return events


class FakeGuestRam(ScatterByPieces):
    """In-memory stand-in for the DMA port, for unit tests only.

    It models one DMA-mapped window of guest RAM and refuses everything else
    with DmaError, as the host proxy refuses unmapped addresses. The real port
    (vfio-user DMA_READ/DMA_WRITE into QEMU's guest RAM) is tested elsewhere
    against QEMU.
    """

    def __init__(self, base: int = RAM_BASE, size: int = RAM_SIZE) -> None:
        self.base = base
        self.ram = bytearray(size)
        self.calls: list[tuple[str, int, int]] = []      # every attempt, even refused
        self.threads: set[str] = set()
        self.gate: threading.Event | None = None          # when set, accesses wait on it

    def _window(self, addr: int, length: int) -> slice:
        self.threads.add(threading.current_thread().name)
        if self.gate is not None:
            self.gate.wait(5)
        if addr < self.base or addr + length > self.base + len(self.ram):
            raise DmaError(f"address {addr:#x}+{length:#x} is not mapped")
        return slice(addr - self.base, addr - self.base + length)

    def read(self, addr: int, length: int) -> bytes:
        self.calls.append(("read", addr, length))
        return bytes(self.ram[self._window(addr, length)])

    def write(self, addr: int, data: bytes) -> None:
        self.calls.append(("write", addr, len(data)))
        self.ram[self._window(addr, len(data))] = data


def map_guest_memory(client, address: int, size: int) -> mmap.mmap:
    """Negotiate, then DMA_MAP a memfd of ``size`` at ``address`` as QEMU maps guest RAM;
    returns our own mapping of it (the test's view of guest memory)."""
    client.negotiate()
    fd = os.memfd_create("guest")
    try:
        os.ftruncate(fd, size)
        ram = mmap.mmap(fd, size)
        client.dma_map(address, size, fd=fd)
    finally:
        os.close(fd)
    return ram


class PostedBlocks:
    """Mixin for a fake DMA port: logs the device's posted-together blocks around its writes
    ("begin", "write", "end"; "write alone" outside a block), as the box's port turns each
    block into one network write. A block inside another counts as the outer one, as on
    the link (``LinkEndpoint.posted_together``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[str] = []
        self.depth = 0

    @contextlib.contextmanager
    def posted_together(self):
        if not self.depth:
            self.log.append("begin")
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if not self.depth:
                self.log.append("end")

    def write(self, addr: int, data: bytes) -> None:
        self.log.append("write" if self.depth else "write alone")
        super().write(addr, data)  # type: ignore[misc]
