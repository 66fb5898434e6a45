"""The box's control services for the pool manager, apart from the data links.

A connection whose first message is INVENTORY or SCREENSHOT (instead of HELLO) gets one
of these and is closed after it; it never takes a device. INVENTORY lists the box's
devices (what the manager registers); SCREENSHOT renders a display's scanout once and
hands the PNG out in pieces of at most 1 MiB, each reply ``total u64`` + the piece.
"""

from __future__ import annotations

import errno
import json
import logging
from typing import Callable, Mapping, Protocol

from dxpu_vfio.link.protocol import LINK_VERSION, LinkCommand
from dxpu_vfio.remoteproxy.config import EXTERNAL_MODEL, BoxDevice
from dxpu_vfio.vfio_user import protocol as vp
from dxpu_vfio.vfio_user.connection import Connection, ConnectionClosed, Message

log = logging.getLogger("dxpu.remote")

PIECE = vp.MAX_DATA_XFER
CONTROL_COMMANDS = (LinkCommand.INVENTORY, LinkCommand.SCREENSHOT)


class ServedDevice(Protocol):
    """What the control services need of a box's device slot."""

    spec: BoxDevice
    device: object

    def in_use(self) -> bool: ...


class ControlServices:
    def __init__(self, box: str, slots: Mapping[str, ServedDevice]) -> None:
        self.box = box
        self.slots = slots

    def serve(self, conn: Connection, msg: Message) -> None:
        """Answer a control request (its command is in CONTROL_COMMANDS); closes ``conn``."""
        try:
            if msg.header.command == LinkCommand.INVENTORY:
                conn.send(vp.message(msg.header.msg_id, msg.header.command,
                                     json.dumps(self.inventory()).encode(), reply=True))
            else:
                self._serve_screenshot(conn, msg)
        except (vp.ProtocolError, ConnectionClosed, OSError) as exc:
            log.info("control link ended: %s", exc)
        finally:
            conn.close()

    def inventory(self) -> dict:
        """Every device, its identity, size and lease token.

        Only peers with a certificate of the pool's CA get here (or anyone, on a box run
        with ``plaintext = true``): the CA is the trust boundary of the pool.
        """
        devices = []
        for sid, slot in self.slots.items():
            device = slot.device
            with device.lock:
                ids = int.from_bytes(device.region_read(vp.REGION_CONFIG, 0, 4), "little")
                capacity: Callable[[], int] | None = getattr(device, "capacity_bytes", None)
                size = capacity() if capacity else max((r.size for r in device.regions()
                                                        if r.index < vp.REGION_CONFIG), default=0)
            devices.append({"id": sid, "class": "external" if slot.spec.model == EXTERNAL_MODEL else slot.spec.model,
                            "vendor": f"{ids & 0xFFFF:04x}", "model": f"{ids >> 16:04x}",
                            "capacity": size, "lease": slot.spec.lease, "in_use": slot.in_use()})
        return {"box": self.box, "version": LINK_VERSION, "devices": devices}

    def _serve_screenshot(self, conn: Connection, msg: Message) -> None:
        png = b""
        while True:
            try:
                req = json.loads(bytes(msg.payload))
                slot = self.slots.get(str(req["device"]))
                offset = int(req.get("offset", 0))
            except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: nested too deep
                raise vp.ProtocolError("bad SCREENSHOT request") from None
            err = (errno.ENODEV if slot is None else errno.EACCES if str(req.get("lease")) != slot.spec.lease
                   else errno.ENOTSUP if not hasattr(slot.device, "render_png") else None)
            if err is not None:
                conn.send(vp.error_reply(msg.header.msg_id, msg.header.command, err))
                return
            if not png:  # not under the device lock: a frame torn by a concurrent write is fine here
                try:
                    png = slot.device.render_png()
                except ValueError as exc:  # the guest's mode cannot be shown (DisplayModeError)
                    log.warning("screenshot of %s refused: %s", req["device"], exc)
                    conn.send(vp.error_reply(msg.header.msg_id, msg.header.command, errno.EINVAL))
                    return
            piece = png[offset:offset + PIECE]
            conn.send(vp.message(msg.header.msg_id, msg.header.command,
                                 len(png).to_bytes(8, "little") + piece, reply=True))
            msg = conn.receive()
            if msg.header.command != LinkCommand.SCREENSHOT:
                return
