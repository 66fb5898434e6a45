"""The link protocol between a host proxy and a remote proxy (docs/link-protocol.md).

One ordered stream (TCP, normally TLS) per attached device, framed exactly like
vfio-user (16-byte header: id, command, size, flags, error) so region accesses and DMA
reuse vfio-user's payload layouts unchanged. Link-only commands are numbered from 0x100.
Posted traffic (MMIO writes, DMA writes, interrupts, heartbeats) carries the no-reply
flag; because everything of one device shares one stream, a read never passes an
earlier write and an interrupt never passes the DMA writes before it.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import secrets
import struct
from dataclasses import dataclass, field

from dxpu_vfio.vfio_user.protocol import ProtocolError

LINK_VERSION = 2  # 2: HELLO is a challenge and a proof of the lease token, never the token


class LinkCommand(enum.IntEnum):
    # reused from vfio-user, same payloads
    DMA_MAP = 2  # host -> remote, non-posted: a DMA window QEMU mapped (never an fd); only if the description asks
    DMA_UNMAP = 3  # host -> remote, non-posted: a window QEMU unmapped (flag DMA_UNMAP_ALL: every window)
    REGION_READ = 9  # host -> remote, non-posted
    REGION_WRITE = 10  # host -> remote, posted or non-posted (config writes)
    DMA_READ = 11  # remote -> host, non-posted
    DMA_WRITE = 12  # remote -> host, posted
    DEVICE_RESET = 13  # host -> remote, non-posted
    # link only
    HELLO = 0x100  # host -> remote, twice: version, device (JSON); reply: a nonce; then the same with the
    # nonce and a proof of the lease token (HMAC); reply: device description
    IRQ = 0x101  # remote -> host, posted: kind, vector, level
    HEARTBEAT = 0x102  # both ways, posted
    WRITE_BATCH = 0x103  # host -> remote, posted: coalesced posted writes (REGION_WRITE payloads back to back)
    INVENTORY = 0x104  # manager -> remote, instead of HELLO: the box's devices (JSON); then the link closes
    SCREENSHOT = 0x105  # manager -> remote, instead of HELLO: a display's scanout as PNG, in pieces
    SYNC = 0x106  # host -> remote, non-posted, empty: completed once everything before it was done
    GRANT = 0x107  # manager -> remote, instead of HELLO: a fresh lease token for one device (JSON)
    REVOKE = 0x108  # manager -> remote, instead of HELLO: that device's token is void (JSON)
    FAULT = 0x109  # manager -> remote, instead of HELLO: arm, clear or list test faults (JSON)


IRQ_MSG = struct.Struct("<III")  # kind, vector, level
IRQ_INTX, IRQ_MSI, IRQ_MSIX = 0, 1, 2


NONCE_BYTES = 32


@dataclass
class Hello:
    """A HELLO: the first (``nonce`` and ``proof`` empty) asks the box for a challenge; the
    second answers it. The lease token itself never crosses the link."""

    device: str
    nonce: str = ""  # hex, as the box sent it
    proof: str = ""  # hex: hello_proof(token, device, nonce)
    version: int = LINK_VERSION

    def pack(self) -> bytes:
        body: dict = {"version": self.version, "device": self.device}
        if self.proof:
            body.update(nonce=self.nonce, proof=self.proof)
        return json.dumps(body).encode()

    @classmethod
    def unpack(cls, payload: bytes | memoryview) -> "Hello":
        try:
            data = json.loads(bytes(payload))
            return cls(device=str(data["device"]), nonce=str(data.get("nonce", "")),
                       proof=str(data.get("proof", "")), version=int(data["version"]))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise ProtocolError(f"bad HELLO: {exc!r}") from exc


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def hello_proof(token: str, device: str, nonce: str) -> str:
    """HMAC-SHA256 keyed with the lease token over the device and the box's fresh nonce:
    proves the token without sending it, and is worth nothing on another connection."""
    message = b"dxpu-hello\0" + device.encode() + b"\0" + nonce.encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def proof_matches(proof: str, token: str, device: str, nonce: str) -> bool:
    return hmac.compare_digest(proof.encode(), hello_proof(token, device, nonce).encode())


def challenge(nonce: str) -> bytes:
    return json.dumps({"nonce": nonce}).encode()


def unpack_challenge(payload: bytes | memoryview) -> str:
    try:
        nonce = json.loads(bytes(payload))["nonce"]
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise ProtocolError(f"bad HELLO challenge: {exc!r}") from exc
    if not isinstance(nonce, str) or len(nonce) != 2 * NONCE_BYTES:
        raise ProtocolError("bad HELLO challenge: no nonce")
    return nonce


@dataclass
class DeviceDescription:
    """What the host proxy needs to answer QEMU's GET_INFO questions without the network."""

    model: str
    regions: list[tuple[int, int, bool, bool]]  # index, size, readable, writable
    irqs: dict[str, int]
    coalesce: bool = False  # the device's posted writes come in floods: combine them
    dma_windows: bool = False  # the box wants QEMU's DMA windows (DMA_MAP/DMA_UNMAP): an external server
    mappable: list[int] = field(default_factory=list)  # host-mappable BARs: the host shadows them (hostproxy/shadow.py)

    def pack(self) -> bytes:
        return json.dumps({"model": self.model, "regions": self.regions, "irqs": self.irqs,
                           "coalesce": self.coalesce, "dma_windows": self.dma_windows,
                           "mappable": self.mappable}).encode()

    @classmethod
    def unpack(cls, payload: bytes | memoryview) -> "DeviceDescription":
        try:
            data = json.loads(bytes(payload))
            return cls(data["model"], [tuple(r) for r in data["regions"]], dict(data["irqs"]),
                       bool(data.get("coalesce", False)), bool(data.get("dma_windows", False)),
                       data.get("mappable", []))  # checked by the host (hostproxy/description.py)
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(f"bad device description: {exc}") from exc


def pack_irq(kind: int, vector: int, level: bool = True) -> bytes:
    return IRQ_MSG.pack(kind, vector, int(level))


def unpack_irq(payload: bytes | memoryview) -> tuple[int, int, bool]:
    if len(payload) < IRQ_MSG.size:
        raise ProtocolError("short IRQ message")
    kind, vector, level = IRQ_MSG.unpack_from(payload)
    if kind > IRQ_MSIX:
        raise ProtocolError(f"IRQ kind {kind}")
    return kind, vector, bool(level)
