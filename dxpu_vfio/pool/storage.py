"""What the manager needs of a pool store, and the pieces both stores share.

Two stores live behind :class:`PoolStore`: SQLite (:mod:`dxpu_vfio.pool.store`, one
file, the single-host default) and etcd (:mod:`dxpu_vfio.pool.etcd_store`, one pool
for many hosts). Both give the same answers to the same calls -- one suite of store
tests runs on both -- so the manager does not know which one it has.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from dxpu_vfio.errors import DxpuError
from dxpu_vfio.pool.states import BoxState, LeaseState

QDEV_PREFIX = "pool-"  # QEMU ids of devices the pool plugged
POLICIES = ("pack", "spread")
STORES = ("sqlite", "etcd")


class StoreError(DxpuError):
    """The store cannot be opened or does not hold what was asked for."""


class NoFreeDevice(StoreError):
    """Fewer free devices match than were asked for; nothing was allocated."""


@dataclass
class Lease:
    id: str
    device: str
    vm: str
    state: LeaseState
    qdev_id: str
    port: str | None = None
    socket: str | None = None
    proxy_pid: int | None = None
    owner_pid: int | None = None
    created_at: float = 0.0
    updated_at: float = 0.0
    host: str | None = None  # the host whose VM holds it (None: a lease of a single-host pool)
    fence: int | None = None  # fencing token: larger for every new lease (docs/pool.md#fencing)
    holder: str | None = None  # the host's agent lease (etcd lease id / heartbeat id) at allocation
    request: str | None = None  # what the host agent is asked to do: "attach" or "detach"
    error: str | None = None  # why the host agent could not do it

    def __post_init__(self) -> None:
        self.state = LeaseState(self.state)  # rows hold plain strings

    @property
    def box(self) -> str:
        return self.device.split("/", 1)[0]


LEASE_FIELDS = frozenset({"state", "port", "socket", "proxy_pid", "owner_pid", "request", "error"})  # what update_lease may change


def check_allocation(policy: str, count: int) -> None:
    if policy not in POLICIES:
        raise StoreError(f"unknown policy {policy!r}; use one of {', '.join(POLICIES)}")
    if count < 1:
        raise StoreError(f"--count must be at least 1, not {count}")


def check_lease_fields(fields: dict[str, object]) -> None:
    if not fields or set(fields) - LEASE_FIELDS:
        raise ValueError(f"cannot update lease fields {sorted(set(fields) - LEASE_FIELDS)}")
    if "state" in fields:
        fields["state"] = LeaseState(fields["state"])  # ValueError before the store sees it


def no_free_device(count: int, free: int, device_class: str | None, box: str | None,
                   device: str | None) -> NoFreeDevice:
    what = " ".join(filter(None, [f"class {device_class}" if device_class else "",
                                  f"on box {box}" if box else "", f"named {device}" if device else ""]))
    return NoFreeDevice(f"asked for {count} device(s){' of ' + what if what else ''}, {free} free",
                        hint="dxpu ls shows boxes, devices and who holds them")


def no_such_box(name: str, known: list[str]) -> StoreError:
    return StoreError(f"no box named {name!r} in the pool (known: {', '.join(known) or 'none'})",
                      hint="register it with: dxpu box add NAME HOST:PORT --tls-dir DIR")


def box_busy(name: str, held: int) -> StoreError:
    return StoreError(f"box {name} still has {held} leased device(s)",
                      hint="detach them first (dxpu ls shows which VMs hold them)")


def host_fenced(host: str) -> StoreError:
    return StoreError(f"host {host} is fenced: the pool gives it no device",
                      hint=f"once its old VMs are gone: dxpu host unfence {host}")


def host_view(name: str, record: dict | None, fenced_at: float | None, leases: int, now: float) -> dict:
    """What ``dxpu host ls`` shows of a host, from either store."""
    record = record or {}
    expires = record.get("expires_at")
    return {"name": name, "alive": record.get("holder") is not None and (expires is None or expires > now),
            "fenced": fenced_at is not None, "fenced_at": fenced_at, "holder": record.get("holder"),
            "agent_pid": record.get("agent_pid"), "started_at": record.get("started_at"), "leases": leases}


def no_such_device(device_id: str) -> StoreError:
    return StoreError(f"no device {device_id!r} in the pool", hint="dxpu ls lists the devices")


def pick_lease(leases: list[Lease], vm: str, name: str) -> Lease:
    """A VM's lease by lease id, QEMU id, device id (box/dev) or device name."""
    matches = [lease for lease in leases
               if name in (lease.id, lease.qdev_id, lease.device, lease.device.split("/", 1)[1])]
    if len(matches) != 1:
        held = ", ".join(f"{lease.device} ({lease.id})" for lease in leases) or "none"
        raise StoreError(f"{vm} holds {'no' if not matches else 'several'} device(s) matching {name!r} "
                         f"(it holds: {held})", hint="name the lease id shown by dxpu status VM")
    return matches[0]


class PoolStore(Protocol):
    """The calls the manager, the service and the metrics make. Boxes and devices are
    dicts with the keys the SQLite rows have (``boxes()``: name, address, tls_dir, state,
    registered_at, last_seen, last_error, cert_sha256, lent, devices, leased)."""

    kind: str
    path: Path  # local state: the manager keeps host proxy logs beside it
    takes_announcements: bool  # boxes announce themselves in it (BoxAnnouncements): etcd
    watches_leases: bool  # host agents watch its lease records (watch_leases) instead of polling: etcd

    @property
    def schema_version(self) -> int: ...
    @property
    def pool_id(self) -> str: ...
    def close(self) -> None: ...
    def register_box(self, name: str, address: str, tls_dir: str | None, devices: list[dict],
                     cert_sha256: str | None = None) -> None: ...
    def remove_box(self, name: str) -> None: ...
    def box(self, name: str) -> dict: ...
    def mark_box(self, name: str, up: bool, error: str | None = None) -> BoxState: ...
    def boxes(self) -> list[dict]: ...
    def devices(self) -> list[dict]: ...
    def device(self, device_id: str) -> dict: ...
    def allocate(self, vm: str, *, device_class: str | None = None, count: int = 1, box: str | None = None,
                 device: str | None = None, policy: str = "pack", owner_pid: int | None = None,
                 host: str | None = None) -> list[Lease]: ...
    def update_lease(self, lease_id: str, **fields: object) -> None: ...
    def delete_lease(self, lease_id: str) -> None: ...
    def leases(self, vm: str | None = None) -> list[Lease]: ...
    def lease(self, lease_id: str) -> Lease | None: ...  # one lease as it is now (None: deleted)
    def lease_for(self, vm: str, name: str) -> Lease: ...
    # hosts (docs/pool.md#host-agents-and-fencing)
    def host_register(self, host: str, ttl: float, agent_pid: int) -> str: ...
    def host_keepalive(self, host: str, holder: str) -> bool: ...
    def host_release(self, host: str, holder: str) -> None: ...
    def hosts(self) -> list[dict]: ...
    def fence_host(self, host: str) -> list[Lease]: ...
    def unfence_host(self, host: str) -> None: ...


class BoxAnnouncements(Protocol):
    """What a store needs so that boxes announce themselves (docs/pool.md#boxes-that-announce-themselves):
    a lease that lives while its holder renews it, and a box published under it. etcd has
    it; a SQLite file cannot be reached from a box, so SQLite pools register boxes by hand
    (``dxpu box add``)."""

    def grant_lease(self, ttl: float) -> str: ...
    def keepalive(self, lease: str) -> bool: ...
    def revoke_lease(self, lease: str) -> None: ...
    def announce_box(self, name: str, address: str, tls_dir: str | None, devices: list[dict],
                     cert_sha256: str | None, generation: str, lease: str) -> None: ...


def box_announcements(store: PoolStore) -> BoxAnnouncements:
    """``store`` as a place boxes announce themselves in, or why it is not one."""
    if not store.takes_announcements:
        raise StoreError(f"a {store.kind} pool cannot take announcements from boxes",
                         hint="use an etcd pool ([pool] store = \"etcd\" in BOX.toml), or register the box "
                              "by hand: dxpu box add NAME HOST:PORT --tls-dir DIR")
    return store  # type: ignore[return-value]
