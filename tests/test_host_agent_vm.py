"""The host agent with a real VM (issue 15, items 3 and 4): a tiny guest's admin QMP socket,
the agent of host h1 doing the plug through the real QMP target, a box in this process
(mutual TLS on loopback), a central manager (host "central") asking for it. The guest
sees the device come, uses it, and after its host is fenced its register reads master
abort: the box cut the link and refuses the old token."""

import os

import pytest

from dxpu_vfio.lab.hotplug import guest_wait_for_child, port_bdf
from dxpu_vfio.link.transport import make_certs
from dxpu_vfio.pool.agent import HostAgent
from dxpu_vfio.pool.manager import Manager, proxy_alive, stop_proxy
from dxpu_vfio.pool.store import Store
from dxpu_vfio.procs import wait_until
from dxpu_vfio.remoteproxy.config import BoxConfig, BoxDevice
from dxpu_vfio.remoteproxy.proxy import RemoteProxy
from dxpu_vfio.testing import eventually
from dxpu_vfio.vmm.errors import VmGone

pytestmark = pytest.mark.vm

BOX = f"vbox{os.getpid()}"
ID_REGISTER = "0xd0c50001"  # testdev's BAR0 offset 0, as tests/test_pool.py reads it


def guest_ids(vm, bridge: str) -> str:
    out = vm.run(f"cd /sys/bus/pci/devices/{bridge} && for d in 0000:*; do "
                 f"[ -e $d/vendor ] && echo $(cat $d/vendor):$(cat $d/device); done; true", check=False)
    return out.stdout.strip()


def test_the_agent_plugs_into_a_real_guest_and_fencing_cuts_its_link(tiny_vm, tmp_path):
    certs = tmp_path / "certs"
    make_certs(certs, ["host", BOX])
    box = RemoteProxy(BoxConfig(BOX, "127.0.0.1", 0, [BoxDevice("td0", "testdev", settings={"memory_size": 1 << 20})],
                                tls_dir=certs)).start()
    store = Store(tmp_path / "pool.db")

    def nowhere(name):
        raise VmGone(f"{name} is not a VM of this host")
    central = Manager(store, open_vm=nowhere, host="central")
    agent = HostAgent(Store(tmp_path / "pool.db"), "h1", ttl=2.0, poll=0.1).start()
    leases = []
    try:
        central.register_box(None, f"127.0.0.1:{box.port}", str(certs))
        sock = str(tiny_vm.admin_qmp_path)
        [lease] = central.attach(sock, device="td0", host="h1", timeout=30.0)
        leases = store.leases()
        assert lease["state"] == "attached" and lease["host"] == "h1"
        bridge = port_bdf(tiny_vm, lease["port"])
        assert wait_until(lambda: "0x1b36:0x10f0" in guest_ids(tiny_vm, bridge), 30, 0.5), "guest never saw it"
        bdf = guest_wait_for_child(tiny_vm, bridge, True, 30)
        read = f"dxpu-mmio {bdf} enable >/dev/null && dxpu-mmio {bdf} 0 read 0"
        assert tiny_vm.run(read).stdout.strip() == ID_REGISTER  # through the agent's host proxy and the box

        agent._stop.set()  # the agent dies; the VM and its host proxy run on
        for thread in agent._threads:
            thread.join()
        eventually(lambda: not next(h for h in central.hosts() if h["name"] == "h1")["alive"], timeout=10,
                   what="h1's host lease run out")
        assert central.reconcile() == []
        assert tiny_vm.run(read).stdout.strip() == ID_REGISTER  # it keeps its device until fenced

        [taken] = central.fence_host("h1")["leases"]
        assert taken["token"] == "revoked"
        eventually(lambda: not box.slots["td0"].in_use(), what="the box cut the fenced host's link")
        assert tiny_vm.run(read).stdout.strip() == "0xffffffff"  # master abort: the device is gone for it
        assert box.grants.current("td0") is None and box.grants.floor("td0", store.pool_id) > taken["fence"]  # no old grant again
        assert store.leases() == [] and any(d["available"] for d in store.devices())
    finally:
        agent.lost = agent.lost or "test over"
        agent.stop()
        for lease in leases:  # the fenced host's leftovers, as its admin would clean them up
            try:
                tiny_vm.qmp.execute("device_del", {"id": lease.qdev_id})
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
            if proxy_alive(lease):
                stop_proxy(lease)
        store.close()
        box.stop()
