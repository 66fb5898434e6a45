"""Shared pieces of the benchmark scripts: a plain-text table and a JSON record with
enough context (host, QEMU, accelerator) to compare runs. Benchmarks are scripts, not tests."""

from __future__ import annotations

import json
import os
import platform
import ssl
import statistics
import time
from pathlib import Path
from typing import Any, NamedTuple, Sequence

from dxpu_vfio.paths import PROJECT_ROOT


def summary(samples: Sequence[float]) -> dict[str, float]:
    return {"n": len(samples), "median": statistics.median(samples), "min": min(samples),
            "max": max(samples), "mean": statistics.fmean(samples)}


def cpu_seconds(pid: int) -> float:
    """User + system CPU of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ThreadTimes(NamedTuple):
    """One thread's counters at one moment; two snapshots subtract into what it did between."""
    user: int  # ticks (SC_CLK_TCK)
    system: int  # ticks
    switches: int  # voluntary + involuntary context switches
    runq_wait_ns: int  # time runnable but not running (schedstat): what waiting for a core cost it


def thread_times(pid: int) -> dict[int, ThreadTimes]:
    """tid -> :class:`ThreadTimes` of each thread of ``pid`` now (threads that end while
    read are left out). The run-queue wait says whether a thread that did little was idle
    or kept from a core: on two shared cores both look alike in CPU time alone."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            switches = sum(int(line.split()[1]) for line in (task / "status").read_text().splitlines()
                           if "ctxt_switches" in line)
            waited = int((task / "schedstat").read_text().split()[1])
            out[int(task.name)] = ThreadTimes(int(fields[11]), int(fields[12]), switches, waited)
        except (OSError, ValueError, IndexError):
            continue
    return out


def thread_names(pid: int) -> dict[int, str]:
    """tid -> the thread's name (``comm``: QEMU names its vCPU threads; Python threads are
    all "python")."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = (task / "comm").read_text().strip()
        except (OSError, ValueError):
            continue
    return out


def flat_counters(stats: dict, prefix: str = "") -> dict[str, float]:
    """A process's counters from its nested stats, keys joined by dots (``a.b.c``): the
    numbers only, and not the timings (keys ending in ``_us``, which are means and maxima,
    not counts), so two snapshots subtract into what happened between them."""
    out: dict[str, float] = {}
    for key, value in stats.items():
        if isinstance(value, dict):
            out.update(flat_counters(value, f"{prefix}{key}."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and not key.endswith("_us"):
            out[f"{prefix}{key}"] = value
    return out


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def native_openssl() -> str | None:
    """The OpenSSL the native stream links (the link's TLS); None where it is not built."""
    from dxpu_vfio.native import stream
    return stream.require().OPENSSL_VERSION if stream.built() else None


def write_json(name: str, data: dict[str, Any], out: Path | None = None) -> Path:
    """Write ``results/bench/<name>.json`` (or ``out``) with the run's context."""
    path = out or PROJECT_ROOT / "results" / "bench" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "host": {"node": platform.node(), "cpus": os.cpu_count(), "kernel": platform.release()},
              "openssl": {"python": ssl.OPENSSL_VERSION, "native": native_openssl()},
              **data}
    path.write_text(json.dumps(record, indent=2, default=str))
    return path
