"""The VM runner with real QEMU and the real trixie cloud kernel (tiny image, TCG)."""

import os
import re
import time

import pytest

from dxpu_vfio.errors import GuestBootTimeout, GuestCommandFailed, GuestCommandTimeout, GuestPanic, QemuStartError
from dxpu_vfio.vms.runner import VmState

pytestmark = pytest.mark.vm

EDU = "0000:00:05.0"


def pci_ids(vm) -> dict[str, str]:
    out = vm.run("for d in /sys/bus/pci/devices/*; do echo $(basename $d) $(cat $d/vendor):$(cat $d/device); done").stdout
    return dict(line.split() for line in out.splitlines())


def test_guest_runs_the_image_kernel(tiny_vm, tiny_image):
    assert tiny_vm.run("uname -r").stdout.strip() == tiny_image.kernel_release
    assert tiny_vm.boot_seconds is not None and tiny_vm.boot_seconds < 60


def test_exit_code_stdout_and_stderr_come_back_separately(tiny_vm):
    result = tiny_vm.run("echo out; echo err >&2; exit 7", check=False)
    assert (result.rc, result.stdout, result.stderr) == (7, "out\n", "err\n")
    with pytest.raises(GuestCommandFailed, match="exit 3"):
        tiny_vm.run("exit 3")


def test_binary_safe_output(tiny_vm):
    result = tiny_vm.run("printf 'a\\tb\\r\\nDXPU1 RC 0\\n\\xe2\\x82\\xac'")
    assert result.stdout == "a\tb\r\nDXPU1 RC 0\n\u20ac"


def test_root_ports_and_edu_are_visible(tiny_vm):
    ids = pci_ids(tiny_vm)
    ports = [bdf for bdf, vd in ids.items() if vd == "0x1b36:0x000c"]
    assert len(ports) == 4
    assert ids[EDU] == "0x1234:0x11e8"


def test_root_ports_reserve_large_prefetchable_windows(tiny_vm):
    """Each hot-plug port must have room for a multi-GiB 64-bit prefetchable BAR."""
    iomem = tiny_vm.run("cat /proc/iomem").stdout
    windows = [(int(a, 16), int(b, 16)) for a, b, bus in
               re.findall(r"^\s+([0-9a-f]+)-([0-9a-f]+) : PCI Bus 0000:(0[1-4])$", iomem, re.M)]
    big = [b - a + 1 for a, b in windows if a >= 1 << 32]
    assert len(big) == 4 and all(size >= 16 << 30 for size in big), iomem


def test_guest_ram_is_a_shared_memfd(tiny_vm):
    """vfio-user DMA_MAP carries fds only for fd-backed, shared RAM."""
    memdevs = tiny_vm.qmp.execute("query-memdev")
    assert memdevs[0]["share"] is True
    fds = os.listdir(f"/proc/{tiny_vm.pid}/fd")
    targets = [os.readlink(f"/proc/{tiny_vm.pid}/fd/{fd}") for fd in fds]
    assert any(t.startswith("/memfd:mem") for t in targets), targets


def test_mmio_tool_reads_and_writes_edu_registers(tiny_vm):
    tiny_vm.run(f"dxpu-mmio {EDU} enable")
    assert tiny_vm.run(f"dxpu-mmio {EDU} 0 read 0").stdout.strip() == "0x010000ed"
    tiny_vm.run(f"dxpu-mmio {EDU} 0 write 4 0x12345678")
    # edu's liveness register reads back the bitwise inverse
    assert tiny_vm.run(f"dxpu-mmio {EDU} 0 read 4").stdout.strip() == "0xedcba987"
    timing = dict(kv.split("=") for kv in tiny_vm.run(f"dxpu-mmio {EDU} 0 time-read 0 500").stdout.split())
    assert int(timing["count"]) == 500 and int(timing["median_ns"]) > 0


def test_dmabuf_reports_real_guest_physical_addresses(tiny_vm):
    """The pagemap tool's addresses are where the data really is in guest RAM (read via QMP)."""
    tiny_vm.run("dxpu-dmabuf 8192 --fill 0x5a --hold 30 > /tmp/buf & echo $! > /tmp/buf.pid; "
                "while ! grep -q 'page=1' /tmp/buf; do sleep 0.1; done")
    out = tiny_vm.run("cat /tmp/buf").stdout
    phys = [int(a, 16) for a in re.findall(r"page=\d+ phys=(0x[0-9a-f]+)", out)]
    assert len(phys) == 2
    for addr in phys:
        dump = tiny_vm.qmp.hmp(f"xp /4xw {addr:#x}")
        assert dump.count("0x5a5a5a5a") == 4, dump
    tiny_vm.run("kill -USR1 $(cat /tmp/buf.pid); wait; true")


def test_command_timeout_is_bounded(tiny_vm):
    started = time.monotonic()
    with pytest.raises(GuestCommandTimeout):
        tiny_vm.run("sleep 30", timeout=2)
    assert time.monotonic() - started < 10


def test_guest_panic_is_a_failure_not_a_hang(tiny_vm):
    started = time.monotonic()
    with pytest.raises(GuestPanic, match="panicked") as err:
        tiny_vm.run("echo c > /proc/sysrq-trigger", timeout=60)
    assert time.monotonic() - started < 30
    assert "serial.log" in str(err.value)
    assert not tiny_vm.alive()


def test_shutdown_ends_qemu_by_itself(vm_factory):
    vm = vm_factory.booted("tiny")
    pid = vm.pid
    assert vm.shutdown() is True
    assert vm.state is VmState.STOPPED
    assert not os.path.exists(f"/proc/{pid}")  # ended and reaped


def test_qemu_dying_at_start_names_its_stderr(vm_factory):
    vm = vm_factory.build("tiny", extra_args=["-device", "no-such-device"])
    started = time.monotonic()
    with pytest.raises(QemuStartError, match="no-such-device") as err:
        vm.start()
    assert time.monotonic() - started < 30
    assert "qemu.stderr" in str(err.value)


def test_guest_that_never_reaches_its_shell_times_out(vm_factory, tiny_image):
    # An init that never starts the command agent: the kernel boots, the shell never answers.
    vm = vm_factory.build("tiny", boot_timeout=6,
                          cmdline=tiny_image.cmdline.replace("rdinit=/init", "rdinit=/bin/sh"))
    started = time.monotonic()
    with pytest.raises(GuestBootTimeout, match="did not reach its shell within 6 s") as err:
        vm.boot()
    assert time.monotonic() - started < 16
    assert "serial.log" in str(err.value)


def test_a_hot_plugged_device_with_an_io_bar_gets_port_io(tiny_vm):
    """Root ports reserve a port I/O window (io_reserve, 4K): QEMU's pci-testdev, plugged
    below rp1, gets its I/O BAR assigned and answers port I/O (it used to get no I/O
    space at all: "BAR 1 [io size 0x0100]: can't assign; no space")."""
    tiny_vm.qmp.execute("device_add", {"driver": "pci-testdev", "id": "iotest", "bus": "rp1"})
    dev = "/sys/bus/pci/devices/0000:01:00.0"
    tiny_vm.run(f"i=0; while [ ! -e {dev}/resource1 ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done")
    start, end, flags = (int(x, 16) for x in tiny_vm.run(f"sed -n 2p {dev}/resource").stdout.split())
    assert flags & 0x100 and start and end - start + 1 == 0x100, "BAR 1 got no I/O space"
    # pci-testdev: a port write of a test index selects it; its header (name at +16) reads back by port I/O
    out = tiny_vm.run(f"echo 1 > {dev}/enable; printf '\\000\\000\\000\\000' | dd of={dev}/resource1 bs=4 count=1 "
                      f"2>/dev/null; dd if={dev}/resource1 bs=4 count=8 2>/dev/null | tail -c 16").stdout
    assert out.startswith("portio-"), out
