"""Allocation's in-memory view of an etcd pool (dxpu_vfio/pool/etcd_view.py), on its own:
no etcd, since the view makes no call. The events are the shapes the store hands it
(a watch event's ``kv`` with ``key_bytes``, ``mod_revision`` and the checked ``record``);
the stores' shared behaviour (policies, races, watches) is tested against a real etcd in
test_pool_store.py and test_pool_etcd.py."""

from __future__ import annotations

import random

from dxpu_vfio.pool.etcd_view import AllocationView

PREFIX = "/dxpu/v1/"


def record(up: bool = True, announces: bool = False) -> dict:
    return {"address": "198.18.1.2:7000", "tls_dir": None, "state": "up" if up else "down", "registered_at": 0.0,
            "last_error": None, "cert_sha256": None, "generation": 1 if announces else None}


def inventory(n: int) -> list[dict]:
    return [{"name": f"d{i}", "class": "testdev", "vendor": "1b36", "model": "td", "capacity": 0} for i in range(n)]


def event(key: str, value: object, revision: int) -> dict:
    kv = {"key_bytes": (PREFIX + key).encode(), "mod_revision": revision}
    if value is None:
        return {"type": "DELETE", "kv": kv}
    return {"kv": {**kv, "record": value}}


def fresh_view(state: dict[str, object], revision: int) -> AllocationView:
    """The view a full read of ``state`` (key -> value) builds."""
    view = AllocationView(PREFIX)
    by = {kind: [(PREFIX + k, v, revision) for k, v in state.items() if k.startswith(kind + "/")]
          for kind in ("boxes", "inventory", "claims", "alive")}
    view.load(by["boxes"], by["inventory"], by["claims"], by["alive"], revision)
    return view


def loaded(boxes: dict[str, tuple[dict, int]], claims: dict[str, str]) -> AllocationView:
    """A view read whole: boxes (record, devices in the inventory) and claims (device -> lease)."""
    state: dict[str, object] = {f"claims/{device}": lease for device, lease in claims.items()}
    for box, (rec, n) in boxes.items():
        state[f"boxes/{box}"], state[f"inventory/{box}"] = rec, inventory(n)
    return fresh_view(state, 1)


def test_pack_takes_the_fullest_box_and_spread_the_emptiest():
    view = loaded({"a": (record(), 4), "b": (record(), 4), "c": (record(up=False), 4)},
                  {"a/d0": "l1", "a/d1": "l2", "b/d0": "l3"})
    assert view.choose(1, None, None, None, "pack", shuffle=False) == (["a/d2"], 1)
    assert view.choose(1, None, None, None, "spread", shuffle=False) == (["b/d1"], 1)
    assert view.choose(6, None, None, None, "pack", shuffle=False) == (["a/d2", "a/d3", "b/d1", "b/d2", "b/d3"], 5), \
        "a box that is down lends nothing, and a short answer says how many were free"


def test_a_box_that_announces_itself_lends_only_while_its_alive_key_is_there():
    view = loaded({"a": (record(announces=True), 2)}, {})
    assert view.choose(1, None, None, None, "pack", shuffle=False) == ([], 0)
    view.apply(event("alive/a", {}, 5))
    assert view.choose(1, None, None, None, "pack", shuffle=False) == (["a/d0"], 1)
    view.apply(event("alive/a", None, 6))
    assert not view.lends("a")


def test_an_event_older_than_what_a_transaction_told_is_ignored():
    view = loaded({"a": (record(), 2)}, {})
    view.learn_box("a", [[(f"{PREFIX}boxes/a", record(up=False), 9)], [(f"{PREFIX}inventory/a", inventory(2), 9)],
                         [], []])
    view.apply(event("boxes/a", record(up=True), 7))  # a watch event from before revision 9
    assert not view.lends("a")


def test_the_index_agrees_with_a_fresh_view_after_every_event():
    """The index of boxes by what they lend is kept by every change, never rebuilt: after
    each of many random events (claims taken and freed, boxes down and up, alive keys
    gone, inventories shrinking, boxes removed) it must be the index a full read of the
    same state builds, and so must the choices."""
    rng = random.Random(7)
    names = [f"b{i}" for i in range(6)]
    view = loaded({n: (record(announces=rng.random() < 0.3), 4) for n in names}, {})
    state: dict[str, object] = {}  # key -> value, as etcd holds it now
    for n in names:
        state[f"boxes/{n}"], state[f"inventory/{n}"] = view.boxes[n][0], view.inventory[n][0]
    for revision in range(2, 2000):
        n = rng.choice(names)
        roll = rng.random()
        if roll < 0.5:
            key, value = f"claims/{n}/d{rng.randrange(4)}", (None if rng.random() < 0.4 else f"l{revision}")
        elif roll < 0.65:
            key, value = f"alive/{n}", (None if rng.random() < 0.5 else {})
        elif roll < 0.8:
            key, value = f"boxes/{n}", (None if rng.random() < 0.1 else record(up=rng.random() < 0.7,
                                                                             announces=rng.random() < 0.3))
        else:
            key, value = f"inventory/{n}", inventory(rng.randrange(5))
        if value is None:
            state.pop(key, None)
        else:
            state[key] = value
        view.apply(event(key, value, revision))
        fresh = fresh_view(state, revision)
        assert (view._open, view._level) == (fresh._open, fresh._level), f"after {key} = {value!r}"
        assert view.choose(3, None, None, None, "pack", shuffle=False) == \
            fresh.choose(3, None, None, None, "pack", shuffle=False), f"after {key} = {value!r}"
