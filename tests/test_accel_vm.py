"""The accelerator in a real guest (full image): the guest runtime (dxpu_accel.py, std-lib
Python in the guest) finds the hot-plugged device in sysfs, maps BAR0, gets DMA memory
with physical addresses from pagemap, and runs its self-test: copies that round-trip
exactly, GEMM / bias + ReLU / softmax against pure Python, a ring that wraps, an
out-of-range command that sets the error state, and recovery; then the AI workloads
(MLP inference, a transformer block, a training step), checked against numpy in the
guest. Served locally and from a GPU box over the lab network with mutual TLS
(``served``)."""

import os
import signal
import time

import pytest

from dxpu_vfio.lab import accel as guest_accel
from dxpu_vfio.lab import hotplug
from dxpu_vfio.lab.accel_workloads import WORKLOADS
from dxpu_vfio.procs import wait_until
from dxpu_vfio.testing.served import Serve, serve_topology

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
    assert lines["huge_pages"] == ("1" if huge else "0") and lines["ring"] == ("16384" if huge else "64")
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


# Runs in the guest: queues ``gemms`` GEMMs of n x n x n (seconds of work for the box's
# numpy) with one flush, says "queued", then waits and says how the wait ended.
IN_FLIGHT = """
import sys, time
sys.path.insert(0, "/tmp")
import dxpu_accel as rt
dev = rt.Accel.open(sys.argv[1], timeout=120)
n, gemms = int(sys.argv[2]), int(sys.argv[3])
a, b, c = (dev.malloc(4 * n * n) for _ in range(3))
s = dev.stream()
s.fill(a, 4 * n * n, 0x3F800000)
s.fill(b, 4 * n * n, 0x3F800000)
for _ in range(gemms):
    s.gemm(c, a, b, n, n, n)
s.flush()
print("queued", flush=True)
started = time.monotonic()
try:
    s.synchronize()
    print("result=done", flush=True)
except rt.DeviceGone as exc:
    print("result=DeviceGone", exc, flush=True)
except rt.AccelError as exc:
    print("result=AccelError", exc, flush=True)
print(f"waited={time.monotonic() - started:.1f}", flush=True)
"""


def start_in_flight(vm, bdf: str, n: int = 2048, gemms: int = 40) -> str:
    """Start IN_FLIGHT in the background; returns its output file once the work is queued."""
    guest_accel.install(vm)
    guest_accel.put(vm, "/tmp/in_flight.py", IN_FLIGHT)
    out = "/tmp/in_flight.out"
    vm.run(f"rm -f {out}")
    vm.spawn(f"python3 /tmp/in_flight.py {bdf} {n} {gemms} > {out} 2>&1; echo exit=$? >> {out}")
    wait_for(vm, out, "queued", 60)
    return out


def wait_for(vm, path: str, word: str, timeout: float) -> str:
    """The guest file's text once it holds ``word`` (bounded)."""
    seen = [""]

    def said() -> bool:
        seen[0] = vm.run(f"cat {path} 2>/dev/null || true").stdout
        return word in seen[0]

    if not wait_until(said, timeout, interval=0.3):
        raise AssertionError(f"{path} in the guest did not say {word!r} within {timeout} s: {seen[0]!r}")
    return seen[0]


@pytest.mark.vm
def test_hot_unplug_with_work_in_flight_ends_the_wait_and_the_device_comes_back_clean(full_vm, served_device):
    """device_del while seconds of GEMMs are queued: the guest's wait ends (the runtime
    sees the device gone, or the kernel takes the mapping away) instead of hanging, the
    guest stays up, and a new attach gets an idle device that runs the self-test."""
    att = hotplug.attach(full_vm, **served_device.attach_args())
    try:
        out = start_in_flight(full_vm, att.guest_bdf)
    finally:
        hotplug.detach(att)
    text = wait_for(full_vm, out, "exit=", 60)
    # the runtime ends its wait with its own error (the unplug resets the device: its ring
    # reads disabled, or all-ones once gone), not a crash and not the work's completion
    assert ("result=AccelError" in text or "result=DeviceGone" in text) and "exit=0" in text, text
    assert full_vm.run("echo up").stdout.strip() == "up"
    again = hotplug.attach(full_vm, **served_device.attach_args())
    try:
        rc, lines = guest_accel.selftest(full_vm, again.guest_bdf, [4096, 1 << 20])
        assert rc == 0 and lines["gemm"].startswith("ok"), lines
    finally:
        hotplug.detach(again)


@pytest.mark.vm
def test_the_box_killed_mid_kernel_ends_the_guests_wait_with_device_gone(full_vm, labs):
    """SIGKILL to the box's proxy while the guest waits on seconds of GEMMs: the host proxy
    answers all-ones, the runtime's status check turns that into DeviceGone within
    seconds, the guest stays up, and the detach completes."""
    state = labs.own(serve_topology([Serve("accel", "acc0", "kbox")], "kill"))
    att = hotplug.attach(full_vm, "remote", settings=state.remote_settings("kbox", "acc0"), netns=state.host_netns)
    try:
        out = start_in_flight(full_vm, att.guest_bdf)
        time.sleep(0.5)                                   # the box is inside the GEMMs
        os.kill(state.box("kbox").proxy_pid, signal.SIGKILL)
        killed = time.monotonic()
        text = wait_for(full_vm, out, "exit=", 60)
        ended_after = time.monotonic() - killed
    finally:
        hotplug.detach(att)
    assert "result=DeviceGone" in text, text
    assert ended_after < 30, (ended_after, text)
    assert full_vm.run("echo up").stdout.strip() == "up"
