#!/usr/bin/env python3
"""MMIO through the vfio-user server, beside QEMU's own device and the raw socket cost.

In one run, on one booted tiny guest (TCG):
  * guest-measured 32-bit read latency of the test device's scratch register through
    our vfio-user server, and posted-write rate;
  * the same on QEMU's built-in ``edu`` device (a local baseline);
  * the raw round trip of a 32-byte message between two Python processes over a UNIX
    socket pair (what one vfio-user read costs at the least);
  * the server's own processing time per REGION_READ (measured inside the server);
each with no pinning, with QEMU and the server pinned to the same CPU, and to
different CPUs. Prints a table and writes results/bench/mmio.json.

    .venv/bin/python scripts/bench_mmio.py [--reads 20000] [--writes 50000]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from multiprocessing import Process
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dxpu_vfio.bench import table, write_json  # noqa: E402
from dxpu_vfio.lab import guest_output, hotplug  # noqa: E402
from dxpu_vfio.procs import exit_on_sigterm, pin_threads  # noqa: E402
from dxpu_vfio.vms.runner import Vm, VmConfig  # noqa: E402

EDU = "0000:00:05.0"
SCRATCH = 0x08
CPUS = sorted(os.sched_getaffinity(0))


def _echo(sock: socket.socket, cpus: set[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    while data := sock.recv(64):
        sock.sendall(data)


def raw_round_trip(n: int, server_cpus: set[int] | None, client_cpus: set[int] | None) -> float:
    """Median µs of a 32-byte request/reply between two processes over a UNIX socket."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    peer = Process(target=_echo, args=(b, server_cpus), daemon=True)
    peer.start()
    old = os.sched_getaffinity(0)
    if client_cpus:
        os.sched_setaffinity(0, client_cpus)
    msg, samples = b"x" * 32, []
    try:
        for _ in range(200):
            a.sendall(msg); a.recv(64)
        for _ in range(n):
            t = time.perf_counter_ns()
            a.sendall(msg)
            a.recv(64)
            samples.append(time.perf_counter_ns() - t)
    finally:
        os.sched_setaffinity(0, old)
        a.close()
        peer.join(5)
        b.close()
    samples.sort()
    return samples[len(samples) // 2] / 1000


def guest_kv(vm: Vm, cmd: str, key: str) -> dict[str, float]:
    return guest_output.numbers(vm.run(cmd, timeout=600).stdout, (key,), "dxpu-mmio")


def measure(vm: Vm, bdf: str, reads: int, writes: int) -> dict:
    dev = guest_output.numbers(vm.run(f"dxpu-mmio {bdf} 0 time-read {SCRATCH} {reads}", timeout=600).stdout,
                               ("median_ns", "p99_ns"), "dxpu-mmio")
    devw = guest_kv(vm, f"dxpu-mmio {bdf} 0 time-write {SCRATCH} {writes}", "writes_per_s")
    edu = guest_kv(vm, f"dxpu-mmio {EDU} 0 time-read 0 {reads}", "median_ns")
    eduw = guest_kv(vm, f"dxpu-mmio {EDU} 0 time-write 0x20 {writes}", "writes_per_s")
    return {"read_median_us": dev["median_ns"] / 1000, "read_p99_us": dev["p99_ns"] / 1000,
            "write_rate_per_s": devw["writes_per_s"],
            "edu_read_median_us": edu["median_ns"] / 1000, "edu_write_rate_per_s": eduw["writes_per_s"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reads", type=int, default=20000)
    parser.add_argument("--writes", type=int, default=50000)
    parser.add_argument("--raw", type=int, default=20000, help="raw socket round trips")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    exit_on_sigterm()  # a SIGTERM still runs the cleanup below: no VM or lab left
    two = len(CPUS) >= 2
    layouts = {"unpinned": (None, None)}
    layouts["same-cpu"] = ({CPUS[0]}, {CPUS[0]})
    if two:
        layouts["split-cpu"] = ({CPUS[0]}, {CPUS[1]})

    results = {}
    with Vm(VmConfig(image="tiny", name="bench-mmio", edu=True)) as vm:
        vm.boot()
        att = hotplug.attach(vm, "testdev")
        vm.run(f"dxpu-mmio {att.guest_bdf} enable && dxpu-mmio {EDU} enable")
        for name, (qemu_cpus, server_cpus) in layouts.items():
            all_cpus = set(CPUS)
            pin_threads(vm.pid, qemu_cpus or all_cpus)  # QEMU's vCPU and I/O threads too
            pin_threads(att.server.pid, server_cpus or all_cpus)
            before = att.server.stats()["server"]["commands"].get("REGION_READ", {})
            row = measure(vm, att.guest_bdf, args.reads, args.writes)
            after = att.server.stats()["server"]["commands"]["REGION_READ"]
            n = after["count"] - before.get("count", 0)
            total_us = after["mean_us"] * after["count"] - (before.get("mean_us") or 0) * before.get("count", 0)
            row["server_us_per_read"] = total_us / n if n else None
            row["raw_socket_rtt_us"] = raw_round_trip(args.raw, server_cpus, qemu_cpus)
            row["read_vs_raw"] = row["read_median_us"] / row["raw_socket_rtt_us"]
            row["read_vs_edu"] = row["read_median_us"] / row["edu_read_median_us"]
            results[name] = row
            print(f"  {name}: read {row['read_median_us']:.1f} µs, raw {row['raw_socket_rtt_us']:.1f} µs", flush=True)
        hotplug.detach(att)
        qemu_version = vm.qemu.version_text

    print()
    print(table(["pinning", "read µs (ours)", "read µs (edu)", "raw rtt µs", "ours/raw",
                 "server µs/read", "writes/s (ours)", "writes/s (edu)"],
                [[k, r["read_median_us"], r["edu_read_median_us"], r["raw_socket_rtt_us"], r["read_vs_raw"],
                  r["server_us_per_read"], round(r["write_rate_per_s"]), round(r["edu_write_rate_per_s"])]
                 for k, r in results.items()]))
    path = write_json("mmio", {"qemu": qemu_version, "accel": "tcg", "reads": args.reads,
                               "writes": args.writes, "results": results}, args.out)
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
