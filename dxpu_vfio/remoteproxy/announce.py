"""The box agent: a remote proxy configured with ``[pool]`` announces its box in an etcd pool.

It takes an etcd lease of ``ttl`` s and publishes, in one transaction, the box's record
(address, the TLS directory hosts use, its certificate's SHA-256 and the inventory's
**generation**), its inventory and an ``alive`` key under that lease
(:meth:`dxpu_vfio.pool.etcd_store.EtcdStore.announce_box`); then it renews the lease every
third of the TTL and publishes again when the generation changes (an external server came
or went with other identity) or when the lease was lost (etcd unreachable longer than
the TTL). A box that dies stops renewing: etcd drops the alive key at most ``ttl`` s
later, and from then on the pool lends none of its devices and reports the attached ones
``box_state = down``; it is back when the box announces again. A box that stops cleanly
revokes its lease, so it is down at once. No ``dxpu box add`` is needed.

The generation is a digest of the inventory (device ids, classes, PCI ids, capacities):
it changes exactly when the inventory does, also across restarts of the box.
"""

from __future__ import annotations

import hashlib
import json
import logging
import ssl
import threading
from pathlib import Path
from typing import Callable

from dxpu_vfio.errors import DxpuError
from dxpu_vfio.pool.boxes import DEVICE_FIELDS, check_inventory
from dxpu_vfio.pool.storage import BoxAnnouncements, box_announcements

log = logging.getLogger("dxpu.remote")


def inventory_generation(devices: list[dict]) -> str:
    """A digest of the inventory that changes exactly when the inventory does."""
    kept = sorted(({field: d[field] for field in DEVICE_FIELDS} for d in devices), key=lambda d: d["id"])
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def certificate_sha256(tls_dir: Path | None, name: str) -> str | None:
    """The SHA-256 of the certificate the box presents (``NAME.pem``), as a host sees it."""
    if tls_dir is None:
        return None
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert((Path(tls_dir) / f"{name}.pem").read_text())).hexdigest()


class BoxAnnouncer:
    """Keeps one box published under a box lease; :meth:`start` / :meth:`stop`."""

    def __init__(self, store: BoxAnnouncements, name: str, address: str, tls_dir: str | None,
                 cert_sha256: str | None, inventory: Callable[[], dict], ttl: float) -> None:
        self.store = store
        self.name = name
        self.address = address
        self.tls_dir = tls_dir
        self.cert_sha256 = cert_sha256
        self.inventory = inventory
        self.ttl = ttl
        self.lease: str | None = None
        self.generation: str | None = None
        self.published = 0  # announcements made (the first, a new generation, a lost lease)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _devices(self) -> list[dict]:
        inventory = self.inventory()
        check_inventory(inventory)
        return [{field: d[field] for field in DEVICE_FIELDS} for d in inventory["devices"]]

    def publish(self) -> None:
        """Announce the box now (a fresh box lease if it has none)."""
        devices = self._devices()
        generation = inventory_generation(devices)
        if self.lease is None:
            self.lease = self.store.grant_lease(self.ttl)
        self.store.announce_box(self.name, self.address, self.tls_dir, devices, self.cert_sha256, generation,
                                self.lease)
        if generation != self.generation:
            log.warning("box %s announced at %s: %d device(s), generation %s (box lease %s, %g s)", self.name,
                        self.address, len(devices), generation, self.lease, self.ttl)
        self.generation = generation
        self.published += 1

    def start(self) -> "BoxAnnouncer":
        try:
            self.publish()
        except DxpuError as exc:  # etcd down at start: the box serves, and keeps trying
            log.error("box %s could not announce itself: %s; retrying every %g s", self.name, exc.message,
                      self.ttl / 3)
        self._thread = threading.Thread(target=self._loop, name="box-announce", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                if self.lease is not None and not self.store.keepalive(self.lease):
                    log.error("box %s lost its box lease %s (etcd unheard for %g s?); announcing again",
                              self.name, self.lease, self.ttl)
                    self.lease = None
                if self.lease is None or inventory_generation(self._devices()) != self.generation:
                    self.publish()
            except DxpuError as exc:
                log.warning("box %s: renewing its announcement failed: %s", self.name, exc.message)
            except Exception:  # noqa: BLE001 - the box keeps serving its devices whatever this thread meets
                log.exception("box %s: renewing its announcement failed", self.name)

    def stop(self) -> None:
        """Stop renewing and revoke the box lease: the pool sees the box down at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.lease is not None:
            try:
                self.store.revoke_lease(self.lease)
            except DxpuError as exc:
                log.warning("box %s: could not revoke its box lease (it expires in %g s): %s", self.name,
                            self.ttl, exc.message)
            self.lease = None


def announcer_for(config, proxy) -> BoxAnnouncer:
    """The announcer of a running :class:`~dxpu_vfio.remoteproxy.proxy.RemoteProxy` with ``[pool]``."""
    from dxpu_vfio.pool.etcd_store import EtcdStore
    pool = config.pool
    if pool.address is None and config.listen in ("0.0.0.0", "::", ""):
        raise DxpuError(f"box {config.name} listens on {config.listen!r}: it cannot tell the pool its address",
                        hint='set [pool] address = "HOST:PORT" (how hosts reach the box)')
    address = pool.address or f"{config.listen}:{proxy.port}"
    host_tls_dir = pool.host_tls_dir or (None if config.plaintext else str(config.tls_dir))
    quick = min(2.0, pool.ttl / 3)  # a renewal must not outlast a third of the TTL in retries
    store = EtcdStore(pool.etcd_endpoints, prefix=pool.prefix, tls_dir=pool.etcd_tls_dir, timeout=quick,
                      retry_for=quick)
    return BoxAnnouncer(box_announcements(store), config.name, address, host_tls_dir,
                        None if config.plaintext else certificate_sha256(config.tls_dir, config.name),
                        proxy.inventory, pool.ttl)
