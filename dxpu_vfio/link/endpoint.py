"""One end of a device's link stream: requests with completion timeouts, posted
messages, heartbeats, and counters. Both proxies use it, with their own handlers.

A reader thread takes messages in stream order: replies go to the thread waiting for
them, requests to ``handlers`` (run inline, so their effects keep the stream's order).
A heartbeat thread posts HEARTBEAT every ``heartbeat`` seconds and declares the link
down when nothing at all was heard for ``dead_after`` seconds (a peer that is stopped,
not closed). Once down, a link stays down (:class:`LinkState`): recovery is a new link
(re-attach).
"""

from __future__ import annotations

import enum
import errno
import itertools
import logging
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from dxpu_vfio.vfio_user import protocol as vp
from dxpu_vfio.vfio_user.connection import Connection, ConnectionClosed, Message
from dxpu_vfio.link.protocol import LinkCommand

log = logging.getLogger("dxpu.link")

Handler = Callable[[Message], "bytes | None"]


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


def _cmd_name(command: int) -> str:
    try:
        return LinkCommand(command).name
    except ValueError:
        return str(command)


@dataclass
class Pending:
    """A request in flight."""

    command: int
    event: threading.Event
    reply: list
    sent_ns: int


class LinkEndpoint:
    def __init__(self, conn: Connection, name: str, handlers: dict[int, Handler], *,
                 heartbeat: float = 0.25, dead_after: float = 3.0,
                 on_down: Callable[[str], None] | None = None) -> None:
        self.conn = conn
        self.name = name
        self.handlers = handlers
        self.heartbeat = heartbeat
        self.dead_after = dead_after
        self.on_down = on_down
        self._state = LinkState.UP
        self.down_reason: str | None = None  # set just before the state goes DOWN
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[threading.Event, list]] = {}
        self._lock = threading.Lock()
        self._last_heard = time.monotonic()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # counters
        self.requests: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # name -> [count, wait ns]
        self.posted: dict[str, int] = defaultdict(int)
        self.received: dict[str, int] = defaultdict(int)
        self.handled: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # name -> [count, handler ns]
        self.timeouts = 0

    @property
    def state(self) -> LinkState:
        return self._state

    @property
    def up(self) -> bool:
        return self._state is LinkState.UP

    def start(self) -> "LinkEndpoint":
        for target, label in ((self._read_loop, "read"), (self._heartbeat_loop, "beat")):
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
            waiters, self._pending = list(self._pending.values()), {}
        log.warning("link %s down: %s", self.name, reason)
        for event, _ in waiters:
            event.set()
        self.conn.close()
        if self.on_down:
            self.on_down(reason)

    # --- sending -----------------------------------------------------------------------
    def post(self, command: int, payload: bytes = b"") -> None:
        """Send without awaiting a completion (posted); dropped once the link is down."""
        if not self.up:
            return
        try:
            self.conn.send(vp.message(next(self._ids) & 0xFFFF, command, payload, no_reply=True))
            self.posted[_cmd_name(command)] += 1
        except ConnectionClosed as exc:
            self.mark_down(f"send failed: {exc}")

    def request(self, command: int, payload: bytes, timeout: float) -> memoryview:
        """Send and wait for the completion; LinkDown on timeout (the link goes down)."""
        return self.wait(self.send_request(command, payload), timeout)

    def send_request(self, command: int, payload: bytes) -> "Pending":
        """Send a non-posted request without waiting: several may be in flight (pipelining)."""
        if not self.up:
            raise LinkDown(self.down_reason)
        msg_id = next(self._ids) & 0xFFFF
        pending = Pending(command, threading.Event(), [], time.perf_counter_ns())
        with self._lock:
            self._pending[msg_id] = (pending.event, pending.reply)
        try:
            self.conn.send(vp.message(msg_id, command, payload))
        except ConnectionClosed as exc:
            self.mark_down(f"send failed: {exc}")
            raise LinkDown(self.down_reason) from exc
        return pending

    def wait(self, pending: "Pending", timeout: float) -> memoryview:
        """The completion of a request sent with :meth:`send_request`."""
        if not pending.event.wait(timeout):
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

    # --- receiving ---------------------------------------------------------------------
    def _read_loop(self) -> None:
        try:
            while not self._stop.is_set():
                msg = self.conn.receive()
                self._last_heard = time.monotonic()
                hdr = msg.header
                if hdr.is_reply:
                    with self._lock:
                        waiter = self._pending.pop(hdr.msg_id, None)
                    if waiter:
                        waiter[1].append(msg)
                        waiter[0].set()
                    continue
                self.received[_cmd_name(hdr.command)] += 1
                if hdr.command == LinkCommand.HEARTBEAT:
                    continue
                self._dispatch(msg)
        except (ConnectionClosed, vp.ProtocolError) as exc:
            self.mark_down(f"peer closed the link ({exc})" if not self._stop.is_set() else "closed")

    def _dispatch(self, msg: Message) -> None:
        hdr = msg.header
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
                self.conn.send(vp.message(hdr.msg_id, hdr.command, reply or b"", reply=True))
        except ConnectionClosed:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes an error completion
            err = getattr(exc, "errno", None) or errno.EIO
            log.info("link %s: %s failed: %s", self.name, _cmd_name(hdr.command), exc)
            if not hdr.no_reply:
                self.conn.send(vp.error_reply(hdr.msg_id, hdr.command, err))

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat):
            if not self.up:
                return
            if time.monotonic() - self._last_heard > self.dead_after:
                self.mark_down(f"peer silent for {self.dead_after:.1f} s (heartbeats stopped)")
                return
            self.post(LinkCommand.HEARTBEAT)

    def close(self) -> None:
        self._stop.set()
        self.mark_down("closed")
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(2)

    def stats(self) -> dict:
        return {"up": self.up, "down_reason": self.down_reason, "timeouts": self.timeouts,
                "requests": {k: {"count": c, "wait_us": round(ns / 1000, 1)} for k, (c, ns) in self.requests.items()},
                "posted": dict(self.posted), "received": dict(self.received),
                "handled": {k: {"count": c, "us": round(ns / 1000, 1)} for k, (c, ns) in self.handled.items()}}
