"""Admission of a new connection to the remote proxy, apart from what is done with it.

A connection is admitted in two steps, together bounded by ``handshake_timeout`` (a
deadline for both, not a timeout per read) so a silent or trickling peer cannot hold an
admission thread: the TLS handshake (mutual: the peer must present a certificate of the
pool's CA, unless the box runs plaintext) and its first message. The proxy admits at
most ``MAX_ADMITTING`` connections at once (:mod:`dxpu_vfio.remoteproxy.proxy`). What that message asks for (a device link after HELLO, or a control service)
is the proxy's business; :func:`check_hello` is the rule for HELLO alone: the box answers
a first HELLO with a fresh nonce and admits the second only with a proof of a lease token
over that nonce (docs/link-protocol.md), so a recorded HELLO is worth nothing.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import ssl
from collections import Counter

from dxpu_vfio.deadline import Deadline
from dxpu_vfio.link.protocol import LINK_VERSION, Hello, proof_matches
from dxpu_vfio.link.transport import TlsFiles, accept_native, tune
from dxpu_vfio.vfio_user import protocol as vp
from dxpu_vfio.vfio_user.connection import Connection, ConnectionClosed, Message, ReceiveTimeout

log = logging.getLogger("dxpu.remote")

HANDSHAKE_TIMEOUT = 5.0  # seconds for the TLS handshake and the first message together
MAX_ADMITTING = 32  # connections between accept() and their first message, at once


class Admission:
    """TLS handshake and first message; counts what it refused in ``refused``."""

    def __init__(self, tls: ssl.SSLContext | None, handshake_timeout: float = HANDSHAKE_TIMEOUT, *,
                 native_tls: TlsFiles | None = None, native: bool = False) -> None:
        self.tls = tls
        self.native = native  # the native stream (C) does framing and TLS: native_tls, or plaintext
        self.native_tls = native_tls
        self.handshake_timeout = handshake_timeout
        self.refused: Counter[str] = Counter({"tls": 0, "hello": 0, "lease": 0, "busy": 0, "crowd": 0})

    def receive_first(self, sock: socket.socket, peer: tuple) -> tuple[Connection, Message] | None:
        """The connection and its first message, or None (refused, counted, closed). The
        socket keeps the handshake timeout: whoever takes the link over clears it."""
        try:
            tune(sock)
        except OSError as exc:  # the peer already reset it
            log.info("refused %s: %s", peer, exc)
            sock.close()
            return None
        sock.settimeout(self.handshake_timeout)
        deadline = Deadline(sock, self.handshake_timeout)
        late = f"no whole handshake and first message in {self.handshake_timeout} s"
        try:
            if self.native:  # the stream gets a descriptor of its own; ``sock`` (the deadline's) closes last
                own = socket.socket(fileno=os.dup(sock.fileno()))
                conn = accept_native(own, self.native_tls, self.handshake_timeout)
                conn.settimeout(self.handshake_timeout)
            else:
                if self.tls is not None:
                    sock = self.tls.wrap_socket(sock, server_side=True)
                conn = Connection(sock)
        except (ssl.SSLError, OSError, ConnectionClosed) as exc:
            deadline.cancel()
            self.refused["tls"] += 1
            log.warning("refused %s: TLS: %s", peer, late if deadline.expired else exc)
            sock.close()
            return None
        try:
            return conn, conn.receive()
        except (vp.ProtocolError, ConnectionClosed, ReceiveTimeout, OSError) as exc:
            deadline.cancel()
            self.refuse_hello(conn, peer, late if deadline.expired or isinstance(exc, (TimeoutError, ReceiveTimeout)) else exc)
            return None
        finally:
            deadline.cancel()
            if self.native:
                sock.close()  # the native stream has its own descriptor

    def refuse_hello(self, conn: Connection, peer: tuple, why: object) -> None:
        self.refused["hello"] += 1
        log.warning("refused %s: %s", peer, why)
        conn.close()


def check_hello(hello: Hello, tokens: list[str] | None, nonce: str | None = None) -> int | None:
    """The errno a HELLO is refused with, or None. ``tokens``: those that admit to the
    named device now (a granted one, else its static one; :mod:`dxpu_vfio.remoteproxy.grants`),
    None if the box has no such device. ``nonce``: None for the first HELLO, which must
    carry no proof (a recorded second HELLO replayed as a first is refused); else the
    nonce this connection was challenged with, which the proof must answer. (Whether the
    device is free is checked under the proxy's lock, when the link takes it.)"""
    if hello.version != LINK_VERSION:
        return errno.EPROTO
    if tokens is None:
        return errno.ENODEV
    if nonce is None:
        return errno.EACCES if hello.proof or hello.nonce else None
    if hello.nonce != nonce or not any(proof_matches(hello.proof, t, hello.device, nonce) for t in tokens):
        return errno.EACCES
    return None
