"""AI workloads on the accelerator, for the guest runtime's ``Accel``
(``vm_images/tools/dxpu_accel.py``) wherever it was opened: in a benchmark or a sweep it
drives the device from the host side (:class:`dxpu_vfio.lab.accel_paths.HostSideAccel`:
our vfio-user client in QEMU's place, a memfd as guest RAM, as
``tests/test_accel_runtime.py`` does), so no TCG guest is needed: the device, the host
proxy, the link and the box are the real ones, only the guest's CPU is not in the loop.

Each workload keeps its weights in VRAM (uploaded once, as a served model does) and one
*pass* is what a framework's step is: inputs copied in, the kernels, outputs copied
out, one doorbell and one synchronize. :func:`run_passes` brackets each pass with two
device timestamps, so its wall time splits into the device's span (compute, copies and
the device's own dispatch) and the launch (doorbell to first entry, last entry to the
fence seen by the host). ``check()`` compares the device's results with numpy.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import numpy as np


def _f32(array) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=np.float32)


class Workload:
    """Weights in VRAM; ``push(stream)`` queues one pass; ``check()`` -> max abs error
    against numpy (raises AssertionError beyond the tolerance)."""

    name = "?"
    what = "?"

    def __init__(self, dev) -> None:
        self.dev = dev
        self.s = dev.stream()

    def put(self, array: np.ndarray) -> int:
        ptr = self.dev.malloc(array.nbytes)
        self.s.memcpy_htod(ptr, _f32(array))
        return ptr

    def pinned(self, array: np.ndarray):
        buf = self.dev.host_alloc(array.nbytes)
        buf.view[:] = _f32(array).tobytes()
        return buf

    def host_array(self, buf, shape: tuple[int, ...]) -> np.ndarray:
        return np.frombuffer(buf.view, dtype=np.float32, count=int(np.prod(shape))).reshape(shape)

    def push(self, s) -> None:
        raise NotImplementedError

    def check(self) -> float:
        raise NotImplementedError


def _close(got: np.ndarray, want: np.ndarray, rtol: float = 1e-3, atol: float = 1e-3) -> float:
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    return float(np.max(np.abs(got - want)))


class MlpInference(Workload):
    """``layers`` x (GEMM width x width, bias, ReLU; no ReLU last) on ``batch`` rows."""

    def __init__(self, dev, batch: int, width: int = 1024, layers: int = 4, seed: int = 1) -> None:
        super().__init__(dev)
        self.name, self.batch, self.width = f"mlp-b{batch}", batch, width
        self.what = f"MLP inference, batch {batch}, {layers} layers of {width}x{width}"
        rng = np.random.default_rng(seed)
        self.w = [_f32(rng.standard_normal((width, width)) / np.sqrt(width)) for _ in range(layers)]
        self.b = [_f32(rng.standard_normal(width) * 0.1) for _ in range(layers)]
        self.pw = [self.put(w) for w in self.w]
        self.pb = [self.put(b) for b in self.b]
        self.s.synchronize()
        self.x = _f32(rng.standard_normal((batch, width)))
        self.hin, self.hout = self.pinned(self.x), dev.host_alloc(self.x.nbytes)
        self.act = [dev.malloc(self.x.nbytes) for _ in range(2)]

    def push(self, s) -> None:
        batch, width, layers = self.batch, self.width, len(self.w)
        s.memcpy_htod(self.act[0], self.hin)
        for i in range(layers):
            src, dst = self.act[i % 2], self.act[(i + 1) % 2]
            s.gemm(dst, src, self.pw[i], batch, width, width)
            s.bias_add(dst, dst, self.pb[i], batch, width)
            if i < layers - 1:
                s.relu(dst, dst, batch * width)
        s.memcpy_dtoh(self.hout, self.act[layers % 2])

    def check(self) -> float:
        want = self.x
        for i, (w, b) in enumerate(zip(self.w, self.b)):
            want = want @ w + b
            if i < len(self.w) - 1:
                want = np.maximum(want, 0)
        return _close(self.host_array(self.hout, want.shape), want)


def _ln(x, g, b, eps=1e-5):
    return (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + eps) * g + b


def _gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


class TransformerBlock(Workload):
    """One pre-LN block, one head: LN, Q/K/V, softmax(Q K^T / sqrt(d)) V, output
    projection, residual; LN, GELU MLP (d -> f -> d), residual. ``seq`` rows in and out."""

    def __init__(self, dev, seq: int, d: int = 256, f: int = 1024, seed: int = 2) -> None:
        super().__init__(dev)
        self.name, self.seq, self.d, self.f = f"transformer-s{seq}", seq, d, f
        self.what = f"transformer block forward, sequence {seq}, d {d}, MLP {f}"
        rng = np.random.default_rng(seed)
        w = {n: _f32(rng.standard_normal(shape) / np.sqrt(shape[0]))
             for n, shape in (("wq", (d, d)), ("wk", (d, d)), ("wv", (d, d)), ("wo", (d, d)),
                              ("w1", (d, f)), ("w2", (f, d)))}
        w["wq"] = _f32(w["wq"] / np.sqrt(d))       # the attention scale, folded into W_q
        vec = {n: _f32(rng.standard_normal(k) * 0.1) for n, k in (("g1", d), ("b1n", d), ("g2", d), ("b2n", d),
                                                                   ("b1", f), ("b2", d))}
        vec["g1"] += 1
        vec["g2"] += 1
        self.w, self.vec = w, vec
        self.p = {n: self.put(a) for n, a in {**w, **vec}.items()}
        self.s.synchronize()
        for name, shape in (("x", (seq, d)), ("h", (seq, d)), ("q", (seq, d)), ("k", (seq, d)), ("v", (seq, d)),
                            ("sc", (seq, seq)), ("pr", (seq, seq)), ("att", (seq, d)), ("o", (seq, d)),
                            ("x1", (seq, d)), ("h2", (seq, d)), ("u", (seq, f)), ("y2", (seq, d)), ("y", (seq, d))):
            self.p[name] = dev.malloc(4 * int(np.prod(shape)))
        self.x = _f32(rng.standard_normal((seq, d)))
        self.hin, self.hout = self.pinned(self.x), dev.host_alloc(self.x.nbytes)

    def push(self, s) -> None:
        p, seq, d, f = self.p, self.seq, self.d, self.f
        s.memcpy_htod(p["x"], self.hin)
        s.layer_norm(p["h"], p["x"], seq, d, p["g1"], p["b1n"])
        for out, weight in (("q", "wq"), ("k", "wk"), ("v", "wv")):
            s.gemm(p[out], p["h"], p[weight], seq, d, d)
        s.gemm(p["sc"], p["q"], p["k"], seq, seq, d, trans_b=True)     # Q K^T
        s.softmax(p["pr"], p["sc"], seq, seq)
        s.gemm(p["att"], p["pr"], p["v"], seq, d, seq)
        s.gemm(p["o"], p["att"], p["wo"], seq, d, d)
        s.add(p["x1"], p["x"], p["o"], seq * d)
        s.layer_norm(p["h2"], p["x1"], seq, d, p["g2"], p["b2n"])
        s.gemm(p["u"], p["h2"], p["w1"], seq, f, d)
        s.bias_add(p["u"], p["u"], p["b1"], seq, f)
        s.gelu(p["u"], p["u"], seq * f)
        s.gemm(p["y2"], p["u"], p["w2"], seq, d, f)
        s.bias_add(p["y2"], p["y2"], p["b2"], seq, d)
        s.add(p["y"], p["x1"], p["y2"], seq * d)
        s.memcpy_dtoh(self.hout, p["y"])

    def check(self) -> float:
        w, vec, x = self.w, self.vec, self.x
        h = _ln(x, vec["g1"], vec["b1n"])
        q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
        sc = q @ k.T
        pr = np.exp(sc - sc.max(1, keepdims=True))
        pr /= pr.sum(1, keepdims=True)
        x1 = x + (pr @ v) @ w["wo"]
        want = x1 + _gelu(_ln(x1, vec["g2"], vec["b2n"]) @ w["w1"] + vec["b1"]) @ w["w2"] + vec["b2"]
        return _close(self.host_array(self.hout, want.shape), want)


class MlpTrainStep(Workload):
    """Forward, MSE gradient, backward through ReLU, SGD on all four parameters; a batch
    and its targets copied in, the predictions copied out. The check replays every pass
    in numpy and compares the parameters."""

    def __init__(self, dev, batch: int = 64, inputs: int = 1024, hidden: int = 1024, outputs: int = 16,
                 lr: float = 0.05, seed: int = 3) -> None:
        super().__init__(dev)
        self.name = "train-step"
        self.what = f"MLP training step, batch {batch}, {inputs}-{hidden}-{outputs}"
        self.dims = (batch, inputs, hidden, outputs)
        self.step = -lr * 2 / (batch * outputs)
        rng = np.random.default_rng(seed)
        self.params = {"w1": _f32(rng.standard_normal((inputs, hidden)) / np.sqrt(inputs)),
                       "b1": _f32(rng.standard_normal(hidden) * 0.1),
                       "w2": _f32(rng.standard_normal((hidden, outputs)) / np.sqrt(hidden)),
                       "b2": _f32(rng.standard_normal(outputs) * 0.1)}
        self.start = {k: v.copy() for k, v in self.params.items()}
        self.p = {n: self.put(a) for n, a in self.params.items()}
        self.s.synchronize()
        b, i, h, o = self.dims
        for name, shape in (("x", (b, i)), ("t", (b, o)), ("z1", (b, h)), ("a1", (b, h)), ("y", (b, o)),
                            ("dy", (b, o)), ("dw2", (h, o)), ("db2", (o,)), ("da1", (b, h)), ("dz1", (b, h)),
                            ("dw1", (i, h)), ("db1", (h,))):
            self.p[name] = dev.malloc(4 * int(np.prod(shape)))
        self.x, self.t = _f32(rng.standard_normal((b, i))), _f32(rng.standard_normal((b, o)))
        self.hx, self.ht, self.hy = self.pinned(self.x), self.pinned(self.t), dev.host_alloc(4 * b * o)
        self.passes = 0

    def push(self, s) -> None:
        p, (b, i, h, o) = self.p, self.dims
        s.memcpy_htod(p["x"], self.hx)
        s.memcpy_htod(p["t"], self.ht)
        s.gemm(p["z1"], p["x"], p["w1"], b, h, i)
        s.bias_add(p["z1"], p["z1"], p["b1"], b, h)
        s.relu(p["a1"], p["z1"], b * h)
        s.gemm(p["y"], p["a1"], p["w2"], b, o, h)
        s.bias_add(p["y"], p["y"], p["b2"], b, o)
        s.axpy(p["dy"], p["y"], p["t"], b * o, -1.0)                 # dL/dy without its constant: y - t
        s.gemm(p["dw2"], p["a1"], p["dy"], h, o, b, trans_a=True)    # a1^T dy
        s.sum_rows(p["db2"], p["dy"], b, o)
        s.gemm(p["da1"], p["dy"], p["w2"], b, h, o, trans_b=True)    # dy W2^T
        s.relu_grad(p["dz1"], p["z1"], p["da1"], b * h)
        s.gemm(p["dw1"], p["x"], p["dz1"], i, h, b, trans_a=True)    # x^T dz1
        s.sum_rows(p["db1"], p["dz1"], b, h)
        for name, size in (("w1", i * h), ("b1", h), ("w2", h * o), ("b2", o)):
            s.axpy(p[name], p[name], p["d" + name], size, self.step)
        s.memcpy_dtoh(self.hy, p["y"])
        self.passes += 1

    def check(self) -> float:
        params = {k: v.astype(np.float64) for k, v in self.start.items()}
        x, t = self.x.astype(np.float64), self.t.astype(np.float64)
        for _ in range(self.passes):
            z1 = x @ params["w1"] + params["b1"]
            a1 = np.maximum(z1, 0)
            dy = a1 @ params["w2"] + params["b2"] - t
            dz1 = np.where(z1 > 0, dy @ params["w2"].T, 0)
            grads = {"w1": x.T @ dz1, "b1": dz1.sum(0), "w2": a1.T @ dy, "b2": dy.sum(0)}
            params = {k: params[k] + self.step * grads[k] for k in params}
        worst = 0.0
        for name, want in params.items():
            got = np.frombuffer(self.dev.memcpy_dtoh(self.p[name], want.size * 4), dtype=np.float32).reshape(want.shape)
            worst = max(worst, _close(got, want, rtol=1e-3, atol=1e-4))
        return worst


# name -> factory(dev): the workloads of issue 16 item 3
WORKLOADS: dict[str, Callable[..., Workload]] = {
    "mlp-b1": lambda dev: MlpInference(dev, 1),
    "mlp-b8": lambda dev: MlpInference(dev, 8),
    "mlp-b64": lambda dev: MlpInference(dev, 64),
    "transformer-s64": lambda dev: TransformerBlock(dev, 64),
    "transformer-s256": lambda dev: TransformerBlock(dev, 256),
    "train-step": lambda dev: MlpTrainStep(dev),
}


class Passes:
    """Timed passes of one workload: ``one()`` runs a pass bracketed by two device
    timestamps (so its wall time splits into the device's span and the launch), and
    ``result()`` sums them up with the counters' deltas per pass. Separate from the loop
    so a benchmark can interleave two paths pass by pass (both see the same load)."""

    def __init__(self, workload: Workload, counters: Callable[[], dict] | None = None, warmup: int = 1) -> None:
        self.workload, self.counters = workload, counters
        self.s = workload.dev.stream()
        for _ in range(warmup):
            workload.push(self.s)
            self.s.synchronize()
        self.walls: list[float] = []
        self.spans: list[float] = []
        self.before = counters() if counters else None

    def one(self) -> float:
        s = self.s
        started = time.perf_counter()
        first = s.timestamp()
        self.workload.push(s)
        last = s.timestamp()
        s.synchronize()
        self.walls.append(time.perf_counter() - started)
        self.spans.append((last.ns - first.ns) / 1e9)
        return self.walls[-1]

    def result(self) -> dict:
        """The summary; checks the numerics (AssertionError if they are off)."""
        after = self.counters() if self.counters else None
        walls, spans, passes = self.walls, self.spans, len(self.walls)
        error = self.workload.check()
        out = {"workload": self.workload.name, "what": self.workload.what, "passes": passes,
               "median_s": statistics.median(walls), "min_s": min(walls), "max_s": max(walls),
               "mean_s": statistics.fmean(walls), "span_mean_s": statistics.fmean(spans), "max_abs_error": error}
        if self.before is not None and after is not None:
            out["per_pass"] = {k: (after[k] - self.before[k]) / passes for k in after
                               if isinstance(after[k], (int, float)) and k in self.before}
        return out


def run_passes(workload: Workload, passes: int, counters: Callable[[], dict] | None = None,
               warmup: int = 1) -> dict:
    """Time ``passes`` passes (after ``warmup`` untimed ones); per pass the wall time and
    the device's span between two timestamps; with ``counters`` (a snapshot of both
    proxies' and the device's counters, :mod:`dxpu_vfio.lab.accel_paths`) their deltas
    per pass. Checks the numerics at the end (AssertionError if they are off)."""
    runner = Passes(workload, counters, warmup)
    for _ in range(passes):
        runner.one()
    return runner.result()


def copy_bandwidth(dev, size: int = 64 << 20, repeats: int = 3) -> dict:
    """Host <-> VRAM copy bandwidth, MB/s, best of ``repeats`` (one copy command, one
    doorbell and one synchronize each; the pinned buffer needs no staging)."""
    host = dev.host_alloc(size)
    host.view[:] = os.urandom(size)
    ptr = dev.malloc(size)
    s = dev.stream()
    out = {}
    for direction in ("h2d", "d2h"):
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            if direction == "h2d":
                s.memcpy_htod(ptr, host)
            else:
                s.memcpy_dtoh(host, ptr)
            s.synchronize()
            best = min(best, time.perf_counter() - started)
        out[f"{direction}_MBps"] = size / best / 1e6
    dev.free(ptr)
    return out
