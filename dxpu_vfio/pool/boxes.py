"""Talking to GPU boxes: their inventory, which is also the manager's heartbeat probe.

A box answers an INVENTORY message (sent instead of HELLO, over the same mutual-TLS
link a host proxy uses) with its devices, their identity, size and lease token, and
closes the link. Registration stores that answer; the heartbeat repeats it.
"""

from __future__ import annotations

import json
import socket
import ssl
from pathlib import Path

from ..errors import DxpuError
from ..link.protocol import LINK_VERSION, LinkCommand
from ..link.transport import TlsFiles, connect
from ..vfio_user import protocol as vp
from ..vfio_user.connection import Connection, ConnectionClosed

TLS_ROLE = "host"  # the manager and the host proxies present the host certificate of the pool's CA


class BoxUnreachable(DxpuError):
    """The box did not answer, or refused us (TLS), or answered nonsense."""


def tls_files(tls_dir: str | None) -> TlsFiles | None:
    return TlsFiles.in_dir(Path(tls_dir), TLS_ROLE) if tls_dir else None


def fetch_inventory(address: str, tls_dir: str | None, timeout: float = 3.0) -> dict:
    """The box's answer to INVENTORY: ``{"box": name, "devices": [...]}``."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise BoxUnreachable(f"bad box address {address!r}", hint="give it as HOST:PORT, e.g. 198.18.1.2:7000")
    try:
        tls = tls_files(tls_dir)
        sock = connect(host, int(port), tls, timeout)
    except ssl.SSLError as exc:
        raise BoxUnreachable(f"TLS with box {address} failed: {exc.reason or exc}",
                             hint=f"the box and {tls_dir} must share one CA (dxpu certs makes them)") from exc
    except (OSError, ValueError) as exc:
        raise BoxUnreachable(f"cannot reach box {address}: {exc}",
                             hint="is `dxpu remote serve` running there, and routed from here?") from exc
    conn = Connection(sock)
    sock.settimeout(timeout)
    try:
        conn.send(vp.message(1, LinkCommand.INVENTORY, json.dumps({"version": LINK_VERSION}).encode()))
        reply = conn.receive()
        if reply.header.is_error:
            raise BoxUnreachable(f"box {address} refused the inventory request (error {reply.header.error})")
        inventory = json.loads(bytes(reply.payload))
        if not isinstance(inventory.get("devices"), list) or not inventory.get("box"):
            raise ValueError("no box name or device list")
        return inventory
    except ssl.SSLError as exc:
        raise BoxUnreachable(f"box {address} refused our certificate: {exc.reason or exc}",
                             hint=f"the box and {tls_dir} must share one CA (dxpu certs makes them)") from exc
    except (ConnectionClosed, OSError, socket.timeout) as exc:
        raise BoxUnreachable(f"box {address} closed the link without an inventory: {exc}",
                             hint="a box with another CA drops us after the handshake; check certificates") from exc
    except (ValueError, vp.ProtocolError) as exc:
        raise BoxUnreachable(f"box {address} sent a bad inventory: {exc}") from exc
    finally:
        conn.close()
