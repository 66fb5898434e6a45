#!/usr/bin/env python3
"""Pool store benchmark: allocate and free N devices across M VMs; operations per second.

    .venv/bin/python scripts/bench_pool.py [--devices 10000] [--vms 1000] [--boxes 100] [--policy pack|spread]

Measures the store alone (SQLite, WAL, one file on disk): registering the boxes, one
``allocate`` per device (what every attach does first, in one BEGIN IMMEDIATE), the
lease updates an attach then makes (socket, proxy pid, port, attached), listing the
pool, and freeing every lease. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dxpu_vfio.bench import table, write_json  # noqa: E402
from dxpu_vfio.pool.states import LeaseState  # noqa: E402
from dxpu_vfio.pool.store import Store  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=10000)
    parser.add_argument("--vms", type=int, default=1000)
    parser.add_argument("--boxes", type=int, default=100)
    parser.add_argument("--policy", default="pack", choices=["pack", "spread"])
    parser.add_argument("--out", type=Path, help="JSON path (default results/bench/pool.json)")
    args = parser.parse_args()
    per_box = -(-args.devices // args.boxes)
    rows = []
    with tempfile.TemporaryDirectory(prefix="dxpu-bench-pool-") as tmp:
        store = Store(Path(tmp) / "pool.db")

        def timed(name: str, count: int, fn) -> None:
            start = time.perf_counter()
            fn()
            seconds = time.perf_counter() - start
            rows.append({"operation": name, "count": count, "seconds": round(seconds, 3),
                         "ops_per_s": round(count / seconds, 1), "us_per_op": round(seconds / count * 1e6, 1)})

        def register() -> None:
            for b in range(args.boxes):
                store.register_box(f"box{b}", f"198.18.{b // 250}.{b % 250 + 1}:7000", None, [
                    {"id": f"d{i}", "class": "nvme" if i % 2 else "testdev", "vendor": "1b36",
                     "model": "10f1", "capacity": 1 << 30, "lease": "t"}
                    for i in range(per_box) if b * per_box + i < args.devices])

        leases = []

        def allocate() -> None:
            for i in range(args.devices):
                leases.extend(store.allocate(f"qmp:/vm{i % args.vms}", policy=args.policy, owner_pid=1))

        def attach_updates() -> None:
            for lease in leases:
                store.update_lease(lease.id, socket=f"/run/{lease.id}.sock", proxy_pid=2, port="rp1")
                store.update_lease(lease.id, state=LeaseState.ATTACHED)

        def listing() -> None:
            for _ in range(10):
                store.devices()
                store.leases()

        def free() -> None:
            for lease in leases:
                store.delete_lease(lease.id)

        timed("register boxes", args.boxes, register)
        timed("allocate (1 device)", args.devices, allocate)
        timed("attach bookkeeping (2 updates)", args.devices, attach_updates)
        timed("list devices + leases", 10, listing)
        timed("free (delete lease)", args.devices, free)
        assert len({lease.device for lease in leases}) == args.devices, "a device was allocated twice"
        assert store.leases() == []
        store.close()
    total = sum(r["seconds"] for r in rows if r["operation"] in ("allocate (1 device)", "free (delete lease)"))
    summary = {"devices": args.devices, "vms": args.vms, "boxes": args.boxes, "policy": args.policy,
               "allocate_and_free_ops_per_s": round(2 * args.devices / total, 1)}
    print(f"pool store: {args.devices} devices in {args.boxes} boxes, {args.vms} VMs, policy {args.policy}")
    print(table(["operation", "count", "seconds", "ops/s", "µs/op"],
                [[r["operation"], r["count"], r["seconds"], r["ops_per_s"], r["us_per_op"]] for r in rows]))
    print(f"allocate + free: {summary['allocate_and_free_ops_per_s']} ops/s")
    print(f"wrote {write_json('pool', {'summary': summary, 'rows': rows}, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
