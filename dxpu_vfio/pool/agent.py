"""The host agent (``dxpu agent serve``): one per host, the hands of the pool on that host.

A manager anywhere (another host, a central place) attaches a device to a VM of host H
by writing the lease with ``host = H`` and ``request = "attach"``
(:meth:`dxpu_vfio.pool.manager.Manager.attach` with ``host=``); the agent of H, which
follows the lease records of its host, does what the manager does for its own VMs --
GRANT at the box with the lease's fencing token, the host proxy, ``device_add`` through
QMP or libvirt -- and answers in the record: ``attached`` (request cleared) or
``error`` (everything it did undone, the lease left for the requester to delete).
``request = "detach"``: it unplugs, ends the proxy, revokes the token and deletes the
lease. The plug path is the manager's own (:class:`~dxpu_vfio.pool.manager.Manager`
built for this host), so agent and manager plug alike.

The agent holds a host lease: with etcd an etcd lease with keepalive (the host key goes
when the agent stops renewing it), with SQLite a heartbeat row. A host whose agent died
keeps its leases -- its VMs may still run and use their devices -- until an admin fences
it (``dxpu host fence``); a fenced agent finds its heartbeat refused and stops serving.

It follows its host's lease records by reading them every ``poll`` s (the same code on
both stores); an etcd watch would only shorten the wait.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

from dxpu_vfio.errors import DxpuError
from dxpu_vfio.pool.agent_requests import ATTACH, DETACH
from dxpu_vfio.pool.manager import Manager, stop_proxy
from dxpu_vfio.pool.states import LeaseState
from dxpu_vfio.pool.storage import Lease, PoolStore
from dxpu_vfio.vmm.errors import VmGone
from dxpu_vfio.vmm.naming import open_target
from dxpu_vfio.vmm.rootports import device_present
from dxpu_vfio.vmm.targets import VmTarget

log = logging.getLogger("dxpu.agent")



class HostAgent:
    """Serves the lease requests of one host; :meth:`start` / :meth:`stop`, or
    :meth:`serve_once` from a test."""

    def __init__(self, store: PoolStore, host: str, *, open_vm: Callable[[str], VmTarget] = open_target,
                 ttl: float = 10.0, poll: float = 0.2, plug_timeout: float = 30.0) -> None:
        self.store = store
        self.host = host
        self.ttl = ttl
        self.poll = poll
        self.plug_timeout = plug_timeout
        self.manager = Manager(store, open_vm=open_vm, host=host)
        self.holder: str | None = None
        self.lost: str | None = None  # why the agent stopped serving (fenced, host lease lost)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> "HostAgent":
        self.holder = self.store.host_register(self.host, self.ttl, os.getpid())
        log.warning("agent of host %s serving (holder %s)", self.host, self.holder)
        for target, name in ((self._keepalive_loop, "keepalive"), (self._serve_loop, "serve")):
            thread = threading.Thread(target=target, name=f"agent-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Stop serving and give the host lease back (its leases stay: the VMs keep their devices)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.plug_timeout + 5)
        if self.holder is not None and self.lost is None:
            try:
                self.store.host_release(self.host, self.holder)
            except DxpuError as exc:
                log.warning("could not give the host lease back: %s", exc.message)

    def wait(self) -> None:
        while not self._stop.wait(1.0):
            pass

    def _keepalive_loop(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                alive = self.store.host_keepalive(self.host, self.holder or "")
            except DxpuError as exc:  # etcd unreachable: keep trying until the lease would run out
                log.warning("host lease keepalive failed: %s", exc.message)
                continue
            if not alive:
                self.lost = f"host {self.host} lost its host lease (fenced, or unheard for {self.ttl} s)"
                log.error("%s: the agent stops serving; dxpu host ls shows why", self.lost)
                self._stop.set()

    def _serve_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.serve_once()
            except DxpuError as exc:
                log.warning("serving lease requests failed: %s", exc.message)
            except Exception:  # noqa: BLE001 - one bad round must not end the agent
                log.exception("serving lease requests failed")
            self._stop.wait(self.poll)

    def serve_once(self) -> list[dict]:
        """Do what this host's lease records ask for, now; what was done."""
        done = []
        for lease in self.store.leases():
            if lease.host != self.host or lease.request is None or lease.error:
                continue
            if lease.request == ATTACH and lease.state == LeaseState.ATTACHING:
                done.append(self._attach(lease))
            elif lease.request == DETACH:
                done.append(self._detach(lease))
        return done

    def _attach(self, lease: Lease) -> dict:
        self.store.update_lease(lease.id, owner_pid=os.getpid())  # this process plugs it now
        plugged = False
        try:
            with self.manager.open_vm(lease.vm) as target, self.manager._vm_lock(target.key):
                if not target.alive():
                    raise DxpuError(f"VM {lease.vm} is not running on host {self.host}", hint="start it first")
                self._clear_leftovers(target, lease)
                try:
                    self.manager._plug(target, lease, self.plug_timeout)
                    plugged = True
                except BaseException:
                    if target.alive() and device_present(target, lease.qdev_id):
                        target.unplug(lease.qdev_id, self.manager.unplug_timeout)
                    raise
        except (DxpuError, OSError) as exc:
            why = getattr(exc, "message", str(exc))
            stop_proxy(lease)
            self.manager._revoke(lease)
            self.store.update_lease(lease.id, error=why, request=None)
            log.warning("attach of %s to %s failed: %s", lease.device, lease.vm, why)
            return {"lease": lease.id, "action": "failed", "why": why}
        assert plugged
        self.store.update_lease(lease.id, state=LeaseState.ATTACHED, request=None)
        log.warning("attached %s to %s on %s", lease.device, lease.vm, lease.port)
        return {"lease": lease.id, "action": "attached", "port": lease.port}

    def _clear_leftovers(self, target: VmTarget, lease: Lease) -> None:
        """What an agent that died half way through this plug left (its proxy, its device in
        the VM): gone before the plug starts again. A fresh lease has neither."""
        if lease.proxy_pid or lease.socket:
            log.warning("lease %s: ending the host proxy an earlier agent left", lease.id)
            stop_proxy(lease)
            lease.proxy_pid = lease.socket = None
        if device_present(target, lease.qdev_id):
            log.warning("lease %s: unplugging %s, which an earlier agent left in %s", lease.id, lease.qdev_id,
                        lease.vm)
            target.unplug(lease.qdev_id, self.manager.unplug_timeout)

    def _detach(self, lease: Lease) -> dict:
        try:
            with self.manager.open_vm(lease.vm) as target, self.manager._vm_lock(target.key):
                result = self.manager._detach_one(target, lease, self.manager.unplug_timeout)
        except VmGone as exc:
            result = self.manager._release(lease, f"VM gone: {exc.message}")
        except DxpuError as exc:  # e.g. the guest holds on: the device stays, the requester hears why
            self.store.update_lease(lease.id, error=exc.message, request=None)
            return {"lease": lease.id, "action": "failed", "why": exc.message}
        return {"lease": lease.id, "action": "detached", "why": result["why"]}
