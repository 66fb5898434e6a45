"""Processes we start, ended by pid, and the JSON counters they write on SIGUSR1.

Every long-running piece (QEMU, device servers, remote proxies, link emulators) is a child
process; these helpers are the one way they are stopped and asked for counters.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable


def _raise_system_exit(code: int) -> None:
    raise SystemExit(code)


def exit_on_sigterm(stop: Callable[[int], None] = _raise_system_exit) -> None:
    """Make SIGTERM end this (main-thread) program as ``sys.exit(143)`` would: ``finally``
    blocks and context managers then run, so a script stopped by SIGTERM removes its temp
    dirs, labs and VMs as after a clean run. ``stop(143)`` raises what unwinds the program
    (pytest needs its own exit: it takes SystemExit for one failed test). A second SIGTERM
    during that cleanup is ignored (SIGKILL still ends it). Outside the main thread (where
    signals cannot be handled) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return
    owner = os.getpid()

    def handler(signum: int, _frame: object) -> None:
        if os.getpid() != owner:
            # a forked child (pyroute2 forks helpers into namespaces and ends them with
            # SIGTERM) must not unwind the parent's stack: its finally blocks would remove
            # the parent's lab while the parent still builds it
            os._exit(128 + signum)
        signal.signal(signal.SIGTERM, lambda *_: None)  # a function, not SIG_IGN: children reset it
        stop(128 + signum)
    signal.signal(signal.SIGTERM, handler)


class ChildProcess:
    """A process we started: its pid, whether it runs, and its end (by pid)."""

    process: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


def terminate(process: subprocess.Popen | None, timeout: float = 5.0) -> None:
    """SIGCONT (a stopped process cannot exit), SIGTERM, then SIGKILL; always reaped."""
    if process is None or process.poll() is not None:
        return
    for sig, wait in ((signal.SIGCONT, 0.0), (signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        try:
            os.kill(process.pid, sig)
            if wait:
                process.wait(wait)
                return
        except ProcessLookupError:
            process.poll()
            return
        except subprocess.TimeoutExpired:
            continue


def pin_threads(pid: int, cpus: set[int]) -> None:
    """Pin every thread process ``pid`` has now to ``cpus`` (threads it starts later inherit
    their creator's CPUs); a thread that ends meanwhile is skipped. For benchmarks."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass


M_ARENA_MAX = -8  # glibc's mallopt parameter


def limit_malloc_arenas(count: int = 2) -> bool:
    """Cap this process's glibc malloc arenas (``mallopt(M_ARENA_MAX)``); call it before
    threads start. A thread may get an arena of its own, and an arena keeps what its thread
    freed, so a server that starts threads for every connection grows by arenas: a box under
    the link fuzzer's reconnects grew from 24 to 138 MiB in 300 s, and to 66 MiB with one
    arena (what numpy and BLAS take once), 71 with two. False where malloc is not glibc's."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_ARENA_MAX, count))


def pid_alive(pid: int) -> bool:
    """A process with this pid exists (zombies included: they still hold the pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def process_start_time(pid: int) -> int | None:
    """When the process started, in clock ticks since boot (/proc/PID/stat field 22);
    None if it does not exist. A pid plus its start time names one process for good:
    a recycled pid has a later start time."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may contain spaces or ')'
    return int(stat[stat.rindex(")") + 2:].split()[19])


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` s pass; returns its last truth value.
    Every wait in dxpu is bounded: this is the one polling loop."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def terminate_pid(pid: int, timeout: float = 5.0) -> None:
    """The same for a process that is not our Popen (e.g. recorded in a lab's state file)."""
    for sig in (signal.SIGCONT, signal.SIGTERM):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return  # our child, now reaped
        except ChildProcessError:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def write_json_atomic(path: Path, data: object) -> None:
    """Readers never see half a file."""
    write_bytes_atomic(path, json.dumps(data, indent=1, default=str).encode())


def write_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    tmp.write_bytes(data)
    tmp.rename(path)


class RequestRefused(Exception):
    """The process wrote why it could not answer (its error file) instead of the answer."""


def request_file(pid: int, path: Path, sig: int = signal.SIGUSR1, timeout: float = 5.0,
                 error_path: Path | None = None) -> bytes | None:
    """Send ``sig`` and return what the process then (re)writes at ``path``; None on timeout.
    If it (re)writes ``error_path`` instead, RequestRefused with that file's text: the asker
    learns why at once instead of waiting out ``timeout`` for a file that will not come."""
    path = Path(path)
    watched = [path] + ([Path(error_path)] if error_path is not None else [])
    before = [p.stat().st_mtime_ns if p.exists() else 0 for p in watched]
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p, then in zip(watched, before):
            if p.exists() and p.stat().st_mtime_ns != then:
                if p == path:
                    return path.read_bytes()
                raise RequestRefused(p.read_text(errors="replace").strip())
        time.sleep(0.01)
    return None


def request_json(pid: int, path: Path, timeout: float = 5.0) -> dict | None:
    """Send SIGUSR1 and return the JSON the process then (re)writes at ``path``; None on timeout."""
    deadline = time.monotonic() + timeout
    while (data := request_file(pid, path, signal.SIGUSR1, max(0.1, deadline - time.monotonic()))) is not None:
        try:
            return json.loads(data)
        except ValueError:
            if time.monotonic() > deadline:  # caught an old writer between write and rename
                return None
    return None
