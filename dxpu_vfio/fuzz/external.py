"""Fuzzing a box's vfio-user client as an external vfio-user server reaches it.

A box drives an external server (a device of model ``vfio-user``) the way QEMU would;
what that server answers, and the DMA it asks for, are bytes from a peer the box parses
(:mod:`dxpu_vfio.remoteproxy.external`, :mod:`dxpu_vfio.vfio_user.client`). The fuzzer is
that server, and the host too: a remote proxy process serves ``ex0`` (behind the fuzzer's
UNIX socket) and ``td0`` (a test device of its own), and the fuzzer links to ``ex0`` over
plaintext loopback. A unit is the host's access to ``ex0`` (register reads and writes,
DMA windows, a reset), which the box forwards to the server, with the server's answers
right or wrong (errors, short, another size or place, garbage); or what the server sends
by itself (DMA reads and writes inside and outside the windows, unknown commands, replies
to nothing, a broken frame, its connection closed). A server the box gives up on takes
its link down; the next unit links again and the box reconnects to the server.

Checked at every probe: the box lives, logged no traceback, and still serves: a link to
``td0`` answers a config read.
"""

from __future__ import annotations

import random
import re
import socket
import struct
import threading
import time
from pathlib import Path

from dxpu_vfio.fuzz.child import ChildTarget
from dxpu_vfio.fuzz.link import hello
from dxpu_vfio.fuzz.mutate import edge, mutate_bytes
from dxpu_vfio.fuzz.peer import Gone, Hang, Peer
from dxpu_vfio.link.protocol import LinkCommand
from dxpu_vfio.remoteproxy.process import RemoteProxyProcess
from dxpu_vfio.vfio_user import protocol as p

L, C = LinkCommand, p.Command
LEASES = {"ex0": "lease-ex0", "td0": "lease-td0"}
WINDOW, WINDOW_SIZE = 0x10_0000, 1 << 20  # the host's DMA window, mapped into the server without fd
REGIONS = {0: 4096, 2: 1 << 20, p.REGION_CONFIG: 4096}  # what the fuzzed server has (the rest: none)
IRQS = {p.IRQ_INTX: 1, p.IRQ_MSI: 4}
PROBE_ID = 0x7FFE


def right_answer(command: int, payload: bytes) -> bytes:
    """What a well-behaved server with :data:`REGIONS` and :data:`IRQS` answers to the box's
    request (a test device's shape; reads give 0x5a bytes); an empty payload for commands
    it just does (DMA_MAP, DMA_UNMAP, SET_IRQS, RESET) and for requests it cannot parse."""
    try:
        if command == C.VERSION:
            return p.Version(0, 0, {"max_msg_fds": 8, "max_data_xfer_size": 1 << 20}).pack()
        if command == C.DEVICE_GET_INFO:
            return p.DEVICE_INFO.pack(p.DEVICE_INFO.size, 0, p.NUM_REGIONS, p.NUM_IRQS)
        if command == C.DEVICE_GET_REGION_INFO:
            index = p.REGION_INFO.unpack_from(payload)[2]
            size = REGIONS.get(index, 0)
            return p.REGION_INFO.pack(p.REGION_INFO.size, 3 if size else 0, index, 0, size, 0)
        if command == C.DEVICE_GET_IRQ_INFO:
            index = p.IRQ_INFO.unpack_from(payload)[2]
            return p.IRQ_INFO.pack(p.IRQ_INFO.size, 0, index, IRQS.get(index, 0))
        if command == C.REGION_READ:
            req = p.RegionAccess.unpack(payload, write=False)
            return p.RegionAccess(req.region, req.offset, req.count, b"\x5a" * req.count).pack()
        if command == C.REGION_WRITE:
            req = p.RegionAccess.unpack(payload, write=True)
            return p.RegionAccess(req.region, req.offset, req.count).pack()
    except (struct.error, p.ProtocolError):
        return b""
    return b""  # DMA_MAP, DMA_UNMAP, SET_IRQS, RESET: done


class ExternalServerTarget(ChildTarget):
    """A remote proxy process whose ``ex0`` is the fuzzer's vfio-user server."""

    name = "vfio-user-client"

    def __init__(self) -> None:
        super().__init__()
        self.listener: socket.socket | None = None  # the server's UNIX socket
        self.server: Peer | None = None  # the box's client connection, the server's end
        self.link: Peer | None = None  # the host's link to ex0
        self.port = 0
        self.wrong = 0.0  # this unit's share of wrong answers from the server
        self.answers = random.Random(0)
        self._ids = 1

    # --- process ---------------------------------------------------------------------
    def start(self, workdir: Path) -> None:
        self.workdir = workdir
        self.log_path = workdir / "box.log"
        sock_path = workdir / "ext.sock"
        if self.listener is None:
            sock_path.unlink(missing_ok=True)
            self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.listener.bind(str(sock_path))
            self.listener.listen(4)
            self.listener.setblocking(False)
        config = workdir / "box.toml"
        config.write_text('name = "fuzzext"\nlisten = "127.0.0.1"\nport = 0\nplaintext = true\n'
                          f'[[device]]\nid = "ex0"\nmodel = "vfio-user"\nlease = "{LEASES["ex0"]}"\n'
                          f'settings = {{ socket = "{sock_path}" }}\n'
                          f'[[device]]\nid = "td0"\nmodel = "testdev"\nlease = "{LEASES["td0"]}"\n'
                          'settings = { memory_size = 1048576 }\n')
        self.wrong = 0.0
        done = threading.Event()  # the box describes ex0 while it starts: answer meanwhile
        helper = threading.Thread(target=self._serve_until, args=(done,), daemon=True)
        helper.start()
        try:
            self.process = RemoteProxyProcess(config, log_path=self.log_path).start()
        finally:
            done.set()
            helper.join(5.0)
        self.port = int(re.findall(rb"127\.0\.0\.1:(\d+)", self.log_path.read_bytes())[-1])

    def _serve_until(self, done: threading.Event) -> None:
        while not done.is_set():
            self._pump_server(0.02)

    def _close(self) -> None:
        for peer in (self.link, self.server):
            if peer is not None:
                peer.close()
        self.link = self.server = None

    def stop(self) -> None:
        super().stop()
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    # --- the server's end ------------------------------------------------------------------
    def _pump_server(self, timeout: float = 0.0) -> None:
        """Take the box's (re)connection, and answer what it asks."""
        assert self.listener is not None
        try:
            sock, _ = self.listener.accept()
            if self.server is not None:
                self.server.close()
            self.server = Peer(sock, self._serve)
        except BlockingIOError:
            pass
        if self.server is not None and not self.server.closed:
            try:
                self.server.pump(timeout)
            except Gone:
                pass
        elif timeout:
            time.sleep(timeout)

    def _serve(self, hdr: p.Header, payload: bytes) -> bytes | None:
        """The server's answer to the box's request: right, or (``wrong`` of the time) an
        error, a reply too short, of another size or place, or garbage."""
        rng = self.answers
        right = right_answer(hdr.command, payload)
        if rng.random() >= self.wrong:
            return p.message(hdr.msg_id, hdr.command, right, reply=True)
        roll = rng.randrange(5)
        if roll == 0:
            return p.error_reply(hdr.msg_id, hdr.command, rng.choice((1, 5, 14, 22, 95)))
        if roll == 1:
            return p.message(hdr.msg_id, hdr.command, right[:rng.randrange(len(right) + 1)], reply=True)
        if roll == 2 and hdr.command == C.REGION_READ and len(right) >= 16:
            offset, region, count = p.REGION_RW.unpack_from(right)
            other = p.RegionAccess(region, offset + rng.choice((0, 4)), count * rng.choice((1, 2)),
                                   b"\x11" * (count * 2)).pack()
            return p.message(hdr.msg_id, hdr.command, other, reply=True)
        if roll == 3:
            return p.message(hdr.msg_id, hdr.command, mutate_bytes(rng, right, 4096), reply=True)
        return p.message(hdr.msg_id, rng.choice((hdr.command, C.VERSION, 0xFFFF)), rng.randbytes(rng.choice((0, 8, 40))),
                         reply=True)

    # --- the host's end ----------------------------------------------------------------
    def _link_answer(self, hdr: p.Header, payload: bytes) -> bytes | None:
        """The box's DMA reads (the server's, forwarded): answered with zeroes of the size asked."""
        if hdr.command == L.DMA_READ and len(payload) >= 16:
            address, count = struct.unpack_from("<QQ", payload)
            count = min(count, 1 << 20)
            return p.message(hdr.msg_id, hdr.command, struct.pack("<QQ", address, count) + bytes(count), reply=True)
        return None

    def _hello(self, device: str, deadline: float) -> Peer:
        """A link to ``device`` (retried while the box still holds the last one), the server
        answered meanwhile (the box reconnects to it for a new link to ex0)."""
        while True:
            peer = Peer(socket.create_connection(("127.0.0.1", self.port), timeout=5), self._link_answer)
            if hello(peer, device, LEASES[device], deadline, meanwhile=self._pump_server) is not None:
                return peer
            peer.close()
            if time.monotonic() > deadline:
                raise Hang(f"the box gave no new link to {device}")
            self._pump_server(0.02)

    def _relink(self, deadline: float) -> None:
        """A new link to ex0 and its DMA window. The server answers right meanwhile: the box
        reconnects to it and waits out its client's timeout for an answer that never comes."""
        if self.link is not None:
            self.link.close()
        self.wrong = 0.0
        self.link = self._hello("ex0", deadline)
        window = p.DmaMap(p.DMA_FLAG_READ | p.DMA_FLAG_WRITE, 0, WINDOW, WINDOW_SIZE).pack()
        self.link.request(p.message(3, L.DMA_MAP, window), 3, deadline, meanwhile=self._pump_server)

    def probe(self, deadline: float) -> None:
        """The box still serves: a new link to its own test device answers a config read."""
        try:
            peer = self._hello("td0", deadline)
        except Gone as exc:
            raise Hang(f"the box refused a link to td0: {exc}") from exc
        try:
            reply = peer.request(p.message(PROBE_ID, L.REGION_READ, p.RegionAccess(p.REGION_CONFIG, 0, 4).pack()),
                                 PROBE_ID, deadline, meanwhile=self._pump_server)
            if reply.is_error:
                raise Hang(f"td0's config read failed: errno {reply.error}")
        except Gone as exc:
            raise Hang(f"the box dropped the probe's link to td0: {exc}") from exc
        finally:
            peer.close()

    def send(self, index: int, rng: random.Random) -> list[bytes]:
        self.answers.seed(index)
        deadline = time.monotonic() + 5.0
        if self.link is None or self.link.closed:
            self._relink(deadline)
        assert self.link is not None
        self.wrong = rng.choice((0.0, 0.0, 0.05, 0.3))
        sent: list[bytes] = []
        try:
            for to_server, data in self._unit(rng):
                if to_server:
                    if self.server is None or self.server.closed:
                        continue
                    self.server.send(data, (), deadline)
                else:
                    self.link.send(data, (), deadline)
                sent.append(data)
                for _ in range(3):  # let the box forward it and the server answer
                    self._pump_server(0.001)
                    self.link.pump(0.001)
        except Gone:
            self.link.close()  # the next unit links again (the box reconnects to the server)
        return sent

    # --- units -----------------------------------------------------------------------
    def _id(self) -> int:
        self._ids = self._ids % 0x7FF0 + 1
        return self._ids

    def _unit(self, rng: random.Random):
        """(to the server's peer?, wire message) pairs."""
        roll = rng.random()
        if roll < 0.5:  # the host's register accesses, forwarded to the server
            for _ in range(rng.choice((1, 2, 4))):
                region = rng.choice((0, 0, 2, p.REGION_CONFIG, 1, 9))
                offset = rng.choice((0, 4, 8, 0x10, 4092, 4096, edge(rng, 32)))
                count = rng.choice((1, 2, 4, 4, 8, 0, 4096))
                if rng.random() < 0.6:
                    yield False, p.message(self._id(), L.REGION_READ, p.RegionAccess(region, offset, count).pack())
                else:
                    yield False, p.message(self._id(), L.REGION_WRITE,
                                           p.RegionAccess(region, offset, count, bytes(count)).pack(),
                                           no_reply=rng.random() < 0.7)
            return
        if roll < 0.55:
            yield False, p.message(self._id(), rng.choice((L.DMA_MAP, L.DMA_UNMAP, L.DEVICE_RESET)),
                                   p.DmaMap(3, 0, rng.choice((WINDOW, WINDOW + WINDOW_SIZE, edge(rng))) & (1 << 64) - 1,
                                            rng.choice((4096, WINDOW_SIZE, edge(rng)))).pack()[:rng.choice((32, 32, 8))])
            return
        if roll < 0.85:  # the server's own DMA, inside the window, at its edges or anywhere
            address = rng.choice((WINDOW, WINDOW + 4096, WINDOW + WINDOW_SIZE - 8, WINDOW + WINDOW_SIZE, 0, edge(rng)))
            count = rng.choice((1, 4, 8, 4096, 64 << 10, 1 << 20, (1 << 20) + 1, 0, edge(rng, 32)))
            if rng.random() < 0.5:
                payload = struct.pack("<QQ", address & (1 << 64) - 1, count & (1 << 64) - 1)
                yield True, p.message(self._id(), C.DMA_READ, payload[:rng.choice((16, 16, 16, 8))])
            else:
                data = bytes(min(count, 64 << 10)) if rng.random() < 0.8 else bytes(rng.choice((0, 3)))
                payload = struct.pack("<QQ", address & (1 << 64) - 1, count & (1 << 64) - 1) + data
                yield True, p.message(self._id(), C.DMA_WRITE, payload, no_reply=rng.random() < 0.2)
            return
        if roll < 0.95:  # what no server should send: unknown commands, replies to nothing
            command = rng.choice((C.VERSION, C.REGION_READ, C.DEVICE_RESET, 0, 0x7F, 0xFFFF))
            yield True, p.message(self._id(), command, rng.randbytes(rng.choice((0, 16, 40))),
                                  reply=rng.random() < 0.5, no_reply=rng.random() < 0.3)
            return
        if rng.random() < 0.5:  # the session's end: a broken frame, or the server hangs up
            yield True, p.HEADER.pack(1, C.REGION_READ, rng.choice((0, 8, 0xFFFFFFFF)), 0, 0) + rng.randbytes(8)
        elif self.server is not None:
            self.server.close()
