"""The structure-aware fuzzers (scripts/fuzz.py, dxpu_vfio/fuzz/) as part of the suite: a
short run against every target finds no crash, hang, traceback or memory growth. Long
runs: docs/testing.md, "Fuzzing"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dxpu_vfio.fuzz.targets import TARGETS

ROOT = Path(__file__).resolve().parent.parent
SECONDS = 13  # per target: under two minutes in all


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_a_short_fuzz_run_finds_nothing(target, tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/fuzz.py"), "--target", target, "--seconds", str(SECONDS),
                           "--json", str(out), "--out", str(tmp_path / "findings")],
                          capture_output=True, text=True, timeout=SECONDS + 120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())["results"][0]
    # it really ran (the etcd and box targets' messages are the answers they changed: a few
    # a second, as the store retries a broken answer after a pause and a box is asked only
    # by registration, screenshots and heartbeats)
    assert result["messages"] > {"etcd": 40, "box-answers": 40}.get(target, 1000), result
    assert not result["findings"], result["findings"]


def test_a_finding_fails_the_run_with_a_reproducer(tmp_path, monkeypatch):
    """A target that dies is a crash, with a reproducer naming the seed and messages."""
    from dxpu_vfio.fuzz.runner import Run
    from dxpu_vfio.fuzz.vfio_user import VfioUserTarget

    class Dying(VfioUserTarget):
        def send(self, index, rng):
            sent = super().send(index, rng)
            if index == 20:
                self.process.process.kill()
                self.process.process.wait()
            return sent

    result = Run(Dying("testdev"), seed=7, stop=40, check_every=8, out=tmp_path).execute()
    crashes = [f for f in result.findings if f.kind == "crash"]
    assert result.crashes == 1 and len(crashes) == 1 and result.restarts == 1
    reproducer = json.loads(Path(crashes[0].reproducer).read_text())
    assert reproducer["seed"] == 7 and "--seed 7" in reproducer["replay"] and reproducer["units"]
    assert result.units == 40  # the run went on with a fresh process


def test_a_write_outside_the_guest_windows_is_a_violation_with_a_reproducer(tmp_path):
    """The host-link target's canary pages lie in the guest-RAM memfd outside the window
    QEMU mapped: a host that wrote there (here the test scribbles one byte, as such a bug
    would) is a violation at the next check, with a reproducer, and the run goes on."""
    from dxpu_vfio.fuzz.host_link import HostLinkTarget
    from dxpu_vfio.fuzz.runner import Run

    class Scribbled(HostLinkTarget):
        def send(self, index, rng):
            sent = super().send(index, rng)
            if index == 20:
                self.ram[0] ^= 0xFF  # the page below the window
            return sent

    result = Run(Scribbled(), seed=5, stop=40, check_every=8, out=tmp_path).execute()
    violations = [f for f in result.findings if f.kind == "violation"]
    assert result.violations == 1 and len(violations) == 1 and "canary" in violations[0].detail, result.findings
    assert 20 <= violations[0].index < 24 and json.loads(Path(violations[0].reproducer).read_text())["units"]
    assert result.units == 40 and not result.crashes and not result.hangs


def test_a_screenshot_that_is_not_the_mode_is_a_violation(tmp_path):
    """The display target holds every screenshot against the mode the guest reads back:
    a proxy that drew the wrong frame (here the answer is swapped for a 2x2 PNG from unit
    30 on, as a renderer bug would) is a violation, with a reproducer, and the run goes on
    with a new proxy."""
    import io

    from PIL import Image

    from dxpu_vfio.fuzz.display import DisplayTarget
    from dxpu_vfio.fuzz.runner import Run

    wrong = io.BytesIO()
    Image.new("RGB", (2, 2)).save(wrong, "PNG")

    class WrongFrame(DisplayTarget):
        def send(self, index, rng):
            if index >= 30 and self.process is not None:
                self.process.screenshot = lambda timeout: wrong.getvalue()
            return super().send(index, rng)

    result = Run(WrongFrame(), seed=3, stop=48, check_every=8, out=tmp_path).execute()
    violations = [f for f in result.findings if f.kind == "violation"]
    assert violations and all("the registers say" in f.detail for f in violations), result.findings
    assert violations[0].index >= 30 and json.loads(Path(violations[0].reproducer).read_text())["units"]
    assert result.units == 48 and result.restarts >= 1 and not result.crashes and not result.hangs
