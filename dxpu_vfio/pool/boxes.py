"""Talking to GPU boxes: their inventory (also the manager's heartbeat probe), lease
tokens, screenshots.

A box answers an INVENTORY message (sent instead of HELLO, over the same mutual-TLS
link a host proxy uses) with its devices, their identity and size, and closes the link.
Registration stores that answer; the heartbeat repeats it. GRANT asks the box for a
fresh token for one device and lease (the host proxy proves it in HELLO), REVOKE ends
it; the box takes those, and SCREENSHOT, only from a manager's certificate.
"""

from __future__ import annotations

import errno
import hashlib
import json
import socket
import ssl
from pathlib import Path

from dxpu_vfio.deadline import Deadline
from dxpu_vfio.errors import DxpuError
from dxpu_vfio.link.protocol import LINK_VERSION, LinkCommand
from dxpu_vfio.link.transport import TlsFiles, connect, peer_certificate
from dxpu_vfio.vfio_user import protocol as vp
from dxpu_vfio.vfio_user.connection import Connection, ConnectionClosed

TLS_ROLE = "host"  # the manager and the host proxies present the host certificate of the pool's CA


class BoxUnreachable(DxpuError):
    """The box did not answer, or refused us (TLS), or answered nonsense."""


def tls_files(tls_dir: str | None) -> TlsFiles | None:
    return TlsFiles.in_dir(Path(tls_dir), TLS_ROLE) if tls_dir else None


def certificate_sha256(conn: Connection) -> str | None:
    """The SHA-256 of the certificate the box presented (None on a plaintext link)."""
    der = peer_certificate(conn)
    return hashlib.sha256(der).hexdigest() if der else None


def _open(address: str, tls_dir: str | None, timeout: float) -> Connection:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise BoxUnreachable(f"bad box address {address!r}", hint="give it as HOST:PORT, e.g. 198.18.1.2:7000")
    try:
        sock = connect(host, int(port), tls_files(tls_dir), timeout)
    except ssl.SSLError as exc:
        raise BoxUnreachable(f"TLS with box {address} failed: {exc.reason or exc}",
                             hint=f"the box and {tls_dir} must share one CA (dxpu certs makes them)") from exc
    except (OSError, ValueError) as exc:
        raise BoxUnreachable(f"cannot reach box {address}: {exc}",
                             hint="is `dxpu remote serve` running there, and routed from here?") from exc
    sock.settimeout(timeout)
    return Connection(sock)


def _ask(conn: Connection, command: int, request: dict, address: str, what: str) -> bytes:
    conn.send(vp.message(1, command, json.dumps(request).encode()))
    reply = conn.receive()
    if reply.header.is_error:
        reasons = {errno.ENODEV: "no such device", errno.EACCES: "lease token refused",
                   errno.EPERM: "this host's certificate is not one of the box's managers",
                   errno.ENOTSUP: "not a display device", errno.EINVAL: "the display's mode cannot be shown"}
        raise BoxUnreachable(f"box {address} refused the {what} request: "
                             f"{reasons.get(reply.header.error, reply.header.error)}")
    return bytes(reply.payload)


def grant_token(address: str, tls_dir: str | None, device: str, lease: str, timeout: float = 5.0) -> str:
    """A fresh token from the box for ``device``, named after ``lease``; it replaces any
    token the device had."""
    answer = _admin(address, tls_dir, LinkCommand.GRANT, {"device": device, "lease": lease}, timeout, "grant")
    token = answer.get("token")
    if not isinstance(token, str) or len(token) < 32:
        raise BoxUnreachable(f"box {address} answered GRANT without a token")
    return token


def revoke_token(address: str, tls_dir: str | None, device: str, lease: str, timeout: float = 2.0) -> bool:
    """End ``lease``'s token for ``device`` (and a link it admitted); False if it had none."""
    return bool(_admin(address, tls_dir, LinkCommand.REVOKE, {"device": device, "lease": lease}, timeout,
                       "revoke").get("revoked"))


def _admin(address: str, tls_dir: str | None, command: int, request: dict, timeout: float, what: str) -> dict:
    conn = _open(address, tls_dir, timeout)
    deadline = Deadline(conn.sock, timeout)
    try:
        answer = json.loads(_ask(conn, command, request, address, what))
        if not isinstance(answer, dict):
            raise ValueError("not an object")
        return answer
    except (ConnectionClosed, OSError, ssl.SSLError) as exc:
        raise BoxUnreachable(f"box {address} closed the link during the {what} request: {exc}",
                             hint="a box older than this manager, or one that refuses our certificate") from exc
    except (ValueError, RecursionError, vp.ProtocolError) as exc:
        raise BoxUnreachable(f"box {address} sent a bad {what} answer: {exc}") from exc
    finally:
        deadline.cancel()
        conn.close()


def fetch_screenshot(address: str, tls_dir: str | None, device: str, timeout: float = 30.0) -> bytes:
    """A display's scanout as PNG, rendered on the box, fetched in 1 MiB pieces."""
    conn = _open(address, tls_dir, timeout)
    try:
        png = bytearray()
        while True:
            reply = _ask(conn, LinkCommand.SCREENSHOT, {"device": device, "offset": len(png)},
                         address, "screenshot")
            total = int.from_bytes(reply[:8], "little")
            png += reply[8:]
            if len(png) >= total or len(reply) <= 8:
                return bytes(png)
    except (ConnectionClosed, OSError, ssl.SSLError) as exc:
        raise BoxUnreachable(f"box {address} closed the link during the screenshot: {exc}") from exc
    finally:
        conn.close()


def fetch_inventory(address: str, tls_dir: str | None, timeout: float = 3.0) -> dict:
    """The box's answer to INVENTORY: ``{"box": name, "devices": [...]}``, plus the
    SHA-256 of the certificate it presented (``certificate_sha256``). ``timeout`` bounds
    the connect and the handshake, and then the whole exchange again."""
    conn = _open(address, tls_dir, timeout)
    deadline = Deadline(conn.sock, timeout)
    try:
        return _inventory(conn, address, tls_dir)
    except BoxUnreachable as exc:
        if deadline.expired:
            raise BoxUnreachable(f"box {address} did not answer the inventory within {timeout} s",
                                 hint="it stalls or trickles: look at the remote proxy's log on the box") from exc
        raise
    finally:
        deadline.cancel()
        conn.close()


def _inventory(conn: Connection, address: str, tls_dir: str | None) -> dict:
    try:
        inventory = json.loads(_ask(conn, LinkCommand.INVENTORY, {"version": LINK_VERSION}, address, "inventory"))
        if not isinstance(inventory, dict) or not isinstance(inventory.get("devices"), list) \
                or not inventory.get("box"):
            raise ValueError("no box name or device list")
        inventory["certificate_sha256"] = certificate_sha256(conn)
        return inventory
    except ssl.SSLError as exc:
        raise BoxUnreachable(f"box {address} refused our certificate: {exc.reason or exc}",
                             hint=f"the box and {tls_dir} must share one CA (dxpu certs makes them)") from exc
    except (ConnectionClosed, OSError, socket.timeout) as exc:
        raise BoxUnreachable(f"box {address} closed the link without an inventory: {exc}",
                             hint="a box with another CA drops us after the handshake; check certificates") from exc
    except (ValueError, RecursionError, vp.ProtocolError) as exc:
        raise BoxUnreachable(f"box {address} sent a bad inventory: {exc}") from exc
