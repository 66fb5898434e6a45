"""Limits of the manager's HTTP listeners, so that idle or slow peers cannot use it up.

Every connection is a thread and a descriptor: a listener serves at most
``max_connections`` at once and closes the connections beyond that at once; a request
must arrive whole (request line, headers and body) within ``request_deadline`` s of the
connect, or the connection is closed; and no single read or write waits longer than
``io_timeout`` s. The API also refuses a body larger than :data:`MAX_BODY` (413) and
checks the token before it reads one (see :mod:`dxpu_vfio.pool.service`).
"""

from __future__ import annotations

import logging
import socket
import socketserver
import sys
import threading

from dxpu_vfio.deadline import Deadline

log = logging.getLogger("dxpu.manager")

MAX_BODY = 64 << 10  # the API's requests are a few small JSON fields
API_CONNECTIONS = 64  # the root-only API socket
METRICS_CONNECTIONS = 16  # the unauthenticated --metrics TCP listener
REQUEST_DEADLINE = 10.0  # seconds from connect to a whole request
IO_TIMEOUT = 10.0  # seconds any one read or write may wait


class BoundedServer(socketserver.ThreadingMixIn):
    """A threading server that serves at most ``max_connections`` connections at once;
    the handler (:class:`DeadlineHandler`) bounds their time."""

    daemon_threads = True
    block_on_close = False
    max_connections = API_CONNECTIONS
    request_deadline = REQUEST_DEADLINE

    def server_activate(self) -> None:
        super().server_activate()
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self.refused_connections = 0

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused_connections += 1
            if self.refused_connections in (1, 10, 100) or self.refused_connections % 1000 == 0:
                log.warning("%s: %d connections refused (%d at once is the limit)", type(self).__name__,
                            self.refused_connections, self.max_connections)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def handle_error(self, request, client_address) -> None:
        """A peer that went away mid-request is a line in the log, not a traceback on stderr."""
        log.info("%s: connection %s ended: %r", type(self).__name__, client_address or "unix", sys.exc_info()[1])

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class DeadlineHandler:
    """Mixin for a ``BaseHTTPRequestHandler``: per-operation ``timeout`` and a deadline for
    the whole request; call :meth:`request_read` once it is read (and authorized)."""

    timeout = IO_TIMEOUT
    connection: socket.socket
    server: BoundedServer

    def setup(self) -> None:
        super().setup()  # type: ignore[misc]  # applies self.timeout to the connection
        self._deadline = Deadline(self.connection, self.server.request_deadline)

    def request_read(self) -> None:
        """The request is in: what it asks for may take longer than the deadline."""
        self._deadline.cancel()

    def finish(self) -> None:
        self._deadline.cancel()
        super().finish()  # type: ignore[misc]
