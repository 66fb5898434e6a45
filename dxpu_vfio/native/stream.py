"""The native stream: message framing (and TLS) in C (``fastlink.c``), behind the
interface of :class:`~dxpu_vfio.vfio_user.connection.Connection`. Two uses: the link
between the proxies (TCP + mutual TLS, :mod:`dxpu_vfio.link.transport`) and the vfio-user
server's connection to QEMU (a UNIX socket; descriptors travel with messages).

Why: a register read crosses the Python layers of a stream (ssl.SSLSocket, the stream's
locks and polls, the buffer, the header) four times, and on these machines each costs
microseconds (docs/benchmarks-history.md, "The native stream and forwarder (C)"). The C stream sends a framed message
in one call and returns the next whole message in one call, the GIL released while it
waits. What messages mean stays in Python.

It is used wherever it is built (``scripts/setup.sh`` builds it) unless ``DXPU_FASTLINK=0``:
the Python streams (:class:`~dxpu_vfio.vfio_user.connection.Connection`,
:class:`~dxpu_vfio.link.stream.LinkStream`) stay as the reference, the fallback, and the
other half of a same-run comparison (``scripts/bench_remote.py --streams``).
``DXPU_FASTLINK_SO`` loads another build of the module (the sanitized one, ``scripts/sanitize.sh``).
"""

from __future__ import annotations

import array
import importlib.util
import os
import socket
import sys
from pathlib import Path
from types import ModuleType
from typing import Protocol

from dxpu_vfio.errors import SetupError
from dxpu_vfio.vfio_user.connection import ConnectionClosed, Message, ReceiveTimeout
from dxpu_vfio.vfio_user.protocol import HEADER_SIZE, MAX_MESSAGE, TYPE_COMMAND, Header, ProtocolError

SEND_BATCH_MAX = 64  # messages per send_messages call (fastlink.c's SEND_BATCH_MAX)


class TlsFiles(Protocol):
    """Where the CA, certificate and key are (:class:`dxpu_vfio.link.transport.TlsFiles`)."""

    ca: Path
    cert: Path
    key: Path


def _load() -> ModuleType | None:
    override = os.environ.get("DXPU_FASTLINK_SO")
    if override:  # e.g. the ASan build: it must be what runs, or the run checks nothing
        spec = importlib.util.spec_from_file_location("dxpu_vfio.native._fastlink", override)
        if spec is None or spec.loader is None:
            raise SetupError(f"DXPU_FASTLINK_SO={override} is not a loadable module",
                             hint="scripts/build_native.py --sanitize builds one")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["dxpu_vfio.native._fastlink"] = module
        return module
    try:
        from dxpu_vfio.native import _fastlink
    except ImportError:
        return None
    return _fastlink


_native = _load()


def built() -> bool:
    return _native is not None


def enabled() -> bool:
    """Streams are native: the module is built and not switched off with DXPU_FASTLINK=0."""
    return _native is not None and os.environ.get("DXPU_FASTLINK", "1") != "0"


def module_path() -> Path | None:
    return Path(_native.__file__) if _native is not None else None


def require() -> ModuleType:
    if _native is None:
        raise SetupError("the native stream (dxpu_vfio/native/_fastlink) is not built",
                         hint="run scripts/setup.sh (or: .venv/bin/python scripts/build_native.py)")
    return _native


_contexts: dict[tuple, object] = {}


def tls_context(files: TlsFiles, server: bool):
    """One context per certificate set and side (loading keys costs milliseconds)."""
    key = (str(files.ca), str(files.cert), str(files.key), server)
    if key not in _contexts:
        try:
            _contexts[key] = require().TlsContext(str(files.ca), str(files.cert), str(files.key), server)
        except ValueError as exc:
            raise SetupError(f"TLS files in {files.cert.parent} cannot be used: {exc}",
                             hint="dxpu certs DIR ROLE... writes a CA and certificates") from exc
    return _contexts[key]


class NativeConnection:
    """A stream in C with the faces its users need: a Connection's (send/receive) and, for
    the link, a :class:`~dxpu_vfio.link.stream.LinkStream`'s (readable/pending/fileno/
    shutdown); so ``conn.sock`` is the connection itself."""

    native = True  # LinkEndpoint: framing in C, use receive_raw/exchange

    def __init__(self, stream, family: int = socket.AF_INET) -> None:
        self.stream = stream
        self.sock = self
        self.family = family
        self.tls = stream.tls
        self.closed = False
        self._timeout: float | None = None
        self._closed_exc = require().Closed
        self._bad_frame = require().BadFrame

    # --- a Connection's face --------------------------------------------------------
    def send(self, data: bytes, fds: list[int] | None = None) -> None:
        if fds:
            if self.family != socket.AF_UNIX:
                raise ProtocolError("descriptors cannot travel on the link")
            self._send_with_fds(data, fds)
            return
        try:
            self.stream.send(data)
        except (self._closed_exc, TimeoutError) as exc:
            raise ConnectionClosed(str(exc)) from exc

    def _send_with_fds(self, data: bytes, fds: list[int]) -> None:
        """A reply that carries descriptors (GET_REGION_INFO of a mappable region): the C
        stream sends bytes alone, so this goes out with ``sendmsg`` on its socket. Its sends
        complete before they return, so nothing of the stream's is left to pass; the only
        caller is the session thread while QEMU waits for this very reply."""
        sock = socket.socket(fileno=os.dup(self.stream.fileno()))
        try:
            sock.settimeout(5.0)
            sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            if sent < len(data):
                sock.sendall(data[sent:])
        except OSError as exc:
            raise ConnectionClosed(str(exc)) from exc
        finally:
            sock.close()

    def send_message(self, msg_id: int, command: int, flags: int, payload: bytes | tuple = b"") -> None:
        try:
            self.stream.send_message(msg_id, command, flags, payload)
        except (self._closed_exc, TimeoutError) as exc:
            raise ConnectionClosed(str(exc)) from exc

    def send_messages(self, messages: list[tuple[int, int, int, bytes | tuple]]) -> None:
        """Several messages, in order, staged into as few writes (TLS records) as they fit."""
        try:
            for start in range(0, len(messages), SEND_BATCH_MAX):
                self.stream.send_messages(messages[start:start + SEND_BATCH_MAX])
        except (self._closed_exc, TimeoutError) as exc:
            raise ConnectionClosed(str(exc)) from exc

    def cork(self) -> None:
        """This thread's posted messages stay in the stream until the next send that does
        not, or :meth:`uncork`, and then leave as one write and as few TLS records as they
        fit (``Stream_cork`` in fastlink.c says why)."""
        self.stream.cork()

    def uncork(self) -> None:
        """What :meth:`cork` held leaves now."""
        try:
            self.stream.uncork()
        except (self._closed_exc, TimeoutError) as exc:
            raise ConnectionClosed(str(exc)) from exc

    def receive(self, timeout: float | None = None) -> Message:
        """The next whole message; ReceiveTimeout after ``timeout`` (default: the one
        :meth:`settimeout` set), what arrived so far staying buffered."""
        try:
            got = self.stream.receive(self._timeout if timeout is None else timeout)
        except self._closed_exc as exc:
            raise ConnectionClosed(str(exc)) from exc
        except self._bad_frame as exc:
            raise ProtocolError(str(exc)) from exc
        if got is None:
            raise ReceiveTimeout("link stream: timed out")
        if len(got) == 6:  # a UNIX socket: with the message's descriptors
            msg_id, command, flags, error, payload, fds = got
            return Message(Header(msg_id, command, HEADER_SIZE + len(payload), flags, error), memoryview(payload), fds)
        msg_id, command, flags, error, payload = got
        return Message(Header(msg_id, command, HEADER_SIZE + len(payload), flags, error), memoryview(payload))

    def exchange(self, msg_id: int, command: int, payload: bytes, timeout: float) -> tuple | None:
        """Send a request and return the next message received within ``timeout`` as
        (msg_id, command, flags, error, payload), or None: one call into C for the thread
        that reads its own completion (which it must still recognise as its own)."""
        try:
            return self.stream.exchange(msg_id, command, TYPE_COMMAND, payload, timeout)
        except (self._closed_exc, TimeoutError) as exc:
            raise ConnectionClosed(str(exc)) from exc
        except self._bad_frame as exc:
            raise ProtocolError(str(exc)) from exc

    def receive_raw(self, timeout: float) -> tuple | None:
        """:meth:`receive` as a tuple, None after ``timeout``."""
        try:
            return self.stream.receive(timeout)
        except self._closed_exc as exc:
            raise ConnectionClosed(str(exc)) from exc
        except self._bad_frame as exc:
            raise ProtocolError(str(exc)) from exc

    def has_message(self) -> bool:
        return self.stream.has_message()

    # --- a LinkStream's face ---------------------------------------------------------
    def readable(self, timeout: float | None) -> bool:
        return self.stream.readable(timeout)

    def pending(self) -> bool:
        return self.stream.pending()

    def fileno(self) -> int:
        return self.stream.fileno()

    def settimeout(self, timeout: float | None) -> None:
        """The default timeout of :meth:`receive` (None: for ever), as a socket's would be."""
        self._timeout = timeout

    def set_send_timeout(self, timeout: float | None) -> None:
        """How long a send may wait for a peer that does not read (None: for ever)."""
        self.stream.send_timeout = timeout

    def shutdown(self, _how: int = socket.SHUT_RDWR) -> None:
        self.stream.shutdown()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.stream.close()

    def stats(self) -> dict:
        return self.stream.stats()


def tcp(sock: socket.socket, tls: TlsFiles | None, server: bool, handshake_timeout: float) -> NativeConnection:
    """Hand a connected TCP socket to a native stream (which owns it from here on); with
    ``tls``, after a mutual TLS handshake bounded by ``handshake_timeout``."""
    module = require()
    ctx = tls_context(tls, server) if tls is not None else None
    fd = sock.detach()
    try:
        stream = module.Stream(fd, ctx, max_message=MAX_MESSAGE, handshake_timeout=handshake_timeout)
    except module.TlsError as exc:
        raise ConnectionClosed(str(exc)) from exc
    return NativeConnection(stream)


def unix(sock: socket.socket) -> NativeConnection:
    """A vfio-user connection (UNIX socket, descriptors with messages) on the native stream."""
    return NativeConnection(require().Stream(sock.detach(), None, max_message=MAX_MESSAGE), socket.AF_UNIX)
