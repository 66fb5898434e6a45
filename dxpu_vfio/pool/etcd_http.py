"""One keep-alive HTTP/1.1 connection to etcd's JSON gateway, just what its POSTs need.

Why not ``http.client``: on a busy host an allocation's latency is mostly CPU, and half
of the client's went to ``http.client`` (py-spy: header parsing through the ``email``
package, a file object per response, two sends per request). This sends a request in one
``sendall`` and reads the answer from one buffer: a body of ``Content-Length`` bytes or
chunked, as Go's server writes them; anything else reads to the end and closes.

Nothing the server says is trusted to be small or quick: a head is at most ``MAX_HEAD``
bytes, a body at most ``MAX_BODY`` (lengths and chunk sizes are digits, or the answer is
malformed), and a whole answer comes within ``ANSWER_TIMEOUTS`` times the connection's
timeout, so a wrong endpoint that streams or trickles costs a bounded wait and buffer.
"""

from __future__ import annotations

import re
import socket
import ssl
import time

MAX_HEAD = 64 << 10  # Go's server writes a few hundred bytes
MAX_BODY = 64 << 20  # the store reads in pages of 2000 records, a few MiB at most
ANSWER_TIMEOUTS = 4  # a whole answer within 4 x the timeout of one receive
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")


class ConnectionClosed(ConnectionError):
    """The server closed the connection before a whole answer came."""


class Connection:
    """POSTs over one TCP (or TLS) connection, opened at the first call."""

    def __init__(self, host: str, port: int, timeout: float, context: ssl.SSLContext | None = None) -> None:
        self.host, self.port, self.timeout, self.context = host, port, timeout, context
        self.sock: socket.socket | None = None
        self._buf = b""
        self._deadline = 0.0  # of the answer being read
        self._head = f"Host: {host}:{port}\r\nContent-Type: application/json\r\nContent-Length: "

    def _open(self) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.context is not None:
            sock = self.context.wrap_socket(sock, server_hostname=self.host)
        self.sock, self._buf = sock, b""
        return sock

    def _more(self, limit: int | None = None) -> None:
        """Receive into the buffer, which must stay under ``limit`` bytes (MAX_BODY)."""
        limit = MAX_BODY if limit is None else limit
        left = self._deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            self.sock.settimeout(min(self.timeout, left))
            data = self.sock.recv(262144)
        except TimeoutError:
            if time.monotonic() < self._deadline:
                raise  # one receive waited its whole timeout
            raise TimeoutError(f"etcd's answer took more than {ANSWER_TIMEOUTS * self.timeout:g} s") from None
        if not data:
            raise ConnectionClosed("etcd closed the connection")
        self._buf += data
        if len(self._buf) > limit:
            raise ValueError(f"more than {limit} bytes where etcd sends less")

    def _take(self, n: int) -> bytes:
        if n > MAX_BODY:
            raise ValueError(f"a body of {n} bytes")
        while len(self._buf) < n:
            self._more(limit=n + MAX_HEAD)  # what follows may be read with it
        data, self._buf = self._buf[:n], self._buf[n:]
        return data

    def _line(self) -> bytes:
        while (end := self._buf.find(b"\r\n")) < 0:
            self._more(limit=MAX_HEAD)
        line, self._buf = self._buf[:end], self._buf[end + 2:]
        return line

    def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """Status and body of ``POST path``; OSError (ConnectionClosed, a timeout, ...) if
        the connection broke, after which it is closed (the next call opens another)."""
        sock = self.sock or self._open()
        self._deadline = time.monotonic() + ANSWER_TIMEOUTS * self.timeout
        try:
            sock.settimeout(self.timeout)
            sock.sendall(f"POST {path} HTTP/1.1\r\n{self._head}{len(body)}\r\n\r\n".encode() + body)
            while (end := self._buf.find(b"\r\n\r\n")) < 0:
                self._more(limit=MAX_HEAD)
            head, self._buf = self._buf[:end].decode("latin-1").split("\r\n"), self._buf[end + 4:]
            status = int(head[0].split(None, 2)[1])
            fields = {}
            for line in head[1:]:
                name, _, value = line.partition(":")
                fields[name.strip().lower()] = value.strip().lower()
            if "content-length" in fields:
                if not fields["content-length"].isdigit():
                    raise ValueError(f"Content-Length {fields['content-length'][:40]!r}")
                data = self._take(int(fields["content-length"]))
            elif fields.get("transfer-encoding") == "chunked":
                parts, size = [], 0
                while True:
                    line = self._line().split(b";", 1)[0].strip()
                    if not _HEX.fullmatch(line):
                        raise ValueError(f"chunk size {line[:40]!r}")
                    if not (chunk := int(line, 16)):
                        break
                    size += chunk
                    parts.append(self._take(chunk if size <= MAX_BODY else MAX_BODY + 1))
                    self._take(2)  # the chunk's CRLF
                while self._line():  # trailers, up to the empty line
                    pass
                data = b"".join(parts)
            else:  # the body runs to the end of the connection
                try:
                    while True:
                        self._more()
                except ConnectionClosed:
                    pass
                if len(self._buf) > MAX_BODY:  # (all of it may have come with the head)
                    raise ValueError(f"more than {MAX_BODY} bytes where etcd sends less")
                data, fields["connection"] = self._buf, "close"
        except (OSError, ValueError, IndexError) as exc:
            self.close()
            if isinstance(exc, OSError):
                raise
            raise ConnectionClosed(f"etcd sent a malformed answer: {exc}") from exc
        if fields.get("connection") == "close":
            self.close()
        return status, data

    def close(self) -> None:
        sock, self.sock = self.sock, None
        self._buf = b""
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass
