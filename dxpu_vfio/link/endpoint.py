"""One end of a device's link stream: requests with completion timeouts, posted
messages, heartbeats, and counters. Both proxies use it, with their own handlers.

Messages are taken in stream order by whichever thread reads: replies go to the request
they answer, requests to ``handlers`` (run inline, so their effects keep the stream's
order). Who reads, one thread at a time (the read lock):

* a thread waiting for a completion reads the stream itself when nobody else is reading,
  so the thread that waits for a completion is usually the thread that receives it
  (no hand-off between threads, no extra wake-up). It runs the handlers of the requests
  it reads only with ``waiters_serve=True`` (the host proxy's handlers never wait for
  anyone); otherwise (the box: a device worker waiting for its DMA must not run a
  register write that waits for that worker) it stops at the first request and leaves
  it, and everything after it, to the background reader;
* a *driver* (the host proxy's vfio-user session thread, :meth:`claim`) reads for good: it
  serves the stream from its own poll loop (:meth:`service`) and receives its own
  completions inline; the background reader is parked meanwhile;
* otherwise the background reader thread does. It stands aside while a thread waits for
  its completions (:meth:`reading_own_completions`, which a scatter-list DMA read holds for
  its whole span), serving only a request that waiter left to it: a completion the
  background reader took would have to be handed over (two wake-ups, counted in
  ``handed_over``).

On the box the background reader waits in C (``region_access``, native/serve.c), which
serves register accesses and ring pushes as they come, one at a time under the stream's
reader lock, and leaves anything else for this loop. It does so only while no thread reads
for itself (:meth:`_hold_serving`), so a request such a thread leaves to it is never
overtaken.

A heartbeat thread posts HEARTBEAT every ``heartbeat`` seconds and declares the link
down when nothing at all was heard for ``dead_after`` seconds (a peer that is stopped,
not closed). Once down, a link stays down (:class:`LinkState`): recovery is a new link
(re-attach). The stream is the native one in C (:mod:`dxpu_vfio.native.stream`) or a
:class:`~dxpu_vfio.link.stream.LinkStream`; either lets threads in one at a time (TLS allows
no more).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import itertools
import logging
import os
import select
import socket
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterator

from dxpu_vfio.link.protocol import LinkCommand
from dxpu_vfio.native import stream as native
from dxpu_vfio.link.stream import LinkStream
from dxpu_vfio.vfio_user import protocol as vp
from dxpu_vfio.vfio_user.connection import Connection, ConnectionClosed, Message, ReceiveTimeout

log = logging.getLogger("dxpu.link")

Handler = Callable[[Message], "bytes | tuple | None"]  # a tuple: the payload in parts (no copy to join them)
REST_OF_MESSAGE = 1.0  # the longest a reader waits for the rest of a message that started
SERVE_WAIT_S = 1.0  # the box's reader waiting in C looks at its loop at least this often


class LinkState(enum.StrEnum):
    """UP from the start; DOWN once, for good (``down_reason`` says why)."""

    UP = "up"
    DOWN = "down"


class LinkDown(Exception):
    """The link is down (peer closed, silent, or a completion timed out)."""


class LinkError(Exception):
    """The peer answered a request with an error."""

    def __init__(self, message: str, err: int) -> None:
        super().__init__(message)
        self.errno = err


_POSTED = vp.TYPE_COMMAND | vp.FLAG_NO_REPLY
_NAMES = {int(c): c.name for c in LinkCommand}  # an enum lookup per message costs microseconds


def _cmd_name(command: int) -> str:
    return _NAMES.get(command) or str(command)


def dma_read_requests(requests: dict) -> tuple[int, float]:
    """(count, wait in µs) of the DMA reads in a link's ``requests`` counters: DMA_READ and
    DMA_READV (one per scatter list), whichever the host's HELLO let the box use."""
    entries = [requests.get(name, {}) for name in ("DMA_READ", "DMA_READV")]
    return sum(e.get("count", 0) for e in entries), sum(e.get("wait_us", 0.0) for e in entries)


@dataclass
class Pending:
    """A request in flight. ``done`` once its completion is in ``reply`` (empty: the link
    went down). ``event`` exists only if a thread that does not read has to sleep on it:
    the thread that reads its own completion needs none (an Event costs 6 µs here)."""

    command: int
    sent_ns: int
    reply: list = field(default_factory=list)
    done: bool = False
    event: threading.Event | None = None


class LinkEndpoint:
    def __init__(self, conn: Connection, name: str, handlers: dict[int, Handler], *,
                 heartbeat: float = 0.25, dead_after: float = 3.0,
                 on_down: Callable[[str], None] | None = None, waiters_serve: bool = False,
                 region_access: "tuple[Callable, Callable, Callable] | None" = None) -> None:
        self.native = getattr(conn, "native", False)  # a NativeConnection: framing and TLS in C
        if not self.native and not isinstance(conn.sock, LinkStream):
            conn.sock = LinkStream(conn.sock)
        self.conn = conn
        self.stream = conn.sock
        # (read, write, push) callbacks: on the native stream the background reader answers
        # the peer's REGION_READ/REGION_WRITE (and SYNC), and takes its posted DMA_PUSHes, in
        # C through them (native/serve.c)
        self.region_access = region_access if self.native else None
        # the rings C fills from DMA_PUSHes itself, without the push callback: an object with
        # mirror_lock, mirrors and pushes (remoteproxy/ports.py LinkDmaPort), set before start()
        self.push_mirrors: object | None = None
        # a peer that stops reading cannot hold a sender longer than a silent one
        self.set_send_timeout(dead_after)
        self.name = name
        self.handlers = handlers
        self.heartbeat = heartbeat
        self.dead_after = dead_after
        self.on_down = on_down
        self._state = LinkState.UP
        self.down_reason: str | None = None  # set just before the state goes DOWN
        self._ids = itertools.count(1)
        self._pending: dict[int, Pending] = {}
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()  # held by the one thread that reads the stream
        self._driver: threading.Thread | None = None
        self.waiters_serve = waiters_serve
        self._deferred: Message | None = None  # a request a waiter read but may not serve
        self._parked = threading.Condition()  # the background reader waits here for a driver or waiters
        self._waiters = 0  # threads in wait() that are not the driver: they read for themselves
        self._sleepers = 0  # waiters asleep on their completion's event (someone else reads)
        self._wake_r, self._wake_w = os.pipe()  # wakes the background reader when a driver claims
        os.set_blocking(self._wake_w, False)  # a wake-up already pending is enough: never wait to add one
        self._last_heard = time.monotonic()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._together = threading.local()  # .depth: this thread is inside posted_together()
        self._life = threading.Lock()  # start() and close() in turn: no thread starts on a closed link
        # counters
        self.requests: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # name -> [count, wait ns]
        self.posted: dict[str, int] = defaultdict(int)
        self.received: dict[str, int] = defaultdict(int)
        self.handled: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # name -> [count, handler ns]
        self.timeouts = 0
        self.self_received = 0  # completions received by the thread that waited for them
        self.handed_over = 0  # completions another thread received while their waiter slept
        self.naps = 0  # waits for the stream another thread held
        self.naps_out = 0  # of them, those nobody woke (each cost up to 2 ms)

    def set_send_timeout(self, seconds: float) -> None:
        """How long a send may wait for a peer that does not read; then the link is down."""
        if self.native:
            self.conn.set_send_timeout(seconds)
        else:
            self.stream.send_timeout = seconds

    @property
    def state(self) -> LinkState:
        return self._state

    @property
    def up(self) -> bool:
        return self._state is LinkState.UP

    def start(self) -> "LinkEndpoint":
        with self._life:
            if self._stop.is_set():  # closed before it started (the box stopping during an admission)
                return self
            for target, label in ((self._background_reader, "read"), (self._heartbeat_loop, "beat")):
                thread = threading.Thread(target=target, name=f"link-{label}-{self.name}", daemon=True)
                thread.start()
                self._threads.append(thread)
        return self

    # --- state -----------------------------------------------------------------------
    def mark_down(self, reason: str) -> None:
        with self._lock:
            if self._state is LinkState.DOWN:
                return
            self.down_reason = reason  # first: whoever sees DOWN (unlocked) finds the reason
            self._state = LinkState.DOWN
            for pending in self._pending.values():
                self._complete(pending)  # with no reply: LinkDown
            self._pending = {}
        log.warning("link %s down: %s", self.name, reason)
        try:  # wakes every thread in poll on the stream; the descriptor stays valid until close()
            self.stream.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._wake(b"d")
        if self.on_down:
            self.on_down(reason)

    # --- sending -----------------------------------------------------------------------
    def post(self, command: int, payload: bytes | tuple = b"") -> None:
        """Send without awaiting a completion (posted); dropped once the link is down.
        ``payload`` may be a tuple of buffers, framed with one copy."""
        if not self.up:
            return
        try:
            msg_id = next(self._ids) & 0xFFFF
            self.conn.send_message(msg_id, command, _POSTED, payload)
            self.posted[_cmd_name(command)] += 1
        except ConnectionClosed as exc:
            self.mark_down(f"send failed: {exc}")

    def post_many(self, command: int, payloads: list[bytes | tuple]) -> None:
        """Several posted messages of one command, in order, as one send (a DMA scatter
        list: a few TLS records instead of one per page)."""
        if not self.up:
            return
        try:
            self.conn.send_messages([(next(self._ids) & 0xFFFF, command, _POSTED, payload) for payload in payloads])
            self.posted[_cmd_name(command)] += len(payloads)
        except ConnectionClosed as exc:
            self.mark_down(f"send failed: {exc}")

    @contextlib.contextmanager
    def posted_together(self) -> Iterator[None]:
        """The posted messages this thread sends inside leave together: at the end, or with
        the next message that is not this thread's posted one (its own request, a reply,
        another thread's message), which keeps the stream's order; so a device's DMA writes
        and the interrupt after them are one write, and one wake-up of the host's reader.
        Nested blocks count as the outer one. Nothing changes on a plain Python stream."""
        depth = getattr(self._together, "depth", 0)
        corks = self.native and depth == 0
        self._together.depth = depth + 1
        if corks:
            self.conn.cork()
        try:
            yield
        finally:
            self._together.depth = depth
            if corks:
                try:
                    self.conn.uncork()
                except ConnectionClosed as exc:
                    self.mark_down(f"send failed: {exc}")

    def request(self, command: int, payload: bytes, timeout: float) -> memoryview:
        """Send and wait for the completion; LinkDown on timeout (the link goes down)."""
        if self.native and not self._pending and threading.current_thread() is self._driver:
            return self._exchange(command, payload, timeout)
        return self.wait(self.send_request(command, payload), timeout)

    def _exchange(self, command: int, payload: bytes, timeout: float) -> memoryview:
        """The driver's request when nothing else is in flight, on the native stream: one
        call sends it and usually returns its completion; whatever the peer sent before
        that is dispatched first, in stream order (the same rules as :meth:`wait`, with no
        Pending to keep: only this thread reads and waits)."""
        if not self.up:
            raise LinkDown(self.down_reason)
        msg_id = next(self._ids) & 0xFFFF
        started = time.perf_counter_ns()
        deadline = time.monotonic() + timeout
        try:
            got = self.conn.exchange(msg_id, command, payload, timeout)
            while True:
                if got is not None:
                    self._last_heard = time.monotonic()
                    if got[2] & vp.TYPE_MASK == vp.TYPE_REPLY and got[0] == msg_id:
                        break
                    self._dispatch(Message(vp.Header(got[0], got[1], vp.HEADER_SIZE + len(got[4]), got[2], got[3]),
                                           memoryview(got[4])))
                    if not self.up:
                        raise LinkDown(self.down_reason)
                left = deadline - time.monotonic()
                if left <= 0:
                    self.timeouts += 1
                    self.mark_down(f"completion timeout: no answer to {_cmd_name(command)} in {timeout * 1000:.0f} ms")
                    raise LinkDown(self.down_reason)
                got = self.conn.receive_raw(left)
        except (ConnectionClosed, vp.ProtocolError) as exc:
            self.mark_down(f"peer closed the link ({exc})" if not self._stop.is_set() else "closed")
            raise LinkDown(self.down_reason) from exc
        stats = self.requests[_cmd_name(command)]
        stats[0] += 1
        stats[1] += time.perf_counter_ns() - started
        self.self_received += 1
        if got[2] & vp.FLAG_ERROR:
            raise LinkError(f"{_cmd_name(command)}: {os.strerror(got[3])}", got[3])
        return memoryview(got[4])

    def send_request(self, command: int, payload: bytes) -> Pending:
        """Send a non-posted request without waiting: several may be in flight (pipelining)."""
        if not self.up:
            raise LinkDown(self.down_reason)
        msg_id = next(self._ids) & 0xFFFF
        pending = Pending(command, time.perf_counter_ns())
        with self._lock:
            self._pending[msg_id] = pending
        try:
            self.conn.send_message(msg_id, command, vp.TYPE_COMMAND, payload)
        except ConnectionClosed as exc:
            self.mark_down(f"send failed: {exc}")
            raise LinkDown(self.down_reason) from exc
        return pending

    def send_requests(self, command: int, payloads: list[bytes]) -> list[Pending]:
        """Several non-posted requests of one command sent with one call (a pipelined
        scatter list: a few TLS records and one system call, not one per piece)."""
        if not self.up:
            raise LinkDown(self.down_reason)
        now = time.perf_counter_ns()
        batch = [(next(self._ids) & 0xFFFF, Pending(command, now)) for _ in payloads]
        with self._lock:
            self._pending.update(batch)
        try:
            self.conn.send_messages([(msg_id, command, vp.TYPE_COMMAND, payload)
                                     for (msg_id, _), payload in zip(batch, payloads)])
        except ConnectionClosed as exc:
            self.mark_down(f"send failed: {exc}")
            raise LinkDown(self.down_reason) from exc
        return [pending for _, pending in batch]

    def wait(self, pending: Pending, timeout: float) -> memoryview:
        """The completion of a request sent with :meth:`send_request`, received by this
        thread itself where it can (see the module docstring)."""
        deadline = time.monotonic() + timeout
        if threading.current_thread() is self._driver:
            self._read_until(pending, deadline)
        else:
            with self.reading_own_completions():
                self._wait_reading(pending, deadline)
        if not pending.done:
            self.timeouts += 1
            self.mark_down(f"completion timeout: no answer to {_cmd_name(pending.command)} in {timeout * 1000:.0f} ms")
            raise LinkDown(self.down_reason)
        stats = self.requests[_cmd_name(pending.command)]
        stats[0] += 1
        stats[1] += time.perf_counter_ns() - pending.sent_ns
        if not pending.reply:
            raise LinkDown(self.down_reason)
        reply: Message = pending.reply[0]
        if reply.header.is_error:
            raise LinkError(f"{_cmd_name(pending.command)}: {os.strerror(reply.header.error)}", reply.header.error)
        return reply.payload

    @contextlib.contextmanager
    def reading_own_completions(self) -> Iterator[None]:
        """While this thread waits for completions, within this span and not only inside
        :meth:`wait`, the background reader leaves the stream to it: a scatter list's next
        completion arriving while the thread copies the last one stays for the thread,
        instead of costing a hand-off (two wake-ups)."""
        with self._parked:
            self._waiters += 1
        try:
            self._hold_serving(True)
            try:
                yield
            finally:
                self._hold_serving(False)
        finally:
            with self._parked:
                self._waiters -= 1
                if not self._waiters:
                    self._parked.notify_all()  # the background reader reads again

    def _hold_serving(self, hold: bool) -> None:
        """A thread that reads the stream itself begins or ends: meanwhile the background
        reader, waiting in C, serves nothing (a request this thread reads may have to wait
        for the background reader, and a later one must not be served before it)."""
        if self.region_access is not None:
            native.require().hold_serving(self.conn.stream, hold)

    def _wait_reading(self, pending: Pending, deadline: float) -> None:
        """A waiter that is not the driver: reads the stream itself while nobody else does
        (the background reader steps aside while waiters are there), else sleeps until the
        one who reads hands its completion over."""
        while not pending.done and time.monotonic() < deadline:
            if self._deferred is None and self._read_lock.acquire(blocking=False):
                try:
                    self._read_until(pending, deadline)
                finally:
                    self._read_lock.release()
                if self._sleepers:
                    self._nudge_sleepers()  # another waiter may read now
                if self.conn.has_message() or self.stream.pending():
                    # what came behind our completion in the same read is buffered, and
                    # the background reader sleeps on the fd, which will not wake it
                    self._wake(b"b")
                continue
            # someone else reads (or serves what we left it): it hands our completion
            # over, or nudges us when the stream is free again
            with self._lock:
                if pending.done:
                    break
                if pending.event is None:
                    pending.event = threading.Event()
                else:
                    pending.event.clear()
                self._sleepers += 1
            # Sleep only while someone holds the stream: whoever lets it go nudges the
            # sleepers it sees, and we count ourselves one before we look. Else we would
            # sleep out the whole timeout on a completion that came while nobody read (the
            # background reader stands aside for us): right after a doorbell the reader
            # still held the stream when the device's first DMA read went out.
            if self._read_lock.locked() or self._deferred is not None:
                self.naps += 1
                if not pending.event.wait(min(0.002, max(0.0, deadline - time.monotonic()))):
                    self.naps_out += 1
            with self._lock:
                self._sleepers -= 1

    def _nudge_sleepers(self) -> None:
        """Wake the waiters asleep on their completions: the stream is free to read."""
        with self._lock:
            for other in self._pending.values():
                if other.event is not None:
                    other.event.set()

    def _wake(self, why: bytes) -> None:
        """Wake the background reader (it re-checks the stream, its parking, the link)."""
        try:
            os.write(self._wake_w, why)
        except BlockingIOError:
            pass  # the pipe is full of wake-ups it has not read yet
        except OSError:
            pass  # closed: the endpoint is going away

    # --- receiving ---------------------------------------------------------------------
    def _read_until(self, pending: Pending, deadline: float) -> None:
        """Read (holding the read lock, or as the driver) until ``pending`` completes."""
        serve = self.waiters_serve or threading.current_thread() is self._driver
        while not pending.done and self.up and self._deferred is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            msg = self._receive(left)
            if msg is None:
                continue
            if not serve and not msg.header.is_reply:
                with self._parked:
                    self._deferred = msg  # the background reader serves it, then reads on
                    self._parked.notify_all()
                return
            self._dispatch(msg)
            if pending.done:
                self.self_received += 1

    def _receive(self, timeout: float) -> Message | None:
        """One message within ``timeout`` (None if none came); marks the link down if the
        stream ends or cannot be trusted."""
        try:
            if self.native:  # one call: waits up to timeout; a message begun stays buffered
                msg = self.conn.receive(timeout)
            else:
                if not self.conn.has_message() and not self.stream.readable(timeout):
                    return None
                msg = self.conn.receive(timeout=REST_OF_MESSAGE)
        except ReceiveTimeout:
            return None
        except (ConnectionClosed, vp.ProtocolError) as exc:
            self.mark_down(f"peer closed the link ({exc})" if not self._stop.is_set() else "closed")
            return None
        self._last_heard = time.monotonic()
        return msg

    def _dispatch(self, msg: Message) -> None:
        hdr = msg.header
        if hdr.is_reply:
            with self._lock:
                pending = self._pending.pop(hdr.msg_id, None)
                if pending is not None:
                    pending.reply.append(msg)
                    if pending.event is not None:
                        self.handed_over += 1
                    self._complete(pending)
            return
        self.received[_cmd_name(hdr.command)] += 1
        if hdr.command == LinkCommand.HEARTBEAT:
            return
        handler = self.handlers.get(hdr.command)
        try:
            if handler is None:
                raise vp.ProtocolError(f"unexpected {_cmd_name(hdr.command)}", errno.ENOSYS)
            started = time.perf_counter_ns()
            reply = handler(msg)
            spent = self.handled[_cmd_name(hdr.command)]
            spent[0] += 1
            spent[1] += time.perf_counter_ns() - started
            if not hdr.no_reply:
                self.conn.send_message(hdr.msg_id, hdr.command, vp.TYPE_REPLY, reply or b"")
        except ConnectionClosed as exc:
            self.mark_down(f"send failed: {exc}")
        except Exception as exc:  # noqa: BLE001 - every failure becomes an error completion
            err = getattr(exc, "errno", None) or errno.EIO
            log.info("link %s: %s failed: %s", self.name, _cmd_name(hdr.command), exc)
            if not hdr.no_reply:
                try:
                    self.conn.send(vp.error_reply(hdr.msg_id, hdr.command, err))
                except ConnectionClosed as closed:
                    self.mark_down(f"send failed: {closed}")

    def deliver(self, got: tuple) -> None:
        """A message someone else read off the stream in order (the native forwarder), as a
        (msg_id, command, flags, error, payload) tuple: dispatched like one read here."""
        msg_id, command, flags, error, payload = got
        self._last_heard = time.monotonic()
        self._dispatch(Message(vp.Header(msg_id, command, vp.HEADER_SIZE + len(payload), flags, error),
                               memoryview(payload)))

    @staticmethod
    def _complete(pending: Pending) -> None:
        """Mark done (under ``_lock``) and wake a thread that sleeps on it."""
        pending.done = True
        if pending.event is not None:
            pending.event.set()

    def _background_reader(self) -> None:
        """Reads when nobody else does: parked while a driver holds the stream, and never
        holding the read lock while it waits, so a waiting thread can read for itself."""
        poller = select.poll()
        poller.register(self.stream.fileno(), select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while self.up and not self._stop.is_set():
            with self._parked:  # a driver reads for good; waiters read their own completions
                while (self._driver is not None or self._stands_aside()) and self.up and not self._stop.is_set():
                    self._parked.wait()
            if not self.up or self._stop.is_set():
                return
            if self._deferred is None and not (self.conn.has_message() or self.stream.pending()):
                if self.region_access is not None:  # C waits, and serves the register accesses
                    self._serve_waiting()           # that come, without this loop's Python
                    continue  # then: a message for Python, a wake-up, a waiter or the link down
                ready = dict(poller.poll())
                if self._wake_r in ready:
                    os.read(self._wake_r, 64)
                    if self._deferred is None:
                        continue  # a driver claims the stream (or the link went down)
            with self._parked:
                if self._stands_aside():
                    continue  # a waiter came while this thread polled: it reads what came
            served_deferred = False
            with self._read_lock:
                if self._driver is None:
                    msg, self._deferred = self._deferred, None
                    served_deferred = msg is not None
                    if msg is None:  # C serves the register accesses there and leaves the first other
                        # message; its None means it read all there was: no second read for nothing
                        msg = self._serve_region_access() if self.region_access is not None else self._receive(0)
                    if msg is not None:
                        self._dispatch(msg)
            if served_deferred or self._sleepers:
                self._nudge_sleepers()  # the waiter that left it reads on, or one that came meanwhile

    def _stands_aside(self) -> bool:
        """While a thread waits for its completion, it reads the stream itself: this
        reader taking that completion would cost a hand-off (two wake-ups) each. It serves
        only what a waiter left to it (``_deferred``). Called with ``_parked`` held."""
        return self._waiters > 0 and self._deferred is None

    def _serve_waiting(self) -> None:
        """Sleep in C until something comes, serving register accesses there (native/serve.c
        with a wake_fd): the box's reader spent 4.5 µs of Python from poll(2) to the serving
        call per access, and as much after it. It leaves anything else buffered, for the loop
        to take in order; a wake-up is drained here (the loop looks again)."""
        read, write, push = self.region_access
        mod = native.require()
        try:
            got = mod.serve_requests(self.conn.stream, read, write, SERVE_WAIT_S, push, self.push_mirrors, self._wake_r)
        except (mod.Closed, mod.BadFrame, TimeoutError, OSError) as exc:
            self.mark_down(f"peer closed the link ({exc})" if not self._stop.is_set() else "closed")
            return
        if got is False:
            try:
                os.read(self._wake_r, 64)
            except OSError:
                pass  # closed: the endpoint is going away

    def _serve_region_access(self) -> Message | None:
        """Let C answer the register accesses that are there; the first message it leaves."""
        read, write, push = self.region_access
        try:
            got = native.require().serve_requests(self.conn.stream, read, write, 0, push, self.push_mirrors)
        except (native.require().Closed, native.require().BadFrame, TimeoutError) as exc:
            self.mark_down(f"peer closed the link ({exc})" if not self._stop.is_set() else "closed")
            return None
        if got is None:
            return None
        self._last_heard = time.monotonic()
        return Message(vp.Header(got[0], got[1], vp.HEADER_SIZE + len(got[4]), got[2], got[3]), memoryview(got[4]))

    # --- a driver thread -------------------------------------------------------------
    def claim(self) -> None:
        """The calling thread reads the stream from now on: it calls :meth:`service` when
        :meth:`fileno` is readable or :meth:`ready` says so, and receives its own
        completions inline. Until :meth:`release`."""
        with self._parked:
            self._driver = threading.current_thread()
        self._hold_serving(True)
        self._wake(b"c")
        self._read_lock.acquire()  # the background reader (or a waiter) lets go between messages

    def release(self) -> None:
        if self._driver is not threading.current_thread():
            return
        self._read_lock.release()
        self._hold_serving(False)
        with self._parked:
            self._driver = None
            self._parked.notify_all()

    def fileno(self) -> int:
        return self.stream.fileno()

    def ready(self) -> bool:
        """Something can be read without waiting (buffered here or in TLS)."""
        return self.up and (self.conn.has_message() or self.stream.pending())

    def service(self) -> None:
        """The driver's turn: handle every message that is there now, never waiting for one."""
        while self.up:
            msg = self._receive(0)
            if msg is None:
                return
            self._dispatch(msg)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat):
            if not self.up:
                return
            heard = max(self._last_heard, self.stream.stream.last_heard) if self.native else self._last_heard
            if time.monotonic() - heard > self.dead_after:
                self.mark_down(f"peer silent for {self.dead_after:.1f} s (heartbeats stopped)")
                return
            self.post(LinkCommand.HEARTBEAT)

    def close(self) -> None:
        with self._life:
            self._stop.set()
        self.mark_down("closed")
        with self._parked:
            self._parked.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(2)
        self.conn.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def stats(self) -> dict:
        handled = {k: {"count": c, "us": round(ns / 1000, 1)} for k, (c, ns) in self.handled.items()}
        if self.region_access is not None:  # what C answered (native/serve.c)
            for name, row in native.require().served(self.conn.stream).items():
                if row["count"]:
                    mine = handled.setdefault(name, {"count": 0, "us": 0.0})
                    mine["count"] += row["count"]
                    mine["us"] = round(mine["us"] + row["ns"] / 1000, 1)
        return {"up": self.up, "down_reason": self.down_reason, "timeouts": self.timeouts,
                "self_received": self.self_received, "handed_over": self.handed_over, "naps": self.naps,
                "naps_out": self.naps_out,
                "requests": {k: {"count": c, "wait_us": round(ns / 1000, 1)} for k, (c, ns) in self.requests.items()},
                "posted": dict(self.posted), "received": dict(self.received), "handled": handled,
                **({"stream": self.conn.stats()} if self.native else {})}
