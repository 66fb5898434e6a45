"""The box's control services for the pool manager, apart from the data links.

A connection whose first message is INVENTORY, GRANT, REVOKE, SCREENSHOT or FAULT (instead
of HELLO) gets one of these and is closed after it; it never takes a device. INVENTORY lists
the box's devices (what the manager registers; never a token); GRANT issues a fresh lease
token for one device (:mod:`dxpu_vfio.remoteproxy.grants`), REVOKE ends it; SCREENSHOT
renders a display's scanout once and hands the PNG out in pieces of at most 1 MiB, each
reply ``total u64`` + the piece. FAULT arms, clears or lists test faults
(:mod:`dxpu_vfio.remoteproxy.faults`): ``{"op": "arm"|"clear"|"list", ...}`` -> JSON.

INVENTORY is for any peer with a certificate of the pool's CA. GRANT, REVOKE,
SCREENSHOT and FAULT are admin commands, for the managers only: the peer must present one of the
certificates named by the box's ``managers`` (EPERM otherwise). Another box has a
certificate of the same CA and must not be able to take a device. A plaintext box has no
identities and answers everyone (it is for tests).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
from typing import Callable, Mapping, Protocol

from dxpu_vfio.link.protocol import LINK_VERSION, LinkCommand
from dxpu_vfio.link.transport import peer_certificate
from dxpu_vfio.remoteproxy.config import EXTERNAL_MODEL, BoxDevice
from dxpu_vfio.remoteproxy.faults import FaultError, FaultTable
from dxpu_vfio.remoteproxy.grants import Grants, StaleFence
from dxpu_vfio.vfio_user import protocol as vp
from dxpu_vfio.vfio_user.connection import Connection, ConnectionClosed, Message

log = logging.getLogger("dxpu.remote")

PIECE = vp.MAX_DATA_XFER
CONTROL_COMMANDS = (LinkCommand.INVENTORY, LinkCommand.SCREENSHOT, LinkCommand.GRANT, LinkCommand.REVOKE,
                    LinkCommand.FAULT)
ADMIN_COMMANDS = (LinkCommand.SCREENSHOT, LinkCommand.GRANT, LinkCommand.REVOKE, LinkCommand.FAULT)


class ServedDevice(Protocol):
    """What the control services need of a box's device slot."""

    spec: BoxDevice
    device: object

    def in_use(self) -> bool: ...


class ControlServices:
    def __init__(self, box: str, slots: Mapping[str, ServedDevice], grants: Grants | None = None,
                 managers: set[str] | None = None, on_revoke: Callable[[str, str], None] | None = None,
                 faults: FaultTable | None = None) -> None:
        self.box = box
        self.slots = slots
        self.grants = grants or Grants()
        self.managers = managers  # SHA-256 of the certificates admin commands are taken from; None: anyone
        self.on_revoke = on_revoke
        self.faults = faults
        self.refused_admin = 0

    def serve(self, conn: Connection, msg: Message) -> None:
        """Answer a control request (its command is in CONTROL_COMMANDS); closes ``conn``."""
        command = msg.header.command
        try:
            if command in ADMIN_COMMANDS and not self._is_manager(conn):
                self.refused_admin += 1
                log.warning("refused %s from a peer that is not a manager of this box",
                            LinkCommand(command).name)
                conn.send(vp.error_reply(msg.header.msg_id, command, errno.EPERM))
            elif command == LinkCommand.INVENTORY:
                conn.send(vp.message(msg.header.msg_id, command, json.dumps(self.inventory()).encode(), reply=True))
            elif command in (LinkCommand.GRANT, LinkCommand.REVOKE):
                self._serve_grant(conn, msg)
            elif command == LinkCommand.FAULT:
                self._serve_fault(conn, msg)
            else:
                self._serve_screenshot(conn, msg)
        except (vp.ProtocolError, ConnectionClosed, OSError) as exc:
            log.info("control link ended: %s", exc)
        finally:
            conn.close()

    def _is_manager(self, conn: Connection) -> bool:
        if self.managers is None:
            return True
        der = peer_certificate(conn)
        return der is not None and hashlib.sha256(der).hexdigest() in self.managers

    def _serve_grant(self, conn: Connection, msg: Message) -> None:
        """GRANT {device, lease[, fence, holder, pool]} -> {token}; REVOKE {device, lease[, fence, pool]}
        -> {revoked}. A GRANT whose fence is stale is refused ESTALE; one that replaces
        another lease's grant takes that lease's link down, as a REVOKE would."""
        try:
            req = json.loads(bytes(msg.payload))
            device, lease = req["device"], req["lease"]
            fence, holder, pool = req.get("fence"), req.get("holder"), req.get("pool")
            if not isinstance(device, str) or not isinstance(lease, str) or not lease:
                raise TypeError("device and lease must be strings")
            if fence is not None and (not isinstance(fence, int) or isinstance(fence, bool) or fence < 0):
                raise TypeError("fence must be a natural number")
            if any(v is not None and not isinstance(v, str) for v in (holder, pool)):
                raise TypeError("holder and pool must be strings")
        except (ValueError, KeyError, TypeError, RecursionError, AttributeError):
            raise vp.ProtocolError("bad GRANT/REVOKE request") from None
        if device not in self.slots:
            conn.send(vp.error_reply(msg.header.msg_id, msg.header.command, errno.ENODEV))
            return
        if msg.header.command == LinkCommand.GRANT:
            try:
                grant, before = self.grants.grant(device, lease, fence, holder, pool)
            except StaleFence as exc:
                log.warning("refused GRANT: %s (the lease was fenced or moved)", exc)
                conn.send(vp.error_reply(msg.header.msg_id, msg.header.command, errno.ESTALE))
                return
            answer: dict = {"token": grant.token}
            log.info("granted a token for %s to lease %s (fence %s, holder %s)", device, lease, fence, holder)
            if before is not None and before.lease != lease and self.on_revoke is not None:
                self.on_revoke(device, before.lease)  # the device moved: the old lease's link goes
        else:
            answer = {"revoked": self.grants.revoke(device, lease, fence, pool)}
            if self.on_revoke is not None:
                self.on_revoke(device, lease)
        conn.send(vp.message(msg.header.msg_id, msg.header.command, json.dumps(answer).encode(), reply=True))

    def _serve_fault(self, conn: Connection, msg: Message) -> None:
        """FAULT {op, ...} -> JSON; a bad request gets EINVAL (ENODEV: no such device) and
        the reason as its payload."""
        try:
            if self.faults is None:
                raise FaultError("this box takes no faults", errno.ENOTSUP)
            answer = self.faults.request(json.loads(bytes(msg.payload)))
        except FaultError as exc:
            text = str(exc).encode()[:500]
            conn.send(vp.HEADER.pack(msg.header.msg_id, msg.header.command, vp.HEADER_SIZE + len(text),
                                     vp.TYPE_REPLY | vp.FLAG_ERROR, exc.errno) + text)
            return
        except (ValueError, RecursionError):
            raise vp.ProtocolError("bad FAULT request") from None
        conn.send(vp.message(msg.header.msg_id, msg.header.command, json.dumps(answer).encode(), reply=True))

    def inventory(self) -> dict:
        """Every device, its identity, size and whether a link holds it; no token.

        A device withdrawn by a surprise-removal fault is not listed until the fault
        ends: a pool refreshing its inventory must not offer what is gone from the bus.
        Only peers with a certificate of the pool's CA get here (or anyone, on a box run
        with ``plaintext = true``).
        """
        devices = []
        for sid, slot in self.slots.items():
            if self.faults is not None and self.faults.removed(sid) is not None:
                continue
            device = slot.device
            with device.lock:
                ids = int.from_bytes(device.region_read(vp.REGION_CONFIG, 0, 4), "little")
                size = device.capacity_bytes()
            devices.append({"id": sid, "class": "external" if slot.spec.model == EXTERNAL_MODEL else slot.spec.model,
                            "vendor": f"{ids & 0xFFFF:04x}", "model": f"{ids >> 16:04x}",
                            "capacity": size, "in_use": slot.in_use()})
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
            err = (errno.ENODEV if slot is None else errno.ENOTSUP if not slot.device.renders_screen
                   else None)
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
