"""Lease tokens are secret and per lease (issue 18, item 14), without a VM: a box in this
process on loopback (mutual TLS, both link streams), the manager's admin exchange with it
(GRANT, REVOKE), host proxies that prove a token without sending it, and the files that
must stay private (the pool database, the CA key)."""

import errno
import hashlib
import os
import shutil
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

from dxpu_vfio.hostproxy.forwarder import RemoteAttachError, connect_remote
from dxpu_vfio.hostproxy.process import HostProxyProcess
from dxpu_vfio.link.protocol import Hello, LinkCommand, hello_proof, unpack_challenge
from dxpu_vfio.link.transport import TlsFiles, ca_private_dir, connect, make_certs
from dxpu_vfio.native import stream as native
from dxpu_vfio.pool.boxes import BoxUnreachable, fetch_inventory, fetch_screenshot, grant_token, revoke_token
from dxpu_vfio.pool.manager import Manager
from dxpu_vfio.pool.store import Store
from dxpu_vfio.remoteproxy.config import BoxConfig, BoxDevice
from dxpu_vfio.remoteproxy.proxy import RemoteProxy
from dxpu_vfio.testing import eventually
from dxpu_vfio.vfio_user import protocol as vp
from dxpu_vfio.vfio_user.connection import Connection
from dxpu_vfio.vmm.errors import VmGone

SMALL = {"memory_size": 1 << 20}
STATIC = "static-secret-of-td2"
BOX = f"tbox{os.getpid()}"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok") / "certs"
    make_certs(d, ["host", BOX, "otherbox"])
    return d


@pytest.fixture(scope="module")
def intruder(certs, tmp_path_factory):
    """What another box of the pool holds: ca.pem and a certificate of the same CA (its
    own), presented where a host's would be."""
    d = tmp_path_factory.mktemp("intruder")
    shutil.copy(certs / "ca.pem", d / "ca.pem")
    shutil.copy(certs / "otherbox.pem", d / "host.pem")
    shutil.copy(certs / "otherbox.key", d / "host.key")
    return d


@pytest.fixture(params=["native", "python"])
def box(request, monkeypatch, certs):
    if request.param == "native" and not native.built():
        pytest.fail("the native stream is not built: run scripts/setup.sh")
    monkeypatch.setenv("DXPU_FASTLINK", "1" if request.param == "native" else "0")
    proxy = RemoteProxy(BoxConfig(BOX, "127.0.0.1", 0, [
        BoxDevice("td0", "testdev", settings=SMALL), BoxDevice("td1", "testdev", settings=SMALL),
        BoxDevice("td2", "testdev", STATIC, SMALL)], tls_dir=certs)).start()
    proxy.address = f"127.0.0.1:{proxy.port}"
    yield proxy
    proxy.stop()


def tls(certs):
    return TlsFiles.in_dir(certs, "host")


def hello_conn(box, certs) -> Connection:
    host, _, port = box.address.rpartition(":")
    conn = Connection(connect(host, int(port), tls(certs)))
    conn.sock.settimeout(5)
    return conn


def test_inventory_carries_no_token(box, certs):
    granted = grant_token(box.address, str(certs), "td0", "lease1")
    inventory = fetch_inventory(box.address, str(certs))
    for device in inventory["devices"]:
        assert set(device) == {"id", "class", "vendor", "model", "capacity", "in_use"}
    assert granted not in repr(inventory) and STATIC not in repr(inventory)


def test_another_box_of_the_ca_can_neither_grant_nor_revoke_nor_look(box, certs, intruder):
    """A certificate of the pool's CA is enough for INVENTORY, not for the admin commands."""
    assert fetch_inventory(box.address, str(intruder))["box"] == BOX
    with pytest.raises(BoxUnreachable, match="not one of the box's managers"):
        grant_token(box.address, str(intruder), "td0", "mine")
    assert box.grants.current("td0") is None
    grant_token(box.address, str(certs), "td0", "lease1")
    with pytest.raises(BoxUnreachable, match="not one of the box's managers"):
        revoke_token(box.address, str(intruder), "td0", "lease1")
    assert box.grants.current("td0").lease == "lease1"
    with pytest.raises(BoxUnreachable, match="not one of the box's managers"):
        fetch_screenshot(box.address, str(intruder), "td0")
    assert box.control.refused_admin == 3


def test_a_lease_token_admits_to_its_own_device_only_and_not_after_revoke(box, certs):
    t0 = grant_token(box.address, str(certs), "td0", "lease1")
    t1 = grant_token(box.address, str(certs), "td1", "lease2")
    assert t0 != t1 and len(t0) >= 64
    with pytest.raises(RemoteAttachError, match="lease token refused"):
        connect_remote(box.address, "td1", t0, tls(certs))  # another lease's token, another device
    device = connect_remote(box.address, "td0", t0, tls(certs))
    assert int.from_bytes(device.region_read(vp.REGION_CONFIG, 0, 4), "little") == 0x10F01B36
    assert revoke_token(box.address, str(certs), "td0", "lease1")
    eventually(lambda: not device.endpoint.up, what="the revoked lease's link closed by the box")
    device.close()
    with pytest.raises(RemoteAttachError, match="lease token refused"):
        connect_remote(box.address, "td0", t0, tls(certs))  # after detach
    again = grant_token(box.address, str(certs), "td0", "lease3")
    assert again != t0
    assert not revoke_token(box.address, str(certs), "td0", "lease1")  # lease1 is over: lease3's stays
    connect_remote(box.address, "td0", again, tls(certs)).close()
    assert box.refused["lease"] == 2


def test_a_new_grant_voids_the_token_before_it_and_the_static_token(box, certs):
    old = grant_token(box.address, str(certs), "td0", "lease1")
    grant_token(box.address, str(certs), "td0", "lease2")
    with pytest.raises(RemoteAttachError, match="lease token refused"):
        connect_remote(box.address, "td0", old, tls(certs))
    connect_remote(box.address, "td2", STATIC, tls(certs)).close()  # a box's own token, for use without a pool
    eventually(lambda: not box.slots["td2"].in_use(), what="td2 free again")
    grant_token(box.address, str(certs), "td2", "lease3")
    with pytest.raises(RemoteAttachError, match="lease token refused"):
        connect_remote(box.address, "td2", STATIC, tls(certs))  # leased by the pool: only its lease's token


def test_a_recorded_hello_cannot_be_replayed(box, certs):
    token = grant_token(box.address, str(certs), "td0", "lease1")
    conn = hello_conn(box, certs)
    conn.send(vp.message(1, LinkCommand.HELLO, Hello("td0").pack()))
    nonce = unpack_challenge(conn.receive().payload)
    assert token not in nonce
    recorded = vp.message(2, LinkCommand.HELLO, Hello("td0", nonce, hello_proof(token, "td0", nonce)).pack())
    assert token.encode() not in recorded  # the token itself never crosses the link
    conn.send(recorded)
    assert not conn.receive().header.is_error  # admitted: the device description
    conn.close()
    eventually(lambda: not box.slots["td0"].in_use(), what="the first link released")

    replay = hello_conn(box, certs)  # the whole exchange again: the box's nonce is another
    replay.send(vp.message(1, LinkCommand.HELLO, Hello("td0").pack()))
    assert unpack_challenge(replay.receive().payload) != nonce
    replay.send(recorded)
    reply = replay.receive()
    assert reply.header.is_error and reply.header.error == errno.EACCES
    replay.close()

    replay = hello_conn(box, certs)  # the recorded answer as a first HELLO
    replay.send(recorded)
    reply = replay.receive()
    assert reply.header.is_error and reply.header.error == errno.EACCES
    replay.close()
    assert box.refused["lease"] == 2 and not box.slots["td0"].in_use()


def test_the_host_proxy_proves_its_token_only_to_the_pinned_box(box, certs):
    token = grant_token(box.address, str(certs), "td0", "lease1")
    with pytest.raises(RemoteAttachError, match="another certificate"):
        connect_remote(box.address, "td0", token, tls(certs), box_sha256="0" * 64)
    eventually(lambda: box.refused["hello"] == 1, what="the box saw no answer to its challenge")
    assert box.refused["lease"] == 0
    der = ssl.PEM_cert_to_DER_cert((certs / f"{BOX}.pem").read_text())
    connect_remote(box.address, "td0", token, tls(certs), box_sha256=hashlib.sha256(der).hexdigest()).close()


def test_the_host_proxy_gets_its_token_by_pipe_not_argv_or_environ(box, certs, tmp_path):
    token = grant_token(box.address, str(certs), "td0", "lease1")
    settings = {"address": box.address, "device": "td0", "lease": token, "tls_dir": str(certs)}
    host = HostProxyProcess("remote", tmp_path / "h.sock", settings=settings, name=f"tok{os.getpid()}").start()
    try:
        assert box.slots["td0"].in_use()  # it proved the token it was given
        for what in ("cmdline", "environ"):
            assert token.encode() not in (Path(f"/proc/{host.pid}") / what).read_bytes()
        ps = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True, check=True).stdout
        assert "--secrets-fd" in ps and token not in ps
    finally:
        host.stop()


def test_the_manager_revokes_the_token_when_it_frees_the_device(box, certs, tmp_path):
    store = Store(tmp_path / "pool.db")

    def gone(vm):
        raise VmGone(f"{vm} is gone")
    manager = Manager(store, open_vm=gone)
    try:
        manager.register_box(None, box.address, str(certs))
        assert {d["token"] for d in store.devices() if "token" in d} <= {""}
        [lease] = store.allocate("libvirt:vm1", device="td0")
        token = grant_token(box.address, str(certs), "td0", lease.id)
        [freed] = manager.detach("vm1", all_devices=True)
        assert freed["device"] == f"{BOX}/td0"
        assert box.grants.current("td0") is None
        with pytest.raises(RemoteAttachError, match="lease token refused"):
            connect_remote(box.address, "td0", token, tls(certs))
    finally:
        store.close()


# --- files -----------------------------------------------------------------------------
def mode(path) -> int:
    return os.stat(path).st_mode & 0o777


def test_the_pool_database_and_its_wal_are_private(tmp_path):
    old = os.umask(0o022)
    try:
        store = Store(tmp_path / "state" / "pool.db")
        store.register_box("a", "x:1", None, [{"id": "d0", "class": "testdev", "vendor": "1b36", "model": "10f0",
                                               "capacity": 1}])
        assert (tmp_path / "state" / "pool.db-wal").exists()
        assert {mode(tmp_path / "state" / n) for n in ("pool.db", "pool.db-wal", "pool.db-shm")} == {0o600}
        assert mode(tmp_path / "state") == 0o700  # made here
        store.close()
        for name in ("pool.db", "pool.db-wal", "pool.db-shm"):  # what an older version left readable
            if (tmp_path / "state" / name).exists():
                (tmp_path / "state" / name).chmod(0o644)
        Store(tmp_path / "state" / "pool.db").close()
        assert mode(tmp_path / "state" / "pool.db") == 0o600
    finally:
        os.umask(old)


def test_the_ca_key_is_not_in_the_tls_dir(tmp_path):
    d = tmp_path / "certs"
    make_certs(d, ["host", "box1"])
    assert sorted(p.name for p in d.iterdir()) == ["box1.key", "box1.pem", "ca.pem", "host.key", "host.pem"]
    private = ca_private_dir(d)
    assert private.parent == tmp_path and mode(private) == 0o700 and mode(private / "ca.key") == 0o600
    # a TLS dir of an older version, with the CA key in it: the key moves out, roles can still be added
    (private / "ca.key").replace(d / "ca.key")
    make_certs(d, ["box2"])
    assert not (d / "ca.key").exists() and (private / "ca.key").exists()
    verify = subprocess.run(["openssl", "verify", "-CAfile", str(d / "ca.pem"), str(d / "box2.pem")],
                            capture_output=True, text=True)
    assert verify.returncode == 0, verify.stderr


def test_dxpu_certs_keeps_the_ca_key_out_of_the_dir(tmp_path):
    out = subprocess.run([sys.executable, "-m", "dxpu_vfio.cli", "certs", str(tmp_path / "c"), "host", "box1"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert not list((tmp_path / "c").glob("ca.key")) and (tmp_path / "c.ca-private" / "ca.key").exists()
