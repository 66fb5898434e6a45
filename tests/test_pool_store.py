"""The pool stores (no VM): one suite run on SQLite (a real file) and on etcd (a real
member this session started): allocation policies, atomicity across processes,
refusals, re-registration, states, and the Prometheus exposition. Then what only SQLite
has: schema migration, its CHECK constraints, a full disk."""

from __future__ import annotations

import json
import multiprocessing
import os
import sqlite3
import subprocess
from dataclasses import dataclass

import pytest

from dxpu_vfio.pool import store as store_mod
from dxpu_vfio.pool.metrics import render
from dxpu_vfio.pool.etcd_client import op_put
from dxpu_vfio.pool.states import BoxState, LeaseState
from dxpu_vfio.pool.storage import PoolStore
from dxpu_vfio.pool.store import NoFreeDevice, Store, StoreError


def inventory(n: int, cls: str = "testdev") -> list[dict]:
    return [{"id": f"d{i}", "class": cls, "vendor": "1b36", "model": "10f0", "capacity": 1 << 20, "lease": f"t{i}"}
            for i in range(n)]


@dataclass(frozen=True)
class Pool:
    """Where one pool lives: a SQLite file, or etcd endpoints and a key prefix. Picklable,
    so another process opens a handle of its own on the same pool."""

    kind: str
    path: str
    endpoints: tuple[str, ...] = ()
    prefix: str = ""

    def open(self) -> PoolStore:
        if self.kind == "sqlite":
            return Store(self.path)
        from dxpu_vfio.pool.etcd_store import EtcdStore
        return EtcdStore(list(self.endpoints), path=self.path, prefix=self.prefix)


@pytest.fixture(params=["sqlite", "etcd"])
def pool(request, tmp_path) -> Pool:
    if request.param == "sqlite":
        return Pool("sqlite", str(tmp_path / "pool.db"))
    cluster = request.getfixturevalue("etcd")
    return Pool("etcd", str(tmp_path / "pool.db"), tuple(cluster.endpoints), request.getfixturevalue("etcd_prefix"))


@pytest.fixture
def store(pool):
    s = pool.open()
    s.register_box("a", "198.18.1.2:7000", None, inventory(3))
    s.register_box("b", "198.18.2.2:7000", None, inventory(2) + [
        {"id": "n0", "class": "nvme", "vendor": "1b36", "model": "10f1", "capacity": 1 << 30, "lease": "tn"}])
    yield s
    s.close()


def boxes_of(leases) -> list[str]:
    return [lease.box for lease in leases]


def test_pack_fills_the_busiest_box_and_spread_goes_across(store):
    assert boxes_of(store.allocate("vm1", device_class="testdev", count=2, policy="spread")) == ["a", "b"]
    # a and b both lend 1: pack takes a's (name order), then keeps filling a
    assert boxes_of(store.allocate("vm2", device_class="testdev", count=2, policy="pack")) == ["a", "a"]
    assert boxes_of(store.allocate("vm3", device_class="testdev", policy="spread")) == ["b"]
    with pytest.raises(NoFreeDevice, match="asked for 1 device.s. of class testdev, 0 free"):
        store.allocate("vm4", device_class="testdev")


def test_a_failed_allocation_allocates_nothing(store):
    with pytest.raises(NoFreeDevice, match="asked for 9 device.s., 6 free"):
        store.allocate("vm1", count=9)
    assert store.leases() == [] and all(d["available"] for d in store.devices())


def test_filters_by_box_and_device(store):
    [lease] = store.allocate("vm1", device="b/n0")
    assert lease.device == "b/n0" and lease.qdev_id == "pool-" + lease.id and lease.state == "attaching"
    [lease] = store.allocate("vm1", device="d1", box="a")
    assert lease.device == "a/d1"
    with pytest.raises(StoreError, match="no box named 'z'"):
        store.allocate("vm1", box="z")
    with pytest.raises(NoFreeDevice):
        store.allocate("vm2", device="b/n0")
    assert store.lease_for("vm1", "n0").device == "b/n0"
    assert store.lease_for("vm1", "a/d1").device == "a/d1"
    with pytest.raises(StoreError, match="holds no device.s. matching 'd0'"):
        store.lease_for("vm1", "d0")


def test_down_boxes_lend_nothing_and_come_back(store):
    store.mark_box("b", up=False, error="no answer")
    assert boxes_of(store.allocate("vm1", count=3)) == ["a", "a", "a"]
    with pytest.raises(NoFreeDevice):
        store.allocate("vm1")
    assert store.mark_box("b", up=True) == "down"
    assert boxes_of(store.allocate("vm1")) == ["b"]


def test_reregistration_keeps_leased_devices_and_drops_vanished_free_ones(store):
    [held] = store.allocate("vm1", device="a/d2")
    store.register_box("a", "198.18.1.9:7000", None, inventory(1))  # d1 and d2 gone from the box
    ids = [d["id"] for d in store.devices() if d["box"] == "a"]
    assert ids == ["a/d0", "a/d2"]
    assert store.box("a")["address"] == "198.18.1.9:7000"
    with pytest.raises(StoreError, match="still has 1 leased device"):
        store.remove_box("a")
    store.delete_lease(held.id)
    store.remove_box("a")
    assert [b["name"] for b in store.boxes()] == ["b"]


def _grab(pool: Pool, name: str, count: int, out, go) -> None:
    s = pool.open()
    go.wait(60)
    out.put([s.allocate(name)[0].device for _ in range(count)])


def test_one_lease_and_one_box_read_as_the_listings_show_them(store):
    """What a host agent's heal pass reads instead of the listings (docs/pool.md#host-agents-and-fencing)."""
    [lease] = store.allocate("vm1", box="b", device="d1", host="h1")
    store.update_lease(lease.id, state=LeaseState.ATTACHED, port="rp1")
    [listed] = store.leases()
    assert store.lease(lease.id) == listed and listed.state is LeaseState.ATTACHED and listed.fence == lease.fence
    store.mark_box("a", up=False, error="probe failed")
    keys = ("name", "address", "tls_dir", "state", "last_error", "cert_sha256", "lent")
    for row in store.boxes():
        assert {k: store.box(row["name"])[k] for k in keys} == {k: row[k] for k in keys}
    assert store.box("a")["state"] is BoxState.DOWN and store.box("b")["lent"] == 1
    store.delete_lease(lease.id)
    assert store.lease(lease.id) is None
    with pytest.raises(StoreError, match="no box named 'zz'"):
        store.box("zz")


def test_concurrent_processes_never_share_a_device(pool):
    """Four processes take 500 devices each, one at a time, from 2000 at once: every
    allocation succeeds (no 'database is locked', no lost race), and no device is handed
    out twice."""
    s = pool.open()
    for b in range(4):
        s.register_box(f"box{b}", f"198.18.{b}.2:7000", None, inventory(500))
    ctx = multiprocessing.get_context("spawn")
    out, go = ctx.Queue(), ctx.Event()
    workers = [ctx.Process(target=_grab, args=(pool, f"vm{i}", 500, out, go)) for i in range(4)]
    for w in workers:
        w.start()
    go.set()  # all at once
    results = [out.get(timeout=120) for _ in workers]
    for w in workers:
        w.join(30)
        assert w.exitcode == 0
    taken = [d for r in results for d in r]
    assert [len(r) for r in results] == [500] * 4
    assert len(set(taken)) == 2000
    assert sum(b["lent"] for b in s.boxes()) == 2000
    with pytest.raises(NoFreeDevice):
        s.allocate("vm9")
    s.close()


def test_lease_and_box_states_are_the_enums_and_the_strings_shown(store):
    [lease] = store.allocate("vm1", device="a/d0")
    store.update_lease(lease.id, state="attached")
    [lease] = store.leases("vm1")
    assert lease.state is LeaseState.ATTACHED and json.dumps(lease.state) == '"attached"'
    assert store.mark_box("b", up=False) is BoxState.UP and store.box("b")["state"] is BoxState.DOWN
    assert [b["state"] for b in json.loads(json.dumps(store.boxes()))] == ["up", "down"]
    with pytest.raises(ValueError, match="'plugged' is not a valid LeaseState"):
        store.update_lease(lease.id, state="plugged")
    if store.kind == "sqlite":  # and the database itself refuses other strings
        assert_states_checked(store.path, lease.id)


def test_every_new_lease_gets_a_larger_fencing_token(store):
    [first] = store.allocate("vm1", device="a/d0", host="h1")
    store.delete_lease(first.id)
    [second] = store.allocate("vm2", device="a/d0", host="h2")
    assert second.fence > first.fence  # the box refuses the first lease's token once it saw the second
    assert len(store.pool_id) == 32  # the scope fences compare in (tests/test_fencing.py: one per pool)
    [listed] = store.leases("vm2")
    assert (listed.fence, listed.host) == (second.fence, "h2")
    store.update_lease(second.id, state=LeaseState.ATTACHED, request="attach", error=None)
    [listed] = store.leases("vm2")
    assert (listed.fence, listed.state, listed.request) == (second.fence, LeaseState.ATTACHED, "attach")


def test_a_fenced_host_loses_its_leases_and_gets_no_device_until_unfenced(store):
    holder = store.host_register("h1", ttl=30, agent_pid=os.getpid())
    assert store.host_keepalive("h1", holder)
    held = store.allocate("vm1", count=2, host="h1")
    assert all(lease.holder == holder for lease in held)
    other = store.allocate("vm2", host="h2")
    [h1] = [h for h in store.hosts() if h["name"] == "h1"]
    assert h1["alive"] and not h1["fenced"] and h1["leases"] == 2
    taken = store.fence_host("h1")
    assert sorted(lease.id for lease in taken) == sorted(lease.id for lease in held)
    assert [lease.id for lease in store.leases()] == [other[0].id]  # h2 keeps its device
    assert not store.host_keepalive("h1", holder)  # its agent's heartbeat is void
    [h1] = [h for h in store.hosts() if h["name"] == "h1"]
    assert h1["fenced"] and not h1["alive"] and h1["leases"] == 0
    with pytest.raises(StoreError, match="host h1 is fenced") as err:
        store.allocate("vm1", host="h1")
    assert "dxpu host unfence h1" in err.value.hint
    with pytest.raises(StoreError, match="fenced"):
        store.host_register("h1", ttl=30, agent_pid=os.getpid())
    assert {lease.device for lease in store.allocate("vm3", count=2, host="h3")} == {
        lease.device for lease in held}  # its devices went back to the pool
    store.unfence_host("h1")
    with pytest.raises(StoreError, match="not fenced"):
        store.unfence_host("h1")
    store.allocate("vm1", host="h1")


def test_metrics_are_valid_prometheus_text(store):
    from prometheus_client.parser import text_string_to_metric_families
    [lease] = store.allocate("vm1", device="b/n0")
    store.update_lease(lease.id, state="attached")
    stats = {lease.id: {"server": {"commands": {"REGION_READ": {"count": 7}}},
                        "device": {"reads": 7, "dma_bytes_read": 4096, "link": {"up": True}}}}
    families = {f.name: f for f in text_string_to_metric_families(render(store, stats))}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    base = (("device", "b/n0"), ("lease", lease.id), ("vm", "vm1"))
    assert samples[("dxpu_device_messages_total", tuple(sorted(base + (("command", "REGION_READ"),))))] == 7
    assert samples[("dxpu_device_dma_bytes_total", tuple(sorted(base + (("direction", "read"),))))] == 4096
    assert samples[("dxpu_device_link_up", base)] == 1
    assert samples[("dxpu_lease_info", tuple(sorted(base + (("state", "attached"),))))] == 1
    assert families["dxpu_device_messages"].type == "counter" and families["dxpu_box_up"].type == "gauge"
    assert samples[("dxpu_box_up", (("box", "a"),))] == 1
    assert samples[("dxpu_devices", (("box", "b"), ("class", "nvme"), ("state", "leased")))] == 1
    assert samples[("dxpu_devices", (("box", "a"), ("class", "testdev"), ("state", "free")))] == 3


def test_a_newer_schema_is_refused(pool):
    pool.open().close()
    if pool.kind == "sqlite":
        db = sqlite3.connect(pool.path)
        db.execute("PRAGMA user_version = 99")
        db.commit()
        db.close()
    else:
        s = pool.open()
        s.etcd.txn([], [op_put(s.k("schema"), 99)])
        s.close()
    with pytest.raises(StoreError, match="schema version 99"):
        pool.open()


# --- SQLite only: its schema, its constraints, its file --------------------------------
def test_migrates_a_version_1_database_keeping_its_leases(tmp_path):
    path = tmp_path / "v1.db"
    db = sqlite3.connect(path)
    db.executescript(store_mod.MIGRATIONS[0] + "PRAGMA user_version = 1;")
    db.execute("INSERT INTO boxes VALUES ('a', 'x:1', NULL, 'up', 0, 0, NULL)")
    for i in range(2):
        db.execute(f"INSERT INTO devices VALUES ('a/d{i}', 'a', 'd{i}', 'testdev', '1b36', '10f0', 1, 't')")
    db.execute("INSERT INTO leases (id, device, vm, state, qdev_id, created_at, updated_at) "
               "VALUES ('l1', 'a/d0', 'vm1', 'attached', 'pool-l1', 0, 0)")
    db.commit()
    db.close()
    s = Store(path)
    assert s.schema_version == store_mod.SCHEMA_VERSION == 5
    assert s.boxes()[0]["lent"] == 1
    [old] = s.leases("vm1")
    assert (old.host, old.fence) == (None, None)  # a lease from before hosts and fencing
    assert {s.device(f"a/d{i}")["token"] for i in range(2)} == {""}  # static tokens an old version kept: gone
    [new] = s.allocate("vm2")
    assert new.device == "a/d1" and new.fence == 1
    with pytest.raises(NoFreeDevice):
        s.allocate("vm3")
    s.close()
    assert_states_checked(path, "l1")


def assert_states_checked(path, lease_id: str) -> None:
    """The database takes every state the code names and refuses any other."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        for state in LeaseState:
            db.execute("UPDATE leases SET state = ? WHERE id = ?", (state, lease_id))
        for state in BoxState:
            db.execute("UPDATE boxes SET state = ?", (state,))
        with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
            db.execute("UPDATE leases SET state = 'plugged' WHERE id = ?", (lease_id,))
        with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
            db.execute("UPDATE boxes SET state = 'sleeping'")
    finally:
        db.close()


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs (we run as root): a real full disk."""
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_full_disk_fails_cleanly_and_loses_nothing(tiny_disk):
    s = Store(tiny_disk / "pool.db")
    s.register_box("a", "x:1", None, inventory(40))
    first = s.allocate("vm1", count=2)
    filler = tiny_disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:  # fill the disk to the last block
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.ftruncate(fd, max(0, os.fstat(fd).st_size - (128 << 10)))  # room for a few writes
        os.close(fd)
    registered = []
    with pytest.raises(StoreError, match="nothing was changed"):
        for k in range(200):  # each box adds ~20 KB until a write finds no space
            s.register_box(f"big{k}", "x:1", None, [{**inventory(1)[0], "lease": "x" * 20000}])
            registered.append(f"big{k}")
    assert registered, "the disk was full before the first registration"
    assert [b["name"] for b in s.boxes()] == sorted(["a", *registered])  # the failed one left nothing
    filler.unlink()
    assert sorted(lease.id for lease in s.leases()) == sorted(lease.id for lease in first)
    assert len(s.allocate("vm1", count=2)) == 2
    s.close()
