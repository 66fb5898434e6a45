"""The guest's nvme driver when an I/O's completion is stalled past its timeout: our NVMe
controller in a lab GPU box, hot-plugged into a tiny TCG guest booted with a short
``nvme_core.io_timeout``; the box holds the device's next DMA read (the fetch of the
I/O's submission entry) longer than the driver waits. The driver must abort, reset the
controller, retry, and the application must get its data back intact. What it saw is
written for docs/faults.md (:mod:`dxpu_vfio.lab.fault_results`)."""

import time

import pytest

from dxpu_vfio.lab import fault_results, hotplug
from dxpu_vfio.lab.guest_devices import nvme_disk
from dxpu_vfio.testing.served import Serve, serve_topology

pytestmark = pytest.mark.vm

BOX, DEV = "nfbox", "nv0"
IO_TIMEOUT = 2  # seconds (nvme_core.io_timeout, the guest's kernel command line)
# The block layer fires a timeout up to 1 s late (round_jiffies_up), so the second timeout,
# the one that resets, comes 2-3 timeouts' worth + 2 s after the I/O at most: 6 s here. A
# stall of 3 timeouts raced it (CI once saw the stall end first: abort, no reset). The
# stall must also end within the driver's wait for CSTS.RDY=0 after the reset (CAP.TO,
# 5 s), which stays up while the held fetch is outstanding: 8 s fits both.
STALL_MS = 4 * IO_TIMEOUT * 1000
MiB = 1 << 20


@pytest.fixture(scope="module")
def _factory(tiny_image):
    from dxpu_vfio.testing.vms import VmFactory
    factory = VmFactory("nvme-faults")
    factory.booted("tiny", name="nflt", cmdline=f"{tiny_image.cmdline} nvme_core.io_timeout={IO_TIMEOUT}")
    yield factory
    factory.kill_all()


@pytest.fixture
def vm(request, _factory):
    from dxpu_vfio.testing.vms import shared_vm
    return shared_vm(request, _factory)


@pytest.fixture
def state(labs, lab_factory):
    disks = lab_factory.directory("fault-nvme-disks")
    spec = Serve("nvme", DEV, BOX, {"namespaces": [{"size": 16 * MiB, "path": str(disks / "n1")}]})
    return labs.shared(serve_topology([spec], "nvfaults"))


def test_an_io_stalled_past_the_timeout_is_aborted_reset_retried_and_its_data_intact(vm, state, lab_faults):
    assert vm.run("cat /sys/module/nvme_core/parameters/io_timeout").stdout.strip() == str(IO_TIMEOUT)
    att = hotplug.attach(vm, "remote", settings=state.remote_settings(BOX, DEV), netns=state.host_netns)
    try:
        disk = nvme_disk(vm, att.guest_bdf)
        faults = lab_faults(state, BOX, DEV, attachment=att)
        vm.run("dd if=/dev/urandom of=/tmp/data bs=64k count=4 2>/dev/null; dmesg -c > /dev/null")
        faults.stall("dma-read", ms=STALL_MS, count=1, duration=60)
        started = time.monotonic()
        out = vm.run(f"dd if=/tmp/data of=/dev/{disk} bs=64k count=4 oflag=direct 2>&1 && sync && "
                     f"dd if=/dev/{disk} of=/tmp/back bs=64k count=4 iflag=direct 2>/dev/null && "
                     "md5sum /tmp/data /tmp/back", timeout=120, check=False)
        took = time.monotonic() - started
        dmesg = vm.run("dmesg").stdout
        print(f"stalled write: {took:.1f} s; guest kernel said:\n{dmesg}")
        sums = out.stdout.split()
        intact = out.rc == 0 and sums[-4] == sums[-2]
        said = [line.split("] ", 1)[-1].strip() for line in dmesg.splitlines() if "nvme" in line.lower()]
        fault_results.observe("stall-abort", {
            "device": "nvme", "io_timeout": IO_TIMEOUT, "mode": "remote",
            "fault": f"the completion of one write stalled {STALL_MS / 1000:g} s in the box (its command's "
                     f"fetch held: stall dma-read), past the I/O timeout ({IO_TIMEOUT} s)",
            "driver": "I/O timeout -> Abort of the command -> timeout again -> controller reset -> the command "
                      "requeued and completed" if "abort" in dmesg.lower() and "reset" in dmesg.lower()
                      else " / ".join(said[:4]) or "nothing",
            "application": f"dd rc {out.rc} after {took:.1f} s (write, then read back): data "
                           + ("intact" if intact else "DIFFERS or not read"),
            "recovery_s": round(took, 1), "dmesg": said, "dmesg_of": "nvme lines"})
        assert out.rc == 0, out.stdout + dmesg
        assert sums[-4] == sums[-2], "the data read back differs from the data written"
        assert took >= 2 * IO_TIMEOUT  # it did wait for the driver's timeouts
        assert "timeout" in dmesg and "abort" in dmesg.lower(), dmesg  # the driver's abort path ran
        assert "reset" in dmesg.lower(), dmesg  # and then the controller reset
        assert faults.list()["hits"][DEV]["stall:dma-read"] >= 1
    finally:
        hotplug.detach(att)
