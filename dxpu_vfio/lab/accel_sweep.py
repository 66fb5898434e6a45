"""The sweep's accelerator workloads (``dxpu lab sweep --workloads accel-mlp-b64,...``):
the AI workloads of :mod:`dxpu_vfio.lab.accel_workloads`, driven from the host side
(no guest), local once and then from a GPU box at each added delay.

Per point it records what the performance model's accelerator terms need (the
docs/perfmodel.md section on AI workloads): the pass's run time; the serialized round
trips, counted per launch (the ring fetch unless its entries came pushed with the
doorbell, and one for the doorbell and the fence, which go one way each) and per copy (one per DMA batch read from host memory; copies to the
host are posted); the host's status reads apart (one per 20 ms of waiting: they overlap
with the device's work, so they are not on the critical path: a sweep at 8 ms of added
delay showed passes shorter than they would be if they were); the bytes the copies moved; the device's compute
time; the link round trip measured at that delay; and the copy bandwidth over the link
at the first delay, which the fit takes as the link's bandwidth. The local device is
measured beside the remote one at every delay (:func:`run`).
"""

from __future__ import annotations

import os
import statistics
from typing import Callable

from dxpu_vfio.lab import lab
from dxpu_vfio.lab.accel_paths import BOX, served, topology
from dxpu_vfio.lab.accel_workloads import WORKLOADS, Passes, copy_bandwidth

PREFIX = "accel-"
COPY_BYTES = 16 << 20


def names() -> list[str]:
    return [PREFIX + w for w in WORKLOADS]


def launch_round_trips(per: dict) -> float:
    """The serialized round trips of a pass's launches (per-pass counters): the doorbell
    and fence legs of each, and each ring fetch that did not come pushed with its doorbell."""
    return per["fetches"] - per.get("pushed_reads", 0) + per["doorbells"]


def _point(run: dict) -> dict:
    per = run["per_pass"]
    launches = per["doorbells"]
    launch_trips = launch_round_trips(per)
    batches = per["copy_reads"] + per["copy_writes"] + per["inline_copies"]   # an inline copy: no round trip
    return {"runtime_s": run["median_s"], "round_trips": round(launch_trips + per["copy_reads"]),
            "launches": launches, "copy_batches": batches, "status_reads": per["host_reads"],
            "round_trips_per_launch": launch_trips / launches if launches else 0.0,
            "round_trips_per_copy": per["copy_reads"] / batches if batches else 0.0,
            "h2d_bytes": round(per["h2d_bytes"]), "d2h_bytes": round(per["d2h_bytes"]),
            "bytes_moved": round(per["h2d_bytes"] + per["d2h_bytes"]), "compute_s": per["kernel_ns"] / 1e9,
            "span_s": run["span_mean_s"], "max_abs_error": run["max_abs_error"]}


def run(delays_us: list[float], workloads: list[str], passes: int = 3,
        log: Callable[[str], None] = print) -> tuple[dict[str, float], dict[str, list[dict]], dict]:
    """(local run time per workload, remote points per workload, extra: local points and
    the link's copy bandwidth per direction). ``workloads``: names with the prefix.

    The local device stays served all along and, at every delay, each workload's local
    and remote passes alternate: on a shared machine the load changes from minute to
    minute and slows both alike, so each remote point's run time is scaled by the local
    reference (the median of all local runs) over the local run beside it
    (``runtime_s``; the measured one is ``runtime_raw_s``)."""
    plain = [w.removeprefix(PREFIX) for w in workloads]
    runs: dict[str, list[dict]] = {w: [] for w in workloads}
    extra: dict = {"local": {}, "copy_MBps": {}, "what": {}}
    local_points: dict[str, list[dict]] = {w: [] for w in workloads}
    topo = topology(f"as{os.getpid() % 100000}")
    try:
        state = lab.up(topo)
        with served("local", None) as (lsrv, lacc):
            for delay in delays_us:
                box = lab.set_delay(state, BOX, delay)
                with served("remote", state) as (srv, acc):
                    before = srv.counters()
                    acc.register_reads(300)
                    after = srv.counters()
                    rtt_s = (after["host_read_wait_us"] - before["host_read_wait_us"]) / (
                        after["host_reads"] - before["host_reads"]) / 1e6
                    if not extra["copy_MBps"]:   # the link's bandwidth: at the first delay
                        extra["copy_MBps"] = {"local": copy_bandwidth(lacc.dev, COPY_BYTES, repeats=2),
                                              "remote": {**copy_bandwidth(acc.dev, COPY_BYTES, repeats=2),
                                                         "delay_us": delay}}
                    for w, name in zip(workloads, plain):
                        there = Passes(WORKLOADS[name](acc.dev), srv.counters)
                        here = Passes(WORKLOADS[name](lacc.dev), lsrv.counters)
                        extra["what"][w] = here.workload.what
                        for _ in range(passes):
                            here.one()
                            there.one()
                        mine = _point(here.result())
                        local_points[w].append(mine)
                        point = {"delay_us": delay, "rtt_s": rtt_s, **_point(there.result()),
                                 "local_s": mine["runtime_s"]}
                        runs[w].append(point)
                        log(f"  +{delay:6.0f} µs  {w:22} {point['runtime_s'] * 1000:8.2f} ms (local beside it "
                            f"{mine['runtime_s'] * 1000:7.2f} ms)  rtt {rtt_s * 1e6:7.1f} µs  "
                            f"round trips {point['round_trips']}")
                report = lab.delay_report(state, BOX)
                for w in workloads:
                    runs[w][-1]["delay_achieved_us"] = report["achieved_median_us"] if report else 0.0
                    runs[w][-1]["delay_mode"] = box.delay_mode
    finally:
        lab.down(topo.name)  # safe where lab.up never finished
    local: dict[str, float] = {}
    for w in workloads:
        local[w] = statistics.median(p["runtime_s"] for p in local_points[w])
        extra["local"][w] = {"runtime_s": local[w], "runs_s": [p["runtime_s"] for p in local_points[w]],
                             "compute_s": statistics.fmean(p["compute_s"] for p in local_points[w])}
        for point in runs[w]:
            point["runtime_raw_s"] = point["runtime_s"]
            point["runtime_s"] = point["runtime_raw_s"] * local[w] / point["local_s"]
    return local, runs, extra


def link_bandwidth(point: dict, copy_MBps: dict) -> float | None:
    """The bandwidth a workload's copies see over the link (bytes/s), from the copy
    bandwidth each way weighted by its bytes; None when it moves nothing."""
    if not point["bytes_moved"]:
        return None
    seconds = point["h2d_bytes"] / (copy_MBps["h2d_MBps"] * 1e6) + point["d2h_bytes"] / (copy_MBps["d2h_MBps"] * 1e6)
    return point["bytes_moved"] / seconds
