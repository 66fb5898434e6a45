"""The lab factory of dxpu_vfio.testing: every lab a session brings up goes down at its
end, also when its tests fail (their logs saved in results/) and after a session that
was killed; shared labs are one per topology and get killed or stopped boxes back; a
served device is what hotplug.attach needs, locally or from a GPU box."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from pyroute2 import netns

from dxpu_vfio.lab import lab
from dxpu_vfio.testing import eventually
from dxpu_vfio.testing.served import Serve, serve_topology

ONE_BOX = lab.Topology("fix", [lab.BoxSpec("box1", [{"id": "td0", "model": "testdev"}])])

INNER_HEAD = '''
import json, os, signal
from dxpu_vfio.lab import lab

TOPOLOGY = lab.Topology("fix", [lab.BoxSpec("box1", [{"id": "td0", "model": "testdev"}])])

def record(state, tag):
    with open(os.environ["INNER_RECORD"] + "." + tag, "w") as f:
        json.dump({"name": state.name, "pids": state.pids, "namespaces": state.namespaces}, f)
'''


def proc_state(pid: int) -> str:
    """R, S, T, Z ... of /proc/PID/stat; X if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "X"
    return stat[stat.rindex(")") + 2]


def running(pid: int) -> bool:
    return proc_state(pid) not in "ZX"


def inner_session(tmp_path: Path, name: str, body: str) -> subprocess.CompletedProcess:
    """pytest on a generated test file, in a process of its own, with the dxpu plugin."""
    work = tmp_path / name
    work.mkdir()
    (work / "conftest.py").write_text('pytest_plugins = ["dxpu_vfio.testing"]\n')
    (work / f"test_{name}.py").write_text(INNER_HEAD + textwrap.dedent(body))
    env = {**os.environ, "INNER_RECORD": str(tmp_path / "record"), "DXPU_RESULTS": str(tmp_path / "results")}
    # its own --basetemp, gone when it returns: pytest keeps a numbered directory of each
    # session in /tmp/pytest-of-<user> for three days otherwise. Not under tmp_path: the
    # outer test's log check would read the inner tests' deliberate tracebacks.
    with tempfile.TemporaryDirectory(prefix="dxpu-inner-") as basetemp:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp",
                               str(Path(basetemp) / "t"), str(work)],
                              cwd=work, env=env, capture_output=True, text=True, timeout=180)


def records(tmp_path: Path) -> dict[str, dict]:
    return {p.suffix[1:]: json.loads(p.read_text()) for p in tmp_path.glob("record.*")}


def assert_gone(rec: dict) -> None:
    assert not [ns for ns in netns.listnetns() if ns.startswith(f"dx{rec['name']}-")], rec
    assert not [pid for pid in rec["pids"] if running(pid)], rec
    assert not lab.lab_dir(rec["name"]).exists(), rec


def test_labs_go_down_at_session_end_and_a_failed_tests_lab_logs_are_saved(tmp_path):
    proc = inner_session(tmp_path, "ends", '''
        def test_shared_lab_and_fails(labs):
            record(labs.shared(TOPOLOGY), "shared")
            assert False, "fails on purpose"

        def test_own_lab_and_passes(labs):
            record(labs.own(TOPOLOGY), "own")
    ''')
    assert proc.returncode == 1 and "1 failed, 1 passed" in proc.stdout, proc.stdout + proc.stderr
    recs = records(tmp_path)
    assert set(recs) == {"shared", "own"} and recs["shared"]["name"] != recs["own"]["name"]
    for rec in recs.values():
        assert_gone(rec)
    [failed] = (tmp_path / "results").iterdir()  # nothing saved for the test that passed
    assert "test_shared_lab_and_fails" in failed.name
    saved = failed / f"lab-{recs['shared']['name']}"
    assert "serving" in (saved / "box1.log").read_text()  # the box's remote proxy log
    assert {"state.json", "box1.toml", "status.json"} <= {p.name for p in saved.iterdir()}
    assert not (saved / "certs").exists()  # no keys in results
    assert json.loads((saved / "status.json").read_text())["boxes"][0]["proxy_alive"]
    assert f"saved in {failed}: lab-{recs['shared']['name']}" in proc.stdout  # the report says where


def test_labs_of_a_killed_session_are_removed_by_the_next_one(tmp_path):
    killed = inner_session(tmp_path, "killed", '''
        def test_killed(labs):
            record(labs.shared(TOPOLOGY), "killed")
            os.kill(os.getpid(), signal.SIGKILL)
    ''')
    assert killed.returncode == -signal.SIGKILL
    rec = records(tmp_path)["killed"]
    assert lab.lab_dir(rec["name"]).exists() and all(running(pid) for pid in rec["pids"])  # left behind
    after = inner_session(tmp_path, "next", '''
        def test_uses_the_factory(lab_factory):
            pass
    ''')
    assert after.returncode == 0, after.stdout + after.stderr
    assert_gone(rec)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_a_shared_lab_gets_back_a_box_a_test_killed_or_stopped(labs, sig):
    state = labs.shared(ONE_BOX)
    old = state.box("box1").proxy_pid
    os.kill(old, sig)
    eventually(lambda: proc_state(old) in ("T", "Z", "X"), what=f"signal {sig} taking effect")
    again = labs.shared(lab.Topology("other", ONE_BOX.boxes))  # same boxes, same lab
    assert again is state and again.name == state.name
    new = state.box("box1").proxy_pid
    assert new != old and running(new) and not running(old)
    assert old not in state.pids and new in state.pids
    assert lab.status(state.name)["boxes"][0]["proxy_alive"]


@pytest.fixture(scope="module")
def served_specs():
    return [Serve("testdev", "td0", "box1"), Serve("testdev", "td1", "box2", local={"msix": False})]


def test_served_devices_are_what_attach_needs(served, served_devices, labs):
    first, second = served_devices
    if served == "local":
        assert first.attach_args() == {"model": "testdev", "settings": {}, "netns": None}
        assert second.attach_args(x=1) == {"model": "testdev", "settings": {"msix": False, "x": 1}, "netns": None}
        assert first.lab is None and first.name is None
        return
    state = first.lab
    assert labs.shared(serve_topology([Serve("testdev", "td0", "box1"), Serve("testdev", "td1", "box2")])) is state
    assert first.attach_args() == {"model": "remote", "settings": state.remote_settings("box1", "td0"),
                                   "netns": state.host_netns}
    assert (second.name, second.settings["address"]) == ("box2/td1", state.box("box2").endpoint)
    stats = second.box_stats()
    assert stats["box"] == "box2" and list(stats["devices"]) == ["td1"]


def test_a_traceback_in_a_log_fails_the_test_that_caused_it(tmp_path):
    """Issue 18: no uncaught exception in any proxy. A process of the test that logs a
    Python traceback (here, a child that dies of one, its output in a log) fails the test;
    a test marked allow_tracebacks, or one whose logs are clean, passes."""
    result = inner_session(tmp_path, "tracebacks", '''
        import subprocess, sys
        import pytest

        def crash(log):
            with open(log, "wb") as out:
                subprocess.run([sys.executable, "-c", "raise KeyError('nmi')"], stderr=out)

        def test_crashing_child(tmp_path):
            crash(tmp_path / "proxy.log")

        @pytest.mark.allow_tracebacks("the crash is the point")
        def test_allowed(tmp_path):
            crash(tmp_path / "proxy.log")

        def test_clean(tmp_path):
            (tmp_path / "proxy.log").write_text("all good\\n")
    ''')
    assert "ERROR test_tracebacks.py::test_crashing_child" in result.stdout, result.stdout
    assert "3 passed, 1 error" in result.stdout, result.stdout  # the other two pass (its call passed too)
    assert "logged a Python traceback" in result.stdout and "KeyError: 'nmi'" in result.stdout
