"""One keep-alive HTTP/1.1 connection to etcd's JSON gateway, just what its POSTs need.

Why not ``http.client``: on a busy host an allocation's latency is mostly CPU, and half
of the client's went to ``http.client`` (py-spy: header parsing through the ``email``
package, a file object per response, two sends per request). This sends a request in one
``sendall`` and reads the answer from one buffer: a body of ``Content-Length`` bytes or
chunked, as Go's server writes them; anything else reads to the end and closes.
"""

from __future__ import annotations

import socket
import ssl


class ConnectionClosed(ConnectionError):
    """The server closed the connection before a whole answer came."""


class Connection:
    """POSTs over one TCP (or TLS) connection, opened at the first call."""

    def __init__(self, host: str, port: int, timeout: float, context: ssl.SSLContext | None = None) -> None:
        self.host, self.port, self.timeout, self.context = host, port, timeout, context
        self.sock: socket.socket | None = None
        self._buf = b""
        self._head = f"Host: {host}:{port}\r\nContent-Type: application/json\r\nContent-Length: "

    def _open(self) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.context is not None:
            sock = self.context.wrap_socket(sock, server_hostname=self.host)
        self.sock, self._buf = sock, b""
        return sock

    def _more(self) -> None:
        data = self.sock.recv(262144)
        if not data:
            raise ConnectionClosed("etcd closed the connection")
        self._buf += data

    def _take(self, n: int) -> bytes:
        while len(self._buf) < n:
            self._more()
        data, self._buf = self._buf[:n], self._buf[n:]
        return data

    def _line(self) -> bytes:
        while (end := self._buf.find(b"\r\n")) < 0:
            self._more()
        line, self._buf = self._buf[:end], self._buf[end + 2:]
        return line

    def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """Status and body of ``POST path``; OSError (ConnectionClosed, a timeout, ...) if
        the connection broke, after which it is closed (the next call opens another)."""
        sock = self.sock or self._open()
        try:
            sock.sendall(f"POST {path} HTTP/1.1\r\n{self._head}{len(body)}\r\n\r\n".encode() + body)
            while (end := self._buf.find(b"\r\n\r\n")) < 0:
                self._more()
            head, self._buf = self._buf[:end].decode("latin-1").split("\r\n"), self._buf[end + 4:]
            status = int(head[0].split(None, 2)[1])
            fields = {}
            for line in head[1:]:
                name, _, value = line.partition(":")
                fields[name.strip().lower()] = value.strip().lower()
            if "content-length" in fields:
                data = self._take(int(fields["content-length"]))
            elif fields.get("transfer-encoding") == "chunked":
                parts = []
                while size := int(self._line().split(b";", 1)[0], 16):
                    parts.append(self._take(size))
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
