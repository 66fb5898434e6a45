"""A lab for a shared pool: its own etcd cluster (``etcd = 3``, ``dxpu lab up --etcd 3``:
three real etcd members in the host namespace, data under the lab's directory; each box
announces itself there over its link, no ``dxpu box add``) and several host namespaces
(``hosts = 2``: the second reaches every box through the first, sharing each box's link).
The first test has no VM; the second plugs a box's device into a real guest from host 2;
the third runs a VM and an agent on each host."""

import os
import signal
import socket
import threading
import time

import pytest

from dxpu_vfio.lab import hotplug, lab
from dxpu_vfio.lab.hotplug import guest_wait_for_child, port_bdf
from dxpu_vfio.namespaces import in_netns
from dxpu_vfio.pool.boxes import fetch_inventory
from dxpu_vfio.pool.etcd_client import EtcdUnavailable
from dxpu_vfio.pool.etcd_store import EtcdStore
from dxpu_vfio.pool.manager import Manager, proxy_alive, stop_proxy
from dxpu_vfio.pool.service import AgentProcess
from dxpu_vfio.pool.states import BoxState
from dxpu_vfio.procs import pid_alive
from dxpu_vfio.testing import eventually
from dxpu_vfio.vmm.errors import VmGone

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


@pytest.mark.vm
def test_each_lab_host_runs_a_vm_and_its_agent_and_they_share_the_boxes_never_a_device(labs, vm_factory, tmp_path):
    """Issue 15 item 6: host 1 and host 2 each run a tiny VM and their own agent (in their
    namespace, on the lab's etcd, which the boxes announced themselves in). A central
    manager asks for two of box2's devices at once, one per host: each agent plugs its VM,
    each guest reads its testdev's registers over the host proxy its agent started in its
    namespace, the two leases never name the same device; with the whole etcd down the
    guests' devices work on and the pool names the endpoints it tried, and when etcd is
    back a detach from the centre is done by each agent."""
    state = labs.own(topology())
    vms = {"h1": vm_factory.booted("tiny"), "h2": vm_factory.booted("tiny")}
    namespaces = {"h1": state.host_netns, "h2": state.extra_hosts[0]}
    # each host's agent in its namespace, as an admin runs it there (its host proxies start
    # there too); ended by pid at the end
    agents = [AgentProcess(h, tmp_path / f"agent-{h}.log", db=tmp_path / f"{h}.db", ttl=10, log_level="INFO",
                           etcd_endpoints=state.etcd_endpoints_of_host(namespaces[h]), netns=namespaces[h]).start()
              for h in vms]

    def central(what):  # a manager in host 1's namespace, for VMs of other hosts only
        def call():
            def nowhere(name):
                raise VmGone(f"{name} is not a VM of the central host")
            store = EtcdStore(state.etcd_endpoints)
            try:
                return what(Manager(store, open_vm=nowhere, host="central"))
            finally:
                store.close()
        return in_netns(state.host_netns, call)

    try:
        eventually(lambda: sorted(h["name"] for h in central(lambda m: m.hosts()) if h["alive"]) == ["h1", "h2"],
                   timeout=20, what="both agents holding their host leases")
        attached: dict = {}

        def attach(host: str) -> None:
            try:
                [attached[host]] = central(lambda m: m.attach(str(vms[host].admin_qmp_path), box="box2", host=host,
                                                              timeout=60.0))
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                attached[host] = exc
        threads = [threading.Thread(target=attach, args=(h,)) for h in vms]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
        assert sorted(attached) == ["h1", "h2"] and all(isinstance(v, dict) for v in attached.values()), attached
        assert attached["h1"]["device"] != attached["h2"]["device"]  # one transaction each: never shared
        reads: dict[str, str] = {}
        for host, lease in attached.items():
            assert lease["state"] == "attached" and lease["host"] == host
            vm = vms[host]
            bdf = guest_wait_for_child(vm, port_bdf(vm, lease["port"]), True, 30)
            reads[host] = read = f"dxpu-mmio {bdf} enable >/dev/null && dxpu-mmio {bdf} 0 read 0"
            assert vm.run(read).stdout.strip() == "0xd0c50001"  # testdev's ID, from box2 over this host's path
            proxy_ns = os.stat(f"/proc/{lease['proxy_pid']}/ns/net").st_ino
            assert proxy_ns == os.stat(f"/run/netns/{namespaces[host]}").st_ino, f"{host}'s proxy: not in its netns"
        # The whole etcd down (its three members frozen, for less than the agents' host lease):
        # the guests' devices work on, and the pool says where it looked; then it is back.
        for pid in state.etcd_pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            for host, read in reads.items():
                assert vms[host].run(read).stdout.strip() == "0xd0c50001", f"{host}'s device with etcd down"

            def ask_frozen():
                store = EtcdStore(state.etcd_endpoints, timeout=0.3, retry_for=0.5)
                try:
                    return store.leases()
                finally:
                    store.close()
            with pytest.raises(EtcdUnavailable) as down:
                in_netns(state.host_netns, ask_frozen)
            assert all(url in down.value.message for url in state.etcd_endpoints)
        finally:
            for pid in state.etcd_pids:
                os.kill(pid, signal.SIGCONT)
        eventually(lambda: len(central(lambda m: m.store.leases())) == 2, timeout=20, what="the pool back with etcd")
        central(lambda m: [m.detach(str(vms[h].admin_qmp_path), lease["lease"], host=h, timeout=30.0)
                           for h, lease in attached.items()])
        assert central(lambda m: m.store.leases()) == []
    finally:
        for agent in agents:
            agent.stop()  # an agent that stops leaves its host proxies running (its VMs keep their devices)
        for lease in central(lambda m: m.store.leases()):  # what a failed run left attached: ended by pid
            if proxy_alive(lease):
                stop_proxy(lease)
