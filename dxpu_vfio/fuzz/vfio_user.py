"""Fuzzing the vfio-user server (:mod:`dxpu_vfio.vfio_user.server`) as QEMU reaches it:
the host proxy process serving the test device or the NVMe model on its UNIX socket.

A unit is one or a few messages: VERSION with mutated JSON, DMA_MAP/UNMAP with memfds
(sealed or not), other descriptors or none at odd offsets and sizes, region accesses at
the edges of every region, SET_IRQS with eventfds (or pipes), the device programmed to DMA
(test device: its copy engine; NVMe: admin queues in guest memory and random commands;
the accelerator: its command ring in guest memory, entries of every opcode with operands
at the edges of VRAM and of guest memory, scatter lists, inline copies, doorbells),
a mapped memfd shrunk under the server, headers with mutated flags, ids and errors, and now
and then a message that breaks the framing (size below the header or above the limit,
truncated, more than 16 descriptors), after which the session must end and a new one be
served. The server's own DMA requests (fd-less windows) are answered, now and then wrongly.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import random
import socket
import struct
import time
from pathlib import Path

from dxpu_vfio.fuzz.child import ChildTarget
from dxpu_vfio.fuzz.mutate import edge, mutate_bytes, mutate_json, nested, small
from dxpu_vfio.fuzz.peer import Gone, Hang, Peer
from dxpu_vfio.hostproxy.process import HostProxyProcess
from dxpu_vfio.vfio_user import protocol as p
from qemu_device import accel

PROBE_ID = 0xFFFF  # never used by a generated message
SYNC_ID = 0xFFFE  # nor this: the round trip before a message with descriptors (see VfioUserTarget.send)
RAM_BASE, RAM_SIZE = 0x1_0000_0000, 1 << 20  # a sealed memfd, mapped at every session start
FDLESS_BASE = 0x2_0000_0000  # a window without descriptor: the server asks us (DMA_READ/DMA_WRITE)
REGION_SIZES = (4096, 16 << 10, 16 << 20, 4096, 0x100, 0x1000, 0x10000)
ACCEL_VRAM = 4 << 20  # the fuzzed accelerator's VRAM: small, so whatever a guest writes stays a few MiB
ACCEL_RING = 0x10000  # offset in guest RAM of its ring (up to 1024 entries) ...
ACCEL_SG = 0x8000  # ... and of the scatter lists its copies name; its copies and fences go above both
ACCEL_DATA = 0x20000
ACCEL_RING_ENTRIES = (64, 64, 64, 1024, 1024, 2, 3, 0, 1 << 17)
CMD = p.Command

# one wire message: (bytes, descriptors, whether it breaks the framing)
Wire = tuple[bytes, list[int], bool]


def header(rng: random.Random, command: int, payload: bytes, *, no_reply: bool = False) -> bytes:
    """A well-framed message; now and then with mutated id, flags or error field."""
    msg_id = rng.randrange(0xFFFF)
    flags = p.FLAG_NO_REPLY if no_reply else 0
    error = 0
    if rng.random() < 0.08:
        flags = rng.choice((p.TYPE_REPLY, p.FLAG_ERROR, p.FLAG_NO_REPLY | p.FLAG_ERROR, 0xF, 0x2, edge(rng, 32)))
    if rng.random() < 0.05:
        error = edge(rng, 32)
    return p.HEADER.pack(msg_id, command, p.HEADER_SIZE + len(payload), flags, error) + payload


def config_read(msg_id: int) -> bytes:
    """A read of the first config dword: what the fuzzer's own round trips ask (the probe,
    the sync before descriptors, the first message of a session without VERSION)."""
    return p.message(msg_id, CMD.REGION_READ, p.RegionAccess(p.REGION_CONFIG, 0, 4).pack())


def framing_breaker(rng: random.Random) -> Wire:
    """A message after which the stream cannot be trusted: the session must end cleanly."""
    body = rng.randbytes(rng.choice((0, 4, 24)))
    roll = rng.randrange(5)
    if roll == 0:
        size = rng.choice((0, 1, 15))
    elif roll == 1:
        size = rng.choice((p.MAX_MESSAGE + 1, 1 << 31, 0xFFFFFFFF))
    elif roll == 2:  # claims more than comes: then the stream ends
        size = p.HEADER_SIZE + len(body) + rng.choice((1, 8, 4096))
    elif roll == 3:  # truncated mid-header
        return p.HEADER.pack(1, CMD.REGION_READ, 40, 0, 0)[:rng.randint(1, 15)], [], True
    else:
        return rng.randbytes(rng.randint(1, 64)), [], True
    return p.HEADER.pack(rng.randrange(0xFFFF), rng.choice(list(CMD)), size, 0, 0) + body, [], True


def _memfd(rng: random.Random, size: int | None = None, seal: bool | None = None) -> int:
    """A memfd as QEMU's guest RAM is (sealed against shrinking) or not."""
    fd = os.memfd_create("fuzz-guest", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size if size is not None else rng.choice((4096, 8192, 65536, 256 << 10)))
    if seal if seal is not None else rng.random() < 0.5:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


def _odd_fd(rng: random.Random) -> int:
    """A descriptor that is not what the command takes."""
    roll = rng.randrange(4)
    if roll == 0:
        r, w = os.pipe()
        os.close(r)
        return w
    if roll == 1:
        return os.open("/dev/null", os.O_RDWR)
    if roll == 2:
        return os.eventfd(0)
    return _memfd(rng)


class VfioUserTarget(ChildTarget):
    """The host proxy process serving ``model`` (testdev, nvme or accel), fuzzed on its socket."""

    def __init__(self, model: str = "testdev") -> None:
        super().__init__()
        self.model = model
        self.name = "vfio-user" if model == "testdev" else f"vfio-user-{model}"
        self.process: HostProxyProcess | None = None
        self.peer: Peer | None = None
        self.broken = False  # a framing breaker was sent on this session: its end is expected
        self.kept: list[int] = []  # memfds we mapped and may shrink later
        self.ram: mmap.mmap | None = None
        self.answers = random.Random(0)  # how the server's DMA requests are answered
        self.sq_tail = 0  # NVMe: the admin submission queue's tail as we last rang it
        self.ring = (0, 0)  # the accelerator: its ring's size as we enabled it, and our tail
        self._index = 0

    # --- process ---------------------------------------------------------------------
    def start(self, workdir: Path) -> None:
        self.workdir = workdir
        self.log_path = workdir / f"{self.name}.log"
        self.process = HostProxyProcess(self.model, workdir / f"{self.name}.sock", settings=self._settings(workdir),
                                        log_path=self.log_path, name=f"fuzz-{self.name}-{os.getpid()}").start()

    def _settings(self, workdir: Path) -> dict:
        """The model's settings: small, so whatever a guest makes it hold stays a few MiB."""
        return {"testdev": {"memory_size": 16 << 20}, "accel": {"vram_size": ACCEL_VRAM},
                "nvme": {"namespaces": [{"size": 8 << 20, "path": str(workdir / "ns1.img")}]}}[self.model]

    # --- sessions --------------------------------------------------------------------
    def _close(self) -> None:
        if self.peer is not None:
            self.peer.close()
            self.peer = None
        for fd in self.kept:
            os.close(fd)
        self.kept = []
        if self.ram is not None:
            self.ram.close()
            self.ram = None

    def _end_broken(self, deadline: float) -> None:
        """After a framing breaker: our side of the stream ends, and the server must end its
        session (read to the end, close) before the next one starts."""
        assert self.peer is not None
        try:
            self.peer.sock.shutdown(socket.SHUT_WR)
            while time.monotonic() < deadline:
                self.peer.pump(0.1)
        except Gone:
            self._close()
            return
        except OSError:
            self._close()
            return
        self._close()
        raise Hang("the server did not end a session whose framing was broken")

    def _lost(self, why: str) -> None:
        if not self.broken:
            self.drops.append(f"the server ended a session whose framing was intact ({why}); "
                              f"last unit {self._index}")
        self._close()

    def _session(self, deadline: float, negotiate: bool = True) -> list[bytes]:
        """A new session (the server serves one at a time: retried until the last one is
        gone), negotiated and with guest RAM mapped unless told otherwise."""
        self._close()
        self.broken = False
        sent: list[bytes] = []
        assert self.process is not None
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(str(self.process.socket_path))
                self.peer = Peer(sock, self._answer)
                if not negotiate:  # a session left without VERSION: a read (refused, EPROTO) shows the
                    # server took it; a connection that came while the last session was still
                    # ending is closed unanswered, and is tried again like a refused VERSION
                    probe = config_read(PROBE_ID)
                    self.peer.request(probe, PROBE_ID, deadline)
                    return sent + [probe]
                hello = p.message(1, CMD.VERSION, p.Version(0, 0, {"max_msg_fds": p.MAX_MSG_FDS}).pack())
                self.peer.request(hello, 1, deadline)
                break
            except (Gone, ConnectionRefusedError, FileNotFoundError):
                self._close()
                if time.monotonic() > deadline:
                    raise Hang("the server served no new session (the last one did not end?)") from None
                time.sleep(0.01)
        sent.append(hello)
        fd = _memfd(self.answers, RAM_SIZE, seal=True)
        try:
            self.ram = mmap.mmap(fd, RAM_SIZE)
            ram = p.message(2, CMD.DMA_MAP, p.DmaMap(3, 0, RAM_BASE, RAM_SIZE).pack())
            fdless = p.message(3, CMD.DMA_MAP, p.DmaMap(3, 0, FDLESS_BASE, RAM_SIZE).pack())
            self.peer.request(ram, 2, deadline, [fd])
            self.peer.request(fdless, 3, deadline)
        finally:
            os.close(fd)
        return sent + [ram, fdless]

    def _answer(self, hdr: p.Header, payload: bytes) -> bytes | None:
        """The server's DMA_READ/DMA_WRITE to an fd-less window: mostly right, now and then
        an error, short or for another address, or no answer at all."""
        rng = self.answers
        roll = rng.random()
        if roll < 0.05:
            return None
        if roll < 0.15:
            return p.error_reply(hdr.msg_id, hdr.command, rng.choice((1, 5, 14, 22, 0)))
        if len(payload) < 16:
            return p.error_reply(hdr.msg_id, hdr.command, 22)
        address, count = struct.unpack_from("<QQ", payload)
        count &= 0xFFFFFFFF
        if hdr.command == CMD.DMA_READ:
            data = bytes(min(count, p.MAX_DATA_XFER))
            if roll < 0.25:
                data = data[:rng.randint(0, len(data))] if rng.random() < 0.5 else data + b"x" * rng.randint(1, 64)
            if roll < 0.3:
                address += 4096
            return p.message(hdr.msg_id, hdr.command, struct.pack("<QQ", address, len(data)) + data, reply=True)
        reply = struct.pack("<QQ", address, count)
        return p.message(hdr.msg_id, hdr.command, reply[:rng.choice((16, 16, 16, 8, 0))], reply=True)

    # --- the fuzzer's side ---------------------------------------------------------------
    def probe(self, deadline: float) -> None:
        for _ in range(2):  # a session the last unit ended legitimately: one new session
            try:
                if self.peer is None or self.peer.closed:
                    self._session(deadline)
                assert self.peer is not None
                reply = self.peer.request(config_read(PROBE_ID), PROBE_ID, deadline)
                if reply.is_error and reply.error != 71:  # EPROTO: a session left without VERSION
                    raise Hang(f"the config read of the probe failed: errno {reply.error}")
                return
            except Gone as exc:
                self._lost(f"probe: {exc}")
        raise Hang("the server ended two sessions in a row at the probe")

    def send(self, index: int, rng: random.Random) -> list[bytes]:
        self._index = index
        self.answers.seed(index)
        deadline = time.monotonic() + 5.0
        sent: list[bytes] = []
        if self.peer is None or self.peer.closed:
            sent += self._session(deadline, negotiate=rng.random() > 0.03)
        assert self.peer is not None
        fds: list[int] = []
        try:
            for data, fds, breaks in self._unit(rng):
                if fds and not breaks:
                    # As QEMU does, nothing else in flight when descriptors go (the streams give a
                    # read's descriptors to the message holding its last byte, docs/limits.md
                    # "Descriptors"; test_vfio_user_limits checks the other order on its own).
                    sync = config_read(SYNC_ID)
                    self.peer.request(sync, SYNC_ID, deadline)
                    sent.append(sync)
                self.broken |= breaks
                self.peer.send(data, fds, deadline)
                for fd in fds:
                    os.close(fd)
                fds = []
                sent.append(data)
                if breaks:
                    self._end_broken(deadline)
                    break
                self.peer.pump()
        except Gone as exc:
            self._lost(str(exc))
        finally:
            for fd in fds:
                os.close(fd)
        return sent

    # --- units -----------------------------------------------------------------------
    def _unit(self, rng: random.Random):
        """The wire messages of one unit, each made just before it is sent."""
        roll = rng.random()
        if roll < 0.03:
            yield framing_breaker(rng)
            return
        if roll < 0.04:  # more descriptors than a message may carry: the kernel truncates, the session ends
            yield header(rng, CMD.DEVICE_SET_IRQS, p.SetIrqs(p.IRQ_DATA_EVENTFD | p.IRQ_ACTION_TRIGGER,
                                                             p.IRQ_MSI, 0, 17).pack()), \
                [os.eventfd(0) for _ in range(p.MAX_MSG_FDS + 1)], True
            return
        if roll < 0.14:
            yield from self._program_device(rng)
            return
        if roll < 0.16 and self.kept:
            try:  # a mapped memfd shrunk under the server (refused if it is sealed)
                os.ftruncate(rng.choice(self.kept), rng.choice((0, 100, 4096)))
            except PermissionError:
                pass
        kind = rng.choice(("version", "map", "map", "unmap", "info", "region_info", "irq_info", "irqs", "irqs",
                           "read", "read", "read", "write", "write", "write", "multi", "reset", "other", "flip"))
        yield getattr(self, f"_{kind}")(rng)

    def _version(self, rng: random.Random) -> Wire:
        caps = {"max_msg_fds": 16, "max_data_xfer_size": 1 << 20, "pgsizes": 4096, "max_dma_maps": 65535,
                "migration": {"pgsize": 4096, "max_bitmap_size": 1 << 20}}
        roll = rng.randrange(5)
        if roll == 0:
            raw = b'{"capabilities": ' + nested(rng) + b"}\0"
        elif roll == 1:
            raw = rng.randbytes(rng.randint(0, 64))
        else:
            raw = mutate_json(rng, {"capabilities": caps}) + (b"\0" if rng.random() < 0.8 else b"")
        payload = p.VERSION.pack(rng.choice((0, 0, 0, 1, 0xFFFF)), edge(rng, 16)) + raw
        return header(rng, CMD.VERSION, payload[:rng.choice((len(payload),) * 9 + (2,))]), [], False

    def _map(self, rng: random.Random) -> Wire:
        size = rng.choice((4096, 8192, 65536, 256 << 10))
        roll = rng.randrange(6)
        fds: list[int] = []
        if roll <= 2:
            fd = _memfd(rng, size)
            fds = [fd]
            if rng.random() < 0.3 and len(self.kept) < 8:
                self.kept.append(os.dup(fd))
        elif roll == 3:
            fds = [_odd_fd(rng)]
        elif roll == 4:
            fds = [_memfd(rng, size), _memfd(rng, size)]
        address = edge(rng, near=(RAM_BASE + RAM_SIZE, FDLESS_BASE, 0x3_0000_0000, 0x100000))
        if rng.random() < 0.6:
            address = 0x3_0000_0000 + rng.randrange(64) * (256 << 10)  # room for many maps that do not overlap
        offset = 0 if rng.random() < 0.5 else edge(rng, near=(size, 4096, 1 << 63))
        length = size if rng.random() < 0.4 else edge(rng, near=(size, 4096, 1 << 63))
        payload = struct.pack("<IIQQQ", rng.choice((32, 32, 0, 16, 0xFFFFFFFF)), edge(rng, 32, near=(1, 2, 3)),
                              offset, address, length)
        return header(rng, CMD.DMA_MAP, payload[:rng.choice((32,) * 9 + (rng.randrange(32),))]), fds, False

    def _unmap(self, rng: random.Random) -> Wire:
        flags = rng.choice((0, 0, 0, p.DMA_UNMAP_ALL, p.DMA_UNMAP_GET_DIRTY, 3, edge(rng, 32)))
        if rng.random() < 0.6:
            address, size = 0x3_0000_0000 + rng.randrange(64) * (256 << 10), rng.choice((4096, 256 << 10, 1 << 30))
        else:
            address, size = edge(rng, near=(RAM_BASE, FDLESS_BASE)), edge(rng, near=(RAM_SIZE,))
        payload = struct.pack("<IIQQ", 24, flags, address, size)
        if flags & p.DMA_UNMAP_GET_DIRTY and rng.random() < 0.5:
            payload += struct.pack("<QI", 4096, 64) + rng.randbytes(rng.choice((0, 8, 64)))
        return header(rng, CMD.DMA_UNMAP, payload[:rng.choice((len(payload),) * 9 + (8,))]), [], False

    def _info(self, rng: random.Random) -> Wire:
        payload = struct.pack("<IIII", edge(rng, 32, near=(16,)), 0, 0, 0)
        return header(rng, CMD.DEVICE_GET_INFO, payload[:rng.choice((16, 16, 0, 4))]), [], False

    def _region_info(self, rng: random.Random) -> Wire:
        payload = p.REGION_INFO.pack(edge(rng, 32, near=(32,)), 0, edge(rng, 32, near=tuple(range(10))), 0, 0, 0)
        return header(rng, CMD.DEVICE_GET_REGION_INFO, payload[:rng.choice((32, 32, 12, 11, 0))]), [], False

    def _irq_info(self, rng: random.Random) -> Wire:
        payload = p.IRQ_INFO.pack(16, 0, edge(rng, 32, near=tuple(range(6))), 0)
        return header(rng, CMD.DEVICE_GET_IRQ_INFO, payload[:rng.choice((16, 16, 12, 11, 0))]), [], False

    def _irqs(self, rng: random.Random) -> Wire:
        data = rng.choice((p.IRQ_DATA_NONE, p.IRQ_DATA_BOOL, p.IRQ_DATA_EVENTFD, p.IRQ_DATA_EVENTFD, 0, 3))
        action = rng.choice((p.IRQ_ACTION_MASK, p.IRQ_ACTION_UNMASK, p.IRQ_ACTION_TRIGGER, p.IRQ_ACTION_TRIGGER, 0, 0x18))
        flags = data | action if rng.random() < 0.9 else edge(rng, 32)
        index = rng.choice((0, 1, 1, 2, 3, 4, 5, edge(rng, 32)))
        start = rng.choice((0, 0, 1, 3, edge(rng, 32, near=(4, 8, 2048))))
        count = rng.choice((0, 1, 1, 2, 4, 8, 9, 16, edge(rng, 32, near=(2048,))))
        fds: list[int] = []
        if data == p.IRQ_DATA_EVENTFD or rng.random() < 0.1:
            n = min(p.MAX_MSG_FDS, count if rng.random() < 0.7 else small(rng, 8))
            fds = [os.eventfd(0, os.EFD_NONBLOCK) if rng.random() < 0.9 else _odd_fd(rng) for _ in range(n)]
            for fd in fds:
                if rng.random() < 0.05:  # saturated: one more signal would block
                    try:
                        os.eventfd_write(fd, 0xFFFF_FFFF_FFFF_FFFE)
                    except OSError:
                        pass
        payload = p.IRQ_SET.pack(20, flags, index, start, count)
        if data == p.IRQ_DATA_BOOL:
            payload += rng.randbytes(min(count, 64) if rng.random() < 0.8 else rng.randrange(4))
        return header(rng, CMD.DEVICE_SET_IRQS, payload[:rng.choice((len(payload),) * 9 + (12,))]), fds, False

    def _where(self, rng: random.Random) -> tuple[int, int, int]:
        region = rng.choice((0, 0, 0, 1, 2, 2, 3, 4, 5, 6, 7, 7, 7, 8, 9, edge(rng, 32)))
        offset = edge(rng, near=REGION_SIZES + (0, 4, 8, 0x10, 0x14, 0x34, 0x1000, 0x1004, 0x3000))
        if rng.random() < 0.5:
            offset = rng.randrange(0x40) & ~3 if region != 7 else rng.randrange(0x100)
        count = rng.choice((1, 2, 4, 4, 4, 8, 3, 0, 16, 4096, edge(rng, 32, near=(4096, p.MAX_DATA_XFER))))
        return region, offset, count

    def _read(self, rng: random.Random) -> Wire:
        region, offset, count = self._where(rng)
        payload = p.REGION_RW.pack(offset, region, count)
        return header(rng, CMD.REGION_READ, payload[:rng.choice((16,) * 9 + (rng.randrange(16),))]), [], False

    def _write(self, rng: random.Random) -> Wire:
        region, offset, count = self._where(rng)
        length = count if count <= 4096 or rng.random() < 0.05 else 8
        if length > p.MAX_DATA_XFER:
            length = 8
        data = rng.randbytes(length) if length <= 64 else bytes(length)
        if rng.random() < 0.1:
            data = data[:-1] if data and rng.random() < 0.5 else data + b"\0"
        payload = p.REGION_RW.pack(offset, region, count) + data
        return header(rng, CMD.REGION_WRITE, payload, no_reply=rng.random() < 0.3), [], False

    def _multi(self, rng: random.Random) -> Wire:
        n = rng.choice((0, 1, 2, 8, 200, 201, edge(rng, 64)))
        entries = []
        for _ in range(min(n, 210)):
            region, offset, _ = self._where(rng)
            entries.append(p.WRITE_ONE.pack(offset, region, rng.choice((1, 2, 4, 8, 0, 9)), rng.randbytes(8)))
        payload = struct.pack("<Q", n) + b"".join(entries)
        if rng.random() < 0.2:
            payload = payload[:rng.randint(0, len(payload))]
        return header(rng, CMD.REGION_WRITE_MULTI, payload, no_reply=rng.random() < 0.8), [], False

    def _reset(self, rng: random.Random) -> Wire:
        return header(rng, CMD.DEVICE_RESET, rng.randbytes(rng.choice((0, 0, 4)))), [], False

    def _other(self, rng: random.Random) -> Wire:
        command = rng.choice((0, 6, 11, 12, 14, 16, 17, 0x100, 0xFFFF, edge(rng, 16)))
        return header(rng, command, rng.randbytes(rng.choice((0, 8, 16, 32, 100)))), [], False

    def _flip(self, rng: random.Random) -> Wire:
        """A valid message with its payload mutated byte by byte (the size kept right)."""
        data, fds, _ = getattr(self, rng.choice(("_map", "_irqs", "_read", "_write", "_version")))(rng)
        payload = mutate_bytes(rng, data[p.HEADER_SIZE:], 8192)
        return data[:4] + struct.pack("<I", p.HEADER_SIZE + len(payload)) + data[8:16] + payload, fds, False

    # --- the device, programmed as a guest driver would (but not as it should) ------------
    def _config_write(self, rng: random.Random, offset: int, value: bytes) -> Wire:
        return header(rng, CMD.REGION_WRITE, p.REGION_RW.pack(offset, p.REGION_CONFIG, len(value)) + value), [], False

    def _bar0(self, offset: int, value: int, size: int = 4, posted: bool = False, region: int = 0) -> Wire:
        payload = p.REGION_RW.pack(offset, region, size) + value.to_bytes(size, "little")
        return p.message(0x7000 + (offset & 0xFFF), CMD.REGION_WRITE, payload, no_reply=posted), [], False

    def _dma_address(self, rng: random.Random) -> int:
        roll = rng.randrange(6)
        if roll <= 2:
            return RAM_BASE + rng.choice((0, 4096, RAM_SIZE - 4096, RAM_SIZE - 1, rng.randrange(RAM_SIZE)))
        if roll == 3:
            return FDLESS_BASE + rng.choice((0, 4096, RAM_SIZE - 1, rng.randrange(RAM_SIZE)))
        if roll == 4:
            return 0x3_0000_0000 + rng.randrange(64) * (256 << 10) + rng.choice((0, 100, 4095))
        return edge(rng)

    def _program_device(self, rng: random.Random):
        if rng.random() < 0.9:
            yield self._config_write(rng, 4, bytes([rng.choice((0x06, 0x06, 0x02, 0x00, 0xFF)), 0]))
        if self.model == "nvme":
            yield from self._nvme(rng)
            return
        if self.model == "accel":
            yield from self._accel(rng)
            return
        src, dst = self._dma_address(rng), self._dma_address(rng)
        length = rng.choice((1, 4, 4096, 64 << 10, 1 << 20, (1 << 20) + 1, 0, edge(rng, 32)))
        for offset, value in ((0x20, src & 0xFFFFFFFF), (0x24, src >> 32), (0x28, dst & 0xFFFFFFFF),
                              (0x2C, dst >> 32), (0x30, length & 0xFFFFFFFF)):
            yield self._bar0(offset, value, posted=rng.random() < 0.5)
        op = rng.choice((1, 2, 3, 0, 4, 0xFF))
        cmd = op | (rng.randrange(256) << 8) | (rng.choice((0, 1)) << 16) | (rng.randrange(16) << 20)
        yield self._bar0(0x34, cmd, posted=rng.random() < 0.5)

    def _nvme(self, rng: random.Random):
        """Admin queues in guest RAM (16 entries: SQ at +0, CQ at +4 KiB), a few commands
        with random fields and PRPs (some into a PRP list of random entries), one doorbell."""
        ram = self.ram
        if rng.random() < 0.5 or ram is None:
            yield self._bar0(0x14, 0)  # CC.EN = 0: a controller reset
            yield self._bar0(0x24, (15 << 16) | 15)
            yield self._bar0(0x28, RAM_BASE, 8)
            yield self._bar0(0x30, RAM_BASE + 0x1000, 8)
            yield self._bar0(0x14, 1 | (6 << 16) | (4 << 20))
            self.sq_tail = 0
        if ram is None:
            return
        n = rng.choice((1, 1, 2, 4, 15))
        tail = self.sq_tail
        for _ in range(n):
            opcode = rng.choice((0x00, 0x01, 0x02, 0x04, 0x05, 0x06, 0x06, 0x08, 0x09, 0x0A, 0x0C, 0x18, 0x7C,
                                 rng.randrange(256)))
            prp1 = self._dma_address(rng)
            prp2 = rng.choice((0, RAM_BASE + 0x2000, RAM_BASE + 0x2000 + rng.choice((8, 4088, 4096)), self._dma_address(rng)))
            entries = [self._dma_address(rng) if rng.random() < 0.5 else RAM_BASE + 0x2000 for _ in range(8)]
            ram[0x2000:0x2040] = struct.pack("<8Q", *entries)
            cdws = [edge(rng, 32, near=(0, 1, 0x10, 0xFF, 0xFFFF)) for _ in range(6)]
            if opcode in (0x01, 0x05) and rng.random() < 0.7:  # create a queue: plausible id, size, flags
                cdws[0] = rng.choice((1, 2, 8, 9)) | (rng.choice((15, 1023, 0, 0xFFFF)) << 16)
                cdws[1] = rng.choice((1, 3)) | (rng.choice((1, 0, 8)) << 16)
            command = struct.pack("<BBHIQQQQ6I", opcode, rng.choice((0, 0, 0x40, 0x80, 0xFF)), rng.randrange(1 << 16),
                                  rng.choice((0, 1, 1, 2, 0xFFFFFFFF)), 0, 0, prp1, prp2, *cdws)
            ram[tail * 64:(tail + 1) * 64] = command
            tail = (tail + 1) % 16
        self.sq_tail = tail
        doorbell = rng.choice((0x1000, 0x1000, 0x1000, 0x1004, 0x1008, 0x100C, 0x1040, 0x1FFC, 0x2000))
        yield self._bar0(doorbell, tail if doorbell == 0x1000 else rng.randrange(1 << 16))
        if rng.random() < 0.3:  # the completion queue's head, as a driver moves it
            yield self._bar0(0x1004, rng.randrange(17))

    def _accel(self, rng: random.Random):
        """The accelerator's ring in guest RAM (enabled again now and then, at sizes valid or
        not), a few entries of any opcode with flags, vectors, dtypes and operands at the
        edges (VRAM offsets and lengths, kernel shapes, guest addresses, scatter lists,
        inline copies whose data runs past the tail), one doorbell; now and then the
        driver's other moves (clear an error, acknowledge or mask causes, reset)."""
        ram = self.ram
        if rng.random() < 0.5 or ram is None or not self.ring[0]:  # (sessions and resets disable it)
            size = rng.choice(ACCEL_RING_ENTRIES)
            yield self._bar0(accel.REG_CONTROL, accel.CONTROL_RESET)
            yield self._bar0(accel.REG_RING_BASE_LO, (RAM_BASE + ACCEL_RING) & 0xFFFFFFFF)
            yield self._bar0(accel.REG_RING_BASE_HI, (RAM_BASE + ACCEL_RING) >> 32)
            yield self._bar0(accel.REG_RING_SIZE, size)
            yield self._bar0(accel.REG_CONTROL, accel.CONTROL_ENABLE)
            self.ring = (size, 0)
        if ram is None:
            return
        size, tail = self.ring
        room = min(size, 1024) if 2 <= size <= 1 << 16 and not size & (size - 1) else 64
        ram[ACCEL_SG:ACCEL_SG + 16 * 8] = b"".join(
            struct.pack("<QQ", self._dma_address(rng), rng.choice((4, 4096, 4096, 0, 64 << 10, edge(rng, 32))))
            for _ in range(8))
        for _ in range(rng.choice((1, 1, 2, 4, 15))):
            for entry in self._accel_entry(rng):
                ram[ACCEL_RING + (tail % room) * 64:ACCEL_RING + (tail % room + 1) * 64] = entry
                tail += 1
        self.ring = (size, tail % max(size, 1))
        if rng.random() < 0.5:  # a refused entry stops the ring until the driver clears it
            yield self._bar0(accel.REG_ERROR_CLEAR, 1)
        doorbell = tail % max(size, 1) if rng.random() < 0.9 else edge(rng, 32)
        yield self._bar0(accel.REG_DOORBELL, doorbell, posted=rng.random() < 0.7)
        roll = rng.random()
        if roll < 0.2:
            yield self._bar0(accel.REG_ERROR_CLEAR, rng.choice((1, 0, edge(rng, 32))))
        elif roll < 0.3:
            yield self._bar0(accel.REG_IRQ_CAUSE, edge(rng, 32))
        elif roll < 0.35:
            yield self._bar0(accel.REG_IRQ_MASK, edge(rng, 32))
        elif roll < 0.4:
            yield self._bar0(accel.REG_CONTROL, rng.choice((0, accel.CONTROL_RESET, edge(rng, 32))))

    def _accel_entry(self, rng: random.Random) -> list[bytes]:
        """One command entry (and, for an inline copy, the entries its data takes)."""
        plausible = rng.random() < 0.6  # operands a driver would give (so the kernels run), or edges

        def vram() -> int:
            if plausible:
                return rng.randrange(ACCEL_VRAM // 4096) * 4096
            return rng.choice((0, 64, 4096, ACCEL_VRAM // 2, ACCEL_VRAM - 4, ACCEL_VRAM - 4096, ACCEL_VRAM,
                               rng.randrange(ACCEL_VRAM) & ~3, edge(rng)))

        def dim() -> int:
            if plausible:
                return rng.choice((1, 2, 7, 16, 64, 100))
            return rng.choice((1, 7, 64, 256, 1024, 0, accel.MAX_DIM, accel.MAX_DIM + 1, edge(rng)))

        def host() -> int:  # guest RAM above the ring, or any address the fuzzer picks
            if plausible:
                return RAM_BASE + ACCEL_DATA + rng.randrange((RAM_SIZE - ACCEL_DATA - (64 << 10)) // 4096) * 4096
            return self._dma_address(rng)

        def length() -> int:
            if plausible:
                return rng.choice((4, 64, 4096, 12288, 64 << 10))
            return rng.choice((0, 1, 4, 64, 4096, 64 << 10, 1 << 20, ACCEL_VRAM, edge(rng)))

        opcode = rng.choice(sorted(accel.OPCODES) * 3 + ([] if plausible else [rng.randrange(256)]))
        flags = rng.choice((0, 0, accel.FLAG_INTERRUPT, accel.FLAG_SG, accel.FLAG_ACCUMULATE | accel.FLAG_TRANS_A,
                            accel.FLAG_TRANS_B, accel.FLAG_AFFINE) + (() if plausible else (rng.randrange(256),)))
        vector = rng.choice((0, 0, 1, 3) + (() if plausible else (4, 255)))
        dtype = rng.choice((accel.DTYPE_F32, accel.DTYPE_F32, accel.DTYPE_BF16) + (() if plausible else (2, 255)))
        args = [vram(), vram(), vram(), dim(), dim(), dim(), edge(rng)]
        if opcode in (accel.OP_COPY_H2D, accel.OP_COPY_D2H):
            if flags & accel.FLAG_SG:
                args[:2] = [RAM_BASE + ACCEL_SG + rng.choice((0, 16, 8, 4096)) if rng.random() < 0.8
                            else self._dma_address(rng), rng.choice((1, 3, 8) if plausible else
                                                                     (0, 8, accel.MAX_SG, accel.MAX_SG + 1, edge(rng)))]
            else:
                args[:2] = [host(), length()]
        elif opcode in (accel.OP_COPY_D2D, accel.OP_FILL):
            args[1 if opcode == accel.OP_FILL else 2] = length()
        elif opcode in (accel.OP_FENCE, accel.OP_TIMESTAMP):
            args[0] = host()
        elif opcode == accel.OP_LAYER_NORM:
            args[6] = rng.choice((0, 0x3727C5AC, 0x7FC00000, 0xFF800000, edge(rng, 32)))  # eps: 1e-5, NaN, -inf
        elif opcode == accel.OP_AXPY:
            args[4] = rng.choice((0x3F800000, 0x7F800000, edge(rng, 32)))  # alpha: 1.0, inf
        if opcode != accel.OP_COPY_INLINE:
            return [accel.ENTRY.pack(opcode, flags, vector, dtype, 0, *(a & (1 << 64) - 1 for a in args))]
        n = rng.choice((0, 1, 63, 64, 65, 4096, accel.MAX_INLINE, accel.MAX_INLINE + 1, edge(rng, 32)))
        entries = [accel.ENTRY.pack(opcode, flags, vector, dtype, 0, args[0] & (1 << 64) - 1, n, 0, 0, 0, 0, 0)]
        data = min((n + 63) // 64, rng.choice((0, 1, 3, 40)))  # the data: whole, short or none before the tail
        return entries + [rng.randbytes(64) for _ in range(data)]
