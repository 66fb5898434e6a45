"""The pool manager end to end: a lab with two GPU boxes, ``dxpu manager serve`` in the
lab's host namespace, a tiny guest reached through its admin QMP socket, and the
``dxpu`` commands an admin types. Everything is real: QEMU, the guest kernel, the
remote proxies over mutual TLS, SQLite, the manager process (killed with SIGKILL in the
crash tests)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dxpu_vfio.lab import lab
from dxpu_vfio.lab.hotplug import guest_wait_for_child, port_bdf
from dxpu_vfio.link.transport import make_certs
from dxpu_vfio.paths import run_dir
from dxpu_vfio.pool.manager import Manager, stop_proxy
from dxpu_vfio.pool.service import ManagerClient, ManagerError, ManagerProcess
from dxpu_vfio.pool.store import Lease, Store
from dxpu_vfio.procs import wait_until

pytestmark = pytest.mark.vm
MiB = 1 << 20


@pytest.fixture
def pool_lab(labs, lab_factory):
    """Two GPU boxes, shared by the session (test_libvirt uses the same lab)."""
    disks = lab_factory.directory("pool-disks")
    return labs.shared(lab.Topology("pool", [
        lab.BoxSpec("box1", [{"id": "td0", "model": "testdev"},
                             {"id": "nv0", "model": "nvme",
                              "settings": {"namespaces": [{"size": 32 * MiB, "path": str(disks / "nv0")}]}}]),
        lab.BoxSpec("box2", [{"id": "td1", "model": "testdev"}]),
    ]))


class Pool:
    """One manager process over one database, and the CLI as an admin runs it."""

    def __init__(self, state: lab.LabState, db: Path) -> None:
        self.state, self.db = state, db
        self.process: ManagerProcess | None = None
        self.client = ManagerClient(db)

    def start(self, **env: str) -> "Pool":
        self.process = ManagerProcess(self.db, netns=self.state.host_netns, env=env).start()
        return self

    def stop(self) -> None:
        if self.process:
            self.process.stop()

    def dxpu(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-m", "dxpu_vfio.cli", *args, "--db", str(self.db)],
                              capture_output=True, text=True, timeout=180)
        if check and proc.returncode != 0:
            raise AssertionError(f"dxpu {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}\n"
                                 f"manager log: {self.db.with_suffix('.log')}")
        return proc

    def json(self, *args: str) -> object:
        return json.loads(self.dxpu(*args, "--json").stdout)

    def register(self, box: str) -> dict:
        b = self.state.box(box)
        return self.json("box", "add", box, b.endpoint, "--tls-dir", str(self.state.certs))

    def leases(self) -> list[dict]:
        with sqlite3.connect(self.db) as db:
            db.row_factory = sqlite3.Row
            return [dict(r) for r in db.execute("SELECT * FROM leases")]


@pytest.fixture
def pool(pool_lab, tmp_path):
    p = Pool(pool_lab, tmp_path / "pool.db").start()
    p.register("box1")
    p.register("box2")
    yield p
    p.stop()
    for row in p.leases():  # a test that failed half way: leave no proxy or socket behind
        stop_proxy(Lease(**row))


@pytest.fixture
def vm(shared_tiny_vm):
    return shared_tiny_vm


def guest_ids(vm, bridge: str) -> str:
    """vendor:device of what sits below a root port in the guest, or '' if nothing."""
    out = vm.run(f"cd /sys/bus/pci/devices/{bridge} && for d in 0000:*; do "
                 f"[ -e $d/vendor ] && echo $(cat $d/vendor):$(cat $d/device); done; true", check=False)
    return out.stdout.strip()


def wait_guest(vm, port: str, want: str, timeout: float = 20) -> bool:
    return wait_until(lambda: (want in guest_ids(vm, port_bdf(vm, port))) if want else
                      guest_ids(vm, port_bdf(vm, port)) == "", timeout, 0.5)


def test_boxes_register_with_their_inventory(pool):
    listing = pool.json("ls")
    assert [b["name"] for b in listing["boxes"]] == ["box1", "box2"]
    assert all(len(b["cert_sha256"]) == 64 for b in listing["boxes"])  # the certificate each presented
    assert all(b["state"] == "up" for b in listing["boxes"])
    devices = {d["id"]: d for d in listing["devices"]}
    assert devices["box1/nv0"]["class"] == "nvme" and devices["box1/nv0"]["capacity"] == 32 * MiB
    assert (devices["box1/nv0"]["vendor"], devices["box1/nv0"]["model"]) == ("1b36", "10f1")
    assert (devices["box2/td1"]["class"], devices["box2/td1"]["model"]) == ("testdev", "10f0")
    assert all(d["available"] for d in devices.values())


def test_attach_status_metrics_detach_through_qmp(pool, vm):
    sock = str(vm.admin_qmp_path)
    [lease] = pool.json("attach", sock, "--class", "testdev", "--box", "box2")
    assert lease["device"] == "box2/td1" and lease["state"] == "attached"
    assert wait_guest(vm, lease["port"], "0x1b36:0x10f0"), "guest never saw the pooled test device"
    # the guest uses it: its id register, read through box2
    bdf = guest_wait_for_child(vm, port_bdf(vm, lease["port"]), True, 30)
    assert vm.run(f"dxpu-mmio {bdf} enable >/dev/null && dxpu-mmio {bdf} 0 read 0").stdout.strip() == "0xd0c50001"
    status = pool.json("status", sock)
    [dev] = status["devices"]
    assert dev["in_vm"] and dev["proxy_alive"] and dev["link_up"], status
    metrics = {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(
        pool.dxpu("manager", "metrics").stdout) for s in f.samples}
    mine = {"lease": lease["lease"], "device": "box2/td1", "vm": lease["vm"]}
    assert metrics[("dxpu_lease_info", frozenset({**mine, "state": "attached"}.items()))] == 1
    assert metrics[("dxpu_device_messages_total", frozenset({**mine, "command": "REGION_READ"}.items()))] >= 1
    assert metrics[("dxpu_box_up", frozenset({"box": "box2"}.items()))] == 1
    text = pool.dxpu("ls").stdout
    assert "box2/td1" in text and "leased" in text
    [freed] = pool.json("detach", sock, lease["lease"])
    assert freed["device"] == "box2/td1" and freed["counters"]["server"]["sessions"] == 1
    assert wait_guest(vm, lease["port"], ""), "guest kept the device after detach"
    assert pool.leases() == [] and not Path(f"/proc/{lease['proxy_pid']}").exists()
    assert all(d["available"] for d in pool.json("ls")["devices"])


def test_concurrent_attaches_never_get_the_same_device(pool, vm):
    """Three admins ask for a test device at once; the pool has two."""
    sock = str(vm.admin_qmp_path)
    results: list[subprocess.CompletedProcess] = []
    threads = [threading.Thread(target=lambda: results.append(
        pool.dxpu("attach", sock, "--class", "testdev", "--json", check=False))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    ok = [json.loads(r.stdout)[0] for r in results if r.returncode == 0]
    failed = [r for r in results if r.returncode != 0]
    assert len(ok) == 2 and len(failed) == 1, [r.stderr for r in results]
    assert {d["device"] for d in ok} == {"box1/td0", "box2/td1"}
    assert len({d["port"] for d in ok}) == 2
    assert "1 device(s) of class testdev, 0 free" in failed[0].stderr and "fix:" in failed[0].stderr
    assert len(pool.leases()) == 2
    pool.dxpu("detach", sock, "--all")
    assert pool.leases() == []


def test_spread_policy_takes_one_device_per_box_and_pack_fills_one_box(pool, vm):
    sock = str(vm.admin_qmp_path)
    spread = pool.json("attach", sock, "--count", "2", "--policy", "spread")
    assert sorted(d["device"].split("/")[0] for d in spread) == ["box1", "box2"]
    pool.dxpu("detach", sock, "--all")
    pack = pool.json("attach", sock, "--count", "2", "--policy", "pack")
    assert [d["device"].split("/")[0] for d in pack] == ["box1", "box1"]
    pool.dxpu("detach", sock, "--all")


def test_clear_errors_lose_nothing(pool, vm, pool_lab, tmp_path):
    sock = str(vm.admin_qmp_path)
    cases = [
        (["attach", str(tmp_path / "nosuch.sock")], "not a UNIX socket"),
        (["attach", sock, "--class", "gpu"], "asked for 1 device(s) of class gpu, 0 free"),
        (["attach", sock, "--device", "box9/x"], "0 free"),
        (["detach", sock, "nothing"], "holds no device(s) matching 'nothing'"),
        (["attach", sock, "--policy", "pack", "--count", "0"], "at least 1"),
        (["box", "add", "box9", "198.18.250.1:1"], "cannot reach box"),
    ]
    for args, message in cases:
        proc = pool.dxpu(*args, check=False)
        assert proc.returncode == 1 and message in proc.stderr, (args, proc.stderr)
    # a box whose certificate is not from our CA is refused at registration
    other_ca = tmp_path / "other-ca"
    make_certs(other_ca, ["host"])
    proc = pool.dxpu("box", "add", "box1", pool_lab.box("box1").endpoint, "--tls-dir", str(other_ca), check=False)
    assert proc.returncode == 1 and ("TLS" in proc.stderr or "certificate" in proc.stderr), proc.stderr
    assert pool.leases() == [] and all(d["available"] for d in pool.json("ls")["devices"])


def test_a_vm_without_free_root_ports_is_refused_and_rolled_back(pool, vm_factory):
    small = vm_factory.booted("tiny", name="pool-1port", root_ports=1)
    sock = str(small.admin_qmp_path)
    pool.json("attach", sock, "--device", "box1/td0")
    proc = pool.dxpu("attach", sock, "--device", "box2/td1", check=False)
    assert proc.returncode == 1 and "no free root port" in proc.stderr and "rolled back" in proc.stderr
    [kept] = pool.leases()
    assert kept["device"] == "box1/td0"
    # the refused device's host proxy was ended and its socket removed
    assert sorted(p.name for p in (run_dir() / "pool").glob("*.sock")) == [f"{kept['id']}.sock"]
    pool.dxpu("detach", sock, "--all")


@pytest.mark.parametrize("point", ["attach.after_proxy", "attach.after_plug"])
def test_manager_killed_mid_attach_restarts_consistent(pool, vm, point):
    sock = str(vm.admin_qmp_path)
    pool.stop()
    pool.start(DXPU_FAILPOINTS=point)
    proc = pool.dxpu("attach", sock, "--device", "box1/td0", check=False)
    assert proc.returncode == 1
    assert wait_until(lambda: not pool.process.alive(), 10), "the failpoint did not kill the manager"
    [lease] = pool.leases()
    assert lease["state"] == "attaching" and Path(f"/proc/{lease['proxy_pid']}").exists()
    plugged = any(p["name"] == lease["qdev_id"] for p in vm.qmp.execute("qom-list", {"path": "/machine/peripheral"}))
    assert plugged == (point == "attach.after_plug")
    pool.start()  # reconciles at start
    assert pool.leases() == []
    assert not any(p["name"].startswith("pool-") for p in vm.qmp.execute("qom-list", {"path": "/machine/peripheral"}))
    assert wait_until(lambda: not Path(f"/proc/{lease['proxy_pid']}").exists(), 10), "host proxy left running"
    again = pool.json("attach", sock, "--device", "box1/td0")
    assert again[0]["state"] == "attached"
    pool.dxpu("detach", sock, "--all")


def test_detach_of_a_device_whose_box_died(pool, vm, pool_lab):
    sock = str(vm.admin_qmp_path)
    [lease] = pool.json("attach", sock, "--device", "box2/td1")
    assert wait_guest(vm, lease["port"], "0x1b36:0x10f0")
    os.kill(pool_lab.box("box2").proxy_pid, signal.SIGKILL)
    try:
        # A heartbeat round whose probe box2 answered just before it died must not re-plug
        # into the dead box (that fails, and the failure would release the lease): heal
        # probes again once it has seen the dead link.
        late = Manager(Store(pool.db))
        held = Lease(**pool.leases()[0])
        assert wait_until(lambda: not late._proxy_stats(held)["device"]["link"]["up"], 10), "link never seen down"
        assert late.heal(late.store.box("box2"), late.store.leases()) == []
        assert [row["state"] for row in pool.leases()] == ["attached"]
        assert wait_until(lambda: pool.json("ls")["boxes"][1]["state"] == "down", 15), "box2 never marked down"
        devices = {d["id"]: d for d in pool.json("ls")["devices"]}
        assert not devices["box2/td1"]["available"]
        proc = pool.dxpu("attach", sock, "--box", "box2", check=False)
        assert proc.returncode == 1 and "0 free" in proc.stderr
        [freed] = pool.json("detach", sock, "box2/td1")
        assert freed["lease"] == lease["lease"]
        assert wait_guest(vm, lease["port"], "")
        assert pool.leases() == []
    finally:
        lab.restart_proxy(pool_lab, "box2")
    assert wait_until(lambda: pool.json("ls")["boxes"][1]["state"] == "up", 15), "box2 never came back"
    assert {d["id"]: d for d in pool.json("ls")["devices"]}["box2/td1"]["available"]


def test_a_vm_that_died_gives_its_devices_back(pool, vm_factory):
    """QEMU killed with SIGKILL (its QMP socket file stays): status says it exited,
    detach releases what it held and ends the host proxy."""
    doomed = vm_factory.booted("tiny", name="pool-doomed")
    sock = str(doomed.admin_qmp_path)
    [lease] = pool.json("attach", sock, "--device", "box2/td1")
    os.kill(doomed.pid, signal.SIGKILL)
    assert wait_until(lambda: not doomed.alive(), 10)
    proc = pool.dxpu("status", sock, check=False)
    assert proc.returncode == 1 and "the VM has exited" in proc.stderr
    [freed] = pool.json("detach", sock, "--all")
    assert freed["device"] == "box2/td1" and freed["why"].startswith("VM gone")
    assert pool.leases() == [] and not Path(f"/proc/{lease['proxy_pid']}").exists()
    assert {d["id"]: d for d in pool.json("ls")["devices"]}["box2/td1"]["available"]


def test_a_restarted_box_gets_its_devices_replugged(pool, vm, pool_lab):
    """box2's remote proxy dies and comes back at once (never marked down): the host
    proxy's link is dead and QEMU never reconnects, so the manager re-plugs the device on
    the same lease, and the guest can use it again."""
    sock = str(vm.admin_qmp_path)
    [lease] = pool.json("attach", sock, "--device", "box2/td1")
    assert wait_guest(vm, lease["port"], "0x1b36:0x10f0")
    os.kill(pool_lab.box("box2").proxy_pid, signal.SIGKILL)
    lab.restart_proxy(pool_lab, "box2")
    status = lambda: pool.json("status", sock)["devices"][0]  # noqa: E731
    assert wait_until(lambda: status()["link_up"] and status()["proxy_pid"] != lease["proxy_pid"], 30), \
        f"never re-plugged: {status()} (manager log {pool.db.with_suffix('.log')})"
    again = status()
    assert again["lease"] == lease["lease"] and again["in_vm"] and again["state"] == "attached"
    assert "re-plugged box2/td1" in pool.db.with_suffix(".log").read_text()
    bdf = guest_wait_for_child(vm, port_bdf(vm, again["port"]), True, 30)
    vm.run(f"dxpu-mmio {bdf} enable && dxpu-mmio {bdf} 0 write 0x0c 0xcafef00d")
    assert vm.run(f"dxpu-mmio {bdf} 0 read 0x0c").stdout.strip() == "0xcafef00d"  # the box answers again
    pool.dxpu("detach", sock, "--all")


def test_a_box_that_presents_another_certificate_goes_down(pool, pool_lab):
    """Another key signed by the same CA at box2's address is not box2 as registered:
    the heartbeat marks it down (its devices unavailable) until an admin registers it again."""
    certs, box2 = pool_lab.certs, pool_lab.box("box2")
    before = {b["name"]: b for b in pool.json("ls")["boxes"]}["box2"]["cert_sha256"]
    for suffix in ("pem", "key"):
        (certs / f"box2.{suffix}").unlink()
    make_certs(certs, ["box2"])  # a new key and certificate from the same CA
    os.kill(box2.proxy_pid, signal.SIGKILL)
    lab.restart_proxy(pool_lab, "box2")
    box = lambda: {b["name"]: b for b in pool.json("ls")["boxes"]}["box2"]  # noqa: E731
    assert wait_until(lambda: box()["state"] == "down", 15), "box2 with a new certificate stayed up"
    assert "presented another certificate" in box()["last_error"]
    again = pool.register("box2")
    assert again["certificate_sha256"] != before and box()["state"] == "up"
    assert wait_until(lambda: box()["state"] == "up", 3) and box()["cert_sha256"] == again["certificate_sha256"]


def test_api_refuses_requests_without_the_token(pool):
    import http.client
    import socket as socketlib

    class Conn(http.client.HTTPConnection):
        def connect(self):
            self.sock = socketlib.socket(socketlib.AF_UNIX)
            self.sock.connect(str(pool.db.with_suffix(".sock")))

    conn = Conn("localhost", timeout=10)
    conn.request("GET", "/v1/ls", headers={"Authorization": "Bearer wrong"})
    assert conn.getresponse().status == 401
    assert oct(pool.db.with_suffix(".token").stat().st_mode & 0o777) == "0o600"
    assert oct(pool.db.with_suffix(".sock").stat().st_mode & 0o777) == "0o600"
    with pytest.raises(ManagerError, match="another manager already serves"):
        from dxpu_vfio.pool.service import serve
        serve(pool.db)
