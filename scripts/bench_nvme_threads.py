#!/usr/bin/env python3
"""Where an NVMe I/O's CPU goes, thread by thread: one fio workload on one of our
controllers (a GPU box's over the lab link, or one the host proxy serves locally) in a
`full` guest, and the CPU each thread of QEMU, the host proxy and the box spent per I/O
while it ran (user + system ticks from ``/proc/PID/task/*/stat``, so threads of a few µs
per I/O round to 0; with context switches per I/O, and the time each spent runnable but
waiting for a core, from ``schedstat``). Where ``bench_nvme.py`` says how fast,
this says who paid: the profile to take before changing the data path.

``--py-spy FILE`` also records the Python of the process that runs the controller (py-spy,
raw format, 200 Hz, idle threads included): the box on ``--path remote``, the host proxy on
``--path local``. It slows that process, so the table of that run is not the one to quote.

Then the guest's own /proc/stat per I/O (its CPU by kind, interrupts, context switches:
what QEMU's vCPU threads spent it on) and the host proxy's counters that moved, per I/O
(its messages, interrupts, DMA: what each I/O asked of it). Tables on stdout, JSON in
results/bench/nvme_threads.json (``results -> process -> tid -> {name, us_per_io,
switches_per_io, runq_wait_us_per_io}``, ``totals_us_per_io``, ``cores``, ``waiting``,
``guest_per_io``, ``host_proxy_counters_per_io``).

    .venv/bin/python scripts/bench_nvme_threads.py [--path remote] [--rw read] [--bs 128k] [--depth 16]
        [--runtime 15] [--guest-cpus 2] [--py-spy box.txt]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dxpu_vfio.bench import ThreadTimes, flat_counters, table, thread_names, thread_times, write_json  # noqa: E402
from dxpu_vfio.lab import guest_output, hotplug, lab  # noqa: E402
from dxpu_vfio.lab.guest_devices import fio, nvme_disk  # noqa: E402
from dxpu_vfio.procs import exit_on_sigterm  # noqa: E402
from dxpu_vfio.vms.runner import Vm, VmConfig  # noqa: E402

WARM_UP_S = 2
PY_SPY = Path(sys.executable).parent / "py-spy"


def per_io(before: dict, after: dict, names: dict, ios: int) -> dict:
    """tid -> {name, us_per_io, switches_per_io, runq_wait_us_per_io} for the threads that
    ran in between."""
    tick_us = 1e6 / os.sysconf("SC_CLK_TCK")
    out = {}
    for tid, now in after.items():
        then = before.get(tid, ThreadTimes(0, 0, 0, 0))
        out[tid] = {"name": names.get(tid, "?"),
                    "us_per_io": (now.user + now.system - then.user - then.system) * tick_us / ios,
                    "switches_per_io": (now.switches - then.switches) / ios,
                    "runq_wait_us_per_io": (now.runq_wait_ns - then.runq_wait_ns) / 1e3 / ios}
    return out


GUEST_CPU_FIELDS = guest_output.STAT_CPU
GUEST_USER_HZ = 100  # what the guest's /proc/stat counts CPU in (USER_HZ, 100 on x86 Linux)


def guest_stat(vm: Vm) -> dict[str, int]:
    """The guest's own accounting from its /proc/stat: CPU ticks (USER_HZ) by kind over all
    vCPUs, interrupts and context switches. What QEMU's CPU per I/O was spent on, as the
    guest saw it (TCG runs the guest's kernel and fio on QEMU's vCPU threads)."""
    return guest_output.proc_stat(vm.run("cat /proc/stat", timeout=30).stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", choices=("remote", "local"), default="remote")
    parser.add_argument("--rw", choices=("read", "write", "randread", "randwrite"), default="read")
    parser.add_argument("--bs", default="128k")
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--runtime", type=int, default=15, help="seconds measured (after a warm-up of 2)")
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--guest-cpus", type=int, default=2)
    parser.add_argument("--py-spy", type=Path,
                        help="also record the controller's process here (the box, or the host proxy on --path local;"
                             " raw format; slows it)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.py_spy and not PY_SPY.exists():
        parser.error("--py-spy needs py-spy: .venv/bin/pip install py-spy")
    exit_on_sigterm()  # a SIGTERM still runs the finally below: no lab, no disk image left
    size = args.size_mib << 20
    work = Path(tempfile.mkdtemp(prefix="dxpu-bench-nvme-threads-"))
    image = work / "ns.img"
    settings = {"namespaces": [{"size": size, "path": str(image)}]}
    topology = lab.Topology("bt", [lab.BoxSpec("box1", [{"id": "nv0", "model": "nvme", "settings": settings}])])
    spy = None
    try:
        image.write_bytes(random.Random(0).randbytes(size))  # no holes: reads come from the page cache
        state = lab.up(topology)
        config = VmConfig(image="full", name="bench-nvme-threads", cpus=args.guest_cpus, boot_timeout=240)
        with Vm(config) as vm:
            vm.boot()
            if args.path == "remote":
                att = hotplug.attach(vm, "remote", settings=state.remote_settings("box1", "nv0"),
                                     netns=state.host_netns)
            else:
                att = hotplug.attach(vm, "nvme", settings=settings)
            pids = {"qemu": vm.pid, "host proxy": att.server.pid}
            if args.path == "remote":
                pids["box"] = state.box("box1").proxy_pid
            dev = nvme_disk(vm, att.guest_bdf)
            fio(vm, dev, args.rw, args.bs, args.depth, WARM_UP_S, args.size_mib)
            names = {name: thread_names(pid) for name, pid in pids.items()}
            counters_before = flat_counters(att.server.stats())  # (read outside the threads' window)
            guest_before = guest_stat(vm)
            before = {name: thread_times(pid) for name, pid in pids.items()}
            if args.py_spy:
                spied = pids.get("box", pids["host proxy"])  # the process that runs the controller
                spy = subprocess.Popen([str(PY_SPY), "record", "--pid", str(spied), "-r", "200", "-d",
                                        str(max(1, args.runtime - 1)), "-f", "raw", "--threads", "--idle",
                                        "-o", str(args.py_spy)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            side = fio(vm, dev, args.rw, args.bs, args.depth, args.runtime, args.size_mib)
            after = {name: thread_times(pid) for name, pid in pids.items()}
            counters_after = flat_counters(att.server.stats())
            guest_after = guest_stat(vm)
            if spy is not None:
                spy.wait(60)
            hotplug.detach(att)
    finally:
        if spy is not None and spy.poll() is None:
            spy.kill()
            spy.wait()
        lab.down(topology.name)  # safe where lab.up never finished
        shutil.rmtree(work, ignore_errors=True)
    ios = max(side["total_ios"], 1)
    results = {name: per_io(before[name], after[name], names[name], ios) for name in pids}
    totals = {name: sum(t["us_per_io"] for t in threads.values()) for name, threads in results.items()}
    cores = sum(totals.values()) * side["iops"] / 1e6
    waiting = sum(t["runq_wait_us_per_io"] for threads in results.values() for t in threads.values()) * side["iops"] / 1e6
    rows = [[name, tid, t["name"], t["us_per_io"], t["runq_wait_us_per_io"], t["switches_per_io"]]
            for name, threads in results.items() for tid, t in sorted(threads.items(), key=lambda kv: -kv[1]["us_per_io"])
            if t["us_per_io"] > 0 or t["runq_wait_us_per_io"] > 1]
    counters = {k: (v - counters_before.get(k, 0)) / ios for k, v in counters_after.items()
                if v != counters_before.get(k, 0)}
    print(f"{args.path} {args.rw} {args.bs} at depth {args.depth}, {args.guest_cpus} vCPUs: "
          f"{side['bw_bytes'] / 1e6:.0f} MB/s, {side['iops']:.0f} IOPS")
    print(table(["process", "tid", "thread", "CPU µs per I/O", "run-queue wait µs per I/O", "switches per I/O"], rows))
    print("per process (µs per I/O): " + ", ".join(f"{n} {v:.0f}" for n, v in totals.items())
          + f"; cores kept busy {cores:.2f} of {os.cpu_count()}; threads waiting for a core {waiting:.2f} (both on average)")
    guest = {k: (guest_after[k] - guest_before[k]) * (1e6 / GUEST_USER_HZ if k in GUEST_CPU_FIELDS else 1) / ios
             for k in guest_before}
    print("\nthe guest's /proc/stat per I/O (CPU in µs over all vCPUs; interrupts, context switches):")
    print(table(["counter", "per I/O"], [[k, v] for k, v in guest.items()]))
    print("\nthe host proxy's counters per I/O (those that moved):")
    print(table(["counter", "per I/O"], [[k, v] for k, v in sorted(counters.items())]))
    path = write_json("nvme_threads", {"path": args.path, "rw": args.rw, "bs": args.bs, "depth": args.depth,
                                       "runtime_s": args.runtime, "guest_cpus": args.guest_cpus,
                                       "MBps": side["bw_bytes"] / 1e6, "iops": side["iops"], "results": results,
                                       "totals_us_per_io": totals, "cores": cores, "waiting": waiting,
                                       "host_proxy_counters_per_io": counters, "guest_per_io": guest,
                                       "py_spy": str(args.py_spy) if args.py_spy else None}, args.out)
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
