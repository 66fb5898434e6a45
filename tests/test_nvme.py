"""The guest's own nvme driver on our NVMe controller, served locally and from a GPU box
over the lab network with mutual TLS (tiny image, trixie cloud kernel; nvme-cli on full)."""

import os
import signal
import time

import pytest

from dxpu_vfio.lab import hotplug, lab
from dxpu_vfio.lab.guest_devices import nvme_disk
from dxpu_vfio.testing.served import Serve
from dxpu_vfio.testing.vms import GuestLoop

pytestmark = pytest.mark.vm
MiB = 1 << 20


@pytest.fixture(scope="module")
def local_disks(tmp_path_factory):
    return tmp_path_factory.mktemp("local-disks")


@pytest.fixture(scope="module")
def served_specs(lab_factory, local_disks):
    """NVMe device n: remote box1/nv0 or box2/nv1 (disks in the session's lab files);
    local: two namespaces of 64 and 16 MiB."""
    disks = lab_factory.directory("nvme-disks")
    ns = lambda where, name, size: {"size": size, "path": str(where / name)}  # noqa: E731
    local = lambda n: {"namespaces": [ns(local_disks, f"l{n}n1", 64 * MiB), ns(local_disks, f"l{n}n2", 16 * MiB)],  # noqa: E731
                       "io_workers": 4}
    return [Serve("nvme", "nv0", "box1", {"namespaces": [ns(disks, "b1n1", 64 * MiB), ns(disks, "b1n2", 16 * MiB)],
                                          "io_workers": 4},
                  local=local(0)),
            Serve("nvme", "nv1", "box2", {"namespaces": [ns(disks, "b2n1", 32 * MiB)], "serial": "DXPUBOX2"},
                  local=local(1))]


@pytest.fixture
def nvme_device(served_devices):
    """attach() arguments for NVMe device n of this mode."""
    return lambda n=0: served_devices[n].attach_args()


@pytest.fixture
def vm(shared_tiny_vm):
    return shared_tiny_vm


def controller(vm, att, timeout: int = 20) -> str:
    """The nvmeN name the guest's driver gave this device (waits for the driver to bind)."""
    d = f"/sys/bus/pci/devices/{att.guest_bdf}/nvme"
    return vm.run(f"i=0; while [ ! -d {d} ] && [ $i -lt {timeout * 10} ]; do sleep 0.1; i=$((i+1)); done; ls {d}",
                  timeout=timeout + 10).stdout.split()[0]


@pytest.fixture
def plugged(vm, nvme_device):
    att = hotplug.attach(vm, **nvme_device())
    yield att, nvme_disk(vm, att.guest_bdf, 1), nvme_disk(vm, att.guest_bdf, 2)
    hotplug.detach(att)


def test_driver_binds_and_disks_have_the_configured_size(vm, plugged):
    att, ns1, ns2 = plugged
    assert vm.run(f"basename $(readlink /sys/bus/pci/devices/{att.guest_bdf}/driver)").stdout.strip() == "nvme"
    assert int(vm.run(f"cat /sys/block/{ns1}/size").stdout) * 512 == 64 * MiB
    assert int(vm.run(f"cat /sys/block/{ns2}/size").stdout) * 512 == 16 * MiB


def round_trip(vm, dev: str, size: str, write_args: str, read_args: str) -> bool:
    """Random data of ``size`` (dd bs= count=) written to /dev/``dev``, synced, the page
    cache dropped, read back: the same bytes?"""
    out = vm.run(f"dd if=/dev/urandom of=/tmp/data {size} 2>/dev/null && "
                 f"dd if=/tmp/data of=/dev/{dev} {size.split()[0]} {write_args} 2>/dev/null && sync && "
                 f"echo 3 > /proc/sys/vm/drop_caches && "
                 f"dd if=/dev/{dev} of=/tmp/back {size} {read_args} 2>/dev/null && "
                 f"md5sum /tmp/data /tmp/back", timeout=300).stdout.split()
    return out[0] == out[2]


def test_random_data_survives_dropped_caches(vm, plugged):
    _, ns1, _ = plugged
    assert round_trip(vm, ns1, "bs=128k count=48", "oflag=direct", "iflag=direct"), \
        "data read back differs from data written"


def mmio_writes(server) -> int:
    """QEMU's REGION_WRITEs a host proxy served so far, in Python or in its C forwarder."""
    stats = server.stats()["server"]
    return stats["commands"].get("REGION_WRITE", {}).get("count", 0) + stats["forwarded"].get("REGION_WRITE", 0)


def test_shadow_doorbells_save_the_cq_doorbells_locally_and_on_a_box(vm, plugged, served):
    """Linux's driver sets up Doorbell Buffer Config where Identify offers it: the guest
    writes its SQ tails and CQ heads to memory and rings an MMIO doorbell only when the event
    index asks. Served locally the controller reads the shadows; on a box the host reads
    them for it (the link's RingWatch.shadow: a shadow read there would be a round trip),
    and each doorbell still takes its command and PRP list along (DMA_PUSH)."""
    att, ns1, _ = plugged
    before = mmio_writes(att.server)
    pushes, lists, tails = pushed(att.server), pushed(att.server, "pointed"), pushed(att.server, "shadow_tails")
    assert round_trip(vm, ns1, "bs=128k count=48", "oflag=direct", "iflag=direct")
    doorbells = mmio_writes(att.server) - before
    # 96 commands of 128 KiB (MDTS) at depth 1: each finds the worker idle, so its SQ doorbell
    # still rings; the CQ head doorbells are gone (96, against 192)
    assert doorbells < 96 * 3 // 2, f"{doorbells} MMIO writes for 96 commands: the shadows were not used"
    if served == "local":
        assert att.server.stats()["device"]["shadow_tails"] >= 96
    else:  # the host read each SQ doorbell's tail from the shadow, and sent the command along
        assert pushed(att.server, "shadow_tails") - tails >= 96, "the host did not read the shadows"
        assert pushed(att.server) - pushes >= 96, "the host pushed no SQ entries with their doorbells"
        # and each 128 KiB command's PRP list (32 pages) with it: the box read none of them itself
        assert pushed(att.server, "pointed") - lists >= 96, "the host pushed no PRP lists with their commands"


def pushed(server, what: str = "pushes") -> int:
    """SQ doorbells whose commands the host's C forwarder sent along (``pointed``: the PRP
    lists it sent with them), 0 for a local device."""
    return server.stats()["device"].get("link", {}).get("native", {}).get(what, 0)


def queue_interrupts(vm, ctrl: str) -> dict[str, int]:
    """Interrupts per queue of controller ``ctrl`` ({"q0": n, "q1": n, ...}), all CPUs."""
    out = {}
    for line in vm.run("cat /proc/interrupts").stdout.splitlines():
        fields = line.split()
        if fields and fields[-1].startswith(ctrl + "q"):
            out[fields[-1].removeprefix(ctrl)] = sum(int(f) for f in fields[1:] if f.isdigit())
    return out


def test_commands_overlap(vm, plugged, served):
    """Writeback sends many writes at once; the controller runs them side by side.
    (With MSI the guest has one vector, so one I/O queue: x86 gives a device several MSI
    messages only behind interrupt remapping. Queues per vCPU: the MSI-X test below.)"""
    att, ns1, _ = plugged
    assert round_trip(vm, ns1, "bs=1M count=4", "seek=8", "skip=8"), "data written at depth read back differs"
    if served == "local":  # the device's own counters (a box keeps them in its proxy)
        assert att.server.stats()["device"]["io_in_flight_peak"] >= 2


def test_second_namespace_is_independent(vm, plugged):
    _, ns1, ns2 = plugged
    vm.run(f"echo namespace-two | dd of=/dev/{ns2} bs=512 conv=sync oflag=direct 2>/dev/null; "
           f"echo namespace-one | dd of=/dev/{ns1} bs=512 conv=sync oflag=direct 2>/dev/null; sync")
    assert vm.run(f"dd if=/dev/{ns2} bs=512 count=1 iflag=direct 2>/dev/null | head -n1").stdout == "namespace-two\n"


def test_data_survives_unplug_and_replug(vm, nvme_device):
    att = hotplug.attach(vm, **nvme_device())
    ns1 = nvme_disk(vm, att.guest_bdf, 1)
    vm.run(f"dd if=/dev/urandom of=/tmp/keep bs=64k count=4 2>/dev/null; "
           f"dd if=/tmp/keep of=/dev/{ns1} bs=64k seek=100 oflag=direct 2>/dev/null; sync")
    hotplug.detach(att)
    att = hotplug.attach(vm, **nvme_device())
    try:
        ns1 = nvme_disk(vm, att.guest_bdf, 1)
        out = vm.run(f"dd if=/dev/{ns1} of=/tmp/again bs=64k skip=100 count=4 iflag=direct 2>/dev/null; "
                     "md5sum /tmp/keep /tmp/again").stdout.split()
        assert out[0] == out[2]
    finally:
        hotplug.detach(att)


def test_two_nvme_devices_in_one_vm(vm, nvme_device, served):
    """Remote: one from each GPU box."""
    first = hotplug.attach(vm, **nvme_device(0))
    second = hotplug.attach(vm, **nvme_device(1))
    try:
        names = [nvme_disk(vm, a.guest_bdf, 1) for a in (first, second)]
        for i, ns in enumerate(names):
            vm.run(f"echo disk-{i} | dd of=/dev/{ns} bs=512 conv=sync oflag=direct 2>/dev/null")
        for i, ns in enumerate(names):
            assert vm.run(f"dd if=/dev/{ns} bs=512 count=1 iflag=direct 2>/dev/null | head -n1").stdout == f"disk-{i}\n"
    finally:
        hotplug.detach(first)
        hotplug.detach(second)


# --- remote failure and durability (remote only) ----------------------------------------

def test_flushed_data_survives_a_remote_proxy_restart(vm_factory, served_lab):
    vm = vm_factory.booted("tiny")
    settings = served_lab.remote_settings("box2", "nv1")
    att = hotplug.attach(vm, "remote", settings=settings, netns=served_lab.host_netns)
    ns1 = nvme_disk(vm, att.guest_bdf, 1)
    vm.run(f"dd if=/dev/urandom of=/tmp/keep bs=64k count=8 2>/dev/null; "
           f"dd if=/tmp/keep of=/dev/{ns1} bs=64k oflag=direct 2>/dev/null; sync")  # sync: flush
    hotplug.detach(att)
    os.kill(served_lab.box("box2").proxy_pid, signal.SIGKILL)
    lab.restart_proxy(served_lab, "box2")
    att = hotplug.attach(vm, "remote", settings=settings, netns=served_lab.host_netns)
    ns1 = nvme_disk(vm, att.guest_bdf, 1)
    out = vm.run(f"dd if=/dev/{ns1} of=/tmp/again bs=64k count=8 iflag=direct 2>/dev/null; "
                 "md5sum /tmp/keep /tmp/again").stdout.split()
    assert out[0] == out[2]
    hotplug.detach(att)


def test_remote_killed_during_io_gives_io_errors_not_a_hang(vm_factory, served_lab, tiny_image):
    # A short nvme_core.io_timeout (default 30 s): the I/O in flight when the box dies never
    # completes, and the driver's timeout is what starts its abort/reset path.
    vm = vm_factory.booted("tiny", cmdline=f"{tiny_image.cmdline} nvme_core.io_timeout=4")
    settings = {**served_lab.remote_settings("box1", "nv0"), "completion_timeout": 0.5}
    att = hotplug.attach(vm, "remote", settings=settings, netns=served_lab.host_netns)
    ns1 = nvme_disk(vm, att.guest_bdf, 1)
    loop = GuestLoop(vm, f"dd if=/dev/urandom of=/dev/{ns1} bs=128k count=64 oflag=direct 2>>/tmp/io.err",
                     tools=(f"of=/dev/{ns1}",))
    time.sleep(2)
    os.kill(served_lab.box("box1").proxy_pid, signal.SIGKILL)
    try:
        started = time.monotonic()
        result = vm.run(f"dd if=/dev/{ns1} of=/dev/null bs=4k count=16 iflag=direct", check=False, timeout=120)
        assert result.rc != 0, "reads from a dead box succeeded"
        assert time.monotonic() - started < 100, "the guest hung"
        loop.stop()
        assert vm.guest_alive() and vm.run("echo alive").stdout == "alive\n"
        hotplug.detach(att, timeout=30)
        assert vm.alive()
    finally:
        lab.restart_proxy(served_lab, "box1")


def test_nvme_cli_on_the_full_image(full_vm, local_disks):
    att = hotplug.attach(full_vm, "nvme", settings={"namespaces": [{"size": 32 * MiB, "path": str(local_disks / "f1")}],
                                                   "serial": "DXPUFULL"})
    try:
        ns1 = nvme_disk(full_vm, att.guest_bdf, 1)
        ctrl = controller(full_vm, att)
        ident = full_vm.run(f"nvme id-ctrl /dev/{ctrl}").stdout
        assert "dxpu-vfio pooled NVMe" in ident and "DXPUFULL" in ident
        assert "DXPUFULL" in full_vm.run("nvme list").stdout
        smart = full_vm.run(f"nvme smart-log /dev/{ctrl}").stdout
        assert "available_spare" in smart
        assert "nsze" in full_vm.run(f"nvme id-ns /dev/{ns1}").stdout
    finally:
        hotplug.detach(att)


def test_msix_option_works_until_unplug(vm_factory, local_disks):
    """NVMe with MSI-X (behind the option): the driver makes one I/O queue per vCPU, each
    with its own MSI-X vector, and a writer on each vCPU uses its own. Not unplugged: QEMU 11.1 aborts on that (recorded in test_hotplug)."""
    vm = vm_factory.booted("tiny")
    att = hotplug.attach(vm, "nvme", allow_msix=True, settings={
        "msix": True, "namespaces": [{"size": 16 * MiB, "path": str(local_disks / "mx")}]})
    ns1 = nvme_disk(vm, att.guest_bdf, 1)
    ctrl, cpus = controller(vm, att), int(vm.run("nproc").stdout)
    assert cpus == 2 and len(vm.run(f"ls /sys/block/{ns1}/mq").stdout.split()) == cpus  # a queue per vCPU
    before = queue_interrupts(vm, ctrl)
    vm.run(f"for c in 0 1; do taskset -c $c dd if=/dev/urandom of=/dev/{ns1} bs=128k count=8 seek=$((c * 8)) "
           f"oflag=direct 2>/dev/null & done; wait", timeout=300)  # a writer on each vCPU
    after = queue_interrupts(vm, ctrl)
    assert all(after.get(f"q{q}", 0) > before.get(f"q{q}", 0) for q in (1, 2)), (before, after)
    lines = [l for l in vm.run("cat /proc/interrupts").stdout.splitlines() if "PCI-MSIX" in l and "nvme" in l]
    assert len(lines) == 1 + cpus  # admin queue + one I/O queue per vCPU
    assert att.server.stats()["server"]["irqs"]["msix"] >= 8
    att.server.stop()
