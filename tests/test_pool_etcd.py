"""The etcd store on a three-member cluster of its own: members die, the whole cluster
dies, and two allocators that talk to different members never share a device; and
managers (``dxpu manager serve --store etcd``) of two hosts serving one pool."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import time

import pytest

from dxpu_vfio.pool.etcd_cluster import EtcdCluster, free_port, make_etcd_certs
from dxpu_vfio.pool.etcd_client import EtcdUnavailable
from dxpu_vfio.pool.etcd_store import EtcdStore
from dxpu_vfio.pool.service import ManagerClient, ManagerProcess
from dxpu_vfio.pool.storage import NoFreeDevice
from dxpu_vfio.procs import wait_until


def inventory(n: int) -> list[dict]:
    return [{"id": f"d{i}", "class": "testdev", "vendor": "1b36", "model": "10f0", "capacity": 1, "lease": f"t{i}"}
            for i in range(n)]


def _grab_all(endpoints: list[str], name: str, out, ready, go) -> None:
    """Take two devices at a time (spread) until the pool has none left."""
    s = EtcdStore(endpoints, path="/nonexistent/pool.db", prefix="/race/v1/")
    ready.release()
    go.wait(60)
    taken = []
    try:
        while True:
            taken += [lease.device for lease in s.allocate(name, count=2, policy="spread")]
    except NoFreeDevice:
        pass
    out.put(taken)


def test_two_allocators_on_different_members_never_share_a_device(etcd3):
    s = EtcdStore(etcd3.endpoints, path="/nonexistent/pool.db", prefix="/race/v1/")
    for b in range(6):
        s.register_box(f"box{b}", f"198.18.{b}.2:7000", None, inventory(20))
    ctx = multiprocessing.get_context("spawn")
    out, ready, go = ctx.Queue(), ctx.Semaphore(0), ctx.Event()
    workers = [ctx.Process(target=_grab_all, args=([url], f"host{i}", out, ready, go))
               for i, url in enumerate(etcd3.endpoints[:2])]  # each host talks to its own member
    for w in workers:
        w.start()
    for _ in workers:  # both connected before either starts (a spawn can take seconds under load)
        assert ready.acquire(timeout=60), "an allocator process did not start"
    go.set()
    results = [out.get(timeout=120) for _ in workers]
    for w in workers:
        w.join(30)
        assert w.exitcode == 0
    taken = [d for r in results for d in r]
    assert all(results), "one allocator got nothing: no race was tested"
    assert len(taken) == len(set(taken)) == 120
    assert len(s.leases()) == 120 and not any(d["available"] for d in s.devices())


def test_the_pool_works_on_after_its_leader_is_killed(etcd3):
    s = EtcdStore(etcd3.endpoints, path="/nonexistent/pool.db", prefix="/kill/v1/")
    s.register_box("a", "198.18.1.2:7000", None, inventory(4))
    [first] = s.allocate("vm1")
    leader = etcd3.leader()
    etcd3.kill(leader)
    start = time.monotonic()
    [second] = s.allocate("vm1")  # waits out the election, or fails over to a live member
    assert time.monotonic() - start < 5.0
    assert {lease.device for lease in s.leases("vm1")} == {first.device, second.device}
    etcd3.restart(leader)
    s.delete_lease(first.id)
    assert [d["id"] for d in s.devices() if d["available"]] == ["a/d0", "a/d2", "a/d3"]


def test_etcd_down_is_a_clear_error_and_the_pool_is_back_with_it(etcd3):
    s = EtcdStore(etcd3.endpoints, path="/nonexistent/pool.db", prefix="/down/v1/", retry_for=1.0)
    s.register_box("a", "198.18.1.2:7000", None, inventory(2))
    [held] = s.allocate("vm1")
    for i in range(3):
        etcd3.kill(i)
    start = time.monotonic()
    with pytest.raises(EtcdUnavailable) as err:
        s.allocate("vm2")
    assert time.monotonic() - start < 10.0
    for url in etcd3.endpoints:
        assert url in err.value.message
    assert "endpoint health" in err.value.hint
    for i in range(3):
        etcd3.start_member(etcd3.members[i], state="existing")
    etcd3.wait_healthy()
    assert [lease.id for lease in s.leases()] == [held.id]  # nothing was lost, nothing half done
    assert [lease.device for lease in s.allocate("vm2")] == ["a/d1"]


def _dxpu(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dxpu_vfio.cli", *args], capture_output=True, text=True, timeout=60)


def test_two_managers_on_one_etcd_serve_one_pool(etcd, tmp_path):
    """Two hosts' managers (their own sockets and logs) over the same etcd see the same
    boxes, devices and leases; SQLite stays what a manager uses unless told otherwise."""
    hosts = [tmp_path / f"host{i}" / "pool.db" for i in range(2)]
    # the box is a name only (nothing answers at its address): dead_after long enough that
    # no heartbeat marks it down (its devices unavailable) while the test looks
    managers = [ManagerProcess(db, etcd_endpoints=etcd.endpoints, dead_after=600).start() for db in hosts]
    try:
        s = EtcdStore(etcd.endpoints, path=tmp_path / "admin.db")  # the manager's default prefix
        s.register_box("shared", "198.18.9.2:7000", None, inventory(2))
        [lease] = s.allocate("qmp:/run/vm-on-host0.sock", device="shared/d1")
        for db in hosts:
            assert ManagerClient(db).get("/v1/health")["store"] == "etcd"
            listing = json.loads(_dxpu("ls", "--db", str(db), "--json").stdout)
            assert [b["name"] for b in listing["boxes"]] == ["shared"]
            assert [(d["id"], d["available"]) for d in listing["devices"]] == [("shared/d0", True), ("shared/d1", False)]
            assert [(le["lease"], le["vm"]) for le in listing["leases"]] == [(lease.id, lease.vm)]
        s.delete_lease(lease.id)
        s.remove_box("shared")
        s.close()
    finally:
        for m in managers:
            m.stop()
    sqlite_manager = ManagerProcess(tmp_path / "single" / "pool.db").start()
    try:
        assert ManagerClient(tmp_path / "single" / "pool.db").get("/v1/health")["store"] == "sqlite"
    finally:
        sqlite_manager.stop()


def test_a_manager_pointed_at_no_etcd_says_where_it_looked(tmp_path):
    proc = _dxpu("manager", "serve", "--db", str(tmp_path / "pool.db"), "--store", "etcd",
                 "--etcd-endpoints", f"127.0.0.1:{free_port()}")
    assert proc.returncode != 0
    assert "etcd does not answer at http://127.0.0.1:" in proc.stderr and "endpoint health" in proc.stderr
    proc = _dxpu("manager", "serve", "--db", str(tmp_path / "pool.db"), "--store", "etcd")
    assert proc.returncode != 0 and "--etcd-endpoints" in proc.stderr


def test_a_handle_learns_box_changes_from_its_watch(etcd, etcd_prefix):
    """Another host marks a box down: the watch brings it to this handle's view, so its
    next allocation goes to the other box without losing a race for the down one."""
    mine, theirs = (EtcdStore(etcd.endpoints, path="/nonexistent/pool.db", prefix=etcd_prefix) for _ in range(2))
    for name in ("a", "b"):
        mine.register_box(name, "198.18.1.2:7000", None, inventory(4))
    assert [lease.device for lease in mine.allocate("vm0")] == ["a/d0"]  # reads the view, starts the watches
    theirs.mark_box("a", up=False, error="no answer")

    def a_down() -> bool:  # what the watch delivered, applied as the next allocation applies it
        with mine._lock:
            mine._drain()
            return not mine._view.lends("a")
    assert wait_until(a_down, 5.0), "the watch told nothing"
    assert [lease.device for lease in mine.allocate("vm0")] == ["b/d0"] and mine.conflicts == 0
    mine.close()
    theirs.close()


def test_a_handle_learns_other_allocations_from_a_lost_race_and_leaves_that_box(etcd, etcd_prefix):
    """Claims are not watched (every allocation writes one): a handle learns another's
    from the race it loses, wins the next try, and leaves the box to the allocator
    filling it; a device another handle freed is found when nothing else is free."""
    mine, theirs = (EtcdStore(etcd.endpoints, path="/nonexistent/pool.db", prefix=etcd_prefix) for _ in range(2))
    for name in ("a", "b"):
        mine.register_box(name, "198.18.1.2:7000", None, inventory(4))
    assert [lease.device for lease in mine.allocate("vm0")] == ["a/d0"]
    taken = [lease.device for lease in theirs.allocate("vm1", count=2)]
    assert taken == ["a/d1", "a/d2"]
    [lease] = mine.allocate("vm0")  # pack: a/d1 in its view, taken: one lost race
    assert mine.conflicts == 1 and lease.box == "b", "it raced the other allocator for its box"
    assert mine._view.claims["a"].keys() == {"d0", "d1", "d2"}, "the lost race told it a's claims"
    rest = [lease.device for _ in range(4) for lease in mine.allocate("vm0")]
    assert sorted(rest) == sorted({"a/d3", "b/d0", "b/d1", "b/d2", "b/d3"} - {lease.device})
    assert mine.conflicts == 1
    theirs_lease = theirs.lease_for("vm1", "a/d1")
    theirs.delete_lease(theirs_lease.id)  # mine's view still has it claimed
    [again] = mine.allocate("vm0")  # nothing free in its view: it reads everything once more
    assert again.device == "a/d1"
    with pytest.raises(NoFreeDevice):
        mine.allocate("vm0")
    mine.close()
    theirs.close()


def test_etcd_over_https_with_client_certificates(tmp_path, monkeypatch):
    """--client-cert-auth: the store presents the host certificate of --etcd-tls-dir and
    trusts only its CA, whatever REQUESTS_CA_BUNDLE says; without a certificate it is
    refused with the endpoint named."""
    certs = make_etcd_certs(tmp_path / "certs")
    assert not (certs / "ca.key").exists()  # the dir hosts get holds no CA key
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(tmp_path / "no-such-bundle.pem"))  # must not matter
    with EtcdCluster(tmp_path / "etcd", tls_dir=certs) as cluster:
        [url] = cluster.endpoints
        assert url.startswith("https://127.0.0.1:")
        s = EtcdStore([url], path=tmp_path / "pool.db", tls_dir=str(certs))
        s.register_box("a", "198.18.1.2:7000", None, inventory(1))
        assert [lease.device for lease in s.allocate("vm1")] == ["a/d0"]
        s.close()
        with pytest.raises(EtcdUnavailable, match=url):
            EtcdStore([url], path=tmp_path / "pool.db", retry_for=0.5)  # no CA: the server is not trusted
