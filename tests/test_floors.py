"""The floors' arithmetic and command line (no network: the measurements themselves run
against a lab in tests/test_netemu.py)."""

import pytest

from dxpu_vfio.lab import floors

BURSTS = {"32": {"median_us": 100.0}, "65536": {"median_us": 300.0}, "262144": {"median_us": 1000.0}}


def test_a_burst_one_way_is_half_its_echo_interpolated_between_sizes():
    assert floors.burst_one_way_s(BURSTS, 32) == pytest.approx(50e-6)
    assert floors.burst_one_way_s(BURSTS, 0) == pytest.approx(50e-6)  # never below the smallest message
    assert floors.burst_one_way_s(BURSTS, 65536) == pytest.approx(150e-6)
    assert floors.burst_one_way_s(BURSTS, 163840) == pytest.approx(325e-6)  # halfway between 64 and 256 KiB
    # beyond the largest size, the slope of the two largest goes on
    assert floors.burst_one_way_s(BURSTS, 458752) == pytest.approx(500e-6 + 350e-6)


def test_a_burst_floor_needs_two_sizes():
    with pytest.raises(ValueError, match="two sizes"):
        floors.burst_one_way_s({"32": {"median_us": 100.0}}, 64)


@pytest.mark.parametrize("argv, says", [
    (["client", "--address", "198.18.1.2:7202", "--burst-sizes", "32,65536"], "--native"),
    (["client", "--address", "198.18.1.2:7202", "--native", "--tls-dir", "/nonexistent", "--burst-sizes", "32,64k"],
     "byte counts"),
    (["client", "--address", "198.18.1.2:7202", "--cpu-message-size", "131072"], "--native"),
    (["client", "--address", "198.18.1.2:7202", "--native", "--tls-dir", "/nonexistent", "--cpu-message-size",
      str(2 << 20)], "1 to"),
])
def test_burst_sizes_are_refused_with_the_reason(argv, says, capsys):
    with pytest.raises(SystemExit):
        floors.main(argv)
    assert says in capsys.readouterr().err
