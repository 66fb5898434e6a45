"""The proxies' process skeleton (dxpu_vfio/daemon.py): what a control-plane request by
signal may and may not do to the process that serves a guest's device."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dxpu_vfio.daemon import screenshot_error_path, screenshot_path
from dxpu_vfio.procs import RequestRefused, request_file, request_json, terminate

ROOT = Path(__file__).resolve().parent.parent

# A stand-in proxy: with "raise-first" its first snapshot raises (a device's stats() caught
# mid-change), the next ones answer; its display renders once and then has a mode that
# cannot be shown.
PROXY = textwrap.dedent("""
    import logging, sys
    from pathlib import Path
    from dxpu_vfio.daemon import run_until_terminated
    logging.basicConfig(filename=sys.argv[2], level=logging.INFO)
    calls = {"stats": 0, "shots": 0}
    def snapshot():
        calls["stats"] += 1
        if calls["stats"] == 1 and sys.argv[3] == "raise-first":
            raise RuntimeError("dictionary changed size during iteration")
        return {"stats_calls": calls["stats"]}
    def render():
        calls["shots"] += 1
        if calls["shots"] > 1:
            raise ValueError("mode 65535x65535x32 exceeds 16000x12000x32")
        return b"PNG"
    run_until_terminated("host", "stand-in", Path(sys.argv[1]), snapshot,
                         screenshots=lambda: [(None, render)], on_ready=lambda: print("ready", flush=True))
""")


@pytest.fixture
def proxy(tmp_path, request):
    stats = tmp_path / "p.stats.json"
    mode = getattr(request, "param", "plain")
    proc = subprocess.Popen([sys.executable, "-c", PROXY, str(stats), str(tmp_path / "p.log"), mode], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    try:
        assert proc.stdout.readline() == "ready\n"
        yield proc, stats, tmp_path / "p.log"
    finally:
        terminate(proc, 5)


@pytest.mark.allow_tracebacks("the stand-in's first snapshot raises on purpose; the test reads the log")
@pytest.mark.parametrize("proxy", ["raise-first"], indirect=True)
def test_a_snapshot_that_raises_is_logged_and_the_proxy_serves_on(proxy):
    """A stats request runs in the signal handler of the main thread: an exception there
    used to end the process that serves the guest's device. Now it is logged (a traceback
    the fuzzers and the test logs show) and the next request is answered."""
    proc, stats, log = proxy
    assert request_json(proc.pid, stats, timeout=1.0) is None  # the first one wrote nothing
    assert proc.poll() is None, "a stats request ended the proxy"
    assert request_json(proc.pid, stats, timeout=5.0) == {"stats_calls": 2}
    assert "stats not written" in log.read_text() and "Traceback" in log.read_text()


def test_a_screenshot_that_cannot_be_made_is_refused_with_the_reason(proxy):
    """The second screenshot's mode cannot be shown: the asker gets the reason from the
    error file beside the PNG at once, not a timeout; the process serves on."""
    proc, stats, _ = proxy
    png = screenshot_path(stats)
    assert request_file(proc.pid, png, signal.SIGUSR2, 5.0, error_path=screenshot_error_path(png)) == b"PNG"
    with pytest.raises(RequestRefused, match="65535x65535x32 exceeds"):
        request_file(proc.pid, png, signal.SIGUSR2, 5.0, error_path=screenshot_error_path(png))
    assert proc.poll() is None
