"""The DxPU performance model: what the network costs a workload (docs/perfmodel.md).

A workload makes ``N`` serialized round trips over the link when its device is remote
(host-side waits: region reads and non-posted writes; box-side waits: the device's DMA
reads). Posted traffic (MMIO writes, DMA writes, interrupts) overlaps with work and is not
on the critical path. So::

    T(rtt) = T0 + k * N * rtt + bytes / bandwidth

``rtt`` is the link round trip *as measured* (the host proxy's mean wait per request),
``k`` says how much of the round trips overlap (pipelined DMA reads overlap; a guest
busy-polling a register does not), ``T0`` is the run time the remote path would have at
zero round-trip time: the local run time plus the remote path's costs that do not grow
with distance. The bandwidth term is dropped when the link is not the bottleneck.
``T0`` and ``k`` are fitted by least squares on calibration points; held-out points test
the model. The overhead relative to the local device is ``T(rtt) / T_local - 1``; it
crosses a threshold ``x`` at ``rtt_x = ((1 + x) * T_local - T0 - bytes / bandwidth) / (k * N)``.

An accelerator workload (docs/perfmodel.md#ai-workloads) brings the terms a GPU's has:
the device's own compute time (in ``T0``: the same locally and remote), round trips per
launch and per copy (``N = launches * r_launch + copies * r_copy``, counted), and the
bytes its copies move over the link. With the link's bandwidth known (measured, not
fitted: the sweep's delays do not change it) the transfer term is taken off each point
before the fit, so ``T0`` and ``k`` describe the rest and the model predicts other
bandwidths too; it crosses ``x`` at ``bandwidth_x = bytes / ((1 + x) * T_local - T0 - k * N * rtt)``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Point:
    """One measured run of a workload on the remote device."""

    rtt_s: float  # measured link round trip (host proxy mean wait per request)
    runtime_s: float
    round_trips: int  # serialized round trips counted by both proxies during the run
    delay_us: float = 0.0  # added one-way delay that was asked for (for reports)
    bytes_moved: int = 0  # bytes the run's copies moved over the link (accelerator workloads)
    compute_s: float = 0.0  # the device's own compute time during the run (its kernel counter)


@dataclass(frozen=True)
class Model:
    workload: str
    t_local_s: float
    round_trips: float  # N: mean over the calibration points (counts barely vary)
    k: float  # overlap factor of round trips
    t0_s: float | None = None  # fitted run time at zero RTT (None: the local run time)
    bandwidth_Bps: float | None = None  # the link's, for the transfer term (None: no term)
    bytes_moved: int = 0
    compute_s: float = 0.0  # the device's compute time per run (part of T0; for the report)

    @property
    def base_s(self) -> float:
        return self.t_local_s if self.t0_s is None else self.t0_s

    def transfer_s(self, bandwidth_Bps: float | None = None) -> float:
        """The transfer term at ``bandwidth_Bps`` (default: the model's); 0 in a model
        fitted without a bandwidth, whose intercept holds the transfer at the lab's."""
        if not self.bandwidth_Bps or not self.bytes_moved:
            return 0.0
        return self.bytes_moved / (bandwidth_Bps or self.bandwidth_Bps)

    def predict(self, rtt_s: float, bandwidth_Bps: float | None = None) -> float:
        """Run time at round trip ``rtt_s`` and (default: the model's) link bandwidth."""
        return self.base_s + self.k * self.round_trips * rtt_s + self.transfer_s(bandwidth_Bps)

    def overhead(self, rtt_s: float, bandwidth_Bps: float | None = None) -> float:
        return self.predict(rtt_s, bandwidth_Bps) / self.t_local_s - 1

    @property
    def compute_share(self) -> float:
        """The device's compute time as a share of the local run time."""
        return self.compute_s / self.t_local_s

    def rtt_for_overhead(self, overhead: float = 0.10) -> float:
        """The round trip at which the overhead reaches ``overhead`` (0.10: 10%), at the
        model's bandwidth.

        0 when the remote path's fixed costs alone already exceed it; inf when round
        trips cost nothing."""
        if self.k * self.round_trips <= 0:
            return float("inf")
        room = (1 + overhead) * self.t_local_s - self.base_s - self.transfer_s()
        return max(0.0, room / (self.k * self.round_trips))

    def bandwidth_for_overhead(self, overhead: float = 0.10, rtt_s: float = 0.0) -> float:
        """The link bandwidth (bytes/s) below which the overhead at ``rtt_s`` exceeds
        ``overhead``: 0 when the workload moves nothing, inf when no bandwidth is enough
        (the fixed costs and round trips alone exceed it)."""
        if not self.bytes_moved:
            return 0.0
        room = (1 + overhead) * self.t_local_s - self.base_s - self.k * self.round_trips * rtt_s
        return self.bytes_moved / room if room > 0 else float("inf")


def fit(workload: str, t_local_s: float, points: list[Point], bandwidth_Bps: float | None = None,
        k_prior: float | None = None) -> Model:
    """Least squares of T_i - bytes_i / bandwidth = T0 + k * N_i * rtt_i over the
    calibration points (no transfer term without ``bandwidth_Bps``).

    With a single point (or points that share one x) only one parameter can be fitted:
    ``T0`` with ``k = k_prior`` where the caller knows k (the accelerator's counts include
    every serialized wait: k = 1), else ``k`` with the line through the local run time
    (T0 = T_local), and never below 0: a remote run that came out faster than the local
    one says the round trips were lost in the noise, not that latency speeds it up (a
    negative k predicted negative run times for the held-out delays)."""
    if not points:
        raise ValueError("fitting needs at least one remote point")
    if t_local_s <= 0:
        raise ValueError("the local runtime must be positive")
    if bandwidth_Bps is not None and bandwidth_Bps <= 0:
        raise ValueError("the link bandwidth must be positive")
    xs = [p.round_trips * p.rtt_s for p in points]
    ys = [p.runtime_s - (p.bytes_moved / bandwidth_Bps if bandwidth_Bps else 0.0) for p in points]
    if not any(xs):
        raise ValueError(f"{workload}: no round trips were counted; the model has nothing to fit")
    n = sum(p.round_trips for p in points) / len(points)
    extra = {"bandwidth_Bps": bandwidth_Bps, "bytes_moved": round(sum(p.bytes_moved for p in points) / len(points)),
             "compute_s": sum(p.compute_s for p in points) / len(points)}
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if (len(points) < 2 or sxx == 0) and k_prior is not None:
        return Model(workload, t_local_s, n, k_prior, t0_s=mean_y - k_prior * mean_x, **extra)
    if len(points) < 2 or sxx == 0:
        k = max(0.0, sum(x * (y - t_local_s) for x, y in zip(xs, ys)) / sum(x * x for x in xs))
        return Model(workload, t_local_s, n, k, **extra)
    k = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx
    return Model(workload, t_local_s, n, k, t0_s=mean_y - k * mean_x, **extra)


def prediction_error(model: Model, point: Point) -> float:
    """Relative error of the model's prediction at a measured point's round-trip time
    (the model's N and k come from the calibration points, not from this one)."""
    return (model.predict(point.rtt_s) - point.runtime_s) / point.runtime_s
