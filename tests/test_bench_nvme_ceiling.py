"""bench_nvme.py's CPU ceiling: the arithmetic the remote sequential goal is judged
against (the measurements themselves need a guest and a lab: the benchmark takes them)."""

from __future__ import annotations

import importlib.util
import os

import pytest

from dxpu_vfio.paths import PROJECT_ROOT


@pytest.fixture(scope="module")
def bench_nvme():
    spec = importlib.util.spec_from_file_location("bench_nvme", PROJECT_ROOT / "scripts" / "bench_nvme.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_ceiling_spreads_the_least_cpu_a_remote_read_costs_over_the_cores(bench_nvme):
    w = "seq-read-128k-qd16"
    results = {"qemu-nvme": {w: {"MBps": 1310.72, "iops": 10000, "cpu_us_per_io": {"qemu": 150.0}}},
               "local": {w: {"MBps": 1048.576, "iops": 8000, "cpu_us_per_io": {"qemu": 100.0, "host proxy": 50.0}}},
               "remote": {w: {"MBps": 524.288, "iops": 4000,
                              "cpu_us_per_io": {"qemu": 160.0, "host proxy": 90.0, "box": 150.0}}}}
    got = bench_nvme.read_cpu_ceiling(results, w, {"both_us": 150.0})
    cores = os.cpu_count()
    # 100 µs of QEMU + 150 of the link = 250 µs a read: 4000 reads a second per busy core, of
    # 128 KiB each (524.288 MB/s), against QEMU's device at 1310.72 MB/s
    assert got["floor_us"] == pytest.approx(250.0)
    assert got["all_cores_vs_qemu"] == pytest.approx(cores * 0.4)
    assert got["remote_cores"] == pytest.approx(1.6)  # 400 µs a read at 4000 reads a second
    assert got["busy_cores_vs_qemu"] == pytest.approx(1.6 * 0.4)
    assert got["qemu_extra_us"] == pytest.approx(60.0)
    assert got["proxies_over_link_us"] == pytest.approx(90.0)
