"""Faults on demand seen from a real guest: the test device of a lab's GPU box hot-plugged
into a tiny TCG guest (host proxy in forward mode, mutual TLS over veth), with faults armed
in the box through the ``lab_faults`` fixture. What the guest's tools read is asserted,
and the box's counters; each test writes what it saw for docs/faults.md
(:mod:`dxpu_vfio.lab.fault_results`). The test device has no kernel driver: the guest's
``dxpu-mmio`` and ``dxpu-testdev`` drive it through sysfs."""

import time

import pytest

from dxpu_vfio.errors import DxpuError
from dxpu_vfio.lab import fault_results, hotplug
from dxpu_vfio.lab.hotplug import AttachmentState
from dxpu_vfio.testing.served import Serve, serve_topology

pytestmark = pytest.mark.vm

BOX, DEV = "fbox", "td0"


@pytest.fixture(scope="module")
def _factory(tiny_image):
    from dxpu_vfio.testing.vms import VmFactory
    factory = VmFactory("faults")
    vm = factory.booted("tiny", name="flt")
    vm.run("echo 8 > /proc/sys/vm/nr_hugepages")
    yield factory
    factory.kill_all()


@pytest.fixture
def vm(request, _factory):
    from dxpu_vfio.testing.vms import shared_vm
    return shared_vm(request, _factory)


@pytest.fixture
def state(labs):
    return labs.shared(serve_topology([Serve("testdev", DEV, BOX)], "faults"))


def attach(vm, state):
    att = hotplug.attach(vm, "remote", settings=state.remote_settings(BOX, DEV), netns=state.host_netns)
    vm.run(f"dxpu-mmio {att.guest_bdf} enable")  # Memory Space and Bus Master on
    return att


@pytest.fixture
def plugged(vm, state):
    att = attach(vm, state)
    yield att
    hotplug.detach(att)


@pytest.fixture
def faults(lab_faults, state, plugged):
    faults = lab_faults(state, BOX, DEV, attachment=plugged)
    hits(faults)  # the counters before the test
    return faults


def mmio(vm, att, *args: str) -> str:
    return vm.run(f"dxpu-mmio {att.guest_bdf} {' '.join(args)}").stdout.strip()


def kv(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split())


def hits(faults) -> dict:
    """Hits per fault kind on the device since the fault client was made (the lab is shared)."""
    now = faults.list()["hits"].get(DEV, {})
    before = getattr(faults, "_hits_before", None)
    if before is None:
        faults._hits_before = before = now
        return {}
    return {k: v - before.get(k, 0) for k, v in now.items() if v - before.get(k, 0)}


def observe(name: str, fault: str, driver: str, application: str, recovery_s: float | None = 0, **facts) -> None:
    fault_results.observe(f"testdev-{name}", {"device": "testdev", "mode": "remote", "fault": fault,
                                              "driver": driver, "application": application,
                                              "recovery_s": recovery_s, "facts": facts})


def test_mmio_read_under_a_completer_abort_reads_all_ones_in_the_guest(vm, plugged, faults):
    assert mmio(vm, plugged, "0", "read", "0x00") == "0xd0c50001"
    faults.abort("mmio-read", count=1)
    assert mmio(vm, plugged, "0", "read", "0x00") == "0xffffffff"
    assert mmio(vm, plugged, "0", "read", "0x00") == "0xd0c50001"  # one read only; the link is up
    assert hits(faults) == {"abort:mmio-read": 1}
    assert plugged.server.stats()["device"]["error_completions"] == 1  # and the host proxy saw it
    observe("abort", "completer abort on one MMIO read", "QEMU got an error completion from the host proxy "
            "and gave the guest all-ones", "dxpu-mmio read 0xffffffff once, then the real value; the link stays up")


def test_config_read_under_a_completer_abort_reads_all_ones_in_the_guest(vm, plugged, faults):
    assert mmio(vm, plugged, "cfg-read", "0x00") == "0x10f01b36"
    faults.abort("config-read", count=1)
    assert mmio(vm, plugged, "cfg-read", "0x00") == "0xffffffff"
    assert mmio(vm, plugged, "cfg-read", "0x00") == "0x10f01b36"
    observe("abort-config", "completer abort on one config-space read", "all-ones to the guest",
            "config dword 0 read 0xffffffff once (as an absent device), then 0x10f01b36")


def test_a_stalled_mmio_read_completes_after_the_stall_with_its_value(vm, plugged, faults):
    faults.stall("mmio-read", ms=300, count=2)
    timed = kv(mmio(vm, plugged, "0", "time-read", "0x00", "2"))
    assert int(timed["min_ns"]) >= 290_000_000, timed  # each read waited for its completion
    assert mmio(vm, plugged, "0", "read", "0x00") == "0xd0c50001"
    assert vm.run(f"dxpu-testdev {plugged.guest_bdf} scratch").stdout.startswith("scratch=ok")
    assert hits(faults)["stall:mmio-read"] == 2
    observe("stall", "2 MMIO reads stalled 300 ms each (under the 1 s completion timeout)",
            "the vCPU waited for each completion", f"each read took at least {int(timed['min_ns']) / 1e6:.0f} ms "
            "and returned its value; nothing else went wrong", read_min_ms=round(int(timed["min_ns"]) / 1e6, 1))


def test_dropped_posted_writes_are_not_seen_by_the_device(vm, plugged, faults):
    mmio(vm, plugged, "0", "write", "0x08", "0x11111111")
    assert mmio(vm, plugged, "0", "read", "0x08") == "0x11111111"  # landed before the fault is armed
    faults.drop_posted(duration=30)
    mmio(vm, plugged, "0", "write", "0x08", "0x22222222")
    assert mmio(vm, plugged, "0", "read", "0x08") == "0x11111111"
    faults.clear()
    mmio(vm, plugged, "0", "write", "0x08", "0x33333333")
    assert mmio(vm, plugged, "0", "read", "0x08") == "0x33333333"
    assert hits(faults)["drop-posted"] >= 1
    observe("drop-posted", "posted writes dropped (until cleared)", "nothing: a posted write has no completion",
            "a register write vanished (read back the old value); after the clear writes land again")


def test_a_refused_dma_sets_the_test_device_error_status(vm, plugged, faults):
    faults.refuse_dma("dma-read", count=1)
    failed = kv(vm.run(f"dxpu-testdev {plugged.guest_bdf} dma-copy 4096", check=False).stdout)
    assert (failed["status"], failed["result"]) == ("3", "3")  # error: DMA fault
    assert kv(vm.run(f"dxpu-testdev {plugged.guest_bdf} dma-copy 4096").stdout)["match"] == "yes"
    assert hits(faults) == {"refuse-dma:dma-read": 1}
    observe("refuse-dma", "one DMA read by the device refused (unsupported request)",
            "the device set its error status (3: DMA fault)",
            "dxpu-testdev dma-copy failed with status 3; the next copy matched")


def test_surprise_removal_reads_all_ones_then_device_del_and_reattach(vm, state, plugged, faults):
    bdf = plugged.guest_bdf
    faults.remove(grace=None, duration=60)  # the box withdraws the device; no device_del yet
    assert mmio(vm, plugged, "0", "read", "0x00") == "0xffffffff"  # the host proxy's master abort
    with pytest.raises(DxpuError) as refused:
        attach(vm, state)  # the box refuses the device while it is removed, and says why
    assert "surprise removal" in "".join(p.read_text() for p in refused.value.logs if p.exists())
    faults.clear()
    cleared = time.monotonic()
    hotplug.detach(plugged)  # the control plane follows
    assert vm.run(f"test -e /sys/bus/pci/devices/{bdf}", check=False).rc != 0
    again = attach(vm, state)  # back in the box: a re-attach brings it back
    faults.attachment = again
    assert mmio(vm, again, "0", "read", "0x00") == "0xd0c50001"
    recovery = round(time.monotonic() - cleared, 1)
    faults.remove(grace=0.5, duration=60)  # now with the control plane's device_del after 0.5 s
    assert again.state is AttachmentState.DETACHED
    assert vm.run(f"test -e /sys/bus/pci/devices/{again.guest_bdf}", check=False).rc != 0
    assert [e["event"] for e in faults.history if e["event"] == "device_del"] == ["device_del"]
    observe("surprise-removal", "surprise removal (then device_del)", "reads all-ones (the host proxy's master "
            "abort); device_del after the grace takes the PCI device away",
            "dxpu-mmio read 0xffffffff; a re-attach is refused (ENXIO, 'surprise removal') while removed; "
            "after the fault a re-attach reads the device again", recovery)


def test_a_cut_link_reads_all_ones_the_vm_stays_up_and_a_reattach_recovers(vm, state, plugged, faults):
    mmio(vm, plugged, "0", "write", "0x08", "0x5a5a5a5a")
    faults.cut()
    assert mmio(vm, plugged, "0", "read", "0x00") == "0xffffffff"
    assert plugged.server.stats()["device"]["master_aborts"] >= 1
    started = time.monotonic()
    hotplug.detach(plugged)
    again = attach(vm, state)
    try:
        assert mmio(vm, again, "0", "read", "0x00") == "0xd0c50001"
        assert mmio(vm, again, "0", "read", "0x08") == "0x00000000"  # a new lease: the device was reset
        recovery = round(time.monotonic() - started, 1)
    finally:
        hotplug.detach(again)
    assert hits(faults)["cut"] == 1
    observe("link-cut", "link cut", "every read all-ones (master abort); the VM up",
            "dxpu-mmio read 0xffffffff; after a re-attach the device answers, reset (its registers zero)", recovery)


def test_a_frozen_box_past_the_completion_timeout_reads_all_ones_and_thaws_on_time(vm, state, plugged, faults):
    faults.freeze(seconds=3)
    assert mmio(vm, plugged, "0", "read", "0x00") == "0xffffffff"  # no completion within 1 s
    assert faults.wait_thawed() >= 2.9
    started = time.monotonic()
    hotplug.detach(plugged)  # the link is down for good: recovery is a re-attach
    again = attach(vm, state)
    try:
        assert mmio(vm, again, "0", "read", "0x00") == "0xd0c50001"
        recovery = round(time.monotonic() - started, 1)
    finally:
        hotplug.detach(again)
    assert hits(faults)["freeze"] == 1
    observe("freeze", "box frozen 3 s (SIGSTOP), past the 1 s completion timeout",
            "a read past the completion timeout: all-ones, the host proxy's link down for good",
            "dxpu-mmio read 0xffffffff (no completion within 1 s); after the thaw a re-attach reads the device again", recovery)
