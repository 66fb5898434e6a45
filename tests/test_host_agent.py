"""The host agent (issue 15, item 3), without a VM: ``attach --host H`` on one manager
results in the agent of H doing the plug, on SQLite and on a real etcd member.

Real: the box (in this process, mutual TLS), the GRANT with the lease's fencing token,
the host proxy process the agent starts and its link to the box. FAKE, on purpose: the
VM. :class:`FakeVm` answers QMP (``qom-list``, ``query-pci``, ``device_add``,
``device_del``) from a table instead of booting a guest, so this tests the state machine
across manager, store and agent and what reaches the box, not what a guest sees (the
QMP path itself is covered by tests/test_pool.py with a real guest)."""

import os
from collections import Counter
from pathlib import Path

import pytest

from dxpu_vfio.link.transport import make_certs
from dxpu_vfio.pool.agent import HostAgent
from dxpu_vfio.pool.manager import AttachError, Manager, proxy_alive
from dxpu_vfio.pool.states import LeaseState
from dxpu_vfio.pool.storage import StoreError
from dxpu_vfio.remoteproxy.config import BoxConfig, BoxDevice
from dxpu_vfio.remoteproxy.proxy import RemoteProxy
from dxpu_vfio.testing import eventually
from dxpu_vfio.vmm.errors import VmGone
from dxpu_vfio.vmm.qmp import QmpError
from dxpu_vfio.vmm.targets import VmTarget

BOX = f"abox{os.getpid()}"
SMALL = {"memory_size": 1 << 20}


class FakeVm(VmTarget):
    """A fake QEMU (see the module docstring): two root ports, devices in a dict."""

    def __init__(self, key: str, sockets: Path) -> None:
        self.key = self.name = key
        self.sockets = sockets
        self.devices: dict[str, tuple[str, str]] = {}  # qdev id -> (root port, socket)
        self.refuse: str | None = None  # device_add answers this error

    def execute(self, command, arguments=None, timeout=30):
        if command == "qom-list":
            return ([{"name": p, "type": "child<pcie-root-port>"} for p in ("rp1", "rp2")]
                    + [{"name": d, "type": "child<vfio-user-pci>"} for d in self.devices])
        if command == "query-pci":
            ports = [{"bus": 0, "slot": i, "qdev_id": p, "class_info": {"class": 0x0604},
                      "pci_bridge": {"bus": {"number": i}, "devices": [
                          {"qdev_id": d, "class_info": {"class": 0x00FF}} for d, (port, _) in self.devices.items()
                          if port == p]}} for i, p in enumerate(("rp1", "rp2"), 1)]
            return [{"bus": 0, "devices": ports}]
        if command == "device_add":
            if self.refuse:
                raise QmpError(self.refuse, command=command, arguments=arguments)
            assert Path(arguments["socket"]["path"]).exists(), "device_add before the host proxy listens"
            self.devices[arguments["id"]] = (arguments["bus"], arguments["socket"]["path"])
            return {}
        raise AssertionError(f"unexpected QMP command {command}")

    def alive(self):
        return True

    def unplug(self, device_id, timeout, *, request=True):
        self.devices.pop(device_id, None)

    def socket_dir(self):
        return self.sockets

    def close(self):
        pass


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("agent") / "certs"
    make_certs(d, ["host", BOX])
    return d


@pytest.fixture
def box(certs):
    proxy = RemoteProxy(BoxConfig(BOX, "127.0.0.1", 0, [BoxDevice("td0", "testdev", settings=SMALL),
                                                        BoxDevice("td1", "testdev", settings=SMALL)],
                                  tls_dir=certs)).start()
    proxy.address = f"127.0.0.1:{proxy.port}"
    yield proxy
    proxy.stop()


@pytest.fixture
def world(stores, box, certs, tmp_path):
    """A central manager (host "central", which has no VMs), host h1's agent and its fake VM."""
    central_store, agent_store = stores
    vm = FakeVm("qmp:" + str((tmp_path / "vm1.qmp").resolve()), tmp_path)

    def nowhere(name):
        raise VmGone(f"{name} is not a VM of this host")

    def h1_vms(name):
        assert name == vm.key
        return vm
    central = Manager(central_store, open_vm=nowhere, host="central")
    central.register_box(None, box.address, str(certs))
    agent = HostAgent(agent_store, "h1", open_vm=h1_vms, ttl=2.0, poll=0.05, plug_timeout=10.0, resync=600).start()
    yield central, agent, vm
    agent.stop()
    for lease in agent_store.leases():  # what a failed test left: end its host proxies
        from dxpu_vfio.pool.manager import stop_proxy
        stop_proxy(lease)


def test_attach_on_one_manager_is_plugged_by_the_hosts_agent_and_detached_by_it(world, box):
    central, agent, vm = world
    [attached] = central.attach(str(Path(vm.key[4:])), device="td0", host="h1", timeout=10.0)
    assert attached["state"] == LeaseState.ATTACHED and attached["host"] == "h1" and attached["port"] == "rp1"
    assert vm.devices == {attached["qdev_id"]: ("rp1", vm.devices[attached["qdev_id"]][1])}
    [lease] = central.store.leases()
    assert lease.request is None and lease.error is None and proxy_alive(lease)  # the agent's host proxy runs
    assert box.slots["td0"].in_use()  # and proved the token granted with the lease's fence
    grant = box.grants.current("td0")
    assert (grant.fence, grant.holder, grant.pool) == (lease.fence, "h1", central.store.pool_id)

    [freed] = central.detach(vm.key, all_devices=True, host="h1", timeout=10.0)
    assert freed["device"] == f"{BOX}/td0" and freed["state"] == "freed"
    assert vm.devices == {} and central.store.leases() == []
    eventually(lambda: not proxy_alive(lease), what="the agent ended the host proxy")
    assert box.grants.current("td0") is None  # the agent revoked the token
    eventually(lambda: not box.slots["td0"].in_use(), what="the box's link released")


def test_the_agent_replugs_its_hosts_device_when_its_box_comes_back(world, box, certs):
    """The box restarts under an attached device: the host proxy's link is down for good
    (QEMU never reconnects a vfio-user device), so the host's agent re-plugs it, with a
    new host proxy and a new grant, on the same lease, once the box answers again."""
    central, agent, vm = world
    [attached] = central.attach(str(Path(vm.key[4:])), device="td0", host="h1", timeout=10.0)
    [before] = central.store.leases()
    box.stop()
    again = RemoteProxy(BoxConfig(BOX, "127.0.0.1", box.port, [BoxDevice("td0", "testdev", settings=SMALL),
                                                              BoxDevice("td1", "testdev", settings=SMALL)],
                                  tls_dir=certs)).start()
    try:
        eventually(lambda: agent.actions["heal"] > 0, timeout=20, what="the agent re-plugged the device",
                   interval=0.1)
        [after] = central.store.leases()
        assert after.id == before.id and after.state == LeaseState.ATTACHED and after.proxy_pid != before.proxy_pid
        assert proxy_alive(after) and not proxy_alive(before)
        assert list(vm.devices) == [attached["qdev_id"]]  # unplugged and plugged again, same id
        eventually(lambda: again.slots["td0"].in_use(), what="the new host proxy's link to the box")
        assert again.grants.current("td0").fence == after.fence  # granted again with the lease's fence
    finally:
        again.stop()


class CountingStore:
    """A store handle whose calls are counted by name (``calls``), to bound what is read."""

    def __init__(self, store) -> None:
        self._store = store
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name):
        value = getattr(self._store, name)
        if not callable(value):
            return value

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return value(*args, **kwargs)
        return counted


def test_a_heal_pass_reads_what_its_host_holds_not_the_pool(stores, box, certs, tmp_path):
    """Every host agent heals every 2 s: a pass reads the boxes its host's attached leases
    are on, one each, and no listing of leases or boxes (at 500 hosts that is an O(pool)
    read per agent per pass). The leases come from the agent's view, kept by the full
    read here. And it still heals: the lease's host proxy is not running, so the first
    pass re-plugs the device, with a new proxy, on the same lease."""
    central_store, agent_store = stores
    vm = FakeVm("qmp:" + str((tmp_path / "vm1.qmp").resolve()), tmp_path)
    Manager(central_store, host="central").register_box(None, box.address, str(certs))
    central_store.register_box("other", "198.18.9.2:7000", None, [
        {"id": "x0", "class": "testdev", "vendor": "1b36", "model": "10f0", "capacity": 1 << 20}])
    [lease] = central_store.allocate(vm.key, device="td0", host="h1")
    central_store.update_lease(lease.id, state=LeaseState.ATTACHED)  # as if its proxy had died
    central_store.allocate("qmp:/elsewhere.qmp", box="other", host="h2")  # another host's: not looked at
    counted = CountingStore(agent_store)
    agent = HostAgent(counted, "h1", open_vm=lambda name: vm, plug_timeout=10.0)
    agent._full_read() if agent.watched else agent.serve_once()
    assert list(agent.attached) == [lease.id]
    counted.calls.clear()
    try:
        healed = []
        for _ in range(3):
            agent._next_heal = 0.0  # due now
            healed += agent._heal_if_due()
        assert [(h["lease"], h["action"]) for h in healed] == [(lease.id, "re-plugged")]
        assert counted.calls["leases"] == counted.calls["leases_at"] == counted.calls["boxes"] == 0, counted.calls
        assert counted.calls["box"] == 3  # its one box, once a pass
        [now] = [x for x in central_store.leases() if x.id == lease.id]
        assert now.state == LeaseState.ATTACHED and proxy_alive(now) and list(vm.devices) == [lease.qdev_id]
        eventually(lambda: box.slots["td0"].in_use(), what="the new host proxy's link to the box")
    finally:
        from dxpu_vfio.pool.manager import stop_proxy
        for held in central_store.leases():
            stop_proxy(held)


def test_the_agents_view_of_attached_leases_follows_its_watch_or_poll(world):
    central, agent, vm = world
    [attached] = central.attach(vm.key, device="td0", host="h1", timeout=10.0)
    eventually(lambda: list(agent.attached) == [attached["lease"]], what="the attached lease in the view")
    assert agent.attached[attached["lease"]].proxy_pid == central.store.leases()[0].proxy_pid
    central.detach(vm.key, all_devices=True, host="h1", timeout=10.0)
    eventually(lambda: agent.attached == {}, what="the detached lease gone from the view")


def test_a_plug_the_agent_cannot_do_is_rolled_back_and_reported(world, box):
    central, agent, vm = world
    vm.refuse = "Bus 'rp1' does not support hotplugging"
    with pytest.raises(AttachError, match="on host h1 failed and was rolled back: .*td0: QEMU refused") as err:
        central.attach(vm.key, device="td0", host="h1", timeout=10.0)
    assert "does not support hotplugging" in err.value.message
    assert central.store.leases() == [] and vm.devices == {}
    assert box.grants.current("td0") is None
    eventually(lambda: not box.slots["td0"].in_use(), what="the failed attach's host proxy gone")
    vm.refuse = None
    [again] = central.attach(vm.key, device="td0", host="h1", timeout=10.0)
    assert again["state"] == LeaseState.ATTACHED


def test_an_agent_restarted_half_way_through_a_plug_clears_what_its_predecessor_left(world, box, stores):
    central, agent, vm = world
    agent._stop.set()  # the agent is down while the request comes
    for thread in agent._threads:
        thread.join()
    [lease] = central.store.allocate(vm.key, device="td0", host="h1", owner_pid=os.getpid())
    vm.devices[lease.qdev_id] = ("rp1", "/nonexistent.sock")  # the device_add a killed agent got to
    central.store.update_lease(lease.id, request="attach", owner_pid=999999999)
    [done] = HostAgent(stores[1], "h1", open_vm=lambda name: vm, plug_timeout=10.0).serve_once()
    assert done["action"] == "attached" and done["port"] == "rp1"
    [now] = central.store.leases()
    assert now.state == LeaseState.ATTACHED and proxy_alive(now)
    assert list(vm.devices) == [lease.qdev_id] and vm.devices[lease.qdev_id][1] == now.socket
    assert box.slots["td0"].in_use()
    from dxpu_vfio.pool.manager import stop_proxy
    stop_proxy(now)


def test_a_dead_agent_keeps_its_devices_until_its_host_is_fenced(world, box):
    central, agent, vm = world
    with pytest.raises(AttachError, match="host h9 has no live agent") as err:
        central.attach(vm.key, device="td0", host="h9")
    assert "dxpu agent serve --host h9" in err.value.hint
    [attached] = central.attach(vm.key, device="td0", host="h1", timeout=10.0)
    [lease] = central.store.leases()
    agent._stop.set()  # the agent dies: no keepalive, no serving (its host proxy, like its VM, runs on)
    for thread in agent._threads:
        thread.join()
    eventually(lambda: not next(h for h in central.hosts() if h["name"] == "h1")["alive"], timeout=6,
               what="h1's host lease run out")
    assert central.reconcile() == [] and [x.id for x in central.store.leases()] == [lease.id]
    assert box.slots["td0"].in_use() and proxy_alive(lease)  # the VM still has its device

    fenced = central.fence_host("h1")
    assert [x["lease"] for x in fenced["leases"]] == [attached["lease"]]
    eventually(lambda: not box.slots["td0"].in_use(), what="the fenced host's link cut by the box")
    with pytest.raises(StoreError, match="host h1 is fenced"):
        HostAgent(central.store, "h1").start()  # a restarted agent of h1 serves nothing
    agent.lost = "fenced"  # (nothing to give back at stop)
    from dxpu_vfio.pool.manager import stop_proxy
    stop_proxy(lease)  # what an admin does on h1 when it comes back


def test_dry_runs_print_the_plan_and_change_nothing(stores, box, certs, tmp_path):
    """--dry-run of attach, detach and reconcile (issue 15, item 5), on the same fake VM."""
    import json

    from dxpu_vfio.cli.pool import _plan_text
    store = stores[0]
    vm = FakeVm("qmp:" + str((tmp_path / "vm1.qmp").resolve()), tmp_path)
    manager = Manager(store, open_vm=lambda name: vm, host="h1")
    manager.register_box(None, box.address, str(certs))

    plan = manager.attach(vm.key, count=2, dry_run=True)
    json.dumps(plan)  # what --json prints
    steps = plan["steps"]
    assert steps[0]["do"] == "store" and f"{BOX}/td0, {BOX}/td1" in steps[0]["what"]
    txn = steps[0]["transaction"]
    if store.kind == "etcd":  # the allocation's one transaction: compare the claims absent, then create them
        assert any(c.startswith("absent(") and c.endswith(f"claims/{BOX}/td0)") for c in txn["compare"])
        assert any(o.startswith(f"put {store.prefix}claims/{BOX}/td1 = ") for o in txn["success"])
    else:
        assert txn[0] == "BEGIN IMMEDIATE" and any("INSERT INTO leases" in t and "td1" in t for t in txn)
    grants = [s for s in steps if s.get("what") == "GRANT"]
    assert [g["request"]["device"] for g in grants] == ["td0", "td1"]
    adds = [s for s in steps if s.get("execute") == "device_add"]
    assert [a["arguments"]["bus"] for a in adds] == ["rp1", "rp2"]
    assert 'qmp: {"execute": "device_add"' in _plan_text(plan)
    assert store.leases() == [] and vm.devices == {} and box.grants.current("td0") is None  # nothing done

    with pytest.raises(StoreError, match="asked for 3 device"):  # refused as the real attach would be
        manager.attach(vm.key, count=3, dry_run=True)

    [attached] = manager.attach(vm.key, device="td0", timeout=10.0)
    plan = manager.detach(vm.key, all_devices=True, dry_run=True)
    kinds = [(s["do"], s.get("execute") or s.get("what", "").split(" ")[0]) for s in plan["steps"]]
    assert kinds == [("store", "lease"), ("qmp", "device_del"), ("proxy", "end"), ("box", "REVOKE"),
                     ("store", "delete")]
    assert plan["steps"][3]["request"]["fence"] == store.leases()[0].fence
    assert vm.devices and box.grants.current("td0") is not None and box.slots["td0"].in_use()

    vm.devices.clear()  # the device left the VM behind the pool's back
    [would] = manager.reconcile(dry_run=True)
    assert would["action"] == "would release" and would["why"] == "device no longer in the VM"
    assert [s["do"] for s in would["plan"]] == ["store", "proxy", "box", "store"]
    assert [lease.id for lease in store.leases()] == [attached["lease"]]
    [done] = manager.reconcile()
    assert done["action"] == "released" and store.leases() == []


def test_requests_reach_the_agent_by_its_watch_on_etcd_and_by_polling_on_sqlite(world, stores):
    central, agent, vm = world
    [attached] = central.attach(vm.key, device="td0", host="h1", timeout=10.0)
    central.detach(vm.key, all_devices=True, host="h1", timeout=10.0)
    assert central.store.leases() == [] and vm.devices == {}
    # each request acted on once, brought by what drives the agent on this store (the
    # agent's own writes to the lease are seen by its watch too, and not acted on again)
    assert agent.actions == ({"watch": 2} if central.store.kind == "etcd" else {"poll": 2})


@pytest.mark.parametrize("stores", ["etcd"], indirect=True)
def test_a_request_written_while_the_watch_was_down_is_acted_on_when_it_is_back(world):
    """The agent restarts its watch just after the revision it had seen everything up to:
    no event is lost, and no full read is needed to find it (the world's agent resyncs
    only every 600 s)."""
    import threading
    central, agent, vm = world
    [attached] = central.attach(vm.key, device="td0", host="h1", timeout=10.0)
    assert agent.actions == {"watch": 1}
    agent.hold_watch()
    answers = []
    detach = threading.Thread(target=lambda: answers.append(central.detach(vm.key, all_devices=True, host="h1",
                                                                           timeout=10.0)))
    detach.start()
    eventually(lambda: central.store.leases()[0].request == "detach", what="the detach request written")
    saved = agent.revision
    assert saved < int(central.store.etcd.range(central.store.k("schema"))["header"]["revision"])
    import time
    time.sleep(0.5)  # nothing drives the agent now: no watch, no polling, no resync due
    assert agent.actions == {"watch": 1} and len(central.store.leases()) == 1
    agent.release_watch()
    detach.join(timeout=15)
    assert answers and answers[0][0]["state"] == "freed" and vm.devices == {}
    assert agent.actions == {"watch": 2}  # from the watch restarted at the saved revision, not a resync
    assert agent.revision > saved


@pytest.mark.parametrize("stores", ["etcd"], indirect=True)
def test_a_watch_that_cannot_resume_because_etcd_compacted_its_history_falls_back_to_a_full_read(world):
    import threading
    central, agent, vm = world
    central.attach(vm.key, device="td0", host="h1", timeout=10.0)
    agent.hold_watch()
    answers = []
    detach = threading.Thread(target=lambda: answers.append(central.detach(vm.key, all_devices=True, host="h1",
                                                                           timeout=10.0)))
    detach.start()
    eventually(lambda: central.store.leases()[0].request == "detach", what="the detach request written")
    from dxpu_vfio.pool.etcd_client import op_put
    written = central.store.etcd.txn([], [op_put(central.store.k("unrelated"), 1)])  # a later revision to compact at
    now = int(written["header"]["revision"])
    assert agent.revision + 1 < now  # the watch would restart at a revision that compaction removes
    central.store.etcd.call("/kv/compaction", {"revision": now, "physical": True})
    agent.release_watch()
    detach.join(timeout=15)
    assert answers and answers[0][0]["state"] == "freed" and vm.devices == {}
    assert agent.actions == {"watch": 1, "resync": 1}  # the detach was found by the full read
    eventually(lambda: agent._watch is not None and agent.revision >= now, what="the watch running again")
