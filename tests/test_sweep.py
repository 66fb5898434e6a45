"""The latency sweep's plumbing on a short run: real lab, real guest, three delays."""

import json

import pytest

from dxpu_vfio.lab.sweep import run_sweep

pytestmark = pytest.mark.vm


def test_short_sweep_records_fits_predicts_and_plots(tmp_path, tiny_image):
    # fitted on the two ends, the middle held out: at 0 added delay a remote read costs
    # about what a local one does (the link round trip is ~20 µs), so a fit on that point
    # alone measures the guest's timing noise, not the round trips (its held-out error
    # ranged from -0.85 to +1.77 over four runs)
    results = run_sweep([0, 150, 300], [0, 300], tmp_path, sizes={"mmio-loop": 200, "nvme-read": 8},
                        workloads=["mmio-loop", "nvme-read"], log=lambda _m: None)
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert saved["delays_us"] == [0, 150, 300] and set(saved["workloads"]) == {"mmio-loop", "nvme-read"}
    mmio = results["workloads"]["mmio-loop"]
    assert [r["delay_us"] for r in mmio["runs"]] == [0, 150, 300]
    assert mmio["runs"][0]["round_trips"] >= 200  # every guest read was one link round trip
    assert mmio["runs"][2]["rtt_s"] > mmio["runs"][0]["rtt_s"] + 500e-6  # 2 x 300 µs were added
    assert mmio["runs"][2]["runtime_s"] > mmio["runs"][1]["runtime_s"] > mmio["runs"][0]["runtime_s"]
    held = mmio["held_out"]
    assert [h["delay_us"] for h in held] == [150] and abs(held[0]["error"]) < 0.3  # predicted, within 30%
    # each 128 KiB read at depth 1 waited for its doorbell to go out and its completion to
    # come back, though its entry and PRP list went with the doorbell (no DMA read at all)
    assert all(r["round_trips"] >= 8 for r in results["workloads"]["nvme-read"]["runs"])
    for name in ("mmio-loop.png", "nvme-read.png", "overhead.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
