"""The accelerator in a real guest (full image): the guest runtime (dxpu_accel.py, std-lib
Python in the guest) finds the hot-plugged device in sysfs, maps BAR0, gets DMA memory
with physical addresses from pagemap, and runs its self-test: copies that round-trip
exactly, GEMM / bias + ReLU / softmax against pure Python, a ring that wraps, an
out-of-range command that sets the error state, and recovery; then the AI workloads
(MLP inference, a transformer block, a training step), checked against numpy in the
guest. Served locally and from a GPU box over the lab network with mutual TLS
(``served``)."""

import pytest

from dxpu_vfio.lab import accel as guest_accel
from dxpu_vfio.lab import hotplug
from dxpu_vfio.lab.accel_workloads import WORKLOADS
from dxpu_vfio.testing import Serve

BOX, DEVICE = "gpubox", "acc0"
MiB = 1 << 20


@pytest.fixture(scope="module")
def served_specs():
    return [Serve("accel", DEVICE, BOX)]


@pytest.fixture
def plugged(served_device, full_vm):
    att = hotplug.attach(full_vm, **served_device.attach_args())
    yield att
    hotplug.detach(att)


def sysfs(vm, bdf: str, name: str) -> str:
    return vm.run(f"cat /sys/bus/pci/devices/{bdf}/{name}").stdout.strip()


@pytest.mark.vm
def test_guest_sees_a_processing_accelerator_with_1_gib_of_vram(full_vm, plugged):
    bdf = plugged.guest_bdf
    assert (sysfs(full_vm, bdf, "vendor"), sysfs(full_vm, bdf, "device"), sysfs(full_vm, bdf, "class")) == \
        ("0x1b36", "0x10f2", "0x120000")
    bar2 = sysfs(full_vm, bdf, "resource").splitlines()[2].split()
    start, end, flags = (int(x, 16) for x in bar2)
    assert end - start + 1 == 1 << 30 and flags & 0x8 and flags & 0x4   # prefetchable, 64-bit


@pytest.mark.vm
@pytest.mark.parametrize("huge", [False, True], ids=["4k-pages", "huge-pages"])
def test_runtime_selftest_in_the_guest(full_vm, plugged, huge):
    """4 KiB pages: every copy goes through scatter lists (64 MiB: 64 commands of 256
    pieces); 2 MiB huge pages: few pieces."""
    full_vm.run(f"echo {16 if huge else 0} > /proc/sys/vm/nr_hugepages")
    try:
        sizes = [4096, MiB, 4 * MiB] if huge else [4096, 64 * 1024, MiB, 4 * MiB, 64 * MiB]
        rc, lines = guest_accel.selftest(full_vm, plugged.guest_bdf, sizes)
    finally:
        full_vm.run("echo 0 > /proc/sys/vm/nr_hugepages")
    assert rc == 0, lines
    assert lines["huge_pages"] == ("1" if huge else "0") and lines["ring"] == ("4096" if huge else "64")
    for check in [f"copy_{n}" for n in sizes] + ["gemm", "bias_relu", "softmax", "ring_wrap", "error_state",
                                                 "recovered"]:
        assert lines[check].startswith("ok"), (check, lines)


@pytest.mark.vm
def test_the_ai_workloads_run_in_the_guest_and_check_their_numerics(full_vm, plugged):
    """MLP inference at batch 1, 8 and 64, a transformer block forward at sequence 64 and
    256, an MLP training step: each through the runtime in the guest (weights in VRAM,
    passes of one doorbell), its results checked against numpy in the guest."""
    runs = guest_accel.workloads(full_vm, plugged.guest_bdf, list(WORKLOADS), passes=2)
    assert set(runs) == set(WORKLOADS)
    for name, run in runs.items():
        assert run["passes"] == 2 and run["max_abs_error"] < 1e-2, (name, run)
        assert run["median_s"] > 0 and run["span_mean_s"] > 0, (name, run)
