#!/usr/bin/env python3
"""Structure-aware fuzzing of the project's servers and of what they read from peers: the
vfio-user server (test device, NVMe, accelerator, display), the remote proxy's link, the
host proxy's link as a malicious box reaches it, a box's vfio-user client as an external
server reaches it, the manager API, the etcd store's client (and a host agent) behind a
relay that changes etcd's answers, the manager as a wrong box answers it, the VM
runner's guest command channels as a hostile guest answers them, and the lab's readers
of what its programs print in a guest and of a box's FAULT answers, and the manager's
client as a wrong manager answers (dxpu_vfio/fuzz/; docs/testing.md).

    scripts/fuzz.py [--target NAME ...] [--seconds S | --count N] [--seed N] [--json PATH]

Each target runs for --seconds or until --count messages; reports messages, crashes,
hangs, tracebacks, violations, sessions dropped and memory growth; exits 1 on any finding, and writes
a reproducer per finding under --out (replay: the command it names).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dxpu_vfio.fuzz.runner import Result, Run  # noqa: E402
from dxpu_vfio.fuzz.targets import TARGETS, make_target  # noqa: E402


def table(results: list[Result]) -> str:
    rows = [("target", "messages", "rate/s", "crashes", "hangs", "tracebacks", "violations", "drops", "rss growth")]
    for r in results:
        rows.append((r.target, str(r.messages), f"{r.rate:.0f}", str(r.crashes), str(r.hangs), str(r.tracebacks),
                     str(r.violations), str(r.drops), f"{r.rss_growth_kb / 1024:.1f} MiB" + (" !" if any(f.kind == "rss" for f in r.findings) else "")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
                     for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", choices=sorted(TARGETS),
                        help="fuzz this target (repeatable; default: all)")
    parser.add_argument("--seconds", type=float, help="per target (default 10 unless --count or --stop)")
    parser.add_argument("--count", type=int, help="messages per target")
    parser.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    parser.add_argument("--start", type=int, default=0, help="first unit index (a reproducer's range)")
    parser.add_argument("--stop", type=int, help="stop before this unit index")
    parser.add_argument("--check-every", type=int, default=8, help="units between liveness checks")
    parser.add_argument("--hang-timeout", type=float, default=5.0, help="seconds a known-good request may take")
    parser.add_argument("--rss-limit-mb", type=float, default=64.0, help="anonymous memory growth that is a finding")
    parser.add_argument("--out", type=Path, default=Path("build/fuzz"), help="reproducers go here")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--fail-on-drops", action="store_true",
                        help="a session the target ended with its framing intact is a finding (else reported)")
    parser.add_argument("--progress", type=float, default=0.0, help="a progress line every this many seconds")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    seconds = args.seconds if args.seconds is not None or args.count or args.stop is not None else 10.0
    print(f"fuzz: seed {seed}", flush=True)

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupt)  # a run ended by pid still stops its servers and reports
    results = []
    for name in args.target or list(TARGETS):
        run = Run(make_target(name), seed=seed, start=args.start, stop=args.stop, count=args.count, seconds=seconds,
                  check_every=args.check_every, hang_timeout=args.hang_timeout, rss_limit_mb=args.rss_limit_mb,
                  out=args.out, progress=args.progress, fail_on_drops=args.fail_on_drops)
        results.append(run.execute())
        if run.interrupted:
            print(f"fuzz: interrupted during {name}: stopping after {run.result.messages} messages", flush=True)
        if args.json:  # after each target: a long run that is cut short keeps what it did
            args.json.write_text(json.dumps({"seed": seed, "results": [r.as_dict() for r in results]}, indent=1))
        if run.interrupted:
            break
    print(table(results))
    findings = sum(len(r.findings) for r in results)
    if findings:
        print(f"fuzz: {findings} findings; reproducers in {args.out}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
