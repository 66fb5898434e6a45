"""Boxes that announce themselves (issue 15, item 2): a remote proxy process with
``[pool]`` in its config publishes its inventory under a box lease in a real etcd (the
session's member, a key prefix of this test); SIGKILLed, its devices stop being
allocatable within 2 lease TTLs and the attached one is reported down; restarted, it is
back (a changed inventory with a new generation); stopped cleanly, it is down at once.
No ``dxpu box add`` anywhere. SQLite refuses announcements and keeps ``dxpu box add``."""

import json
import os
import signal
import time
from pathlib import Path

import pytest

from dxpu_vfio.link.transport import make_certs
from dxpu_vfio.pool.etcd_store import EtcdStore
from dxpu_vfio.pool.manager import Manager
from dxpu_vfio.pool.states import BoxState, LeaseState
from dxpu_vfio.pool.storage import NoFreeDevice, StoreError, box_announcements
from dxpu_vfio.pool.store import Store
from dxpu_vfio.remoteproxy.announce import inventory_generation
from dxpu_vfio.remoteproxy.config import BoxConfig
from dxpu_vfio.remoteproxy.process import RemoteProxyProcess
from dxpu_vfio.testing import eventually

BOX = f"ann{os.getpid()}"
TTL = 2.0


def box_config(path: Path, certs: Path, endpoints: list[str], prefix: str, devices: list[str]) -> Path:
    lines = [f'name = "{BOX}"', 'listen = "127.0.0.1"', "port = 0", f'tls_dir = "{certs}"', "",
             "[pool]", 'store = "etcd"', f"etcd_endpoints = {json.dumps(endpoints)}", f'prefix = "{prefix}"',
             f"ttl = {TTL}", ""]
    for dev in devices:
        lines += ["[[device]]", f'id = "{dev}"', 'model = "testdev"', "settings = { memory_size = 1048576 }", ""]
    path.write_text("\n".join(lines))
    return path


@pytest.fixture
def certs(tmp_path):
    make_certs(tmp_path / "certs", ["host", BOX])
    return tmp_path / "certs"


def test_a_box_announces_itself_dies_by_lease_expiry_and_comes_back(etcd, etcd_prefix, certs, tmp_path):
    store = EtcdStore(etcd.endpoints, path=tmp_path / "pool.db", prefix=etcd_prefix)
    config = box_config(tmp_path / "box.toml", certs, etcd.endpoints, etcd_prefix, ["td0", "td1"])
    box = RemoteProxyProcess(config).start()
    try:
        [announced] = store.boxes()  # published before the box said "serving"
        assert (announced["name"], announced["state"], announced["devices"]) == (BOX, BoxState.UP, 2)
        assert announced["generation"] and announced["tls_dir"] == str(certs) and announced["cert_sha256"]
        stats = box.stats()
        assert stats["announce"]["generation"] == announced["generation"] and stats["announce"]["lease"]
        # what the pool took from the announcement is enough to talk to the box (mutual TLS, same certificate)
        manager = Manager(store, open_vm=None, host="h1")
        assert manager.heartbeat() == []
        [held] = store.allocate("qmp:/run/vm1.qmp", device="td0", host="h1")
        store.update_lease(held.id, state=LeaseState.ATTACHED)

        box.signal(signal.SIGKILL)
        killed = time.monotonic()
        eventually(lambda: store.boxes()[0]["state"] == BoxState.DOWN, timeout=3 * TTL,
                   what="the box down by its lease's expiry", interval=0.05)
        assert time.monotonic() - killed < 2 * TTL
        with pytest.raises(NoFreeDevice):
            store.allocate("qmp:/run/vm2.qmp", host="h1")  # td1 is free but its box is gone
        assert not any(d["available"] for d in store.devices())
        [down] = store.boxes()
        assert "box lease expired" in down["last_error"]
        [attached] = manager.listing()["leases"]
        assert attached["lease"] == held.id and attached["box_state"] == BoxState.DOWN  # reported down, kept
        assert manager.heartbeat() == []  # the heartbeat does not bring an announced box back by itself

        box_config(config, certs, etcd.endpoints, etcd_prefix, ["td0", "td1", "td2"])
        box = RemoteProxyProcess(config).start()
        [back] = store.boxes()
        assert back["state"] == BoxState.UP and back["devices"] == 3 and back["leased"] == 1
        assert back["generation"] != announced["generation"]  # the inventory changed, so did the generation
        got = {lease.device for lease in store.allocate("qmp:/run/vm2.qmp", count=2, host="h1")}
        assert got == {f"{BOX}/td1", f"{BOX}/td2"}
        assert store.device(held.device)["box_state"] == BoxState.UP

        box.stop()  # a clean stop revokes the box lease: down at once, not a TTL later
        assert store.boxes()[0]["state"] == BoxState.DOWN
    finally:
        box.stop()
        store.close()


def test_the_generation_follows_the_inventory_only():
    devices = [{"id": "td0", "class": "testdev", "vendor": "1b36", "model": "0005", "capacity": 4096, "in_use": False}]
    same = [{**devices[0], "in_use": True}]
    assert inventory_generation(devices) == inventory_generation(same)  # a link taking it is no inventory change
    assert inventory_generation(devices) != inventory_generation([{**devices[0], "capacity": 8192}])


def test_a_sqlite_pool_takes_no_announcements_and_box_configs_say_what_is_wrong(tmp_path):
    with pytest.raises(StoreError) as caught:
        box_announcements(Store(tmp_path / "pool.db"))
    assert "dxpu box add" in caught.value.hint
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "b"\nplaintext = true\n[pool]\nstore = "sqlite"\netcd_endpoints = "x"\n')
    with pytest.raises(ValueError, match="only an etcd pool"):
        BoxConfig.load(bad)
    bad.write_text('name = "b"\nplaintext = true\n[pool]\n')
    with pytest.raises(ValueError, match="etcd_endpoints"):
        BoxConfig.load(bad)
    good = tmp_path / "good.toml"
    good.write_text('name = "b"\nplaintext = true\n[pool]\netcd_endpoints = "10.0.0.1:2379, 10.0.0.2:2379"\nttl = 4\n')
    pool = BoxConfig.load(good).pool
    assert pool.etcd_endpoints == ["10.0.0.1:2379", "10.0.0.2:2379"] and pool.ttl == 4.0
