"""The remote proxy (DxPU_PROXY in the GPU box): serves a box's devices over the link.

Each device of the box (:mod:`dxpu_vfio.remoteproxy.config`) is one model instance that
lives as long as the proxy; one host link at a time may drive it, after a HELLO naming
the device and proving a lease token the box accepts (:mod:`dxpu_vfio.remoteproxy.admission`,
:mod:`dxpu_vfio.remoteproxy.grants`).
The link's reader thread performs region accesses in stream order; the device reaches
guest memory and raises interrupts through the link ports
(:mod:`dxpu_vfio.remoteproxy.ports`). Connections that ask for a control service
instead of a device go to :mod:`dxpu_vfio.remoteproxy.control`. Test faults armed by a
manager (:mod:`dxpu_vfio.remoteproxy.faults`) are applied where the box serves: the region
access callbacks (Python handlers and the native reader's alike), the posted writes and
the DMA port.

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

from dxpu_vfio.deadline import Deadline
from dxpu_vfio.link.endpoint import LinkEndpoint
from dxpu_vfio.link.protocol import (FEATURE_DMA_READV, FEATURE_DMA_WRITEV, FEATURE_RING_PUSH,
                                     FEATURE_SHADOW_DOORBELLS, DeviceDescription,
                                    Hello, LinkCommand, challenge, new_nonce, proof_matches)
from dxpu_vfio.link.transport import TlsFiles, server_context
from dxpu_vfio.native import stream as native
from dxpu_vfio.remoteproxy.admission import MAX_ADMITTING, Admission, check_hello
from dxpu_vfio.remoteproxy.config import EXTERNAL_MODEL, BoxConfig, BoxDevice
from dxpu_vfio.remoteproxy.control import CONTROL_COMMANDS, ControlServices
from dxpu_vfio.remoteproxy.external import ExternalFunction, ExternalServerError
from dxpu_vfio.remoteproxy.faults import FaultTable
from dxpu_vfio.remoteproxy.grants import Grants, certificate_fingerprints
from dxpu_vfio.remoteproxy.ports import LinkDmaPort, LinkIrqPort
from dxpu_vfio.vfio_user import protocol as vp
from dxpu_vfio.vfio_user.connection import Connection, ConnectionClosed, Message, ReceiveTimeout, close_listener
from dxpu_vfio.vfio_user.posted import unpack_batch
from qemu_device.device import PciFunction
from qemu_device.models import create_model
from qemu_device.ports import NullDmaPort, NullIrqPort

log = logging.getLogger("dxpu.remote")

ACCEPT_RETRY = 0.1  # seconds to wait after an accept() error (e.g. EMFILE) before the next accept


def describe(model: str, device: PciFunction) -> DeviceDescription:
    return DeviceDescription(model, [(r.index, r.size, r.readable, r.writable) for r in device.regions()],
                             device.irq_counts(), device.coalesce_posted,
                             dma_windows=device.wants_dma_windows,
                             mappable=[r.index for r in device.regions() if r.mappable])


def refusal(msg_id: int, command: int, err: int, why: str) -> bytes:
    """An error reply that says why in its payload (UTF-8; a host shows it)."""
    text = why.encode()[:500]
    return vp.HEADER.pack(msg_id, command, vp.HEADER_SIZE + len(text), vp.TYPE_REPLY | vp.FLAG_ERROR, err) + text


class Slot:
    """One device of the box and the link that drives it now (if any)."""

    def __init__(self, spec: BoxDevice) -> None:
        self.spec = spec
        self.endpoint: LinkEndpoint | None = None
        self.admitted: str | None = None  # the lease whose granted token admitted the link (None: static)
        self.links_served = 0
        self.dma: LinkDmaPort | None = None
        self.irq: LinkIrqPort | None = None
        if spec.model == EXTERNAL_MODEL:  # an external vfio-user server, reached by its socket
            self.device = self._external()
        else:
            self.device = create_model(spec.model, **spec.settings)

    def _external(self) -> ExternalFunction:
        device = ExternalFunction(**self.spec.settings)
        device.on_gone = self._external_gone
        return device

    def _external_gone(self, reason: str) -> None:
        """The external server went away (it exited): the host learns it as a link that
        went down, and the box's log says why (not "peer closed the link")."""
        endpoint = self.endpoint
        if endpoint is not None and endpoint.up:
            endpoint.mark_down(reason)

    def unusable(self) -> str | None:
        """Why this device cannot serve a new link (None: it can). An external server
        that went away is reconnected first: it may have been restarted."""
        gone = self.device.gone
        if gone is None:
            return None
        try:
            device = self._external()
        except ExternalServerError as exc:
            return f"{gone}; reconnecting failed: {exc.message}"
        old, self.device = self.device, device
        old.close()
        log.warning("device %s: reconnected to its external vfio-user server at %s", self.spec.id, device.socket)
        return None

    def in_use(self) -> bool:
        return self.endpoint is not None and self.endpoint.up

    def snapshot(self, faults: FaultTable | None = None) -> dict:
        return {"model": self.spec.model, "links": self.links_served,
                "faults": faults.counters(self.spec.id) if faults else {},
                "link": self.endpoint.stats() if self.endpoint else None,
                "dma_bytes_read": self.dma.bytes_read if self.dma else 0,
                "dma_bytes_written": self.dma.bytes_written if self.dma else 0,
                "dma_read_requests": self.dma.requests if self.dma else 0,
                "ring_pushes": self.dma.pushes if self.dma else 0,  # DMA_PUSHes taken, and the reads
                "pushed_reads": self.dma.pushed_reads if self.dma else 0,  # they served with no round trip
                "pointed_reads": self.dma.pointed_reads if self.dma else 0,  # of them PRP lists (pointed ranges)
                "irqs_sent": self.irq.sent if self.irq else 0,
                "device": self.device.stats()}


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
        self.grants = Grants()
        managers = None if config.plaintext else certificate_fingerprints(config.tls_dir, config.managers)
        if managers == set():
            log.warning("box %s: no manager certificate (%s in %s): no pool can be granted a lease token",
                        config.name, ", ".join(f"{r}.pem" for r in config.managers), config.tls_dir)
        self.faults = FaultTable(list(self.slots), {"cut": self._fault_down, "remove": self._fault_down})
        self.control = ControlServices(config.name, self.slots, self.grants, managers, on_revoke=self._revoked,
                                       faults=self.faults)
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

    def _tokens(self, slot: Slot | None) -> list[tuple[str | None, str]] | None:
        """(grant's lease id or None for the static token, token) that admit to ``slot`` now."""
        if slot is None:
            return None
        grant = self.grants.current(slot.spec.id)
        if grant is not None:
            return [(grant.lease, grant.token)]
        return [(None, slot.spec.lease)] if slot.spec.lease else []

    def _challenge(self, conn: Connection, msg: Message, device: str, peer: tuple) -> tuple[Message, Hello, str] | None:
        """Answer the first HELLO with a fresh nonce and read the second, bounded like the
        first: (its message, the HELLO, the nonce), or None (refused and closed)."""
        nonce = new_nonce()
        deadline = Deadline(conn.sock, self.admission.handshake_timeout)
        try:
            conn.send(vp.message(msg.header.msg_id, msg.header.command, challenge(nonce), reply=True))
            second = conn.receive()
            if second.header.command != LinkCommand.HELLO:
                raise vp.ProtocolError("the answer to the challenge must be HELLO")
            hello = Hello.unpack(second.payload)
            if hello.device != device:
                raise vp.ProtocolError(f"the answer to the challenge names device {hello.device!r}, not {device!r}")
            return second, hello, nonce
        except (vp.ProtocolError, ConnectionClosed, ReceiveTimeout, OSError) as exc:
            deadline.cancel()
            self.admission.refuse_hello(conn, peer, f"no whole HELLO answer in "
                                        f"{self.admission.handshake_timeout} s" if deadline.expired else exc)
            return None
        finally:
            deadline.cancel()

    def _take_link(self, conn: Connection, msg: Message, peer: tuple) -> None:
        """HELLO, challenge, HELLO with the proof of a lease token; then the device belongs
        to this link."""
        try:
            hello = Hello.unpack(msg.payload)
        except (vp.ProtocolError, RecursionError) as exc:  # RecursionError: JSON nested too deep (fuzzer)
            self.admission.refuse_hello(conn, peer, exc)
            return
        slot = self.slots.get(hello.device)
        tokens = self._tokens(slot)
        err = check_hello(hello, None if tokens is None else [t for _, t in tokens])
        lease = None
        if err is None:
            answered = self._challenge(conn, msg, hello.device, peer)
            if answered is None:
                return
            msg, hello, nonce = answered
            tokens = self._tokens(slot)  # a GRANT or REVOKE may have come meanwhile
            err = check_hello(hello, [t for _, t in tokens], nonce)
            lease = next((who for who, t in tokens if proof_matches(hello.proof, t, hello.device, nonce)), None)
        if err == errno.EACCES:
            self.admission.refused["lease"] += 1
        old = None
        why = None
        if err is None:
            with self._lock:
                current = self.grants.current(slot.spec.id)
                if (current.lease if current else None) != lease:
                    err = errno.EACCES  # granted, revoked or replaced since the proof was checked
                    self.admission.refused["lease"] += 1
                elif slot.in_use():
                    err = errno.EBUSY
                    self.admission.refused["busy"] += 1
                elif (removed := self.faults.removed(slot.spec.id)) is not None:
                    err, why = errno.ENXIO, f"device removed by fault {removed.id} (surprise removal)"
                    self.admission.refused["out_of_service"] += 1
                elif (why := slot.unusable()) is not None:
                    err = errno.ENXIO
                    self.admission.refused["out_of_service"] += 1
                else:
                    old = slot.endpoint
                    slot.admitted = lease
                    slot.endpoint = LinkEndpoint(conn, f"{self.config.name}/{slot.spec.id}",
                                                 self._handlers(slot), on_down=lambda r, s=slot: self._released(s, r),
                                                 region_access=self._region_access(slot),
                                                 heartbeat=self.config.heartbeat, dead_after=self.config.dead_after)
        if err is not None:
            log.warning("refused %s for device %r: %s%s", peer, hello.device, errno.errorcode[err],
                        f": {why}" if why else "")
            try:
                conn.send(refusal(msg.header.msg_id, msg.header.command, err, why) if why else
                          vp.error_reply(msg.header.msg_id, msg.header.command, err))
            finally:
                conn.close()
            return
        if old is not None:
            old.close()  # the link before, down: its descriptors go now
        if getattr(conn, "native", False):
            conn.stream.spin_us = self.config.spin_us
            conn.stream.read_spin_us = self.config.read_spin_us
        slot.links_served += 1
        description = describe(slot.spec.model, slot.device)
        # ring entries pushed with their doorbells: only where the host offered it, which it
        # does when its C forwarder sees every posted write (not coalesced, no shadowed BAR)
        ring_push = FEATURE_RING_PUSH in hello.features and not description.coalesce and not description.mappable
        slot.dma = LinkDmaPort(slot.endpoint, self.faults, slot.spec.id, readv=FEATURE_DMA_READV in hello.features,
                               writev=FEATURE_DMA_WRITEV in hello.features, ring_push=ring_push,
                               shadows=ring_push and FEATURE_SHADOW_DOORBELLS in hello.features)
        slot.endpoint.push_mirrors = slot.dma if ring_push else None  # C takes its ring pushes (serve.c)
        slot.irq = LinkIrqPort(slot.endpoint)
        with slot.device.lock:
            slot.device.vmm_masks_msix = True  # the host's QEMU keeps the MSI-X table
            slot.device.attach(slot.dma, slot.irq)
        conn.send(vp.message(msg.header.msg_id, msg.header.command, description.pack(), reply=True))
        slot.endpoint.start()

    def _revoked(self, device: str, lease: str) -> None:
        """The manager revoked ``lease``'s token: a link it admitted goes down now."""
        slot = self.slots[device]
        with self._lock:
            endpoint = slot.endpoint if slot.admitted == lease and slot.in_use() else None
        if endpoint is not None:  # down, not closed: the next link's admission closes it (once)
            endpoint.mark_down(f"lease {lease} revoked")

    def _fault_down(self, device: str, reason: str) -> None:
        """A cut or remove fault: the device's link goes down now (shut, so the host sees it)."""
        endpoint = self.slots[device].endpoint
        if endpoint is not None and endpoint.up:
            endpoint.mark_down(reason)

    def _released(self, slot: Slot, reason: str) -> None:
        """The link went down: the device forgets its host and is reset for the next lease."""
        with slot.device.lock:
            slot.device.attach(NullDmaPort(), NullIrqPort())
            slot.device.reset()
            if slot.device.wants_dma_windows:
                slot.device.unmap_all()  # QEMU's windows went with the link

    def _handlers(self, slot: Slot) -> dict:
        device, faults, dev_id = slot.device, self.faults, slot.spec.id

        def dma_map(msg):  # QEMU's window, passed on by the host (an external server maps it)
            req = vp.DmaMap.unpack(msg.payload)
            try:
                with device.lock:
                    device.dma_map(req.address, req.size, req.flags)
            except OSError:
                if device.gone:  # it died on the window: down once the host has the refusal
                    endpoint = slot.endpoint
                    timer = threading.Timer(0.2, lambda: endpoint.mark_down(device.gone))
                    timer.daemon = True
                    timer.start()
                raise
            return b""

        def dma_unmap(msg):
            req = vp.DmaUnmap.unpack(msg.payload)
            with device.lock:
                device.dma_unmap(req.address, req.size, req.flags)
            return req.pack()

        def region_read(msg):
            req = vp.RegionAccess.unpack(msg.payload, write=False)
            if faults.armed and (err := faults.read_fault(dev_id, req.region)) is not None:
                raise OSError(err, "completer abort (fault)")
            with device.lock:
                data = device.region_read(req.region, req.offset, req.count)
            return vp.RegionAccess(req.region, req.offset, req.count, data).pack()

        def region_write(msg):
            req = vp.RegionAccess.unpack(msg.payload, write=True)
            if msg.header.no_reply and faults.armed and faults.drop_posted(dev_id):
                return None
            with device.lock:
                device.region_write(req.region, req.offset, req.data, posted=msg.header.no_reply)
            return vp.RegionAccess(req.region, req.offset, req.count).pack()

        def write_batch(msg):  # posted runs, applied in order
            if faults.armed and faults.drop_posted(dev_id):
                return
            with device.lock:
                for region, offset, data in unpack_batch(msg.payload):
                    device.region_write(region, offset, data, posted=True)

        def reset(msg):
            with device.lock:
                device.reset()
            return b""

        def sync(msg):  # the reader got here, so everything before it is done
            return b""

        windows = {LinkCommand.DMA_MAP: dma_map, LinkCommand.DMA_UNMAP: dma_unmap} \
            if device.wants_dma_windows else {}
        def dma_push(msg):  # ring entries, just before the doorbell that announces them
            if slot.dma is not None:
                slot.dma.pushed(msg.payload)

        return {**windows, LinkCommand.REGION_READ: region_read, LinkCommand.REGION_WRITE: region_write,
                LinkCommand.WRITE_BATCH: write_batch, LinkCommand.DEVICE_RESET: reset, LinkCommand.SYNC: sync,
                LinkCommand.DMA_PUSH: dma_push}

    def _region_access(self, slot: Slot) -> tuple:
        """(read, write, push) for the native reader (native/serve.c): the same work as the
        REGION_READ/REGION_WRITE/DMA_PUSH handlers, with an errno instead of an exception
        (a push is posted: one it cannot take is dropped and logged)."""
        device, name = slot.device, f"{self.config.name}/{slot.spec.id}"
        faults, dev_id = self.faults, slot.spec.id

        def read(region: int, offset: int, count: int):
            if faults.armed and (err := faults.read_fault(dev_id, region)) is not None:
                return err
            try:
                with device.lock:
                    return device.region_read(region, offset, count)
            except Exception as exc:  # noqa: BLE001 - every failure becomes an error completion
                log.info("link %s: REGION_READ failed: %s", name, exc)
                return getattr(exc, "errno", None) or errno.EIO

        def write(region: int, offset: int, data: bytes, posted: bool):
            if posted and faults.armed and faults.drop_posted(dev_id):
                return None
            try:
                with device.lock:
                    device.region_write(region, offset, data, posted=posted)
            except Exception as exc:  # noqa: BLE001 - a posted one is dropped, like on PCIe
                log.info("link %s: REGION_WRITE failed: %s", name, exc)
                return getattr(exc, "errno", None) or errno.EIO
            return None

        def push(payload: bytes) -> None:
            try:
                if slot.dma is not None:
                    slot.dma.pushed(memoryview(payload))
            except Exception as exc:  # noqa: BLE001 - posted: a bad push is dropped, never raised into C
                log.info("link %s: DMA_PUSH failed: %s", name, exc)

        return read, write, push

    def inventory(self) -> dict:
        return self.control.inventory()

    def snapshot(self) -> dict:
        return {"box": self.config.name, "port": self.port, "refused": self.refused,
                "accept_errors": self.accept_errors,
                "devices": {sid: s.snapshot(self.faults) for sid, s in self.slots.items()}}

    def screenshots(self):
        """Every display and the renderer of its scanout, for SIGUSR2 (:mod:`dxpu_vfio.daemon`,
        which writes why for a display whose mode cannot be shown)."""
        for dev_id, slot in self.slots.items():
            if slot.device.renders_screen:
                yield dev_id, slot.device.render_png

    def stop(self) -> None:
        self._stopping = True
        self.faults.clear_all()  # held completions go on; nothing outlives the box
        close_listener(self._listener)
        self._listener = None
        for slot in self.slots.values():
            if slot.endpoint is not None:
                slot.endpoint.close()
            slot.device.close()
