"""The test device hot-plugged through QMP into a real guest (tiny image, trixie cloud
kernel): identity, registers, DMA, interrupts, replug, reset, errors.

Every test runs twice: ``local`` (our vfio-user server runs the model) and ``remote``
(the model runs in a remote proxy in a GPU-box network namespace, reached over veth
with mutual TLS by a host proxy in the lab's host namespace). The tests are the same."""

import json
import os
import signal
import time

import pytest

from dxpu_vfio.errors import VmError
from dxpu_vfio.hostproxy.process import HostProxyError, HostProxyProcess
from dxpu_vfio.lab import hotplug, lab
from dxpu_vfio.testing import eventually
from dxpu_vfio.testing.served import Serve
from dxpu_vfio.testing.vms import GuestLoop
from dxpu_vfio.vmm.rootports import used_root_ports

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def served_specs():
    """Remote: device 1 is in the other GPU box."""
    return [Serve("testdev", "td0", "box1"), Serve("testdev", "td2", "box2"), Serve("testdev", "td1", "box1")]


@pytest.fixture
def device(served_devices):
    """device(n) -> attach() arguments for the n-th device of this mode."""
    return lambda n=0: served_devices[n].attach_args()


@pytest.fixture(scope="module")
def shared_vm(tiny_image, served):
    """One tiny guest for the plug tests of this module; each test unplugs what it plugs."""
    from dxpu_vfio.testing.vms import VmFactory
    factory = VmFactory("hotplug")
    vm = factory.booted("tiny", name="hp", edu=True)
    vm.run("echo 8 > /proc/sys/vm/nr_hugepages")
    yield factory
    factory.kill_all()


@pytest.fixture
def vm(request, shared_vm):
    from dxpu_vfio.testing.vms import shared_vm as first_vm
    return first_vm(request, shared_vm)


@pytest.fixture
def plugged(vm, device):
    att = hotplug.attach(vm, **device())
    yield att
    hotplug.detach(att)


def sysfs(vm, bdf: str, name: str) -> str:
    return vm.run(f"cat /sys/bus/pci/devices/{bdf}/{name}").stdout.strip()


def kv(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split())


def test_guest_sees_identity_and_bar_sizes(vm, plugged):
    bdf = plugged.guest_bdf
    assert (sysfs(vm, bdf, "vendor"), sysfs(vm, bdf, "device")) == ("0x1b36", "0x10f0")
    assert sysfs(vm, bdf, "class") == "0xff0000"
    resources = [line.split() for line in sysfs(vm, bdf, "resource").splitlines()]
    start0, end0, _ = (int(x, 16) for x in resources[0])
    start2, end2, flags2 = (int(x, 16) for x in resources[2])
    assert end0 - start0 + 1 == 4096
    assert end2 - start2 + 1 == 4 << 30
    assert flags2 & 0x2000 and flags2 & 0x100000  # IORESOURCE_PREFETCH, IORESOURCE_MEM_64
    info = kv(vm.run(f"dxpu-testdev {bdf} info").stdout)
    assert info == {"id": "0xd0c50001", "version": "0x00010000", "bar0_size": "4096",
                    "bar2_size": str(4 << 30)}


def test_register_round_trips(vm, plugged):
    bdf = plugged.guest_bdf
    assert vm.run(f"dxpu-testdev {bdf} scratch").stdout.startswith("scratch=ok counter_step=1")
    vm.run(f"dxpu-mmio {bdf} 0 write 0x0c 0xcafef00d")
    assert vm.run(f"dxpu-mmio {bdf} 0 read 0x0c").stdout.strip() == "0xcafef00d"
    assert vm.run(f"dxpu-testdev {bdf} bar2 0xfffff000").stdout.startswith("bar2=ok")


@pytest.mark.parametrize("size", [4096, 65536, 1 << 20])
def test_dma_copy_between_guest_buffers(vm, plugged, size):
    result = kv(vm.run(f"dxpu-testdev {plugged.guest_bdf} dma-copy {size}").stdout)
    assert result["match"] == "yes" and result["status"] == "2" and result["bytes"] == str(size)


def test_repeated_dma_copies_are_each_checked_and_timed(vm, plugged):
    """--repeat (what bench_remote measures with) resets and checks every run; the summary orders its times."""
    result = kv(vm.run(f"dxpu-testdev {plugged.guest_bdf} dma-copy 65536 --repeat 3").stdout)
    assert result["match"] == "yes" and result["runs"] == "3" and "run" not in result, result
    assert 0 < int(result["ns"]) <= int(result["median_ns"]) <= int(result["max_ns"]), result
    fill = kv(vm.run(f"dxpu-testdev {plugged.guest_bdf} dma-fill 8192 0x5a --repeat 2").stdout)
    assert fill["match"] == "yes" and fill["runs"] == "2", fill


def test_dma_fill_and_checksum(vm, plugged):
    bdf = plugged.guest_bdf
    assert kv(vm.run(f"dxpu-testdev {bdf} dma-fill 8192 0x3c").stdout)["match"] == "yes"
    csum = kv(vm.run(f"dxpu-testdev {bdf} dma-csum 65536").stdout)
    assert csum["device_crc"] == csum["tool_crc"]


def test_dma_outside_guest_memory_is_refused_and_counted(vm, plugged):
    out = vm.run(f"dxpu-testdev {plugged.guest_bdf} dma-fault").stdout
    assert kv(out) == {"status": "3", "result": "3", "dst_untouched": "yes"}
    assert plugged.server.stats()["server"]["dma"]["refused"] >= 1


def test_intx_interrupts_are_delivered_and_counted_in_guest(vm, plugged):
    bdf = plugged.guest_bdf
    vm.run("grep -q '1b36 10f0' /sys/bus/pci/drivers/uio_pci_generic/new_id 2>/dev/null || "
           "echo '1b36 10f0' > /sys/bus/pci/drivers/uio_pci_generic/new_id 2>/dev/null; "
           f"[ -e /sys/bus/pci/devices/{bdf}/driver ] || echo {bdf} > /sys/bus/pci/drivers/uio_pci_generic/bind")
    result = kv(vm.run(f"dxpu-testdev {bdf} irq 25").stdout)
    assert result["received"] == "25" and result["device_irq_count"] == "25"
    line = next(l for l in vm.run("cat /proc/interrupts").stdout.splitlines() if "uio_pci_generic" in l)
    assert sum(int(x) for x in line.split()[1:3]) >= 25  # counted by the guest kernel, per CPU
    assert plugged.server.stats()["server"]["irqs"]["intx"] >= 25


def _fds(pid: int) -> list[str]:
    return sorted(os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))


def _settled_state(server_pid: int, vm_pid: int, timeout: float = 5.0) -> tuple:
    """The server's fds and thread count and QEMU's fd count, once three reads 0.1 s apart
    agree: the session thread reports its end just before it exits, so a read right after
    the stats say "ended" can still count it (a CI run once counted 6 threads against the baseline 5).
    A leak stays; a thread on its way out does not."""
    def state() -> tuple:
        return (_fds(server_pid), len(os.listdir(f"/proc/{server_pid}/task")), len(_fds(vm_pid)))
    deadline = time.monotonic() + timeout
    reads = [state()]
    while len(reads) < 3 or reads[-1] != reads[-2] or reads[-2] != reads[-3]:
        assert time.monotonic() < deadline, f"server/QEMU fds or threads still changing after {timeout} s: {reads[-3:]}"
        time.sleep(0.1)
        reads.append(state())
    return reads[-1]


def test_unplug_and_replug_20_times_leaks_nothing(vm, device):
    spec = device()
    server = HostProxyProcess(spec["model"], vm.workdir / "replug.sock", name="replug",
                                 settings=spec.get("settings"), netns=spec.get("netns")).start()
    try:
        baseline = None
        for cycle in range(20):
            att = hotplug.attach(vm, server=server, device_id=f"replug{cycle}")
            assert vm.run(f"dxpu-testdev {att.guest_bdf} scratch").rc == 0
            hotplug.detach(att)
            deadline = time.monotonic() + 10
            while server.stats()["server"]["dma"] is not None:  # session torn down
                assert time.monotonic() < deadline, "server session did not end after unplug"
                time.sleep(0.05)
            state = _settled_state(server.pid, vm.pid)
            if cycle == 1:
                baseline = state
            elif cycle > 1:
                assert state == baseline, f"cycle {cycle}: server/QEMU fds or threads changed"
        stats = server.stats()["server"]
        assert stats["sessions"] == 20 and stats["protocol_errors"] == 0
    finally:
        server.stop()
    assert not (vm.workdir / "replug.sock").exists()


def test_two_devices_in_one_vm(vm, device):
    first = hotplug.attach(vm, **device(0))
    second = hotplug.attach(vm, **device(1))  # remote: from the other GPU box
    try:
        assert first.port != second.port and first.guest_bdf != second.guest_bdf
        vm.run(f"dxpu-mmio {first.guest_bdf} 0 write 0x08 0x11111111 && "
               f"dxpu-mmio {second.guest_bdf} 0 write 0x08 0x22222222")
        assert vm.run(f"dxpu-mmio {first.guest_bdf} 0 read 0x08").stdout.strip() == "0x11111111"
        assert vm.run(f"dxpu-mmio {second.guest_bdf} 0 read 0x08").stdout.strip() == "0x22222222"
        for att in (first, second):
            assert kv(vm.run(f"dxpu-testdev {att.guest_bdf} dma-copy 4096").stdout)["match"] == "yes"
    finally:
        hotplug.detach(first)
        hotplug.detach(second)


def test_socket_path_in_use_is_refused(vm):
    squatter = HostProxyProcess("testdev", vm.workdir / "busy.sock").start()
    try:
        with pytest.raises(HostProxyError, match="already listening") as err:
            hotplug.attach(vm, device_id="busy")
        assert "another socket" in str(err.value)
        assert used_root_ports(vm.qmp) == set()  # nothing was plugged
    finally:
        squatter.stop()


def test_guest_that_never_lets_go_times_out_and_stays_consistent(vm, device):
    att = hotplug.attach(vm, **device())
    vm.qmp.execute("stop")  # a guest whose CPUs do not run never acknowledges the eject
    try:
        with pytest.raises(hotplug.UnplugTimeout, match="did not release"):
            hotplug.detach(att, timeout=3)
        assert att.state is hotplug.AttachmentState.UNPLUG_PENDING and att.server.alive()
    finally:
        vm.qmp.execute("cont")
    hotplug.detach(att, timeout=15)  # once the guest runs again the removal completes
    assert att.state is hotplug.AttachmentState.DETACHED and not att.server.alive()
    assert used_root_ports(vm.qmp) == set()


# --- tests with a VM of their own -------------------------------------------------------

def test_system_reset_with_device_attached(vm_factory, device):
    vm = vm_factory.booted("tiny")
    att = hotplug.attach(vm, **device())
    vm.run(f"dxpu-mmio {att.guest_bdf} 0 write 0x08 0x5a5a5a5a")
    vm.reset()
    assert float(vm.run("cat /proc/uptime").stdout.split()[0]) < 30  # it really rebooted
    assert vm.run(f"dxpu-testdev {att.guest_bdf} scratch").rc == 0
    assert kv(vm.run(f"dxpu-testdev {att.guest_bdf} dma-copy 4096").stdout)["match"] == "yes"
    assert att.server.stats()["server"]["commands"]["DEVICE_RESET"]["count"] >= 2
    hotplug.detach(att)


def test_no_free_root_port(vm_factory, device):
    vm = vm_factory.booted("tiny", root_ports=1)
    first = hotplug.attach(vm, **device(0))
    with pytest.raises(hotplug.NoFreeRootPort, match="no free root port") as err:
        hotplug.attach(vm, **device(1))
    assert "detach a device" in str(err.value)
    assert vm.run(f"dxpu-testdev {first.guest_bdf} scratch").rc == 0  # the first is untouched
    hotplug.detach(first)


def test_unreachable_vm(vm_factory, device):
    vm = vm_factory.booted("tiny")
    vm.kill()
    with pytest.raises(VmError, match="not running"):
        hotplug.attach(vm, **device())


def test_msix_unplug_still_aborts_this_qemu(vm_factory):
    """Records the QEMU 11.1 bug of docs/architecture.md ("QEMU"): device_del of a vfio-user device with
    MSI-X aborts QEMU. If this test fails because QEMU survived, the bug is fixed in the
    QEMU in use: MSI-X can then become the default for hot-pluggable devices."""
    vm = vm_factory.booted("tiny")
    att = hotplug.attach(vm, "testdev", settings={"msix": True}, allow_msix=True)
    assert vm.run(f"dxpu-testdev {att.guest_bdf} scratch").rc == 0  # MSI-X devices work ...
    vm.qmp.execute("device_del", {"id": att.device_id})
    deadline = time.monotonic() + 15
    while vm.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    stderr = vm.stderr_log.read_text()
    record = {"qemu": vm.qemu.version_text, "aborted": not vm.alive(),
              "assertion": "subregion->container == mr" in stderr}
    (vm.workdir / "msix-unplug.json").write_text(json.dumps(record))  # kept with the VM's logs if this fails
    att.server.stop()
    assert record == {"qemu": vm.qemu.version_text, "aborted": True, "assertion": True}, \
        f"QEMU {vm.qemu.version_text} no longer aborts on MSI-X unplug: {record}"


# --- the remote proxy fails under a running guest (remote mode only) -------------------

@pytest.mark.parametrize("during", ["read", "dma", "stopped"])
def test_remote_failure_under_a_running_guest(vm_factory, served_lab, during):
    """kill -9 of the box during MMIO reads or during a DMA, or SIGSTOP of it: the guest sees
    all-ones, the VM survives, QEMU does not abort, detach works, re-attach after restart works."""
    vm = vm_factory.booted("tiny")
    vm.run("echo 4 > /proc/sys/vm/nr_hugepages")
    settings = {**served_lab.remote_settings("box2", "td2"), "completion_timeout": 0.5}
    att = hotplug.attach(vm, "remote", settings=settings, netns=served_lab.host_netns)
    bdf = att.guest_bdf
    vm.run(f"dxpu-mmio {bdf} enable")  # memory decode on, or QEMU never forwards the reads
    pid = served_lab.box("box2").proxy_pid
    loop = None
    if during == "read":
        loop = GuestLoop(vm, f"dxpu-mmio {bdf} 0 read 0", "/tmp/reads", tools=("dxpu-mmio",))
        time.sleep(1)
        os.kill(pid, signal.SIGKILL)
    elif during == "dma":
        loop = GuestLoop(vm, f"dxpu-testdev {bdf} dma-copy 1048576", "/tmp/dma", tools=("dxpu-testdev",))
        time.sleep(1)
        os.kill(pid, signal.SIGKILL)
    else:
        os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 15
        while vm.run(f"dxpu-mmio {bdf} 0 read 0").stdout.strip() != "0xffffffff":
            assert time.monotonic() < deadline, "the guest never saw all-ones"
        assert vm.guest_alive() and vm.run("echo alive").stdout == "alive\n"
        if during == "read":
            assert "0xd0c50001" in vm.run("head -n 3 /tmp/reads").stdout  # it was reading before
        stats = att.server.stats()["device"]
        assert stats["link"]["up"] is False and stats["master_aborts"] >= 1
        if loop:  # it would go on driving the device re-plugged at the same address below
            loop.stop()
        hotplug.detach(att)  # unplug still works with the box gone
        assert vm.alive(), f"QEMU died: {vm.stderr_log.read_text()[-500:]}"
    finally:
        if during == "stopped":
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        lab.restart_proxy(served_lab, "box2")
    again = hotplug.attach(vm, "remote", settings=settings, netns=served_lab.host_netns)
    assert kv(vm.run(f"dxpu-testdev {again.guest_bdf} dma-copy 4096").stdout)["match"] == "yes"
    hotplug.detach(again)


def test_guest_uses_an_external_vfio_user_server_in_a_box(vm_factory, labs, tmp_path):
    """A box can serve an external vfio-user server (here our device server as a separate
    process, whose DMA then travels as vfio-user messages and over the link)."""

    external = HostProxyProcess("testdev", tmp_path / "ext.sock", name="ext").start()
    try:
        state = labs.own(lab.Topology("ext", [lab.BoxSpec("boxx", [
            {"id": "ext0", "model": "vfio-user", "settings": {"socket": str(external.socket_path)}}])]))
        vm = vm_factory.booted("tiny")
        vm.run("echo 4 > /proc/sys/vm/nr_hugepages; echo '1b36 10f0' > /sys/bus/pci/drivers/uio_pci_generic/new_id")
        att = hotplug.attach(vm, "remote", settings=state.remote_settings("boxx", "ext0"), netns=state.host_netns)
        bdf = att.guest_bdf
        assert vm.run(f"dxpu-testdev {bdf} scratch").stdout.startswith("scratch=ok")
        assert kv(vm.run(f"dxpu-testdev {bdf} dma-copy 65536").stdout)["match"] == "yes"
        assert kv(vm.run(f"dxpu-testdev {bdf} irq 5").stdout)["received"] == "5"
        assert external.stats()["server"]["dma"]["bytes_written"] == 65536
        # the external server holds QEMU's own windows (no descriptors: its DMA is messages)
        qemu_windows = [m[:3] for m in att.server.stats()["server"]["dma"]["maps"]]
        maps = external.stats()["server"]["dma"]["maps"]
        assert [m[:3] for m in maps] == qemu_windows and not any(m[3] for m in maps)
        hotplug.detach(att)
        eventually(lambda: external.stats()["server"]["dma"]["maps"] == [], what="QEMU's windows unmapped")
    finally:
        external.stop()


def test_an_external_server_that_needs_fd_mapped_memory_is_refused_at_attach(vm_factory, labs, tmp_path):
    """device_add fails, naming why: the box cannot give guest memory by descriptor."""
    external = HostProxyProcess("testdev", tmp_path / "needy.sock", name="needy", dma_needs_fd=True).start()
    try:
        state = labs.own(lab.Topology("needy", [lab.BoxSpec("boxn", [
            {"id": "ext0", "model": "vfio-user", "settings": {"socket": str(external.socket_path)}}])]))
        vm = vm_factory.booted("tiny")
        with pytest.raises(hotplug.HotplugError) as refused:
            hotplug.attach(vm, "remote", settings=state.remote_settings("boxn", "ext0"), netns=state.host_netns)
        assert "needs fd-mapped guest memory" in str(refused.value), str(refused.value)
        assert vm.alive()
        assert external.stats()["server"]["dma"] is None or external.stats()["server"]["dma"]["maps"] == []
    finally:
        external.stop()


def test_device_servers_end_with_their_vm(vm_factory):
    """A test that fails before detach must not leave device servers behind."""
    vm = vm_factory.booted("tiny")
    att = hotplug.attach(vm, "testdev")
    pid = att.server.pid
    vm.kill()
    assert not os.path.exists(f"/proc/{pid}"), "the device server outlived its VM"
    assert not att.socket_path.exists()
