"""One client's session of a vfio-user server: its reader thread, DMA table and eventfds.

The session thread handles QEMU's requests in order (so a read never passes an earlier
write) and routes the replies to our own DMA_READ/DMA_WRITE requests to the device thread
that waits for them. A reply to a region access is therefore never held up by a DMA in
flight.

A device with an ``event_source`` (the host proxy's link to a GPU box) gets its events
served by the session thread too, while it waits for QEMU: the thread that waits for a
link completion is then the thread that receives it, with no hand-off between threads.
A device with a ``native_forward``, with QEMU on a native stream, has its region accesses
forwarded in C until something needs Python.

Posted writes (REGION_WRITE without reply, REGION_WRITE_MULTI) are combined into runs
(:mod:`.posted`) and given to the device before any other request and whenever no
further message is already buffered, so they are never reordered and never wait for
more traffic; the device's ``posted_idle`` is called then too (the host proxy's link sends
what it coalesced).

The client is not trusted: a message may carry only the descriptors its command takes
(:data:`~.handlers.FDS_ALLOWED`), the session holds at most ``MAX_DMA_MAPS`` mappings (each
keeps a descriptor), and a malformed message gets an error reply (EINVAL, EPROTO...) and
the session goes on; only a stream whose framing is lost ends it. At its end every
descriptor, mapping and thread of the session is released, a device that was told of
QEMU's DMA windows has them all unmapped (``DMA_UNMAP_ALL``), and the device is reset, so
the next ``device_add`` (replug) starts clean.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import select
import threading
import time
from typing import Protocol

from dxpu_vfio.native import stream as native
from dxpu_vfio.vfio_user import protocol as p
from dxpu_vfio.vfio_user.connection import PEER_CLOSED, Connection, ConnectionClosed, Message
from dxpu_vfio.vfio_user.device_api import EventSource, NativeForward, VfioDevice, irq_vector_counts
from dxpu_vfio.vfio_user.dma import DmaTable
from dxpu_vfio.vfio_user.handlers import FDS_ALLOWED, Handler, Reply, ServerOptions, command_name
from dxpu_vfio.vfio_user.irq import EventfdIrqs
from dxpu_vfio.vfio_user.posted import WriteRuns
from qemu_device.ports import DmaError, NullDmaPort, NullIrqPort

log = logging.getLogger("dxpu.vfio_user.server")

DMA_REPLY_TIMEOUT = 5.0
MAX_DMA_MAPS = 256  # advertised as max_dma_maps; each fd-backed map holds a descriptor (QEMU uses a few)


class SessionOwner(Protocol):
    """What a session uses of the server that accepted it (:class:`~.server.VfioUserServer`)."""

    device: VfioDevice
    name: str  # in logs and thread names
    options: ServerOptions
    handlers: dict[int, Handler]  # by command number: the session's one dispatch
    protocol_errors: int  # counters the session adds to
    posted_refused: int

    def record(self, command: int, ns: int, error: bool) -> None:
        """One request handled, in ``ns`` of the server's own work."""

    def session_ended(self, session: "Session") -> None:
        """The session released everything it held; the next client may come."""


class Session:
    """One client connection: its DMA table, its eventfds, its reader thread."""

    def __init__(self, server: SessionOwner, conn: Connection) -> None:
        self.server = server
        self.device = server.device
        self.options = server.options
        self.conn = conn
        self.dma = DmaTable(fallback=self._dma_by_message, max_maps=MAX_DMA_MAPS)
        self.irqs = EventfdIrqs(irq_vector_counts(server.device))
        self._ids = itertools.count(0x8000)  # our requests; QEMU numbers its own
        self._pending: dict[int, tuple[threading.Event, list]] = {}
        self._pending_lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=f"vfio-user-{server.name}",
                                       daemon=True)
        self.version_seen = False
        self.windows_told = False  # the device was told of a DMA window (dma_mapped)
        self.mapped_regions: set[int] = set()  # regions offered to QEMU as mappable (with their memfd)
        self.forwarder = None  # the native Forwarder that served this session, if one did (its counters)
        self._event_poll: select.poll | None = None  # QEMU's socket + the device's event source
        self._events_fd = 0
        # posted writes not yet given to the device; glued together only for a device that
        # asks (its posted writes go to memory, e.g. a framebuffer)
        self.posted = WriteRuns(merge=server.device.coalesce_posted)

    # --- reader loop ---------------------------------------------------------------------
    def _run(self) -> None:
        device = self.device
        device.vmm_masks_msix = True  # QEMU keeps the MSI-X table and masks vectors itself
        device.attach(self.dma, self.irqs)
        posted_commands = (p.Command.REGION_WRITE, p.Command.REGION_WRITE_MULTI)
        source: EventSource | None = device.event_source
        if source is not None:
            source.claim()
        forward: NativeForward | None = device.native_forward if self.conn.native else None
        forwarder = None
        try:
            while True:
                if forwarder is None and forward is not None and self.version_seen:
                    forwarder = self._start_forwarder(forward)
                if forwarder is not None:
                    msg, keep = self._forward_until_python(forwarder, forward)
                    if not keep:  # the link is down: the Python path answers from now on
                        forward.forwarding(None)
                        forwarder = forward = None
                    if msg is not None:
                        self._handle_for_forwarder(msg, forwarder)
                    continue
                if self.posted and not self.conn.has_message():
                    self._flush_posted(idle=True)  # about to wait: nothing may linger
                if source is not None and not self.conn.has_message():
                    self._serve_events_until_client(source)
                try:
                    msg = self.conn.receive()
                except p.ProtocolError as exc:
                    log.warning("%s: dropping client: %s", self.server.name, exc)
                    self.server.protocol_errors += 1
                    break
                hdr = msg.header
                if hdr.is_reply:
                    self._complete(msg)
                    continue
                if hdr.no_reply and hdr.command in posted_commands and self.version_seen:
                    self._add_posted(msg)
                    continue
                if self.posted:
                    self._flush_posted(idle=False)  # a later request never passes them
                self._handle(msg)
        except ConnectionClosed as exc:
            if str(exc) != PEER_CLOSED and not self.conn.closed:  # the stream broke: say why
                log.warning("%s: session ended: %s", self.server.name, exc)
        finally:
            if forward is not None:
                forward.forwarding(None)
            if self.posted:
                self._flush_posted(idle=True)
            if source is not None:
                source.release()
            device.attach(NullDmaPort(), NullIrqPort())
            self._fail_pending()
            self.irqs.close()
            self.dma.clear()
            if self.windows_told:  # the device passed QEMU's windows on: they end with the session
                try:
                    device.dma_unmapped(0, 0, p.DMA_UNMAP_ALL)
                except Exception as exc:  # noqa: BLE001 - the session ends either way
                    log.info("%s: unmapping the session's DMA windows failed: %s", self.server.name, exc)
            self.conn.close()
            with device.lock:
                device.reset()
            self.server.session_ended(self)

    # --- the native forwarder (a device with native_forward, QEMU on a native stream) ------
    def _start_forwarder(self, forward: NativeForward):
        forwarder = native.require().Forwarder(self.conn.stream, forward.link_stream, forward.completion_timeout,
                                               read_spin_us=forward.read_spin_us)
        self.forwarder = forwarder
        self._refresh_forwarder(forwarder)
        forward.forwarding(forwarder)
        return forwarder

    def _refresh_forwarder(self, forwarder) -> None:
        """The forwarder borrows the DMA table's memfds and the eventfds: after anything
        Python handled (DMA_MAP, DMA_UNMAP, SET_IRQS...) it gets the tables again."""
        forwarder.set_windows(self.dma.native_windows())
        forwarder.set_irqs(self.irqs.vector_fds(p.IRQ_MSI), self.irqs.vector_fds(p.IRQ_MSIX))

    def _forward_until_python(self, forwarder, forward: NativeForward) -> tuple[Message | None, bool]:
        """Let the forwarder serve until something needs Python: (the QEMU message it left,
        or None; whether it may go on forwarding)."""
        what = forwarder.serve()
        kind = what[0]
        if kind == "qemu":
            return _message(what[1]), True
        if kind == "link":
            forward.deliver(what[1])
            return None, True
        if kind == "timeout":  # an access (or SYNC) without completion: Python answers it (all-ones)
            if what[2]:
                forward.deliver(what[2])
            forward.link_failed("completion timeout", timeout=True)
            return (_message(what[1]) if what[1] is not None else None), False
        if kind == "link-closed":  # a QEMU message in progress stays buffered for Python
            if len(what) > 2 and what[2]:
                forward.deliver(what[2])
            forward.link_failed(what[1], timeout=False)
            return None, False
        raise ConnectionClosed(what[1])  # qemu-closed

    def _handle_for_forwarder(self, msg: Message, forwarder) -> None:
        """A QEMU message the forwarder left to Python: handled as always, then the
        forwarder (if it goes on) sees the tables it may have changed."""
        if msg.header.is_reply:
            self._complete(msg)
            return
        self._handle(msg)
        if forwarder is not None:
            self._refresh_forwarder(forwarder)

    def _serve_events_until_client(self, source: EventSource) -> None:
        """Serve the device's events until QEMU has something for us."""
        client, events = self.conn.fileno(), source.fileno()
        if client < 0:
            raise ConnectionClosed("the server closed this session")
        poller = self._event_poll
        if poller is None:
            poller = self._event_poll = select.poll()
            poller.register(client, select.POLLIN)
            if events >= 0:
                poller.register(events, select.POLLIN)
        elif self._events_fd < 0:
            events = -1
        while True:
            if source.ready():
                source.service()
            ready = dict(poller.poll(0 if source.ready() else -1))
            if events in ready:
                if ready[events] & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                    poller.unregister(events)  # the link closed: nothing more will come from it
                    events = self._events_fd = -1
                source.service()
            if client in ready:
                return

    def _handle(self, msg: Message) -> None:
        """Answer one request. The time recorded is the server's own work (decode, device,
        encode), not the send: a send may switch to the woken peer before it returns."""
        hdr = msg.header
        started = time.perf_counter_ns()
        out: bytes | None = None
        reply_fds: list[int] = []  # sent with the reply (a mappable region's memory); we keep them open
        error = False
        try:
            handler = self.server.handlers.get(hdr.command)
            if handler is None:
                raise p.ProtocolError(f"unknown command {hdr.command}", errno.ENOSYS)
            if not self.version_seen and hdr.command != p.Command.VERSION:
                raise p.ProtocolError("VERSION must come first", errno.EPROTO)
            if len(msg.fds) > FDS_ALLOWED.get(hdr.command, 0):
                raise p.ProtocolError(f"{command_name(hdr.command)} carries {len(msg.fds)} descriptors; it takes "
                                      f"{FDS_ALLOWED.get(hdr.command, 0)}")
            reply = handler(self, msg)
            if isinstance(reply, Reply):
                reply, reply_fds = reply.payload, reply.fds
            if not hdr.no_reply:
                out = p.message(hdr.msg_id, hdr.command, reply or b"", reply=True)
        except (p.ProtocolError, ValueError, DmaError, OSError, OverflowError, RecursionError) as exc:
            error = True
            err = getattr(exc, "errno", None) or (errno.EFAULT if isinstance(exc, DmaError) else errno.EINVAL)
            log.info("%s: %s failed: %s", self.server.name, command_name(hdr.command), exc)
            self.server.protocol_errors += isinstance(exc, p.ProtocolError)
            if not hdr.no_reply:
                out = p.error_reply(hdr.msg_id, hdr.command, err)
        except Exception:  # noqa: BLE001 - a bug here: logged, answered, and the session goes on
            error = True
            log.exception("%s: %s failed", self.server.name, command_name(hdr.command))
            if not hdr.no_reply:
                out = p.error_reply(hdr.msg_id, hdr.command, errno.EIO)
        finally:
            msg.close_fds()
        self.server.record(hdr.command, time.perf_counter_ns() - started, error)
        if out is not None:
            self.conn.send(out, reply_fds if not error else None)

    def _add_posted(self, msg: Message) -> None:
        started = time.perf_counter_ns()
        error, full = False, False
        try:
            if msg.fds:
                raise p.ProtocolError(f"posted {command_name(msg.header.command)} carries descriptors")
            if msg.header.command == p.Command.REGION_WRITE:
                req = msg.payload
                if len(req) < p.REGION_RW.size:
                    raise p.ProtocolError(f"REGION_WRITE payload of {len(req)} bytes")
                offset, region, count = p.REGION_RW.unpack_from(req)
                if count == 0 or len(req) != p.REGION_RW.size + count:
                    raise p.ProtocolError(f"REGION_WRITE count {count} but {len(req) - p.REGION_RW.size} data bytes")
                full = self.posted.add(region, offset, req[p.REGION_RW.size:])
            else:
                full = self.posted.add_multi(msg.payload)
        except p.ProtocolError as exc:
            error = True
            self.server.protocol_errors += 1
            log.info("%s: posted %s dropped: %s", self.server.name, command_name(msg.header.command), exc)
        finally:
            msg.close_fds()
        self.server.record(msg.header.command, time.perf_counter_ns() - started, error)
        if full:
            self._flush_posted(idle=False)

    def _flush_posted(self, idle: bool) -> None:
        """Give the pending posted writes to the device, in order; a write the device
        refuses is dropped and logged, like a posted write to nowhere on PCIe."""
        device = self.device
        with device.lock:
            for region, offset, data in self.posted.take():
                try:
                    device.region_write(region, offset, data, posted=True)
                except (ValueError, DmaError, OSError) as exc:
                    self.server.posted_refused += 1
                    log.info("%s: posted write to region %d+%#x refused: %s", self.server.name, region, offset, exc)
        if idle:
            device.posted_idle()

    # --- our requests to QEMU (DMA without a descriptor) ---------------------------------
    def _dma_by_message(self, address: int, what: int | bytes, write: bool) -> bytes | None:
        if threading.current_thread() is self.thread:
            raise DmaError("message DMA from the reader thread would deadlock")
        out = bytearray()
        total = len(what) if write else what
        for pos in range(0, total, p.MAX_DATA_XFER):
            n = min(p.MAX_DATA_XFER, total - pos)
            if write:
                req = p.DmaAccess(address + pos, n, bytes(what[pos:pos + n])).pack()
                self._request(p.Command.DMA_WRITE, req)
            else:
                reply = self._request(p.Command.DMA_READ, p.DmaAccess(address + pos, n).pack())
                try:
                    out += p.DmaAccess.answer(reply, address + pos, n)
                except p.ProtocolError as exc:
                    raise DmaError(f"client's DMA_READ reply: {exc}") from exc
        return bytes(out) if not write else None

    def _request(self, command: int, payload: bytes) -> memoryview:
        msg_id = next(self._ids) & 0xFFFF
        done: tuple[threading.Event, list] = (threading.Event(), [])
        with self._pending_lock:
            self._pending[msg_id] = done
        try:
            self.conn.send(p.message(msg_id, command, payload))
        except ConnectionClosed as exc:
            raise DmaError(f"client gone: {exc}") from exc
        if not done[0].wait(DMA_REPLY_TIMEOUT):
            with self._pending_lock:
                self._pending.pop(msg_id, None)
            raise DmaError(f"{command_name(command)} got no reply in {DMA_REPLY_TIMEOUT} s")
        reply: Message | None = done[1][0] if done[1] else None
        if reply is None:
            raise DmaError("client disconnected during DMA")
        if reply.header.is_error:
            raise DmaError(f"{command_name(command)} refused by the client: "
                           f"{os.strerror(reply.header.error)}")
        return reply.payload

    def _complete(self, msg: Message) -> None:
        with self._pending_lock:
            waiter = self._pending.pop(msg.header.msg_id, None)
        msg.close_fds()
        if waiter is None:
            log.info("%s: unexpected reply id %d", self.server.name, msg.header.msg_id)
            return
        waiter[1].append(msg)
        waiter[0].set()

    def _fail_pending(self) -> None:
        with self._pending_lock:
            waiters, self._pending = list(self._pending.values()), {}
        for event, _ in waiters:
            event.set()


def _message(got: tuple) -> Message:
    """A message the native forwarder returned: (msg_id, command, flags, error, payload, fds)."""
    msg_id, command, flags, error, payload, fds = got
    return Message(p.Header(msg_id, command, p.HEADER_SIZE + len(payload), flags, error), memoryview(payload), fds)
