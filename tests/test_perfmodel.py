"""The performance model's arithmetic (docs/perfmodel.md)."""

import math

import pytest

from dxpu_vfio.perfmodel import Model, Point, fit, prediction_error


def synthetic(t_local: float, n: int, k: float, rtts: list[float]) -> list[Point]:
    return [Point(rtt, t_local + k * n * rtt, n) for rtt in rtts]


def test_fit_recovers_the_overlap_factor_exactly_on_clean_data():
    model = fit("w", 0.5, synthetic(0.5, 1000, 0.6, [100e-6, 400e-6, 1e-3]))
    assert model.k == pytest.approx(0.6) and model.round_trips == 1000
    assert model.base_s == pytest.approx(0.5)
    assert model.predict(2e-3) == pytest.approx(0.5 + 0.6 * 1000 * 2e-3)


def test_fixed_remote_costs_go_into_the_intercept():
    points = [Point(rtt, 0.7 + 0.9 * 300 * rtt, 300) for rtt in (200e-6, 800e-6, 2e-3)]
    model = fit("w", 0.5, points)  # 0.2 s of remote cost that does not grow with distance
    assert model.t0_s == pytest.approx(0.7) and model.k == pytest.approx(0.9)
    assert model.overhead(0.0) == pytest.approx(0.4)
    assert model.rtt_for_overhead(0.10) == 0.0  # fixed costs alone exceed 10%


def test_one_calibration_point_fits_through_the_local_time():
    model = fit("w", 1.0, [Point(1e-3, 1.5, 500)])
    assert model.t0_s is None and model.k == pytest.approx(1.0)


def test_held_out_points_are_predicted_and_errors_are_relative():
    calib = synthetic(1.0, 500, 1.0, [200e-6, 1e-3])
    model = fit("w", 1.0, calib)
    held = Point(500e-6, 1.0 + 500 * 500e-6 * 1.1, 500)  # 10% more delay cost than the model
    err = prediction_error(model, held)
    assert err == pytest.approx((1.25 - 1.275) / 1.275)


def test_overhead_and_the_10_percent_crossing():
    model = Model("w", t_local_s=2.0, round_trips=400, k=0.5)
    rtt10 = model.rtt_for_overhead(0.10)
    assert rtt10 == pytest.approx(0.1 * 2.0 / (0.5 * 400))  # 1 ms
    assert model.overhead(rtt10) == pytest.approx(0.10)
    assert Model("w", 2.0, 400, 0.5, t0_s=2.1).rtt_for_overhead(0.10) == pytest.approx(0.1 / 200)
    assert Model("none", 1.0, 0, 1.0).rtt_for_overhead() == math.inf


def test_bandwidth_term():
    model = Model("w", 1.0, 0, 1.0, bandwidth_Bps=100e6, bytes_moved=50_000_000)
    assert model.predict(0.0) == pytest.approx(1.5)


def test_fit_refuses_what_it_cannot_fit():
    with pytest.raises(ValueError, match="at least one"):
        fit("w", 1.0, [])
    with pytest.raises(ValueError, match="no round trips"):
        fit("w", 1.0, [Point(1e-4, 1.2, 0)])
    with pytest.raises(ValueError, match="positive"):
        fit("w", 0.0, [Point(1e-4, 1.2, 10)])


# -- accelerator workloads: compute, round trips per launch and per copy, transfer ---------

def accel_points(t0: float, k: float, n: int, nbytes: int, bandwidth: float, rtts: list[float]) -> list[Point]:
    """Remote runs of an accelerator workload: T = T0 + k * N * rtt + bytes / bandwidth."""
    return [Point(rtt, t0 + k * n * rtt + nbytes / bandwidth, n, bytes_moved=nbytes, compute_s=0.03)
            for rtt in rtts]


def test_a_known_bandwidth_comes_off_before_the_fit_and_predicts_other_links():
    # 3 launches x 2 round trips + 2 copies x 1: N = 8; 4 MB over a 400 MB/s link = 10 ms
    points = accel_points(0.052, 1.0, 8, 4_000_000, 400e6, [150e-6, 600e-6, 1.2e-3])
    model = fit("mlp", 0.050, points, bandwidth_Bps=400e6)
    assert model.t0_s == pytest.approx(0.052) and model.k == pytest.approx(1.0)
    assert model.bytes_moved == 4_000_000 and model.compute_s == pytest.approx(0.03)
    assert model.compute_share == pytest.approx(0.6)
    assert model.predict(2e-3) == pytest.approx(0.052 + 8 * 2e-3 + 0.010)          # a held-out delay
    assert model.predict(0.0, bandwidth_Bps=4e9) == pytest.approx(0.052 + 0.001)   # a faster link
    without = fit("mlp", 0.050, points)             # the transfer term left in the intercept
    assert without.t0_s == pytest.approx(0.062) and without.predict(0.0, 4e9) == pytest.approx(0.062)


def test_the_10_percent_crossings_in_round_trip_and_bandwidth():
    model = Model("t", t_local_s=0.100, round_trips=10, k=1.0, t0_s=0.102, bandwidth_Bps=500e6, bytes_moved=1_000_000)
    rtt10 = model.rtt_for_overhead(0.10)
    assert rtt10 == pytest.approx((0.110 - 0.102 - 0.002) / 10)                    # 600 µs
    assert model.overhead(rtt10) == pytest.approx(0.10)
    bw10 = model.bandwidth_for_overhead(0.10, rtt_s=200e-6)
    assert bw10 == pytest.approx(1_000_000 / (0.110 - 0.102 - 0.002))              # 166.7 MB/s
    assert model.overhead(200e-6, bandwidth_Bps=bw10) == pytest.approx(0.10)
    assert model.bandwidth_for_overhead(0.10, rtt_s=1e-3) == math.inf              # the round trips alone exceed it
    assert Model("none", 0.1, 10, 1.0).bandwidth_for_overhead(0.10) == 0.0          # moves nothing: any link


def test_one_calibration_point_with_a_known_k_fits_the_intercept():
    [point] = accel_points(0.060, 1.0, 5, 1_000_000, 250e6, [300e-6])
    model = fit("w", 0.050, [point], bandwidth_Bps=250e6, k_prior=1.0)
    assert model.k == 1.0 and model.t0_s == pytest.approx(0.060)
    assert model.predict(1e-3) == pytest.approx(0.060 + 5e-3 + 0.004)


def test_fit_refuses_a_bandwidth_that_is_not_one():
    with pytest.raises(ValueError, match="bandwidth"):
        fit("w", 1.0, [Point(1e-4, 1.2, 10)], bandwidth_Bps=0.0)


def test_one_point_faster_than_local_fits_no_negative_slope():
    """Noise: the remote run at the floor beat the local one. The line through the local
    time would slope down (latency making it faster) and predict negative times."""
    model = fit("w", 1.0, [Point(100e-6, 0.9, 1000)])
    assert model.k == 0.0 and model.predict(1e-3) == pytest.approx(1.0)
