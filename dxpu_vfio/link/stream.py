"""A link socket (TLS or plain TCP) that several threads may use, one at a time.

OpenSSL does not support one thread in ``SSL_read`` while another is in ``SSL_write`` on
the same connection (a threaded stand-in lost completions that way). So the socket is
non-blocking, every call into it (read or write, TLS or not) is made holding one lock,
and a thread that must wait for the socket waits in ``poll`` *without* the lock: a
reader waiting for bytes never blocks a writer, and a writer waiting for room never
blocks the reader that would drain the peer. Whole sends are ordered by a second lock,
so messages from different threads never interleave on the stream.

Bytes TLS already decrypted but not yet returned do not make the descriptor readable:
:meth:`LinkStream.readable` checks ``pending()`` first.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time

_WOULD_BLOCK = (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError, InterruptedError)


class LinkStream:
    """Duck-types the socket methods :class:`~dxpu_vfio.vfio_user.connection.Connection` uses."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.family = sock.family
        self.tls = isinstance(sock, ssl.SSLSocket)
        sock.setblocking(False)
        self._io = threading.Lock()  # held for each call into the socket, never while waiting
        self._send_order = threading.Lock()  # held for a whole sendall
        self._fd = sock.fileno()
        # one poller each for the reader side and the sender side (each used by one thread at a time)
        self._read_poll = select.poll()
        self._read_poll.register(self._fd, select.POLLIN)
        self._send_poll = select.poll()
        self.send_timeout: float | None = None  # a peer that does not read fails a send after this

    def fileno(self) -> int:
        return self._fd

    def pending(self) -> bool:
        """TLS holds decrypted bytes nobody read yet (the fd may not be readable)."""
        return self.tls and self.sock.pending() > 0

    def _wait(self, poller: select.poll, events: int, deadline: float | None) -> None:
        timeout_ms = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000) + 1)
        poller.modify(self._fd, events) if poller is self._read_poll else poller.register(self._fd, events)
        try:
            if not poller.poll(timeout_ms) and deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError("link stream: timed out")
        finally:
            if poller is self._read_poll:
                poller.modify(self._fd, select.POLLIN)
            else:
                poller.unregister(self._fd)

    def readable(self, timeout: float | None) -> bool:
        """Bytes can be read now, or within ``timeout`` seconds (None: wait for ever).
        Only the thread that reads calls this."""
        if self.pending():
            return True
        return bool(self._read_poll.poll(-1 if timeout is None else max(0, int(timeout * 1000))))

    def recv_into(self, view: memoryview, timeout: float | None = None) -> int:
        """Read at least one byte (0 at end of stream); TimeoutError past ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._io:
                try:
                    return self.sock.recv_into(view)
                except ssl.SSLWantWriteError:
                    events = select.POLLOUT
                except _WOULD_BLOCK:
                    events = select.POLLIN
                except ssl.SSLZeroReturnError:
                    return 0
            self._wait(self._read_poll, events, deadline)

    def sendall(self, data: bytes | memoryview) -> None:
        """All of ``data``, in order with other sends; TimeoutError (an OSError: the caller's
        Connection reports ConnectionClosed) past ``send_timeout``."""
        view = memoryview(data).cast("B")
        deadline = None if self.send_timeout is None else time.monotonic() + self.send_timeout
        with self._send_order:
            pos = 0
            while pos < len(view):
                with self._io:
                    try:
                        pos += self.sock.send(view[pos:])
                        continue
                    except ssl.SSLWantReadError:
                        events = select.POLLIN
                    except _WOULD_BLOCK:
                        events = select.POLLOUT
                self._wait(self._send_poll, events, deadline)

    def settimeout(self, _timeout: float | None) -> None:
        """Waits are bounded by the callers' own timeouts; the socket stays non-blocking."""

    def shutdown(self, how: int) -> None:
        self.sock.shutdown(how)

    def close(self) -> None:
        self.sock.close()
