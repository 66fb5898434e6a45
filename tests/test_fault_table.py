"""scripts/fault_table.py renders what the fault tests observed (no VM)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_table_has_a_row_per_observation_in_order_and_the_loss_latencies(tmp_path):
    results = tmp_path / "faults"
    results.mkdir()
    runs = {"clean": {"latency": {"write": {"p50_ms": 1.5, "p99_ms": 3.0}, "read": {"p50_ms": 1.0, "p99_ms": 2.0}},
                      "errors": 0, "data_intact": True, "achieved_loss": {"up": None, "down": None}},
            "random 1%": {"latency": {"write": {"p50_ms": 2.0, "p99_ms": 250.0}, "read": {"p50_ms": 1.2, "p99_ms": 210.0}},
                          "errors": 0, "data_intact": True, "achieved_loss": {"up": 0.0104, "down": 0.0098},
                          "packets": {"up": 9000, "down": 12000}, "blackout_ms": {"up": 31.4, "down": 1250.2}}}
    records = [{"name": "link-cut", "fault": "cut | link", "mode": "remote", "driver": "dead", "application": "EIO",
                "recovery_s": 3.1, "io_timeout": 5, "controller_state": "dead"},
               {"name": "loss", "fault": "loss", "mode": "remote", "driver": "nothing", "application": "intact",
                "recovery_s": 0, "io_timeout": 5, "runs": runs},
               {"name": "reset-local", "fault": "reset", "mode": "local", "driver": "reset", "application": "no error",
                "recovery_s": 0.2, "io_timeout": 5},
               {"name": "display-cut", "device": "display", "fault": "cut", "mode": "remote", "driver": "bound",
                "application": "no error", "recovery_s": None, "facts": {"driver after": "bochs-drm"}}]
    for r in records:
        (results / f"{r['name']}.json").write_text(json.dumps(r))
    out = tmp_path / "faults.md"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "fault_table.py"), "--results", str(results),
                           "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and (" | local | " in line or " | remote | " in line)]
    assert [r.split(" | ")[0] for r in rows] == ["| reset", "| loss", "| cut \\| link", "| cut"]  # ORDER, | escaped
    assert "| 0.2 s |" in rows[0] and "none needed" in rows[1] and "| 3.1 s |" in rows[2] and rows[3].endswith("| — |")
    assert [r.split(" | ")[1] for r in rows] == ["nvme", "nvme", "nvme", "display"]  # nvme when a record names none
    assert "- driver after: `bochs-drm`" in text  # a test's own facts
    assert ("| random 1% | 2.0 ms | 250.0 ms | 1.2 ms | 210.0 ms | 1.04 % / 0.98 % | 9000 / 12000 | 31 ms / 1250 ms "
            "| 0 | intact |") in text
    assert "| clean | 1.5 ms | 3.0 ms | 1.0 ms | 2.0 ms | — / — | — / — | — / — | 0 | intact |" in text  # no emulator
    assert "nvme_core.io_timeout=5" in text


def test_no_observations_is_an_error_that_says_what_to_run(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "fault_table.py"), "--results", str(tmp_path),
                           "--out", str(tmp_path / "x.md")], capture_output=True, text=True)
    assert proc.returncode == 1 and "tests/test_nvme_faults.py" in proc.stderr
    assert not (tmp_path / "x.md").exists()
