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
