"""``dxpu lab sweep``: run guest workloads at several injected link delays, fit the
performance model (dxpu_vfio/perfmodel.py) on some delays, predict the others, plot.

Each workload runs once on local devices (the host proxy serves the model: no link) and
then on the same models in a GPU box at every delay. Per run the sweep records the
guest-visible run time, the serialized round trips both proxies counted, and the link
round-trip time measured at that delay (the host proxy's mean wait per register read).
Output: ``<out>/sweep.json`` and one ``<out>/<workload>.png`` per workload plus
``<out>/overhead.png`` with all of them.

The accelerator's AI workloads (``accel-*``, :mod:`dxpu_vfio.lab.accel_sweep`) run from
the host side without a guest; their model has the transfer term, with the copy
bandwidth over the link measured in the same sweep, and reports the link bandwidth at
which the overhead crosses 10% too.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from dxpu_vfio import registry
from dxpu_vfio.errors import DxpuError
from dxpu_vfio.lab import accel_sweep, hotplug, lab
from dxpu_vfio.lab.guest_devices import nvme_disk
from dxpu_vfio.link.endpoint import dma_read_requests
from dxpu_vfio.perfmodel import Point, fit, prediction_error
from dxpu_vfio.vms.runner import Vm, VmConfig

MiB = 1 << 20
# name -> (device, guest command with {bdf} / {disk}, what it is)
WORKLOADS: dict[str, tuple[str, str, str]] = {
    "mmio-loop": ("testdev", "dxpu-mmio {bdf} 0 time-read 8 {n} >/dev/null", "{n} register reads"),
    "dma-64k": ("testdev", "for i in $(seq {n}); do dxpu-testdev {bdf} dma-copy 65536 >/dev/null; done",
                "{n} DMA copies of 64 KiB"),
    "dma-1m": ("testdev", "for i in $(seq {n}); do dxpu-testdev {bdf} dma-copy 1048576 >/dev/null; done",
               "{n} DMA copies of 1 MiB"),
    "nvme-read": ("nvme", "dd if=/dev/{disk} of=/dev/null bs=128k count={n} iflag=direct 2>/dev/null",
                  "{n} x 128 KiB NVMe reads"),
    "nvme-write": ("nvme", "dd if=/dev/zero of=/dev/{disk} bs=128k count={n} oflag=direct 2>/dev/null",
                   "{n} x 128 KiB NVMe writes"),
}
DEFAULT_SIZES = {"mmio-loop": 2000, "dma-64k": 40, "dma-1m": 8, "nvme-read": 192, "nvme-write": 96}


def known_workloads() -> list[str]:
    return list(WORKLOADS) + accel_sweep.names()


def _timed(vm: Vm, command: str, repeats: int = 1) -> float:
    """Best-of wall time of a guest command, less the fixed cost of running any command."""
    def once(cmd: str) -> float:
        started = time.perf_counter()
        vm.run(cmd, timeout=900)
        return time.perf_counter() - started
    floor = min(once("true") for _ in range(3))
    return max(1e-6, min(once(command) for _ in range(repeats)) - floor)


class _Counters:
    """Serialized round trips of one device, from both proxies' counters. With
    ``interrupts``, each interrupt the host delivered counts one too: an NVMe command at
    depth 1 is a posted doorbell out and its completion's interrupt back, a round trip the
    guest waits for although no message waits for a reply (its entries and PRP list travel
    with the doorbell; a Write's data read is the box's DMA read, counted apart)."""

    def __init__(self, att: hotplug.Attachment, box_pid: int | None, box_device: str | None,
                 interrupts: bool = False) -> None:
        self.att, self.box_pid, self.box_device, self.interrupts = att, box_pid, box_device, interrupts

    def snapshot(self) -> tuple[int, float, int]:
        device = self.att.server.stats()["device"]
        link = device.get("link")
        if link is None:  # a local device: no link, no round trips
            return 0, 0.0, 0
        host = sum(r["count"] for r in link["requests"].values()) + (device.get("irqs", 0) if self.interrupts else 0)
        wait = link["requests"].get("REGION_READ", {"wait_us": 0.0})["wait_us"]
        reads = link["requests"].get("REGION_READ", {"count": 0})["count"]
        box = 0
        if self.box_pid:
            entry = next(e for e in registry.entries() if e["pid"] == self.box_pid)
            dev = registry.collect(entry)["devices"][self.box_device]["link"]
            box = dma_read_requests(dev["requests"])[0] if dev else 0
        return host + box, wait, reads


def run_sweep(delays_us: list[float], calibration_us: list[float], out: Path,
              sizes: dict[str, int] | None = None, workloads: list[str] | None = None,
              log: Callable[[str], None] = print, passes: int = 3) -> dict:
    """``workloads``: guest ones (WORKLOADS, default all) and/or ``accel-*`` ones;
    ``passes``: timed passes per point of an accelerator workload (the median counts)."""
    sizes = {**DEFAULT_SIZES, **(sizes or {})}
    chosen = workloads or list(WORKLOADS)
    unknown = [w for w in chosen if w not in known_workloads()]
    if unknown:
        raise DxpuError(f"unknown sweep workloads: {', '.join(unknown)}",
                        hint=f"pick from: {', '.join(known_workloads())}")
    names = [w for w in chosen if w in WORKLOADS]
    accel = [w for w in chosen if w not in WORKLOADS]
    out.mkdir(parents=True, exist_ok=True)
    local: dict[str, float] = {}
    runs: dict[str, list[dict]] = {}
    if names:
        guest_local, guest_runs = _guest_runs(delays_us, names, sizes, log)
        local.update(guest_local)
        runs.update(guest_runs)
    extra: dict = {}
    if accel:
        accel_local, accel_runs, extra = accel_sweep.run(delays_us, accel, passes, log)
        local.update(accel_local)
        runs.update(accel_runs)

    results = {"delays_us": delays_us, "calibration_us": calibration_us, "sizes": sizes,
               "local_s": local, "workloads": {}}
    if accel:
        results["accel"] = {"passes": passes, "copy_MBps": extra["copy_MBps"], "local": extra["local"]}
    for w in chosen:
        points = [Point(r["rtt_s"], r["runtime_s"], r["round_trips"], r["delay_us"], r.get("bytes_moved", 0),
                        r.get("compute_s", 0.0)) for r in runs[w]]
        calib = [p for p in points if p.delay_us in calibration_us]
        held = [p for p in points if p.delay_us not in calibration_us]
        bandwidth = accel_sweep.link_bandwidth(runs[w][0], extra["copy_MBps"]["remote"]) if w in accel else None
        model = fit(w, local[w], calib, bandwidth_Bps=bandwidth, k_prior=1.0 if w in accel else None)
        what = WORKLOADS[w][2].format(n=sizes[w]) if w in WORKLOADS else extra["what"][w]
        entry = {
            "what": what, "model": asdict(model), "runs": runs[w],
            "held_out": [{"delay_us": p.delay_us, "rtt_us": p.rtt_s * 1e6, "measured_s": p.runtime_s,
                          "predicted_s": model.predict(p.rtt_s), "error": prediction_error(model, p)} for p in held],
            "rtt_for_10pct_us": model.rtt_for_overhead(0.10) * 1e6,
        }
        if w in accel:
            floor_rtt = min(p.rtt_s for p in points)
            first = runs[w][0]
            entry.update({
                "compute_share": extra["local"][w]["compute_s"] / local[w], "launches": first["launches"],
                "copy_batches": first["copy_batches"], "round_trips_per_launch": first["round_trips_per_launch"],
                "round_trips_per_copy": first["round_trips_per_copy"],
                "overhead_at_floor": model.overhead(floor_rtt), "floor_rtt_us": floor_rtt * 1e6,
                "bandwidth_for_10pct_MBps": model.bandwidth_for_overhead(0.10, floor_rtt) / 1e6,
                "bandwidth_for_10pct_at_zero_rtt_MBps": model.bandwidth_for_overhead(0.10, 0.0) / 1e6})
        results["workloads"][w] = entry
    (out / "sweep.json").write_text(json.dumps(results, indent=1, default=str))
    plot(results, out)
    return results


def _guest_runs(delays_us: list[float], names: list[str], sizes: dict[str, int],
                log: Callable[[str], None]) -> tuple[dict[str, float], dict[str, list[dict]]]:
    """The guest workloads: local once, then remote at each delay, in one tiny guest."""
    disks = Path(tempfile.mkdtemp(prefix="dxpu-sweep-"))
    nvme_settings = lambda tag: {"namespaces": [{"size": 64 * MiB, "path": str(disks / f"{tag}.img")}]}  # noqa: E731
    topology = lab.Topology(f"sw{os.getpid()}", [lab.BoxSpec("box1", [
        {"id": "td0", "model": "testdev"}, {"id": "nv0", "model": "nvme", "settings": nvme_settings("remote")}])])
    local: dict[str, float] = {}
    runs: dict[str, list[dict]] = {w: [] for w in names}
    try:
        state = lab.up(topology)
        with Vm(VmConfig(image="tiny", name="sweep")) as vm:
            vm.boot()
            vm.run("echo 4 > /proc/sys/vm/nr_hugepages")

            def run_all(devices: dict[str, hotplug.Attachment], counters: dict[str, _Counters] | None,
                        rtt_s: float | None, delay: float | None) -> None:
                disk = nvme_disk(vm, devices["nvme"].guest_bdf) if any(WORKLOADS[w][0] == "nvme" for w in names) else ""
                for w in names:
                    kind, template, _ = WORKLOADS[w]
                    cmd = template.format(bdf=devices[kind].guest_bdf, disk=disk, n=sizes[w])
                    if counters is None:
                        local[w] = _timed(vm, cmd, repeats=2)
                        log(f"  local        {w:11} {local[w] * 1000:9.1f} ms")
                        continue
                    trips0, wait0, reads0 = counters[kind].snapshot()
                    runtime = _timed(vm, cmd, repeats=2)
                    trips1, wait1, reads1 = counters[kind].snapshot()
                    trips = (trips1 - trips0) // 2  # _timed ran the command twice
                    # the round trip this run really saw, where it made enough reads to say;
                    # else the one probed at this delay
                    run_rtt = (wait1 - wait0) / (reads1 - reads0) / 1e6 if reads1 - reads0 >= 50 else rtt_s
                    runs[w].append({"delay_us": delay, "rtt_s": run_rtt, "runtime_s": runtime, "round_trips": trips})
                    log(f"  +{delay:6.0f} µs  {w:11} {runtime * 1000:9.1f} ms  rtt {run_rtt * 1e6:7.1f} µs  "
                        f"round trips {trips}")

            devices = {"testdev": hotplug.attach(vm, "testdev"), "nvme": hotplug.attach(vm, "nvme", settings=nvme_settings("local"))}
            vm.run(f"dxpu-mmio {devices['testdev'].guest_bdf} enable >/dev/null")
            run_all(devices, None, None, None)
            for att in devices.values():
                hotplug.detach(att)

            for delay in delays_us:
                box = lab.set_delay(state, "box1", delay)
                devices = {kind: hotplug.attach(vm, "remote", settings=state.remote_settings("box1", dev),
                                                netns=state.host_netns)
                           for kind, dev in (("testdev", "td0"), ("nvme", "nv0"))}
                counters = {"testdev": _Counters(devices["testdev"], box.proxy_pid, "td0"),
                            "nvme": _Counters(devices["nvme"], box.proxy_pid, "nv0", interrupts=True)}
                _, wait0, reads0 = counters["testdev"].snapshot()
                vm.run(f"dxpu-mmio {devices['testdev'].guest_bdf} enable >/dev/null; "
                       f"dxpu-mmio {devices['testdev'].guest_bdf} 0 time-read 8 500 >/dev/null")
                _, wait1, reads1 = counters["testdev"].snapshot()
                rtt_s = (wait1 - wait0) / (reads1 - reads0) / 1e6  # measured at this delay
                run_all(devices, counters, rtt_s, delay)
                report = lab.delay_report(state, "box1")
                for w in names:
                    runs[w][-1]["delay_achieved_us"] = report["achieved_median_us"] if report else 0.0
                    runs[w][-1]["delay_mode"] = box.delay_mode
                for att in devices.values():
                    hotplug.detach(att)
    finally:
        lab.down(topology.name)  # safe where lab.up never finished
        shutil.rmtree(disks, ignore_errors=True)
    return local, runs


def plot(results: dict, out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dxpu_vfio.perfmodel import Model
    paths = []
    fig_all, ax_all = plt.subplots(figsize=(8, 5))
    for w, data in results["workloads"].items():
        model = Model(**data["model"])
        calib = set(results["calibration_us"])
        fig, ax = plt.subplots(figsize=(6, 4))
        for axis in (ax, ax_all):
            xs_all = [r["rtt_s"] * 1e6 for r in data["runs"]]
            low, top = min(xs_all) * 0.5, max(xs_all) * 1.1  # the model where it was measured
            line_x = [low + (top - low) * i / 100 for i in range(101)]
            line = axis.plot(line_x, [model.overhead(x / 1e6) * 100 for x in line_x], "-",
                             label=f"{w} model" if axis is ax_all else "model")[0]
            for r in data["runs"]:
                filled = r["delay_us"] in calib
                axis.plot(r["rtt_s"] * 1e6, (r["runtime_s"] / model.t_local_s - 1) * 100,
                          "o" if filled else "s", color=line.get_color(),
                          markerfacecolor=line.get_color() if filled else "none")
        ax.axhline(10, color="grey", lw=0.8, ls="--")
        ax.set_title(f"{w}: {data['what']}")
        ax.set_xlabel("link round trip, measured (µs)")
        ax.set_ylabel("overhead vs local (%)")
        ax.legend(["model", "calibration (filled) / held-out (open)"], fontsize=8)
        fig.tight_layout()
        path = out / f"{w}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    ax_all.axhline(10, color="grey", lw=0.8, ls="--")
    ax_all.set_xlabel("link round trip, measured (µs)")
    ax_all.set_ylabel("overhead vs local (%)")
    ax_all.set_yscale("log")
    ax_all.set_ylim(bottom=1)
    ax_all.set_title("DxPU overhead vs link round trip (points measured, lines model)")
    ax_all.legend(fontsize=8)
    fig_all.tight_layout()
    path = out / "overhead.png"
    fig_all.savefig(path, dpi=100)
    plt.close(fig_all)
    return paths + [path]
