"""The fuzzer as a peer that others connect to (a box a manager asks, a guest's agent, a
relay in front of etcd): a listening socket whose connections are each served on a thread
of their own, until :meth:`Listener.close`."""

from __future__ import annotations

import socket
import threading
from typing import Callable

from dxpu_vfio.vfio_user.connection import close_listener


class Listener:
    """Accepts on ``sock`` and runs ``serve(conn)`` on a thread per connection; the
    connection is closed when ``serve`` returns. Other sockets a server opens for a
    connection (a relay's upstream) may be :meth:`track`-ed, so :meth:`close` shuts them too."""

    def __init__(self, sock: socket.socket, serve: Callable[[socket.socket], None], name: str) -> None:
        self.sock, self.serve, self.name = sock, serve, name
        self.closing = False
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self.thread = threading.Thread(target=self._accept, name=name, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.closing:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.track(conn)
            threading.Thread(target=self._run, args=(conn,), name=f"{self.name}-conn", daemon=True).start()

    def _run(self, conn: socket.socket) -> None:
        try:
            self.serve(conn)
        except OSError:
            pass  # the peer went away, or close() shut the connection
        finally:
            self.forget(conn)
            conn.close()

    def track(self, sock: socket.socket) -> socket.socket:
        with self._lock:
            self._open.add(sock)
        return sock

    def forget(self, sock: socket.socket) -> None:
        with self._lock:
            self._open.discard(sock)

    def close(self) -> None:
        """Stop accepting (a shutdown wakes the accept; closing the socket alone does not)
        and shut every connection still open, so their threads end."""
        self.closing = True
        close_listener(self.sock)
        with self._lock:
            still = list(self._open)
        for sock in still:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.thread.join(5)
