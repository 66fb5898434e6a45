"""A vfio-user server endpoint: one device, one UNIX socket, one client at a time.

QEMU's ``vfio-user-pci`` connects (inside ``device_add``), negotiates, maps guest
memory, and then sends config and region accesses; the device (:mod:`.device_api`)
answers through this endpoint and reaches guest memory and interrupts through the ports
the endpoint gives it (:class:`~.dma.DmaTable`, :class:`~.irq.EventfdIrqs`).

The parts, in the order a message meets them: this module listens and accepts (one
client per device, like one slot per card; a second is refused); a :class:`~.session.Session`
per client reads QEMU's messages in order on its own thread; :mod:`.handlers` answers
each request. After the client goes (unplug, or QEMU died) the session releases
everything it held and resets the device, so the next ``device_add`` starts clean.

The accept loop survives ``accept()`` errors (e.g. EMFILE). A window above
``max_dma_window`` (8 TiB, libvfio-user's limit) is refused.

A device that passes QEMU's DMA windows on (the host proxy's link to a box's external
server) has ``dma_mapped(address, size, flags)`` and ``dma_unmapped(address, size, flags)``:
called once the table changed; a refused map is undone and is QEMU's error, and the
session's end unmaps everything (``DMA_UNMAP_ALL``).
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dxpu_vfio.native import stream as native
from dxpu_vfio.vfio_user.connection import Connection, close_listener
from dxpu_vfio.vfio_user.device_api import VfioDevice
from dxpu_vfio.vfio_user.handlers import HANDLERS, ServerOptions, command_name
from dxpu_vfio.vfio_user.session import Session

log = logging.getLogger("dxpu.vfio_user.server")

ACCEPT_RETRY = 0.1  # seconds to wait after an accept() error before the next accept


class SocketInUse(OSError):
    """Another live server already listens on this path."""


@dataclass
class CommandStats:
    count: int = 0
    errors: int = 0
    total_ns: int = 0
    max_ns: int = 0

    def add(self, ns: int, error: bool) -> None:
        self.count += 1
        self.errors += error
        self.total_ns += ns
        self.max_ns = max(self.max_ns, ns)

    def as_dict(self) -> dict:
        return {"count": self.count, "errors": self.errors,
                "mean_us": round(self.total_ns / self.count / 1000, 3) if self.count else None,
                "max_us": round(self.max_ns / 1000, 3)}


def claim_socket_path(path: Path) -> None:
    """Remove a stale socket file, or refuse if a live server still answers there."""
    if not path.exists() and not path.is_symlink():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()  # nobody listens: a leftover of a dead server
        return
    finally:
        probe.close()
    raise SocketInUse(errno.EADDRINUSE, f"a server is already listening on {path}")


def _add_forwarded(counts: dict[str, int], forwarder_counters: dict) -> None:
    """Fold a forwarder's counters into counts by vfio-user command."""
    for command, n in (("REGION_READ", forwarder_counters["reads"]),
                       ("REGION_WRITE", forwarder_counters["writes_posted"] + forwarder_counters["writes_nonposted"])):
        if n:
            counts[command] = counts.get(command, 0) + n


class VfioUserServer:
    """Serves ``device`` on ``socket_path`` until :meth:`stop`."""

    def __init__(self, device: VfioDevice, socket_path: Path, *, name: str = "dev",
                 options: ServerOptions | None = None) -> None:
        self.device = device
        self.socket_path = Path(socket_path)
        self.name = name
        self.options = options or ServerOptions()
        if device.irq_counts().get("msix") and not self.options.allow_msix:
            raise ValueError("device offers MSI-X, which makes QEMU 11.1 abort on device_del; "
                             "use MSI or pass ServerOptions(allow_msix=True)")
        self.handlers = dict(HANDLERS)
        self.stats: dict[int, CommandStats] = {}  # by command number
        self.sessions_served = 0
        self.rejected_connections = 0
        self.accept_errors = 0
        self.protocol_errors = 0
        self.posted_refused = 0  # posted writes the device refused (dropped)
        self.forwarded: dict[str, int] = {}  # QEMU's messages ended sessions' native forwarders handled
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._session: Session | None = None
        self._lock = threading.Lock()
        self._session_done = threading.Condition(self._lock)
        self._stopping = False

    def record(self, command: int, ns: int, error: bool) -> None:
        stats = self.stats.get(command)
        if stats is None:
            stats = self.stats[command] = CommandStats()
        stats.add(ns, error)

    @property
    def session(self) -> Session | None:
        return self._session

    def start(self) -> "VfioUserServer":
        claim_socket_path(self.socket_path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.socket_path))
        listener.listen(4)
        self._listener = listener
        self._accept_thread = threading.Thread(target=self._accept_loop,
                                               name=f"vfio-user-accept-{self.name}", daemon=True)
        self._accept_thread.start()
        return self

    def _accept_loop(self) -> None:
        assert self._listener is not None
        listener = self._listener
        while not self._stopping:
            try:
                sock, _ = listener.accept()
            except OSError as exc:
                if self._stopping:
                    break  # listener closed by stop()
                self.accept_errors += 1  # EMFILE...: the device must stay pluggable once it passes
                if self.accept_errors in (1, 10, 100) or self.accept_errors % 1000 == 0:
                    log.error("%s: accept() failed (%d times so far): %s; retrying", self.name,
                              self.accept_errors, exc)
                time.sleep(ACCEPT_RETRY)
                continue
            with self._lock:
                if self._session is not None or self._stopping:
                    self.rejected_connections += 1
                    sock.close()  # one client per device, like one slot per card
                    continue
                conn = native.unix(sock) if native.enabled() else Connection(sock)
                try:
                    session = Session(self, conn)
                except Exception as exc:  # noqa: BLE001 - e.g. a device that describes itself wrongly:
                    self.rejected_connections += 1  # this client is refused, the next one is accepted
                    log.error("%s: cannot serve a session: %r", self.name, exc)
                    conn.close()
                    continue
                self._session = session
                self.sessions_served += 1
                session.thread.start()

    def session_ended(self, session: Session) -> None:
        with self._lock:  # with the session's going: a snapshot sees its counts once
            if session.forwarder is not None:
                _add_forwarded(self.forwarded, session.forwarder.counters())
            if self._session is session:
                self._session = None
            self._session_done.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no client is connected (e.g. after device_del)."""
        with self._lock:
            return self._session_done.wait_for(lambda: self._session is None, timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Close the socket, drop the client, join every thread. Idempotent."""
        self._stopping = True
        close_listener(self._listener)
        self._listener = None
        with self._lock:  # the accept loop creates and starts a session under it
            session = self._session
        if session is not None:
            session.conn.close()
            session.thread.join(timeout)
        if self._accept_thread is not None:
            self._accept_thread.join(timeout)
        self.socket_path.unlink(missing_ok=True)
        self.device.close()

    def _forwarded_counts(self, s: Session | None) -> dict[str, int]:
        """QEMU's messages the native forwarder handled in C (not in ``commands``: their
        time is the link's wait), of every session so far."""
        counts = dict(self.forwarded)
        if s is not None and s.forwarder is not None:
            _add_forwarded(counts, s.forwarder.counters())
        return counts

    @staticmethod
    def _dma_counters(s: Session) -> dict:
        """The session's DMA, with what the native forwarder did in C (outside the table)."""
        native_dma = s.forwarder.counters() if s.forwarder is not None else {}
        windows = s.dma.windows()
        return {"windows": len(windows), "maps": [[a, n, f, fd] for a, n, f, fd in windows],
                "refused": s.dma.refused + native_dma.get("dma_refused", 0),
                "bytes_read": s.dma.bytes_read + native_dma.get("dma_bytes_read", 0),
                "bytes_written": s.dma.bytes_written + native_dma.get("dma_bytes_written", 0)}

    def snapshot(self) -> dict:
        """Counters for ``dxpu stats`` and benchmarks."""
        with self._lock:
            s = self._session
            forwarded = self._forwarded_counts(s)
        return {"name": self.name, "sessions": self.sessions_served,
                "rejected_connections": self.rejected_connections,
                "protocol_errors": self.protocol_errors, "posted_refused": self.posted_refused,
                "commands": {command_name(k): v.as_dict() for k, v in sorted(self.stats.items())},
                "forwarded": forwarded,
                "dma": None if s is None else self._dma_counters(s),
                "irqs": None if s is None else {**s.irqs.delivered, "dropped": s.irqs.dropped, "lost": s.irqs.lost,
                                                "eventfds": s.irqs.fd_count()}}
