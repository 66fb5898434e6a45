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

How it learns of requests depends on the store. On etcd, a watch drives it: it reads
every lease once (a full read, at revision R), acts on what is asked of its host, and
watches the lease records from R + 1; every change the watch delivers for its host is
read afresh and acted on (``actions["watch"]``). It keeps the revision up to which the
watch delivered everything and restarts a broken watch just after it, so a request
written while the watch was down is acted on when it is back; a compacted history, and
every ``resync`` s anyway, cost a full read again (``actions["resync"]``). On SQLite it
reads its host's lease records every ``poll`` s (``actions["poll"]``). Whatever drives
it, one thread acts, on the lease as it is at that moment, so a request seen twice
(watch and resync) is done once.

Every ``heal_every`` s the serving thread heals this host's attached devices whose link
died (:meth:`HostAgent._heal_if_due`), from its own view of them (:attr:`HostAgent.attached`),
which the same reads keep: the full reads and the poll replace it, each lease the watch
names is read afresh into it, and a deleted record leaves it. So a pass reads the boxes
this host holds devices on, one each, never every lease or box of the pool.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import Counter
from typing import Callable

from dxpu_vfio.errors import DxpuError
from dxpu_vfio.pool.agent_requests import ATTACH, DETACH
from dxpu_vfio.pool.etcd_watch import WatchCompacted, WatchFailed
from dxpu_vfio.pool.manager import Manager, stop_proxy
from dxpu_vfio.pool.states import BoxState, LeaseState
from dxpu_vfio.pool.storage import Lease, PoolStore
from dxpu_vfio.vmm.errors import VmGone
from dxpu_vfio.vmm.naming import open_target
from dxpu_vfio.vmm.rootports import device_present
from dxpu_vfio.vmm.targets import VmTarget

log = logging.getLogger("dxpu.agent")
RESYNC = object()  # the serving thread's cue for a full read
GONE = "gone"  # why of a queued lease id: its record was deleted



class HostAgent:
    """Serves the lease requests of one host; :meth:`start` / :meth:`stop`, or
    :meth:`serve_once` from a test."""

    def __init__(self, store: PoolStore, host: str, *, open_vm: Callable[[str], VmTarget] = open_target,
                 ttl: float = 10.0, poll: float = 0.2, plug_timeout: float = 30.0, resync: float = 30.0,
                 heal_every: float = 2.0) -> None:
        self.store = store
        self.host = host
        self.ttl = ttl
        self.poll = poll
        self.resync = resync
        self.heal_every = heal_every  # s between looks at this host's attached devices (0: never)
        self._next_heal = 0.0
        self.attached: dict[str, Lease] = {}  # this host's attached leases, what a heal pass looks at (id -> lease)
        self.plug_timeout = plug_timeout
        self.watched = store.watches_leases  # etcd: a watch drives it; SQLite: polling
        self.actions: Counter[str] = Counter()  # requests acted on, by what brought them: watch, resync, poll
        self.revision = 0  # the watch delivered every change up to here (restarts just after it)
        self._events: queue.SimpleQueue = queue.SimpleQueue()  # (lease id, why), RESYNC, None (wake up)
        self._watch = None
        self._watch_held = threading.Event()  # set: the watch stays down (tests: a watch that broke)
        self.manager = Manager(store, open_vm=open_vm, host=host)
        self.holder: str | None = None
        self.lost: str | None = None  # why the agent stopped serving (fenced, host lease lost)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> "HostAgent":
        self.holder = self.store.host_register(self.host, self.ttl, os.getpid())
        log.warning("agent of host %s serving (holder %s, %s)", self.host, self.holder,
                    "driven by an etcd watch" if self.watched else f"polling every {self.poll} s")
        loops = [(self._keepalive_loop, "keepalive")]
        if self.watched:
            self._full_read(queue_only=True)  # before start() returns: what is asked from now on reaches the watch
            loops += [(self._watch_loop, "watch"), (self._watched_loop, "serve")]
        else:
            loops.append((self._serve_loop, "serve"))
        for target, name in loops:
            thread = threading.Thread(target=target, name=f"agent-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Stop serving and give the host lease back (its leases stay: the VMs keep their devices)."""
        self._stop.set()
        self._events.put(None)  # wakes the serving thread
        self._close_watch()
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
        self._events.put(None)  # however the agent was stopped: the serving thread wakes,
        self._close_watch()  # and the watch thread's stream ends

    def _serve_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.serve_once()
                self._heal_if_due()
            except DxpuError as exc:
                log.warning("serving lease requests failed: %s", exc.message)
            except Exception:  # noqa: BLE001 - one bad round must not end the agent
                log.exception("serving lease requests failed")
            self._stop.wait(self.poll)

    def serve_once(self) -> list[dict]:
        """Do what this host's lease records ask for, now; what was done."""
        leases = self.store.leases()
        self._see_all(leases)
        return [self._act(lease, "poll") for lease in leases if self._asks(lease)]

    def _see_all(self, leases: list[Lease]) -> None:
        """A full read replaces the view of this host's attached leases."""
        self.attached = {lease.id: lease for lease in leases
                         if lease.host == self.host and lease.state == LeaseState.ATTACHED}

    def _see(self, lease_id: str, lease: Lease | None) -> None:
        """One lease as read now (None: deleted) updates the view."""
        if lease is not None and lease.host == self.host and lease.state == LeaseState.ATTACHED:
            self.attached[lease_id] = lease
        else:
            self.attached.pop(lease_id, None)

    def _heal_if_due(self) -> list[dict]:
        """Every ``heal_every`` s, in the serving thread (the one that acts): re-plug this
        host's attached devices whose host proxy lost its link while their box is up
        again (a box that restarted or came back: QEMU never reconnects a vfio-user
        device), as a manager heals its own host's (:meth:`Manager.heal`, which does it).

        It reads what this host holds, not the pool: the leases are the agent's view
        (:attr:`attached`, kept by the watch or the poll), and only the boxes they are on
        are read, one each."""
        if not self.heal_every or time.monotonic() < self._next_heal:
            return []
        self._next_heal = time.monotonic() + self.heal_every
        by_box: dict[str, list[Lease]] = {}
        for lease in self.attached.values():
            if not lease.request:  # a detach asked of this agent: it finishes that instead
                by_box.setdefault(lease.box, []).append(lease)
        actions: list[dict] = []
        for name, leases in sorted(by_box.items()):
            try:
                box = self.store.box(name)
                if box["state"] == BoxState.UP:
                    actions += self.manager.heal(box, leases)
            except DxpuError as exc:
                log.warning("healing this host's devices on box %s failed: %s", name, exc.message)
        for action in actions:
            self.actions["heal"] += 1
            log.warning("healed %s: %s", action.get("device"), action.get("action"))
        return actions

    def _asks(self, lease: Lease | None) -> bool:
        """Does this lease record ask this host's agent for something now?"""
        if lease is None or lease.host != self.host or lease.request is None or lease.error:
            return False
        return lease.request == DETACH or (lease.request == ATTACH and lease.state == LeaseState.ATTACHING)

    def _act(self, lease: Lease, why: str) -> dict:
        self.actions[why] += 1
        return self._attach(lease) if lease.request == ATTACH else self._detach(lease)

    # --- driven by an etcd watch ------------------------------------------------------
    def _full_read(self, queue_only: bool = False) -> list[dict]:
        """Read every lease, act on what asks this host (``queue_only``: hand it to the
        serving thread); the watch (re)starts after the revision of this read. The view
        of this host's attached leases is replaced from it."""
        leases, revision = self.store.leases_at()
        self.revision = max(self.revision, revision)
        self._see_all(leases)
        if queue_only:  # start(): the plugs run in the serving thread, with the keepalive running
            for lease in leases:
                if self._asks(lease):
                    self._events.put((lease.id, "resync"))
            return []
        return [self._act(lease, "resync") for lease in leases if self._asks(lease)]

    def _watched_loop(self) -> None:
        """The one thread that acts: on each lease the watch saw change (read again, as it
        is now), and on a full read every ``resync`` s or when the watch lost history."""
        next_full = time.monotonic() + self.resync
        while not self._stop.is_set():
            try:
                item = self._events.get(timeout=max(0.0, min(1.0, next_full - time.monotonic())))
            except queue.Empty:
                item = RESYNC if time.monotonic() >= next_full else None
            self._heal_if_due()
            if item is None:
                continue
            try:
                if item is RESYNC:
                    next_full = time.monotonic() + self.resync
                    self._full_read()
                elif item[1] == GONE:
                    self.attached.pop(item[0], None)
                else:  # read afresh: the view and the action follow the lease as it is now
                    self._see(item[0], lease := self.store.lease(item[0]))
                    if self._asks(lease):
                        self._act(lease, item[1])
            except DxpuError as exc:
                log.warning("serving lease requests failed: %s", exc.message)
                self._events.put(RESYNC)  # e.g. etcd away: read everything once it answers
                self._stop.wait(self.poll)
            except Exception:  # noqa: BLE001 - one bad round must not end the agent
                log.exception("serving lease requests failed")

    def _watch_loop(self) -> None:
        """Keep a watch on the lease records open from just after :attr:`revision`; hand
        the ids of this host's changed leases, and of every deleted one, to the serving
        thread (which alone keeps the view of attached leases: a deleted record names no host)."""
        while not self._stop.is_set():
            if self._watch_held.is_set() or self.revision == 0:  # 0: history lost, a full read comes first
                self._stop.wait(0.05)
                continue
            try:
                watch = self.store.watch_leases(self.revision + 1)
            except (WatchFailed, DxpuError) as exc:
                log.warning("cannot watch the lease records (%s); trying again", exc)
                self._stop.wait(min(1.0, self.ttl / 3))
                continue
            self._watch = watch
            if self._stop.is_set() or self._watch_held.is_set():
                self._close_watch()
                continue
            try:
                for revision, changed in watch:
                    if self._watch_held.is_set():
                        break  # held while this batch was on its way: a broken stream delivers no more
                    for lease_id, record in changed:
                        if record is None:
                            self._events.put((lease_id, GONE))
                        elif record.get("host") == self.host:
                            self._events.put((lease_id, "watch"))
                    self.revision = max(self.revision, revision)  # only once its events are handed on
            except WatchCompacted as exc:
                log.warning("%s: reading every lease again", exc)
                self.revision = 0
                self._events.put(RESYNC)
            self._close_watch()
            self._stop.wait(0.1)  # a member went away: the next attempt fails over

    def _close_watch(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.close()

    def hold_watch(self) -> None:
        """End the watch and keep it down (what a broken stream does; for tests). Events the
        closing watch still had on their way are not handed on: the watch starts again just
        after the revision it had delivered up to, and brings them then."""
        self._watch_held.set()
        self._close_watch()

    def release_watch(self) -> None:
        """Let the watch start again, just after the revision it had delivered up to."""
        self._watch_held.clear()

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
