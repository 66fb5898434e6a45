#!/usr/bin/env python3
"""NVMe in the guest: our controller remote (GPU box over the lab network, TLS) vs local
(served by the host proxy) vs QEMU's own emulated nvme with a file backend, all in the
same full-image VM, measured by fio in the guest with the guest's own nvme driver.

The three backings are alike, so the ratios measure the devices, not the disks: each image
holds the same written bytes before the first pass (no holes: O_DIRECT on a hole reads
no disk), and QEMU's drive uses the page cache as our controllers' namespace files do
(``cache=writeback``; ``--qemu-cache none`` for the O_DIRECT drive of the runs before
2026-12-05 third session, whose reads of written data went to this VM's disk: QEMU's
device at 561-811 MB/s on data against 940-956 on holes and 890-1094 through the page
cache, one guest, same hour).

Workloads: sequential 128 KiB read and write, random 4 KiB read and write (direct I/O,
libaio), each at iodepth 1, 4 and 16 (the workload key names the depth, e.g.
``seq-read-128k-qd16``), each workload on the three devices one after the other (QEMU's
own device ran 686-1345 MB/s in runs an hour apart on this shared machine: a ratio is
only worth the load its two sides shared). QEMU's own nvme is the floor of the device;
the network floor between the lab's namespaces (TLS ping-pong and bulk,
:mod:`dxpu_vfio.lab.floors`) is measured in the same run. Prints a table with ratios and
the data path's NVMe goals, and writes results/bench/nvme.json (``results -> path ->
workload -> MBps`` and ``cpu_us_per_io`` of QEMU, the host proxy and the box, ``floor``,
``remote_ceiling_vs_qemu``, ``cpu_ceiling``, ``goals``). The CPU per I/O is the budget the
goals are judged by: on two cores the guest's vCPUs and both proxies share them. So the
run also measures the link's CPU per 128 KiB message (both ends, C TLS) and prints the CPU
ceiling of a remote sequential read stream: QEMU's CPU per read on the local path plus the
link's, on all cores (:func:`read_cpu_ceiling`).

The goals are judged on paired rounds (``--paired-rounds``, JSON ``paired``): the
goal workloads at the deepest depth run again on the three devices in turn, the order
rotating each round, and each goal is the median of the rounds' ratios (the first pass is
round one). One pass alone moved the local/QEMU ratio of the same code from 0.76 to 0.91
between runs; the single ratios stay in ``goals -> single_pass``.

    .venv/bin/python scripts/bench_nvme.py [--runtime 8] [--size-mib 64] [--depths 1,4,16] [--msix]

``--msix`` gives our controllers MSI-X, so the guest's driver makes one I/O queue per vCPU
(with MSI it gets one vector, one queue, and completes every request through a softirq):
what the device path reaches once QEMU can unplug MSI-X vfio-user devices. QEMU 11.1
aborts on that unplug (docs/architecture.md), so with ``--msix`` nothing is unplugged: the
VM is ended with the devices in it.

``--guest-cpus 1`` boots the guest with one vCPU instead of two. On this 2-core machine a
2-vCPU guest, the host proxy and the box (which in DxPU is another machine) share two
cores; a remote read then costs the guest ~90 µs more CPU than a local one (its vCPUs
preempted by the proxies' threads), and with one vCPU it does not (docs/benchmarks-history.md,
NVMe, 2026-12-05 fifth session).

``--plaintext`` serves the box without TLS and measures plain TCP's floors and CPU per
message instead (JSON ``link``): what the link's encryption costs a remote read. DxPU's
own fabric carries PCIe unencrypted; the pool's default is mutual TLS.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dxpu_vfio.bench import cpu_seconds, table, write_json  # noqa: E402
from dxpu_vfio.lab import hotplug  # noqa: E402
from dxpu_vfio.lab import floors, lab  # noqa: E402
from dxpu_vfio.lab.guest_devices import fio as guest_fio, nvme_disk  # noqa: E402
from dxpu_vfio.procs import exit_on_sigterm  # noqa: E402
from dxpu_vfio.vms.runner import Vm, VmConfig  # noqa: E402

WORKLOADS = {"seq-read-128k": ("read", "128k"), "seq-write-128k": ("write", "128k"),
             "rand-read-4k": ("randread", "4k"), "rand-write-4k": ("randwrite", "4k")}


def fio(vm: Vm, dev: str, rw: str, bs: str, depth: int, runtime: int, size_mib: int,
        processes: dict[str, int]) -> dict:
    """One fio run, and the CPU each of ``processes`` (name -> pid) spent per I/O during it
    (the whole fio command: its few ms of start-up are in it too)."""
    before = {name: cpu_seconds(pid) for name, pid in processes.items()}
    side = guest_fio(vm, dev, rw, bs, depth, runtime, size_mib)
    spent = {name: cpu_seconds(pid) - before[name] for name, pid in processes.items()}
    ios = max(side["total_ios"], 1)
    return {"MBps": side["bw_bytes"] / 1e6, "iops": side["iops"],
            "lat_mean_us": side["lat_ns"]["mean"] / 1000,
            "cpu_us_per_io": {name: seconds / ios * 1e6 for name, seconds in spent.items()}}


READ_BYTES = 128 << 10  # a sequential read's transfer: the link's CPU floor is measured per message of it


def read_cpu_ceiling(results: dict, workload: str, link: dict) -> dict:
    """The most a remote sequential read stream can reach on this machine's CPUs, as a
    share of QEMU's own device in the same run, if QEMU spent per remote read what it spent
    per local one (the same vfio-user device without distance: the guest, its driver and
    QEMU's side of vfio-user) and the proxies no more than the link does moving 128 KiB
    (both ends, OpenSSL in C, ``link``: :func:`dxpu_vfio.lab.floors.native_cpu_per_message`);
    the guest and both proxies share the same cores. At all cores busy, and at the cores the
    remote run kept busy. With the remote read's own cost split into QEMU's extra over its
    local-path cost and the proxies' over the link's: where the rest of the gap lies."""
    remote, local = results["remote"][workload], results["local"][workload]
    floor_us = local["cpu_us_per_io"]["qemu"] + link["both_us"]
    cores = os.cpu_count() or 1
    remote_us = sum(remote["cpu_us_per_io"].values())
    remote_cores = remote_us * remote["iops"] / 1e6
    qemu_mbps = results["qemu-nvme"][workload]["MBps"]

    def share(busy: float) -> float:
        return busy * 1e6 / floor_us * READ_BYTES / 1e6 / qemu_mbps
    return {"workload": workload, "qemu_local_us": local["cpu_us_per_io"]["qemu"], "link_us": link["both_us"],
            "floor_us": floor_us, "cores": cores, "remote_cores": remote_cores,
            "all_cores_vs_qemu": share(cores), "busy_cores_vs_qemu": share(remote_cores), "remote_us": remote_us,
            "qemu_extra_us": remote["cpu_us_per_io"]["qemu"] - local["cpu_us_per_io"]["qemu"],
            "proxies_over_link_us": remote["cpu_us_per_io"]["host proxy"] + remote["cpu_us_per_io"]["box"]
            - link["both_us"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runtime", type=int, default=8)
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--depths", default="1,4,16", help="fio iodepths")
    parser.add_argument("--io-workers", type=int, default=0, help="our controllers' I/O threads (0: on the worker)")
    parser.add_argument("--msix", action="store_true", help="our controllers with MSI-X (one queue per vCPU; never unplugged)")
    parser.add_argument("--guest-cpus", type=int, default=2,
                        help="the guest's vCPUs (1: the proxies' threads do not preempt a second vCPU; see above)")
    parser.add_argument("--paired-rounds", type=int, default=3,
                        help="rounds of the goal workloads the goals are judged on (1: the first pass alone)")
    parser.add_argument("--qemu-cache", choices=("writeback", "none"), default="writeback",
                        help="QEMU's drive: the page cache like our namespace files (default), or O_DIRECT")
    parser.add_argument("--plaintext", action="store_true",
                        help="the box's link without TLS, and the floors plain TCP's: what TLS costs")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    # the floors of the link the box serves: TLS (Python's, and OpenSSL's in C), or plain TCP
    py, c = floors.link_kinds(args.plaintext)
    link_name = py.upper()
    workloads = {f"{name}-qd{depth}": (rw, bs, depth) for name, (rw, bs) in WORKLOADS.items() for depth in depths}
    size = args.size_mib << 20
    exit_on_sigterm()  # a SIGTERM still runs the finally below: no lab, no disk images left
    work = Path(tempfile.mkdtemp(prefix="dxpu-bench-nvme-"))
    msix = {"msix": True} if args.msix else {}
    topology = lab.Topology("bn", [lab.BoxSpec("box1", [{"id": "nv0", "model": "nvme", "settings": {
        "namespaces": [{"size": size, "path": str(work / "remote.img")}], "io_workers": args.io_workers, **msix}}],
                                           plaintext=args.plaintext)])
    deepest = max(depths)
    goal_workloads = [f"seq-read-128k-qd{deepest}", f"rand-read-4k-qd{deepest}"]
    results: dict[str, dict] = {}
    paired: dict[str, list[dict[str, float]]] = {}  # goal workload -> rounds of MB/s by device
    try:
        qemu_disk = work / "qemu-nvme.img"
        written = random.Random(0).randbytes(size)  # the same bytes on all three, none of them a hole
        for image in (qemu_disk, work / "local.img", work / "remote.img"):
            image.write_bytes(written)
        del written
        state = lab.up(topology)
        floor = floors.measure_lab(state, "box1", kinds=("tcp", py, c),
                                   cpu_message_size=READ_BYTES)
        extra = ["-drive", f"file={qemu_disk},if=none,id=qn,format=raw,cache={args.qemu_cache},aio=threads",
                 "-device", "nvme,drive=qn,serial=QEMUNVME,addr=0x6"]
        config = VmConfig(image="full", name="bench-nvme", cpus=args.guest_cpus, extra_args=extra, boot_timeout=240)
        with Vm(config) as vm:
            vm.boot()
            qemu_dev = nvme_disk(vm, "0000:00:06.0")
            local = hotplug.attach(vm, "nvme", settings={"namespaces": [{"size": size, "path": str(work / "local.img")}],
                                                         "io_workers": args.io_workers, **msix}, allow_msix=args.msix)
            remote = hotplug.attach(vm, "remote", settings=state.remote_settings("box1", "nv0"), netns=state.host_netns,
                                    allow_msix=args.msix)
            devices = {"qemu-nvme": qemu_dev, "local": nvme_disk(vm, local.guest_bdf),
                       "remote": nvme_disk(vm, remote.guest_bdf)}
            processes = {"qemu-nvme": {"qemu": vm.pid}, "local": {"qemu": vm.pid, "host proxy": local.server.pid},
                         "remote": {"qemu": vm.pid, "host proxy": remote.server.pid,
                                    "box": state.box("box1").proxy_pid}}
            results = {name: {} for name in devices}
            for workload, (rw, bs, depth) in workloads.items():  # workload by workload, so the three
                for name, dev in devices.items():                 # devices see the same load
                    results[name][workload] = fio(vm, dev, rw, bs, depth, args.runtime, args.size_mib,
                                                       processes[name])
                    print(f"  {name:9} {workload:15} {results[name][workload]['MBps']:8.1f} MB/s", flush=True)
            paired = {w: [{d: results[d][w]["MBps"] for d in devices}] for w in goal_workloads}
            names = list(devices)
            for r in range(1, args.paired_rounds):  # the same load for all three, in a rotating order
                for workload in goal_workloads:
                    rw, bs, depth = workloads[workload]
                    order = names[r % len(names):] + names[:r % len(names)]
                    got = {d: fio(vm, devices[d], rw, bs, depth, args.runtime, args.size_mib, processes[d])["MBps"]
                           for d in order}
                    paired[workload].append(got)
                    print(f"  round {r + 1} {workload:15} " + "  ".join(f"{d} {got[d]:.1f}" for d in names), flush=True)
            if not args.msix:  # (QEMU 11.1 aborts on unplugging an MSI-X vfio-user device)
                hotplug.detach(remote)
                hotplug.detach(local)
    finally:
        lab.down(topology.name)  # safe where lab.up never finished
        shutil.rmtree(work, ignore_errors=True)  # three disk images of --size-mib each
    rows = []
    for workload in workloads:
        q, lo, re = (results[d][workload]["MBps"] for d in ("qemu-nvme", "local", "remote"))
        rows.append([workload, q, lo, re, lo / q, re / q, re / lo])
    print()
    print(table(["workload", "QEMU nvme MB/s", "local MB/s", "remote MB/s", "local/QEMU", "remote/QEMU",
                 "remote/local"], rows))
    print("\nCPU per I/O (µs, user + system, whole processes) and the cores they kept busy:")
    cpu_rows = []
    for workload in workloads:
        for device in devices:
            got = results[device][workload]
            per_io = got["cpu_us_per_io"]
            total = sum(per_io.values())
            cpu_rows.append([workload, device, f"{got['iops']:.0f}"]
                            + [f"{per_io[p]:.0f}" if p in per_io else "-" for p in ("qemu", "host proxy", "box")]
                            + [f"{total:.0f}", total * got["iops"] / 1e6])
    print(table(["workload", "device", "IOPS", "QEMU", "host proxy", "box", "total", "cores"], cpu_rows))
    bulk = floor[py]["bulk"]
    print(f"\nnetwork floor (same run): {link_name} ping-pong {floor[py]['ping_pong']['median_us']:.1f} µs, "
          f"{link_name} bulk "
          f"{bulk['to_box_MBps']:.0f}/{bulk['from_box_MBps']:.0f} MB/s (to/from the box)")
    # The most a remote sequential stream can move: one connection's bulk rate between
    # the same namespaces with nothing else running (the guest and both proxies then share
    # the same two cores), as a share of QEMU's own device in this run.
    bulk_for = {f"seq-read-128k-qd{deepest}": bulk["from_box_MBps"], f"seq-write-128k-qd{deepest}": bulk["to_box_MBps"]}
    ceilings = {w: min(1.0, mbps / results["qemu-nvme"][w]["MBps"]) for w, mbps in bulk_for.items()}
    print(f"remote ceiling ({link_name} bulk / QEMU's nvme, same run): "
          + ", ".join(f"{w} = {v:.2f}" for w, v in ceilings.items()))
    cpu_ceiling = read_cpu_ceiling(results, f"seq-read-128k-qd{deepest}", floor[c]["cpu_per_message"])
    print(f"CPU ceiling of {cpu_ceiling['workload']}: if a remote read cost QEMU what a local one does "
          f"({cpu_ceiling['qemu_local_us']:.0f} µs) and the proxies what the link spends per 128 KiB message, both ends "
          f"in C {link_name} ({cpu_ceiling['link_us']:.0f} µs), it would cost {cpu_ceiling['floor_us']:.0f} µs; at all "
          f"{cpu_ceiling['cores']} cores "
          f"busy that is {cpu_ceiling['all_cores_vs_qemu']:.2f} of QEMU's nvme, at the {cpu_ceiling['remote_cores']:.2f} "
          f"the remote run kept busy {cpu_ceiling['busy_cores_vs_qemu']:.2f}. The remote read cost "
          f"{cpu_ceiling['remote_us']:.0f} µs: QEMU {cpu_ceiling['qemu_extra_us']:+.0f} µs over its local-path cost, "
          f"the proxies {cpu_ceiling['proxies_over_link_us']:+.0f} µs over the link's")

    def ratios(path: str, workload: str) -> list[float]:
        return [r[path] / r["qemu-nvme"] for r in paired[workload]]
    wanted = {f"remote_vs_qemu_seq-read-128k-qd{deepest}": ("remote", f"seq-read-128k-qd{deepest}"),
              f"local_vs_qemu_seq-read-128k-qd{deepest}": ("local", f"seq-read-128k-qd{deepest}"),
              f"remote_vs_qemu_rand-read-4k-qd{deepest}": ("remote", f"rand-read-4k-qd{deepest}")}
    goals: dict = {k: statistics.median(ratios(*w)) for k, w in wanted.items()}
    print(f"\npaired rounds ({max(1, args.paired_rounds)}, the devices in turn), ratio to QEMU's nvme per round:")
    print("\n".join(f"  {k}: " + ", ".join(f"{v:.2f}" for v in ratios(*w)) for k, w in wanted.items()))
    print("goals, medians of the rounds (want remote >= 0.5, local >= 0.8 of QEMU): "
          + ", ".join(f"{k} = {v:.2f}" for k, v in goals.items()))
    goals["single_pass"] = {k: ratios(*w)[0] for k, w in wanted.items()}
    path = write_json("nvme", {"runtime_s": args.runtime, "size_mib": args.size_mib, "depths": depths,
                               "link": "plaintext" if args.plaintext else "tls",
                               "io_workers": args.io_workers, "msix": args.msix, "qemu_cache": args.qemu_cache,
                               "guest_cpus": args.guest_cpus,
                               "images": "written",
                               "results": results, "paired": paired, "floor": floor,
                               "remote_ceiling_vs_qemu": ceilings, "cpu_ceiling": cpu_ceiling, "goals": goals},
                      args.out)
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
