"""The fuzzer's end of a framed stream (vfio-user framing: the vfio-user socket and the
link). What the fuzzer sends is never checked; what the target sends is parsed, routed
(a reply the fuzzer waits for is kept, any other dropped) and the target's own requests
are answered by ``answer``. Sends never block for long: a target that stops reading is a
:class:`Hang`, one that closed the stream :class:`Gone`."""

from __future__ import annotations

import array
import errno
import select
import socket
import time
from typing import Callable

from dxpu_vfio.vfio_user import protocol as vp


class Hang(Exception):
    """The target did not read or answer within the bound."""


class Gone(Exception):
    """The target closed the stream."""


class Violation(Exception):
    """The target did what it must never do (e.g. wrote memory outside every window)."""


# answer(header, payload) -> bytes to send back, or None
Answer = Callable[[vp.Header, bytes], "bytes | None"]


class Peer:
    def __init__(self, sock: socket.socket, answer: Answer | None = None) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.answer = answer
        self.closed = False
        self._buf = bytearray()
        self._want: dict[int, vp.Header | None] = {}
        self._outbox = bytearray()  # answers to the target's requests not sent yet (whole messages, in order)
        self._mid_message = False  # part of a message is sent: nothing else may go until the rest has
        self.requests_seen = 0  # the target's own requests (DMA, heartbeats, interrupts)
        self.reply_payload = b""  # of the last reply :meth:`request` waited for

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, data: bytes, fds: list[int] | tuple = (), deadline: float | None = None) -> None:
        """All of ``data`` (``fds`` with its first byte), reading what the target sends meanwhile."""
        deadline = deadline or time.monotonic() + 5.0
        while self._outbox:  # our answers first, whole: a message never starts inside another
            self._flush()
            if self._outbox:
                self._wait_room(deadline, len(self._outbox))
        view = memoryview(data)
        first = True
        self._mid_message = True  # answers made while we wait for room wait in the outbox
        try:
            while view:
                try:
                    if first and fds:
                        n = self.sock.sendmsg([view], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                        array.array("i", fds))])
                    else:
                        n = self.sock.send(view)
                    first = False
                    view = view[n:]
                    continue
                except BlockingIOError:
                    pass
                except OSError as exc:
                    if exc.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF):
                        self.closed = True
                        raise Gone(str(exc)) from None
                    raise
                self._wait_room(deadline, len(view))
        finally:
            self._mid_message = False
        if self._outbox:
            self._flush()

    def _wait_room(self, deadline: float, left: int) -> None:
        if time.monotonic() > deadline:
            raise Hang(f"the target stopped reading: {left} bytes left to send")
        self.pump(min(0.05, max(0.0, deadline - time.monotonic())), want_out=True)

    def _flush(self) -> None:
        """Send what the outbox holds, as far as the socket takes it now."""
        try:
            while self._outbox:
                n = self.sock.send(self._outbox)
                del self._outbox[:n]
        except BlockingIOError:
            pass
        except OSError as exc:
            self.closed = True
            raise Gone(str(exc)) from None

    def pump(self, timeout: float = 0.0, want_out: bool = False) -> None:
        """Read and handle what the target sent, waiting up to ``timeout`` for something
        (with ``want_out``: or for room to send)."""
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN | (select.POLLOUT if want_out else 0))
        events = poller.poll(int(timeout * 1000))
        if not events or not events[0][1] & (select.POLLIN | select.POLLHUP | select.POLLERR):
            return
        while True:
            try:
                chunk = self.sock.recv(1 << 20)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                self.closed = True
                raise Gone("the target closed the stream")
            self._buf += chunk
            if len(chunk) < 1 << 20:
                break
        self._parse()

    def _parse(self) -> None:
        buf = self._buf
        pos = 0
        while len(buf) - pos >= vp.HEADER_SIZE:
            hdr = vp.Header.unpack(buf[pos:pos + vp.HEADER_SIZE])
            if hdr.size < vp.HEADER_SIZE:
                raise Gone(f"the target sent a message of size {hdr.size}")
            if len(buf) - pos < hdr.size:
                break
            payload = bytes(buf[pos + vp.HEADER_SIZE:pos + hdr.size])
            pos += hdr.size
            if hdr.is_reply:
                if hdr.msg_id in self._want:
                    self._want[hdr.msg_id] = hdr
                    self.reply_payload = payload
                continue
            self.requests_seen += 1
            if self.answer is not None and not hdr.no_reply:
                out = self.answer(hdr, payload)
                if out:
                    self._outbox += out
        del buf[:pos]
        if self._outbox and not self._mid_message:  # never inside a message we are still sending
            self._flush()

    def request(self, data: bytes, msg_id: int, deadline: float, fds: list[int] | tuple = (),
                meanwhile: Callable[[], None] | None = None) -> vp.Header:
        """Send a request and wait for the reply with ``msg_id`` (any reply: an error one too);
        ``meanwhile`` runs between short waits (another stream the reply depends on)."""
        self._want[msg_id] = None
        try:
            self.send(data, fds, deadline)
            while self._want[msg_id] is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Hang(f"no reply to message {msg_id:#x} within the bound")
                if meanwhile is not None:
                    meanwhile()
                self.pump(min(left, 0.5 if meanwhile is None else 0.002))
            return self._want[msg_id]
        finally:
            self._want.pop(msg_id, None)

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass
