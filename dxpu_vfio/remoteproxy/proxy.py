"""The remote proxy (DxPU_PROXY in the GPU box): serves a box's devices over the link.

``dxpu remote serve --config BOX.toml``. Each device of the box is one model instance
that lives as long as the proxy; one host link at a time may drive it, after a HELLO
naming the device and a lease token the box accepts. The link's reader thread performs
region accesses in stream order; the device reaches guest memory through
:class:`LinkDmaPort` (DMA reads wait for the host's completion, DMA writes are posted)
and raises interrupts through :class:`LinkIrqPort` (posted, after the DMA writes).

BOX.toml::

    name = "box1"
    listen = "198.18.0.2"
    port = 7000
    tls_dir = "/path/to/certs"   # ca.pem + box1.pem/key; or: plaintext = true
    [[device]]
    id = "td0"
    model = "testdev"
    lease = "secret-token"       # the token a host must present
    settings = { memory_size = 4294967296 }
    [[device]]
    id = "ext0"
    model = "vfio-user"          # an external vfio-user server, driven as a client
    lease = "other-token"
    settings = { socket = "/run/ext0.sock" }
"""

from __future__ import annotations

import errno
import json
import logging
import socket
import ssl
import threading
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from qemu_device.device import PciFunction
from qemu_device.models import create_model
from qemu_device.ports import DmaError, NullDmaPort, NullIrqPort

from dxpu_vfio.vfio_user import protocol as vp
from dxpu_vfio.vfio_user.connection import Connection, ConnectionClosed, close_listener
from dxpu_vfio.vfio_user.posted import unpack_batch
from dxpu_vfio.link.endpoint import LinkDown, LinkEndpoint, LinkError
from dxpu_vfio.link.protocol import (IRQ_INTX, IRQ_MSI, IRQ_MSIX, LINK_VERSION, DeviceDescription, Hello,
                                     LinkCommand, pack_irq)
from dxpu_vfio.link.transport import TlsFiles, server_context, tune

log = logging.getLogger("dxpu.remote")

DMA_TIMEOUT = 2.0
CHUNK = vp.MAX_DATA_XFER
READ_PIECE = 64 << 10  # a large DMA read goes as several pieces in flight at once
READ_WINDOW = 8


@dataclass
class BoxDevice:
    id: str
    model: str
    lease: str
    settings: dict = field(default_factory=dict)


@dataclass
class BoxConfig:
    name: str
    listen: str
    port: int
    devices: list[BoxDevice]
    tls_dir: Path | None = None
    plaintext: bool = False

    @classmethod
    def load(cls, path: Path) -> "BoxConfig":
        with open(path, "rb") as f:
            raw = tomllib.load(f)
        try:
            devices = [BoxDevice(d["id"], d["model"], str(d["lease"]), d.get("settings", {}))
                       for d in raw.get("device", [])]
            config = cls(raw["name"], raw.get("listen", "127.0.0.1"), int(raw.get("port", 7000)), devices,
                         Path(raw["tls_dir"]) if raw.get("tls_dir") else None, bool(raw.get("plaintext", False)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: bad box config: {exc}") from exc
        if config.tls_dir is None and not config.plaintext:
            raise ValueError(f"{path}: set tls_dir, or plaintext = true to run without TLS")
        return config


class LinkDmaPort:
    """The device's DMA port on the box: guest memory is on the other end of the link."""

    def __init__(self, endpoint: LinkEndpoint) -> None:
        self.endpoint = endpoint
        self.bytes_read = 0
        self.bytes_written = 0

    def read(self, addr: int, length: int) -> bytes:
        return self.read_many([(addr, length)])[0]

    def read_many(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Pipelined: up to READ_WINDOW pieces of at most READ_PIECE in flight, across all
        ranges, so a scatter list costs about one round trip plus the transfer, not one
        round trip per page or per piece."""
        pieces = [(i, addr + pos, min(READ_PIECE, length - pos))
                  for i, (addr, length) in enumerate(ranges) for pos in range(0, length, READ_PIECE)]
        out = [bytearray() for _ in ranges]
        in_flight: list = []
        try:
            while pieces or in_flight:
                while pieces and len(in_flight) < READ_WINDOW:
                    i, a, n = pieces.pop(0)
                    in_flight.append((i, self.endpoint.send_request(LinkCommand.DMA_READ, vp.DmaAccess(a, n).pack())))
                i, pending = in_flight.pop(0)
                out[i] += vp.DmaAccess.unpack(self.endpoint.wait(pending, DMA_TIMEOUT), with_data=True).data
        except LinkError as exc:
            raise DmaError(f"host refused a DMA read: {exc}") from exc
        except LinkDown as exc:
            raise DmaError(f"link down during DMA read: {exc}") from exc
        self.bytes_read += sum(n for _, n in ranges)
        return [bytes(b) for b in out]

    def write(self, addr: int, data: bytes) -> None:
        if not self.endpoint.up:
            raise DmaError(f"link down: {self.endpoint.down_reason}")
        for pos in range(0, len(data), CHUNK):
            chunk = data[pos:pos + CHUNK]
            self.endpoint.post(LinkCommand.DMA_WRITE, vp.DmaAccess(addr + pos, len(chunk), chunk).pack())
        self.bytes_written += len(data)


class LinkIrqPort:
    def __init__(self, endpoint: LinkEndpoint) -> None:
        self.endpoint = endpoint
        self.sent = 0

    def _post(self, kind: int, vector: int, level: bool = True) -> None:
        self.sent += 1
        self.endpoint.post(LinkCommand.IRQ, pack_irq(kind, vector, level))

    def msi(self, vector: int) -> None:
        self._post(IRQ_MSI, vector)

    def msix(self, vector: int) -> None:
        self._post(IRQ_MSIX, vector)

    def intx(self, level: bool) -> None:
        self._post(IRQ_INTX, 0, level)


def describe(model: str, device: PciFunction) -> DeviceDescription:
    return DeviceDescription(model, [(r.index, r.size, r.readable, r.writable) for r in device.regions()],
                             device.irq_counts(), bool(getattr(device, "coalesce_posted", False)))


class _Slot:
    """One device of the box and the link that drives it now (if any)."""

    def __init__(self, spec: BoxDevice) -> None:
        self.spec = spec
        if spec.model == "vfio-user":  # an external vfio-user server, reached by its socket
            from dxpu_vfio.remoteproxy.external import ExternalFunction
            self.device = ExternalFunction(**spec.settings)
        else:
            self.device = create_model(spec.model, **spec.settings)
        self.endpoint: LinkEndpoint | None = None
        self.links_served = 0
        self.dma: LinkDmaPort | None = None
        self.irq: LinkIrqPort | None = None


class RemoteProxy:
    def __init__(self, config: BoxConfig) -> None:
        self.config = config
        self.slots = {d.id: _Slot(d) for d in config.devices}
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._tls = None if config.plaintext else server_context(TlsFiles.in_dir(config.tls_dir, config.name))
        self.refused: dict[str, int] = {"tls": 0, "hello": 0, "lease": 0, "busy": 0}
        self.port = config.port

    def start(self) -> "RemoteProxy":
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.config.listen, self.config.port))
        listener.listen(16)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept_loop, name="remote-accept", daemon=True).start()
        return self

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._admit, args=(sock, peer), name=f"remote-admit-{peer}",
                             daemon=True).start()

    def _admit(self, sock: socket.socket, peer: tuple) -> None:
        """TLS handshake, HELLO, lease check; then the device belongs to this link."""
        tune(sock)
        sock.settimeout(5)
        try:
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_side=True)
        except (ssl.SSLError, OSError) as exc:
            self.refused["tls"] += 1
            log.warning("refused %s: TLS: %s", peer, exc)
            sock.close()
            return
        conn = Connection(sock)
        try:
            msg = conn.receive()
            if msg.header.command == LinkCommand.INVENTORY:
                conn.send(vp.message(msg.header.msg_id, msg.header.command,
                                     json.dumps(self.inventory()).encode(), reply=True))
                conn.close()
                return
            if msg.header.command == LinkCommand.SCREENSHOT:
                self._serve_screenshot(conn, msg)
                return
            if msg.header.command != LinkCommand.HELLO:
                raise vp.ProtocolError("first message must be HELLO")
            hello = Hello.unpack(msg.payload)
        except (vp.ProtocolError, ConnectionClosed, OSError) as exc:
            self.refused["hello"] += 1
            log.warning("refused %s: %s", peer, exc)
            conn.close()
            return
        slot = self.slots.get(hello.device)
        err = None
        if hello.version != LINK_VERSION:
            err = errno.EPROTO
        elif slot is None:
            err = errno.ENODEV
        elif hello.lease != slot.spec.lease:
            err, self.refused["lease"] = errno.EACCES, self.refused["lease"] + 1
        if err is None:
            with self._lock:
                if slot.endpoint is not None and slot.endpoint.up:
                    err, self.refused["busy"] = errno.EBUSY, self.refused["busy"] + 1
                else:
                    slot.endpoint = LinkEndpoint(conn, f"{self.config.name}/{slot.spec.id}",
                                                 self._handlers(slot), on_down=lambda r, s=slot: self._released(s, r))
        if err is not None:
            log.warning("refused %s for device %r: %s", peer, hello.device, errno.errorcode[err])
            try:
                conn.send(vp.error_reply(msg.header.msg_id, msg.header.command, err))
            finally:
                conn.close()
            return
        sock.settimeout(None)
        slot.links_served += 1
        slot.dma, slot.irq = LinkDmaPort(slot.endpoint), LinkIrqPort(slot.endpoint)
        with slot.device.lock:
            slot.device.vmm_masks_msix = True  # the host's QEMU keeps the MSI-X table
            slot.device.attach(slot.dma, slot.irq)
        conn.send(vp.message(msg.header.msg_id, msg.header.command,
                             describe(slot.spec.model, slot.device).pack(), reply=True))
        slot.endpoint.start()

    def _serve_screenshot(self, conn: Connection, msg) -> None:
        """SCREENSHOT: the display renders its scanout once; the requester then asks for
        the PNG piece by piece (``offset``), each reply ``total u64`` + up to 1 MiB."""
        png = b""
        try:
            while True:
                try:
                    req = json.loads(bytes(msg.payload))
                    slot = self.slots.get(str(req["device"]))
                    offset = int(req.get("offset", 0))
                except (ValueError, KeyError, TypeError):
                    raise vp.ProtocolError("bad SCREENSHOT request") from None
                err = (errno.ENODEV if slot is None else errno.EACCES if str(req.get("lease")) != slot.spec.lease
                       else errno.ENOTSUP if not hasattr(slot.device, "render_png") else None)
                if err is not None:
                    conn.send(vp.error_reply(msg.header.msg_id, msg.header.command, err))
                    return
                if not png:  # not under the device lock: a frame torn by a concurrent write is fine here
                    png = slot.device.render_png()
                piece = png[offset:offset + CHUNK]
                conn.send(vp.message(msg.header.msg_id, msg.header.command,
                                     len(png).to_bytes(8, "little") + piece, reply=True))
                msg = conn.receive()
                if msg.header.command != LinkCommand.SCREENSHOT:
                    return
        except (vp.ProtocolError, ConnectionClosed, OSError) as exc:
            log.info("screenshot link ended: %s", exc)
        finally:
            conn.close()

    def _released(self, slot: _Slot, reason: str) -> None:
        """The link went down: the device forgets its host and is reset for the next lease."""
        with slot.device.lock:
            slot.device.attach(NullDmaPort(), NullIrqPort())
            slot.device.reset()

    def _handlers(self, slot: _Slot) -> dict:
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

        return {LinkCommand.REGION_READ: region_read, LinkCommand.REGION_WRITE: region_write,
                LinkCommand.WRITE_BATCH: write_batch, LinkCommand.DEVICE_RESET: reset}

    def inventory(self) -> dict:
        """What the pool manager registers: every device, its identity, size and lease token.

        Only peers with a certificate of the pool's CA get here (or anyone, on a box run
        with ``plaintext = true``): the CA is the trust boundary of the pool.
        """
        devices = []
        for sid, slot in self.slots.items():
            with slot.device.lock:
                ids = int.from_bytes(slot.device.region_read(vp.REGION_CONFIG, 0, 4), "little")
                capacity = getattr(slot.device, "capacity_bytes", None)
                capacity = capacity() if capacity else max((r.size for r in slot.device.regions()
                                                            if r.index < vp.REGION_CONFIG), default=0)
            devices.append({"id": sid, "class": "external" if slot.spec.model == "vfio-user" else slot.spec.model,
                            "vendor": f"{ids & 0xFFFF:04x}", "model": f"{ids >> 16:04x}",
                            "capacity": capacity, "lease": slot.spec.lease,
                            "in_use": bool(slot.endpoint is not None and slot.endpoint.up)})
        return {"box": self.config.name, "version": LINK_VERSION, "devices": devices}

    def snapshot(self) -> dict:
        return {"box": self.config.name, "port": self.port, "refused": dict(self.refused),
                "devices": {sid: {"model": s.spec.model, "links": s.links_served,
                                  "link": s.endpoint.stats() if s.endpoint else None,
                                  "dma_bytes_read": s.dma.bytes_read if s.dma else 0,
                                  "dma_bytes_written": s.dma.bytes_written if s.dma else 0,
                                  "irqs_sent": s.irq.sent if s.irq else 0,
                                  "device": s.device.stats() if hasattr(s.device, "stats") else None}
                            for sid, s in self.slots.items()}}

    def stop(self) -> None:
        close_listener(self._listener)
        self._listener = None
        for slot in self.slots.values():
            if slot.endpoint is not None:
                slot.endpoint.close()
            close = getattr(slot.device, "close", None)
            if close:
                close()
