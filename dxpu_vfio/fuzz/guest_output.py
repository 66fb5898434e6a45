"""Fuzzing the lab's readers of what its programs print in a guest
(:mod:`dxpu_vfio.lab.guest_output`) as a broken or hostile guest prints it.

Each unit takes one reader and what its program prints when all is well (a sample
shaped like the real output: fio's JSON report, /proc/stat, the udev watcher's events,
the accel runner's result lines, the KMS client's report, ``key=value`` words, a PCI
address, a disk's name) and changes it: a JSON value anywhere in it replaced by another
of any type or removed, JSON nested past the stack, a number turned into ``nan``,
``inf``, ``1e999``, a negative, thousands of digits, another script's digits or a
word; lines dropped, repeated, cut short or joined; bytes flipped (decoded as the
channels decode them, invalid UTF-8 replaced); the whole repeated to hundreds of KiB.

The reader must return a value that keeps its contract (numbers finite, counts whole
and not negative, names matching their pattern) or raise
:class:`~dxpu_vfio.lab.guest_output.GuestOutputError`; anything else it raises, or a
value that breaks the contract, is a violation, and so is a reader that takes more than
:data:`SLOW_S` on one output. The probe gives every reader its sample unchanged and
checks what it reads from it, so a reader that refuses everything is a finding too.
The readers run in the fuzzer's process (they are a library), so the memory the
runner watches is the fuzzer's.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dxpu_vfio.fuzz.mutate import json_value, mutate_bytes, nested
from dxpu_vfio.fuzz.peer import Hang, Violation
from dxpu_vfio.lab import guest_output as out
from dxpu_vfio.lab.guest_output import GuestOutputError

SLOW_S = 2.0  # one reading of at most a few hundred KiB: a reader slower than this is quadratic somewhere
BIG = 256 << 10  # how far a unit repeats an output
NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?(?:e-?[0-9]+)?")
BAD_NUMBERS = ("nan", "NaN", "inf", "-inf", "Infinity", "1e999", "-1e999", "-1", "-0", "0", "", "1_0", "0x10",
               "\u0661\u0662", "\u00b2", "1" * 5000, "9" * 30, "1e-400", "true", "null", '"5"', "[1]", "{}", "1.5")
KINDS = ("value", "value", "value", "number", "number", "lines", "bytes", "nested", "big")

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


@dataclass(frozen=True)
class Reader:
    """One reader: its sample, how to call it, what its value must keep, and the value
    the pristine sample reads as."""

    name: str
    sample: str
    read: Callable[[str], object]
    keeps: Callable[[object], str | None]  # what the value breaks, or None
    expected: object


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
    Reader("fio", "fio: note: both iodepth >= 1 and synchronous I/O engine are selected\n" + FIO + "\n",
           lambda t: out.fio_side(t, "read"), _fio_keeps,
           {**json.loads(FIO)["jobs"][0]["read"], "bw_bytes": 44739242.0, "total_ios": 1024.0}),
    Reader("proc-stat", STAT, out.proc_stat, _stat_keeps,
           {"user": 4705, "nice": 0, "system": 2345, "idle": 98765, "iowait": 12, "irq": 0, "softirq": 37,
            "intr": 123456, "ctxt": 654321}),
    Reader("udev-events", EVENTS, lambda t: out.udev_events(t, "dxpu-guest-events"), _events_keep,
           [json.loads(line) for line in EVENTS.splitlines()[1:]]),
    Reader("workloads", WORKLOADS, lambda t: out.workload_lines(t, ("remote", "local"), "the accel runner"),
           _workloads_keep, _expected_workloads()),
    Reader("kms-fill", KMS, out.kms_fill, _kms_keeps, json.loads(KMS)),
    Reader("numbers", MMIO, lambda t: out.numbers(t, ("median_ns", "p99_ns"), "dxpu-mmio"),
           _numbers_keep(("median_ns", "p99_ns")), {"median_ns": 19500.0, "p99_ns": 40000.0}),
    Reader("dd-numbers", DD, lambda t: out.numbers(t, ("write_s", "read_s"), "the demo's dd"),
           _numbers_keep(("write_s", "read_s")), {"write_s": 0.52, "read_s": 0.31}),
    Reader("tokens", DD, out.tokens, _strings_keep, {"write_s": "0.52", "read_s": "0.31",
                                                      "src": "0123456789abcdef" * 2, "back": "0123456789abcdef" * 2}),
    Reader("key-lines", SELFTEST, out.key_lines, _strings_keep,
           {"device": "0000:01:00.0", "vram_bytes": "1073741824", "selftest": "passed 12 checks"}),
    Reader("pci-address", "0000:01:00.0\n", lambda t: out.pci_address(t, "the guest's sysfs poll"),
           _word_keeps(out.PCI_ADDRESS), "0000:01:00.0"),
    Reader("nvme-disk", "nvme0n1\n", lambda t: out.word(t, out.NVME_DISK, "the guest's sysfs poll", "NVMe disk"),
           _word_keeps(out.NVME_DISK), "nvme0n1"),
)


def _mutate_value(rng: random.Random, doc: object) -> object:
    """``doc`` (parsed JSON) with one value somewhere in it replaced by any JSON value, an
    edge number or nothing (removed from its object or list)."""
    if not isinstance(doc, (dict, list)) or not doc or rng.random() < 0.2:
        return rng.choice((json_value(rng), rng.choice((float("nan"), float("inf"), -1, -1.5, 0, 10**30, True,
                                                        "12", None, [], {}))))
    keys = list(doc) if isinstance(doc, dict) else list(range(len(doc)))
    key = rng.choice(keys)
    copy = dict(doc) if isinstance(doc, dict) else list(doc)
    if rng.random() < 0.15:
        del copy[key]  # type: ignore[arg-type]
    else:
        copy[key] = _mutate_value(rng, copy[key])  # type: ignore[index]
    return copy


def _json_spans(text: str) -> list[tuple[int, int, object]]:
    """Where in ``text`` a line carries a JSON object from its first ``{``: (start, end, value)."""
    spans, pos = [], 0
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\n")
        brace = body.find("{")
        if brace >= 0:
            try:
                spans.append((pos + brace, pos + len(body), json.loads(body[brace:])))
            except ValueError:
                pass
        pos += len(line)
    return spans


def mutate(rng: random.Random, kind: str, sample: str) -> str:
    """``sample`` changed the way ``kind`` says (:data:`KINDS`)."""
    spans = _json_spans(sample)
    if kind in ("value", "nested") and spans:
        start, end, doc = rng.choice(spans)
        if kind == "nested":
            body = nested(rng).decode()
        else:  # (NaN and Infinity come out as JSON's extensions, which Python's reader takes)
            body = json.dumps(_mutate_value(rng, doc))
        return sample[:start] + body + sample[end:]
    numbers = list(NUMBER.finditer(sample))
    if kind in ("value", "number", "nested") and numbers:
        match = rng.choice(numbers)
        return sample[:match.start()] + rng.choice(BAD_NUMBERS) + sample[match.end():]
    if kind == "big":
        return sample * max(1, BIG // max(len(sample), 1))
    if kind == "lines":
        lines = sample.splitlines(keepends=True) or [""]
        i = rng.randrange(len(lines))
        roll = rng.randrange(6)
        if roll == 0:
            del lines[i]
        elif roll == 1:
            lines.insert(i, lines[i])
        elif roll == 2:
            lines[i] = lines[i][:rng.randint(0, len(lines[i]))]  # cut short (a guest that died mid-line)
        elif roll == 3:
            lines[i] = lines[i].rstrip("\n")  # joined with the next
        elif roll == 4:
            lines.insert(i, rng.choice(("\n", "=\n", "==\n", "{\n", " \n", "\x00\n", "\r\n", "workload=\n",
                                        "cpu\n", "intr\n", "key=value=more\n", "\ufffd\n")))
        else:
            lines = [line.replace("\n", "\r\n") for line in lines]
        return "".join(lines)
    return mutate_bytes(rng, sample.encode(), 1 << 16).decode(errors="replace")


class GuestOutputTarget:
    """Every reader of :mod:`dxpu_vfio.lab.guest_output`, in this process."""

    name = "guest-output"

    def __init__(self) -> None:
        self.log_path = Path("/nonexistent")  # no server log: what goes wrong is raised here
        self.started = False

    def start(self, workdir: Path) -> None:
        self.started = True

    def stop(self) -> None:
        self.started = False

    def pid(self) -> int | None:
        return os.getpid()

    def alive(self) -> bool:
        return self.started

    def take_drops(self) -> list[str]:
        return []

    @staticmethod
    def _read(reader: Reader, text: str) -> object | GuestOutputError:
        """What ``reader`` made of ``text``: its value or the GuestOutputError it raised;
        :class:`Violation` for anything else, :class:`Hang` if it took past :data:`SLOW_S`."""
        started = time.monotonic()
        try:
            value: object | GuestOutputError = reader.read(text)
        except GuestOutputError as exc:
            value = exc
        except Exception as exc:  # noqa: BLE001 - what the fuzzer looks for
            raise Violation(f"the {reader.name} reader raised {type(exc).__name__}: {exc!s:.300} on "
                            f"{text[:300]!r}\n" + "".join(traceback.format_exception(exc))[-3000:]) from None
        took = time.monotonic() - started
        if took > SLOW_S:
            raise Hang(f"the {reader.name} reader took {took:.1f} s on {len(text)} characters")
        if not isinstance(value, GuestOutputError):
            try:
                broken = reader.keeps(value)
            except Exception as exc:  # noqa: BLE001 - a value of a shape the check did not foresee
                broken = f"of another shape ({type(exc).__name__}: {exc!s:.100}): {str(value)[:200]}"
            if broken:
                raise Violation(f"the {reader.name} reader returned a value that is {broken}, from {text[:300]!r}")
        return value

    def send(self, index: int, rng: random.Random) -> list[bytes]:
        reader, kind = rng.choice(READERS), rng.choice(KINDS)
        text = mutate(rng, kind, reader.sample)
        value = self._read(reader, text)
        outcome = f"refused: {value.problem}" if isinstance(value, GuestOutputError) else "read"
        return [f"{reader.name}: {kind} -> {outcome:.200}".encode(), text.encode()[:1 << 16]]

    def probe(self, deadline: float) -> None:
        for reader in READERS:
            value = self._read(reader, reader.sample)
            if value != reader.expected:
                raise Violation(f"the {reader.name} reader read its sample as {str(value)[:400]}, not "
                                f"{str(reader.expected)[:400]}")
