"""The lab's readers of its guest programs' output (dxpu_vfio/lab/guest_output.py): what
the programs print when all is well reads as it should, and what a broken or hostile
guest prints is refused with an error that names the program and quotes the output,
never a traceback of another kind or a figure nobody checked. The fuzz target
(dxpu_vfio/fuzz/guest_output.py) runs in test_fuzz.py; here it is checked to catch the
readers this module replaced."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dxpu_vfio.errors import VmError
from dxpu_vfio.fuzz import guest_output as fuzz
from dxpu_vfio.fuzz.readers import ReaderTarget
from dxpu_vfio.fuzz.runner import Run
from dxpu_vfio.lab import guest_output as out
from dxpu_vfio.lab.guest_output import GuestOutputError


def test_every_reader_reads_what_its_program_prints_when_all_is_well():
    target = fuzz.target()
    target.start(Path("/nonexistent"))
    target.probe(0.0)  # each sample read as expected, the value keeping its contract


@pytest.mark.parametrize("text, problem", [
    ("count=3 median_ns=nan p99_ns=1", "median_ns that is not finite"),
    ("median_ns=1e999 p99_ns=1", "median_ns that is not finite"),
    ("median_ns=\u0661\u0662 p99_ns=1", None),  # float() reads Arabic-Indic digits: it is a number, 12
    ("median_ns=12 p99_ns=0x10", "p99_ns that is not a number"),
    ("median_ns=12", "no p99_ns="),
])
def test_numbers_are_finite_and_every_key_is_there(text, problem):
    if problem is None:
        assert out.numbers(text, ("median_ns", "p99_ns"), "dxpu-mmio") == {"median_ns": 12.0, "p99_ns": 1.0}
        return
    with pytest.raises(GuestOutputError) as caught:
        out.numbers(text, ("median_ns", "p99_ns"), "dxpu-mmio")
    assert caught.value.program == "dxpu-mmio" and problem in caught.value.problem
    assert str(caught.value).startswith("dxpu-mmio in the guest printed") and text[-20:] in str(caught.value)
    assert isinstance(caught.value, VmError)  # what a lab caller of vm.run already handles


def test_fio_json_nested_past_the_stack_or_with_a_bad_figure_is_refused():
    good = "fio: warning\n" + fuzz.FIO
    assert out.fio_side(good, "write")["iops"] == 0.0
    with pytest.raises(GuestOutputError, match="no JSON .*RecursionError"):
        out.fio_side('{"jobs": ' + "[" * 100_000 + "]" * 100_000 + "}", "read")
    report = json.loads(fuzz.FIO)
    report["jobs"][0]["read"]["bw_bytes"] = -5
    with pytest.raises(GuestOutputError, match="a negative read.bw_bytes"):
        out.fio_side(json.dumps(report), "read")
    report["jobs"][0]["read"]["bw_bytes"] = True  # a bool is no number, though int() takes it
    with pytest.raises(GuestOutputError, match="read.bw_bytes that is not a number"):
        out.fio_side(json.dumps(report), "read")
    with pytest.raises(GuestOutputError, match="no job with a read side"):
        out.fio_side('{"jobs": []}', "read")


def test_proc_stat_counts_are_ascii_digits_of_a_bounded_length():
    assert out.proc_stat(fuzz.STAT)["ctxt"] == 654321
    with pytest.raises(GuestOutputError, match="ctxt count that is not a count"):
        out.proc_stat(fuzz.STAT.replace("ctxt 654321", "ctxt \u00b2"))  # '²'.isdigit() is True; int() refuses it
    with pytest.raises(GuestOutputError, match="ctxt count that is not a count"):
        out.proc_stat(fuzz.STAT.replace("ctxt 654321", "ctxt " + "9" * 5000))  # past int()'s digit limit
    with pytest.raises(GuestOutputError, match="no intr"):
        out.proc_stat(fuzz.STAT.replace("intr", "int"))


def test_a_plug_event_and_a_sysfs_answer_must_carry_a_pci_address():
    event = {"action": "add", "bdf": "0000:01:00.0; reboot"}
    with pytest.raises(GuestOutputError, match="an add without a PCI address"):
        out.udev_events(json.dumps(event) + "\n", "dxpu-guest-events")
    with pytest.raises(GuestOutputError, match="no JSON"):
        out.udev_events('{"action": "add"\n', "dxpu-guest-events")  # a line cut short
    assert out.pci_address(" 0000:01:00.0\n", "sysfs") == "0000:01:00.0"
    with pytest.raises(GuestOutputError, match="no PCI address"):
        out.pci_address("0000:01:00.0\n0000:02:00.0\n", "sysfs")
    with pytest.raises(GuestOutputError, match="no NVMe disk"):
        out.word("nvme0n1 /dev/sda", out.NVME_DISK, "sysfs", "NVMe disk")


def test_a_workload_line_without_its_figures_is_refused_and_a_failure_is_returned():
    run = {**fuzz.RUN, "device": "remote", "median_s": "fast"}
    with pytest.raises(GuestOutputError, match="mlp-b64's median_s that is not a number"):
        out.workload_lines(f"workload={json.dumps(run)}\n", ("remote",), "the accel runner")
    runs, failed = out.workload_lines('workload_failed={"workload": "mlp-b64", "error": "off by 3"}\n',
                                      ("remote",), "the accel runner")
    assert runs == {"remote": {}} and failed == {"workload": "mlp-b64", "error": "off by 3"}
    other = {**fuzz.RUN, "device": "elsewhere"}  # a device not asked for is left out
    assert out.workload_lines(f"workload={json.dumps(other)}\n", ("remote",), "r") == ({"remote": {}}, None)


def test_the_fuzz_target_catches_the_readers_this_module_replaced(tmp_path):
    """The lab's earlier readers, put back in the target: a mmio tool's output without its
    key raised KeyError, and fio's figures went on unchecked (ints, negatives, None)."""
    def old_numbers(text):
        found = dict(item.split("=", 1) for item in text.split() if "=" in item)
        return {k: float(found[k]) for k in ("median_ns", "p99_ns")}

    def old_fio(text):
        return json.loads(text[text.index("{"):])["jobs"][0]["read"]

    for name, read in (("numbers", old_numbers), ("fio", old_fio)):
        readers = tuple(dataclasses.replace(r, read=read) if r.name == name else r for r in fuzz.READERS)
        result = Run(ReaderTarget("guest-output", readers), seed=11, stop=600, check_every=50, out=tmp_path / name).execute()
        assert result.violations > 0, name
        assert any(f"the {name} reader" in f.detail for f in result.findings), [f.detail[:200] for f in result.findings]
