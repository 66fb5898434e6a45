"""The native link stream's own checks, as part of the suite: a short coverage-guided fuzz
run of its parser (libFuzzer + ASan + UBSan, scripts/fuzz_native.sh; long runs: pass a
larger time) and its tests with the sanitized build loaded (scripts/sanitize.sh)."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_fuzzing_the_frame_parser_finds_no_crash_and_no_mismatch():
    if shutil.which("clang") is None:
        pytest.fail("clang is missing (libFuzzer): run scripts/setup.sh (apt-get install clang libclang-rt-14-dev)")
    proc = run(["scripts/fuzz_native.sh", "15"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Done" in proc.stderr and "number_of_executed_units" in proc.stderr


def test_the_link_runs_clean_under_address_and_undefined_behaviour_sanitizers():
    proc = run(["scripts/sanitize.sh", "-x"], timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "ERROR: AddressSanitizer" not in out and "runtime error" not in out, out[-4000:]
    assert " passed" in out
