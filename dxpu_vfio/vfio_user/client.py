"""A vfio-user client: the QEMU side of the protocol, in Python.

Used to drive vfio-user servers without a VM (tests of our server, and the remote
proxy driving an external server). Guest memory is whatever the caller maps with
:meth:`VfioUserClient.dma_map`; the server's DMA_READ/DMA_WRITE requests for windows
mapped without a descriptor are answered from ``memory`` (a writable buffer).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import queue
import socket
import threading
from pathlib import Path
from typing import Callable

from dxpu_vfio.vfio_user import protocol as p
from dxpu_vfio.vfio_user.connection import Connection, ConnectionClosed, Message


class ClientError(Exception):
    """The server answered with an error (``errno``) or went away."""

    def __init__(self, message: str, err: int = errno.EIO) -> None:
        super().__init__(message)
        self.errno = err


DmaHandler = Callable[[int, "int | bytes", bool], "bytes | None"]


class VfioUserClient:
    """``dma_handler(address, count_or_data, write)`` answers the server's DMA requests
    instead of ``memory``; it runs on a worker thread of its own (in order), so the
    reader thread keeps delivering region replies while a DMA waits elsewhere."""

    def __init__(self, path: Path, *, timeout: float = 5.0, dma_handler: DmaHandler | None = None,
                 on_close: Callable[[str], None] | None = None) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(path))
        except OSError:
            sock.close()
            raise
        self.on_close = on_close  # called once (on the reader thread) when the server ends the session
        self.closed_reason: str | None = None  # why the session ended (None: it has not)
        self._closing = False
        self.conn = Connection(sock)
        self.timeout = timeout
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[threading.Event, list]] = {}
        self._lock = threading.Lock()
        self.memory: dict[int, bytearray] = {}  # address -> buffer, for fd-less windows
        self.dma_requests = 0
        self.server_caps: dict = {}
        self._dma_handler = dma_handler
        self._dma_queue: queue.Queue = queue.Queue()
        if dma_handler is not None:
            threading.Thread(target=self._dma_loop, daemon=True, name="vfio-user-client-dma").start()
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name="vfio-user-client")
        self._reader.start()

    # --- plumbing ----------------------------------------------------------------------
    def _read_loop(self) -> None:
        try:
            while True:
                msg = self.conn.receive()
                if msg.header.is_reply:
                    with self._lock:
                        waiter = self._pending.pop(msg.header.msg_id, None)
                    if waiter:
                        waiter[1].append(msg)
                        waiter[0].set()
                    else:
                        msg.close_fds()
                elif self._dma_handler is not None:
                    self._dma_queue.put(msg)
                else:
                    self._serve_dma(msg)
        except (ConnectionClosed, p.ProtocolError, OSError) as exc:
            self.closed_reason = "closed by us" if self._closing else f"the server closed the connection ({exc})"
        finally:
            if self.closed_reason is None:
                self.closed_reason = "the client's reader failed"
            self._dma_queue.put(None)
            with self._lock:
                waiters, self._pending = list(self._pending.values()), {}
            for event, _ in waiters:
                event.set()
            if self.on_close is not None and not self._closing:  # after the waiters are free
                try:
                    self.on_close(self.closed_reason)
                except Exception:  # noqa: BLE001 - a callback's failure must not hide the close
                    logging.getLogger("dxpu.vfio_user").exception("on_close callback failed")

    def _find(self, address: int, count: int) -> tuple[bytearray, int]:
        for base, buf in self.memory.items():
            if base <= address and address + count <= base + len(buf):
                return buf, address - base
        raise ClientError(f"DMA {address:#x}+{count} outside client memory", errno.EFAULT)

    def _serve_dma(self, msg: Message) -> None:
        hdr = msg.header
        self.dma_requests += 1
        try:
            if hdr.command == p.Command.DMA_READ:
                req = p.DmaAccess.unpack(msg.payload, with_data=False)
                buf, off = self._find(req.address, req.count)
                reply = p.DmaAccess(req.address, req.count, bytes(buf[off:off + req.count])).pack()
            elif hdr.command == p.Command.DMA_WRITE:
                req = p.DmaAccess.unpack(msg.payload, with_data=True)
                buf, off = self._find(req.address, req.count)
                buf[off:off + req.count] = req.data
                reply = p.DmaAccess(req.address, req.count).pack()
            else:
                raise ClientError(f"server sent command {hdr.command}", errno.ENOSYS)
            self.conn.send(p.message(hdr.msg_id, hdr.command, reply, reply=True))
        except (ClientError, p.ProtocolError) as exc:
            self.conn.send(p.error_reply(hdr.msg_id, hdr.command, getattr(exc, "errno", errno.EINVAL)))

    def _dma_loop(self) -> None:
        while (msg := self._dma_queue.get()) is not None:
            hdr = msg.header
            try:
                if hdr.command == p.Command.DMA_READ:
                    req = p.DmaAccess.unpack(msg.payload, with_data=False)
                    data = self._dma_handler(req.address, req.count, False)
                    reply = p.DmaAccess(req.address, req.count, data).pack()
                elif hdr.command == p.Command.DMA_WRITE:
                    req = p.DmaAccess.unpack(msg.payload, with_data=True)
                    self._dma_handler(req.address, req.data, True)
                    reply = p.DmaAccess(req.address, req.count).pack()
                else:
                    raise ClientError(f"server sent command {hdr.command}", errno.ENOSYS)
                if not hdr.no_reply:
                    self.conn.send(p.message(hdr.msg_id, hdr.command, reply, reply=True))
            except ConnectionClosed:
                return
            except Exception as exc:  # noqa: BLE001 - any refusal becomes an error reply
                if not hdr.no_reply:
                    try:
                        self.conn.send(p.error_reply(hdr.msg_id, hdr.command, getattr(exc, "errno", None) or errno.EFAULT))
                    except ConnectionClosed:
                        return

    def request(self, command: int, payload: bytes = b"", fds: list[int] | None = None,
                no_reply: bool = False) -> memoryview | None:
        """Send a request and return its reply's payload (descriptors with it are closed)."""
        reply = self.request_message(command, payload, fds, no_reply)
        if reply is None:
            return None
        reply.close_fds()
        return reply.payload

    def request_message(self, command: int, payload: bytes = b"", fds: list[int] | None = None,
                        no_reply: bool = False) -> Message | None:
        """Send a request and return its whole reply, descriptors included (the caller's)."""
        msg_id = next(self._ids) & 0xFFFF
        waiter: tuple[threading.Event, list] = (threading.Event(), [])
        with self._lock:
            if self.closed_reason is not None:
                raise ClientError(f"the session is over: {self.closed_reason}", errno.ECONNRESET)
            if not no_reply:
                self._pending[msg_id] = waiter
        try:
            self.conn.send(p.message(msg_id, command, payload, no_reply=no_reply), fds)
        except (ConnectionClosed, OSError) as exc:
            with self._lock:
                self._pending.pop(msg_id, None)
            raise ClientError(f"server closed the connection ({exc})", errno.ECONNRESET) from exc
        if no_reply:
            return None
        if not waiter[0].wait(self.timeout):
            raise ClientError(f"no reply to command {command} in {self.timeout} s", errno.ETIMEDOUT)
        if not waiter[1]:
            raise ClientError("server closed the connection", errno.ECONNRESET)
        reply: Message = waiter[1][0]
        if reply.header.is_error:
            reply.close_fds()
            raise ClientError(f"command {command}: {os.strerror(reply.header.error)}", reply.header.error)
        return reply

    # --- the protocol ----------------------------------------------------------------
    def negotiate(self, caps: dict | None = None) -> dict:
        caps = caps if caps is not None else {"max_msg_fds": p.MAX_MSG_FDS, "max_data_xfer_size": p.MAX_DATA_XFER}
        reply = self.request(p.Command.VERSION, p.Version(0, 0, caps).pack())
        self.server_caps = p.Version.unpack(reply).capabilities
        return self.server_caps

    def dma_map(self, address: int, size: int, *, fd: int | None = None, offset: int = 0,
                flags: int = p.DMA_FLAG_READ | p.DMA_FLAG_WRITE) -> None:
        if fd is None and self._dma_handler is None:
            self.memory.setdefault(address, bytearray(size))
        self.request(p.Command.DMA_MAP, p.DmaMap(flags, offset, address, size).pack(),
                     [fd] if fd is not None else None)

    def dma_unmap(self, address: int, size: int) -> None:
        self.request(p.Command.DMA_UNMAP, p.DmaUnmap(0, address, size).pack())
        self.memory.pop(address, None)

    def device_info(self) -> tuple[int, int, int]:
        reply = self.request(p.Command.DEVICE_GET_INFO, p.DEVICE_INFO.pack(p.DEVICE_INFO.size, 0, 0, 0))
        _argsz, flags, regions, irqs = p.DEVICE_INFO.unpack_from(reply)
        return flags, regions, irqs

    def region_info(self, index: int) -> tuple[int, int]:
        """(size, flags) of region ``index``."""
        reply = self.request(p.Command.DEVICE_GET_REGION_INFO,
                             p.REGION_INFO.pack(p.REGION_INFO.size, 0, index, 0, 0, 0))
        _argsz, flags, _index, _cap, size, _offset = p.REGION_INFO.unpack_from(reply)
        return size, flags

    def region_mapping(self, index: int) -> tuple[int, int, int, list[tuple[int, int]] | None, int | None]:
        """(size, flags, fd offset, sparse-mmap areas or None, fd or None) of region
        ``index``, asked the way QEMU asks: 32 bytes first, again with the ``argsz`` the
        server says it needs. The fd is the caller's to close."""
        argsz = p.REGION_INFO.size
        for _ in range(2):
            reply = self.request_message(p.Command.DEVICE_GET_REGION_INFO,
                                         p.REGION_INFO.pack(argsz, 0, index, 0, 0, 0))
            if len(reply.payload) > argsz:
                reply.close_fds()
                raise ClientError(f"region info of {len(reply.payload)} bytes for argsz {argsz}", errno.E2BIG)
            needed, flags, _index, _cap, size, offset = p.REGION_INFO.unpack_from(reply.payload)
            fd = reply.fds.pop() if reply.fds else None
            reply.close_fds()
            if needed <= argsz:
                return size, flags, offset, p.unpack_sparse_areas(reply.payload), fd
            if fd is not None:
                os.close(fd)  # as QEMU: the descriptor of the short answer is dropped
            argsz = needed
        raise ClientError(f"region {index}: the server wants ever more argsz", errno.EPROTO)

    def irq_info(self, index: int) -> tuple[int, int]:
        """(count, flags) of irq ``index``."""
        reply = self.request(p.Command.DEVICE_GET_IRQ_INFO, p.IRQ_INFO.pack(p.IRQ_INFO.size, 0, index, 0))
        _argsz, flags, _index, count = p.IRQ_INFO.unpack_from(reply)
        return count, flags

    def set_irqs(self, index: int, fds: list[int], start: int = 0) -> None:
        flags = p.IRQ_DATA_EVENTFD | p.IRQ_ACTION_TRIGGER
        self.request(p.Command.DEVICE_SET_IRQS, p.SetIrqs(flags, index, start, len(fds)).pack(), fds)

    def read(self, region: int, offset: int, count: int) -> bytes:
        """The bytes the server answers; ClientError (EPROTO) for a reply that is not this
        read's (unparsable, or of another region, offset or size): a caller that passes the
        bytes on (a box, to a host) must never pass on other bytes than were asked for."""
        reply = self.request(p.Command.REGION_READ, p.RegionAccess(region, offset, count).pack())
        try:
            got = p.RegionAccess.unpack(reply, write=True)
        except p.ProtocolError as exc:
            raise ClientError(f"malformed reply to a read of region {region}+{offset:#x}: {exc}", errno.EPROTO) from exc
        if (got.region, got.offset, got.count) != (region, offset, count):
            raise ClientError(f"the reply to a read of {count} bytes at region {region}+{offset:#x} is "
                              f"{got.count} bytes at region {got.region}+{got.offset:#x}", errno.EPROTO)
        return bytes(got.data)

    def write(self, region: int, offset: int, data: bytes, posted: bool = False) -> None:
        self.request(p.Command.REGION_WRITE, p.RegionAccess(region, offset, len(data), data).pack(),
                     no_reply=posted)

    def read32(self, region: int, offset: int) -> int:
        return int.from_bytes(self.read(region, offset, 4), "little")

    def write32(self, region: int, offset: int, value: int, posted: bool = False) -> None:
        self.write(region, offset, value.to_bytes(4, "little"), posted)

    def reset(self) -> None:
        self.request(p.Command.DEVICE_RESET)

    def close(self) -> None:
        self._closing = True
        self.conn.close()
        self._reader.join(5)
