"""Reading what the lab's programs print in a guest: each reader takes the text and
returns checked values, or raises :class:`GuestOutputError` naming the program and
quoting what it printed.

A guest is a peer, like a box: its kernel, its tools or a test that broke it may print
anything (a line cut off by a panic, ``nan``, a word where a number belongs, JSON nested
past the stack), and a figure the lab reports or a name it runs a command on must never
come from a value nobody looked at. The readers check what their callers use and keep
the rest as it came. Fuzzed by ``scripts/fuzz.py --target guest-output``
(:mod:`dxpu_vfio.fuzz.guest_output`), which also holds them to the contracts below.
"""

from __future__ import annotations

import json
import math
import re
from typing import Iterable

from dxpu_vfio.errors import VmError

QUOTE = 300  # characters of the output an error quotes (its end: where a program says why it stopped)
PCI_ADDRESS = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
NVME_DISK = re.compile(r"nvme[0-9]{1,4}n[0-9]{1,6}")
DRM_CARD = re.compile(r"card[0-9]{1,4}")
FIO_NUMBERS = ("bw_bytes", "iops", "total_ios")  # a side's figures the benchmarks use (and lat_ns.mean)
STAT_CPU = ("user", "nice", "system", "idle", "iowait", "irq", "softirq")  # /proc/stat's first 7 columns
RUN_NUMBERS = ("median_s", "min_s", "max_s", "mean_s", "span_mean_s", "max_abs_error")  # a workload's result


class GuestOutputError(VmError):
    """A program in the guest printed what its reader cannot take."""

    def __init__(self, program: str, problem: str, text: str) -> None:
        self.program, self.problem = program, problem
        super().__init__(f"{program} in the guest printed {problem}: ...{text[-QUOTE:]!r}",
                         hint="the guest's console log (the VM's logs) shows what else went wrong there")


def word(text: str, pattern: re.Pattern[str], program: str, what: str) -> str:
    """The one word ``text`` is (white space around it aside), if it matches ``pattern``:
    the caller puts it in a path or a command, so nothing else may come along."""
    value = text.strip()
    if not pattern.fullmatch(value):
        raise GuestOutputError(program, f"no {what}", text)
    return value


def pci_address(text: str, program: str) -> str:
    """A PCI address as Linux writes it (``0000:01:00.0``)."""
    return word(text, PCI_ADDRESS, program, "PCI address")


def tokens(text: str) -> dict[str, str]:
    """``key=value`` words (split at white space) as {key: value}; words without ``=`` or
    without a key are left out, and of a key printed twice the last value counts."""
    out = {}
    for item in text.split():
        key, sep, value = item.partition("=")
        if sep and key:
            out[key] = value
    return out


def key_lines(text: str) -> dict[str, str]:
    """``key=value [more]`` lines as {key: "value [more]"}; lines whose key is empty or has
    a space are left out."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key and " " not in key:
            out[key] = value
    return out


def number(value: object, program: str, what: str, text: str) -> float:
    """``value`` as a finite float: a JSON number (not a bool) or a decimal numeral as
    Python's float() reads it (``nan``, ``inf`` and overflow to infinity refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise GuestOutputError(program, f"{what} that is not a number ({value!r:.60})", text)
    try:
        out = float(value)
    except (ValueError, OverflowError):
        raise GuestOutputError(program, f"{what} that is not a number ({value!r:.60})", text) from None
    if not math.isfinite(out):
        raise GuestOutputError(program, f"{what} that is not finite ({value!r:.60})", text)
    return out


def numbers(text: str, keys: Iterable[str], program: str) -> dict[str, float]:
    """The ``key=value`` words at ``keys`` of ``text`` (:func:`tokens`), each a finite
    number; a key missing is an error (the program stopped before it printed it)."""
    found = tokens(text)
    out = {}
    for key in keys:
        if key not in found:
            raise GuestOutputError(program, f"no {key}=", text)
        out[key] = number(found[key], program, key, text)
    return out


def json_value(text: str, program: str, *, rest: bool = False) -> object:
    """``text`` as JSON (with ``rest``, the JSON it starts with: a program may print more
    after its report); nested past the parser's stack, or not JSON, is an error."""
    try:
        return json.JSONDecoder().raw_decode(text)[0] if rest else json.loads(text)
    except (ValueError, RecursionError) as exc:  # (JSONDecodeError and a bad escape are ValueErrors)
        raise GuestOutputError(program, f"no JSON ({type(exc).__name__}: {exc!s:.80})", text) from None


def json_object(text: str, program: str, what: str, *, rest: bool = False) -> dict:
    value = json_value(text, program, rest=rest)
    if not isinstance(value, dict):
        raise GuestOutputError(program, f"{what} that is not a JSON object", text)
    return value


def fio_side(text: str, side: str) -> dict:
    """The ``side`` (``read`` or ``write``) of fio's first job in its ``--output-format=json``
    (what fio printed before or after the JSON, a warning, is skipped), with :data:`FIO_NUMBERS` and
    ``lat_ns.mean`` checked finite numbers of at least 0 (converted to float)."""
    start = text.find("{")
    if start < 0:
        raise GuestOutputError("fio", "no JSON", text)
    report = json_object(text[start:], "fio", "a report", rest=True)
    jobs = report.get("jobs")
    if not isinstance(jobs, list) or not jobs or not isinstance(jobs[0], dict) \
            or not isinstance(jobs[0].get(side), dict):
        raise GuestOutputError("fio", f"no job with a {side} side", text)
    out = dict(jobs[0][side])
    lat = out.get("lat_ns")
    if not isinstance(lat, dict):
        raise GuestOutputError("fio", f"a {side} side without lat_ns", text)
    out["lat_ns"] = {**lat, "mean": _at_least_zero(lat.get("mean"), "fio", f"{side}.lat_ns.mean", text)}
    for key in FIO_NUMBERS:
        out[key] = _at_least_zero(out.get(key), "fio", f"{side}.{key}", text)
    return out


def proc_stat(text: str) -> dict[str, int]:
    """The guest's ``/proc/stat``: its ``cpu`` line's first seven columns (:data:`STAT_CPU`,
    in USER_HZ ticks) and the ``intr`` and ``ctxt`` totals, each a count."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu" and len(fields) >= 8:
            out.update(zip(STAT_CPU, (_count(f, "/proc/stat", "cpu", text) for f in fields[1:8])))
        elif fields and fields[0] in ("intr", "ctxt") and len(fields) >= 2:
            out[fields[0]] = _count(fields[1], "/proc/stat", fields[0], text)
    missing = [key for key in (*STAT_CPU, "intr", "ctxt") if key not in out]
    if missing:
        raise GuestOutputError("/proc/stat", f"no {', '.join(missing)}", text)
    return out


def udev_events(text: str, program: str) -> list[dict]:
    """The JSON lines (those that start with ``{``) a guest's udev watcher printed, each an
    object; an ``add`` must carry a PCI address as ``bdf`` (the plug's caller drives the
    device there)."""
    events = []
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        event = json_object(line, program, "an event")
        if event.get("action") == "add":
            bdf = event.get("bdf")
            if not isinstance(bdf, str) or not PCI_ADDRESS.fullmatch(bdf):
                raise GuestOutputError(program, f"an add without a PCI address ({bdf!r:.60})", text)
        events.append(event)
    return events


def workload_lines(text: str, labels: Iterable[str],
                   program: str) -> tuple[dict[str, dict[str, dict]], dict[str, str] | None]:
    """The accel runner's lines (:data:`dxpu_vfio.lab.accel.GUEST_RUNNER`): {label: {name:
    result}} of its ``workload=`` lines for the devices ``labels``, and the first
    ``workload_failed=`` line's {workload, error}, if any. A result must name its workload
    and carry :data:`RUN_NUMBERS` as finite numbers; a line of a device not asked for is
    left out (its caller finds a workload missing)."""
    out: dict[str, dict[str, dict]] = {label: {} for label in labels}
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key == "workload":
            run = json_object(value, program, "a workload result")
            label = run.pop("device", None)
            if not isinstance(run.get("workload"), str):
                raise GuestOutputError(program, "a workload result without its name", text)
            for field in RUN_NUMBERS:
                run[field] = number(run.get(field), program, f"{run['workload']}'s {field}", text)
            if isinstance(label, str) and label in out:
                out[label][run["workload"]] = run
        elif key == "workload_failed":
            failed = json_object(value, program, "a failure")
            if not isinstance(failed.get("workload"), str) or not isinstance(failed.get("error"), str):
                raise GuestOutputError(program, "a failure without its workload and error", text)
            return out, {"workload": failed["workload"], "error": failed["error"]}
    return out, None


def kms_fill(text: str) -> dict:
    """The KMS client's last line (``vm_images/tools/dxpu_kms.py --repeat``): {bytes, fill_s}
    with a positive count of bytes and one positive time per fill."""
    last = text.strip().splitlines()[-1:] or [""]
    report = json_object(last[0], "dxpu_kms.py", "a report")
    size, fills = report.get("bytes"), report.get("fill_s")
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise GuestOutputError("dxpu_kms.py", f"a size that is not a positive count ({size!r:.60})", text)
    if not isinstance(fills, list) or not fills:
        raise GuestOutputError("dxpu_kms.py", "no fill times", text)
    seconds = [number(s, "dxpu_kms.py", "a fill time", text) for s in fills]
    if min(seconds) <= 0:
        raise GuestOutputError("dxpu_kms.py", "a fill time that is not positive", text)
    return {**report, "bytes": size, "fill_s": seconds}


def _at_least_zero(value: object, program: str, what: str, text: str) -> float:
    out = number(value, program, what, text)
    if out < 0:
        raise GuestOutputError(program, f"a negative {what}", text)
    return out


def _count(value: str, program: str, what: str, text: str) -> int:
    if not value.isascii() or not value.isdigit() or len(value) > 20:  # (isdigit alone takes ² and ٣)
        raise GuestOutputError(program, f"a {what} count that is not a count ({value!r:.60})", text)
    return int(value)
