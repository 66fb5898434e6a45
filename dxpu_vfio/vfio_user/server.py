"""A vfio-user server endpoint: one device, one UNIX socket, one client at a time.

QEMU's ``vfio-user-pci`` connects (inside ``device_add``), negotiates, maps guest
memory, and then sends config and region accesses; the device answers through this
endpoint and reaches guest memory and interrupts through the ports the endpoint gives
it (:class:`DmaTable`, :class:`EventfdIrqs`). After the client goes (unplug, or QEMU
died) every descriptor, mapping and thread of that session is released and the device
is reset, so the next ``device_add`` (replug) starts clean.

Threads: an accept thread, and one reader thread per session that handles QEMU's
requests in order (so a read never passes an earlier write) and routes the replies to
our own DMA_READ/DMA_WRITE requests to the device thread that waits for them. A reply
to a region access is therefore never held up by a DMA in flight.

A device with an ``event_source`` (the host proxy's link to a GPU box) gets its events
served by the session thread too, while it waits for QEMU: the thread that waits for a
link completion is then the thread that receives it, with no hand-off between threads.

Posted writes (REGION_WRITE without reply, REGION_WRITE_MULTI) are combined into runs
(:mod:`.posted`) and given to the device before any other request and whenever no
further message is already buffered, so they are never reordered and never wait for
more traffic; the device's ``posted_idle`` is called then too (the host proxy's link sends
what it coalesced).

The client is not trusted: a message may carry only the descriptors its command takes
(DMA_MAP one, SET_IRQS one eventfd per vector, nothing else any), a session holds at
most ``MAX_DMA_MAPS`` mappings (each keeps a descriptor), and a malformed message gets an
error reply (EINVAL, EPROTO...) and the session goes on; only a stream whose framing
is lost ends it. The accept loop survives ``accept()`` errors (e.g. EMFILE). A window
above ``max_dma_window`` (8 TiB, libvfio-user's limit) is refused.

A device that passes QEMU's DMA windows on (the host proxy's link to a box's external
server) has ``dma_mapped(address, size, flags)`` and ``dma_unmapped(address, size, flags)``:
called once the table changed; a refused map is undone and is QEMU's error, and the
session's end unmaps everything (``DMA_UNMAP_ALL``).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import select
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from dxpu_vfio.native import stream as native
from dxpu_vfio.vfio_user import protocol as p
from dxpu_vfio.vfio_user.connection import Connection, ConnectionClosed, Message, close_listener
from dxpu_vfio.vfio_user.dma import DmaTable
from dxpu_vfio.vfio_user.irq import EventfdIrqs
from dxpu_vfio.vfio_user.posted import WriteRuns
from qemu_device.ports import DmaError, NullDmaPort, NullIrqPort

log = logging.getLogger("dxpu.vfio_user.server")

DMA_REPLY_TIMEOUT = 5.0
MAX_DMA_WINDOW = 8 << 40  # bytes: libvfio-user's MAX_DMA_SIZE
MAX_DMA_MAPS = 256  # advertised as max_dma_maps; each fd-backed map holds a descriptor (QEMU uses a few)
ACCEPT_RETRY = 0.1  # seconds to wait after an accept() error before the next accept
FDS_ALLOWED = {p.Command.DMA_MAP: 1, p.Command.DEVICE_SET_IRQS: p.MAX_MSG_FDS}  # every other command: none


class EventSource(Protocol):
    """A device's own descriptor of events, served by the session thread (see module doc)."""

    def fileno(self) -> int: ...

    def ready(self) -> bool:
        """Events are buffered already: serve them before waiting on the descriptor."""

    def service(self) -> None:
        """Handle the events that are ready; never waits long."""

    def claim(self) -> None:
        """The calling thread serves the events from now on (until :meth:`release`)."""

    def release(self) -> None: ...


class VfioDevice(Protocol):
    """What the server serves: a device model (:class:`qemu_device.device.PciFunction`)
    or the host proxy's link to a box (:class:`dxpu_vfio.hostproxy.forwarder.RemoteFunction`).
    Optional features are declared as attributes, never probed: the server reads
    ``coalesce_posted``, ``event_source``, ``native_forward`` and ``wants_dma_windows``
    and calls only what they enable."""

    lock: threading.RLock
    coalesce_posted: bool  # posted writes may be glued into runs (write_multiple is offered)
    event_source: EventSource | None
    native_forward: NativeForward | None
    wants_dma_windows: bool  # dma_mapped/dma_unmapped are called
    attach_error: str | None  # set: GET_INFO fails with it (QEMU ignores a refused DMA_MAP)

    def regions(self) -> list: ...
    def bar_memory(self, index: int): ...
    def irq_counts(self) -> dict[str, int]: ...
    def region_read(self, index: int, offset: int, size: int) -> bytes: ...
    def region_write(self, index: int, offset: int, data: bytes, posted: bool = False) -> None: ...
    def posted_idle(self) -> None: ...
    def attach(self, dma, irq) -> None: ...
    def reset(self) -> None: ...
    def dma_mapped(self, address: int, size: int, flags: int) -> None: ...
    def dma_unmapped(self, address: int, size: int, flags: int) -> None: ...
    def close(self) -> None: ...


class NativeForward(Protocol):
    """A device whose region accesses the session may forward in C (a ``Forwarder`` of
    :mod:`dxpu_vfio.native`, which also serves the link's DMA and MSI/MSI-X) while QEMU's
    socket is a native stream; declared as ``native_forward`` (None: not this device)."""

    link_stream: object  # the link's native Stream
    completion_timeout: float
    read_spin_us: float  # how long the forwarder may spin for a read's completion (0: never)

    def forwarding(self, forwarder: object | None) -> None:
        """The forwarder now serving the device (None: no more), for its counters."""

    def deliver(self, messages: list[tuple]) -> None:
        """Link messages the forwarder leaves to Python, in stream order."""

    def link_failed(self, reason: str, timeout: bool) -> None:
        """The link closed or a completion timed out: the device's link is down from now on."""


class SocketInUse(OSError):
    """Another live server already listens on this path."""


@dataclass
class CommandStats:
    count: int = 0
    errors: int = 0
    total_ns: int = 0
    max_ns: int = 0

    def add(self, ns: int, error: bool) -> None:
        self.count += 1
        self.errors += error
        self.total_ns += ns
        self.max_ns = max(self.max_ns, ns)

    def as_dict(self) -> dict:
        return {"count": self.count, "errors": self.errors,
                "mean_us": round(self.total_ns / self.count / 1000, 3) if self.count else None,
                "max_us": round(self.max_ns / 1000, 3)}


@dataclass
class ServerOptions:
    advertise_write_multiple: bool = False
    allow_msix: bool = False  # QEMU 11.1 aborts on device_del of MSI-X vfio-user devices
    # the largest DMA window accepted: libvfio-user's MAX_DMA_SIZE (8 TiB), so that a client
    # that maps more (the remote proxy once mapped 2^48 bytes) fails against us as against it
    max_dma_window: int = MAX_DMA_WINDOW
    # refuse windows without a descriptor, like a server that needs fd-mapped guest memory
    # (tests: such a server cannot work behind a box)
    dma_needs_fd: bool = False
    # offer host-mappable BARs as mappable (False: every access of them is a message, as before)
    map_regions: bool = True


@dataclass
class Reply:
    """A handler's reply payload with descriptors to send along (the caller keeps them)."""

    payload: bytes
    fds: list[int]


IRQ_INDEX = {"intx": p.IRQ_INTX, "msi": p.IRQ_MSI, "msix": p.IRQ_MSIX, "err": p.IRQ_ERR, "req": p.IRQ_REQ}


def irq_vector_counts(device: "VfioDevice") -> dict[int, int]:
    """The device's vector counts keyed by vfio-user IRQ index."""
    return {IRQ_INDEX[name]: count for name, count in device.irq_counts().items()}


def claim_socket_path(path: Path) -> None:
    """Remove a stale socket file, or refuse if a live server still answers there."""
    if not path.exists() and not path.is_symlink():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()  # nobody listens: a leftover of a dead server
        return
    finally:
        probe.close()
    raise SocketInUse(errno.EADDRINUSE, f"a server is already listening on {path}")


class _Session:
    """One client connection: its DMA table, its eventfds, its reader thread."""

    def __init__(self, server: "VfioUserServer", conn: Connection) -> None:
        self.server = server
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
        device = self.server.device
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
        except ConnectionClosed:
            pass
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
            self.server._session_ended(self)

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
                raise p.ProtocolError(f"{_name(hdr.command)} carries {len(msg.fds)} descriptors; it takes "
                                      f"{FDS_ALLOWED.get(hdr.command, 0)}")
            reply = handler(self, msg)
            if isinstance(reply, Reply):
                reply, reply_fds = reply.payload, reply.fds
            if not hdr.no_reply:
                out = p.message(hdr.msg_id, hdr.command, reply or b"", reply=True)
        except (p.ProtocolError, ValueError, DmaError, OSError, OverflowError, RecursionError) as exc:
            error = True
            err = getattr(exc, "errno", None) or (errno.EFAULT if isinstance(exc, DmaError) else errno.EINVAL)
            log.info("%s: %s failed: %s", self.server.name, _name(hdr.command), exc)
            self.server.protocol_errors += isinstance(exc, p.ProtocolError)
            if not hdr.no_reply:
                out = p.error_reply(hdr.msg_id, hdr.command, err)
        except Exception:  # noqa: BLE001 - a bug here: logged, answered, and the session goes on
            error = True
            log.exception("%s: %s failed", self.server.name, _name(hdr.command))
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
                raise p.ProtocolError(f"posted {_name(msg.header.command)} carries descriptors")
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
            log.info("%s: posted %s dropped: %s", self.server.name, _name(msg.header.command), exc)
        finally:
            msg.close_fds()
        self.server.record(msg.header.command, time.perf_counter_ns() - started, error)
        if full:
            self._flush_posted(idle=False)

    def _flush_posted(self, idle: bool) -> None:
        """Give the pending posted writes to the device, in order; a write the device
        refuses is dropped and logged, like a posted write to nowhere on PCIe."""
        device = self.server.device
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
            raise DmaError(f"{_name(command)} got no reply in {DMA_REPLY_TIMEOUT} s")
        reply: Message | None = done[1][0] if done[1] else None
        if reply is None:
            raise DmaError("client disconnected during DMA")
        if reply.header.is_error:
            raise DmaError(f"{_name(command)} refused by the client: "
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


# --- request handlers: (session, message) -> reply payload ---------------------------------

def _version(s: _Session, msg: Message) -> bytes:
    theirs = p.Version.unpack(msg.payload)
    if theirs.major != 0:
        raise p.ProtocolError(f"unsupported vfio-user major version {theirs.major}", errno.ENOTSUP)
    s.version_seen = True
    caps = {"max_msg_fds": p.MAX_MSG_FDS, "max_data_xfer_size": p.MAX_DATA_XFER,
            "pgsizes": p.PAGE_SIZE, "max_dma_maps": s.dma.max_maps}
    if s.server.options.advertise_write_multiple:
        caps["write_multiple"] = True
    return p.Version(0, 0, caps).pack()


def _dma_map(s: _Session, msg: Message) -> bytes:
    req = p.DmaMap.unpack(msg.payload)
    if len(msg.fds) > 1:
        raise p.ProtocolError(f"DMA_MAP with {len(msg.fds)} descriptors")
    if msg.fds and (req.size > sys.maxsize - p.PAGE_SIZE or req.offset > sys.maxsize - req.size - p.PAGE_SIZE):
        raise p.ProtocolError(f"DMA_MAP of {req.size:#x} bytes at file offset {req.offset:#x}: "
                              "beyond what a mapping can hold")
    if s.server.options.max_dma_window and req.size > s.server.options.max_dma_window:
        raise ValueError(f"DMA_MAP of {req.size:#x} bytes: windows are at most "
                         f"{s.server.options.max_dma_window:#x} bytes here")
    if s.server.options.dma_needs_fd and not msg.fds:
        raise ValueError(f"DMA_MAP of {req.address:#x}+{req.size:#x} without a file descriptor: "
                         "this server needs fd-mapped guest memory")
    fd = msg.fds.pop() if msg.fds else None
    s.dma.add(req.address, req.size, req.flags, fd, req.offset)
    if s.server.device.wants_dma_windows:  # a device that passes windows on (a box's external server)
        try:
            s.server.device.dma_mapped(req.address, req.size, req.flags)
        except BaseException:
            s.dma.remove(req.address, req.size)
            raise
        s.windows_told = True
    return b""


def _dma_unmap(s: _Session, msg: Message) -> bytes:
    req = p.DmaUnmap.unpack(msg.payload)
    if req.flags & p.DMA_UNMAP_ALL:
        s.dma.clear()
    else:
        s.dma.remove(req.address, req.size)
    if s.server.device.wants_dma_windows:
        s.server.device.dma_unmapped(req.address, req.size, req.flags)
    return req.pack()


def _device_info(s: _Session, msg: Message) -> bytes:
    # QEMU only logs a refused DMA_MAP (it sends them before GET_INFO, without waiting):
    # a device that cannot work with QEMU's windows fails the attach here instead
    refused = s.server.device.attach_error
    if refused:
        raise OSError(errno.EOPNOTSUPP, refused)
    return p.device_info_reply()


def _region_info(s: _Session, msg: Message) -> bytes | Reply:
    """A region's size and rights; a mappable one (a host-mappable BAR whose memory the
    device shows: ``bar_memory(index)``) also gets VFIO_REGION_INFO_FLAG_MMAP, its memfd
    with the reply, and the sparse-mmap capability when the memory says only some
    ``areas`` may be mapped. QEMU then maps it into the guest and sends no more
    accesses for it (and sends every MMIO write of the device non-posted from then on)."""
    index = p.unpack_index(msg.payload, "GET_REGION_INFO")
    argsz = struct.unpack_from("<I", msg.payload)[0]
    if index >= p.NUM_REGIONS:
        raise p.ProtocolError(f"region {index} does not exist")
    device = s.server.device
    region = device.regions()[index]
    flags = (p.REGION_FLAG_READ if region.readable else 0) | (p.REGION_FLAG_WRITE if region.writable else 0)
    memory = device.bar_memory(index) if region.mappable and s.server.options.map_regions else None
    if memory is None or memory.fd < 0:
        return p.region_info_reply(index, region.size, flags)
    areas = memory.areas  # None: the whole region may be mapped
    reply = p.region_info_reply(index, region.size, flags | p.REGION_FLAG_MMAP, areas=areas, argsz=argsz)
    s.mapped_regions.add(index)
    return Reply(reply, [memory.fd])


IRQ_FLAGS = {p.IRQ_INTX: p.IRQ_INFO_EVENTFD | p.IRQ_INFO_MASKABLE | p.IRQ_INFO_AUTOMASKED,
             p.IRQ_MSI: p.IRQ_INFO_EVENTFD | p.IRQ_INFO_NORESIZE,
             p.IRQ_MSIX: p.IRQ_INFO_EVENTFD | p.IRQ_INFO_NORESIZE,
             p.IRQ_ERR: p.IRQ_INFO_EVENTFD, p.IRQ_REQ: p.IRQ_INFO_EVENTFD}


def _irq_info(s: _Session, msg: Message) -> bytes:
    index = p.unpack_index(msg.payload, "GET_IRQ_INFO")
    if index >= p.NUM_IRQS:
        raise p.ProtocolError(f"irq index {index} does not exist")
    return p.irq_info_reply(index, s.irqs.counts.get(index, 0), IRQ_FLAGS[index])


def _set_irqs(s: _Session, msg: Message) -> bytes:
    req = p.SetIrqs.unpack(msg.payload)
    if msg.fds and req.data_type != p.IRQ_DATA_EVENTFD:
        raise p.ProtocolError(f"SET_IRQS without eventfd data carries {len(msg.fds)} descriptors")
    fds, msg.fds = msg.fds, []
    try:
        leftover = s.irqs.set_irqs(req, fds)
    except p.ProtocolError:
        msg.fds = fds  # closed by the caller
        raise
    for fd in leftover:
        os.close(fd)
    return b""


def _region_read(s: _Session, msg: Message) -> bytes:
    req = p.RegionAccess.unpack(msg.payload, write=False)
    device = s.server.device
    with device.lock:
        data = device.region_read(req.region, req.offset, req.count)
    return p.RegionAccess(req.region, req.offset, req.count, data).pack()


def _region_write(s: _Session, msg: Message) -> bytes:
    req = p.RegionAccess.unpack(msg.payload, write=True)
    device = s.server.device
    with device.lock:
        device.region_write(req.region, req.offset, req.data, posted=msg.header.no_reply)
    return p.RegionAccess(req.region, req.offset, req.count).pack()


def _reset(s: _Session, msg: Message) -> bytes:
    with s.server.device.lock:
        s.server.device.reset()
    return b""


def _not_supported(s: _Session, msg: Message) -> bytes:
    raise p.ProtocolError(f"{_name(msg.header.command)} is not supported", errno.ENOTSUP)


HANDLERS: dict[int, Callable[[_Session, Message], bytes]] = {
    p.Command.VERSION: _version,
    p.Command.DMA_MAP: _dma_map,
    p.Command.DMA_UNMAP: _dma_unmap,
    p.Command.DEVICE_GET_INFO: _device_info,
    p.Command.DEVICE_GET_REGION_INFO: _region_info,
    p.Command.DEVICE_GET_REGION_IO_FDS: _not_supported,
    p.Command.DEVICE_GET_IRQ_INFO: _irq_info,
    p.Command.DEVICE_SET_IRQS: _set_irqs,
    p.Command.REGION_READ: _region_read,
    p.Command.REGION_WRITE: _region_write,
    p.Command.REGION_WRITE_MULTI: _not_supported,  # posted only: combined in _Session._add_posted
    p.Command.DEVICE_RESET: _reset,
    p.Command.DIRTY_PAGES: _not_supported,
}


def _add_forwarded(counts: dict[str, int], native: dict) -> None:
    """Fold a forwarder's counters into counts by vfio-user command."""
    for command, n in (("REGION_READ", native["reads"]),
                       ("REGION_WRITE", native["writes_posted"] + native["writes_nonposted"])):
        if n:
            counts[command] = counts.get(command, 0) + n


def _message(got: tuple) -> Message:
    """A message the native forwarder returned: (msg_id, command, flags, error, payload, fds)."""
    msg_id, command, flags, error, payload, fds = got
    return Message(p.Header(msg_id, command, p.HEADER_SIZE + len(payload), flags, error), memoryview(payload), fds)


def _name(command: int) -> str:
    try:
        return p.Command(command).name
    except ValueError:
        return f"command {command}"


class VfioUserServer:
    """Serves ``device`` on ``socket_path`` until :meth:`stop`."""

    def __init__(self, device: VfioDevice, socket_path: Path, *, name: str = "dev",
                 options: ServerOptions | None = None) -> None:
        self.device = device
        self.socket_path = Path(socket_path)
        self.name = name
        self.options = options or ServerOptions()
        if device.irq_counts().get("msix") and not self.options.allow_msix:
            raise ValueError("device offers MSI-X, which makes QEMU 11.1 abort on device_del; "
                             "use MSI or pass ServerOptions(allow_msix=True)")
        self.handlers = dict(HANDLERS)
        self.stats: dict[int, CommandStats] = {}  # by command number
        self.sessions_served = 0
        self.rejected_connections = 0
        self.accept_errors = 0
        self.protocol_errors = 0
        self.posted_refused = 0  # posted writes the device refused (dropped)
        self.forwarded: dict[str, int] = {}  # QEMU's messages ended sessions' native forwarders handled
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._session: _Session | None = None
        self._lock = threading.Lock()
        self._session_done = threading.Condition(self._lock)
        self._stopping = False

    def record(self, command: int, ns: int, error: bool) -> None:
        stats = self.stats.get(command)
        if stats is None:
            stats = self.stats[command] = CommandStats()
        stats.add(ns, error)

    @property
    def session(self) -> _Session | None:
        return self._session

    def start(self) -> "VfioUserServer":
        claim_socket_path(self.socket_path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.socket_path))
        listener.listen(4)
        self._listener = listener
        self._accept_thread = threading.Thread(target=self._accept_loop,
                                               name=f"vfio-user-accept-{self.name}", daemon=True)
        self._accept_thread.start()
        return self

    def _accept_loop(self) -> None:
        assert self._listener is not None
        listener = self._listener
        while not self._stopping:
            try:
                sock, _ = listener.accept()
            except OSError as exc:
                if self._stopping:
                    break  # listener closed by stop()
                self.accept_errors += 1  # EMFILE...: the device must stay pluggable once it passes
                if self.accept_errors in (1, 10, 100) or self.accept_errors % 1000 == 0:
                    log.error("%s: accept() failed (%d times so far): %s; retrying", self.name,
                              self.accept_errors, exc)
                time.sleep(ACCEPT_RETRY)
                continue
            with self._lock:
                if self._session is not None or self._stopping:
                    self.rejected_connections += 1
                    sock.close()  # one client per device, like one slot per card
                    continue
                conn = native.unix(sock) if native.enabled() else Connection(sock)
                try:
                    session = _Session(self, conn)
                except Exception as exc:  # noqa: BLE001 - e.g. a device that describes itself wrongly:
                    self.rejected_connections += 1  # this client is refused, the next one is accepted
                    log.error("%s: cannot serve a session: %r", self.name, exc)
                    conn.close()
                    continue
                self._session = session
                self.sessions_served += 1
                session.thread.start()

    def _session_ended(self, session: _Session) -> None:
        with self._lock:  # with the session's going: a snapshot sees its counts once
            if session.forwarder is not None:
                _add_forwarded(self.forwarded, session.forwarder.counters())
            if self._session is session:
                self._session = None
            self._session_done.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no client is connected (e.g. after device_del)."""
        with self._lock:
            return self._session_done.wait_for(lambda: self._session is None, timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Close the socket, drop the client, join every thread. Idempotent."""
        self._stopping = True
        close_listener(self._listener)
        self._listener = None
        with self._lock:  # the accept loop creates and starts a session under it
            session = self._session
        if session is not None:
            session.conn.close()
            session.thread.join(timeout)
        if self._accept_thread is not None:
            self._accept_thread.join(timeout)
        self.socket_path.unlink(missing_ok=True)
        self.device.close()

    def _forwarded_counts(self, s: _Session | None) -> dict[str, int]:
        """QEMU's messages the native forwarder handled in C (not in ``commands``: their
        time is the link's wait), of every session so far."""
        counts = dict(self.forwarded)
        if s is not None and s.forwarder is not None:
            _add_forwarded(counts, s.forwarder.counters())
        return counts

    @staticmethod
    def _dma_counters(s: _Session) -> dict:
        """The session's DMA, with what the native forwarder did in C (outside the table)."""
        native_dma = s.forwarder.counters() if s.forwarder is not None else {}
        windows = s.dma.windows()
        return {"windows": len(windows), "maps": [[a, n, f, fd] for a, n, f, fd in windows],
                "refused": s.dma.refused + native_dma.get("dma_refused", 0),
                "bytes_read": s.dma.bytes_read + native_dma.get("dma_bytes_read", 0),
                "bytes_written": s.dma.bytes_written + native_dma.get("dma_bytes_written", 0)}

    def snapshot(self) -> dict:
        """Counters for ``dxpu stats`` and benchmarks."""
        with self._lock:
            s = self._session
            forwarded = self._forwarded_counts(s)
        return {"name": self.name, "sessions": self.sessions_served,
                "rejected_connections": self.rejected_connections,
                "protocol_errors": self.protocol_errors, "posted_refused": self.posted_refused,
                "commands": {_name(k): v.as_dict() for k, v in sorted(self.stats.items())},
                "forwarded": forwarded,
                "dma": None if s is None else self._dma_counters(s),
                "irqs": None if s is None else {**s.irqs.delivered, "dropped": s.irqs.dropped, "lost": s.irqs.lost,
                                                "eventfds": s.irqs.fd_count()}}
