"""A fake GPU box for tests: it speaks the link protocol (docs/link-protocol.md) on loopback,
plaintext, and answers what the test tells it to, right or wrong (issue 18 item 8)."""

from __future__ import annotations

import json
import queue
import secrets
import socket
import threading
from typing import Callable

from dxpu_vfio.link.protocol import NONCE_BYTES, LinkCommand, challenge
from dxpu_vfio.vfio_user import protocol as vp
from dxpu_vfio.vfio_user.connection import Connection, ConnectionClosed, Message

# what a real box says of its test device (remoteproxy.proxy.describe of a 1 MiB testdev)
TESTDEV = {"model": "testdev",
           "regions": [[0, 4096, True, True], [1, 0, False, False], [2, 1 << 20, True, True], [3, 0, False, False],
                       [4, 0, False, False], [5, 0, False, False], [6, 0, False, False], [7, 4096, True, True],
                       [8, 0, False, False]],
           "irqs": {"intx": 1, "msi": 4, "msix": 0, "err": 1, "req": 1}, "coalesce": False}


class HostileBox:
    """Accepts connections; ``serve(conn, first_message)`` runs for each, in a thread of its own."""

    def __init__(self, serve: Callable[[Connection, Message], None]) -> None:
        self.serve = serve
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(sock)
            threading.Thread(target=self._run, args=(sock,), daemon=True).start()

    def _run(self, sock: socket.socket) -> None:
        conn = Connection(sock)
        try:
            self.serve(conn, conn.receive())
        except (ConnectionClosed, OSError, vp.ProtocolError):
            pass

    def close(self) -> None:
        self.stop.set()
        try:  # wakes the accepting thread (close alone leaves it blocked in accept for good)
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        for sock in self.conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


def reply(conn: Connection, msg: Message, payload: bytes) -> None:
    conn.send(vp.message(msg.header.msg_id, msg.header.command, payload, reply=True))


class DeviceBox(HostileBox):
    """A box with one device: HELLO gets ``description``; then REGION_READ is answered by
    ``answer_read(request)`` (a right answer unless a test replaces it), non-posted writes
    are echoed, heartbeats go out every 0.2 s, and the test sends DMA from the box side
    (:meth:`dma_write`, :meth:`dma_read`)."""

    def __init__(self, description: dict | None = None) -> None:
        self.description = dict(TESTDEV if description is None else description)
        self.answer_read: Callable[[vp.RegionAccess], bytes] = \
            lambda req: vp.RegionAccess(req.region, req.offset, req.count, b"\x5a" * req.count).pack()
        self.link: Connection | None = None
        self.features: list[str] = []  # what the host offered in its HELLO
        self.linked = threading.Event()
        self.dma_replies: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = iter(range(1, 1 << 15))
        super().__init__(self._serve)

    def _serve(self, conn: Connection, first: Message) -> None:
        # HELLO, the challenge, HELLO with a proof (not checked: the host side is under test)
        reply(conn, first, challenge(secrets.token_hex(NONCE_BYTES)))
        proved = conn.receive()
        self.features = json.loads(bytes(proved.payload)).get("features", [])
        reply(conn, proved, json.dumps(self.description).encode())
        self.link = conn
        self.linked.set()
        threading.Thread(target=self._beat, args=(conn,), daemon=True).start()
        while True:
            msg = conn.receive()
            hdr = msg.header
            if hdr.is_reply:
                if hdr.command in (LinkCommand.DMA_READ, LinkCommand.DMA_READV):
                    self.dma_replies.put(msg)
            elif hdr.command == LinkCommand.REGION_READ:
                reply(conn, msg, self.answer_read(vp.RegionAccess.unpack(msg.payload, write=False)))
            elif hdr.command in (LinkCommand.REGION_WRITE, LinkCommand.DEVICE_RESET, LinkCommand.SYNC) \
                    and not hdr.no_reply:
                req = vp.RegionAccess.unpack(msg.payload, write=True) if hdr.command == LinkCommand.REGION_WRITE \
                    else None
                reply(conn, msg, vp.RegionAccess(req.region, req.offset, req.count).pack() if req else b"")

    def _beat(self, conn: Connection) -> None:
        while not self.stop.wait(0.2):
            try:
                conn.send(vp.message(0, LinkCommand.HEARTBEAT, b"", no_reply=True))
            except (ConnectionClosed, OSError):
                return

    def dma_write(self, address: int, data: bytes) -> None:
        assert self.link is not None
        self.link.send(vp.message(next(self._ids), LinkCommand.DMA_WRITE, vp.DmaAccess(address, len(data), data).pack(),
                                  no_reply=True))

    def dma_writev(self, payload: bytes) -> None:
        """A posted DMA_WRITEV with this payload (right or wrong)."""
        assert self.link is not None
        self.link.send(vp.message(next(self._ids), LinkCommand.DMA_WRITEV, payload, no_reply=True))

    def dma_read(self, address: int, count: int, timeout: float = 3.0) -> Message:
        """The host's completion of a DMA read (an error one too)."""
        assert self.link is not None
        self.link.send(vp.message(next(self._ids), LinkCommand.DMA_READ, vp.DmaAccess(address, count).pack()))
        return self.dma_replies.get(timeout=timeout)

    def dma_readv(self, payload: bytes, timeout: float = 3.0) -> Message:
        """The host's completion of a DMA_READV with this payload (right or wrong)."""
        assert self.link is not None
        self.link.send(vp.message(next(self._ids), LinkCommand.DMA_READV, payload))
        return self.dma_replies.get(timeout=timeout)
