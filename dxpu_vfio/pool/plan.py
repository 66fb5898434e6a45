"""``--dry-run``: what attach, detach and reconcile would do, step by step, without doing it.

A plan is a list of steps, each a dict with ``do`` (``store``, ``box``, ``proxy``,
``qmp``, ``agent``) and what exactly would be sent: the store's transaction (etcd:
compares and operations with the keys in clear; SQLite: the statements), the box's
admin request (GRANT/REVOKE with the fencing token), the host proxy's command, the QMP
command. To be exact it reads: the store (the allocation is chosen the way the
allocator would choose it, from a fresh read or a copy of the database) and the VM
(``qom-list`` and ``query-pci``, read-only, to pick the root ports and see what is
plugged). It writes nothing, grants nothing, starts nothing; lease ids and fencing
tokens in it are examples, and another admin may take the devices before a real run.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Protocol

from dxpu_vfio.pool.boxes import TLS_ROLE
from dxpu_vfio.pool.etcd_store import show_lease_delete
from dxpu_vfio.pool.states import LeaseState
from dxpu_vfio.pool.storage import QDEV_PREFIX, Lease, PoolStore
from dxpu_vfio.vmm.errors import VmGone
from dxpu_vfio.vmm.naming import target_key
from dxpu_vfio.vmm.rootports import plugged_devices, root_ports, used_root_ports
from dxpu_vfio.vmm.targets import VmTarget


class Manager(Protocol):
    """What a plan reads of the manager (:class:`dxpu_vfio.pool.manager.Manager`): its
    store, its host and how it opens a VM (read-only here)."""

    store: PoolStore
    host: str | None
    open_vm: Callable[[str], VmTarget]


def _update(manager: "Manager", lease: Lease, **fields: object) -> dict:
    shown = ", ".join(f"{k}={v}" for k, v in fields.items())
    if manager.store.kind == "etcd":
        key = f"{manager.store.prefix}leases/{lease.id}"  # type: ignore[attr-defined]
        txn: object = {"compare": [f"mod_revision({key}) == (as read)"], "success": [f"put {key} = {{..., {shown}}}"]}
    else:
        txn = [f"UPDATE leases SET {shown}, updated_at = now WHERE id = '{lease.id}'"]
    return {"do": "store", "what": f"lease {lease.id}: {shown}", "transaction": txn}


def _delete(manager: "Manager", lease: Lease) -> dict:
    txn: object = (show_lease_delete(manager.store.prefix, lease) if manager.store.kind == "etcd"  # type: ignore[attr-defined]
                   else [f"DELETE FROM leases WHERE id = '{lease.id}'"])
    return {"do": "store", "what": f"delete lease {lease.id} (frees {lease.device})", "transaction": txn}


def _revoke(manager: "Manager", lease: Lease) -> dict:
    dev = manager.store.device(lease.device)
    return {"do": "box", "what": "REVOKE", "box": dev["address"],
            "request": {"device": dev["name"], "lease": lease.id, "fence": lease.fence,
                        "pool": manager.store.pool_id}}


def _stop(lease: Lease) -> list[dict]:
    if not lease.proxy_pid:
        return []
    return [{"do": "proxy", "what": f"end host proxy pid {lease.proxy_pid} (SIGTERM, then SIGKILL)",
             "socket": lease.socket}]


def _device_del(lease: Lease) -> dict:
    return {"do": "qmp", "execute": "device_del", "arguments": {"id": lease.qdev_id},
            "then": "wait for DEVICE_DELETED"}


def attach(manager: "Manager", vm: str, *, host: str | None = None, **allocation: object) -> dict:
    host = host or manager.host
    key = target_key(vm)
    planned = manager.store.plan_allocate(key, owner_pid=os.getpid(), host=host, **allocation)  # type: ignore[attr-defined]
    leases: list[Lease] = planned["leases"]
    steps: list[dict] = [{"do": "store", "what": f"allocate {', '.join(lease.device for lease in leases)} "
                          f"for {key} on host {host} (leases 'attaching')", "transaction": planned["transaction"]}]
    if host != manager.host:
        steps += [_update(manager, lease, request="attach") for lease in leases]
        steps.append({"do": "agent", "what": f"the agent of host {host} grants, starts the host proxies and "
                      "runs device_add, then sets each lease 'attached' (or its error)"})
        return {"vm": key, "host": host, "dry_run": True, "steps": steps}
    with manager.open_vm(vm) as target:
        if not target.alive():
            steps.append({"do": "stop", "what": f"VM {vm} is not running: the attach would fail"})
            return {"vm": key, "host": host, "dry_run": True, "steps": steps}
        used = used_root_ports(target)
        free = [port for port in root_ports(target) if port not in used]
        for i, lease in enumerate(leases):
            dev = manager.store.device(lease.device)
            socket_path = target.socket_dir() / f"{lease.id}.sock"
            settings = {"address": dev["address"], "device": dev["name"]}
            settings.update({"tls_dir": dev["tls_dir"], "tls_role": TLS_ROLE} if dev["tls_dir"] else {"plaintext": True})
            steps += [
                {"do": "box", "what": "GRANT", "box": dev["address"],
                 "request": {"device": dev["name"], "lease": lease.id, "fence": lease.fence, "holder": host,
                             "pool": manager.store.pool_id}},
                {"do": "proxy", "what": "start the host proxy (the token goes by pipe)",
                 "command": [sys.executable, "-m", "dxpu_vfio.hostproxy", "--model", "remote",
                             "--socket", str(socket_path)]
                 + [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]},
                _update(manager, lease, socket=str(socket_path)), _update(manager, lease, proxy_pid="(its pid)")]
            if i >= len(free):
                steps.append({"do": "stop", "what": f"VM {vm} has no free root port for {lease.device}: the attach "
                              "would fail and be rolled back"})
                break
            steps += [_update(manager, lease, port=free[i]),
                      {"do": "qmp", "execute": "device_add", "arguments": {
                          "driver": "vfio-user-pci", "id": lease.qdev_id, "bus": free[i],
                          "socket": {"type": "unix", "path": str(socket_path)}}}]
        else:
            steps += [_update(manager, lease, state=str(LeaseState.ATTACHED)) for lease in leases]
    return {"vm": key, "host": host, "dry_run": True, "steps": steps}


def detach(manager: "Manager", vm: str, device: str | None, *, all_devices: bool = False,
           host: str | None = None) -> dict:
    key = target_key(vm)
    leases = manager.store.leases(key) if all_devices else [manager.store.lease_for(key, device or "")]
    steps: list[dict] = []
    if host is not None and host != manager.host:
        steps += [_update(manager, lease, request="detach") for lease in leases]
        steps.append({"do": "agent", "what": f"the agent of host {host} unplugs, ends the proxies, revokes the "
                      "tokens and deletes the leases"})
        return {"vm": key, "host": host, "dry_run": True, "steps": steps}
    try:
        with manager.open_vm(vm) as target:
            present = set(plugged_devices(target, QDEV_PREFIX)) if target.alive() else set()
    except VmGone:
        present = set()
        steps.append({"do": "note", "what": f"VM {vm} is gone: its leases would be released"})
    for lease in leases:
        steps.append(_update(manager, lease, state=str(LeaseState.DETACHING)))
        if lease.qdev_id in present:
            steps.append(_device_del(lease))
        steps += _stop(lease) + [_revoke(manager, lease), _delete(manager, lease)]
    return {"vm": key, "host": manager.host, "dry_run": True, "steps": steps}


def release_steps(manager: "Manager", lease: Lease, unplug: bool) -> list[dict]:
    """What reconcile does to release ``lease`` (for its dry run)."""
    steps = [_update(manager, lease, state=str(LeaseState.DETACHING))]
    if unplug:
        steps.append(_device_del(lease))
    return steps + _stop(lease) + [_revoke(manager, lease), _delete(manager, lease)]
