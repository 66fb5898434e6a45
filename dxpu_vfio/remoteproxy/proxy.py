"""The remote proxy (DxPU_PROXY in the GPU box): serves a box's devices over the link.

Each device of the box (:mod:`dxpu_vfio.remoteproxy.config`) is one model instance that
lives as long as the proxy; one host link at a time may drive it, after a HELLO naming
the device and a lease token the box accepts (:mod:`dxpu_vfio.remoteproxy.admission`).
The link's reader thread performs region accesses in stream order; the device reaches
guest memory and raises interrupts through the link ports
(:mod:`dxpu_vfio.remoteproxy.ports`). Connections that ask for a control service
instead of a device go to :mod:`dxpu_vfio.remoteproxy.control`.

The accept loop never ends but by :meth:`RemoteProxy.stop`: an ``accept()`` error (no
descriptors left, a connection reset before it was accepted) is counted, logged and
retried after a pause. At most ``MAX_ADMITTING`` connections are between ``accept()``
and their first message at once; more are closed at once (counted as ``crowd``).
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time

from dxpu_vfio.link.endpoint import LinkEndpoint
from dxpu_vfio.link.protocol import DeviceDescription, Hello, LinkCommand
from dxpu_vfio.link.transport import TlsFiles, server_context
from dxpu_vfio.native import stream as native
from dxpu_vfio.remoteproxy.admission import MAX_ADMITTING, Admission, check_hello
from dxpu_vfio.remoteproxy.config import EXTERNAL_MODEL, BoxConfig, BoxDevice
from dxpu_vfio.remoteproxy.control import CONTROL_COMMANDS, ControlServices
from dxpu_vfio.remoteproxy.external import ExternalFunction
from dxpu_vfio.remoteproxy.ports import LinkDmaPort, LinkIrqPort
from dxpu_vfio.vfio_user import protocol as vp
from dxpu_vfio.vfio_user.connection import Connection, ConnectionClosed, Message, close_listener
from dxpu_vfio.vfio_user.posted import unpack_batch
from qemu_device.device import PciFunction
from qemu_device.models import create_model
from qemu_device.ports import NullDmaPort, NullIrqPort

log = logging.getLogger("dxpu.remote")

ACCEPT_RETRY = 0.1  # seconds to wait after an accept() error (e.g. EMFILE) before the next accept


def describe(model: str, device: PciFunction) -> DeviceDescription:
    return DeviceDescription(model, [(r.index, r.size, r.readable, r.writable) for r in device.regions()],
                             device.irq_counts(), device.coalesce_posted)


class Slot:
    """One device of the box and the link that drives it now (if any)."""

    def __init__(self, spec: BoxDevice) -> None:
        self.spec = spec
        if spec.model == EXTERNAL_MODEL:  # an external vfio-user server, reached by its socket
            self.device = ExternalFunction(**spec.settings)
        else:
            self.device = create_model(spec.model, **spec.settings)
        self.endpoint: LinkEndpoint | None = None
        self.links_served = 0
        self.dma: LinkDmaPort | None = None
        self.irq: LinkIrqPort | None = None

    def in_use(self) -> bool:
        return self.endpoint is not None and self.endpoint.up

    def snapshot(self) -> dict:
        return {"model": self.spec.model, "links": self.links_served,
                "link": self.endpoint.stats() if self.endpoint else None,
                "dma_bytes_read": self.dma.bytes_read if self.dma else 0,
                "dma_bytes_written": self.dma.bytes_written if self.dma else 0,
                "irqs_sent": self.irq.sent if self.irq else 0,
                "device": self.device.stats() if hasattr(self.device, "stats") else None}


class RemoteProxy:
    def __init__(self, config: BoxConfig) -> None:
        self.config = config
        self.slots = {d.id: Slot(d) for d in config.devices}
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        files = None if config.plaintext else TlsFiles.in_dir(config.tls_dir, config.name)
        if native.enabled():
            self.admission = Admission(None, native=True, native_tls=files)
        else:
            self.admission = Admission(server_context(files) if files else None)
        self.control = ControlServices(config.name, self.slots)
        self.port = config.port
        self.max_admitting = MAX_ADMITTING
        self._admitting: threading.BoundedSemaphore | None = None
        self._stopping = False
        self.accept_errors = 0

    @property
    def refused(self) -> dict[str, int]:
        return dict(self.admission.refused)

    def start(self) -> "RemoteProxy":
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.config.listen, self.config.port))
        listener.listen(16)
        self.port = listener.getsockname()[1]
        self._listener = listener
        self._admitting = threading.BoundedSemaphore(self.max_admitting)
        threading.Thread(target=self._accept_loop, name="remote-accept", daemon=True).start()
        return self

    def _accept_loop(self) -> None:
        listener, admitting = self._listener, self._admitting
        assert listener is not None and admitting is not None
        while not self._stopping:
            try:
                sock, peer = listener.accept()
            except OSError as exc:
                if self._stopping:
                    return
                self.accept_errors += 1  # EMFILE, ENFILE, ENOBUFS, ECONNABORTED...: the box must keep serving
                if self.accept_errors in (1, 10, 100) or self.accept_errors % 1000 == 0:
                    log.error("accept() failed (%d times so far): %s; retrying", self.accept_errors, exc)
                time.sleep(ACCEPT_RETRY)
                continue
            if not admitting.acquire(blocking=False):
                self.admission.refused["crowd"] += 1
                if self.admission.refused["crowd"] in (1, 10, 100) or self.admission.refused["crowd"] % 1000 == 0:
                    log.warning("refused %s: %d connections are being admitted already (%d refused so far)",
                                peer, self.max_admitting, self.admission.refused["crowd"])
                sock.close()
                continue
            try:
                threading.Thread(target=self._admit, args=(sock, peer), name=f"remote-admit-{peer}",
                                 daemon=True).start()
            except RuntimeError as exc:  # no thread could be started
                admitting.release()
                log.error("refused %s: %s", peer, exc)
                sock.close()

    def _admit(self, sock: socket.socket, peer: tuple) -> None:
        try:
            first = self.admission.receive_first(sock, peer)
        finally:
            assert self._admitting is not None
            self._admitting.release()
        if first is None:
            return
        conn, msg = first
        try:
            if msg.header.command in CONTROL_COMMANDS:
                self.control.serve(conn, msg)
            elif msg.header.command == LinkCommand.HELLO:
                self._take_link(conn, msg, peer)
            else:
                self.admission.refuse_hello(conn, peer, "first message must be HELLO")
        except (ConnectionClosed, OSError) as exc:
            log.info("%s went away while being admitted: %s", peer, exc)
            conn.close()

    def _take_link(self, conn: Connection, msg: Message, peer: tuple) -> None:
        """HELLO and lease check; then the device belongs to this link."""
        try:
            hello = Hello.unpack(msg.payload)
        except vp.ProtocolError as exc:
            self.admission.refuse_hello(conn, peer, exc)
            return
        slot = self.slots.get(hello.device)
        err = check_hello(hello, slot.spec.lease if slot else None)
        if err == errno.EACCES:
            self.admission.refused["lease"] += 1
        old = None
        if err is None:
            with self._lock:
                if slot.in_use():
                    err = errno.EBUSY
                    self.admission.refused["busy"] += 1
                else:
                    old = slot.endpoint
                    slot.endpoint = LinkEndpoint(conn, f"{self.config.name}/{slot.spec.id}",
                                                 self._handlers(slot), on_down=lambda r, s=slot: self._released(s, r),
                                                 region_access=self._region_access(slot),
                                                 heartbeat=self.config.heartbeat, dead_after=self.config.dead_after)
        if err is not None:
            log.warning("refused %s for device %r: %s", peer, hello.device, errno.errorcode[err])
            try:
                conn.send(vp.error_reply(msg.header.msg_id, msg.header.command, err))
            finally:
                conn.close()
            return
        if old is not None:
            old.close()  # the link before, down: its descriptors go now
        if getattr(conn, "native", False) and self.config.spin_us:
            conn.stream.spin_us = self.config.spin_us
        slot.links_served += 1
        slot.dma, slot.irq = LinkDmaPort(slot.endpoint), LinkIrqPort(slot.endpoint)
        with slot.device.lock:
            slot.device.vmm_masks_msix = True  # the host's QEMU keeps the MSI-X table
            slot.device.attach(slot.dma, slot.irq)
        conn.send(vp.message(msg.header.msg_id, msg.header.command,
                             describe(slot.spec.model, slot.device).pack(), reply=True))
        slot.endpoint.start()

    def _released(self, slot: Slot, reason: str) -> None:
        """The link went down: the device forgets its host and is reset for the next lease."""
        with slot.device.lock:
            slot.device.attach(NullDmaPort(), NullIrqPort())
            slot.device.reset()

    def _handlers(self, slot: Slot) -> dict:
        device = slot.device

        def region_read(msg):
            req = vp.RegionAccess.unpack(msg.payload, write=False)
            with device.lock:
                data = device.region_read(req.region, req.offset, req.count)
            return vp.RegionAccess(req.region, req.offset, req.count, data).pack()

        def region_write(msg):
            req = vp.RegionAccess.unpack(msg.payload, write=True)
            with device.lock:
                device.region_write(req.region, req.offset, req.data, posted=msg.header.no_reply)
            return vp.RegionAccess(req.region, req.offset, req.count).pack()

        def write_batch(msg):  # posted runs, applied in order
            with device.lock:
                for region, offset, data in unpack_batch(msg.payload):
                    device.region_write(region, offset, data, posted=True)

        def reset(msg):
            with device.lock:
                device.reset()
            return b""

        def sync(msg):  # the reader got here, so everything before it is done
            return b""

        return {LinkCommand.REGION_READ: region_read, LinkCommand.REGION_WRITE: region_write,
                LinkCommand.WRITE_BATCH: write_batch, LinkCommand.DEVICE_RESET: reset, LinkCommand.SYNC: sync}

    def _region_access(self, slot: Slot) -> tuple:
        """(read, write) for the native reader (native/serve.c): the same work as the
        REGION_READ/REGION_WRITE handlers, with an errno instead of an exception."""
        device, name = slot.device, f"{self.config.name}/{slot.spec.id}"

        def read(region: int, offset: int, count: int):
            try:
                with device.lock:
                    return device.region_read(region, offset, count)
            except Exception as exc:  # noqa: BLE001 - every failure becomes an error completion
                log.info("link %s: REGION_READ failed: %s", name, exc)
                return getattr(exc, "errno", None) or errno.EIO

        def write(region: int, offset: int, data: bytes, posted: bool):
            try:
                with device.lock:
                    device.region_write(region, offset, data, posted=posted)
            except Exception as exc:  # noqa: BLE001 - a posted one is dropped, like on PCIe
                log.info("link %s: REGION_WRITE failed: %s", name, exc)
                return getattr(exc, "errno", None) or errno.EIO
            return None

        return read, write

    def inventory(self) -> dict:
        return self.control.inventory()

    def snapshot(self) -> dict:
        return {"box": self.config.name, "port": self.port, "refused": self.refused,
                "accept_errors": self.accept_errors,
                "devices": {sid: s.snapshot() for sid, s in self.slots.items()}}

    def screenshots(self):
        """Every display's scanout, for SIGUSR2 (:mod:`dxpu_vfio.daemon`)."""
        for dev_id, slot in self.slots.items():
            if hasattr(slot.device, "render_png"):
                try:
                    yield dev_id, slot.device.render_png()
                except ValueError as exc:  # an invalid mode (DisplayModeError): no file for this one
                    log.warning("screenshot of %s skipped: %s", dev_id, exc)

    def stop(self) -> None:
        self._stopping = True
        close_listener(self._listener)
        self._listener = None
        for slot in self.slots.values():
            if slot.endpoint is not None:
                slot.endpoint.close()
            close = getattr(slot.device, "close", None)
            if close:
                close()
