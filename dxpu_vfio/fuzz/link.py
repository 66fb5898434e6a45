"""Fuzzing the remote proxy's link (the box side, :mod:`dxpu_vfio.remoteproxy`): a box
process with a test device, an NVMe and an accelerator serving plaintext on loopback (TLS
only wraps the same stream), reached as a host proxy reaches it.

A unit is, on the link a valid HELLO opened: region accesses at the edges, write batches,
resets, SYNC, heartbeats, IRQ/DMA messages a host never sends, replies to nothing, HELLO
again, headers with mutated flags, and now and then a framing breaker (after which the box
must close the link and serve the next HELLO); the box's own DMA reads (DMA_READ, or
DMA_READV on the half of the links whose HELLO offered it) are answered, now and then
wrongly; its DMA writes come as DMA_WRITE or, on half the links, DMA_WRITEV; on half the links
the HELLO offers ring pushes, and DMA_PUSH messages (whole, lying, mutated) come as units (on
such a link to the accelerator its ring is enabled first, and most pushes aim at it). One
unit in ten is a fresh connection whose first message is a mutated
HELLO, INVENTORY or SCREENSHOT, a manager's GRANT, REVOKE or FAULT (or garbage). The
admin requests aim at a fourth device, ``td1``, that no unit links to: a GRANT that took
would end the links of the device it names, and a fault on it would stall or cut them
(the box is plaintext, so it takes admin requests from anyone).
"""

from __future__ import annotations

import random
import re
import socket
import struct
import time
from pathlib import Path
from typing import Callable

from dxpu_vfio.fuzz.child import ChildTarget
from dxpu_vfio.fuzz.mutate import edge, mutate_bytes, mutate_json
from dxpu_vfio.fuzz.peer import Gone, Hang, Peer
from dxpu_vfio.fuzz.vfio_user import PROBE_ID, framing_breaker, header
from dxpu_vfio.link.protocol import (FEATURE_DMA_READV, FEATURE_DMA_WRITEV, FEATURE_RING_PUSH, LINK_VERSION, Hello,
                                    LinkCommand, hello_proof, pack_irq, pack_push, unpack_challenge, unpack_readv)
from dxpu_vfio.remoteproxy.faults import KINDS as FAULT_KINDS
from dxpu_vfio.remoteproxy.faults import TARGETS as FAULT_TARGETS
from dxpu_vfio.remoteproxy.process import RemoteProxyProcess
from dxpu_vfio.vfio_user import protocol as p
from qemu_device import accel, header as pci

DEVICES = {"td0": "lease-td0", "nv0": "lease-nv0", "ac0": "lease-ac0"}
ADMIN_DEVICE = "td1"  # GRANT, REVOKE and FAULT name it: no unit links to it
L = LinkCommand
# the accelerator's ring, enabled on each of its links whose HELLO offered ring pushes: the box
# watches it, so DMA_PUSHes into it reach the box reader's C copy (native/serve.c push_mirrored)
ACCEL_RING, ACCEL_ENTRIES, ACCEL_ENTRY = 0x100000, 64, accel.ENTRY_SIZE


def hello(peer: Peer, device: str, token: str, deadline: float, features: tuple[str, ...] = (),
          meanwhile: Callable[[], None] | None = None) -> list[bytes] | None:
    """The host's side of a link's start on ``peer``: HELLO, the box's challenge, HELLO with
    the proof of ``token``. The two HELLOs sent if the box took the link, else None (it
    refused, or closed: the caller may retry on a new connection)."""
    first = p.message(1, L.HELLO, Hello(device, features=features).pack())
    try:
        if peer.request(first, 1, deadline, meanwhile=meanwhile).is_error:
            return None
        nonce = unpack_challenge(peer.reply_payload)
        second = p.message(2, L.HELLO, Hello(device, nonce, hello_proof(token, device, nonce), features=features).pack())
        return None if peer.request(second, 2, deadline, meanwhile=meanwhile).is_error else [first, second]
    except (Gone, p.ProtocolError):
        return None


class LinkTarget(ChildTarget):
    name = "link"

    def __init__(self) -> None:
        super().__init__()
        self.process: RemoteProxyProcess | None = None
        self.port = 0
        self.peer: Peer | None = None
        self.device = "td0"
        self.broken = False
        self.answers = random.Random(0)
        self._index = 0
        self._last_beat = 0.0
        self.ring_watched = False  # this link's accelerator ring is enabled (and pushes offered)

    def start(self, workdir: Path) -> None:
        config = workdir / "box.toml"
        config.write_text('name = "fuzzbox"\nlisten = "127.0.0.1"\nport = 0\nplaintext = true\n'
                          '[[device]]\nid = "td0"\nmodel = "testdev"\nlease = "lease-td0"\n'
                          'settings = { memory_size = 16777216 }\n'
                          '[[device]]\nid = "nv0"\nmodel = "nvme"\nlease = "lease-nv0"\n'
                          f'settings = {{ namespaces = [{{ size = 8388608, path = "{workdir / "nv0.img"}" }}] }}\n'
                          '[[device]]\nid = "ac0"\nmodel = "accel"\nlease = "lease-ac0"\n'
                          'settings = { vram_size = 1048576 }\n'
                          '[[device]]\nid = "td1"\nmodel = "testdev"\n'  # the admin requests' device
                          'settings = { memory_size = 65536 }\n')
        self.log_path = workdir / "box.log"
        self.process = RemoteProxyProcess(config, log_path=self.log_path).start()
        found = re.findall(rb"127\.0\.0\.1:(\d+)", self.log_path.read_bytes())
        self.port = int(found[-1])

    # --- links -----------------------------------------------------------------------
    def _close(self) -> None:
        if self.peer is not None:
            self.peer.close()
            self.peer = None

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _link(self, deadline: float, device: str) -> list[bytes]:
        """A link to ``device`` after a valid HELLO (EBUSY while the box still holds the last
        link: retried until it let go)."""
        self._close()
        self.broken = False
        self.device = device
        features = tuple(f for f in (FEATURE_DMA_READV, FEATURE_DMA_WRITEV, FEATURE_RING_PUSH)  # each way, and
                         if self.answers.random() < 0.5)  # ring entries pushed (DMA_PUSH) or fetched
        while True:
            self.peer = Peer(self._connect(), self._answer)
            hellos = hello(self.peer, device, DEVICES[device], deadline, features)
            if hellos is not None:
                return hellos + self._enable_ring(device, features, deadline)
            self._close()
            if time.monotonic() > deadline:
                raise Hang(f"the box gave no new link to {device} (the last one never let go?)")
            time.sleep(0.02)

    def _enable_ring(self, device: str, features: tuple[str, ...], deadline: float) -> list[bytes]:
        """On an accelerator's link that offered ring pushes, what its runtime does first: bus
        mastering on, the ring's base and size, enable (the box then watches the ring)."""
        self.ring_watched = device == "ac0" and FEATURE_RING_PUSH in features
        if not self.ring_watched:
            return []
        sent = []
        for i, msg in enumerate(self._ring_writes(3)):
            assert self.peer is not None
            self.peer.request(msg, 3 + i, deadline)
            sent.append(msg)
        return sent

    @staticmethod
    def _ring_writes(first_id: int, posted: bool = False) -> list[bytes]:
        """The register writes that enable the accelerator's ring (again, after a reset or a
        random write undid it)."""
        writes = [(p.REGION_CONFIG, pci.COMMAND, (pci.CMD_MEMORY | pci.CMD_BUS_MASTER).to_bytes(2, "little")),
                  (0, accel.REG_RING_BASE_LO, ACCEL_RING.to_bytes(4, "little")), (0, accel.REG_RING_BASE_HI, bytes(4)),
                  (0, accel.REG_RING_SIZE, ACCEL_ENTRIES.to_bytes(4, "little")),
                  (0, accel.REG_CONTROL, accel.CONTROL_ENABLE.to_bytes(4, "little"))]
        return [p.message(first_id + i, L.REGION_WRITE, p.REGION_RW.pack(offset, region, len(data)) + data,
                          no_reply=posted) for i, (region, offset, data) in enumerate(writes)]

    def _answer(self, hdr: p.Header, payload: bytes) -> bytes | None:
        """The box's DMA_READ: mostly the bytes asked for, now and then short, long, for
        another address, an error or nothing (the box's DMA timeout then)."""
        rng = self.answers
        if hdr.command == L.DMA_READV:
            return self._answer_readv(hdr, payload)
        if hdr.command != L.DMA_READ or len(payload) < 16:
            return p.error_reply(hdr.msg_id, hdr.command, 38)
        address, count = struct.unpack_from("<QQ", payload)
        roll = rng.random()
        if roll < 0.03:  # the box's DMA times out and it takes the link down, as it must
            self.broken = True
            return None
        if roll < 0.1:
            return p.error_reply(hdr.msg_id, hdr.command, rng.choice((5, 14, 22)))
        data = bytes(min(count, p.MAX_DATA_XFER))
        if roll < 0.2:
            data = data[:rng.randint(0, len(data))] if rng.random() < 0.5 else data + b"\0" * rng.randint(1, 64)
        if roll < 0.25:
            address ^= 1 << rng.randrange(40)
        reply = struct.pack("<QQ", address, len(data)) + data
        if roll < 0.28:
            reply = reply[:rng.randrange(16)]
        return p.message(hdr.msg_id, hdr.command, reply, reply=True)

    def _answer_readv(self, hdr: p.Header, payload: bytes) -> bytes | None:
        """The box's DMA_READV (on a link whose HELLO offered it): its bytes, now and then a
        few too few or too many, an error or nothing."""
        rng = self.answers
        try:
            total = sum(n for _, n in unpack_readv(payload))
        except p.ProtocolError:  # the box never sends a list the host must refuse
            return p.error_reply(hdr.msg_id, hdr.command, 22)
        roll = rng.random()
        if roll < 0.03:
            self.broken = True
            return None
        if roll < 0.1:
            return p.error_reply(hdr.msg_id, hdr.command, rng.choice((5, 14, 22)))
        if roll < 0.2:
            total = max(0, total + rng.choice((-1, 1, -4096, 4096)))
        return p.message(hdr.msg_id, hdr.command, bytes(total), reply=True)

    def probe(self, deadline: float) -> None:
        for _ in range(2):
            try:
                if self.peer is None or self.peer.closed:
                    self._link(deadline, self.device)
                assert self.peer is not None
                reply = self.peer.request(p.message(PROBE_ID, L.REGION_READ,
                                                    p.RegionAccess(p.REGION_CONFIG, 0, 4).pack()), PROBE_ID, deadline)
                if reply.is_error:
                    raise Hang(f"the probe's config read failed: errno {reply.error}")
                return
            except Gone as exc:
                self._lost(f"probe: {exc}")
        raise Hang("the box closed two links in a row at the probe")

    def _lost(self, why: str) -> None:
        if not self.broken:
            self.drops.append(f"the box closed a link whose framing was intact ({why}); last unit {self._index}")
        self._close()

    def send(self, index: int, rng: random.Random) -> list[bytes]:
        self._index = index
        self.answers.seed(index)
        deadline = time.monotonic() + 5.0
        sent: list[bytes] = []
        if self.peer is not None and not self.peer.closed and time.monotonic() - self._last_beat > 0.5:
            # as a host proxy does: the box takes a link silent for 3 s for dead
            beat = p.message(0, L.HEARTBEAT, no_reply=True)
            try:
                self.peer.send(beat, (), deadline)
                sent.append(beat)
            except Gone as exc:
                self._lost(str(exc))
            self._last_beat = time.monotonic()
        if rng.random() < 0.1:
            return sent + [self._door(rng, deadline)]
        if self.peer is None or self.peer.closed:
            sent += self._link(deadline, rng.choice(list(DEVICES)))
        assert self.peer is not None
        try:
            for data, breaks in self._unit(rng):
                self.broken |= breaks
                self.peer.send(data, (), deadline)
                sent.append(data)
                if breaks:
                    self._end_broken(deadline)
                    break
                self.peer.pump()
        except Gone as exc:
            self._lost(str(exc))
        return sent

    def _end_broken(self, deadline: float) -> None:
        assert self.peer is not None
        try:
            self.peer.sock.shutdown(socket.SHUT_WR)
            while time.monotonic() < deadline:
                self.peer.pump(0.1)
        except (Gone, OSError):
            self._close()
            return
        self._close()
        raise Hang("the box did not close a link whose framing was broken")

    # --- a new connection's first message --------------------------------------------
    def _door(self, rng: random.Random, deadline: float) -> bytes:
        roll = rng.randrange(9)
        if roll <= 2:
            device = rng.choice(list(DEVICES) + ["nope", ""])
            doc: dict = {"version": LINK_VERSION, "device": device}
            if rng.random() < 0.5:  # a second HELLO without the challenge, or a replayed one
                doc.update(nonce=rng.randbytes(16).hex(), proof=rng.randbytes(32).hex())
            data = header(rng, L.HELLO, mutate_json(rng, doc, {"device": tuple(DEVICES), "version": (0, 1, 2)}))
        elif roll == 3:
            data = header(rng, L.INVENTORY, mutate_json(rng, {"version": LINK_VERSION}))
        elif roll == 4:
            data = header(rng, L.SCREENSHOT, mutate_json(rng, {"device": "td0", "lease": "lease-td0", "offset": 0},
                                                         {"offset": (0, -1, 1 << 63, 10**20)}))
        elif roll in (5, 6):
            doc = {"device": ADMIN_DEVICE, "lease": "lz", "fence": rng.choice((1, 7)), "pool": "p"}
            if roll == 5:
                doc["holder"] = "h"
            data = header(rng, L.GRANT if roll == 5 else L.REVOKE, mutate_json(rng, doc, {
                "device": (ADMIN_DEVICE, "nope", "", 7, None), "lease": ("", 7, None, "x" * 300),
                "fence": (0, -1, 1 << 63, 10 ** 20, True, "3", None, 1.5, float("inf"))}))
        elif roll == 7:
            data = header(rng, L.FAULT, self._fault_request(rng))
        else:
            data = framing_breaker(rng)[0]
        try:
            with self._connect() as sock:
                sock.sendall(data)
                sock.shutdown(socket.SHUT_WR)
                end = time.monotonic() + 0.3  # in all: a link this HELLO opened sends heartbeats for ever
                while time.monotonic() < end:
                    sock.settimeout(max(0.01, end - time.monotonic()))
                    if not sock.recv(65536):
                        break
        except OSError:
            pass  # refused, reset, or the box waits for the rest of a message (its deadline ends it)
        return data

    @staticmethod
    def _fault_request(rng: random.Random) -> bytes:
        op = rng.choice(("arm", "arm", "clear", "list", "note"))
        doc: dict = {"op": op, "device": ADMIN_DEVICE}
        if op == "arm":
            kind = rng.choice(FAULT_KINDS)
            doc.update(kind=kind, target=rng.choice(FAULT_TARGETS[kind] or (None,)), duration=0.5,
                       count=rng.choice((None, 1, 3)))
            if kind == "stall":
                doc["ms"] = rng.choice((1, 50))
        elif op == "clear":
            doc["id"] = rng.randrange(1, 40)
        elif op == "note":
            doc.update(kind="freeze", seconds=0.1)
        odd = (None, -1, 0, 1.5, 10 ** 20, 1e308, float("inf"), float("nan"), "x", True, [], {})
        return mutate_json(rng, doc, {"op": ("arm", "clear", "list", "note", "x", None, 7),
                                      "device": (ADMIN_DEVICE, "nope", 7, None),
                                      "kind": FAULT_KINDS + ("x", "", None), "target": (None, "x", "dma-read", 7),
                                      "ms": odd, "duration": odd, "count": odd, "id": odd, "seconds": odd})

    # --- units on the link -----------------------------------------------------------------
    def _unit(self, rng: random.Random):
        roll = rng.random()
        if roll < 0.03:
            yield framing_breaker(rng)[0], True
            return
        kind = rng.choice(("read", "read", "read", "write", "write", "write", "batch", "batch", "reset", "sync",
                           "beat", "host_only", "reply", "hello", "flip", "dma_engine", "push"))
        yield from getattr(self, f"_{kind}")(rng)

    def _where(self, rng: random.Random) -> tuple[int, int, int]:
        region = rng.choice((0, 0, 0, 2, 2, 7, 7, 1, 6, 8, 9, edge(rng, 32)))
        offset = rng.randrange(0x40) & ~3 if rng.random() < 0.5 else \
            edge(rng, near=(4096, 16 << 10, 16 << 20, 0x100, 0x1000))
        count = rng.choice((1, 2, 4, 4, 4, 8, 3, 0, 4096, edge(rng, 32, near=(p.MAX_DATA_XFER,))))
        return region, offset, count

    def _read(self, rng: random.Random):
        region, offset, count = self._where(rng)
        payload = p.REGION_RW.pack(offset, region, count)
        yield header(rng, L.REGION_READ, payload[:rng.choice((16,) * 9 + (rng.randrange(16),))]), False

    def _write(self, rng: random.Random):
        region, offset, count = self._where(rng)
        length = count if count <= 4096 else 8
        data = rng.randbytes(length) if length <= 64 else bytes(length)
        if rng.random() < 0.1:
            data = data[:-1] if data else b"\0"
        yield header(rng, L.REGION_WRITE, p.REGION_RW.pack(offset, region, count) + data,
                     no_reply=rng.random() < 0.5), False

    def _batch(self, rng: random.Random):
        parts = []
        for _ in range(rng.choice((0, 1, 2, 8, 64))):
            region, offset, count = self._where(rng)
            n = min(count, 64)
            parts.append(p.REGION_RW.pack(offset, region, count if rng.random() < 0.9 else n + 1) + rng.randbytes(n))
        payload = b"".join(parts)
        if rng.random() < 0.2:
            payload = mutate_bytes(rng, payload, 65536)
        yield header(rng, L.WRITE_BATCH, payload, no_reply=rng.random() < 0.9), False

    def _push(self, rng: random.Random):
        """A DMA_PUSH: ring entries for a slot the box may or may not watch (an NVMe SQ's, when
        the box created one), whole entries or not, ranges that lie or a length that does; with
        what the entries point to (PRP lists: empty, crossing a page, too many) or not."""
        slot = rng.choice((0, 1, 1, 2, 63, 64, edge(rng, 32)))
        ranges = [(rng.choice((0x1000, 0x10000, 0x200000, edge(rng))), rng.choice((64, 128, 4096, 0, edge(rng, 32))))
                  for _ in range(rng.choice((0, 1, 1, 2, 3)))]
        pointed = [(rng.choice((0x3000, 0x3F80, 0x200000, edge(rng))), rng.choice((0, 8, 256, 4096, edge(rng, 32))))
                   for _ in range(rng.choice((0, 0, 1, 4, 65)))]
        if self.ring_watched and rng.random() < 0.7:  # the accelerator's watched ring: mostly whole entries
            if rng.random() < 0.5:  # enabled again first: resets and random writes turn it off
                for msg in self._ring_writes(0x7F00, posted=True):
                    yield msg, False
            slot, first = rng.choice((0, 0, 0, 1)), rng.randrange(ACCEL_ENTRIES)
            count = rng.randrange(1, ACCEL_ENTRIES - first + 1) if rng.random() < 0.8 else \
                rng.choice((ACCEL_ENTRIES, edge(rng, 16)))
            ranges = [(ACCEL_RING + first * ACCEL_ENTRY + (0 if rng.random() < 0.8 else rng.choice((8, -ACCEL_ENTRY))),
                       count * ACCEL_ENTRY)]
            if first and rng.random() < 0.3:  # the wrap back to the ring's start
                ranges.append((ACCEL_RING, rng.randrange(1, first + 1) * ACCEL_ENTRY))
            pointed = pointed if rng.random() < 0.2 else []
        try:
            head = pack_push(slot & 0xFFFFFFFF, [(a & (1 << 64) - 1, n & 0xFFFFFFFF) for a, n in ranges],
                             [(a & (1 << 64) - 1, n & 0xFFFFFFFF) for a, n in pointed], rng.random() < 0.1)
        except struct.error:
            head = rng.randbytes(8)
        data = bytes(min(sum(n for _, n in ranges + pointed), 1 << 18))
        payload = head + data
        if rng.random() < 0.2:
            payload = mutate_bytes(rng, payload, 1 << 18)
        yield header(rng, L.DMA_PUSH, payload, no_reply=rng.random() < 0.9), False

    def _reset(self, rng: random.Random):
        yield header(rng, L.DEVICE_RESET, rng.randbytes(rng.choice((0, 0, 8)))), False

    def _sync(self, rng: random.Random):
        yield header(rng, L.SYNC, rng.randbytes(rng.choice((0, 0, 4)))), False

    def _beat(self, rng: random.Random):
        yield header(rng, L.HEARTBEAT, rng.randbytes(rng.choice((0, 0, 16))), no_reply=rng.random() < 0.8), False

    def _host_only(self, rng: random.Random):
        """What only the box sends (IRQ, DMA_WRITE) or never anyone (unknown commands)."""
        command = rng.choice((L.IRQ, L.DMA_WRITE, L.DMA_READ, L.INVENTORY, L.SCREENSHOT, 0, 1, 2, 8, 0x107,
                              0xFFFF, edge(rng, 16)))
        payload = pack_irq(rng.randrange(4), edge(rng, 32)) if command == L.IRQ else rng.randbytes(rng.choice((0, 16, 40)))
        yield header(rng, command, payload, no_reply=rng.random() < 0.5), False

    def _reply(self, rng: random.Random):
        """A reply to nothing (or to a DMA the box already gave up)."""
        payload = struct.pack("<QQ", edge(rng), rng.choice((0, 4, 4096))) + rng.randbytes(rng.choice((0, 4, 16)))
        flags = p.TYPE_REPLY | (p.FLAG_ERROR if rng.random() < 0.3 else 0)
        yield p.HEADER.pack(rng.randrange(0xFFFF), rng.choice((L.DMA_READ, L.REGION_READ, L.HELLO, 0)),
                            p.HEADER_SIZE + len(payload), flags, edge(rng, 32)) + payload, False

    def _hello(self, rng: random.Random):
        doc = {"version": LINK_VERSION, "device": rng.choice(list(DEVICES)), "nonce": "00" * 16, "proof": "00" * 32}
        yield header(rng, L.HELLO, mutate_json(rng, doc)), False

    def _flip(self, rng: random.Random):
        kind = rng.choice(("_read", "_write", "_batch"))
        data, _ = next(getattr(self, kind)(rng))
        payload = mutate_bytes(rng, data[p.HEADER_SIZE:], 8192)
        yield data[:4] + struct.pack("<I", p.HEADER_SIZE + len(payload)) + data[8:16] + payload, False

    def _dma_engine(self, rng: random.Random):
        """Make the device DMA (test device: its copy engine; NVMe: enable it with admin
        queues at random guest addresses): the box then asks us for guest memory."""
        yield header(rng, L.REGION_WRITE, p.REGION_RW.pack(4, p.REGION_CONFIG, 2) + b"\x06\x00"), False
        if self.device == "nv0":
            regs = [(0x14, 0, 4), (0x24, (15 << 16) | 15, 4), (0x28, edge(rng) & ~0xFFF, 8),
                    (0x30, edge(rng) & ~0xFFF, 8), (0x14, 1 | (6 << 16) | (4 << 20), 4), (0x1000, rng.randrange(17), 4)]
        else:
            regs = [(0x20, edge(rng, 32), 4), (0x24, edge(rng, 32), 4), (0x28, edge(rng, 32), 4),
                    (0x2C, edge(rng, 32), 4), (0x30, rng.choice((1, 4096, 1 << 20, edge(rng, 32))), 4),
                    (0x34, rng.choice((1, 2, 3, 7)) | (rng.choice((0, 1)) << 16), 4)]
        for offset, value, size in regs:
            yield header(rng, L.REGION_WRITE, p.REGION_RW.pack(offset, 0, size) + value.to_bytes(size, "little"),
                         no_reply=rng.random() < 0.5), False
