"""A lab with its own etcd cluster (``etcd = 3``, ``dxpu lab up --etcd 3``): three real etcd
members in the host namespace, data under the lab's directory; each box announces itself
there over its link (no ``dxpu box add``). No VM: what is tested is the lab's pool."""

import os
import signal
import time

import pytest

from dxpu_vfio.lab import lab
from dxpu_vfio.namespaces import in_netns
from dxpu_vfio.pool.etcd_store import EtcdStore
from dxpu_vfio.pool.states import BoxState
from dxpu_vfio.procs import pid_alive
from dxpu_vfio.testing import eventually

TTL = 3.0  # the lab's box lease


@pytest.fixture
def etcd_lab():
    topology = lab.Topology(f"et{os.getpid() % 10000}", [
        lab.BoxSpec("box1", [{"id": "td0", "model": "testdev"}]),
        lab.BoxSpec("box2", [{"id": "td0", "model": "testdev"}, {"id": "td1", "model": "testdev"}])], etcd=3)
    state = lab.up(topology)
    yield state
    lab.down(topology.name)


def test_the_lab_runs_three_etcd_members_its_boxes_announce_themselves_and_down_removes_them(etcd_lab):
    state = etcd_lab
    assert len(state.etcd_pids) == 3 and all(pid_alive(p) for p in state.etcd_pids)
    box_toml = open(state.box("box2").config).read()
    assert "[pool]" in box_toml and f"http://{state.box('box2').host_ip}:{state.etcd_ports[0]}" in box_toml

    def ask(what):  # from the host namespace, as a host agent there would
        def call():
            store = EtcdStore(state.etcd_endpoints)
            try:
                return what(store)
            finally:
                store.close()
        return in_netns(state.host_netns, call)

    def up_boxes(store) -> dict:
        return {b["name"]: b["devices"] for b in store.boxes() if b["state"] == BoxState.UP}

    eventually(lambda: ask(up_boxes) == {"box1": 1, "box2": 2}, timeout=10, what="both boxes announced")

    os.kill(state.etcd_pids[0], signal.SIGKILL)  # one member crashes: two of three keep the quorum
    os.waitpid(state.etcd_pids[0], 0)  # lab.up ran here: the member was our child
    time.sleep(2 * TTL)  # the boxes' leases must have been renewed through the other members meanwhile
    assert ask(up_boxes) == {"box1": 1, "box2": 2}
    [held] = ask(lambda store: store.allocate("qmp:/run/vm1.qmp", box="box2", host="h1"))
    assert held.device.startswith("box2/")

    os.kill(state.box("box1").proxy_pid, signal.SIGKILL)  # a box dies: gone by its lease's expiry
    killed = time.monotonic()
    eventually(lambda: "box1" not in ask(up_boxes), timeout=3 * TTL, what="box1 down", interval=0.2)
    assert time.monotonic() - killed < 2 * TTL + 1  # within two lease TTLs (+ the poll)

    etcd_dir = os.path.join(state.directory, "etcd")
    assert os.path.isdir(etcd_dir)
    lab.down(state.name)
    assert not any(pid_alive(p) for p in state.etcd_pids) and not os.path.exists(etcd_dir)
