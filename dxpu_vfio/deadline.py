"""A deadline for a whole exchange on a socket, not for each read.

A socket timeout bounds one read; a peer that sends a byte just before each timeout
(slow-loris, a trickling box) stretches an exchange forever. :class:`Deadline` shuts the
socket down when its time is up, which wakes any thread blocked on it (under TLS too:
the descriptor is shut down, not the Python object, so a socket wrapped in TLS after
the deadline was armed is covered as well).
"""

from __future__ import annotations

import os
import socket
import threading


class Deadline:
    """Shut ``sock`` down ``seconds`` from now unless :meth:`cancel` comes first. Call
    :meth:`cancel` before closing the socket: its descriptor number may be reused."""

    def __init__(self, sock: socket.socket, seconds: float) -> None:
        self.seconds = seconds
        self.expired = False
        self._fd = sock.fileno()
        self._lock = threading.Lock()
        self._done = False
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = self.expired = True
            try:
                dup = socket.socket(fileno=os.dup(self._fd))  # shut down the socket, then close only our dup
            except OSError:
                return
            try:
                dup.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            finally:
                dup.close()

    def cancel(self) -> None:
        with self._lock:
            self._done = True
        self._timer.cancel()

