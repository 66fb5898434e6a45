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
import json
import struct
from dataclasses import dataclass

from dxpu_vfio.vfio_user.protocol import ProtocolError

LINK_VERSION = 1


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
    HELLO = 0x100  # host -> remote: version, device id, lease token (JSON); reply: device description
    IRQ = 0x101  # remote -> host, posted: kind, vector, level
    HEARTBEAT = 0x102  # both ways, posted
    WRITE_BATCH = 0x103  # host -> remote, posted: coalesced posted writes (REGION_WRITE payloads back to back)
    INVENTORY = 0x104  # manager -> remote, instead of HELLO: the box's devices (JSON); then the link closes
    SCREENSHOT = 0x105  # manager -> remote, instead of HELLO: a display's scanout as PNG, in pieces
    SYNC = 0x106  # host -> remote, non-posted, empty: completed once everything before it was done


IRQ_MSG = struct.Struct("<III")  # kind, vector, level
IRQ_INTX, IRQ_MSI, IRQ_MSIX = 0, 1, 2


@dataclass
class Hello:
    device: str
    lease: str
    version: int = LINK_VERSION

    def pack(self) -> bytes:
        return json.dumps({"version": self.version, "device": self.device, "lease": self.lease}).encode()

    @classmethod
    def unpack(cls, payload: bytes | memoryview) -> "Hello":
        try:
            data = json.loads(bytes(payload))
            return cls(device=str(data["device"]), lease=str(data["lease"]), version=int(data["version"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(f"bad HELLO: {exc}") from exc


@dataclass
class DeviceDescription:
    """What the host proxy needs to answer QEMU's GET_INFO questions without the network."""

    model: str
    regions: list[tuple[int, int, bool, bool]]  # index, size, readable, writable
    irqs: dict[str, int]
    coalesce: bool = False  # the device's posted writes come in floods: combine them
    dma_windows: bool = False  # the box wants QEMU's DMA windows (DMA_MAP/DMA_UNMAP): an external server

    def pack(self) -> bytes:
        return json.dumps({"model": self.model, "regions": self.regions, "irqs": self.irqs,
                           "coalesce": self.coalesce, "dma_windows": self.dma_windows}).encode()

    @classmethod
    def unpack(cls, payload: bytes | memoryview) -> "DeviceDescription":
        try:
            data = json.loads(bytes(payload))
            return cls(data["model"], [tuple(r) for r in data["regions"]], dict(data["irqs"]),
                       bool(data.get("coalesce", False)), bool(data.get("dma_windows", False)))
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
