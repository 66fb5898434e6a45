"""Allocation's view of a pool in etcd, in one store handle's memory: the boxes, their
inventories, alive keys and claims as the handle last learnt them; each box that lends
filed by how many devices it lends (so a choice needs no pass over every box); and the
walk that spreads allocators racing each other over different boxes.

Memory only, no etcd call here: :class:`~dxpu_vfio.pool.etcd_store.EtcdStore` fills the
view (full reads, watch events, the failure branch of a lost transaction, its own
allocations and frees) and compares what it chose from against etcd in the allocation's
transaction, so a stale view costs a lost race, never a wrong answer. Not thread-safe:
the store holds its allocation lock around every use.
"""

from __future__ import annotations

import heapq
import random
import time
from typing import Any, Iterable, Iterator

from dxpu_vfio.pool.states import BoxState

AVOID_FOR = 30.0  # s a box where this handle lost a race comes last in its choice (another allocator fills it)
PROBE = 16  # boxes whose claims are read where the walk lands after a lost race (docs: choose)

Found = list[tuple[str, Any, int]]  # (key, value, revision) of one range read


def box_state(record: dict, alive: bool) -> tuple[BoxState, str | None]:
    """A box's state and last error: its record's, except that a box announcing itself
    (it has a ``generation``) whose alive key is gone is down."""
    if record.get("generation") is not None and not alive and record["state"] == BoxState.UP:
        return BoxState.DOWN, "its box lease expired: the remote proxy stopped announcing it (dead or cut off)"
    return BoxState(record["state"]), record["last_error"]


class AllocationView:
    """What one handle knows of the pool's boxes, for choosing devices (``prefix``: the
    pool's key prefix, ``/dxpu/v1/``)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.claims_prefix = prefix + "claims/"
        # box -> (record, mod_revision), box -> (inventory, mod_revision), box -> {device: lease id}
        self.boxes: dict[str, tuple[dict, int]] = {}
        self.inventory: dict[str, tuple[list[dict], int]] = {}
        self.claims: dict[str, dict[str, str | None]] = {}  # lease id None: read as keys only
        self.alive: dict[str, int] = {}  # announcing box -> mod_revision of its alive key
        self.seen = 0  # revision of the last full read
        self.probe = False  # read the claims where the walk lands before choosing there
        self._open: dict[int, set[str]] = {}  # lent -> the up boxes lending that many that are not full
        self._level: dict[str, int] = {}  # box -> its key in _open
        self._avoid: dict[str, float] = {}  # box -> until when it comes last (a race for it was lost)
        self._order: list[str] = []  # box names in key order (the walk's order); [] = to be rebuilt
        self._position: dict[str, int] = {}
        self._cursor = 0  # where the walk over equally good boxes goes on (index in _order)

    # --- what the store learnt ---------------------------------------------------------
    def load(self, boxes: Found, inventories: Found, claims: Found, alive: Found, revision: int) -> None:
        """The whole view, from one full read at ``revision``."""
        self.boxes = {k.rsplit("/", 1)[1]: (v, rev) for k, v, rev in boxes}
        self._order = []
        self.alive = {k.rsplit("/", 1)[1]: rev for k, _, rev in alive}
        self.inventory = {k.rsplit("/", 1)[1]: (v, rev) for k, v, rev in inventories}
        self.set_claims((key, lease_id) for key, lease_id, _ in claims)
        self.seen = revision
        self.probe = False  # the whole view is fresh

    def set_claims(self, claims: Iterable[tuple[str, str | None]]) -> None:
        """The view's claims are these (claim key, lease id or None), and every box is
        indexed again by what is free in it."""
        self.claims = {}
        cut = len(self.claims_prefix)
        for key, lease_id in claims:
            box, name = key[cut:].split("/", 1)
            self.claims.setdefault(box, {})[name] = lease_id
        self._open, self._level = {}, {}
        for name in self.boxes:
            self.index(name)

    def apply(self, event: dict) -> None:
        """One watch event (a put or delete of a box, inventory, alive key or claim)."""
        kv = event["kv"]
        key, revision = kv["key_bytes"].decode(), int(kv.get("mod_revision", 0))
        deleted = event.get("type") == "DELETE"
        value = None if deleted else kv["record"]
        kind, _, rest = key[len(self.prefix):].partition("/")
        if kind == "claims":
            box, _, name = rest.partition("/")
            if deleted:
                self.claims.get(box, {}).pop(name, None)
            else:
                self.claims.setdefault(box, {})[name] = value
            self.index(box)
            return
        if kind == "alive":
            if deleted:
                self.alive.pop(rest, None)
            elif revision >= self.alive.get(rest, 0):
                self.alive[rest] = revision
            self.index(rest)
            return
        cache = self.boxes if kind == "boxes" else self.inventory if kind == "inventory" else None
        if cache is None or revision < cache.get(rest, (None, 0))[1]:
            return  # older than what a transaction of ours already told us
        if kind == "boxes" and deleted != (rest not in cache):
            self._order = []  # a box came or went
        if deleted:
            cache.pop(rest, None)
        else:
            cache[rest] = (value, revision)
        self.index(rest)

    def learn_box(self, name: str, found: list[Found]) -> None:
        """What a failed allocation's failure branch read about one box: record, inventory,
        claims, alive key."""
        [boxes, inventories, claims, alive] = found
        if alive:
            self.alive[name] = alive[0][2]
        else:
            self.alive.pop(name, None)
        if bool(boxes) != (name in self.boxes):
            self._order = []  # a box came or went
        for cache, items in ((self.boxes, boxes), (self.inventory, inventories)):
            if items:
                cache[name] = (items[0][1], items[0][2])
            else:
                cache.pop(name, None)
        self.claims[name] = {key.rsplit("/", 1)[1]: lease_id for key, lease_id, _ in claims}
        self.index(name)

    def claimed(self, box: str, device: str, lease_id: str) -> None:
        """This handle's transaction claimed ``box/device`` for ``lease_id``."""
        self.claims.setdefault(box, {})[device] = lease_id
        self.index(box)

    def released(self, box: str, device: str, lease_id: str) -> None:
        """This handle deleted ``lease_id`` and its claim of ``box/device`` (if it was still
        that lease's, or read as a key only)."""
        claims = self.claims.get(box, {})
        if device in claims and claims[device] in (lease_id, None):
            del claims[device]
            self.index(box)

    def lost_race(self, picks: list[str]) -> None:
        """An allocation of ``picks`` lost its transaction: a box where one of them is
        another's now comes last for a while (another allocator is filling it), and the
        walk goes on from a random box (its neighbours are likely the other's too)."""
        now = time.monotonic()
        if len(self._avoid) > 256:
            self._avoid = {name: until for name, until in self._avoid.items() if until > now}
        for pick in picks:
            name, dev = pick.split("/", 1)
            if dev in self.claims.get(name, {}):
                self._avoid[name] = now + AVOID_FOR
        self.jump()

    # --- the index and the walk ----------------------------------------------------------
    def index(self, name: str) -> None:
        """Re-file one box in ``_open`` after its record, inventory or claims changed."""
        old = self._level.pop(name, None)
        if old is not None:
            self._open[old].discard(name)
            if not self._open[old]:
                del self._open[old]
        record, inventory = self.boxes.get(name), self.inventory.get(name)
        lent = len(self.claims.get(name, ()))
        if record and inventory and self.lends(name) and lent < len(inventory[0]):
            self._open.setdefault(lent, set()).add(name)
            self._level[name] = lent

    def lends(self, name: str) -> bool:
        """Up in allocation's view: record up and, if it announces itself, alive."""
        record = self.boxes.get(name)
        return record is not None and box_state(record[0], name in self.alive)[0] == BoxState.UP

    def _walk_order(self) -> list[str]:
        """Box names in the order of their claim keys (``name/`` sorts as the keys do)."""
        if len(self._order) != len(self.boxes):
            self._order = sorted(self.boxes, key=lambda name: name + "/")
            self._position = {name: i for i, name in enumerate(self._order)}
            self._cursor %= max(1, len(self._order))
        return self._order

    def _walk(self, names: set[str], avoid: set[str], later: list[str]) -> Iterator[str]:
        """``names`` in walk order from the cursor (the avoided ones into ``later``)."""
        order = self._walk_order()
        n, cursor = len(order), self._cursor
        if len(names) <= 32:
            ranked = sorted(names, key=lambda name: (self._position.get(name, 0) - cursor) % n)
        else:
            ranked = (order[(cursor + step) % n] for step in range(n))
        for name in ranked:
            if name not in names:
                continue
            if name in avoid:
                later.append(name)
            else:
                yield name

    def jump(self) -> None:
        """After a lost race: walk on from a random box, and read its claims first."""
        order = self._walk_order()
        self._cursor = random.randrange(len(order)) if order else 0
        self.probe = True

    def probe_span(self) -> tuple[list[str], str, str | None]:
        """The :data:`PROBE` boxes from the cursor on whose claims to read (one range: the
        first one's claim prefix up to the next box's, None: to the end of claims/)."""
        self.probe = False
        order = self._walk_order()
        span = order[self._cursor:self._cursor + PROBE]
        after = order[self._cursor + PROBE] if self._cursor + PROBE < len(order) else None
        start = self.claims_prefix + span[0] + "/" if span else ""
        return span, start, (self.claims_prefix + after + "/") if after is not None else None

    def probed(self, span: list[str], found: Found) -> bool:
        """The claims read for ``span``; True if one of its boxes has a free device."""
        for name in span:
            self.claims[name] = {}
        cut = len(self.claims_prefix)
        for key, lease_id, _ in found:
            name, _, device = key[cut:].partition("/")
            self.claims.setdefault(name, {})[device] = lease_id
        for name in span:
            self.index(name)
        return any(name in self._level for name in span)

    # --- the choice ------------------------------------------------------------------------
    def choose(self, count: int, device_class: str | None, box: str | None, device: str | None,
               policy: str, shuffle: bool) -> tuple[list[str], int]:
        """The devices SQLite's allocator would take from this view (box by policy, ties
        by name, then the box's first free device by name). With ``shuffle`` (other
        allocators race us) ties between boxes go in key order from the cursor (which
        jumps to a random box at each lost race, :meth:`jump`), a box where a race was
        lost in the last :data:`AVOID_FOR` s comes after every other (another allocator
        is filling it), and the device is a random free one of the box: the policy still
        decides the box, and concurrent allocators each fill their own. And, if fewer
        than ``count`` match, how many do."""
        chosen: dict[str, set[str]] = {}
        now = time.monotonic()
        avoid = {name for name, until in self._avoid.items() if until > now} if shuffle else set()

        def free_in(name: str) -> list[str]:
            claimed, mine = self.claims.get(name, {}), chosen.get(name, ())
            return sorted(d["name"] for d in self.inventory[name][0] if d["name"] not in claimed
                          and d["name"] not in mine and (not device_class or d["class"] == device_class)
                          and (device is None or device in (d["name"], f"{name}/{d['name']}")))

        def up() -> list[str]:
            return [name for name in self.boxes
                    if self.lends(name) and (box is None or name == box) and name in self.inventory]

        sign = -1 if policy == "pack" else 1

        def in_order() -> Iterator[str]:
            """Non-full up boxes, the policy's choice first."""
            if box is None and not chosen:  # the index: no pass over every box
                later: list[str] = []
                for level in sorted(self._open, reverse=policy == "pack"):
                    if not shuffle:
                        yield from sorted(self._open[level])
                        continue
                    yield from self._walk(self._open[level], avoid, later)
                yield from later
                return
            heap = []
            for name in up():
                lent = len(self.claims.get(name, ())) + len(chosen.get(name, ()))
                if lent < len(self.inventory[name][0]):  # a full box needs no look at its devices
                    heap.append((name in avoid, sign * lent, random.random() if shuffle else 0.0, name))
            heapq.heapify(heap)
            while heap:
                yield heapq.heappop(heap)[3]

        picks: list[str] = []
        for _ in range(count):
            for name in in_order():
                free = free_in(name)
                if free:
                    pick = random.choice(free) if shuffle else free[0]
                    break
            else:
                chosen.clear()
                return picks, sum(len(free_in(name)) for name in up())
            chosen.setdefault(name, set()).add(pick)
            picks.append(f"{name}/{pick}")
            if shuffle and name in self._position:
                self._cursor = self._position[name]  # the walk goes on from here
        return picks, len(picks)
