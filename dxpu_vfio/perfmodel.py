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
crosses a threshold ``x`` at ``rtt_x = ((1 + x) * T_local - T0) / (k * N)``.
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


@dataclass(frozen=True)
class Model:
    workload: str
    t_local_s: float
    round_trips: float  # N: mean over the calibration points (counts barely vary)
    k: float  # overlap factor of round trips
    t0_s: float | None = None  # fitted run time at zero RTT (None: the local run time)
    bandwidth_Bps: float | None = None
    bytes_moved: int = 0

    @property
    def base_s(self) -> float:
        return self.t_local_s if self.t0_s is None else self.t0_s

    def predict(self, rtt_s: float) -> float:
        t = self.base_s + self.k * self.round_trips * rtt_s
        if self.bandwidth_Bps:
            t += self.bytes_moved / self.bandwidth_Bps
        return t

    def overhead(self, rtt_s: float) -> float:
        return self.predict(rtt_s) / self.t_local_s - 1

    def rtt_for_overhead(self, overhead: float = 0.10) -> float:
        """The round trip at which the overhead reaches ``overhead`` (0.10: 10%).

        0 when the remote path's fixed costs alone already exceed it; inf when round
        trips cost nothing."""
        if self.k * self.round_trips <= 0:
            return float("inf")
        return max(0.0, ((1 + overhead) * self.t_local_s - self.base_s) / (self.k * self.round_trips))


def fit(workload: str, t_local_s: float, points: list[Point]) -> Model:
    """Least squares of T_i = T0 + k * N_i * rtt_i over the calibration points.

    With a single point (or points that share one x) only ``k`` can be fitted: the line
    then goes through the local run time (T0 = T_local)."""
    if not points:
        raise ValueError("fitting needs at least one remote point")
    if t_local_s <= 0:
        raise ValueError("the local runtime must be positive")
    xs = [p.round_trips * p.rtt_s for p in points]
    ys = [p.runtime_s for p in points]
    if not any(xs):
        raise ValueError(f"{workload}: no round trips were counted; the model has nothing to fit")
    n = sum(p.round_trips for p in points) / len(points)
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if len(points) < 2 or sxx == 0:
        k = sum(x * (y - t_local_s) for x, y in zip(xs, ys)) / sum(x * x for x in xs)
        return Model(workload, t_local_s, n, k)
    k = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx
    return Model(workload, t_local_s, n, k, t0_s=mean_y - k * mean_x)


def prediction_error(model: Model, point: Point) -> float:
    """Relative error of the model's prediction at a measured point's round-trip time
    (the model's N and k come from the calibration points, not from this one)."""
    return (model.predict(point.rtt_s) - point.runtime_s) / point.runtime_s
