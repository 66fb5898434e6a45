"""Talking to GPU boxes: their inventory (also the manager's heartbeat probe), lease
tokens, screenshots.

A box answers an INVENTORY message (sent instead of HELLO, over the same mutual-TLS
link a host proxy uses) with its devices, their identity and size, and closes the link.
Registration stores that answer; the heartbeat repeats it. GRANT asks the box for a
fresh token for one device and lease (the host proxy proves it in HELLO), REVOKE ends
it; the box takes those, and SCREENSHOT, only from a manager's certificate.

What a box answers is checked before anything is kept of it (a box may be broken or
hostile): an inventory is one message (at most ``vp.MAX_MESSAGE``) of at most
``MAX_DEVICES`` devices, each with its fields of their types; a screenshot is at most
``MAX_SCREENSHOT`` bytes, its pieces agree on the total and each one moves it on, and the
whole exchange has a deadline. Anything else is a :class:`BoxUnreachable` that says what
the box sent.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import ssl
from pathlib import Path

from dxpu_vfio.deadline import Deadline
from dxpu_vfio.errors import DxpuError
from dxpu_vfio.link.protocol import LINK_VERSION, LinkCommand
from dxpu_vfio.link.transport import TlsFiles, connect, peer_certificate, split_address
from dxpu_vfio.vfio_user import protocol as vp
from dxpu_vfio.vfio_user.connection import Connection, ConnectionClosed

TLS_ROLE = "host"  # the manager and the host proxies present the host certificate of the pool's CA
MAX_SCREENSHOT = 64 << 20  # bytes of PNG: a 4K scanout of noise is ~33 MiB
MAX_DEVICES = 1024  # devices in one box's inventory
# an inventory device's fields and their types (capacity: bytes, an int; not a bool)
DEVICE_FIELDS: dict[str, type] = {"id": str, "class": str, "vendor": str, "model": str, "capacity": int}
MAX_FIELD = 256  # characters in one of the strings above


class BoxUnreachable(DxpuError):
    """The box did not answer, or refused us (TLS), or answered nonsense."""


def tls_files(tls_dir: str | None) -> TlsFiles | None:
    return TlsFiles.in_dir(Path(tls_dir), TLS_ROLE) if tls_dir else None


def certificate_sha256(conn: Connection) -> str | None:
    """The SHA-256 of the certificate the box presented (None on a plaintext link)."""
    der = peer_certificate(conn)
    return hashlib.sha256(der).hexdigest() if der else None


def _open(address: str, tls_dir: str | None, timeout: float) -> Connection:
    try:
        host, port = split_address(address)
    except ValueError as exc:
        raise BoxUnreachable(str(exc), hint="give it as HOST:PORT, e.g. 198.18.1.2:7000") from exc
    try:
        sock = connect(host, port, tls_files(tls_dir), timeout)
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
                   errno.ENOTSUP: "not a display device", errno.EINVAL: "the display's mode cannot be shown",
                   errno.ESTALE: "the lease's fencing token is stale (the lease was fenced or the device moved)"}
        err = reply.header.error
        known = reasons.get(err) or (f"{os.strerror(err)} (errno {err})" if 0 < err < 4096 else f"error code {err}")
        raise BoxUnreachable(f"box {address} refused the {what} request: {known}")
    return bytes(reply.payload)


def grant_token(address: str, tls_dir: str | None, device: str, lease: str, timeout: float = 5.0, *,
                fence: int | None = None, holder: str | None = None, pool: str | None = None) -> str:
    """A fresh token from the box for ``device``, named after ``lease``; it replaces any
    token the device had (and takes that lease's link down). With ``fence`` (the lease's
    fencing token, comparable within ``pool``) the box refuses it if a newer lease of that
    pool already had the device."""
    request: dict = {"device": device, "lease": lease}
    if fence is not None:
        request.update(fence=fence, holder=holder, pool=pool)
    answer = _admin(address, tls_dir, LinkCommand.GRANT, request, timeout, "grant")
    token = answer.get("token")
    if not isinstance(token, str) or len(token) < 32:
        raise BoxUnreachable(f"box {address} answered GRANT without a token")
    return token


def revoke_token(address: str, tls_dir: str | None, device: str, lease: str, timeout: float = 2.0, *,
                 fence: int | None = None, pool: str | None = None) -> bool:
    """End ``lease``'s token for ``device`` (and a link it admitted); False if it had none.
    With ``fence``, the box takes no GRANT at or below that fencing token again."""
    request: dict = {"device": device, "lease": lease}
    if fence is not None:
        request.update(fence=fence, pool=pool)
    return bool(_admin(address, tls_dir, LinkCommand.REVOKE, request, timeout, "revoke").get("revoked"))


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


def fetch_screenshot(address: str, tls_dir: str | None, device: str, timeout: float = 30.0,
                     limit: int = MAX_SCREENSHOT) -> bytes:
    """A display's scanout as PNG, rendered on the box, fetched in 1 MiB pieces: at most
    ``limit`` bytes, the whole exchange within ``timeout``."""
    conn = _open(address, tls_dir, timeout)
    deadline = Deadline(conn.sock, timeout)
    try:
        png = bytearray()
        total = None
        while True:
            reply = _ask(conn, LinkCommand.SCREENSHOT, {"device": device, "offset": len(png)},
                         address, "screenshot")
            if len(reply) < 8:
                raise BoxUnreachable(f"box {address} sent a bad screenshot: a piece of {len(reply)} bytes")
            said = int.from_bytes(reply[:8], "little")
            if total is not None and said != total:
                raise BoxUnreachable(f"box {address} sent a bad screenshot: its pieces disagree on the size "
                                     f"({total}, then {said} bytes)")
            total = said
            if total > limit:
                raise BoxUnreachable(f"box {address} offered a screenshot of {total} bytes; at most {limit} "
                                     "are accepted", hint="the guest's display mode is too large to fetch")
            piece = reply[8:]
            if not piece and len(png) < total:
                raise BoxUnreachable(f"box {address} ended the screenshot at {len(png)} of {total} bytes")
            if len(png) + len(piece) > total:
                raise BoxUnreachable(f"box {address} sent more screenshot than the {total} bytes it offered")
            png += piece
            if len(png) == total:
                return bytes(png)
    except vp.ProtocolError as exc:  # a message larger than any piece may be, or unframed bytes
        raise BoxUnreachable(f"box {address} sent a bad screenshot: {exc}") from exc
    except (ConnectionClosed, OSError, ssl.SSLError) as exc:
        if deadline.expired:
            raise BoxUnreachable(f"box {address} did not send the screenshot within {timeout} s",
                                 hint="it stalls or trickles: look at the remote proxy's log on the box") from exc
        raise BoxUnreachable(f"box {address} closed the link during the screenshot: {exc}") from exc
    finally:
        deadline.cancel()
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
        check_inventory(inventory)
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


def check_inventory(inventory: object) -> None:
    """ValueError naming what is wrong with a box's inventory (what the store would keep)."""
    if not isinstance(inventory, dict) or not isinstance(inventory.get("devices"), list):
        raise ValueError("no device list")
    if not isinstance(inventory.get("box"), str) or not 0 < len(inventory["box"]) <= MAX_FIELD:
        raise ValueError("no box name")
    devices = inventory["devices"]
    if len(devices) > MAX_DEVICES:
        raise ValueError(f"{len(devices)} devices; at most {MAX_DEVICES} are accepted")
    seen = set()
    for i, device in enumerate(devices):
        if not isinstance(device, dict):
            raise ValueError(f"device {i} is not an object")
        for field, kind in DEVICE_FIELDS.items():
            value = device.get(field)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"device {i}: {field!r} must be {'an integer' if kind is int else 'a string'}")
            if kind is str and not 0 < len(value) <= MAX_FIELD:
                raise ValueError(f"device {i}: {field!r} must be 1 to {MAX_FIELD} characters")
        if device["capacity"] < 0 or device["capacity"] >= 1 << 63:
            raise ValueError(f"device {i}: capacity {device['capacity']} is out of range")
        if device["id"] in seen:
            raise ValueError(f"device id {device['id']!r} appears twice")
        seen.add(device["id"])
