"""The pool's state in etcd: one pool for many hosts, the same calls as the SQLite store.

Key layout (every key under a versioned prefix, ``/dxpu/v1/``; values are JSON)::

    /dxpu/v1/schema                 "1"
    /dxpu/v1/pool_id                random, made with the pool: fencing tokens compare only within one pool
    /dxpu/v1/alive/<box>            a box that announces itself: put under the box's etcd lease
                                    (the remote proxy renews it); gone with the box, and then the box is down
    /dxpu/v1/boxes/<box>            address, tls_dir, state, registered_at, last_error, cert_sha256,
                                    generation (changes with the inventory; None: registered by hand)
    /dxpu/v1/seen/<box>             last heartbeat answer (unix time): heartbeats write only this
    /dxpu/v1/inventory/<box>        the box's devices, one value: [{name, class, vendor, model, capacity}]
    /dxpu/v1/claims/<box>/<dev>     lease id; the key exists exactly while the device is leased
    /dxpu/v1/leases/<lease>         the lease (device, vm, state, port, socket, pids, times)
    /dxpu/v1/hosts/<host>           the host's agent: holder (its etcd lease id), pid, start time;
                                    put under that etcd lease, so it goes when the agent stops renewing
    /dxpu/v1/fenced/<host>          time the host was fenced: no allocation for it while the key exists

A lease's fencing token is the revision that created its record (etcd revisions only grow,
so a later lease of a device always has a larger one); its holder is the host agent's etcd
lease id at allocation, which is the host key's lease.

Allocation of N devices is one transaction: it compares, for every device it takes,
that the claim key does not exist, and for every box it takes from, that the box record
(still up) and its inventory (still lists the device) are the revisions it chose from
(and, for a box that announces itself, that its ``alive`` key is the one it saw);
then it creates the claims and the leases. All or nothing, and two allocators -- threads,
processes or hosts -- never get the same device: at most one transaction creates a
claim key. ``pack``/``spread`` choose the box as the SQLite allocator does, from a cache
of boxes, inventories and claims; a conflict refreshes the boxes it touched (the
transaction's failure branch reads them) and tries again. For a while after a conflict
ties between boxes are walked in key order from a cursor that jumps to a random box at
each lost race (reading the claims there first), the device within the box is a random
one, and a box where the race was lost comes last for a while (another allocator is
filling it), so concurrent allocators each fill their own boxes instead of racing for
one; from the second lost race in a row a short random pause comes before the next try,
and the third reads every claim again. Watches (from the
revision of the last full read, so no event is missed) keep the boxes, their alive keys
and inventories fresh; not the claims, which every allocation and free writes (a watcher
per handle costs etcd more than the transactions: see :meth:`EtcdStore._start_watches`):
other handles' claims are learned from lost races and full reads. No match reads
everything once more before it answers :class:`NoFreeDevice`, and the whole view is read
again every ``resync_interval`` s (while the watches run, every ``WATCHED_RESYNC_FACTOR``
times that). Listings always read etcd afresh. Lease updates and deletes
are one transaction each (compare the revision this handle last wrote, else read it).

The client (failover, retries, transaction pieces) is :mod:`dxpu_vfio.pool.etcd_client`;
allocation's view of the boxes and its choice of devices, :mod:`dxpu_vfio.pool.etcd_view`.
"""

from __future__ import annotations

import logging
import random
import secrets
import threading
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any, Iterator

from dxpu_vfio.pool.etcd_client import (
    PREFIX, EtcdClient, b64, c_absent, c_mod, c_value, endpoints_from, kvs, op_delete, op_put, op_range,
    prefix_end, ranges, unb64)
from dxpu_vfio.pool.etcd_view import AllocationView, box_state
from dxpu_vfio.pool.etcd_watch import Watch, WatchCompacted, WatchFailed
from dxpu_vfio.pool.states import BoxState, LeaseState
from dxpu_vfio.pool.storage import (
    QDEV_PREFIX, Lease, StoreError, box_busy, check_allocation, check_lease_fields, host_fenced, host_view,
    no_free_device, no_such_box, no_such_device, pick_lease)

log = logging.getLogger("dxpu.store")

SCHEMA_VERSION = 1
ATTEMPTS = 64  # allocation tries before it reports contention
CONTENDED_FOR = 60.0  # s after a lost race during which allocation breaks ties by chance
PROBES = 4  # landings tried (a read each) before the walk goes on from the last
RESYNC_AFTER = 3  # races lost by one allocation before it reads every claim again
BACKOFF = 0.002  # s: after the second lost race in a row, a random pause up to this, doubling, ...
BACKOFF_MAX = 0.032  # ... up to this
WATCHED_RESYNC_FACTOR = 10  # a full read of allocation's view this much rarer while its watch runs


class EtcdStore:
    """The pool in etcd; thread-safe (one lock around allocation, as SQLite's writer lock)."""

    kind = "etcd"
    takes_announcements = True  # boxes publish themselves under leases they renew
    watches_leases = True  # host agents are driven by a watch on leases/

    def __init__(self, endpoints: list[str] | str, *, path: Path | str | None = None, prefix: str = PREFIX,
                 tls_dir: str | None = None, timeout: float = 2.0, retry_for: float = 5.0,
                 resync_interval: float = 30.0) -> None:
        from dxpu_vfio.pool.store import default_path
        self.endpoints = endpoints_from(endpoints)
        self.path = Path(path) if path else default_path()  # local: the manager's proxy logs go beside it
        self.prefix = prefix
        self.resync_interval = resync_interval
        self.etcd = EtcdClient(self.endpoints, tls_dir=tls_dir, timeout=timeout, retry_for=retry_for, prefix=prefix)
        self._lock = threading.RLock()
        self._view = AllocationView(prefix)  # what allocation chooses from (etcd_view.py)
        self._watches: list[Watch] = []  # boxes/ with alive/, and inventory/ (not claims/: see _start_watches)
        self._pending: deque[list[dict]] = deque()  # watch events not yet applied to the view
        self._synced_at = -1e9
        self._mine: dict[str, tuple[dict, int]] = {}  # leases this handle wrote: record, mod_revision
        self._contended_until = 0.0
        self.conflicts = 0  # allocation transactions that lost a race (the benchmark reports them)
        self._init_schema()

    # --- keys -----------------------------------------------------------------
    def k(self, *parts: str) -> str:
        return self.prefix + "/".join(parts)

    def _init_schema(self) -> None:
        key = self.k("schema")
        result = self.etcd.txn([c_absent(key)], [op_put(key, SCHEMA_VERSION)], [op_range(key)])
        if not result.get("succeeded"):
            found = int(ranges(result)[0][0][1])
            if found > SCHEMA_VERSION:
                raise StoreError(f"the pool in etcd ({self.prefix}) has schema version {found}; this dxpu knows "
                                 f"up to {SCHEMA_VERSION}", hint="upgrade dxpu-vfio on this host")

    @property
    def pool_id(self) -> str:
        """Made with the pool (the first handle to ask writes it): fencing tokens compare
        only within one pool."""
        if getattr(self, "_pool_id", None) is None:
            key = self.k("pool_id")
            self.etcd.txn([c_absent(key)], [op_put(key, secrets.token_hex(16))])
            [[(_, self._pool_id, _)]] = [kvs(self.etcd.range(key))]
        return self._pool_id

    @property
    def schema_version(self) -> int:
        [[(_, value, _)]] = [kvs(self.etcd.range(self.k("schema")))]
        return int(value)

    def close(self) -> None:
        with self._lock:
            self._stop_watches()
        self.etcd.close()

    def _read(self, *keys: tuple[str, bool]) -> list[list[tuple[str, Any, int]]]:
        """Several keys or prefixes ((key, is_prefix), ...) read at one revision."""
        return ranges(self.etcd.txn([], [op_range(key, prefix) for key, prefix in keys]))

    def _snapshot(self, *prefixes: str, page: int = 2000, revision_of: str = "mod_revision",
                  serializable: bool = False, keys_only: bool = False) -> tuple[list[list[tuple[str, Any, int]]], int]:
        """Whole prefixes at one revision, in pages (a big pool exceeds one gRPC message);
        ``serializable`` for allocation's view, which may be stale (its transactions compare)."""
        revision, out = 0, []
        for prefix in prefixes:
            items: list[tuple[str, Any, int]] = []
            start = None
            while True:
                response = self.etcd.range(prefix, prefix=True, revision=revision, limit=page, start=start,
                                           serializable=serializable, keys_only=keys_only)
                revision = revision or int(response["header"]["revision"])
                items += kvs(response, revision_of)
                if not response.get("more"):
                    break
                start = items[-1][0] + "\0"
            out.append(items)
        return out, revision

    # --- boxes and devices --------------------------------------------------------
    def _box_keys(self, name: str) -> tuple[str, str, str, str]:
        return self.k("boxes", name), self.k("seen", name), self.k("inventory", name), self.k("claims", name) + "/"

    def register_box(self, name: str, address: str, tls_dir: str | None, devices: list[dict],
                     cert_sha256: str | None = None) -> None:
        """Add or refresh a box and its inventory; leased devices are kept as they are."""
        self._put_box(name, address, tls_dir, devices, cert_sha256)

    def _put_box(self, name: str, address: str, tls_dir: str | None, devices: list[dict], cert_sha256: str | None,
                 generation: str | None = None, lease: str | None = None) -> None:
        """Write a box's record and inventory (one transaction); with ``lease``, also its
        ``alive`` key under that etcd lease (a box announcing itself)."""
        box_key, seen_key, inv_key, claims = self._box_keys(name)
        for _ in range(ATTEMPTS):
            [boxes, inventories, claimed] = self._read((box_key, False), (inv_key, False), (claims, True))
            now = time.time()
            record = {"address": address, "tls_dir": tls_dir, "state": str(BoxState.UP),
                      "registered_at": boxes[0][1]["registered_at"] if boxes else now,
                      "last_error": None, "cert_sha256": cert_sha256, "generation": generation}
            held = {key.rsplit("/", 1)[1] for key, _, _ in claimed}
            fresh = [{"name": d["id"], "class": d["class"], "vendor": d["vendor"], "model": d["model"],
                      "capacity": int(d["capacity"])} for d in devices]
            names = {d["name"] for d in fresh}
            old = inventories[0][1] if inventories else []
            kept = [d for d in old if d["name"] not in names and d["name"] in held]  # leased, gone from the box
            dropped = [d["name"] for d in old if d["name"] not in names and d["name"] not in held]
            compare = [c_mod(box_key, boxes[0][2] if boxes else 0), c_mod(inv_key, inventories[0][2] if inventories
                                                                          else 0)]
            compare += [c_absent(claims + n) for n in dropped]
            success = [op_put(box_key, record), op_put(seen_key, now),
                       op_put(inv_key, sorted(fresh + kept, key=lambda d: d["name"]))]
            if lease is not None:
                success.append(op_put(self.k("alive", name), {"lease": lease, "since": now}, lease))
            result = self.etcd.txn(compare, success)
            if result.get("succeeded"):
                return
        raise StoreError(f"box {name} changed under every registration attempt", hint="try again")

    # --- boxes that announce themselves (docs/pool.md#boxes-that-announce-themselves) ---
    def grant_lease(self, ttl: float) -> str:
        """A fresh etcd lease of ``ttl`` s (at least 1); its id."""
        return str(self.etcd.call("/lease/grant", {"TTL": max(1, int(round(ttl)))})["ID"])

    def keepalive(self, lease: str) -> bool:
        """Renew an etcd lease; False once it expired or was revoked."""
        answer = self.etcd.call("/lease/keepalive", {"ID": lease})
        return int((answer.get("result") or answer).get("TTL") or 0) > 0

    def revoke_lease(self, lease: str) -> None:
        """End an etcd lease now (the keys under it go at once)."""
        self.etcd.call("/lease/revoke", {"ID": lease})

    def announce_box(self, name: str, address: str, tls_dir: str | None, devices: list[dict],
                     cert_sha256: str | None, generation: str, lease: str) -> None:
        """A box's remote proxy publishes itself: record (with the inventory's
        ``generation``), inventory, and its ``alive`` key under ``lease`` (from
        :meth:`grant_lease`, renewed by :meth:`keepalive`). When the lease ends the alive
        key goes and the box is down: it lends nothing, and its leased devices show
        ``box_state`` down, until it announces again."""
        self._put_box(name, address, tls_dir, devices, cert_sha256, generation, lease)

    def remove_box(self, name: str) -> None:
        box_key, seen_key, inv_key, claims = self._box_keys(name)
        for _ in range(ATTEMPTS):
            [boxes, claimed] = self._read((box_key, False), (claims, True))
            if not boxes:
                raise no_such_box(name, self._box_names())
            if claimed:
                raise box_busy(name, len(claimed))
            result = self.etcd.txn([c_mod(box_key, boxes[0][2]), c_absent(claims, prefix=True)],
                                   [op_delete(box_key), op_delete(seen_key), op_delete(inv_key),
                                    op_delete(self.k("alive", name))])
            if result.get("succeeded"):
                return
        raise StoreError(f"box {name} changed under every removal attempt", hint="try again")

    def _box_names(self) -> list[str]:
        prefix = self.k("boxes") + "/"
        return sorted(kv["key_bytes"].decode()[len(prefix):]
                      for kv in self.etcd.range(prefix, prefix=True, keys_only=True).get("kvs", []))

    @staticmethod
    def _box_dict(name: str, record: dict, seen: float | None, lent: int, alive: bool = False) -> dict:
        state, error = box_state(record, alive)
        return {"name": name, "address": record["address"], "tls_dir": record["tls_dir"],
                "state": state, "registered_at": record["registered_at"],
                "last_seen": seen if seen is not None else record["registered_at"],
                "last_error": error, "lent": lent, "cert_sha256": record["cert_sha256"],
                "generation": record.get("generation")}

    def box(self, name: str) -> dict:
        box_key, seen_key, _, claims = self._box_keys(name)
        [boxes, seen, claimed, alive] = self._read((box_key, False), (seen_key, False), (claims, True),
                                                   (self.k("alive", name), False))
        if not boxes:
            raise no_such_box(name, self._box_names())
        return self._box_dict(name, boxes[0][1], seen[0][1] if seen else None, len(claimed), bool(alive))

    def mark_box(self, name: str, up: bool, error: str | None = None) -> BoxState:
        """Record a heartbeat result; returns the box's state before it. A heartbeat that
        changes nothing writes only the box's ``seen`` key (allocations compare the box record)."""
        box_key, seen_key, _, _ = self._box_keys(name)
        for _ in range(ATTEMPTS):
            [boxes] = self._read((box_key, False))
            if not boxes:
                raise no_such_box(name, self._box_names())
            _, record, revision = boxes[0]
            before = BoxState(record["state"])
            ops = []
            if up:
                ops.append(op_put(seen_key, time.time()))
                if before != BoxState.UP or record["last_error"] is not None:
                    ops.append(op_put(box_key, {**record, "state": str(BoxState.UP), "last_error": None}))
            else:
                ops.append(op_put(box_key, {**record, "state": str(BoxState.DOWN), "last_error": error}))
            if self.etcd.txn([c_mod(box_key, revision)], ops).get("succeeded"):
                return before
        raise StoreError(f"box {name} changed under every heartbeat attempt", hint="try again")

    def _pool(self) -> tuple[dict, dict, dict, dict, dict, set]:
        """Everything at one revision: boxes, seen, inventories, claims (device -> lease),
        leases, the boxes whose alive key exists."""
        (boxes, seen, inventories, claims, leases, alive), _ = self._snapshot(
            *(self.k(p) + "/" for p in ("boxes", "seen", "inventory", "claims", "leases", "alive")))
        cut = len(self.prefix)

        def tail(key: str) -> str:
            return key[cut:].split("/", 1)[1]

        return ({tail(k): v for k, v, _ in boxes}, {tail(k): v for k, v, _ in seen},
                {tail(k): v for k, v, _ in inventories}, {tail(k): v for k, v, _ in claims},
                {tail(k): v for k, v, _ in leases}, {tail(k) for k, _, _ in alive})

    def boxes(self) -> list[dict]:
        boxes, seen, inventories, claims, _, alive = self._pool()
        lent = Counter(device.split("/", 1)[0] for device in claims)
        return [{**self._box_dict(name, record, seen.get(name), lent[name], name in alive),
                 "devices": len(inventories.get(name, [])), "leased": lent[name]}
                for name, record in sorted(boxes.items())]

    def devices(self) -> list[dict]:
        boxes, _, inventories, claims, leases, alive = self._pool()
        rows = []
        for box, inventory in inventories.items():
            if box not in boxes:
                continue
            state, _ = box_state(boxes[box], box in alive)
            for d in inventory:
                device_id = f"{box}/{d['name']}"
                lease = claims.get(device_id)
                rows.append({"id": device_id, "box": box, "name": d["name"], "class": d["class"],
                             "vendor": d["vendor"], "model": d["model"], "capacity": d["capacity"],
                             "box_state": state, "lease": lease, "vm": (leases.get(lease) or {}).get("vm"),
                             "available": lease is None and state == BoxState.UP})
        return sorted(rows, key=lambda r: r["id"])

    def device(self, device_id: str) -> dict:
        box, _, name = device_id.partition("/")
        box_key, _, inv_key, claims = self._box_keys(box)
        [boxes, inventories, claim, alive] = self._read((box_key, False), (inv_key, False), (claims + name, False),
                                                        (self.k("alive", box), False))
        found = [d for d in (inventories[0][1] if inventories else []) if d["name"] == name]
        if not boxes or not found:
            raise no_such_device(device_id)
        return {"id": device_id, "box": box, **found[0], "leased": int(bool(claim)),
                "address": boxes[0][1]["address"], "tls_dir": boxes[0][1]["tls_dir"],
                "cert_sha256": boxes[0][1].get("cert_sha256"), "box_state": box_state(boxes[0][1], bool(alive))[0]}

    # --- allocation -------------------------------------------------------------------
    def _resync(self, settle: bool = False) -> None:
        """Read allocation's whole view again: serializable (the answering member's copy;
        the transactions compare), or with ``settle`` (before answering "no free device")
        linearizable."""
        (boxes, inventories, claims, alive), revision = self._snapshot(
            *(self.k(p) + "/" for p in ("boxes", "inventory", "claims", "alive")), serializable=not settle)
        self._view.load(boxes, inventories, claims, alive, revision)
        self._synced_at = time.monotonic()
        if not self._watches:
            self._start_watches(revision + 1)

    def _refresh_claims(self) -> None:
        """Read every claim again, keys only (their lease ids become None): a tenth of a
        full read, whose inventories are most of its bytes; boxes and inventories are
        watched."""
        (claims,), _ = self._snapshot(self.k("claims") + "/", keys_only=True, serializable=True)
        self._view.set_claims((key, None) for key, _, _ in claims)
        self._view.probe = False

    def _probe_claims(self) -> bool:
        """Read the claims of the boxes where the walk landed (one serializable range:
        stale is fine, the transaction compares), so the walk does not lose a race for
        each of them that others filled meanwhile. True if one has a free device."""
        span, start, end = self._view.probe_span()
        if not span:
            return False
        found = kvs(self.etcd.call("/kv/range", {
            "key": b64(start), "range_end": b64(end) if end else prefix_end(self._view.claims_prefix),
            "serializable": True}))
        return self._view.probed(span, found)

    # --- the watch that keeps allocation's view fresh ------------------------------------
    def _start_watches(self, revision: int) -> None:
        """Watch alive/ and boxes/ (one range: alive/ to boxes0) and inventory/ from
        ``revision`` on; a watch that ends (its member died, a compaction) ends the other
        too, and both start again at the next full read.

        Not claims/: every allocation and free writes a claim, and etcd's gateway encodes
        each event once per watcher (measured: 8 handles watching claims cost etcd 1.6 ms
        of CPU per allocation, twice the transaction itself, and their Python readers
        more; with a watcher per host it grows with the hosts). Other handles' claims
        reach this view when a race for one of their devices is lost (the transaction's
        failure branch reads that box's claims) and at full reads; frees, at full reads
        (one comes before any "no free device")."""
        watches: list[Watch] = []
        try:
            for start, end in ((self.k("alive") + "/", self.k("boxes") + "0"),
                               (self.k("inventory") + "/", self.k("inventory") + "0")):
                watches.append(Watch(self.etcd, b64(start), b64(end), revision, self.prefix))
        except WatchFailed:
            for watch in watches:
                watch.close()
            return  # allocation works without them (conflicts refresh the view), and tries again later
        self._watches = watches
        for watch in watches:
            threading.Thread(target=self._watch_loop, args=(watch,), name="etcd-watch", daemon=True).start()

    def _watch_loop(self, watch: Watch) -> None:
        """Hand the events on; the allocating thread applies them (:meth:`_drain`), so this
        thread never waits for the view's lock, nor an allocation for it."""
        try:
            for events in watch:
                self._pending.append(events)
            if watch.failed:  # the next full read names the record, or finds etcd itself again
                log.warning("etcd watch given up: %s", watch.failed)
        except WatchCompacted:
            pass
        finally:
            with self._lock:
                if watch in self._watches:
                    self._stop_watches()
                    self._synced_at = -1e9  # the next allocation reads everything and watches again

    def _drain(self) -> None:
        """Apply the watch's events that came since the last call (under the view's lock);
        those a full read already covered are skipped."""
        while self._pending:
            for event in self._pending.popleft():
                if int(event["kv"].get("mod_revision", 0)) > self._view.seen:
                    self._view.apply(event)

    def _stop_watches(self) -> None:
        watches, self._watches = self._watches, []
        for watch in watches:
            watch.close()

    def allocate(self, vm: str, *, device_class: str | None = None, count: int = 1, box: str | None = None,
                 device: str | None = None, policy: str = "pack", owner_pid: int | None = None,
                 host: str | None = None) -> list[Lease]:
        """Pick ``count`` free devices and create ``attaching`` leases for them in one etcd
        transaction: all of them or none (:class:`NoFreeDevice`). For a ``host`` the
        transaction also compares that the host is not fenced."""
        check_allocation(policy, count)
        holder = None
        if host is not None:
            [fenced, agent] = self._read((self.k("fenced", host), False), (self.k("hosts", host), False))
            if fenced:
                raise host_fenced(host)
            holder = agent[0][1].get("holder") if agent else None
        with self._lock:
            fresh = False
            # a stale view costs a lost race, never a wrong answer (and "no free device" is
            # answered only after a linearizable read: fresh): the full read, 10,000 keys
            # in a big pool, comes rarely
            interval = self.resync_interval * (WATCHED_RESYNC_FACTOR if self._watches else 1)
            if time.monotonic() - self._synced_at > interval:
                self._resync()
            conflicts = 0
            for _ in range(ATTEMPTS):
                self._drain()
                if box is not None and box not in self._view.boxes:
                    if not fresh:
                        self._resync(settle=True)
                        fresh = True
                        continue
                    raise no_such_box(box, sorted(self._view.boxes))
                contended = conflicts > 0 or time.monotonic() < self._contended_until
                if contended and self._view.probe and box is None:
                    for _ in range(PROBES):
                        if self._probe_claims():
                            break
                        self._view.jump()
                    self._view.probe = False
                picks, free = self._view.choose(count, device_class, box, device, policy, shuffle=contended)
                if len(picks) < count:
                    if not fresh:  # others may have freed devices or added boxes since the last read
                        self._resync(settle=True)
                        fresh = True
                        continue
                    raise no_free_device(count, free, device_class, box, device)
                leases = self._try_allocate(vm, picks, owner_pid, host, holder)
                if leases is not None:
                    return leases
                conflicts += 1
                self.conflicts += 1
                self._contended_until = time.monotonic() + CONTENDED_FOR
                self._view.lost_race(picks)  # boxes another is filling come last; walk on elsewhere
                if conflicts == RESYNC_AFTER:  # the claims are stale all over (a nearly full pool)
                    self._refresh_claims()
                    continue
                if conflicts >= 2:  # racing the same allocator again: let one of us go first
                    time.sleep(random.uniform(0, min(BACKOFF_MAX, BACKOFF * 2 ** (conflicts - 2))))
                fresh = False
        raise StoreError(f"allocation for {vm} lost {ATTEMPTS} races in a row to other allocators",
                         hint="the pool is very busy; try again")

    def plan_allocate(self, vm: str, *, device_class: str | None = None, count: int = 1, box: str | None = None,
                      device: str | None = None, policy: str = "pack", owner_pid: int | None = None,
                      host: str | None = None) -> dict:
        """What :meth:`allocate` would send now: the devices it would choose (from a fresh
        read) and its transaction, keys in clear; nothing is written. Lease ids are
        examples, and the fencing token is the revision the transaction would create."""
        check_allocation(policy, count)
        if host is not None and self._read((self.k("fenced", host), False))[0]:
            raise host_fenced(host)
        with self._lock:
            self._resync(settle=True)
            self._drain()
            if box is not None and box not in self._view.boxes:
                raise no_such_box(box, sorted(self._view.boxes))
            picks, free = self._view.choose(count, device_class, box, device, policy, shuffle=False)
            if len(picks) < count:
                raise no_free_device(count, free, device_class, box, device)
            leases, compare, success, _, _ = self._allocation_txn(vm, picks, owner_pid, host, None)
        return {"leases": leases, "transaction": {"compare": [_show(c) for c in compare],
                                                  "success": [_show(op) for op in success]}}

    def _allocation_txn(self, vm: str, picks: list[str], owner_pid: int | None, host: str | None,
                        holder: str | None) -> tuple[list[Lease], list[dict], list[dict], list[dict], list[str]]:
        now = time.time()
        leases = []
        for device_id in picks:
            lease_id = secrets.token_hex(4)
            leases.append(Lease(lease_id, device_id, vm, LeaseState.ATTACHING, QDEV_PREFIX + lease_id,
                                owner_pid=owner_pid, created_at=now, updated_at=now, host=host, holder=holder))
        boxes = sorted({device_id.split("/", 1)[0] for device_id in picks})
        compare, success, failure = [], [], []
        if host is not None:
            compare.append(c_absent(self.k("fenced", host)))
        for name in boxes:
            box_key, _, inv_key, claims = self._box_keys(name)
            view = self._view
            compare += [c_mod(box_key, view.boxes[name][1]), c_mod(inv_key, view.inventory[name][1])]
            if view.boxes[name][0].get("generation") is not None:  # announces itself: still alive
                compare.append(c_mod(self.k("alive", name), view.alive[name]))
            failure += [op_range(box_key), op_range(inv_key), op_range(claims, prefix=True),
                        op_range(self.k("alive", name))]
        for lease in leases:
            claim, lease_key = self.k("claims", lease.device), self.k("leases", lease.id)
            compare += [c_absent(claim), c_absent(lease_key)]
            success += [op_put(claim, lease.id), op_put(lease_key, _lease_record(lease))]
        return leases, compare, success, failure, boxes

    def _try_allocate(self, vm: str, picks: list[str], owner_pid: int | None, host: str | None = None,
                      holder: str | None = None) -> list[Lease] | None:
        """One transaction for all ``picks``; None (and a refreshed view) if any was taken."""
        leases, compare, success, failure, boxes = self._allocation_txn(vm, picks, owner_pid, host, holder)
        result = self.etcd.txn(compare, success, failure)
        revision = int(result["header"]["revision"])
        if not result.get("succeeded"):
            found = ranges(result)
            for i, name in enumerate(boxes):
                self._view.learn_box(name, found[4 * i:4 * i + 4])
            if not all(self._view.claims.get(lease.box, {}).get(lease.device.split("/", 1)[1]) == lease.id
                       for lease in leases):
                if host is not None and self._read((self.k("fenced", host), False))[0]:
                    raise host_fenced(host)
                return None
            # a retried send of a transaction that had been applied: they are ours
            [found_lease] = [kvs(self.etcd.range(self.k("leases", leases[0].id)), "create_revision")]
            revision = found_lease[0][2] if found_lease else revision
        for lease in leases:
            lease.fence = revision
            self._view.claimed(lease.box, lease.device.split("/", 1)[1], lease.id)
            self._mine[lease.id] = (_lease_record(lease), revision)
        return leases

    # --- leases -----------------------------------------------------------------
    def _lease(self, lease_id: str) -> tuple[dict, int] | None:
        """The lease record and its revision: from what this handle wrote last, else read."""
        if lease_id in self._mine:
            return self._mine[lease_id]
        [found] = self._read((self.k("leases", lease_id), False))
        return (found[0][1], found[0][2]) if found else None

    def update_lease(self, lease_id: str, **fields: object) -> None:
        """One transaction (compare the lease's revision, put); a lost race reads it again."""
        check_lease_fields(fields)
        key = self.k("leases", lease_id)
        with self._lock:
            for _ in range(ATTEMPTS):
                known = self._lease(lease_id)
                if known is None:
                    return  # as SQLite's UPDATE of a missing row: nothing to change
                record, revision = known
                record = {**record, **{k: str(v) if isinstance(v, LeaseState) else v for k, v in fields.items()},
                          "updated_at": time.time()}
                result = self.etcd.txn([c_mod(key, revision)], [op_put(key, record)])
                if result.get("succeeded"):
                    self._mine[lease_id] = (record, int(result["header"]["revision"]))
                    return
                self._mine.pop(lease_id, None)
        raise StoreError(f"lease {lease_id} changed under every update attempt", hint="try again")

    def delete_lease(self, lease_id: str) -> None:
        """The lease goes, and its device's claim with it (if the claim is still this lease's)."""
        key = self.k("leases", lease_id)
        with self._lock:
            for _ in range(ATTEMPTS):
                known = self._lease(lease_id)
                if known is None:
                    return
                record, revision = known
                claim = self.k("claims", record["device"])
                result = self.etcd.txn([c_mod(key, revision), c_value(claim, lease_id)],
                                       [op_delete(key), op_delete(claim)], [op_range(key), op_range(claim)])
                if not result.get("succeeded"):
                    [lease_now, claim_now] = ranges(result)
                    if lease_now and lease_now[0][2] == revision:  # the claim is another's (or gone)
                        result = self.etcd.txn([c_mod(key, revision)], [op_delete(key)])
                if result.get("succeeded"):
                    self._mine.pop(lease_id, None)
                    box, name = record["device"].split("/", 1)
                    self._view.released(box, name, lease_id)
                    return
                self._mine.pop(lease_id, None)
        raise StoreError(f"lease {lease_id} changed under every delete attempt", hint="try again")

    def leases(self, vm: str | None = None) -> list[Lease]:
        [found], _ = self._snapshot(self.k("leases") + "/", revision_of="create_revision")
        leases = [Lease(**{**record, "fence": created}) for _, record, created in found]
        if vm:
            return sorted((lease for lease in leases if lease.vm == vm), key=lambda lease: (lease.created_at, lease.id))
        return sorted(leases, key=lambda lease: (lease.vm, lease.created_at, lease.id))

    def leases_at(self) -> tuple[list[Lease], int]:
        """Every lease and the revision they were read at: a watch from just after it
        (:meth:`watch_leases`) misses no change."""
        [found], revision = self._snapshot(self.k("leases") + "/", revision_of="create_revision")
        return [Lease(**{**record, "fence": created}) for _, record, created in found], revision

    def lease(self, lease_id: str) -> Lease | None:
        """One lease as it is now (None: deleted)."""
        [found] = [kvs(self.etcd.range(self.k("leases", lease_id)), "create_revision")]
        return Lease(**{**found[0][1], "fence": found[0][2]}) if found else None

    def watch_leases(self, start_revision: int) -> "LeaseWatch":
        """The changes of lease records from ``start_revision`` on (see :class:`LeaseWatch`)."""
        prefix = self.k("leases") + "/"
        return LeaseWatch(Watch(self.etcd, b64(prefix), prefix_end(prefix), start_revision, self.prefix), len(prefix))

    def lease_for(self, vm: str, name: str) -> Lease:
        """A VM's lease by lease id, QEMU id, device id (box/dev) or device name."""
        return pick_lease(self.leases(vm), vm, name)

    # --- hosts ------------------------------------------------------------------
    def host_register(self, host: str, ttl: float, agent_pid: int) -> str:
        """A host agent starts: an etcd lease of ``ttl`` s (its holder id) and the host key
        under it, unless the host is fenced."""
        granted = self.etcd.call("/lease/grant", {"TTL": max(1, int(round(ttl)))})
        holder = str(granted["ID"])
        record = {"holder": holder, "agent_pid": agent_pid, "started_at": time.time()}
        result = self.etcd.txn([c_absent(self.k("fenced", host))], [op_put(self.k("hosts", host), record, holder)])
        if not result.get("succeeded"):
            self.etcd.call("/lease/revoke", {"ID": holder})
            raise host_fenced(host)
        return holder

    def host_keepalive(self, host: str, holder: str) -> bool:
        """Renew the agent's etcd lease; False once it expired or was revoked (fenced)."""
        answer = self.etcd.call("/lease/keepalive", {"ID": holder})
        return int((answer.get("result") or answer).get("TTL") or 0) > 0

    def host_release(self, host: str, holder: str) -> None:
        self.etcd.call("/lease/revoke", {"ID": holder})

    def hosts(self) -> list[dict]:
        (agents, fenced, leases), _ = self._snapshot(*(self.k(p) + "/" for p in ("hosts", "fenced", "leases")))
        cut = len(self.prefix)
        agents_by = {key[cut:].split("/", 1)[1]: value for key, value, _ in agents}
        fenced_by = {key[cut:].split("/", 1)[1]: value for key, value, _ in fenced}
        held = Counter(record.get("host") for _, record, _ in leases if record.get("host"))
        now = time.time()
        return [host_view(name, agents_by.get(name), fenced_by.get(name), held.get(name, 0), now)
                for name in sorted(set(agents_by) | set(fenced_by) | set(held))]

    def fence_host(self, host: str) -> list[Lease]:
        """Mark ``host`` fenced (from now on no allocation for it: they compare the fenced
        key), end its agent's etcd lease, and take its leases from it; returns them."""
        host_key = self.k("hosts", host)
        [agent] = self._read((host_key, False))
        self.etcd.txn([], [op_put(self.k("fenced", host), time.time())])
        if agent and agent[0][1].get("holder"):
            try:
                self.etcd.call("/lease/revoke", {"ID": agent[0][1]["holder"]})
            except StoreError:
                pass  # expired already
        taken = [lease for lease in self.leases() if lease.host == host]
        for lease in taken:
            self.delete_lease(lease.id)
        return taken

    def unfence_host(self, host: str) -> None:
        key = self.k("fenced", host)
        result = self.etcd.txn([c_absent(key)], [], [op_delete(key)])
        if result.get("succeeded"):
            raise StoreError(f"host {host} is not fenced", hint="dxpu host ls shows the hosts")


class LeaseWatch:
    """Iterate for ``(revision, [(lease id, record or None if deleted), ...])``, in order;
    ends when the stream does (:class:`WatchCompacted` if etcd compacted past the start).
    :meth:`close` ends it from another thread."""

    def __init__(self, watch: Watch, cut: int) -> None:
        self.watch = watch
        self.cut = cut

    def __iter__(self) -> Iterator[tuple[int, list[tuple[str, dict | None]]]]:
        for events in self.watch:
            changed, revision = [], 0
            for event in events:
                kv = event["kv"]
                revision = max(revision, int(kv.get("mod_revision", 0)))
                value = kv["record"] if event.get("type") != "DELETE" else None
                changed.append((kv["key_bytes"].decode()[self.cut:], value))
            yield revision, changed

    def close(self) -> None:
        self.watch.close()


def _show(item: dict) -> str:
    """A compare or an operation of a transaction, as text (keys and values decoded)."""
    if "request_put" in item:
        put = item["request_put"]
        return f"put {unb64(put['key'])} = {unb64(put['value'])}"
    if "request_delete_range" in item:
        return f"delete {unb64(item['request_delete_range']['key'])}"
    key = unb64(item["key"]) + ("*" if "range_end" in item else "")
    if item["target"] == "MOD":
        return f"mod_revision({key}) == {item['mod_revision']}"
    if item["target"] == "VERSION":
        return f"absent({key})" if item["version"] == 0 else f"version({key}) == {item['version']}"
    return f"value({key}) == {unb64(item['value'])}"


def show_lease_delete(prefix: str, lease: Lease) -> dict:
    """The transaction :meth:`EtcdStore.delete_lease` sends, as text."""
    return {"compare": [f"mod_revision({prefix}leases/{lease.id}) == (as read)",
                        f"value({prefix}claims/{lease.device}) == \"{lease.id}\""],
            "success": [f"delete {prefix}leases/{lease.id}", f"delete {prefix}claims/{lease.device}"]}


def _lease_record(lease: Lease) -> dict:
    return {"id": lease.id, "device": lease.device, "vm": lease.vm, "state": str(lease.state),
            "qdev_id": lease.qdev_id, "port": lease.port, "socket": lease.socket, "proxy_pid": lease.proxy_pid,
            "owner_pid": lease.owner_pid, "created_at": lease.created_at, "updated_at": lease.updated_at,
            "host": lease.host, "holder": lease.holder, "request": lease.request, "error": lease.error}
