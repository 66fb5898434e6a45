"""Admission of a new connection to the remote proxy, apart from what is done with it.

A connection is admitted in two steps, each bounded by ``handshake_timeout`` so a
silent peer cannot hold an admission thread: the TLS handshake (mutual: the peer must
present a certificate of the pool's CA, unless the box runs plaintext) and its first
message. What that message asks for (a device link after HELLO, or a control service)
is the proxy's business; :func:`check_hello` is the rule for HELLO alone.
"""

from __future__ import annotations

import errno
import logging
import socket
import ssl
from collections import Counter

from dxpu_vfio.link.protocol import LINK_VERSION, Hello
from dxpu_vfio.link.transport import TlsFiles, accept_native, tune
from dxpu_vfio.vfio_user import protocol as vp
from dxpu_vfio.vfio_user.connection import Connection, ConnectionClosed, Message

log = logging.getLogger("dxpu.remote")

HANDSHAKE_TIMEOUT = 5.0


class Admission:
    """TLS handshake and first message; counts what it refused in ``refused``."""

    def __init__(self, tls: ssl.SSLContext | None, handshake_timeout: float = HANDSHAKE_TIMEOUT, *,
                 native_tls: TlsFiles | None = None, native: bool = False) -> None:
        self.tls = tls
        self.native = native  # the native stream (C) does framing and TLS: native_tls, or plaintext
        self.native_tls = native_tls
        self.handshake_timeout = handshake_timeout
        self.refused: Counter[str] = Counter({"tls": 0, "hello": 0, "lease": 0, "busy": 0})

    def receive_first(self, sock: socket.socket, peer: tuple) -> tuple[Connection, Message] | None:
        """The connection and its first message, or None (refused, counted, closed). The
        socket keeps the handshake timeout: whoever takes the link over clears it."""
        tune(sock)
        sock.settimeout(self.handshake_timeout)
        try:
            if self.native:
                conn = accept_native(sock, self.native_tls, self.handshake_timeout)
                conn.settimeout(self.handshake_timeout)
            else:
                if self.tls is not None:
                    sock = self.tls.wrap_socket(sock, server_side=True)
                conn = Connection(sock)
        except (ssl.SSLError, OSError, ConnectionClosed) as exc:
            self.refused["tls"] += 1
            log.warning("refused %s: TLS: %s", peer, exc)
            sock.close()
            return None
        try:
            return conn, conn.receive()
        except (vp.ProtocolError, ConnectionClosed, OSError) as exc:
            self.refuse_hello(conn, peer, exc)
            return None

    def refuse_hello(self, conn: Connection, peer: tuple, why: object) -> None:
        self.refused["hello"] += 1
        log.warning("refused %s: %s", peer, why)
        conn.close()


def check_hello(hello: Hello, lease_token: str | None) -> int | None:
    """The errno a HELLO is refused with, or None. ``lease_token``: the named device's
    token, None if the box has no such device. (Whether the device is free is checked
    under the proxy's lock, when the link takes it.)"""
    if hello.version != LINK_VERSION:
        return errno.EPROTO
    if lease_token is None:
        return errno.ENODEV
    if hello.lease != lease_token:
        return errno.EACCES
    return None
