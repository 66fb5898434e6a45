"""Helpers for the processes we start (dxpu_vfio/procs.py) that the other tests do not cover."""

import os
import subprocess
import sys

import pytest

from dxpu_vfio.procs import pin_threads, terminate


def allowed(pid: int, tid: str) -> str:
    status = open(f"/proc/{pid}/task/{tid}/status").read()
    return next(line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list"))


def test_pin_threads_moves_every_thread_and_new_threads_follow_their_creator():
    """What bench_accel --device-cpu and bench_mmio rely on: the threads a process has are
    pinned, and one it starts afterwards runs where its creator does."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.fail(f"this test needs two CPUs to pin to one of them; this process may use {cpus}")
    code = ("import sys, threading, time\n"
            "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
            "print('ready', flush=True)\n"
            "sys.stdin.readline()\n"
            "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
            "print('more', flush=True)\n"
            "time.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        before = os.listdir(f"/proc/{proc.pid}/task")
        pin_threads(proc.pid, {cpus[-1]})
        assert {allowed(proc.pid, tid) for tid in before} == {str(cpus[-1])}
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "more"
        tids = os.listdir(f"/proc/{proc.pid}/task")
        assert len(tids) > len(before)
        assert {allowed(proc.pid, tid) for tid in tids} == {str(cpus[-1])}
    finally:
        terminate(proc)
