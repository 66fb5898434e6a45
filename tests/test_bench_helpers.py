"""The benchmark scripts' shared helpers (dxpu_vfio/bench.py) that a profile rests on: the
per-thread CPU read from /proc and the counters two stats snapshots are subtracted by."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time

from dxpu_vfio.bench import flat_counters, thread_names, thread_times


def _burn(seconds: float) -> None:
    """CPU for ``seconds``, mostly outside the GIL (hashlib lets go of it for large data):
    a burner holding the GIL would starve the snapshots' file reads, and a snapshot slower
    than the burn (many threads in the process) would see none of it."""
    data = bytes(1 << 20)
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        hashlib.sha256(data).digest()


def test_thread_times_charge_a_busy_thread_and_not_an_idle_one():
    """The busy thread's ticks grow by about the CPU it used; a thread that only sleeps
    stays near zero. A profile that charged CPU to the wrong thread would send the next
    optimisation to the wrong place."""
    ready, stop = threading.Barrier(3), threading.Event()
    tids: dict[str, int] = {}

    def busy() -> None:
        tids["busy"] = threading.get_native_id()
        ready.wait()
        _burn(0.3)
        stop.wait(10)

    def idle() -> None:
        tids["idle"] = threading.get_native_id()
        ready.wait()
        stop.wait(10)

    threads = [threading.Thread(target=busy), threading.Thread(target=idle)]
    for thread in threads:
        thread.start()
    ready.wait()
    before = thread_times(os.getpid())
    time.sleep(0.6)  # the busy thread burns its 0.3 s of CPU meanwhile
    after = thread_times(os.getpid())
    names = thread_names(os.getpid())
    stop.set()
    for thread in threads:
        thread.join()
    tick = 1 / os.sysconf("SC_CLK_TCK")

    def cpu(name: str) -> float:
        (u0, s0, *_), (u1, s1, *_) = before[tids[name]], after[tids[name]]
        return (u1 + s1 - u0 - s0) * tick

    assert 0.2 <= cpu("busy") <= 0.5, cpu("busy")
    assert cpu("idle") <= 0.05, cpu("idle")
    assert after[tids["idle"]].runq_wait_ns - before[tids["idle"]].runq_wait_ns < 50_000_000
    assert names[os.getpid()]  # every thread has its comm, the main one included
    assert set(names) >= {tids["busy"], tids["idle"]}


BURNER = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
print("pinned", flush=True)
sys.stdin.readline()
end = time.thread_time() + 0.4
while time.thread_time() < end:
    pass
print("burnt", flush=True)
sys.stdin.readline()
"""


def test_thread_times_count_the_wait_for_a_core():
    """Two processes that burn 0.4 s of CPU each on one core: each spends about as long
    runnable, waiting for the core, as the other one runs. That wait is what tells a
    thread kept from a core apart from an idle one (both show little CPU)."""
    cpu = min(os.sched_getaffinity(0))
    burners = [subprocess.Popen([sys.executable, "-c", BURNER, str(cpu)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for burner in burners:
            assert burner.stdout.readline() == "pinned\n"
        before = [thread_times(burner.pid)[burner.pid] for burner in burners]
        for burner in burners:
            burner.stdin.write("go\n")
            burner.stdin.flush()
        for burner in burners:
            assert burner.stdout.readline() == "burnt\n"
        after = [thread_times(burner.pid)[burner.pid] for burner in burners]
    finally:
        for burner in burners:
            burner.kill()
            burner.wait(10)
    waited = [(a.runq_wait_ns - b.runq_wait_ns) / 1e9 for a, b in zip(after, before)]
    assert all(0.1 <= w <= 2.0 for w in waited), waited  # each waited through much of the other's 0.4 s


def test_flat_counters_join_nested_keys_and_keep_counts_only():
    stats = {"device": {"commands": 7, "link": {"stream": {"bytes_in": 4096}}, "attach_error": None},
             "server": {"commands": {"REGION_WRITE": {"count": 3, "mean_us": 1.5, "max_us": 9.0}}},
             "enabled": True, "model": "nvme", "ratio": 0.25}
    assert flat_counters(stats) == {"device.commands": 7, "device.link.stream.bytes_in": 4096,
                                    "server.commands.REGION_WRITE.count": 3, "ratio": 0.25}
