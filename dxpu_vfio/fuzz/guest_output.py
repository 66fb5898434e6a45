"""The ``guest-output`` fuzz target: the lab's readers of what its programs print in a
guest (:mod:`dxpu_vfio.lab.guest_output`), as a broken or hostile guest prints it, with
the generic reader fuzzing of :mod:`dxpu_vfio.fuzz.readers`. The samples are shaped like
the real output: fio's JSON report, /proc/stat, the udev watcher's events, the accel
runner's result lines, the KMS client's report, ``key=value`` words, a PCI address, a
disk's name. A reader must return finite floats, whole counts that are not negative and
names that match their pattern, or raise
:class:`~dxpu_vfio.lab.guest_output.GuestOutputError`.
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Callable

from dxpu_vfio.fuzz.readers import Reader, ReaderTarget
from dxpu_vfio.lab import guest_output as out
from dxpu_vfio.lab.guest_output import GuestOutputError

_Reader = functools.partial(Reader, refusal=GuestOutputError)

FIO = json.dumps({"fio version": "fio-3.38", "jobs": [{
    "jobname": "b", "error": 0,
    "read": {"io_bytes": 134217728, "bw_bytes": 44739242, "iops": 341.33, "total_ios": 1024, "runtime": 3000,
             "lat_ns": {"min": 1000, "max": 9000000, "mean": 2929000.5, "stddev": 10.0},
             "clat_ns": {"percentile": {"99.000000": 4000000}}},
    "write": {"io_bytes": 0, "bw_bytes": 0, "iops": 0.0, "total_ios": 0, "runtime": 0,
              "lat_ns": {"min": 0, "max": 0, "mean": 0.0, "stddev": 0.0}}}]})
STAT = ("cpu  4705 0 2345 98765 12 0 37 0 0 0\ncpu0 4705 0 2345 98765 12 0 37 0 0 0\n"
        "intr 123456 0 9 0 0 0 0 0 0 1 0\nctxt 654321\nbtime 1765000000\nprocesses 812\n")
EVENTS = ("watching 0000:00:10.0\n"
          + json.dumps({"action": "add", "bdf": "0000:01:00.0", "driver": None, "vendor": "0x4446",
                        "device": "0x0001", "t": 12.5}) + "\n"
          + json.dumps({"action": "bind", "bdf": "0000:01:00.0", "driver": "nvme", "vendor": "0x4446",
                        "device": "0x0001", "t": 12.7}) + "\n")
RUN = {"workload": "mlp-b64", "what": "a 3-layer MLP, batch 64", "passes": 2, "median_s": 0.0123,
       "min_s": 0.012, "max_s": 0.0131, "mean_s": 0.01255, "span_mean_s": 0.011, "max_abs_error": 1.2e-6,
       "per_pass": {"doorbells": 12, "copy_reads": 3}}
WORKLOADS = "".join(f"workload={json.dumps({**RUN, 'workload': w, 'device': d})}\n"
                    for w in ("mlp-b64", "transformer-s64") for d in ("remote", "local")) + "done\n"
KMS = (json.dumps({"mode": "1024x768", "modes": ["1024x768"], "pitch": 4096, "bytes": 3145728,
                   "fill_s": [0.105, 0.098, 0.101]}) + "\n")
MMIO = "count=20000 total_ns=400000000 mean_ns=20000 min_ns=15000 median_ns=19500 p99_ns=40000 max_ns=90000\n"
DD = "write_s=0.52 read_s=0.31 src=0123456789abcdef0123456789abcdef back=0123456789abcdef0123456789abcdef\n"
SELFTEST = "device=0000:01:00.0\nvram_bytes=1073741824\ncopy 4096=ok\nselftest=passed 12 checks\n"


def _finite(value: object) -> bool:
    return isinstance(value, float) and math.isfinite(value)


def _numbers_keep(keys: tuple[str, ...]) -> Callable[[object], str | None]:
    def keeps(value: object) -> str | None:
        if not isinstance(value, dict) or set(value) != set(keys) or not all(map(_finite, value.values())):
            return f"not {len(keys)} finite floats at {keys}"
        return None
    return keeps


def _strings_keep(value: object) -> str | None:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) and k
                                              for k, v in value.items()):
        return "not a dict of strings"
    return None


def _word_keeps(pattern: re.Pattern[str]) -> Callable[[object], str | None]:
    return lambda value: None if isinstance(value, str) and pattern.fullmatch(value) else f"not a {pattern.pattern}"


def _fio_keeps(value: object) -> str | None:
    if not isinstance(value, dict) or not isinstance(value.get("lat_ns"), dict):
        return "no side with lat_ns"
    figures = [value.get(k) for k in out.FIO_NUMBERS] + [value["lat_ns"].get("mean")]
    return None if all(_finite(f) and f >= 0 for f in figures) else f"figures {figures} not finite and >= 0"


def _stat_keeps(value: object) -> str | None:
    keys = set(out.STAT_CPU) | {"intr", "ctxt"}
    if not isinstance(value, dict) or set(value) != keys:
        return f"not the keys {sorted(keys)}"
    bad = {k: v for k, v in value.items() if isinstance(v, bool) or not isinstance(v, int) or v < 0}
    return f"counts that are not counts: {bad}" if bad else None


def _events_keep(value: object) -> str | None:
    if not isinstance(value, list) or not all(isinstance(e, dict) for e in value):
        return "not a list of objects"
    bad = [e.get("bdf") for e in value if e.get("action") == "add"
           and not (isinstance(e.get("bdf"), str) and out.PCI_ADDRESS.fullmatch(e["bdf"]))]
    return f"adds without a PCI address: {bad}" if bad else None


def _workloads_keep(value: object) -> str | None:
    runs, failed = value  # type: ignore[misc]
    if not isinstance(runs, dict) or set(runs) != {"remote", "local"}:
        return f"labels {sorted(runs)}"
    for label, by_name in runs.items():
        for name, run in by_name.items():
            if not isinstance(name, str) or not isinstance(run, dict) or run.get("workload") != name or "device" in run \
                    or not all(_finite(run.get(f)) for f in out.RUN_NUMBERS):
                return f"{label}'s {name!r:.40} breaks the contract: {str(run)[:200]}"
    if failed is not None and not (isinstance(failed, dict) and set(failed) == {"workload", "error"}
                                   and all(isinstance(v, str) for v in failed.values())):
        return f"a failure of another shape: {failed!r:.200}"
    return None


def _kms_keeps(value: object) -> str | None:
    if not isinstance(value, dict):
        return "not an object"
    size, fills = value.get("bytes"), value.get("fill_s")
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        return f"bytes {size!r:.40}"
    if not isinstance(fills, list) or not fills or not all(_finite(s) and s > 0 for s in fills):
        return f"fill_s {fills!r:.100}"
    return None


def _expected_workloads() -> tuple[dict, None]:
    runs = {d: {w: {**RUN, "workload": w} for w in ("mlp-b64", "transformer-s64")} for d in ("remote", "local")}
    return runs, None


READERS = (
    _Reader("fio", "fio: note: both iodepth >= 1 and synchronous I/O engine are selected\n" + FIO + "\n",
            lambda t: out.fio_side(t, "read"), _fio_keeps,
            {**json.loads(FIO)["jobs"][0]["read"], "bw_bytes": 44739242.0, "total_ios": 1024.0}),
    _Reader("proc-stat", STAT, out.proc_stat, _stat_keeps,
            {"user": 4705, "nice": 0, "system": 2345, "idle": 98765, "iowait": 12, "irq": 0, "softirq": 37,
             "intr": 123456, "ctxt": 654321}),
    _Reader("udev-events", EVENTS, lambda t: out.udev_events(t, "dxpu-guest-events"), _events_keep,
            [json.loads(line) for line in EVENTS.splitlines()[1:]]),
    _Reader("workloads", WORKLOADS, lambda t: out.workload_lines(t, ("remote", "local"), "the accel runner"),
            _workloads_keep, _expected_workloads()),
    _Reader("kms-fill", KMS, out.kms_fill, _kms_keeps, json.loads(KMS)),
    _Reader("numbers", MMIO, lambda t: out.numbers(t, ("median_ns", "p99_ns"), "dxpu-mmio"),
            _numbers_keep(("median_ns", "p99_ns")), {"median_ns": 19500.0, "p99_ns": 40000.0}),
    _Reader("dd-numbers", DD, lambda t: out.numbers(t, ("write_s", "read_s"), "the demo's dd"),
            _numbers_keep(("write_s", "read_s")), {"write_s": 0.52, "read_s": 0.31}),
    _Reader("tokens", DD, out.tokens, _strings_keep, {"write_s": "0.52", "read_s": "0.31",
                                                       "src": "0123456789abcdef" * 2, "back": "0123456789abcdef" * 2}),
    _Reader("key-lines", SELFTEST, out.key_lines, _strings_keep,
            {"device": "0000:01:00.0", "vram_bytes": "1073741824", "selftest": "passed 12 checks"}),
    _Reader("pci-address", "0000:01:00.0\n", lambda t: out.pci_address(t, "the guest's sysfs poll"),
            _word_keeps(out.PCI_ADDRESS), "0000:01:00.0"),
    _Reader("nvme-disk", "nvme0n1\n", lambda t: out.word(t, out.NVME_DISK, "the guest's sysfs poll", "NVMe disk"),
            _word_keeps(out.NVME_DISK), "nvme0n1"),
)




def target() -> ReaderTarget:
    return ReaderTarget("guest-output", READERS)
