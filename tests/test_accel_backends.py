"""Every kernel backend the accelerator can name computes what numpy computes in float64,
within float32's tolerance: through the interface, through the device model (entries,
VRAM, bf16), and through the guest runtime's workloads on the model in this process.

The backends are collected where they load: numpy everywhere; CuPy and PyTorch where
they are installed (a box with a GPU; `scripts/bench_accel_backends.py` and
docs/devices/accel.md say how this file is run on one). A backend that does not load
here is checked for the error that says what to install, not skipped.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_qemu_device_accel import A, B, C, D, make

from dxpu_vfio.lab.accel_direct import DirectAccel
from dxpu_vfio.lab.accel_workloads import WORKLOADS, run_passes
from qemu_device import accel as ac
from qemu_device import accel_kernels as ak


def _loads(name: str) -> bool:
    try:
        ak.get_backend(name)
    except ValueError:
        return False
    return True


LOADABLE = [name for name in sorted(ak.BACKENDS) if _loads(name)]
MISSING = [name for name in sorted(ak.BACKENDS) if name not in LOADABLE]
RNG = np.random.default_rng(16)


def rand(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def f64(x: np.ndarray | None) -> np.ndarray | None:
    return None if x is None else x.astype(np.float64)


def _gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _softmax(x):
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _layer_norm(x, g, b, eps):
    y = (x - x.mean(axis=1, keepdims=True)) / np.sqrt(x.var(axis=1, keepdims=True) + eps)
    return y * (1 if g is None else g) + (0 if b is None else b)


# name -> (inputs, call on a backend, float64 reference, rtol, atol)
def _cases() -> dict:
    x, y, sq = rand(37, 129), rand(37, 129), rand(64, 256, scale=3)
    g, b, big = rand(256), rand(256), rand(8, 300, scale=1000)
    zeros_at = np.where(RNG.random(500) < 0.3, 0, rand(500)).astype(np.float32)
    dy = rand(500)
    return {
        "gemm-odd": ((rand(33, 70), rand(70, 17)), lambda k, a, c: k.gemm(a, c), lambda a, c: a @ c, 1e-4, 1e-4),
        "gemm-mlp": ((rand(64, 1024), rand(1024, 256)), lambda k, a, c: k.gemm(a, c), lambda a, c: a @ c, 1e-4, 1e-3),
        "gemm-row": ((rand(1, 513), rand(513, 1)), lambda k, a, c: k.gemm(a, c), lambda a, c: a @ c, 1e-4, 1e-3),
        "bias_add": ((x, rand(129)), lambda k, a, c: k.bias_add(a, c), lambda a, c: a + c, 1e-6, 1e-6),
        "add": ((x, y), lambda k, a, c: k.add(a, c), lambda a, c: a + c, 1e-6, 1e-6),
        "mul": ((x, y), lambda k, a, c: k.mul(a, c), lambda a, c: a * c, 1e-6, 1e-6),
        "axpy": ((x, y), lambda k, a, c: k.axpy(a, c, -0.01), lambda a, c: a - 0.01 * c, 1e-6, 1e-6),
        "relu": ((zeros_at,), lambda k, a: k.relu(a), lambda a: np.maximum(a, 0), 0, 0),
        "relu_grad": ((zeros_at, dy), lambda k, a, c: k.relu_grad(a, c), lambda a, c: np.where(a > 0, c, 0), 0, 0),
        "gelu": ((sq,), lambda k, a: k.gelu(a), _gelu, 1e-5, 1e-5),
        "softmax": ((sq,), lambda k, a: k.softmax(a), _softmax, 1e-5, 1e-7),
        "softmax-large": ((big,), lambda k, a: k.softmax(a), _softmax, 1e-5, 1e-7),
        "layer_norm": ((sq,), lambda k, a: k.layer_norm(a, None, None, 1e-5),
                       lambda a: _layer_norm(a, None, None, 1e-5), 1e-4, 1e-4),
        "layer_norm-affine": ((sq, g, b), lambda k, a, gg, bb: k.layer_norm(a, gg, bb, 1e-3),
                              lambda a, gg, bb: _layer_norm(a, gg, bb, 1e-3), 1e-4, 1e-4),
        "sum_rows": ((x,), lambda k, a: k.sum_rows(a), lambda a: a.sum(axis=0), 1e-5, 1e-4),
    }


CASES = _cases()


def test_numpy_is_always_there():
    assert "numpy" in LOADABLE, "numpy must load everywhere: it is the default backend"


@pytest.mark.parametrize("name", MISSING or ["(none missing)"])
def test_a_backend_that_cannot_load_says_what_to_install(name):
    if not MISSING:
        assert LOADABLE == sorted(ak.BACKENDS)   # every backend loads here: nothing to say
        return
    with pytest.raises(ValueError, match=rf"pip install 'dxpu-vfio\[accel-{name}\]'"):
        ak.get_backend(name)


def test_an_unknown_backend_names_the_known_ones():
    with pytest.raises(ValueError, match="known: cupy, numpy, torch"):
        ak.get_backend("tpu")


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", LOADABLE)
def test_each_kernel_matches_numpy_in_float64(name, case):
    inputs, call, reference, rtol, atol = CASES[case]
    backend = ak.get_backend(name)
    before = [a.copy() for a in inputs]
    got = call(backend, *inputs)
    want = reference(*(f64(a) for a in inputs))
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == want.shape
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    for a, was in zip(inputs, before):          # operands are VRAM: a kernel never writes them
        np.testing.assert_array_equal(a, was)


@pytest.mark.parametrize("name", LOADABLE)
def test_the_model_computes_the_same_on_every_backend(name):
    """Entries through the device model: GEMM with both transposes and accumulate, bf16
    GEMM, affine layer norm; operands and results in VRAM."""
    drv, _ = make(backend=name)
    try:
        a_t, b_t, c0 = rand(70, 33), rand(17, 70), rand(33, 17)
        for where, array in ((A, a_t), (B, b_t), (C, c0)):
            drv.upload(where, array)
        drv.run(ac.encode_entry(ac.OP_GEMM, A, B, C, 33, 17, 70,
                                flags=ac.FLAG_TRANS_A | ac.FLAG_TRANS_B | ac.FLAG_ACCUMULATE))
        np.testing.assert_allclose(drv.download(C, (33, 17)), f64(c0) + f64(a_t).T @ f64(b_t).T, rtol=1e-4, atol=1e-4)

        a, b = rand(16, 32), rand(32, 8)
        drv.upload(A, ak.to_bf16(a))
        drv.upload(B, ak.to_bf16(b))
        drv.run(ac.encode_entry(ac.OP_GEMM, A, B, C, 16, 8, 32, dtype=ac.DTYPE_BF16))
        got = ak.from_bf16(drv.download(C, (16, 8), np.uint16))
        np.testing.assert_allclose(got, ak.from_bf16(ak.to_bf16(a)) @ ak.from_bf16(ak.to_bf16(b)), rtol=1e-2, atol=1e-2)

        x, g, bias = rand(8, 64, scale=3), rand(64), rand(64)
        for where, array in ((A, x), (B, g), (D, bias)):
            drv.upload(where, array)
        drv.run(ac.encode_entry(ac.OP_LAYER_NORM, A, B, C, 8, 64, D, ac.f32_bits(1e-3), flags=ac.FLAG_AFFINE))
        np.testing.assert_allclose(drv.download(C, (8, 64)), _layer_norm(f64(x), g, bias, 1e-3), rtol=1e-4, atol=1e-4)
        assert drv.dev.stats()["backend"] == name and drv.r32(ac.REG_ERROR_CODE) == 0
    finally:
        drv.dev.close()


@pytest.mark.parametrize("workload", ["mlp-b8", "transformer-s64", "train-step"])
@pytest.mark.parametrize("name", LOADABLE)
def test_the_guest_workloads_pass_their_checks_on_every_backend(name, workload):
    """The runtime's workloads on the model in this process (no proxy, no link): each
    checks its result against numpy (run_passes raises AssertionError if it is off)."""
    with DirectAccel(backend=name, vram_size=256 << 20) as direct:
        run = run_passes(WORKLOADS[workload](direct.dev), passes=2, counters=direct.counters)
        assert run["passes"] == 2 and run["per_pass"]["kernel_ns"] > 0
        assert direct.counters()["backend"] == name


def test_the_backend_benchmark_writes_its_table_and_json(tmp_path):
    """scripts/bench_accel_backends.py is the check a GPU box runs: on numpy here, it
    checks a workload, times the GEMMs, writes the JSON layout the docs quote; a backend
    named with --require that does not load makes it fail (exit 2) after the JSON."""
    import json
    import subprocess
    import sys

    from dxpu_vfio.paths import PROJECT_ROOT

    out = tmp_path / "backends.json"
    require = ",".join(["numpy"] + MISSING[:1])
    proc = subprocess.run([sys.executable, str(PROJECT_ROOT / "scripts" / "bench_accel_backends.py"),
                           "--backends", ",".join(sorted(ak.BACKENDS)), "--workloads", "mlp-b1",
                           "--passes", "1", "--repeat", "1", "--require", require, "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    record = json.loads(out.read_text())
    assert set(record["results"]) == set(LOADABLE) and set(record["unavailable"]) == set(MISSING)
    numpy_run = record["results"]["numpy"]
    assert numpy_run["workloads"]["mlp-b1"]["kernel_ms"] > 0
    assert numpy_run["gemm"]["1024x1024x1024"]["relative_error"] < 1e-5
    assert "mlp-b1" in proc.stdout and "GFLOP/s" in proc.stdout
    if MISSING:
        assert proc.returncode == 2 and f"required backends did not load: {MISSING[0]}" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr


FAULT_PROBE = """
import resource, numpy as np
from qemu_device import accel_kernels as ak
backend = ak.numpy_backend() if KEEP else ak.ArrayBackend()
x = np.ones((64, 1024), np.float32)
for _ in range(5):
    backend.gelu(x)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(40):
    backend.gelu(x)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _gelu_faults(keep: bool) -> int:
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", f"KEEP = {keep}\n" + FAULT_PROBE], capture_output=True, text=True,
                         timeout=60, check=True)
    return int(out.stdout.split()[-1])


def test_the_numpy_backends_temporaries_reuse_memory_instead_of_faulting_fresh_pages():
    """A GELU over 64x1024 makes five 256 KiB temporaries: above glibc's first mmap threshold,
    each a fresh mapping whose pages fault on first touch, unless the backend keeps freed
    memory (each process alone: the setting is process-wide)."""
    kept = _gelu_faults(True)
    assert kept < 40, f"{kept} page faults in 40 GELUs with freed memory kept"
    assert _gelu_faults(False) > 10 * max(kept, 40), "the probe no longer shows the faults it guards against"
