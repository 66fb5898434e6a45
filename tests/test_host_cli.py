"""``dxpu agent serve`` and ``dxpu host ls/fence/unfence`` as an admin types them (no VM):
the manager and the agent are processes of their own on one SQLite pool, the box runs in
this process (mutual TLS), and host h1's link is the host proxy's own code."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dxpu_vfio.hostproxy.forwarder import RemoteAttachError, connect_remote
from dxpu_vfio.link.transport import TlsFiles, make_certs
from dxpu_vfio.pool.boxes import grant_token
from dxpu_vfio.pool.service import AgentProcess, ManagerProcess
from dxpu_vfio.pool.store import Store
from dxpu_vfio.remoteproxy.config import BoxConfig, BoxDevice
from dxpu_vfio.remoteproxy.proxy import RemoteProxy
from dxpu_vfio.testing import eventually

BOX = f"cbox{os.getpid()}"


def dxpu(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dxpu_vfio.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def pool(tmp_path):
    certs = tmp_path / "certs"
    make_certs(certs, ["host", BOX])
    box = RemoteProxy(BoxConfig(BOX, "127.0.0.1", 0, [BoxDevice("td0", "testdev", settings={"memory_size": 1 << 20})],
                                tls_dir=certs)).start()
    db = tmp_path / "pool.db"
    manager = ManagerProcess(db, env={"DXPU_HOST": "central"}).start()
    agents: list[AgentProcess] = []
    try:
        assert dxpu("box", "add", BOX, f"127.0.0.1:{box.port}", "--tls-dir", str(certs), "--db", str(db)).returncode == 0
        yield db, box, certs, agents
    finally:
        for agent in agents:
            agent.stop()  # by pid
        manager.stop()
        box.stop()


def hosts(db) -> dict:
    r = dxpu("host", "ls", "--json", "--db", str(db))
    assert r.returncode == 0, r.stderr
    return {h["name"]: h for h in json.loads(r.stdout)}


def agent_serve(db: Path, host: str) -> AgentProcess:
    """``dxpu agent serve`` for ``host``, its output in a log of its own beside ``db``."""
    return AgentProcess(host, db.parent / f"agent-{host}-{time.monotonic_ns()}.log", db=db, ttl=1.5).start()


def test_an_agent_killed_keeps_its_device_until_dxpu_host_fence_then_its_link_is_refused(pool):
    db, box, certs, agents = pool
    agents.append(agent_serve(db, "h1"))
    eventually(lambda: hosts(db).get("h1", {}).get("alive"), timeout=20, what="h1's agent registered")

    # h1 held td0: its lease (as its agent writes it) and its host proxy's link to the box
    store = Store(db)
    [lease] = store.allocate("qmp:/run/h1/vm1.qmp", device="td0", host="h1")
    pool_id = store.pool_id
    store.close()
    token = grant_token(f"127.0.0.1:{box.port}", str(certs), "td0", lease.id, fence=lease.fence, holder="h1",
                        pool=pool_id)
    link = connect_remote(f"127.0.0.1:{box.port}", "td0", token, TlsFiles.in_dir(certs, "host"))

    agents[0].process.send_signal(signal.SIGKILL)
    agents[0].process.wait(10)
    eventually(lambda: not hosts(db)["h1"]["alive"], timeout=10, what="h1's agent seen dead")
    assert hosts(db)["h1"]["leases"] == 1 and link.endpoint.up  # it keeps its device meanwhile

    r = dxpu("host", "fence", "h1", "--json", "--db", str(db))
    assert r.returncode == 0, r.stderr
    fenced = json.loads(r.stdout)
    assert fenced["fenced"] and [(x["lease"], x["token"]) for x in fenced["leases"]] == [(lease.id, "revoked")]
    eventually(lambda: not link.endpoint.up, what="the fenced host's link cut")
    link.close()
    with pytest.raises(RemoteAttachError, match="lease token refused"):
        connect_remote(f"127.0.0.1:{box.port}", "td0", token, TlsFiles.in_dir(certs, "host"))
    assert hosts(db)["h1"]["fenced"] and hosts(db)["h1"]["leases"] == 0

    restarted = agent_serve(db, "h1")  # its agent comes back: it must not serve
    agents.append(restarted)
    assert restarted.process.wait(30) == 1
    err = restarted.log_path.read_text()
    assert "host h1 is fenced" in err and "fix: " in err and "dxpu host unfence h1" in err

    r = dxpu("host", "unfence", "h1", "--db", str(db))
    assert r.returncode == 0 and "no longer fenced" in r.stdout
    r = dxpu("host", "unfence", "h1", "--db", str(db))
    assert r.returncode == 1 and "host h1 is not fenced" in r.stderr and "fix: dxpu host ls" in r.stderr


def test_attach_to_a_host_without_agent_says_what_to_run(pool):
    db, *_ = pool
    r = dxpu("attach", "/run/h9/vm.qmp", "--host", "h9", "--db", str(db))
    assert r.returncode == 1 and "host h9 has no live agent" in r.stderr
    assert "fix: start it there: dxpu agent serve --host h9" in r.stderr
    r = dxpu("attach", "/run/h9/vm.qmp", "--host", "h9", "--dry-run", "--json", "--db", str(db))
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["dry_run"] and plan["host"] == "h9" and plan["steps"][-1]["do"] == "agent"
    assert hosts(db) == {}  # nothing was written
