"""Nothing left behind: a script stopped by SIGTERM cleans up as after a clean run
(its temp dirs, its lab), because SIGTERM is turned into SystemExit
(:func:`dxpu_vfio.procs.exit_on_sigterm`)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dxpu_vfio.lab import lab
from dxpu_vfio.paths import PROJECT_ROOT


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_sigterm_runs_the_finally_blocks(tmp_path):
    script = ("import shutil, sys, tempfile, time\n"
              "from dxpu_vfio.procs import exit_on_sigterm\n"
              "exit_on_sigterm()\n"
              "work = tempfile.mkdtemp()\n"
              "try:\n"
              "    print(work, flush=True)\n"
              "    time.sleep(60)\n"
              "finally:\n"
              "    shutil.rmtree(work)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    work = Path(proc.stdout.readline().strip())
    assert work.is_dir() and work.parent == tmp_path
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 128 + signal.SIGTERM
    assert not work.exists()


def test_bench_nvme_stopped_by_sigterm_leaves_no_lab_and_no_disk_images(tmp_path):
    """SIGTERM while the benchmark brings its lab up (or later): its work dir (disk images
    of --size-mib each) and its lab (namespaces, proxies) are gone when it has exited."""
    proc = subprocess.Popen([sys.executable, str(PROJECT_ROOT / "scripts" / "bench_nvme.py"), "--size-mib", "8",
                             "--depths", "1", "--runtime", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        wait_for(lambda: list(tmp_path.glob("dxpu-bench-nvme-*")), 60, "the benchmark made no work dir")
        wait_for(lambda: lab.lab_dir("bn").exists(), 60, "the benchmark started no lab")
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        # 143, or 1 where the SystemExit surfaced inside a netlink call as another error
        assert proc.wait(120) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            lab.down("bn")
    assert list(tmp_path.glob("dxpu-bench-nvme-*")) == []
    assert not lab.lab_dir("bn").exists()
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "dxbn-" not in namespaces
    assert not [pid for pid in os.listdir("/proc") if pid.isdigit() and b"/lab-bn/" in _cmdline(pid)], \
        "a remote proxy of the benchmark's lab is still running"


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_sigterm_to_a_forked_child_does_not_run_the_parents_cleanup(tmp_path):
    """exit_on_sigterm in a script whose library forks (pyroute2 forks helpers into network
    namespaces and ends them with SIGTERM): the child must die at once, not raise SystemExit
    through the parent's stack, whose finally blocks removed the lab being built."""
    marker = tmp_path / "cleanup-ran-in"
    script = f"""
import os, signal, sys, time
sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
from dxpu_vfio.procs import exit_on_sigterm
exit_on_sigterm()
parent = os.getpid()
ready_r, ready_w = os.pipe()
try:
    child = os.fork()
    if child == 0:
        os.write(ready_w, b"!")  # a signal before the child runs Python is dropped by CPython
        time.sleep(30)
        os._exit(0)
    os.read(ready_r, 1)
    os.kill(child, signal.SIGTERM)
    _, status = os.waitpid(child, 0)
    print("child", os.waitstatus_to_exitcode(status))
finally:
    if os.getpid() != parent:
        open({str(marker)!r}, "a").write("child")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "child 143" in out.stdout
    assert not marker.exists(), "the forked child ran the parent's finally block"


def test_a_test_run_stopped_by_sigterm_tears_its_fixtures_down(tmp_path):
    """pytest with the project's plugin, stopped by SIGTERM in the middle of a test (as CI's
    time limit would): the session fixture's teardown runs, as it would after Ctrl-C, so
    what it owns (a lab, VMs, proxies) does not outlive the run."""
    started, torn_down = tmp_path / "started", tmp_path / "torn-down"
    (tmp_path / "test_stopped.py").write_text(
        "import time\n"
        "import pytest\n\n"
        "@pytest.fixture(scope='session')\n"
        "def owned():\n"
        "    yield\n"
        f"    open({str(torn_down)!r}, 'w').close()\n\n"
        "def test_long(owned):\n"
        f"    open({str(started)!r}, 'w').close()\n"
        "    time.sleep(60)\n")
    output = tmp_path / "pytest.out"
    with open(output, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "dxpu_vfio.testing", "-q", "-p", "no:cacheprovider",
                                 "--rootdir", str(tmp_path), "--basetemp", str(tmp_path / "inner-tmp"),
                                 str(tmp_path / "test_stopped.py")],
                                cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    try:
        wait_for(lambda: started.exists() or proc.poll() is not None, 60, "the inner test never started")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 128 + signal.SIGTERM, output.read_text()
        assert torn_down.exists(), "the session fixture was not torn down after SIGTERM"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_every_benchmark_that_starts_a_lab_or_a_vm_turns_sigterm_into_its_cleanup():
    """A benchmark stopped by SIGTERM runs its ``finally`` blocks only if it asked for it
    (``exit_on_sigterm``); one that forgot would leave its lab or VMs running. The one
    stopped above shows the mechanism; this keeps every such script under it."""
    scripts = {p.name: p.read_text() for p in sorted((PROJECT_ROOT / "scripts").glob("bench_*.py"))}
    forgot = [name for name, text in scripts.items()
              if any(s in text for s in ("lab.up(", "Vm(", "accel_paths.")) and "exit_on_sigterm()" not in text]
    assert not forgot, f"these benchmarks leave their lab or VMs behind on SIGTERM: {forgot}"
