"""The accelerator's kernels behind a small backend interface.

The device model (:mod:`qemu_device.accel`) checks every command, loads its operands
from VRAM as float32 numpy arrays and hands them to a backend; the backend only
computes. numpy is the default and runs anywhere; a box with a real GPU can name
``backend = "cupy"`` or ``"torch"`` (the optional extras ``accel-cupy`` /
``accel-torch``), which move the operands to the GPU, compute there and bring the
result back, so the model never depends on them. Every backend computes in float32;
bf16 operands are widened before and rounded after (:func:`to_bf16`).
"""

from __future__ import annotations

import ctypes
import math
from typing import Callable, Protocol

import numpy as np

GELU_C = math.sqrt(2.0 / math.pi)


class KernelBackend(Protocol):
    """What a backend computes; inputs and results are float32 numpy arrays."""

    name: str

    def gemm(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """``a @ b`` for 2-D ``a`` (M x K) and ``b`` (K x N)."""
        ...

    def bias_add(self, x: np.ndarray, bias: np.ndarray) -> np.ndarray:
        """``x + bias`` with ``bias`` (cols) broadcast over the rows of ``x``."""
        ...

    def add(self, x: np.ndarray, y: np.ndarray) -> np.ndarray: ...

    def mul(self, x: np.ndarray, y: np.ndarray) -> np.ndarray: ...

    def axpy(self, x: np.ndarray, y: np.ndarray, alpha: float) -> np.ndarray:
        """``x + alpha * y`` (an SGD update is ``w + (-lr) * grad``)."""
        ...

    def relu(self, x: np.ndarray) -> np.ndarray: ...

    def relu_grad(self, x: np.ndarray, dy: np.ndarray) -> np.ndarray:
        """``dy`` where ``x > 0``, else 0: ReLU's backward pass."""
        ...

    def gelu(self, x: np.ndarray) -> np.ndarray:
        """GELU, tanh approximation (as GPT-2 and PyTorch's ``approximate='tanh'``)."""
        ...

    def softmax(self, x: np.ndarray) -> np.ndarray:
        """Softmax over each row of 2-D ``x`` (max-subtracted, so large inputs stay finite)."""
        ...

    def layer_norm(self, x: np.ndarray, gamma: np.ndarray | None, beta: np.ndarray | None,
                   eps: float) -> np.ndarray:
        """Normalise each row of 2-D ``x`` to mean 0, variance 1, then ``* gamma + beta``."""
        ...

    def sum_rows(self, x: np.ndarray) -> np.ndarray:
        """Column sums of 2-D ``x`` (a bias's gradient)."""
        ...


class ArrayBackend:
    """The kernels written once against an array module with numpy's API (``xp``):
    numpy itself, or CuPy on a GPU. ``to``/``back`` move operands there and results
    back to numpy."""

    def __init__(self, xp=np, name: str = "numpy", to: Callable | None = None,
                 back: Callable | None = None) -> None:
        self.xp, self.name = xp, name
        self._to = to or (lambda a: a)
        self._back = back or (lambda a: a)

    def _in(self, *arrays):
        return [None if a is None else self._to(a) for a in arrays]

    def _out(self, result) -> np.ndarray:
        return np.asarray(self._back(result), dtype=np.float32)

    def gemm(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        a, b = self._in(a, b)
        return self._out(self.xp.matmul(a, b))

    def bias_add(self, x: np.ndarray, bias: np.ndarray) -> np.ndarray:
        x, bias = self._in(x, bias)
        return self._out(x + bias[None, :])

    def add(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        x, y = self._in(x, y)
        return self._out(x + y)

    def mul(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        x, y = self._in(x, y)
        return self._out(x * y)

    def axpy(self, x: np.ndarray, y: np.ndarray, alpha: float) -> np.ndarray:
        x, y = self._in(x, y)
        return self._out(x + np.float32(alpha) * y)

    def relu(self, x: np.ndarray) -> np.ndarray:
        (x,) = self._in(x)
        return self._out(self.xp.maximum(x, np.float32(0)))

    def relu_grad(self, x: np.ndarray, dy: np.ndarray) -> np.ndarray:
        x, dy = self._in(x, dy)
        return self._out(self.xp.where(x > 0, dy, np.float32(0)))

    def gelu(self, x: np.ndarray) -> np.ndarray:
        (x,) = self._in(x)
        inner = np.float32(GELU_C) * (x + np.float32(0.044715) * x * x * x)
        return self._out(np.float32(0.5) * x * (np.float32(1) + self.xp.tanh(inner)))

    def softmax(self, x: np.ndarray) -> np.ndarray:
        (x,) = self._in(x)
        e = self.xp.exp(x - x.max(axis=1, keepdims=True))
        return self._out(e / e.sum(axis=1, keepdims=True))

    def layer_norm(self, x: np.ndarray, gamma: np.ndarray | None, beta: np.ndarray | None,
                   eps: float) -> np.ndarray:
        x, gamma, beta = self._in(x, gamma, beta)
        mean = x.mean(axis=1, keepdims=True)
        var = ((x - mean) ** 2).mean(axis=1, keepdims=True)
        y = (x - mean) / self.xp.sqrt(var + np.float32(eps))
        if gamma is not None:
            y = y * gamma[None, :]
        if beta is not None:
            y = y + beta[None, :]
        return self._out(y)

    def sum_rows(self, x: np.ndarray) -> np.ndarray:
        (x,) = self._in(x)
        return self._out(x.sum(axis=0))


BLAS_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                "openblas_set_num_threads64_", "openblas_set_num_threads")


def limit_blas_threads(threads: int) -> bool:
    """Set the thread count of the OpenBLAS numpy loaded (process-wide); False where none
    is found. Why: numpy's OpenBLAS starts a thread per core, and on a busy host (QEMU's
    vCPUs, the proxies) its threads spin against them: a 64x128x128 GEMM measured 20 ms
    with 2 threads and 0.6 ms with 1 on this 2-core lab host under load."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower() and "/" in line}
    except OSError:
        return False
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in BLAS_SETTERS:
            setter = getattr(lib, name, None)
            if setter is not None:
                setter(ctypes.c_int(threads))
                return True
    return False


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3   # mallopt(3) parameters (glibc's malloc.h)
KEEP_MMAP_THRESHOLD = 32 << 20     # glibc's largest: temporaries below it come from the heap
KEEP_TRIM_THRESHOLD = 256 << 20    # freed memory kept for the next kernel, up to this much


def keep_freed_memory() -> bool:
    """Make numpy's temporaries (a GELU's five 256 KiB arrays, a softmax's) reuse freed heap
    memory instead of fresh mappings, process-wide; False where mallopt is not glibc's. Why:
    glibc serves an allocation above its mmap threshold (128 KiB at start, raised as such
    blocks are freed) with a new mapping whose every page faults on first touch, so two
    processes running the same kernels differed by their heaps' history: a box paid 159
    faults per transformer-s64 pass and 0.5-0.7 ms more kernel time than the local path."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, KEEP_MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_TRIM_THRESHOLD))


def numpy_backend(threads: int = 1) -> KernelBackend:
    """The default: numpy on the box's CPUs, its BLAS limited to ``threads`` threads, freed
    memory kept for the next kernel's temporaries."""
    limit_blas_threads(threads)
    keep_freed_memory()
    return ArrayBackend()


def cupy_backend() -> KernelBackend:
    """CuPy on the box's GPU (extra ``accel-cupy``): the same formulae on cupy arrays."""
    try:
        import cupy  # type: ignore[import-not-found]
    except ImportError as exc:
        raise ValueError("backend 'cupy' needs CuPy on the box: pip install 'dxpu-vfio[accel-cupy]'") from exc
    return ArrayBackend(cupy, "cupy", cupy.asarray, cupy.asnumpy)


def torch_backend() -> KernelBackend:
    """PyTorch on the box's GPU (extra ``accel-torch``)."""
    try:
        import torch  # type: ignore[import-not-found]
    except ImportError as exc:
        raise ValueError("backend 'torch' needs PyTorch on the box: pip install 'dxpu-vfio[accel-torch]'") from exc
    device = "cuda" if torch.cuda.is_available() else "cpu"

    class TorchBackend:
        name = "torch"

        def _t(self, a: np.ndarray):
            # a copy straight onto the device: torch.from_numpy would share the model's
            # operand buffer (reused by the next entry) and warns when it is read-only
            return torch.tensor(a, dtype=torch.float32, device=device)

        def _n(self, t) -> np.ndarray:
            return t.float().cpu().numpy()

        def gemm(self, a, b):
            return self._n(self._t(a) @ self._t(b))

        def bias_add(self, x, bias):
            return self._n(self._t(x) + self._t(bias))

        def add(self, x, y):
            return self._n(self._t(x) + self._t(y))

        def mul(self, x, y):
            return self._n(self._t(x) * self._t(y))

        def axpy(self, x, y, alpha):
            return self._n(self._t(x) + alpha * self._t(y))

        def relu(self, x):
            return self._n(torch.relu(self._t(x)))

        def relu_grad(self, x, dy):
            return self._n(torch.where(self._t(x) > 0, self._t(dy), 0.0))

        def gelu(self, x):
            return self._n(torch.nn.functional.gelu(self._t(x), approximate="tanh"))

        def softmax(self, x):
            return self._n(torch.softmax(self._t(x), dim=1))

        def layer_norm(self, x, gamma, beta, eps):
            t = self._t(x)
            return self._n(torch.nn.functional.layer_norm(
                t, (t.shape[1],), None if gamma is None else self._t(gamma),
                None if beta is None else self._t(beta), eps))

        def sum_rows(self, x):
            return self._n(self._t(x).sum(dim=0))

    return TorchBackend()


BACKENDS: dict[str, Callable[[], KernelBackend]] = {
    "numpy": numpy_backend,
    "cupy": cupy_backend,
    "torch": torch_backend,
}


def get_backend(name: str, threads: int = 1) -> KernelBackend:
    """The backend called ``name``; ValueError (saying what to install) if it cannot run
    here. ``threads``: the numpy backend's BLAS threads."""
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown accel backend {name!r}; known: {', '.join(sorted(BACKENDS))}") from None
    return factory(threads) if name == "numpy" else factory()


# -- bf16: the top half of a float32 ---------------------------------------------------

def from_bf16(raw: np.ndarray) -> np.ndarray:
    """uint16 bf16 bit patterns to float32 (exact)."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 to uint16 bf16 bit patterns, rounded to nearest even; NaN stays NaN."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded = np.where(nan, np.uint16(0x7FC0), rounded)
    return rounded
