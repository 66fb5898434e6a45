"""Fuzzing the host proxy as a malicious GPU box reaches it: its end of the link (the C
forwarder and the Python endpoint behind it) and, through them, the guest's memory.

The fuzzer is the box: it listens on loopback (plaintext), lets a host proxy process link
to it (HELLO, challenge, its description of a test device), and plays QEMU on the host
proxy's vfio-user socket too, with guest RAM that is a memfd mapped at ``GUEST`` between
two canary pages QEMU never mapped. A unit is what a box may send: DMA_WRITE(V) and
DMA_READ(V) at the edges of the window and past them, with lengths that lie; IRQs of
any kind and vector; RING_WATCH of rings anywhere, then QEMU's doorbell writes that make
the host push ring entries; heartbeats, unknown commands, replies to nothing; mutated
payloads. The box answers the host's requests (region reads, config writes, syncs),
now and then wrongly. Now and then a unit breaks the link on purpose (a framing breaker,
a wrong completion): the host must drop the link and the fuzzer links a new host proxy.

Checked at every probe: the host proxy lives, answers QEMU's config read, and left the
canary pages as they were (a **violation** otherwise: it wrote where QEMU never mapped).
A link the host dropped after a unit it should have taken is a **drop**.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import secrets
import socket
import struct
import threading
import time
from pathlib import Path

from dxpu_vfio.fuzz.child import ChildTarget
from dxpu_vfio.fuzz.mutate import edge, mutate_bytes
from dxpu_vfio.fuzz.peer import Gone, Hang, Peer, Violation
from dxpu_vfio.hostproxy.process import HostProxyProcess
from dxpu_vfio.link.protocol import (FEATURE_DMA_READV, FEATURE_DMA_WRITEV, FEATURE_RING_PUSH, NONCE_BYTES,
                                     READV_HEAD, READV_RANGE, RING_WATCH_MSG, LinkCommand, challenge, pack_irq)
from dxpu_vfio.vfio_user import protocol as p
from dxpu_vfio.vfio_user.connection import Connection, ConnectionClosed

L = LinkCommand
PAGE = 4096
GUEST, MEM = 0x1_0000_0000, 1 << 20  # where QEMU maps guest RAM, and how much
CANARY = 0xCC  # the memfd's first and last page, never mapped: they must keep this byte
PROBE_ID = 0xFFFF
# the box's test device, as a real box describes it (remoteproxy.proxy.describe of a 1 MiB testdev)
DESCRIPTION = {"model": "testdev",
               "regions": [[0, 4096, True, True], [1, 0, False, False], [2, 1 << 20, True, True],
                           [3, 0, False, False], [4, 0, False, False], [5, 0, False, False],
                           [6, 0, False, False], [7, 4096, True, True], [8, 0, False, False]],
               "irqs": {"intx": 1, "msi": 4, "msix": 0, "err": 1, "req": 1}, "coalesce": False}


class HostLinkTarget(ChildTarget):
    """A host proxy process linked to the fuzzer's box, with the fuzzer as its QEMU too."""

    name = "host-link"

    def __init__(self) -> None:
        super().__init__()
        self.listener: socket.socket | None = None
        self.box: Peer | None = None  # the link, the box's end
        self.qemu: Peer | None = None  # the vfio-user socket, QEMU's end
        self.features: list[str] = []  # what the host offered in its HELLO
        self.ram: mmap.mmap | None = None  # the whole memfd: canary, guest RAM, canary
        self.answers = random.Random(0)  # how the box answers the host's requests
        self.breaking = False  # this unit may end the link: its end is expected
        self.plausible = False  # this unit's addresses and lengths are a device's, not edges
        self._ids = 1

    # --- process and link ------------------------------------------------------------
    def start(self, workdir: Path) -> None:
        self.workdir = workdir
        self.log_path = workdir / f"{self.name}.log"
        if self.listener is None:
            self.listener = socket.create_server(("127.0.0.1", 0))
            self.listener.settimeout(15.0)
        self._spawn()

    def _spawn(self) -> None:
        """A host proxy linked to our box and a QEMU session on it with guest RAM mapped."""
        assert self.listener is not None
        linked: dict = {}
        accepting = threading.Thread(target=self._accept, args=(linked,), daemon=True)
        accepting.start()
        address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.process = HostProxyProcess("remote", self.workdir / f"{self.name}.sock", log_path=self.log_path,
                                        settings={"address": address, "device": "td0", "lease": "fuzz",
                                                  "plaintext": True, "completion_timeout": 1.0},
                                        name=f"fuzz-{self.name}-{os.getpid()}").start()
        accepting.join(15.0)
        if "sock" not in linked:
            raise Hang(f"the host proxy did not link to the box: {linked.get('error')}")
        self.box = Peer(linked["sock"], self._box_answer)
        self._qemu_session()
        self.breaking = False

    def _accept(self, linked: dict) -> None:
        """The box's side of the handshake, blocking: HELLO, our challenge, HELLO with a
        proof (not checked: the host is under test), our description."""
        assert self.listener is not None
        try:
            sock, _ = self.listener.accept()
            sock.settimeout(10.0)
            conn = Connection(sock)  # (nothing comes after a HELLO before its reply: nothing stays buffered)
            first = conn.receive()
            conn.send(p.message(first.header.msg_id, first.header.command, challenge(secrets.token_hex(NONCE_BYTES)),
                                reply=True))
            proved = conn.receive()
            self.features = json.loads(bytes(proved.payload)).get("features", [])
            conn.send(p.message(proved.header.msg_id, proved.header.command, json.dumps(DESCRIPTION).encode(),
                                reply=True))
            sock.settimeout(None)
            linked["sock"] = sock
        except (OSError, ValueError, KeyError, ConnectionClosed, p.ProtocolError) as exc:
            linked["error"] = repr(exc)

    def _qemu_session(self) -> None:
        """QEMU's end: VERSION, guest RAM (the memfd's middle), bus mastering on."""
        assert self.process is not None
        deadline = time.monotonic() + 10.0
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(self.process.socket_path))
        self.qemu = Peer(sock)
        self._qemu_request(p.message(1, p.Command.VERSION, p.Version(0, 0, {"max_msg_fds": 8}).pack()), 1, deadline)
        fd = os.memfd_create("fuzz-guest", os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, MEM + 2 * PAGE)
            self.ram = mmap.mmap(fd, MEM + 2 * PAGE)
            self.ram[:PAGE] = bytes([CANARY]) * PAGE
            self.ram[PAGE + MEM:] = bytes([CANARY]) * PAGE
            self._qemu_request(p.message(2, p.Command.DMA_MAP, p.DmaMap(3, PAGE, GUEST, MEM).pack()), 2, deadline, [fd])
        finally:
            os.close(fd)
        command = p.RegionAccess(p.REGION_CONFIG, 4, 2, b"\x06\x00").pack()
        self._qemu_request(p.message(3, p.Command.REGION_WRITE, command), 3, deadline)

    def _qemu_request(self, data: bytes, msg_id: int, deadline: float, fds: list[int] | tuple = ()) -> p.Header:
        """A request on QEMU's socket, the box answering the host meanwhile (a region
        access goes over the link)."""
        assert self.qemu is not None
        return self.qemu.request(data, msg_id, deadline, fds, meanwhile=self._pump_box)

    def _pump_box(self, timeout: float = 0.002) -> None:
        """Let the box read and answer what the host sent (up to ``timeout`` for something)."""
        if self.box is not None and not self.box.closed:
            try:
                self.box.pump(timeout)
            except Gone:
                pass  # seen by the next unit or probe

    def _close(self) -> None:
        for peer in (self.box, self.qemu):
            if peer is not None:
                peer.close()
        self.box = self.qemu = None
        if self.ram is not None:
            self.ram.close()
            self.ram = None

    def stop(self) -> None:
        super().stop()
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def _relink(self, why: str) -> None:
        """The host dropped the link: a new host proxy (it never links again by itself).
        Unexpected unless this unit meant to break it; the process dying is a crash the
        runner sees (alive() false), not something to relink over."""
        if self.process is None or not self.process.alive():
            return
        if not self.breaking:
            self.drops.append(f"the host dropped a link whose framing was intact ({why})")
        self._close()
        self.process.stop()
        self._spawn()

    # --- the box's answers to the host -----------------------------------------------
    def _box_answer(self, hdr: p.Header, payload: bytes) -> bytes | None:
        """Region reads answered right (or, now and then, wrong: the host must drop the
        link, not hand QEMU the bytes); non-posted writes, syncs and resets completed."""
        rng = self.answers
        if hdr.command == L.REGION_READ:
            try:
                req = p.RegionAccess.unpack(payload, write=False)
            except p.ProtocolError:
                return None
            if rng.random() < 0.03:
                self.breaking = True
                wrong = p.RegionAccess(req.region, req.offset + 4, req.count, b"\x11" * req.count).pack()
                return p.message(hdr.msg_id, hdr.command, rng.choice((wrong, b"\x01\x02", b"")), reply=True)
            return p.message(hdr.msg_id, hdr.command,
                             p.RegionAccess(req.region, req.offset, req.count, b"\x5a" * req.count).pack(), reply=True)
        if hdr.command == L.REGION_WRITE:
            try:
                req = p.RegionAccess.unpack(payload, write=True)
            except p.ProtocolError:
                return None
            return p.message(hdr.msg_id, hdr.command, p.RegionAccess(req.region, req.offset, req.count).pack(),
                             reply=True)
        if hdr.command in (L.SYNC, L.DEVICE_RESET, L.DMA_MAP, L.DMA_UNMAP):
            return p.message(hdr.msg_id, hdr.command, b"", reply=True)
        return None

    # --- the fuzzer's side -------------------------------------------------------------
    def probe(self, deadline: float) -> None:
        if self.box is None or self.box.closed or self.qemu is None or self.qemu.closed:
            self._relink("seen at the probe")
        assert self.ram is not None
        if self.ram[:PAGE] != bytes([CANARY]) * PAGE or self.ram[PAGE + MEM:] != bytes([CANARY]) * PAGE:
            raise Violation("the host wrote guest memory outside every window QEMU mapped (a canary page changed)")
        try:
            reply = self._qemu_request(p.message(PROBE_ID, p.Command.REGION_READ,
                                                 p.RegionAccess(p.REGION_CONFIG, 0, 4).pack()), PROBE_ID, deadline)
        except Gone as exc:
            self._relink(f"probe: {exc}")
            return
        if reply.is_error and reply.error != 5:  # EIO: the link just broke under the read
            raise Hang(f"the config read of the probe failed: errno {reply.error}")

    def send(self, index: int, rng: random.Random) -> list[bytes]:
        self.answers.seed(index)
        deadline = time.monotonic() + 5.0
        if self.box is None or self.box.closed or self.qemu is None or self.qemu.closed:
            self._relink("seen at the next unit")
        assert self.box is not None and self.qemu is not None
        sent: list[bytes] = []
        try:
            for peer, data in self._unit(rng):
                peer.send(data, (), deadline)
                sent.append(data)
                self._pump_box(0.0)
                self.qemu.pump()
        except Gone as exc:
            self._relink(str(exc))
        return sent

    # --- units -----------------------------------------------------------------------
    def _unit(self, rng: random.Random):
        """(peer, wire message) pairs, each made just before it is sent."""
        assert self.box is not None and self.qemu is not None
        self.plausible = rng.random() < 0.5  # this unit's addresses and lengths: what a device would use
        roll = rng.random()
        if roll < 0.005:  # rare: each costs a new host proxy (0.2-0.3 s)
            self.breaking = True
            yield self.box, rng.randbytes(rng.randint(1, 24)) if rng.random() < 0.5 else \
                p.HEADER.pack(1, L.DMA_WRITE, rng.choice((0, 8, 0xFFFFFFFF)), 0, 0)
            return
        if roll < 0.12 and FEATURE_RING_PUSH in self.features:
            yield from self._ring(rng)
            return
        if roll < 0.2:  # QEMU's own accesses: reads go over the link (and come back right or not)
            region = rng.choice((0, 0, 2, p.REGION_CONFIG))
            access = p.RegionAccess(region, rng.choice((0, 4, 8, 0x10, 4092)), rng.choice((1, 2, 4, 8)))
            command = p.Command.REGION_READ if rng.random() < 0.6 else p.Command.REGION_WRITE
            payload = access.pack() if command == p.Command.REGION_READ else \
                p.RegionAccess(access.region, access.offset, access.count, rng.randbytes(access.count)).pack()
            yield self.qemu, p.message(self._id(), command, payload, no_reply=command == p.Command.REGION_WRITE
                                       and region != p.REGION_CONFIG)
            return
        kind = rng.choice(("write", "write", "writev", "read", "readv", "irq", "beat", "other", "reply", "mutated"))
        data = getattr(self, f"_{kind}")(rng)
        yield self.box, data

    def _id(self) -> int:
        self._ids = self._ids % 0x7FFF + 1
        return self._ids

    def _address(self, rng: random.Random) -> int:
        """A guest address: in the window, at or across its edges, or anywhere."""
        if self.plausible:
            return GUEST + rng.randrange(MEM // PAGE - 16) * PAGE + rng.choice((0, 0, 8, 64))
        roll = rng.randrange(6)
        if roll <= 2:
            return GUEST + rng.choice((0, 8, PAGE, MEM - PAGE, MEM - 8, rng.randrange(MEM)))
        if roll == 3:
            return GUEST + rng.choice((MEM, MEM - 1, MEM + 8, -1, -8, -PAGE))
        if roll == 4:
            return rng.choice((0, PAGE, GUEST - PAGE - 1, 2 * GUEST))
        return edge(rng)

    def _length(self, rng: random.Random) -> int:
        if self.plausible:
            return rng.choice((4, 8, 64, PAGE, 8 * PAGE))
        return rng.choice((0, 1, 4, 8, 64, PAGE, PAGE + 1, 64 << 10, MEM, edge(rng, 32)))

    def _message(self, command: int, payload: bytes, posted: bool) -> bytes:
        return p.message(self._id(), command, payload, no_reply=posted)

    def _write(self, rng: random.Random) -> bytes:
        address, length = self._address(rng), self._length(rng)
        data = rng.randbytes(min(length, 64 << 10)) if rng.random() < 0.8 else rng.randbytes(rng.choice((0, 3, 100)))
        payload = struct.pack("<QQ", address & (1 << 64) - 1, length & (1 << 64) - 1) + data
        return self._message(L.DMA_WRITE, payload, posted=rng.random() < 0.95)

    def _ranges(self, rng: random.Random) -> list[tuple[int, int]]:
        return [(self._address(rng) & (1 << 64) - 1, min(self._length(rng), 1 << 20) & 0xFFFFFFFF)
                for _ in range(rng.choice((0, 1, 1, 2, 5, 256, 257)))]

    @staticmethod
    def _scatter(ranges: list[tuple[int, int]], count: int | None = None) -> bytes:
        """A DMA_READV/WRITEV head as a box may send it: its count right or lying, ranges
        of any size (pack_readv/pack_writev refuse what a malicious box would send)."""
        return READV_HEAD.pack(len(ranges) if count is None else count, 0) + \
            b"".join(READV_RANGE.pack(address, length, 0) for address, length in ranges)

    def _writev(self, rng: random.Random) -> bytes:
        ranges = self._ranges(rng)
        total = sum(n for _, n in ranges)
        data = rng.randbytes(min(total, 256 << 10)) if rng.random() < 0.8 else rng.randbytes(rng.choice((0, 7)))
        command = L.DMA_WRITEV if FEATURE_DMA_WRITEV in self.features or rng.random() < 0.1 else L.DMA_WRITE
        count = None if rng.random() < 0.9 else edge(rng, 32)
        return self._message(command, self._scatter(ranges, count) + data, posted=rng.random() < 0.95)

    def _read(self, rng: random.Random) -> bytes:
        payload = struct.pack("<QQ", self._address(rng) & (1 << 64) - 1, self._length(rng) & (1 << 64) - 1)
        return self._message(L.DMA_READ, payload, posted=rng.random() < 0.05)

    def _readv(self, rng: random.Random) -> bytes:
        command = L.DMA_READV if FEATURE_DMA_READV in self.features or rng.random() < 0.1 else L.DMA_READ
        count = None if rng.random() < 0.9 else edge(rng, 32)
        return self._message(command, self._scatter(self._ranges(rng), count), posted=rng.random() < 0.05)

    def _irq(self, rng: random.Random) -> bytes:
        payload = pack_irq(rng.choice((0, 1, 2, 3, 4, edge(rng, 32))), rng.choice((0, 1, 3, 4, 31, edge(rng, 32))),
                           rng.random() < 0.7)
        return self._message(L.IRQ, payload[:rng.choice((12, 12, 12, 4, 0))], posted=rng.random() < 0.9)

    def _beat(self, rng: random.Random) -> bytes:
        return self._message(L.HEARTBEAT, rng.randbytes(rng.choice((0, 0, 8))), posted=rng.random() < 0.9)

    def _other(self, rng: random.Random) -> bytes:
        """What a box never sends the host (its own requests' commands) or no one does."""
        command = rng.choice((L.REGION_READ, L.REGION_WRITE, L.DEVICE_RESET, L.HELLO, L.WRITE_BATCH, L.SYNC,
                              L.INVENTORY, L.DMA_PUSH, L.DMA_MAP, 0, 1, 0x10F, 0xFFFF, edge(rng, 16)))
        return self._message(command, rng.randbytes(rng.choice((0, 4, 16, 40))), posted=rng.random() < 0.5)

    def _reply(self, rng: random.Random) -> bytes:
        """A reply to nothing the host asked (an id it may or may not have in flight)."""
        payload = p.RegionAccess(0, 0, 4, b"\x00" * 4).pack() if rng.random() < 0.5 else rng.randbytes(8)
        flags = p.TYPE_REPLY | (p.FLAG_ERROR if rng.random() < 0.3 else 0)
        return p.HEADER.pack(rng.randrange(0x10000), rng.choice((L.REGION_READ, L.REGION_WRITE, L.SYNC, L.DMA_READ)),
                             p.HEADER_SIZE + len(payload), flags, edge(rng, 32)) + payload

    def _mutated(self, rng: random.Random) -> bytes:
        """One of the others with its payload's bytes changed (the framing kept whole)."""
        data = getattr(self, rng.choice(("_write", "_writev", "_readv", "_irq")))(rng)
        payload = mutate_bytes(rng, data[p.HEADER_SIZE:], 1 << 18)
        return data[:4] + struct.pack("<I", p.HEADER_SIZE + len(payload)) + data[8:16] + payload

    def _ring(self, rng: random.Random):
        """A RING_WATCH of a ring anywhere (the host reads guest memory for it), then QEMU's
        doorbell writes to it: each makes the host push the ring's entries to the box."""
        assert self.box is not None and self.qemu is not None
        base = self._address(rng) & ~0x3F if rng.random() < 0.8 else self._address(rng)
        if self.plausible:  # an NVMe SQ's shape: 64 entries of 64 bytes, each pointing at a PRP list
            slot, region, entries, entry_size, doorbell = rng.choice((0, 1)), 0, 64, 64, 0x10
            pointer = rng.choice((0, (8 << 16) | 24, (4096 << 16) | 24))
            for i in range(entries):  # the entries' pointers: into the window, or not
                at = base - GUEST + PAGE + i * entry_size + 24
                if self.ram is not None and PAGE <= at <= PAGE + MEM - 8:
                    self.ram[at:at + 8] = struct.pack("<Q", self._address(rng) & (1 << 64) - 1)
        else:
            slot, region = rng.choice((0, 1, 63, 64)), rng.choice((0, 0, 2, 9))
            entries, entry_size = rng.choice((16, 64, 1, 0, 1 << 16, 1 << 17)), rng.choice((64, 64, 16, 1, 4096, 8192))
            doorbell = rng.choice((0x10, 0x10, 0x14, 0xFFC, 0x1000))
            pointer = rng.choice((0, 0, (8 << 16) | 24, (4096 << 16) | 24, (64 << 16) | 60, edge(rng, 32)))  # bytes | offset
        watch = RING_WATCH_MSG.pack(slot, region, doorbell, base & (1 << 64) - 1, entry_size, entries, 0, pointer)
        yield self.box, self._message(L.RING_WATCH, watch[:rng.choice((len(watch),) * 9 + (8,))], posted=True)
        for _ in range(rng.choice((1, 2, 5))):
            tail = rng.choice((1, 2, entries - 1 if entries else 0, rng.randrange(1 << 16), edge(rng, 32)))
            yield self.qemu, p.message(self._id(), p.Command.REGION_WRITE,
                                       p.RegionAccess(0, doorbell, 4, (tail & 0xFFFFFFFF).to_bytes(4, "little")).pack(),
                                       no_reply=True)
