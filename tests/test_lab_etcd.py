"""A lab for a shared pool: its own etcd cluster (``etcd = 3``, ``dxpu lab up --etcd 3``:
three real etcd members in the host namespace, data under the lab's directory; each box
announces itself there over its link, no ``dxpu box add``) and several host namespaces
(``hosts = 2``: the second reaches every box through the first, sharing each box's link).
The first test has no VM; the second plugs a box's device into a real guest from host 2."""

import os
import signal
import socket
import time

import pytest

from dxpu_vfio.lab import hotplug, lab
from dxpu_vfio.namespaces import in_netns
from dxpu_vfio.pool.boxes import fetch_inventory
from dxpu_vfio.pool.etcd_store import EtcdStore
from dxpu_vfio.pool.states import BoxState
from dxpu_vfio.procs import pid_alive
from dxpu_vfio.testing import eventually

TTL = 3.0  # the lab's box lease


def topology(etcd: int = 3) -> lab.Topology:
    return lab.Topology("pl", [lab.BoxSpec("box1", [{"id": "td0", "model": "testdev"}]),
                               lab.BoxSpec("box2", [{"id": "td0", "model": "testdev"},
                                                    {"id": "td1", "model": "testdev"}])], etcd=etcd, hosts=2)


def connect_ms(netns: str, address: str) -> float:
    """A TCP handshake from ``netns`` to ``address`` (one round trip), in ms."""
    host, port = address.rsplit(":", 1)

    def connect() -> float:
        started = time.perf_counter()
        with socket.create_connection((host, int(port)), timeout=5):
            return (time.perf_counter() - started) * 1000
    return in_netns(netns, connect)


def test_the_lab_runs_etcd_and_two_hosts_its_boxes_announce_themselves_and_down_removes_it(labs):
    state = labs.own(topology())
    host2 = state.extra_hosts[0]
    assert state.hosts == [state.host_netns, host2]
    assert len(state.etcd_pids) == 3 and all(pid_alive(p) for p in state.etcd_pids)
    box_toml = open(state.box("box2").config).read()
    assert "[pool]" in box_toml and f"http://{state.box('box2').host_ip}:{state.etcd_ports[0]}" in box_toml

    def ask(what, netns: str = state.host_netns):  # as a host agent in that namespace would
        def call():
            store = EtcdStore(state.etcd_endpoints_of_host(netns))
            try:
                return what(store)
            finally:
                store.close()
        return in_netns(netns, call)

    def up_boxes(store) -> dict:
        return {b["name"]: b["devices"] for b in store.boxes() if b["state"] == BoxState.UP}

    eventually(lambda: ask(up_boxes) == {"box1": 1, "box2": 2}, timeout=10, what="both boxes announced")
    assert ask(up_boxes, host2) == {"box1": 1, "box2": 2}  # host 2 reaches the pool through host 1
    inventory = in_netns(host2, lambda: fetch_inventory(state.box("box2").endpoint, str(state.certs)))
    assert [d["id"] for d in inventory["devices"]] == ["td0", "td1"]  # and the box itself, over TLS

    clean = min(connect_ms(host2, state.box("box1").endpoint) for _ in range(5))
    lab.set_delay(state, "box1", 2000)  # 2 ms each way on box1's link: host 2 shares that wire
    try:
        delayed = min(connect_ms(host2, state.box("box1").endpoint) for _ in range(5))
        assert delayed > clean + 3.5, (clean, delayed)
        assert min(connect_ms(host2, state.box("box2").endpoint) for _ in range(5)) < delayed - 3.5
    finally:
        lab.set_delay(state, "box1", 0)

    os.kill(state.etcd_pids[0], signal.SIGKILL)  # one member crashes: two of three keep the quorum
    os.waitpid(state.etcd_pids[0], 0)  # lab.up ran here: the member was our child
    time.sleep(2 * TTL)  # the boxes' leases must have been renewed through the other members meanwhile
    assert ask(up_boxes) == {"box1": 1, "box2": 2}
    [held] = ask(lambda store: store.allocate("qmp:/run/vm1.qmp", box="box2", host="h2"), host2)
    assert held.device.startswith("box2/")

    os.kill(state.box("box1").proxy_pid, signal.SIGKILL)  # a box dies: gone by its lease's expiry
    killed = time.monotonic()
    eventually(lambda: "box1" not in ask(up_boxes), timeout=3 * TTL, what="box1 down", interval=0.2)
    assert time.monotonic() - killed < 2 * TTL + 1  # within two lease TTLs (+ the poll)

    etcd_dir = os.path.join(state.directory, "etcd")
    assert os.path.isdir(etcd_dir)
    lab.down(state.name)
    assert not any(pid_alive(p) for p in state.etcd_pids) and not os.path.exists(etcd_dir)
    assert not any(ns in state.hosts for ns in os.listdir("/run/netns"))


@pytest.mark.vm
def test_a_guest_gets_a_box_device_through_the_second_host(labs, shared_tiny_vm):
    """Host proxies run in host 2's namespace; their link to the box goes through host 1
    (masqueraded as its end of the box's link): the guest's driver sees the device and
    its registers, and the box counts the link."""
    state = labs.own(topology(etcd=0))
    host2 = state.extra_hosts[0]
    att = hotplug.attach(shared_tiny_vm, "remote", settings=state.remote_settings("box2", "td1"), netns=host2)
    try:
        vendor = shared_tiny_vm.run(f"cat /sys/bus/pci/devices/{att.guest_bdf}/vendor").stdout.strip()
        assert vendor == "0x1b36"
        stats = att.server.stats()["device"]
        assert stats["link"]["up"] and stats["reads"] > 0  # config reads crossed host 2's path
    finally:
        hotplug.detach(att)
