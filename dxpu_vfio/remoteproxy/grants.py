"""Lease tokens the box issued: one fresh secret per lease, known to the manager and the box.

The pool manager asks the box for a token when it attaches a device (GRANT, over the
admin exchange: :mod:`dxpu_vfio.remoteproxy.control`) and hands it to the host proxy it
starts; the host proxy proves it in HELLO (:func:`dxpu_vfio.link.protocol.hello_proof`)
without sending it. A device has at most one grant: a new one replaces the one before,
REVOKE (at detach) ends it. Grants live in memory: a restarted box knows none, and the
pool's heal re-plugs its devices with fresh ones.

A device may also carry a static token from the box's config (``lease = ...``), for a
host proxy started by hand or by the lab without a pool; it admits only while the
device has no grant, and the box never tells it to anyone.
"""

from __future__ import annotations

import hashlib
import secrets
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

TOKEN_BYTES = 32


@dataclass(frozen=True)
class Grant:
    lease: str  # the pool's lease id: names the grant in logs and in REVOKE
    token: str


class Grants:
    """Thread-safe: admission threads read, control connections write."""

    def __init__(self) -> None:
        self._by_device: dict[str, Grant] = {}
        self._lock = threading.Lock()

    def grant(self, device: str, lease: str) -> Grant:
        grant = Grant(lease, secrets.token_hex(TOKEN_BYTES))
        with self._lock:
            self._by_device[device] = grant
        return grant

    def revoke(self, device: str, lease: str) -> bool:
        """End ``lease``'s grant on ``device``; False if the device has no grant of that lease."""
        with self._lock:
            if self._by_device.get(device, Grant("", "")).lease != lease:
                return False
            del self._by_device[device]
            return True

    def current(self, device: str) -> Grant | None:
        with self._lock:
            return self._by_device.get(device)


def certificate_fingerprints(tls_dir: Path | None, roles: list[str]) -> set[str]:
    """SHA-256 of the certificates ``ROLE.pem`` in ``tls_dir`` that exist: the peers the box
    takes admin commands from (GRANT, REVOKE, SCREENSHOT)."""
    found = set()
    for role in roles if tls_dir else []:
        path = Path(tls_dir) / f"{role}.pem"
        try:
            der = ssl.PEM_cert_to_DER_cert(path.read_text())
        except (OSError, ValueError):
            continue
        found.add(hashlib.sha256(der).hexdigest())
    return found
