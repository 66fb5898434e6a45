"""Parent-side handle on a remote proxy process (:mod:`dxpu_vfio.remoteproxy.main`): start it
(optionally inside a lab namespace), read its counters, stop it by pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dxpu_vfio import registry
from dxpu_vfio.errors import DxpuError
from dxpu_vfio.procs import ChildProcess, request_json, terminate, wait_until


class RemoteProxyError(DxpuError):
    pass


class RemoteProxyProcess(ChildProcess):
    def __init__(self, config: Path, *, netns: str | None = None, log_path: Path | None = None) -> None:
        self.config = Path(config)
        self.netns = netns
        self.log_path = log_path or self.config.with_suffix(".log")
        self.stats_path = self.config.with_suffix(".stats.json")
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 15.0) -> "RemoteProxyProcess":
        argv = [sys.executable, "-m", "dxpu_vfio.remoteproxy", "--config", str(self.config),
                "--stats", str(self.stats_path)]
        if self.netns:
            argv = ["ip", "netns", "exec", self.netns, *argv]
        with open(self.log_path, "ab") as log:
            start_at = log.tell()
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        deadline = time.monotonic() + timeout
        try:
            while b"serving" not in self.log_path.read_bytes()[start_at:]:
                if not self.alive() or time.monotonic() > deadline:
                    raise RemoteProxyError(f"remote proxy for {self.config} did not start", logs=[self.log_path])
                time.sleep(0.05)
        except BaseException:  # SystemExit (SIGTERM) too: the caller never learns of this process
            self.stop()
            raise
        return self

    def stats(self, timeout: float = 5.0) -> dict:
        stats = request_json(self.pid, self.stats_path, timeout) if self.alive() else None
        if stats is None:
            raise RemoteProxyError("remote proxy did not write its stats", logs=[self.log_path])
        return stats

    def signal(self, sig: int) -> None:
        """For failure tests: SIGKILL, SIGSTOP, SIGCONT. Returns once a SIGSTOP took effect
        (kill() does not wait for it: a stopped box must not still answer the next request)."""
        os.kill(self.pid, sig)
        if sig == signal.SIGSTOP:
            wait_until(lambda: _state(self.pid) in ("T", "t", None), 5.0, interval=0.005)

    def stop(self, timeout: float = 5.0) -> None:
        terminate(self.process, timeout)
        registry.sweep()  # its entry, if it was killed and could not remove it


def freeze(pid: int) -> None:
    """SIGSTOP a box and return once it is stopped (a frozen box answers nothing)."""
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: _state(pid) in ("T", "t", None), 5.0, interval=0.005)


def thaw(pid: int) -> None:
    os.kill(pid, signal.SIGCONT)


def _state(pid: int) -> str | None:
    """The scheduler state of a process (/proc/PID/stat field 3), None if gone."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2]
