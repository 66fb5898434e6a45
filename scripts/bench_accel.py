#!/usr/bin/env python3
"""AI workloads on the accelerator: local (the host proxy serves the model, no network)
vs remote (the same model in a GPU box of the lab, over mutual TLS, no added delay),
in the same run, both open at once, each workload's passes alternating between the two
(so both see the same load on a shared machine).

The guest runtime drives the device from the host side (``dxpu_vfio.lab.accel_paths``:
our vfio-user client in QEMU's place, a memfd as guest RAM); no TCG guest is booted, so
the numbers are the device path's, without a guest CPU. Workloads (weights in VRAM, one
pass = inputs in, kernels, outputs out, one doorbell): MLP inference at batch 1, 8, 64,
a transformer block forward at two sequence lengths, an MLP training step; each checked
against numpy. Per workload: run time local and remote, and where the time goes, from the
device's timestamps (span of a pass) and counters (kernel, copy and ring-fetch time) and
both proxies' counters (serialized round trips, the link's round trip): launch + round
trips, moving bytes, computing, the device's own dispatch. Then host <-> VRAM copy
bandwidth, and the lab's floors (TLS ping-pong and bulk, in Python and with OpenSSL in C
as the proxies' hot paths use it) of the same run.

Table on stdout, JSON in results/bench/accel.json (``results -> workload -> local/remote``,
``copy``, ``floor``, ``goals``; per workload ``floor_vs_local``: the least a remote pass
can take with the same run's TLS floors, see ``floor_pass_s``, and ``native_floor_vs_local``
with the C ones; ``burst_floor_vs_local``: the local pass plus its bytes moved as single
bursts (``burst_floor_pass_s``); ``copy_*_c_floor_vs_local``: the C TLS bulk floor against the local copy,
the most a remote copy can reach here). Goals: at 0 added delay
MLP inference at batch 64 and the transformer block within 10% of local; copy bandwidth
remote >= 50% of local.

    .venv/bin/python scripts/bench_accel.py [--passes 51] [--workloads mlp-b1,...] [--copy-mib 64] [--device-cpu 1]
        [--plaintext]

``--plaintext`` serves the box without TLS and measures plain TCP's floors instead (JSON
``link``; goal keys name ``tcp`` where they name ``tls``): what the link's encryption costs
each workload. DxPU's own fabric carries PCIe unencrypted; the pool's default is mutual TLS.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dxpu_vfio.bench import table, write_json  # noqa: E402
from dxpu_vfio.lab import floors, lab  # noqa: E402
from dxpu_vfio.lab.accel_paths import BOX, served, topology  # noqa: E402
from dxpu_vfio.lab.accel_sweep import launch_round_trips  # noqa: E402
from dxpu_vfio.lab.accel_workloads import WORKLOADS, Passes, copy_bandwidth  # noqa: E402
from dxpu_vfio.procs import exit_on_sigterm, pin_threads  # noqa: E402

GOAL_WORKLOADS = ("mlp-b64", "transformer-s64", "transformer-s256")


def breakdown(run: dict, rtt_s: float) -> dict:
    """Where one pass's time goes (seconds): launch and round trips (doorbell to the first
    entry, the last entry to the fence seen, plus one round trip per copy batch), moving
    bytes (the copies' DMA time beyond their round trips), computing (the kernels), the
    device's own dispatch (operand loads from VRAM, checks); and the serialized round
    trips counted: the ring fetch (unless its entries came pushed with the doorbell) and the
    doorbell/fence legs of each launch, one per copy batch read (the host's status reads overlap with the device's work: apart)."""
    per = run["per_pass"]
    mean = run["mean_s"]
    span = run["span_mean_s"]
    compute = per["kernel_ns"] / 1e9
    copies = (per["dma_ns"] - per["fetch_ns"]) / 1e9
    copy_trips = per["copy_reads"] * rtt_s
    waits = max(0.0, mean - span) + min(copies, copy_trips)
    return {"round_trips_s": waits, "bytes_s": max(0.0, copies - copy_trips), "compute_s": compute,
            "device_other_s": max(0.0, span - compute - copies),
            "round_trips_counted": launch_round_trips(per) + per["copy_reads"],
            "status_reads": per["host_reads"],
            "launches": per["doorbells"],
            "copy_batches": per["copy_reads"] + per["copy_writes"] + per["inline_copies"],
            "bytes": per["h2d_bytes"] + per["d2h_bytes"]}


def floor_pass_s(local_s: float, remote: dict, floor: dict, kind: str = "tls") -> float:
    """The least a remote pass can take on this machine: the local pass, plus its bytes at
    the same run's TLS bulk rate (each direction at its own) and its serialized round trips
    at the TLS ping-pong. A lower bound (small copies move slower than bulk), so a goal
    below it cannot be met here whatever the proxies do. ``kind`` "tls-native": the floors
    of OpenSSL in C, as the proxies' hot paths use it (lower still); "tcp" and "tcp-native"
    the same for a plaintext link."""
    per, tls = remote["per_pass"], floor[kind]
    return (local_s + per["h2d_bytes"] / (tls["bulk"]["to_box_MBps"] * 1e6)
            + per["d2h_bytes"] / (tls["bulk"]["from_box_MBps"] * 1e6)
            + remote["breakdown"]["round_trips_counted"] * tls["ping_pong"]["median_us"] / 1e6)


BURST_SIZES = (32, 4 << 10, 64 << 10, 256 << 10, 1 << 20)


def _bytes_label(n: int) -> str:
    return f"{n >> 10} KiB" if n >= 1024 else f"{n} B"


def burst_floor_pass_s(local_s: float, remote: dict, floor: dict, kind: str = "tls-native") -> float:
    """The least a remote pass can take with its bytes moved as a pass moves them: the
    local pass, plus one way of a burst of its bytes to the box and one way of a burst of
    its bytes back (half of an echo of that size after idle, OpenSSL in C, same run:
    :func:`dxpu_vfio.lab.floors.native_bursts`), plus its other serialized round trips at
    the C ping-pong. A burst costs more than its bytes at the bulk rate: the sender's
    sealing, both kernels and the receiver's opening run one after the other, and both
    ends wake from idle; bulk overlaps them across messages. ``kind`` "tcp-native": a
    plaintext link's floor."""
    per, tls = remote["per_pass"], floor[kind]
    return (local_s + floors.burst_one_way_s(tls["burst"], per["h2d_bytes"])
            + floors.burst_one_way_s(tls["burst"], per["d2h_bytes"])
            + max(0.0, remote["breakdown"]["round_trips_counted"] - 1) * tls["ping_pong"]["median_us"] / 1e6)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passes", type=int, default=51, help="timed passes per workload and path "
                        "(medians of 11 swung by 0.2-0.5 between back-to-back runs on this 2-core machine)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--copy-mib", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="the device's BLAS threads (both paths)")
    parser.add_argument("--inline-max", type=int, default=None,
                        help="the runtime's limit for copies in the ring, bytes (0: each copy a DMA read; default 256 KiB)")
    parser.add_argument("--device-cpu", type=int, default=None,
                        help="pin the device's server (the local host proxy, the box) to this CPU and the bench and "
                        "the remote host proxy to the others: the device computes on a CPU of its own, as a GPU "
                        "does, and the runs are steadier (default: the scheduler places everything)")
    parser.add_argument("--plaintext", action="store_true",
                        help="the box's link without TLS, and the floors plain TCP's: what TLS costs")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cpus = os.sched_getaffinity(0)
    if args.device_cpu is not None and (args.device_cpu not in cpus or len(cpus) < 2):
        sys.exit(f"--device-cpu {args.device_cpu}: pick one of CPUs {sorted(cpus)} (and have two at least)")
    names = args.workloads.split(",")
    # the floors of the link the box serves: TLS (Python's, and OpenSSL's in C), or plain TCP
    py, c = floors.link_kinds(args.plaintext)
    link_name, in_c = ("TCP", "in C, no TLS") if args.plaintext else ("TLS", "with OpenSSL in C")
    unknown = set(names) - set(WORKLOADS)
    if unknown:
        sys.exit(f"unknown workloads {sorted(unknown)}; known: {', '.join(WORKLOADS)}")
    exit_on_sigterm()  # a SIGTERM still runs the finally below: no lab, no proxies left
    topo = topology(f"ba{os.getpid() % 10000}", args.threads, args.plaintext)
    results: dict[str, dict] = {}
    load = os.getloadavg()
    try:
        state = lab.up(topo)
        floor = floors.measure_lab(state, BOX, kinds=("tcp", py, c), burst_sizes=BURST_SIZES)
        with served("local", None, args.threads, args.inline_max) as (local, lacc), \
                served("remote", state, args.threads, args.inline_max) as (remote, racc):
            if args.device_cpu is not None:
                host_side = cpus - {args.device_cpu}
                for pid, where in ((local.proxy.pid, {args.device_cpu}), (remote.box_pid, {args.device_cpu}),
                                   (remote.proxy.pid, host_side), (os.getpid(), host_side)):
                    pin_threads(pid, where)
            before = remote.counters()
            client_rtt = racc.register_reads(300)
            after = remote.counters()
            rtt = (after["host_read_wait_us"] - before["host_read_wait_us"]) / (after["host_reads"] - before["host_reads"]) / 1e6
            local_read = lacc.register_reads(300)
            print(f"  link round trip {rtt * 1e6:.1f} µs (host proxy's wait per read; client sees "
                  f"{client_rtt * 1e6:.1f} µs, local read {local_read * 1e6:.1f} µs)", flush=True)
            for name in names:
                results[name] = {}
                paths = {kind: Passes(WORKLOADS[name](acc.dev), srv.counters)
                         for kind, srv, acc in (("local", local, lacc), ("remote", remote, racc))}
                for _ in range(args.passes):       # pass by pass, so both paths see the same load
                    for runner in paths.values():
                        runner.one()
                for kind, runner in paths.items():
                    run = runner.result()
                    run["breakdown"] = breakdown(run, rtt if kind == "remote" else 0.0)
                    results[name][kind] = run
                    print(f"  {kind:6} {name:16} {run['median_s'] * 1000:8.2f} ms  (error {run['max_abs_error']:.1e})",
                          flush=True)
            copy = {"bytes": args.copy_mib << 20}
            for kind, acc in (("local", lacc), ("remote", racc)):
                copy[kind] = copy_bandwidth(acc.dev, args.copy_mib << 20)
                print(f"  {kind:6} copy {copy[kind]['h2d_MBps']:7.0f} MB/s to VRAM, {copy[kind]['d2h_MBps']:7.0f} "
                      "MB/s back", flush=True)
    finally:
        lab.down(topo.name)  # safe where lab.up never finished
    rows, split = [], []
    for name, r in results.items():
        lo, re = r["local"], r["remote"]
        r["remote_vs_local"] = re["median_s"] / lo["median_s"]
        r["floor_s"] = floor_pass_s(lo["median_s"], re, floor, py)
        r["floor_vs_local"], r["remote_vs_floor"] = r["floor_s"] / lo["median_s"], re["median_s"] / r["floor_s"]
        r["native_floor_vs_local"] = floor_pass_s(lo["median_s"], re, floor, c) / lo["median_s"]
        r["burst_floor_vs_local"] = burst_floor_pass_s(lo["median_s"], re, floor, c) / lo["median_s"]
        rows.append([name, lo["median_s"] * 1000, re["median_s"] * 1000, r["remote_vs_local"], r["floor_vs_local"],
                     r["native_floor_vs_local"], r["burst_floor_vs_local"], r["remote_vs_floor"], re["breakdown"]["round_trips_counted"],
                     re["breakdown"]["bytes"] / 1e6])
        for kind in ("local", "remote"):
            b, mean = r[kind]["breakdown"], r[kind]["mean_s"]
            split.append([f"{name} {kind}", mean * 1000, f"{100 * b['round_trips_s'] / mean:.0f}%",
                          f"{100 * b['bytes_s'] / mean:.0f}%", f"{100 * b['compute_s'] / mean:.0f}%",
                          f"{100 * b['device_other_s'] / mean:.0f}%"])
    print()
    print(table(["workload", "local ms", "remote ms", "remote/local", "floor/local", "C floor/local",
                 "burst floor/local", "remote/floor", "round trips/pass", "MB moved/pass"], rows))
    print(f"floor: the local pass + its bytes at the {link_name} bulk floor + its round trips at the {link_name} "
          f"ping-pong floor (same run): the least a remote pass can take here; C floor: the same {in_c};\n"
          "burst floor: the local pass + its bytes each way as one burst echoed after idle (C, same run) + its "
          "other round trips at the C ping-pong")
    print("\nwhere a pass's time goes (mean pass; device timestamps and counters, both proxies' counters):")
    print(table(["workload path", "ms", "launch + round trips", "moving bytes", "computing", "device dispatch"], split))
    copy_ratio = {d: copy["remote"][f"{d}_MBps"] / copy["local"][f"{d}_MBps"] for d in ("h2d", "d2h")}
    c_bulk = {"h2d": floor[c]["bulk"]["to_box_MBps"], "d2h": floor[c]["bulk"]["from_box_MBps"]}
    print("\n" + table(["copy", "local MB/s", "remote MB/s", "remote/local", f"C {link_name} bulk MB/s", "C floor/local"],
                       [[f"{d} {args.copy_mib} MiB", copy["local"][f"{d}_MBps"], copy["remote"][f"{d}_MBps"], copy_ratio[d],
                         c_bulk[d], c_bulk[d] / copy["local"][f"{d}_MBps"]] for d in ("h2d", "d2h")]))
    print(f"C floor/local: the most a remote copy can reach here, against the local one ({in_c}, same run)")
    tls_bulk = min(floor[py]["bulk"]["to_box_MBps"], floor[py]["bulk"]["from_box_MBps"])
    print(f"\nfloors (same run): {link_name} ping-pong {floor[py]['ping_pong']['median_us']:.1f} µs, {link_name} bulk "
          f"{floor[py]['bulk']['to_box_MBps']:.0f}/{floor[py]['bulk']['from_box_MBps']:.0f} MB/s; in C "
          f"{floor[c]['ping_pong']['median_us']:.1f} µs, {c_bulk['h2d']:.0f}/{c_bulk['d2h']:.0f} MB/s; "
          f"link round trip {rtt * 1e6:.1f} µs; load average before the run {load[0]:.2f}")
    print("bursts in C, echoed after idle (same run): " + ", ".join(
        f"{_bytes_label(int(size))} {row['median_us']:.0f} µs"
        for size, row in floor[c]["burst"].items()))
    goals = {f"{w}_remote_vs_local": results[w]["remote_vs_local"] for w in GOAL_WORKLOADS if w in results}
    goals.update({f"{w}_floor_vs_local": results[w]["floor_vs_local"] for w in GOAL_WORKLOADS if w in results})
    goals.update({f"{w}_burst_floor_vs_local": results[w]["burst_floor_vs_local"]
                  for w in GOAL_WORKLOADS if w in results})
    goals.update({f"copy_{d}_remote_vs_local": v for d, v in copy_ratio.items()})
    goals.update({f"copy_{d}_remote_vs_{py}_bulk": copy["remote"][f"{d}_MBps"] / tls_bulk for d in ("h2d", "d2h")})
    goals.update({f"copy_{d}_remote_vs_c_{py}_bulk": copy["remote"][f"{d}_MBps"] / c_bulk[d] for d in ("h2d", "d2h")})
    goals.update({f"copy_{d}_c_floor_vs_local": c_bulk[d] / copy["local"][f"{d}_MBps"] for d in ("h2d", "d2h")})
    print("goals (want workloads <= 1.10, copies >= 0.50 of local): "
          + ", ".join(f"{k} = {v:.2f}" for k, v in goals.items()))
    path = write_json("accel", {"passes": args.passes, "threads": args.threads, "inline_max": args.inline_max,
                                "device_cpu": args.device_cpu, "link": "plaintext" if args.plaintext else "tls",
                                "load_average": load,
                                "link_rtt_s": rtt, "client_read_s": client_rtt, "local_read_s": local_read,
                                "results": results, "copy": copy, "floor": floor, "goals": goals}, args.out)
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
