#!/usr/bin/env python3
"""Pool store benchmark: N concurrent allocators take every device one at a time, then free them.

    .venv/bin/python scripts/bench_pool.py [--store sqlite|etcd] [--boxes 1000] [--per-box 8]
        [--allocators 8] [--policy pack|spread] [--etcd-members 1|3] [--etcd-endpoints URL,...]

Measures the store alone, as the managers of many hosts would use it: the boxes are
registered, then ``--allocators`` processes (each its own store handle: its own SQLite
connection, or its own etcd client) allocate devices one ``allocate`` each until all are
taken, make the lease updates an attach makes (socket, proxy pid and port; attached),
and free them. Per operation: throughput over the phase's wall time, and p50/p99/max
latency. For ``--store etcd`` the script starts its own members on free ports (data in a
temporary directory, or under ``--etcd-dir``) unless ``--etcd-endpoints`` names a cluster, whose ``--prefix`` it
then uses and clears. On the members it starts, it then times a box's death: a box
announced under a 3 s lease and never renewed after, until the store says it is down
(goal: within 2 TTLs). Prints a table and writes JSON (results/bench/pool-<store>.json).
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dxpu_vfio.bench import table, write_json  # noqa: E402
from dxpu_vfio.pool.states import LeaseState  # noqa: E402

PHASES = ("allocate (1 device)", "attach bookkeeping (2 updates)", "free (delete lease)")


@dataclass(frozen=True)
class Spec:
    kind: str
    path: str
    endpoints: tuple[str, ...] = ()
    prefix: str = "/dxpu-bench/v1/"

    def open(self):
        if self.kind == "sqlite":
            from dxpu_vfio.pool.store import Store
            return Store(self.path)
        from dxpu_vfio.pool.etcd_store import EtcdStore
        return EtcdStore(list(self.endpoints), path=self.path, prefix=self.prefix)


def worker(spec: Spec, index: int, share: int, vms: int, policy: str, barrier, out) -> None:
    """One allocator: its share of the devices, one operation at a time, per phase."""
    store = spec.open()
    leases, samples = [], {phase: [] for phase in PHASES}
    barrier.wait()
    for i in range(share):
        start = time.perf_counter()
        leases += store.allocate(f"qmp:/run/host{index}/vm{i % vms}.sock", policy=policy, owner_pid=index + 1)
        samples[PHASES[0]].append(time.perf_counter() - start)
    barrier.wait()
    barrier.wait()
    for lease in leases:
        start = time.perf_counter()
        store.update_lease(lease.id, socket=f"/run/{lease.id}.sock", proxy_pid=2, port="rp1")
        store.update_lease(lease.id, state=LeaseState.ATTACHED)
        samples[PHASES[1]].append(time.perf_counter() - start)
    barrier.wait()
    barrier.wait()
    for lease in leases:
        start = time.perf_counter()
        store.delete_lease(lease.id)
        samples[PHASES[2]].append(time.perf_counter() - start)
    barrier.wait()
    out.put((index, [lease.device for lease in leases], samples, getattr(store, "conflicts", 0)))
    store.close()


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(spec: Spec, args: argparse.Namespace) -> tuple[list[dict], dict]:
    devices = args.boxes * args.per_box
    store = spec.open()
    start = time.perf_counter()
    for b in range(args.boxes):
        store.register_box(f"box{b}", f"198.18.{b // 250}.{b % 250 + 1}:7000", None, [
            {"id": f"d{i}", "class": "nvme" if i % 2 else "testdev", "vendor": "1b36", "model": "10f1",
             "capacity": 1 << 30, "lease": "t"} for i in range(args.per_box)])
    rows = [{"operation": "register boxes", "count": args.boxes, "seconds": round(time.perf_counter() - start, 3)}]
    shares = [devices // args.allocators + (i < devices % args.allocators) for i in range(args.allocators)]
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(args.allocators + 1), ctx.Queue()
    workers = [ctx.Process(target=worker, args=(spec, i, shares[i], args.vms, args.policy, barrier, out))
               for i in range(args.allocators)]
    for w in workers:
        w.start()
    walls = []
    barrier.wait(300)  # every worker has its store open
    for phase in PHASES:
        start = time.perf_counter()
        barrier.wait(1800)
        walls.append(time.perf_counter() - start)
        if phase == PHASES[0]:
            listed = time.perf_counter()
            store.devices()
            store.leases()
            rows.append({"operation": "list devices + leases (all leased)", "count": 1,
                         "seconds": round(time.perf_counter() - listed, 3)})
        if phase != PHASES[-1]:
            barrier.wait(300)
    results = sorted(out.get(timeout=300) for _ in workers)
    for w in workers:
        w.join(60)
        assert w.exitcode == 0, f"allocator {w.name} failed"
    taken = [d for _, got, _, _ in results for d in got]
    assert len(taken) == len(set(taken)) == devices, "a device was allocated twice, or not at all"
    assert store.leases() == [], "a lease outlived the free phase"
    if spec.kind == "etcd" and args.etcd_endpoints:
        from dxpu_vfio.pool.etcd_client import b64, prefix_end
        store.etcd.call("/kv/deleterange", {"key": b64(spec.prefix), "range_end": prefix_end(spec.prefix)})
    store.close()
    for phase, wall in zip(PHASES, walls):
        samples = [s for _, _, by_phase, _ in results for s in by_phase[phase]]
        rows.append({"operation": phase, "count": len(samples), "seconds": round(wall, 3),
                     "ops_per_s": round(len(samples) / wall, 1),
                     "p50_ms": round(statistics.median(samples) * 1e3, 2),
                     "p99_ms": round(percentile(samples, 0.99) * 1e3, 2),
                     "max_ms": round(max(samples) * 1e3, 2)})
    by = {r["operation"]: r for r in rows}
    alloc, free = by[PHASES[0]], by[PHASES[2]]
    summary = {"store": spec.kind, "boxes": args.boxes, "devices": devices, "allocators": args.allocators,
               "policy": args.policy, "etcd_members": args.etcd_members if spec.kind == "etcd" else None,
               "allocate_ops_per_s": alloc["ops_per_s"], "allocate_p50_ms": alloc["p50_ms"],
               "allocate_p99_ms": alloc["p99_ms"], "free_ops_per_s": free["ops_per_s"],
               "free_p99_ms": free["p99_ms"], "lost_races": sum(r[3] for r in results),
               "allocate_and_free_ops_per_s": round(2 * devices / (alloc["seconds"] + free["seconds"]), 1)}
    return rows, summary


def box_death(spec: "Spec", ttl: float = 3.0) -> dict:
    """How long after its last lease renewal an announced box is down (etcd): a box
    announces itself with 8 devices under a lease of ``ttl`` s, renews it once, and then
    never again (what a SIGKILLed remote proxy does); the store is polled every 20 ms. A
    box dies between renewals (every ttl/3), so this is the worst case. Goal: within 2 TTLs."""
    from dxpu_vfio.pool.etcd_store import EtcdStore
    from dxpu_vfio.pool.states import BoxState
    from dxpu_vfio.remoteproxy.announce import inventory_generation
    store = EtcdStore(list(spec.endpoints), path=spec.path, prefix=spec.prefix)
    try:
        devices = [{"id": f"d{i}", "class": "testdev", "vendor": "1b36", "model": "0005", "capacity": 4096,
                    "in_use": False} for i in range(8)]
        lease = store.grant_lease(ttl)
        store.announce_box("deadbox", "127.0.0.1:1", None, devices, None, inventory_generation(devices), lease)
        store.keepalive(lease)
        renewed = time.monotonic()
        while True:
            [box] = [b for b in store.boxes() if b["name"] == "deadbox"]
            if box["state"] == BoxState.DOWN:
                break
            if time.monotonic() - renewed > 10 * ttl:
                raise SystemExit(f"the dead box was still up {10 * ttl:.0f} s after its last renewal")
            time.sleep(0.02)
        noticed = time.monotonic() - renewed
        available = sum(d["available"] for d in store.devices() if d["id"].startswith("deadbox/"))
        store.remove_box("deadbox")
        return {"box_death_ttl_s": ttl, "box_death_noticed_s": round(noticed, 3), "dead_box_devices_available": available}
    finally:
        store.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", choices=["sqlite", "etcd"], default="sqlite")
    parser.add_argument("--boxes", type=int, default=1000)
    parser.add_argument("--per-box", type=int, default=8, help="devices per box")
    parser.add_argument("--allocators", type=int, default=8, help="concurrent allocator processes")
    parser.add_argument("--vms", type=int, default=64, help="VMs per allocator the leases are spread over")
    parser.add_argument("--policy", default="pack", choices=["pack", "spread"])
    parser.add_argument("--etcd-members", type=int, default=1, help="members of the cluster the script starts")
    parser.add_argument("--etcd-dir", type=Path, help="where the members keep their data (default: a temporary "
                        "directory; /dev/shm takes the disk's fsync out of the numbers)")
    parser.add_argument("--etcd-endpoints", help="use this cluster instead (its --prefix is cleared afterwards)")
    parser.add_argument("--prefix", default="/dxpu-bench/v1/")
    parser.add_argument("--out", type=Path, help="JSON path (default results/bench/pool-<store>.json)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dxpu-bench-pool-") as tmp:
        path = str(Path(tmp) / "pool.db")
        if args.store == "sqlite":
            rows, summary = run(Spec("sqlite", path), args)
        elif args.etcd_endpoints:
            from dxpu_vfio.pool.etcd_client import endpoints_from
            rows, summary = run(Spec("etcd", path, tuple(endpoints_from(args.etcd_endpoints)), args.prefix), args)
        else:
            from dxpu_vfio.pool.etcd_cluster import EtcdCluster
            data = Path(tempfile.mkdtemp(prefix="dxpu-bench-etcd-", dir=args.etcd_dir)) if args.etcd_dir else \
                Path(tmp) / "etcd"
            with EtcdCluster(data, members=args.etcd_members) as cluster:
                spec = Spec("etcd", path, tuple(cluster.endpoints), args.prefix)
                rows, summary = run(spec, args)
                summary.update(box_death(spec))
            if args.etcd_dir:
                shutil.rmtree(data, ignore_errors=True)
            summary["etcd_data"] = str(args.etcd_dir or tempfile.gettempdir())
    print(f"pool store {args.store}: {summary['devices']} devices in {args.boxes} boxes, {args.allocators} "
          f"concurrent allocators, policy {args.policy}"
          + (f", {args.etcd_members} etcd member(s), data in {summary['etcd_data']}"
             if args.store == "etcd" and not args.etcd_endpoints else ""))
    print(table(["operation", "count", "seconds", "ops/s", "p50 ms", "p99 ms", "max ms"],
                [[r["operation"], r["count"], r["seconds"], r.get("ops_per_s", ""), r.get("p50_ms", ""),
                  r.get("p99_ms", ""), r.get("max_ms", "")] for r in rows]))
    print(f"allocate + free: {summary['allocate_and_free_ops_per_s']} ops/s; "
          f"allocate p99 {summary['allocate_p99_ms']} ms; allocations that lost a race and retried: "
          f"{summary['lost_races']}")
    if "box_death_noticed_s" in summary:
        print(f"box death: down {summary['box_death_noticed_s']} s after its last lease renewal (TTL "
              f"{summary['box_death_ttl_s']:.0f} s, goal: within 2 TTLs); its devices available after: "
              f"{summary['dead_box_devices_available']}")
    print(f"wrote {write_json(f'pool-{args.store}', {'summary': summary, 'rows': rows}, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
