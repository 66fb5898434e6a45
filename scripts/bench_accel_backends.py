#!/usr/bin/env python3
"""The accelerator's kernel backends compared: numpy (the default) and, where they load,
CuPy and PyTorch on a GPU. Answers two questions a box owner asks before naming a
backend in the box config: does it compute the same (each workload's numerics are
checked against numpy, as in the guest), and what does it do to the device's own time,
the "compute" term of the performance model (docs/perfmodel.md)?

Each workload of ``dxpu_vfio.lab.accel_workloads`` runs on the device model in this
process (``dxpu_vfio.lab.accel_direct``: no proxy, no link), so a pass is the device's
dispatch and compute alone; per backend: median pass, the kernels' share of it
(``kernel_ns``: operands to the backend, compute, result back), the numerics' worst
error. Then plain GEMMs through the backend interface at a workload's size and at sizes
where a GPU pays, with the operands' trips over the GPU's bus counted in (the model keeps
VRAM in the box's memory: every kernel moves its operands there and back), and on a GPU
the same GEMMs with the operands resident there: the GPU's own rate.

Needs only numpy, the device model and the DMA table: runs on a GPU machine's own Python
(CuPy / PyTorch there) without the lab's dependencies. Table on stdout, JSON in
results/bench/accel_backends.json (``results -> backend -> workloads / gemm``,
``unavailable -> backend -> why``).

    python3 scripts/bench_accel_backends.py [--backends numpy,cupy,torch] [--passes 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from dxpu_vfio.bench import table, write_json  # noqa: E402
from dxpu_vfio.lab.accel_direct import DirectAccel  # noqa: E402
from dxpu_vfio.lab.accel_workloads import WORKLOADS, run_passes  # noqa: E402
from qemu_device.accel_kernels import BACKENDS, get_backend  # noqa: E402

# (M, N, K): the MLP's layer at batch 64, the transformer's MLP at sequence 256, then
# sizes where compute outweighs moving the operands
GEMMS = ((64, 1024, 1024), (256, 1024, 256), (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096))


def accelerator(name: str) -> str:
    """What the backend computes on, in words."""
    try:
        if name == "torch":
            import torch  # type: ignore[import-not-found]
            return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (torch, no CUDA)"
        if name == "cupy":
            import cupy  # type: ignore[import-not-found]
            props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
            return props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    except Exception as exc:   # noqa: BLE001 - a description only
        return f"? ({exc})"
    return "CPU (numpy)"


def bench_gemm(backend, m: int, n: int, k: int, repeat: int) -> dict:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    got = backend.gemm(a, b)                        # warm-up (and the check)
    want = a.astype(np.float64) @ b.astype(np.float64)
    error = float(np.max(np.abs(got - want)) / max(1.0, float(np.max(np.abs(want)))))
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        backend.gemm(a, b)
        times.append(time.perf_counter() - started)
    median = statistics.median(times)
    return {"median_us": median * 1e6, "gflops": 2 * m * n * k / median / 1e9, "relative_error": error}


def resident_gemm(name: str, m: int, n: int, k: int, repeat: int) -> dict | None:
    """The GPU's own fp32 GEMM rate, operands already on it (outside the backend
    interface): what a box that kept VRAM on the GPU would compute at. None for numpy."""
    if name == "torch":
        import torch  # type: ignore[import-not-found]
        if not torch.cuda.is_available():
            return None
        a, b = torch.randn(m, k, device="cuda"), torch.randn(k, n, device="cuda")
        sync = torch.cuda.synchronize
        mm = torch.matmul
    elif name == "cupy":
        import cupy  # type: ignore[import-not-found]
        a = cupy.random.standard_normal((m, k), dtype=cupy.float32)
        b = cupy.random.standard_normal((k, n), dtype=cupy.float32)
        sync = cupy.cuda.runtime.deviceSynchronize
        mm = cupy.matmul
    else:
        return None
    mm(a, b)
    sync()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        mm(a, b)
        sync()
        times.append(time.perf_counter() - started)
    median = statistics.median(times)
    return {"median_us": median * 1e6, "gflops": 2 * m * n * k / median / 1e9}


def bench_backend(name: str, workloads: list[str], passes: int, threads: int, repeat: int) -> dict:
    out: dict = {"accelerator": accelerator(name), "workloads": {}, "gemm": {}}
    with DirectAccel(backend=name, threads=threads) as direct:
        for wl in workloads:
            workload = WORKLOADS[wl](direct.dev)
            run = run_passes(workload, passes, direct.counters)
            out["workloads"][wl] = {"median_ms": run["median_s"] * 1e3,
                                    "kernel_ms": run["per_pass"]["kernel_ns"] / 1e6,
                                    "span_ms": run["span_mean_s"] * 1e3,
                                    "max_abs_error": run["max_abs_error"]}
            del workload
    backend = get_backend(name, threads)
    for m, n, k in GEMMS:
        out["gemm"][f"{m}x{n}x{k}"] = bench_gemm(backend, m, n, k, repeat)
        resident = resident_gemm(name, m, n, k, repeat)
        if resident is not None:
            out["gemm"][f"{m}x{n}x{k}"]["resident"] = resident
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated (default: all known)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--passes", type=int, default=5, help="timed passes per workload")
    parser.add_argument("--repeat", type=int, default=5, help="timed GEMMs per size")
    parser.add_argument("--threads", type=int, default=1, help="numpy's BLAS threads")
    parser.add_argument("--require", default="", help="comma-separated backends that must load (else exit 2)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    names, workloads = args.backends.split(","), args.workloads.split(",")
    unknown = (set(names) - set(BACKENDS)) | (set(workloads) - set(WORKLOADS))
    if unknown:
        sys.exit(f"unknown backends or workloads {sorted(unknown)}; backends: {', '.join(BACKENDS)}; "
                 f"workloads: {', '.join(WORKLOADS)}")
    results: dict = {}
    unavailable: dict = {}
    for name in names:
        try:
            get_backend(name, args.threads)
        except ValueError as exc:
            unavailable[name] = str(exc)
            continue
        results[name] = bench_backend(name, workloads, args.passes, args.threads, args.repeat)

    for name, why in unavailable.items():
        print(f"{name}: not here ({why})")
    for name, res in results.items():
        print(f"\n{name} on {res['accelerator']}")
        print(table(["workload", "pass ms", "kernels ms", "max abs error"],
                    [[wl, r["median_ms"], r["kernel_ms"], f"{r['max_abs_error']:.2e}"]
                     for wl, r in res["workloads"].items()]))
    shapes = [s for s in next(iter(results.values()))["gemm"]] if results else []
    if shapes:
        print("\nGEMM fp32 through the backend interface (operands there and back), GFLOP/s")
        print(table(["M x N x K"] + list(results),
                    [[s] + [results[n]["gemm"][s]["gflops"] for n in results] for s in shapes]))
        gpus = [n for n in results if "resident" in results[n]["gemm"][shapes[0]]]
        if gpus:
            print("\nthe same GEMMs with the operands resident on the GPU (its own rate), GFLOP/s, and us each")
            print(table(["M x N x K"] + [f"{n} GFLOP/s" for n in gpus] + [f"{n} us" for n in gpus],
                        [[s] + [results[n]["gemm"][s]["resident"]["gflops"] for n in gpus]
                         + [results[n]["gemm"][s]["resident"]["median_us"] for n in gpus] for s in shapes]))
    path = write_json("accel_backends", {"results": results, "unavailable": unavailable,
                                         "settings": {"passes": args.passes, "threads": args.threads}}, args.out)
    print(f"\nJSON: {path}")
    missing = [n for n in args.require.split(",") if n and n not in results]
    if missing:
        print(f"required backends did not load: {', '.join(missing)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
