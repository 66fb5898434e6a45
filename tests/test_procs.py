"""Helpers for the processes we start (dxpu_vfio/procs.py) that the other tests do not cover."""

import os
import subprocess
import sys
from pathlib import Path

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


ARENAS = ("import ctypes, sys, threading\n"
          "from dxpu_vfio.procs import limit_malloc_arenas\n"
          "if sys.argv[1] == 'capped': assert limit_malloc_arenas(1)\n"
          "barrier = threading.Barrier(8)\n"
          "def work():\n"
          "    barrier.wait()  # all at once: each may be given an arena of its own\n"
          "    for _ in range(50): bytearray(1 << 20)\n"
          "threads = [threading.Thread(target=work) for _ in range(8)]\n"
          "[t.start() for t in threads]; [t.join() for t in threads]\n"
          "ctypes.CDLL(None).malloc_stats()\n")


def test_a_capped_process_keeps_one_malloc_arena_however_many_threads_allocate():
    """What the box relies on (remoteproxy/main.py): threads it starts for each link share
    the capped arenas instead of each keeping one (glibc's malloc_stats lists them)."""
    def arenas(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", ARENAS, mode], capture_output=True, text=True, timeout=60,
                             cwd=Path(__file__).resolve().parents[1])
        assert out.returncode == 0, out.stderr
        return out.stderr.count("Arena ")
    assert arenas("capped") == 1
    assert arenas("free") > 1
