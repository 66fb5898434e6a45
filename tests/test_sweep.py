"""The latency sweep's plumbing on a short run: real lab, real guest, two delays."""

import json

import pytest

from dxpu_vfio.lab.sweep import run_sweep

pytestmark = pytest.mark.vm


def test_short_sweep_records_fits_predicts_and_plots(tmp_path, tiny_image):
    results = run_sweep([0, 300], [0], tmp_path, sizes={"mmio-loop": 200, "nvme-read": 8},
                        workloads=["mmio-loop", "nvme-read"], log=lambda _m: None)
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert saved["delays_us"] == [0, 300] and set(saved["workloads"]) == {"mmio-loop", "nvme-read"}
    mmio = results["workloads"]["mmio-loop"]
    assert [r["delay_us"] for r in mmio["runs"]] == [0, 300]
    assert mmio["runs"][0]["round_trips"] >= 200  # every guest read was one link round trip
    assert mmio["runs"][1]["rtt_s"] > mmio["runs"][0]["rtt_s"] + 500e-6  # 2 x 300 µs were added
    assert mmio["runs"][1]["runtime_s"] > mmio["runs"][0]["runtime_s"]
    assert len(mmio["held_out"]) == 1 and abs(mmio["held_out"][0]["error"]) < 1  # predicted, sanely
    # each 128 KiB read at depth 1 waited for its doorbell to go out and its completion to
    # come back, though its entry and PRP list went with the doorbell (no DMA read at all)
    assert all(r["round_trips"] >= 8 for r in results["workloads"]["nvme-read"]["runs"])
    for name in ("mmio-loop.png", "nvme-read.png", "overhead.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
