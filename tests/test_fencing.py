"""Fencing (issue 15, item 4), without a VM: a real box in this process (mutual TLS), the
pool on SQLite and on a real etcd member, two hosts' managers over one pool. The host
side of a link is the host proxy's own code (``connect_remote``), holding the token the
box granted for the lease; a host's "death" is its agent no longer renewing its lease."""

import os

import pytest

from dxpu_vfio.hostproxy.forwarder import RemoteAttachError, connect_remote
from dxpu_vfio.link.transport import TlsFiles, make_certs
from dxpu_vfio.pool.boxes import BoxUnreachable, grant_token
from dxpu_vfio.pool.manager import Manager
from dxpu_vfio.pool.storage import NoFreeDevice, StoreError
from dxpu_vfio.remoteproxy.config import BoxConfig, BoxDevice
from dxpu_vfio.remoteproxy.proxy import RemoteProxy
from dxpu_vfio.testing import eventually
from dxpu_vfio.vfio_user import protocol as vp
from dxpu_vfio.vmm.errors import VmGone

BOX = f"fbox{os.getpid()}"
SMALL = {"memory_size": 1 << 20}


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("fence") / "certs"
    make_certs(d, ["host", BOX])
    return d


@pytest.fixture
def box(certs):
    proxy = RemoteProxy(BoxConfig(BOX, "127.0.0.1", 0, [BoxDevice("td0", "testdev", settings=SMALL)],
                                  tls_dir=certs)).start()
    proxy.address = f"127.0.0.1:{proxy.port}"
    yield proxy
    proxy.stop()


def gone(vm):
    raise VmGone(f"{vm} is not on this host")


def host_attaches(store, box, certs, vm: str, host: str):
    """What a host's attach does at the box: a lease for it, a token granted with the
    lease's fencing token, and the host proxy's link admitted with that token."""
    [lease] = store.allocate(vm, device="td0", host=host)
    token = grant_token(box.address, str(certs), "td0", lease.id, fence=lease.fence, holder=host, pool=store.pool_id)
    link = connect_remote(box.address, "td0", token, TlsFiles.in_dir(certs, "host"))
    assert int.from_bytes(link.region_read(vp.REGION_CONFIG, 0, 4), "little") == 0x10F01B36
    return lease, token, link


def test_a_dead_host_keeps_its_device_until_fenced_then_the_box_refuses_it(stores, box, certs):
    s1, s2 = stores
    m2 = Manager(s2, open_vm=gone, host="h2")
    m2.register_box(None, box.address, str(certs))
    holder = s1.host_register("h1", ttl=1, agent_pid=os.getpid())
    old, old_token, link = host_attaches(s1, box, certs, "qmp:/run/h1/vm1.qmp", "h1")
    assert old.holder == holder and old.fence

    # h1's agent dies: its heartbeat runs out, but nothing takes the device from it
    eventually(lambda: not next(h for h in m2.hosts() if h["name"] == "h1")["alive"], timeout=5,
               what="h1's agent seen dead")
    assert m2.reconcile() == []  # h2's manager leaves h1's VMs alone (it cannot see them)
    with pytest.raises(StoreError, match="VM of host h1"):
        m2.detach("qmp:/run/h1/vm1.qmp", all_devices=True)
    with pytest.raises(NoFreeDevice):
        s2.allocate("qmp:/run/h2/vm2.qmp", device="td0", host="h2")
    assert link.endpoint.up and [lease.id for lease in s2.leases()] == [old.id]

    fenced = m2.fence_host("h1")
    assert fenced["leases"] == [{"lease": old.id, "device": f"{BOX}/td0", "vm": "qmp:/run/h1/vm1.qmp",
                                 "fence": old.fence, "token": "revoked"}]
    eventually(lambda: not link.endpoint.up, what="the fenced host's live link cut by the box")
    link.close()
    with pytest.raises(RemoteAttachError, match="lease token refused"):
        connect_remote(box.address, "td0", old_token, TlsFiles.in_dir(certs, "host"))  # HELLO with the old token
    with pytest.raises(BoxUnreachable, match="fencing token is stale"):  # h1's manager, still running, re-grants
        grant_token(box.address, str(certs), "td0", old.id, fence=old.fence, holder="h1", pool=s1.pool_id)
    with pytest.raises(StoreError, match="host h1 is fenced"):
        s1.allocate("qmp:/run/h1/vm1.qmp", device="td0", host="h1")

    new, _, link2 = host_attaches(s2, box, certs, "qmp:/run/h2/vm2.qmp", "h2")  # the device goes to h2
    assert new.fence > old.fence and s1.pool_id == s2.pool_id
    with pytest.raises(BoxUnreachable, match="fencing token is stale"):
        grant_token(box.address, str(certs), "td0", old.id, fence=old.fence, holder="h1", pool=s1.pool_id)
    assert link2.endpoint.up
    link2.close()
    assert box.refused["lease"] == 1


def test_a_newer_lease_of_the_device_cuts_the_link_of_the_one_before(box, certs):
    """The lease moved without a revoke (the old manager never got to it): the new grant
    takes the old lease's link down and its token is dead."""
    t1 = grant_token(box.address, str(certs), "td0", "lease1", fence=10, holder="h1")
    link = connect_remote(box.address, "td0", t1, TlsFiles.in_dir(certs, "host"))
    grant_token(box.address, str(certs), "td0", "lease2", fence=11, holder="h2")
    eventually(lambda: not link.endpoint.up, what="the old lease's link cut")
    link.close()
    with pytest.raises(RemoteAttachError, match="lease token refused"):
        connect_remote(box.address, "td0", t1, TlsFiles.in_dir(certs, "host"))
    with pytest.raises(BoxUnreachable, match="stale"):
        grant_token(box.address, str(certs), "td0", "lease1", fence=10, holder="h1")
    with pytest.raises(BoxUnreachable, match="stale"):  # once fenced, a grant must carry a fence
        grant_token(box.address, str(certs), "td0", "lease3")
    # a pool made afresh (its fences start low again) is another scope: not locked out
    grant_token(box.address, str(certs), "td0", "lease4", fence=1, holder="h1", pool="another-pool")
