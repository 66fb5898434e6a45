"""The pool manager's operations: register boxes, attach, detach, reconcile, report.

Attach is all-or-nothing: leases are created first (``attaching``), then for each device
a host proxy is started and QEMU gets ``device_add``; only when every device is in the
VM do the leases become ``attached``. Any failure undoes what this call did, in reverse
order. Detach marks the lease ``detaching``, unplugs, stops the proxy and only then
deletes the lease. :meth:`Manager.reconcile` finishes or undoes whatever a killed manager
left half done, by asking the VMs what they really have.

Host proxies are processes of their own (``dxpu_vfio.hostproxy`` in forward mode)
that outlive the manager; the store records their pids, and they are ended by pid.

Every manager serves one host (``host``, default the machine's name): its leases carry
that name, and reconcile and heal touch only those, so managers of several hosts can
share one pool (etcd) without releasing each other's devices. A host whose manager or
agent died keeps its leases until an admin fences it (:meth:`Manager.fence_host`).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterator

from dxpu_vfio import registry
from dxpu_vfio.errors import DxpuError
from dxpu_vfio.hostproxy.process import HostProxyProcess
from dxpu_vfio.pool.agent_requests import ATTACH, DETACH, wait_for_agent
from dxpu_vfio.pool.boxes import TLS_ROLE, BoxUnreachable, fetch_inventory, fetch_screenshot, grant_token, revoke_token
from dxpu_vfio.pool.states import BoxState, LeaseState
from dxpu_vfio.pool.storage import QDEV_PREFIX, Lease, PoolStore, StoreError
from dxpu_vfio.procs import request_json, terminate_pid
from dxpu_vfio.vmm.errors import VmGone
from dxpu_vfio.vmm.naming import open_target, target_key
from dxpu_vfio.vmm.qmp import QmpError
from dxpu_vfio.vmm.rootports import device_present, free_root_port, plugged_devices, root_ports, used_root_ports
from dxpu_vfio.vmm.targets import VmTarget

log = logging.getLogger("dxpu.manager")


def failpoint(name: str) -> None:
    """Crash here if ``$DXPU_FAILPOINTS`` names this point (``attach.after_proxy,...``).

    For crash tests: the manager dies by SIGKILL at an exact step, exactly as a kill -9
    from outside would leave things, only at a known moment.
    """
    if name in os.environ.get("DXPU_FAILPOINTS", "").split(","):
        log.error("failpoint %s: killing the manager", name)
        os.kill(os.getpid(), signal.SIGKILL)


class AttachError(DxpuError):
    """An attach failed; everything it had done was undone."""


def default_host() -> str:
    """This host's name in the pool: $DXPU_HOST, else the machine's name."""
    return os.environ.get("DXPU_HOST") or socket.gethostname()


def stats_path(socket_path: str | Path) -> Path:
    return Path(socket_path).with_suffix(".stats.json")


def proxy_alive(lease: Lease) -> bool:
    """The lease's host proxy runs: its pid has a live registry entry (same start time, so
    not a recycled pid) for the lease's socket."""
    if not lease.proxy_pid or not lease.socket:
        return False
    entry = registry.find(lease.proxy_pid, kind="host")
    return entry is not None and entry.get("socket") == lease.socket


def stop_proxy(lease: Lease) -> None:
    """End the lease's host proxy by pid and remove its socket and counters file."""
    if proxy_alive(lease):
        terminate_pid(lease.proxy_pid)
    if lease.socket:
        Path(lease.socket).unlink(missing_ok=True)
        stats_path(lease.socket).unlink(missing_ok=True)


class Manager:
    """One pool, one store (SQLite or etcd: :class:`~dxpu_vfio.pool.storage.PoolStore`).
    Thread-safe: the service calls it from many threads."""

    def __init__(self, store: PoolStore, *, open_vm: Callable[[str], VmTarget] = open_target,
                 dead_after: float = 3.0, unplug_timeout: float = 15.0,
                 reconcile_unplug_timeout: float = 5.0, heal_interval: float = 10.0,
                 host: str | None = None) -> None:
        self.store = store
        self.host = host or default_host()
        self.open_vm = open_vm
        self.dead_after = dead_after
        self.unplug_timeout = unplug_timeout
        self.reconcile_unplug_timeout = reconcile_unplug_timeout  # short: reconcile runs before the API serves
        self.heal_interval = heal_interval
        self._healed: dict[str, float] = {}  # lease id -> when heal() last re-plugged it
        self._vm_locks: dict[str, threading.Lock] = defaultdict(threading.Lock)
        self._locks_lock = threading.Lock()
        self._probing: set[str] = set()  # boxes whose heartbeat probe is in flight
        self._probe_lock = threading.Lock()

    def proxy_log(self, lease: Lease) -> Path:
        """Host proxy logs live with the pool's state (with etcd: beside ``--db``, which
        names only this place then); a clean detach removes them."""
        directory = self.store.path.with_suffix(".logs")
        directory.mkdir(parents=True, exist_ok=True)  # an etcd host need never have made the db's directory
        return directory / f"{lease.id}.log"

    def _vm_lock(self, key: str) -> threading.Lock:
        """Operations on one VM run one at a time (they pick root ports); VMs run in parallel."""
        with self._locks_lock:
            return self._vm_locks[key]

    # --- boxes --------------------------------------------------------------------
    def register_box(self, name: str | None, address: str, tls_dir: str | None) -> dict:
        """Ask the box for its inventory over mutual TLS and store it."""
        tls_dir = str(Path(tls_dir).resolve()) if tls_dir else None
        inventory = fetch_inventory(address, tls_dir)
        name = name or inventory["box"]
        if name != inventory["box"]:
            raise BoxUnreachable(f"the box at {address} calls itself {inventory['box']!r}, not {name!r}",
                                 hint="register it under its own name, or fix its config")
        self.store.register_box(name, address, tls_dir, inventory["devices"], inventory["certificate_sha256"])
        return {"box": name, "address": address, "certificate_sha256": inventory["certificate_sha256"], "devices": [
            {k: d[k] for k in ("id", "class", "vendor", "model", "capacity")} for d in inventory["devices"]]}

    def heartbeat(self) -> list[dict]:
        """Probe every box once, all at once; a box unheard for ``dead_after`` s goes down,
        and back up when it answers (its inventory refreshed). Returns the state changes.

        Each probe is bounded (:meth:`_probe_all`): a box that answers slowly, or trickles,
        delays neither the verdict on another box nor the next round."""
        boxes = self.store.boxes()
        changes: list[dict] = []
        up = []
        for box, result in self._probe_all(boxes):
            # a box that announces itself is up while its box lease lives (its remote proxy
            # renews it); the probe only tells whether its attached devices need healing
            change = None if box.get("generation") is not None else self._judge(box, result)
            if change is not None:
                changes.append(change)
            if not isinstance(result, BoxUnreachable):
                up.append(box["name"])
        by_name = {box["name"]: box for box in boxes}
        healing = [by_name[name] for name in up
                   if by_name[name]["state"] == BoxState.UP or by_name[name].get("generation") is None]
        leases = self.store.leases() if healing else []  # one read for every box of the round
        for box in healing:
            changes += self.heal(box, leases)
        return changes

    def probe_timeout(self) -> float:
        return min(2.0, self.dead_after)

    def _probe_all(self, boxes: list[dict]) -> Iterator[tuple[dict, "dict | BoxUnreachable"]]:
        """(box, inventory or BoxUnreachable) for each box, as the answers come. A probe
        gets ``probe_timeout`` for the connect and handshake and as much for the exchange;
        a box not answered by then is unreachable this round. A box whose probe of an
        earlier round still runs gets no second one (one thread per box at most)."""
        timeout = self.probe_timeout()
        answers: queue.SimpleQueue = queue.SimpleQueue()
        waiting = {}
        for box in boxes:
            with self._probe_lock:
                if box["name"] in self._probing:
                    yield box, BoxUnreachable(f"box {box['name']} has not answered its last probe yet")
                    continue
                self._probing.add(box["name"])
            waiting[box["name"]] = box
            threading.Thread(target=self._probe, args=(box, timeout, answers), name=f"heartbeat-{box['name']}",
                             daemon=True).start()
        end = time.monotonic() + 2 * timeout + 0.5
        while waiting:
            try:
                name, result = answers.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                break
            yield waiting.pop(name), result
        for name, box in waiting.items():
            yield box, BoxUnreachable(f"box {name} did not answer its probe within {2 * timeout + 0.5:.1f} s")

    def _probe(self, box: dict, timeout: float, answers: queue.SimpleQueue) -> None:
        try:
            result: dict | BoxUnreachable = fetch_inventory(box["address"], box["tls_dir"], timeout=timeout)
        except BoxUnreachable as exc:
            result = exc
        except Exception as exc:  # noqa: BLE001 - a probe thread reports, it never dies with a traceback
            result = BoxUnreachable(f"probing box {box['name']} failed: {exc!r}")
        finally:
            with self._probe_lock:
                self._probing.discard(box["name"])
        answers.put((box["name"], result))

    def _judge(self, box: dict, result: "dict | BoxUnreachable") -> dict | None:
        """Record one probe's result; the state change it makes, if any."""
        try:
            if isinstance(result, BoxUnreachable):
                raise result
            inventory = result
            if inventory["certificate_sha256"] != box["cert_sha256"]:
                raise BoxUnreachable(  # another machine with a certificate of our CA: not the box we registered
                    f"box {box['name']} presented another certificate (sha256 "
                    f"{(inventory['certificate_sha256'] or 'none')[:16]}..., registered "
                    f"{(box['cert_sha256'] or 'none')[:16]}...)",
                    hint=f"if the box was re-keyed on purpose: dxpu box add {box['name']} {box['address']}")
        except BoxUnreachable as exc:
            if box["state"] == BoxState.UP and time.time() - box["last_seen"] >= self.dead_after:
                self.store.mark_box(box["name"], up=False, error=exc.message)
                log.warning("box %s is down: %s", box["name"], exc.message)
                return {"box": box["name"], "state": BoxState.DOWN, "error": exc.message}
            return None
        if box["state"] == BoxState.DOWN:
            self.store.register_box(box["name"], box["address"], box["tls_dir"], inventory["devices"],
                                    box["cert_sha256"])
            log.warning("box %s is back", box["name"])
            return {"box": box["name"], "state": BoxState.UP}
        self.store.mark_box(box["name"], up=True)
        return None

    def heal(self, box: dict, leases: list[Lease]) -> list[dict]:
        """Re-plug the attached devices of a box that answers again but whose host proxy's
        link is down (the box restarted, or was down): QEMU never reconnects a vfio-user
        device, so the device leaves the VM and comes back with a new proxy, on the same
        lease. At most once per ``heal_interval`` s per lease; a failure releases the lease.

        ``leases`` are the ones to consider (those of other boxes and hosts are skipped):
        the caller's read, so that healing costs no read of every lease per box (the
        heartbeat reads them once a round, a host agent passes its own view).

        The box is probed again after the dead link was seen: the round's probe may have
        been answered just before the box died, and re-plugging into a dead box would
        fail and release a lease the admin still has to detach."""
        actions = []
        confirmed: bool | None = None  # did the box answer a probe made after a dead link was seen?
        for lease in leases:
            if lease.box != box["name"] or lease.state != LeaseState.ATTACHED or not self._ours(lease):
                continue
            if lease.request:  # a host agent is asked to act on it (a detach): the agent finishes it
                continue
            if time.monotonic() - self._healed.get(lease.id, -1e9) < self.heal_interval:
                continue
            if proxy_alive(lease):  # heal on evidence only: a busy proxy that did not answer is left alone
                stats = self._proxy_stats(lease)
                if stats is None or ((stats.get("device") or {}).get("link") or {}).get("up", True):
                    continue
            if confirmed is None:
                confirmed = self._answers_now(box)
            if not confirmed:
                break
            self._healed[lease.id] = time.monotonic()
            try:
                with self.open_vm(lease.vm) as target, self._vm_lock(target.key):
                    self._replug(target, lease)
                actions.append({"lease": lease.id, "device": lease.device, "vm": lease.vm, "action": "re-plugged",
                                "port": lease.port})
                log.warning("re-plugged %s into %s (its link was down)", lease.device, lease.vm)
            except DxpuError as exc:
                log.error("could not re-plug %s into %s: %s", lease.device, lease.vm, exc)
                actions.append({"lease": lease.id, "device": lease.device, "vm": lease.vm, "action": "failed",
                                "why": exc.message})
        return actions

    def _answers_now(self, box: dict) -> bool:
        try:
            fetch_inventory(box["address"], box["tls_dir"], timeout=self.probe_timeout())
        except BoxUnreachable as exc:
            log.warning("box %s stopped answering before its devices were re-plugged: %s", box["name"], exc.message)
            return False
        return True

    def _replug(self, target: VmTarget, lease: Lease) -> None:
        """Unplug, new proxy, plug again (lease 'attaching' meanwhile: a crash rolls it back)."""
        now = self.store.lease(lease.id)  # that lease alone: on etcd leases(vm) reads every lease
        if now is None or now.state != LeaseState.ATTACHED:
            return  # detached or changed since we looked
        self.store.update_lease(lease.id, state=LeaseState.ATTACHING, owner_pid=os.getpid())
        try:
            if device_present(target, lease.qdev_id):
                target.unplug(lease.qdev_id, self.unplug_timeout)
            stop_proxy(lease)
            self._plug(target, lease, 30.0)
        except BaseException:
            self._undo(target, lease, plugged=device_present(target, lease.qdev_id))
            raise
        self.store.update_lease(lease.id, state=LeaseState.ATTACHED)

    # --- attach / detach ---------------------------------------------------------
    def attach(self, vm: str, *, device_class: str | None = None, count: int = 1, box: str | None = None,
               device: str | None = None, policy: str = "pack", timeout: float = 30.0,
               host: str | None = None, dry_run: bool = False) -> list[dict] | dict:
        """Plug free devices into ``vm``. With ``host`` (another host than this manager's),
        the VM is one of that host's and its agent does the plug (:mod:`dxpu_vfio.pool.agent`).
        ``dry_run``: the plan instead (:mod:`dxpu_vfio.pool.plan`)."""
        if dry_run:
            from dxpu_vfio.pool import plan
            return plan.attach(self, vm, host=host, device_class=device_class, count=count, box=box, device=device,
                               policy=policy)
        if host is not None and host != self.host:
            return self._attach_via_agent(host, vm, timeout, device_class=device_class, count=count, box=box,
                                          device=device, policy=policy)
        with self.open_vm(vm) as target, self._vm_lock(target.key):
            if not target.alive():
                raise AttachError(f"VM {vm} is not running", hint="start it first")
            leases = self.store.allocate(target.key, device_class=device_class, count=count, box=box,
                                         device=device, policy=policy, owner_pid=os.getpid(), host=self.host)
            done: list[tuple[Lease, bool]] = []  # (lease, plugged)
            try:
                for lease in leases:
                    done.append((lease, False))
                    self._plug(target, lease, timeout)
                    done[-1] = (lease, True)
                for lease in leases:
                    self.store.update_lease(lease.id, state=LeaseState.ATTACHED)
                    lease.state = LeaseState.ATTACHED
            except BaseException as exc:
                for lease, plugged in reversed(done):
                    self._undo(target, lease, plugged)
                for lease in leases[len(done):]:
                    self.store.delete_lease(lease.id)
                if isinstance(exc, DxpuError):
                    raise AttachError(f"attach to {vm} failed and was rolled back: {exc.message}",
                                      hint=exc.hint, logs=exc.logs) from exc
                raise
            return [self._describe(lease) for lease in leases]

    def _attach_via_agent(self, host: str, vm: str, timeout: float, **allocation: object) -> list[dict]:
        """Leases for ``host``'s VM with ``request = attach``; wait for its agent's answer.
        All or nothing: if one fails (or the agent does not answer in time) the others are
        handed back to the agent to detach and the failed ones deleted."""
        key = target_key(vm)
        agents = {h["name"]: h for h in self.store.hosts()}
        if not (agents.get(host) or {}).get("alive"):
            raise AttachError(f"host {host} has no live agent: nothing would plug the device into {vm}",
                              hint=f"start it there: dxpu agent serve --host {host} (dxpu host ls shows the hosts)")
        leases = self.store.allocate(key, owner_pid=os.getpid(), host=host, **allocation)  # type: ignore[arg-type]
        for lease in leases:
            self.store.update_lease(lease.id, request=ATTACH)
        ids = [lease.id for lease in leases]
        done = wait_for_agent(self.store, ids, lambda lease: lease is None or lease.error is not None
                              or lease.state == LeaseState.ATTACHED, timeout + 5.0)
        failed = {i: lease for i, lease in done.items() if lease is None or lease.state != LeaseState.ATTACHED}
        if not failed:
            return [self._describe(lease) for lease in done.values() if lease is not None]
        for lease_id, lease in done.items():
            if lease is None:
                continue
            if lease.state == LeaseState.ATTACHED:
                self.store.update_lease(lease_id, request=DETACH)
            elif lease.error is not None:
                self.store.delete_lease(lease_id)
        why = "; ".join(f"{lease.device}: {lease.error}" for lease in failed.values() if lease and lease.error) \
            or f"the agent of {host} did not answer within {timeout + 5.0:.0f} s"
        if any(lease is not None and lease.error is None for lease in failed.values()):
            for lease_id, lease in failed.items():  # not answered: take the request back
                if lease is not None and lease.error is None:
                    self.store.update_lease(lease_id, request=DETACH)
        raise AttachError(f"attach to {vm} on host {host} failed and was rolled back: {why}",
                          hint=f"its agent's log on {host} has the details")

    def _plug(self, target: VmTarget, lease: Lease, timeout: float) -> None:
        """Start the lease's host proxy and plug it. The box grants a fresh token for this
        lease (replacing any token the device had); the proxy gets it through a pipe, not
        its command line, and presents it to no box but the one registered (pinned by its
        certificate)."""
        dev = self.store.device(lease.device)
        token = grant_token(dev["address"], dev["tls_dir"], dev["name"], lease.id, timeout=min(timeout, 5.0),
                            fence=lease.fence, holder=lease.host, pool=self._pool_id(lease))
        settings = {"address": dev["address"], "device": dev["name"]}
        settings.update({"tls_dir": dev["tls_dir"], "tls_role": TLS_ROLE} if dev["tls_dir"] else {"plaintext": True})
        if dev["tls_dir"] and dev.get("cert_sha256"):
            settings["box_sha256"] = dev["cert_sha256"]
        socket_path = target.socket_dir() / f"{lease.id}.sock"
        server = HostProxyProcess("remote", socket_path, settings=settings, secrets={"lease": token},
                                  name=lease.qdev_id, log_path=self.proxy_log(lease))
        lease.socket = str(socket_path)
        self.store.update_lease(lease.id, socket=lease.socket)
        server.start()
        lease.proxy_pid = server.pid
        self.store.update_lease(lease.id, proxy_pid=server.pid)
        failpoint("attach.after_proxy")
        port = free_root_port(target, target.name)
        lease.port = port
        self.store.update_lease(lease.id, port=port)
        try:
            target.plug(lease.qdev_id, port, socket_path, timeout)
        except QmpError as exc:
            why = server.attach_error()  # e.g. the box's external server needs fd-mapped memory
            raise AttachError(f"QEMU refused {lease.device} on {port}: {exc.message}" + (f"; {why}" if why else ""),
                              logs=[server.log_path]) from exc
        failpoint("attach.after_plug")

    def _undo(self, target: VmTarget, lease: Lease, plugged: bool) -> None:
        """Reverse of _plug, best effort, then the lease goes."""
        if plugged or (target.alive() and device_present(target, lease.qdev_id)):
            try:
                target.unplug(lease.qdev_id, self.unplug_timeout)
            except DxpuError as exc:
                log.error("rollback could not unplug %s from %s: %s", lease.qdev_id, target.name, exc)
                self.store.update_lease(lease.id, state=LeaseState.DETACHING)
                return  # keep the lease: the device is still in the VM; reconcile retries
        stop_proxy(lease)  # its log stays: the AttachError names it
        self._revoke(lease)
        self.store.delete_lease(lease.id)

    def detach(self, vm: str, device: str | None = None, *, all_devices: bool = False,
               timeout: float | None = None, host: str | None = None, dry_run: bool = False) -> list[dict] | dict:
        """Unplug one device (lease id, device id or name) or all of the VM's, and free them;
        with ``host`` (not this manager's), by asking that host's agent. ``dry_run``: the plan."""
        if device is None and not all_devices:
            raise StoreError("name a device to detach, or pass --all", hint="dxpu status VM lists its devices")
        if dry_run:
            from dxpu_vfio.pool import plan
            return plan.detach(self, vm, device, all_devices=all_devices, host=host)
        if host is not None and host != self.host:
            return self._detach_via_agent(host, vm, device, timeout or self.unplug_timeout)
        try:
            target = self.open_vm(vm)
        except VmGone as exc:  # what a VM that is gone held is free again
            key = target_key(vm)
            with self._vm_lock(key):
                leases = self.store.leases(key) if all_devices else [self.store.lease_for(key, device)]
                foreign = sorted({lease.host for lease in leases if not self._ours(lease)})
                if foreign:  # not gone: it runs on another host, which this manager cannot see
                    raise StoreError(f"{vm} is a VM of host {', '.join(foreign)}, not of {self.host}",
                                     hint=f"detach it there, or if that host is dead: dxpu host fence {foreign[0]}")
                return [self._release(lease, f"VM gone: {exc.message}") for lease in leases]
        with target, self._vm_lock(target.key):
            leases = self.store.leases(target.key) if all_devices else [self.store.lease_for(target.key, device)]
            return [self._detach_one(target, lease, timeout or self.unplug_timeout) for lease in leases]

    def _detach_via_agent(self, host: str, vm: str, device: str | None, timeout: float) -> list[dict]:
        key = target_key(vm)
        leases = self.store.leases(key) if device is None else [self.store.lease_for(key, device)]
        for lease in leases:
            self.store.update_lease(lease.id, request=DETACH, error=None)
        done = wait_for_agent(self.store, [lease.id for lease in leases],
                              lambda lease: lease is None or lease.error is not None, timeout + 5.0)
        stuck = [lease for lease in done.values() if lease is not None]
        if stuck:
            raise StoreError(f"the agent of {host} did not detach " + ", ".join(
                f"{lease.device} ({lease.error or 'no answer'})" for lease in stuck),
                hint=f"try again; if {host} is dead: dxpu host fence {host}")
        return [{"lease": lease.id, "device": lease.device, "vm": lease.vm, "state": "freed", "why": "detached",
                 "host": host, "counters": None} for lease in leases]

    def _detach_one(self, target: VmTarget, lease: Lease, timeout: float) -> dict:
        """Unplug (UnplugTimeout leaves the lease 'detaching' and the device served: detach
        again later), then release."""
        self.store.update_lease(lease.id, state=LeaseState.DETACHING, owner_pid=os.getpid())
        counters = self._proxy_stats(lease)
        if target.alive() and device_present(target, lease.qdev_id):
            target.unplug(lease.qdev_id, timeout)
        return {**self._release(lease, "detached"), "counters": counters}

    def _release(self, lease: Lease, why: str) -> dict:
        """The device is out of the VM (or the VM is gone): end its proxy, void its token, free it."""
        stop_proxy(lease)
        self._revoke(lease)
        self.store.delete_lease(lease.id)
        self.proxy_log(lease).unlink(missing_ok=True)
        return {"lease": lease.id, "device": lease.device, "vm": lease.vm, "state": "freed", "why": why,
                "counters": None}

    def _revoke(self, lease: Lease) -> None:
        """Void the lease's token at its box, best effort: a box that does not answer has
        restarted (it forgot its tokens) or is down, and the device's next lease replaces
        the token anyway."""
        try:
            dev = self.store.device(lease.device)
            revoke_token(dev["address"], dev["tls_dir"], dev["name"], lease.id, timeout=self.probe_timeout(),
                         fence=lease.fence, pool=self._pool_id(lease))
        except DxpuError as exc:
            log.warning("could not revoke the token of lease %s at its box: %s", lease.id, exc.message)

    def _pool_id(self, lease: Lease) -> str | None:
        return self.store.pool_id if lease.fence is not None else None

    def _ours(self, lease: Lease) -> bool:
        """A lease of this manager's host (or of a pool from before hosts)."""
        return lease.host is None or lease.host == self.host

    # --- fencing -------------------------------------------------------------------
    def fence_host(self, host: str) -> dict:
        """Fence ``host``: the store marks it fenced (no device for it, its agent's lease
        void) and takes its leases from it in one step; then each lease's token is revoked
        at its box with the lease's fencing token, which takes the host's live link down
        and makes the box refuse any later GRANT or HELLO of that lease. The host's VMs and
        proxies are not touched (the host may be unreachable): what they hold is dead.

        A box that does not answer now is reported: it restarted (and forgot the token)
        or is down; when it comes back it knows no token of the fenced host either."""
        taken = self.store.fence_host(host)
        freed = []
        for lease in taken:
            try:
                dev = self.store.device(lease.device)
                revoked = revoke_token(dev["address"], dev["tls_dir"], dev["name"], lease.id,
                                       timeout=self.probe_timeout(), fence=lease.fence, pool=self._pool_id(lease))
                at_box = "revoked" if revoked else "no grant at the box"
            except DxpuError as exc:
                at_box = f"box did not answer: {exc.message}"
                log.warning("fencing %s: could not revoke lease %s at its box: %s", host, lease.id, exc.message)
            freed.append({"lease": lease.id, "device": lease.device, "vm": lease.vm, "fence": lease.fence,
                          "token": at_box})
        log.warning("fenced host %s: %d lease(s) taken from it", host, len(freed))
        return {"host": host, "fenced": True, "leases": freed}

    def unfence_host(self, host: str) -> dict:
        self.store.unfence_host(host)
        return {"host": host, "fenced": False}

    def hosts(self) -> list[dict]:
        return self.store.hosts()

    # --- reconciliation ----------------------------------------------------------
    def reconcile(self, dry_run: bool = False) -> list[dict]:
        """Make the store and the VMs agree, after a crash or at start. ``dry_run``: the
        same decisions, each with the ``plan`` of steps it would take, and nothing done.

        - ``attaching`` leases whose manager is gone are rolled back (unplug if QEMU has
          the device, end the proxy, delete the lease);
        - ``detaching`` leases are finished;
        - ``attached`` leases whose device left the VM, whose VM is gone, or whose host
          proxy died (QEMU never reconnects a vfio-user device) are released;
        - devices with the pool's QEMU id prefix but no lease are unplugged.
        """
        actions = []
        by_vm: dict[str, list[Lease]] = defaultdict(list)
        for lease in self.store.leases():
            if self._ours(lease):  # another host's VMs are its own business (or its fence's)
                by_vm[lease.vm].append(lease)
        for vm_key, leases in by_vm.items():
            try:
                target = self.open_vm(vm_key)
            except VmGone as exc:
                with self._vm_lock(vm_key):
                    for lease in leases:  # the VM is gone: so is its device
                        action = {"lease": lease.id, "device": lease.device, "vm": vm_key,
                                  "action": "released", "why": f"VM gone: {exc.message}"}
                        if dry_run:
                            from dxpu_vfio.pool.plan import release_steps
                            action.update(action="would release", plan=release_steps(self, lease, unplug=False))
                        else:
                            self._release(lease, f"VM gone: {exc.message}")
                        actions.append(action)
                continue
            except DxpuError as exc:  # e.g. libvirtd down: the VM may well run; touch nothing
                actions += [{"lease": lease.id, "device": lease.device, "vm": vm_key, "action": "skipped",
                             "why": f"VM unreachable: {exc.message}"} for lease in leases]
                continue
            with target, self._vm_lock(target.key):
                actions += self._reconcile_vm(target, leases, dry_run)
        return actions

    def _reconcile_vm(self, target: VmTarget, leases: list[Lease], dry_run: bool = False) -> list[dict]:
        actions = []
        alive = target.alive()
        present = set(plugged_devices(target, QDEV_PREFIX)) if alive else set()
        for lease in leases:
            why = None
            # Under the VM lock no attach or detach of this process is in flight, so an
            # unfinished lease is stale unless another live process owns it.
            stale = lease.owner_pid == os.getpid() or not _pid_alive(lease.owner_pid)
            if lease.state == LeaseState.ATTACHING and stale:
                why = "attach interrupted"
            elif lease.state == LeaseState.DETACHING and stale:
                why = "detach interrupted"
            elif lease.state == LeaseState.ATTACHED and lease.qdev_id not in present:
                why = "device no longer in the VM"
            elif lease.state == LeaseState.ATTACHED and not proxy_alive(lease):
                why = "host proxy died"
            if why is None:
                continue
            if dry_run:
                from dxpu_vfio.pool.plan import release_steps
                actions.append({"lease": lease.id, "device": lease.device, "vm": lease.vm, "action": "would release",
                                "why": why, "plan": release_steps(self, lease, unplug=lease.qdev_id in present)})
                continue
            self.store.update_lease(lease.id, state=LeaseState.DETACHING, owner_pid=os.getpid())
            if lease.qdev_id in present:
                try:
                    target.unplug(lease.qdev_id, self.reconcile_unplug_timeout)
                except DxpuError as exc:
                    actions.append({"lease": lease.id, "device": lease.device, "vm": lease.vm,
                                    "action": "unplug-pending", "why": f"{why}; {exc.message}"})
                    continue
            self._release(lease, why)
            actions.append({"lease": lease.id, "device": lease.device, "vm": lease.vm,
                            "action": "released", "why": why})
        known = {lease.qdev_id for lease in leases}
        for qdev_id in sorted(present - known):
            if dry_run:
                actions.append({"qdev_id": qdev_id, "vm": target.key, "action": "would unplug",
                                "why": "plugged by the pool but no lease",
                                "plan": [{"do": "qmp", "execute": "device_del", "arguments": {"id": qdev_id}}]})
                continue
            try:
                target.unplug(qdev_id, self.reconcile_unplug_timeout)
                actions.append({"qdev_id": qdev_id, "vm": target.key, "action": "unplugged",
                                "why": "plugged by the pool but no lease"})
            except DxpuError as exc:
                actions.append({"qdev_id": qdev_id, "vm": target.key, "action": "unplug-pending",
                                "why": exc.message})
        return actions

    # --- reports -----------------------------------------------------------------
    def _proxy_stats(self, lease: Lease) -> dict | None:
        if not self._ours(lease) or not proxy_alive(lease):
            return None
        return request_json(lease.proxy_pid, stats_path(lease.socket), timeout=2.0)

    def _describe(self, lease: Lease, present: set[str] | None = None) -> dict:
        dev = self.store.device(lease.device)
        out = {"lease": lease.id, "device": lease.device, "class": dev["class"], "vendor": dev["vendor"],
               "model": dev["model"], "capacity": dev["capacity"], "vm": lease.vm, "state": lease.state,
               "qdev_id": lease.qdev_id, "port": lease.port, "proxy_pid": lease.proxy_pid,
               "proxy_alive": proxy_alive(lease) if self._ours(lease) else None, "host": lease.host,
               "fence": lease.fence, "box_state": dev.get("box_state")}
        if present is not None:
            out["in_vm"] = lease.qdev_id in present
        return out

    def status(self, vm: str) -> dict:
        with self.open_vm(vm) as target:
            alive = target.alive()
            present = set(plugged_devices(target, QDEV_PREFIX)) if alive else set()
            leases = self.store.leases(target.key)
            devices = []
            for lease in leases:
                entry = self._describe(lease, present)
                stats = (self._proxy_stats(lease) or {}).get("device") or {}
                entry["link_up"] = bool(stats.get("link", {}).get("up"))
                entry["counters"] = {k: v for k, v in stats.items() if isinstance(v, int) and not isinstance(v, bool)}
                devices.append(entry)
            return {"vm": target.key, "running": alive, "devices": devices,
                    "root_ports_free": _free_ports(target) if alive else 0}

    def listing(self) -> dict:
        return {"boxes": self.store.boxes(), "devices": self.store.devices(),
                "leases": [self._describe(lease) for lease in self.store.leases()]}

    def screenshot(self, name: str) -> bytes:
        """A pooled display's scanout as PNG, rendered on its box; ``name`` is a lease id
        or a device id (BOX/DEVICE)."""
        leases = [lease for lease in self.store.leases() if lease.id == name]
        dev = self.store.device(leases[0].device if leases else name)
        return fetch_screenshot(dev["address"], dev["tls_dir"], dev["name"])

    def metrics(self) -> str:
        """Prometheus text exposition: pool gauges and per-device counters from the proxies."""
        from dxpu_vfio.pool.metrics import render
        return render(self.store, {lease.id: self._proxy_stats(lease) for lease in self.store.leases()
                                   if lease.state == LeaseState.ATTACHED})


def _free_ports(target: VmTarget) -> int:
    return len(set(root_ports(target)) - used_root_ports(target))


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
