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
SECONDS = 9  # per target: under two minutes in all


# The targets whose messages are the answers a peer changed run a fixed number of units,
# not seconds: one of their units may wait out a client's timeout (a box that stalls a
# GRANT's frame costs the manager its 5 s), so how many fit in a few seconds depends on
# the seed, and a count of them says nothing about whether the run worked.
UNITS = {"etcd": 24, "box-answers": 24}
# The pure readers' targets read thousands of outputs a second: a few seconds is plenty.
READER_SECONDS = {"guest-output": 4, "fault-replies": 4, "manager-answers": 4}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_a_short_fuzz_run_finds_nothing(target, tmp_path):
    out = tmp_path / "results.json"
    length = ["--stop", str(UNITS[target])] if target in UNITS else \
        ["--seconds", str(READER_SECONDS.get(target, SECONDS))]
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/fuzz.py"), "--target", target, *length,
                           "--json", str(out), "--out", str(tmp_path / "findings")],
                          capture_output=True, text=True, timeout=SECONDS + 170, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())["results"][0]
    if target in UNITS:  # every unit ran, and the peer changed answers beyond the units' own lines
        assert result["units"] == UNITS[target] and result["messages"] > result["units"], result
    else:  # it really ran (a guest channel's unit waits out its timeout when its answer never comes)
        assert result["messages"] > {"guest-channel": 60}.get(target, 1000), result
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


@pytest.mark.parametrize("fault", ["a lease left", "a token not revoked"])
def test_an_attach_whose_rollback_forgets_something_is_a_violation(tmp_path, fault):
    """The box-answers target attaches to a paused QEMU without a root port, so every
    attach must be rolled back: no lease left on the VM, and every lease the box was asked
    a token for revoked at the box. A rollback that forgot either (here, at the attaches
    from unit 20 on until one is caught, the test allocates a lease for the VM before it,
    or makes the box forget the REVOKEs it gets) is a violation with a reproducer, and the
    run goes on with a new manager."""
    from dxpu_vfio.fuzz.box_answers import BoxAnswersTarget
    from dxpu_vfio.fuzz.peer import Violation
    from dxpu_vfio.fuzz.runner import Run
    from dxpu_vfio.link.protocol import LinkCommand
    from dxpu_vfio.pool.storage import NoFreeDevice
    from dxpu_vfio.vmm.naming import target_key

    class Forgetful(BoxAnswersTarget):
        index, caught = 0, False

        def _attach(self, rng, deadline):
            if self.index >= 20 and not self.caught:  # until the first violation
                if fault == "a token not revoked":
                    self.box.asked[LinkCommand.REVOKE] = _Deaf()
                else:
                    try:
                        self.store.allocate(target_key(f"qmp:{self.vm.admin_qmp_path}"), device_class="testdev")
                    except NoFreeDevice:  # a unit's inventory left the box without devices: the next attach
                        pass
            try:
                return super()._attach(rng, deadline)
            except Violation:
                self.caught = True
                raise

        def send(self, index, rng):
            self.index = index
            return super().send(index, rng)

    class _Deaf(list):
        def append(self, item):
            pass

        def clear(self):
            pass

    result = Run(Forgetful(), seed=11, stop=48, check_every=8, out=tmp_path).execute()
    violations = [f for f in result.findings if f.kind == "violation"]
    said = "leases left" if fault == "a lease left" else "did not revoke"
    assert len(violations) == 1 and said in violations[0].detail, result.findings
    assert violations[0].index >= 20 and json.loads(Path(violations[0].reproducer).read_text())["units"]
    assert result.units == 47 and result.restarts == 1 and not result.crashes and not result.hangs


def test_the_etcd_targets_agent_is_replaced_when_it_stops_and_its_traceback_is_a_violation(tmp_path):
    """The etcd target runs a host agent on the relay beside the manager. An agent that
    stops (here killed at unit 10) is replaced by one under a new host name, and the next
    unit says so; a traceback in the agent's log (here written at unit 30, as a crash in
    one of its threads would) is a violation with a reproducer."""
    from dxpu_vfio.fuzz.etcd import EtcdAnswersTarget
    from dxpu_vfio.fuzz.runner import Run

    told: list[bytes] = []

    class Troubled(EtcdAnswersTarget):
        def send(self, index, rng):
            if index == 10:
                self.agent.process.kill()
                self.agent.process.wait()
            if index == 30:
                with open(self.agent.log_path, "a") as log:
                    log.write("Traceback (most recent call last):\n  a thread of the agent died\n")
            sent = super().send(index, rng)
            told.extend(m for m in sent if m.startswith(b"agent fzagent"))
            return sent

    result = Run(Troubled(), seed=2, stop=48, check_every=8, out=tmp_path).execute()
    assert told and told[0].startswith(b"agent fzagent1 stopped"), told
    violations = [f for f in result.findings if f.kind == "violation"]
    assert len(violations) == 1 and "a thread of the agent died" in violations[0].detail, result.findings
    # the target looks at its agent before every unit: the one that found it is not counted
    assert violations[0].index == 30 and json.loads(Path(violations[0].reproducer).read_text())["units"]
    assert result.units == 47 and not result.crashes and not result.hangs
