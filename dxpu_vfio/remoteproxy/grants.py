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

Fencing (docs/pool.md#host-agents-and-fencing): a GRANT may carry the lease's fencing
token, a number the pool makes larger for every new lease (etcd: the revision that
created the lease record; SQLite: a counter), and the pool's id (fences of two pools,
or of a pool made afresh, do not compare). The box keeps, per device and pool, the
lowest fence it still accepts: a GRANT with a smaller one is refused
(:class:`StaleFence`), so a host the pool fenced -- whose manager may still run and
still hold a manager certificate -- cannot take a device back with its old lease once
the device moved; a GRANT raises the floor to its own fence, and a REVOKE with a fence
raises it past that fence (the lease is over for good). Once a device has a floor in a
pool, a GRANT of that pool without a fence is refused too. The floors live in memory
like the grants: a restarted box forgets both, and no old token survives that restart
either.
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
    fence: int | None = None  # the lease's fencing token, if the pool sent one
    holder: str | None = None  # who holds the lease (host name), for logs and the inventory
    pool: str | None = None  # the pool's id: fences compare only within one pool


class StaleFence(Exception):
    """A GRANT whose fencing token is below what the device already accepted."""


class Grants:
    """Thread-safe: admission threads read, control connections write."""

    def __init__(self) -> None:
        self._by_device: dict[str, Grant] = {}
        self._floor: dict[tuple[str, str | None], int] = {}  # (device, pool) -> lowest fence a GRANT may carry
        self._lock = threading.Lock()

    def grant(self, device: str, lease: str, fence: int | None = None, holder: str | None = None,
              pool: str | None = None) -> tuple[Grant, Grant | None]:
        """A fresh token for ``lease`` and the grant it replaced (whose link must go);
        :class:`StaleFence` if ``fence`` is below the device's floor in ``pool`` (or
        absent once it has one)."""
        with self._lock:
            floor = self._floor.get((device, pool))
            if floor is not None and (fence is None or fence < floor):
                raise StaleFence(f"fence {fence} of lease {lease} is below {floor} for {device}")
            if fence is not None:
                self._floor[(device, pool)] = fence
            grant = Grant(lease, secrets.token_hex(TOKEN_BYTES), fence, holder, pool)
            before = self._by_device.get(device)
            self._by_device[device] = grant
        return grant, before

    def revoke(self, device: str, lease: str, fence: int | None = None, pool: str | None = None) -> bool:
        """End ``lease``'s grant on ``device``; False if the device has no grant of that
        lease. With ``fence``, no GRANT of ``pool`` at or below it is taken for the device again."""
        with self._lock:
            if fence is not None:
                self._floor[(device, pool)] = max(self._floor.get((device, pool), 0), fence + 1)
            if self._by_device.get(device, Grant("", "")).lease != lease:
                return False
            del self._by_device[device]
            return True

    def floor(self, device: str, pool: str | None = None) -> int | None:
        with self._lock:
            return self._floor.get((device, pool))

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
