"""What Linux's nvme driver and the guest's user see when the fabric misbehaves (issue 17
items 3 to 5): a controller reset from the guest during a checksummed write and read-back
(local and from a box), 1 % random and 0.1 % bursty loss on the host<->box link, a
link cut beyond the driver's I/O timeout followed by a re-attach, and a surprise removal
during writes followed by device_del and a re-attach.

Each test writes what it observed to ``results/faults/<name>.json``;
``scripts/fault_table.py`` renders those into docs/faults.md. One tiny guest serves the
module, booted with a low ``nvme_core.io_timeout`` so that a cut link reaches the
driver's timeout path within seconds."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest

from dxpu_vfio.lab import fault_results, hotplug, lab
from dxpu_vfio.lab.guest_devices import nvme_disk
from dxpu_vfio.lab.impairment import Impairment
from dxpu_vfio.remoteproxy.ports import DMA_TIMEOUT
from dxpu_vfio.testing.served import Serve
from dxpu_vfio.testing.vms import VmFactory, shared_vm

pytestmark = pytest.mark.vm
MiB = 1 << 20
IO_TIMEOUT = 5  # s, nvme_core.io_timeout on the guest's command line (default 30)


def observe(name: str, record: dict) -> Path:
    """Write one test's observations where scripts/fault_table.py reads them."""
    return fault_results.observe(name, {"device": "nvme", "io_timeout": IO_TIMEOUT, **record})


@pytest.fixture(scope="module")
def _faults_factory(tiny_image):
    factory = VmFactory("faults")
    yield factory
    factory.kill_all()


@pytest.fixture
def vm(request, _faults_factory, tiny_image):
    """The module's tiny guest, its nvme driver timing out I/O after IO_TIMEOUT s."""
    if not _faults_factory.vms:
        _faults_factory.booted("tiny", name="faults", cmdline=f"{tiny_image.cmdline} nvme_core.io_timeout={IO_TIMEOUT}")
    return shared_vm(request, _faults_factory)


@pytest.fixture(scope="module")
def local_disks(tmp_path_factory):
    return tmp_path_factory.mktemp("fault-disks")


@pytest.fixture(scope="module")
def served_specs(lab_factory, local_disks):
    disks = lab_factory.directory("nvme-fault-disks")
    ns = lambda where, name: {"namespaces": [{"size": 64 * MiB, "path": str(where / name)}], "io_workers": 4}  # noqa: E731
    return [Serve("nvme", "nv0", "box1", ns(disks, "f1n1"), local=ns(local_disks, "l1n1"))]


def controller(vm, bdf: str) -> str:
    return vm.run(f"ls /sys/bus/pci/devices/{bdf}/nvme").stdout.split()[0]


def dmesg_nvme(vm) -> list[str]:
    """The guest kernel's nvme lines since the last clear (timestamps cut), and clear."""
    lines = vm.run("dmesg -c 2>/dev/null | grep -i nvme || true").stdout.splitlines()
    return [line.split("] ", 1)[-1].strip() for line in lines if line.strip()]


def device_stats(att) -> dict:
    try:
        return att.server.stats().get("device") or {}
    except Exception:  # noqa: BLE001 - a host proxy that cannot answer has no counters to give
        return {}


def model_stats(att, served_device) -> dict:
    """The NVMe model's own counters: in the host proxy (local) or in the box's proxy."""
    if not served_device.remote:
        return device_stats(att)
    return (served_device.box_stats().get("devices", {}).get(served_device.device) or {}).get("device") or {}


# --- controller reset from the guest during I/O ------------------------------------------------

RESET_CHUNKS = 384  # 48 MiB in 128 KiB direct I/O


def io_with_reset(vm, ns: str, ctrl: str, write: bool) -> dict:
    """A 48 MiB direct dd (write from /tmp/data, or read into /tmp/back) with
    ``reset_controller`` written once the I/O is under way: times from the guest's clock,
    I/Os done before the reset and in all, dd's exit status and message."""
    field = 5 if write else 1  # /sys/block/X/stat: write I/Os, read I/Os
    dd = (f"dd if=/tmp/data of=/dev/{ns} bs=128k oflag=direct" if write
          else f"dd if=/dev/{ns} of=/tmp/back bs=128k count={RESET_CHUNKS} iflag=direct")
    out = vm.run(f"""
ios() {{ set -- $(cat /sys/block/{ns}/stat); eval echo \\${field}; }}
start=$(ios)
{dd} 2>/tmp/dd.err & pid=$!
i=0; while [ $(ios) -lt $((start + 8)) ] && [ $i -lt 20000 ]; do i=$((i+1)); done
at=$(($(ios) - start)); kill -0 $pid 2>/dev/null && running=1 || running=0
t0=$(cut -d' ' -f1 /proc/uptime)
echo 1 > /sys/class/nvme/{ctrl}/reset_controller; reset_rc=$?
t1=$(cut -d' ' -f1 /proc/uptime)
state=$(cat /sys/class/nvme/{ctrl}/state)
wait $pid; rc=$?
t2=$(cut -d' ' -f1 /proc/uptime)
echo "$reset_rc $running $at $(($(ios) - start)) $t0 $t1 $t2 $state $rc"
tr '\\n' ' ' < /tmp/dd.err
""", timeout=300).stdout.splitlines()
    reset_rc, running, at, total, t0, t1, t2, state, rc = out[0].split()
    return {"reset_rc": int(reset_rc), "io_running_at_reset": running == "1", "ios_before_reset": int(at),
            "ios_total": int(total), "reset_s": round(float(t1) - float(t0), 2),
            "io_after_reset_s": round(float(t2) - float(t1), 2), "state_after": state, "dd_rc": int(rc),
            "dd_said": (out[1] if len(out) > 1 else "").strip()}


def test_controller_reset_during_checksummed_io_keeps_the_data(vm, served_device, served):
    """``echo 1 > /sys/class/nvme/nvmeX/reset_controller`` once during a 48 MiB write and
    once during its read-back: the driver disables the controller with commands in
    flight, enables it again and requeues them; dd finishes without an error and the
    data read back is the data written."""
    att = hotplug.attach(vm, **served_device.attach_args())
    try:
        ns, ctrl = nvme_disk(vm, att.guest_bdf, 1), controller(vm, att.guest_bdf)
        vm.run(f"dd if=/dev/urandom of=/tmp/data bs=128k count={RESET_CHUNKS} 2>/dev/null; rm -f /tmp/back", timeout=120)
        dmesg_nvme(vm)
        before = model_stats(att, served_device)
        write = io_with_reset(vm, ns, ctrl, write=True)
        vm.run("sync; echo 3 > /proc/sys/vm/drop_caches")
        read = io_with_reset(vm, ns, ctrl, write=False)
        sums = vm.run("md5sum /tmp/data /tmp/back").stdout.split()
        after = model_stats(att, served_device)
        log = dmesg_nvme(vm)
        intact = sums[0] == sums[2]
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("enables", "disables", "aborted", "admin_refused")
                 if k in after}
        observe(f"reset-{served}", {
            "fault": "controller reset from the guest (reset_controller) during a 48 MiB write and its read-back",
            "mode": served, "write": write, "read": read, "data_intact": intact, "model": delta, "dmesg": log,
            "admin_refused_at_probe": before.get("admin_refused"),
            "driver": (f"reset the controller with I/O in flight: the model saw {delta.get('disables', '?')} "
                       f"disables and {delta.get('enables', '?')} enables (CC.EN 1->0->1), "
                       f"{delta.get('admin_refused', '?')} admin commands refused; the kernel said only "
                       + " / ".join(sorted(set(log)) or ["nothing"])),
            "application": ("no error; data read back intact" if intact and not write["dd_rc"] + read["dd_rc"]
                            else f"dd rc {write['dd_rc']}/{read['dd_rc']}, data intact: {intact}"),
            "recovery_s": max(write["reset_s"], read["reset_s"])})
        for phase in (write, read):
            assert phase["reset_rc"] == 0 and phase["state_after"] == "live", phase
            assert phase["io_running_at_reset"] and phase["ios_before_reset"] < phase["ios_total"], \
                f"the reset did not land during the I/O: {phase}"
            assert phase["dd_rc"] == 0, f"the application saw an error: {phase}"
        assert intact, "the data read back differs from the data written"
        if delta:  # the model's own counters
            assert delta["disables"] == 2 and delta["enables"] == 2, delta
            assert delta["admin_refused"] == 0, f"the driver's recovery asked for something not served: {delta}"
            assert before["admin_refused"] == 0, f"the driver's probe asked for something not served: {before}"
    finally:
        hotplug.detach(att)


# --- loss on the host<->box link ----------------------------------------------------------------

LOSS_CHUNKS = 128  # 8 MiB in 64 KiB direct I/O, one dd each (timed)
# Under loss the link may go down only after the network was dark this long: half the
# shortest timer that takes it down (the box's 2 s wait for a DMA read's answer; TCP's
# backoff after the blackout takes the rest). At 40 times the burst rate, 4 runs in 30 lost
# the link, after blackouts of 1.6-6.7 s; the others kept it through blackouts of up to 2.1 s.
DARK_FOR_DOWN_MS = DMA_TIMEOUT * 1000 / 2
LOSSES = {
    "clean": Impairment(),
    "random 1%": Impairment(loss=0.01),
    "bursty 0.1%": Impairment(ge_p=0.00025, ge_r=0.25),  # Gilbert-Elliott: mean loss 0.1 %, bursts of 4
}


def timed_chunks(vm, ns: str, offset: int) -> dict:
    """Write /tmp/ldata chunk by chunk at ``offset`` (64 KiB units), drop caches, read it back
    chunk by chunk: each dd's time (``ts -i``: since the line before), errors, checksum; where
    the data differs, which chunks differ and which ones a dd failed on. A dd that did not
    move its whole chunk is an error too: a disk the driver gave up on reads as empty, and
    dd calls an empty read a success."""
    loop = ("i=0; while [ $i -lt {n} ]; do out=$({dd} 2>&1) && case \"$out\" in *'1+0 records out'*) ;; *) false;; esac "
            "|| echo err; echo x; i=$((i+1)); done | ts -i '%.s' > {out}")
    write = f"dd if=/tmp/ldata of=/dev/{ns} bs=64k count=1 skip=$i seek=$(({offset} + i)) oflag=direct"
    read = f"dd if=/dev/{ns} of=/tmp/lback bs=64k count=1 skip=$(({offset} + i)) seek=$i conv=notrunc iflag=direct"
    out = vm.run(f"rm -f /tmp/lback; {loop.format(n=LOSS_CHUNKS, dd=write, out='/tmp/wlat')}; sync; "
                 f"echo 3 > /proc/sys/vm/drop_caches; {loop.format(n=LOSS_CHUNKS, dd=read, out='/tmp/rlat')}; "
                 "md5sum /tmp/ldata /tmp/lback; echo; cat /tmp/wlat; echo; cat /tmp/rlat", timeout=900).stdout
    sums, wlat, rlat = out.split("\n\n")[:3]
    lat = {}
    failed: set[int] = set()
    errors = 0
    for name, text in (("write", wlat), ("read", rlat)):
        lines = [line.split() for line in text.splitlines() if line.strip()]
        chunk = 0
        for line in lines:  # "err" (if the dd failed), then "x", for each chunk
            if line[-1] == "err":
                errors += 1
                failed.add(chunk)
            else:
                chunk += 1
        ms = sorted(float(line[0]) * 1000 for line in lines if line[-1] == "x")
        lat[name] = {"n": len(ms), "p50_ms": round(statistics.median(ms), 2),
                     "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 2), "max_ms": round(ms[-1], 2)}
    words = sums.split()
    run = {"latency": lat, "errors": errors, "data_intact": words[0] == words[2], "failed_chunks": sorted(failed)}
    if not run["data_intact"]:
        sums = vm.run(f"i=0; while [ $i -lt {LOSS_CHUNKS} ]; do for f in /tmp/ldata /tmp/lback; do "
                      "dd if=$f bs=64k skip=$i count=1 2>/dev/null | md5sum; done; i=$((i+1)); done", timeout=300).stdout
        pairs = [line.split()[0] for line in sums.splitlines() if line.strip()]
        run["differing_chunks"] = [i for i in range(LOSS_CHUNKS) if pairs[2 * i] != pairs[2 * i + 1]]
    return run


def test_random_and_bursty_loss_on_the_link_keep_the_data(vm, served_lab):
    """The same checksummed run on a clean link, with 1 % random loss and with 0.1 %
    bursty (Gilbert-Elliott) loss both ways: TCP on the link retransmits, the data is
    intact, the link stays up; the latencies the guest saw are printed."""
    box = "box1"
    att = hotplug.attach(vm, "remote", settings=served_lab.remote_settings(box, "nv0"), netns=served_lab.host_netns)
    runs = {}
    try:
        ns = nvme_disk(vm, att.guest_bdf, 1)
        vm.run(f"dd if=/dev/urandom of=/tmp/ldata bs=64k count={LOSS_CHUNKS} 2>/dev/null")
        dmesg_nvme(vm)
        for i, (name, imp) in enumerate(LOSSES.items()):
            lab.set_link(served_lab, box, imp)
            lab.reset_link_counters(served_lab, box)
            run = timed_chunks(vm, ns, offset=i * LOSS_CHUNKS)
            report = lab.link_report(served_lab, box) or {}
            run["achieved_loss"] = {d: (report.get(d) or {}).get("loss_rate") for d in ("up", "down")}
            run["packets"] = {d: (report.get(d) or {}).get("packets") for d in ("up", "down")}
            run["asked_as_set"] = all((report.get(d) or {}).get("asked") == imp.to_dict() for d in ("up", "down"))
            run["blackout_ms"] = {d: (report.get(d) or {}).get("blackout_ms") for d in ("up", "down")}
            link = device_stats(att).get("link") or {}
            run["link_up"], run["down_reason"] = link.get("up"), link.get("down_reason")
            runs[name] = run
            print(f"\n{name}: write p50 {run['latency']['write']['p50_ms']} ms p99 {run['latency']['write']['p99_ms']} ms, "
                  f"read p50 {run['latency']['read']['p50_ms']} ms p99 {run['latency']['read']['p99_ms']} ms, "
                  f"achieved loss {run['achieved_loss']}, longest blackout {run['blackout_ms']} ms, "
                  f"intact {run['data_intact']}, link up {run['link_up']}")
        log = dmesg_nvme(vm)
        observe("loss", {
            "fault": "1 % random and 0.1 % bursty (Gilbert-Elliott, bursts of 4) loss both ways on the host<->box link",
            "mode": "remote", "runs": runs, "dmesg": log,
            "driver": "nothing: no timeout, no reset" if not log else "; ".join(log[:3]),
            "application": ("no error, data intact" if all(r["data_intact"] and not r["errors"] for r in runs.values())
                            else "ERRORS or data differs") + "".join(
                f"; {n}: the link went down after a {max(r['blackout_ms'].values()) / 1000:.1f} s blackout "
                f"({r['down_reason']}), {r['errors']} dd failed"
                for n, r in runs.items() if r["link_up"] is False and r["blackout_ms"]["up"] is not None)
                + "; p99 of a 64 KiB read/write: " + ", ".join(
                f"{n} {r['latency']['read']['p99_ms']:.0f}/{r['latency']['write']['p99_ms']:.0f} ms"
                for n, r in runs.items()),
            "recovery_s": 0})
        for name, run in runs.items():
            if name == "bursty 0.1%" and run["link_up"] is False:
                # A burst in the Gilbert-Elliott model lasts some packets, not some time: when
                # it takes TCP's retransmissions too, each one waits twice as long as the one
                # before, and a burst of a dozen packets can leave a direction dark for seconds
                # (a few runs in a thousand at this rate). Then the link's timers (a DMA read's 2 s,
                # nothing heard for 3 s: docs/link-protocol.md) rightly take it down; what must
                # hold is that the network really was dark that long, and that the guest was
                # told: every chunk that differs is one a dd failed on, never a silent corruption.
                assert max(run["blackout_ms"].values()) >= DARK_FOR_DOWN_MS, \
                    f"{name}: the link went down ({run['down_reason']}) with no long blackout: {run}"
                assert run["errors"] and set(run.get("differing_chunks", ())) <= set(run["failed_chunks"]), \
                    f"{name}: data differs where no dd failed: {run}"
                continue
            assert run["errors"] == 0 and run["data_intact"], f"{name}: {run}"
            assert run["link_up"] is not False, f"{name}: the host proxy marked the link down ({run['down_reason']})"
        for name in ("random 1%", "bursty 0.1%"):  # the emulator was asked and did it
            assert runs[name]["asked_as_set"], f"{name}: the emulator was not running with it: {runs[name]}"
        assert all(0.004 < runs["random 1%"]["achieved_loss"][d] < 0.03 for d in ("up", "down")), runs["random 1%"]
    finally:
        lab.set_link(served_lab, box, Impairment())
        hotplug.detach(att)


# --- a cut link beyond the driver's timeout, then a re-attach --------------------------------------

def test_link_cut_removes_the_controller_vm_stays_up_reattach_brings_the_data_back(vm, served_lab):
    """100 % loss both ways while a writer runs: the host proxy's heartbeats declare the
    link down (reads answer all-ones from then on), the driver's I/O timeout reads
    CSTS = all-ones, resets, fails to enable and removes the controller; the writer
    gets I/O errors; the VM answers throughout. The link healed, the device is
    unplugged and attached again (a new host proxy, a new link): the data flushed before
    the cut reads back intact."""
    box = "box1"
    settings = served_lab.remote_settings(box, "nv0")
    att = hotplug.attach(vm, "remote", settings=settings, netns=served_lab.host_netns)
    record: dict = {"fault": f"link cut (100 % loss both ways) for longer than the I/O timeout ({IO_TIMEOUT} s)",
                    "mode": "remote"}
    cut = observed = False
    try:
        bdf = att.guest_bdf
        ns, ctrl = nvme_disk(vm, bdf, 1), controller(vm, bdf)
        vm.run(f"dd if=/dev/urandom of=/tmp/keep bs=128k count=32 2>/dev/null; "
               f"dd if=/tmp/keep of=/dev/{ns} bs=128k oflag=direct 2>/dev/null; sync")  # flushed before the cut
        dmesg_nvme(vm)
        vm.run(f"(rc=0; i=0; while [ $i -lt 100000 ]; do dd if=/dev/zero of=/dev/{ns} bs=128k count=8 seek=64 "
               f"oflag=direct 2>/tmp/cut.err || {{ rc=$?; break; }}; i=$((i+1)); done; "
               "echo \"$rc $i $(cut -d' ' -f1 /proc/uptime)\" > /tmp/cut.rc) > /dev/null 2>&1 &")
        time.sleep(1)
        t_cut = float(vm.run("cut -d' ' -f1 /proc/uptime").stdout)
        lab.set_link(served_lab, box, Impairment(loss=1.0))
        cut = True
        started = time.monotonic()
        state = f"/sys/class/nvme/{ctrl}/state"  # 6.12 marks a controller it cannot enable dead (older: removed)
        gone = vm.run(f"i=0; while [ \"$(cat {state} 2>/dev/null || echo removed)\" != dead ] && [ -e {state} ] "
                      f"&& [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done; "
                      f"echo $(cut -d' ' -f1 /proc/uptime) $(cat {state} 2>/dev/null || echo removed) "
                      f"$([ -e /sys/block/{ns} ] && echo disk-present || echo disk-gone)", timeout=120).stdout.split()
        t_removed, ctrl_state, disk = float(gone[0]), gone[1], gone[2]
        removed = ctrl_state in ("dead", "removed")
        config = vm.run(f"hexdump -n 4 -e '1/4 \"%08x\"' /sys/bus/pci/devices/{bdf}/config 2>&1 || true").stdout.strip()
        ended = vm.run("i=0; while [ ! -e /tmp/cut.rc ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done; "
                       "cat /tmp/cut.rc 2>/dev/null; tr '\\n' ' ' < /tmp/cut.err", timeout=60, check=False).stdout.split("\n")
        rc_line = ended[0].split()
        driver = vm.run(f"basename $(readlink /sys/bus/pci/devices/{bdf}/driver 2>/dev/null) 2>/dev/null || echo none"
                        ).stdout.strip() or "none"
        alive = vm.guest_alive() and vm.run("echo alive").stdout == "alive\n"
        link = device_stats(att).get("link") or {}
        log = dmesg_nvme(vm)
        record.update({
            "controller_state": ctrl_state, "disk_after": disk, "dead_after_s": round(t_removed - t_cut, 1),
            "pci_driver_after": driver, "config_dword0_read_after": config, "writer_rc": int(rc_line[0]) if rc_line else None,
            "writer_ios_before_error": int(rc_line[1]) if len(rc_line) > 1 else None,
            "writer_error_after_s": round(float(rc_line[2]) - t_cut, 1) if len(rc_line) > 2 else None,
            "writer_said": ended[1].strip() if len(ended) > 1 else "", "vm_alive": alive,
            "host_proxy_link": {k: link.get(k) for k in ("up", "down_reason") if k in link}, "dmesg": log})
        # heal, unplug the dead device, attach it again
        lab.set_link(served_lab, box, Impairment())
        cut = False
        healed = time.monotonic()
        hotplug.detach(att, timeout=30)
        att = None
        for attempt in range(10):  # the box may still hold the old link until its heartbeats give up
            try:
                att = hotplug.attach(vm, "remote", settings=settings, netns=served_lab.host_netns)
                break
            except hotplug.HotplugError as exc:
                record.setdefault("reattach_refusals", []).append(str(exc)[:200])
                time.sleep(1)
        assert att is not None, f"re-attach failed: {record.get('reattach_refusals')}"
        ns = nvme_disk(vm, att.guest_bdf, 1)
        sums = vm.run(f"dd if=/dev/{ns} of=/tmp/again bs=128k count=32 iflag=direct 2>/dev/null; "
                      "md5sum /tmp/keep /tmp/again").stdout.split()
        record.update({"reattach_s": round(time.monotonic() - healed, 1), "data_back_intact": sums[0] == sums[2],
                       "detected_s": round(time.monotonic() - started, 1)})
        record.update({
            "driver": (f"I/O timeout ({IO_TIMEOUT} s) -> CSTS reads all-ones -> reset -> enable fails (-19) -> "
                       f"controller {ctrl_state} after {record['dead_after_s']} s, its disk's I/O fails "
                       f"(the disk node stays: {disk}; PCI driver still {driver})"),
            "application": (f"I/O error (dd rc {record['writer_rc']}, {record['writer_said'][:60]!r}) "
                            f"after {record['writer_error_after_s']} s; VM up: {alive}; "
                            f"after re-attach the data flushed before the cut is "
                            f"{'intact' if record['data_back_intact'] else 'NOT intact'}"),
            "recovery_s": record["reattach_s"]})
        observe("link-cut", record)
        observed = True
        assert removed, f"the driver did not give up on the controller within 60 s: {record}"
        assert any("CSTS=0xffffffff" in line for line in log), f"the driver did not read all-ones: {log}"
        assert record["writer_rc"] not in (None, 0), f"the writer saw no error: {record}"
        assert alive, "the VM stopped answering"
        assert record["data_back_intact"], "the data flushed before the cut did not come back"
    finally:
        if cut:
            lab.set_link(served_lab, box, Impairment())
        if not observed and len(record) > 2:
            observe("link-cut", record)  # what was seen before something failed
        if att is not None:
            hotplug.detach(att, timeout=30)


# --- surprise removal during I/O, then device_del and a re-attach ----------------------------------

REMOVAL_GRACE = 1.0  # s between the box withdrawing the device and the control plane's device_del


def test_surprise_removal_during_io_fails_the_io_vm_stays_up_reattach_brings_the_disk_back(
        vm, served_lab, lab_faults):
    """The box withdraws the disk while a writer runs, and the control plane's
    ``device_del`` follows after REMOVAL_GRACE s: the writer's I/O, stuck since the link
    went down, fails with an error (not a hang), the guest lets go of the device and the
    VM answers; the box no longer lists the device. The fault over, a re-attach brings
    the disk back with the data flushed before the removal."""
    box = "box1"
    settings = served_lab.remote_settings(box, "nv0")
    att = hotplug.attach(vm, "remote", settings=settings, netns=served_lab.host_netns)
    faults = lab_faults(served_lab, box, "nv0", attachment=att)
    record: dict = {"fault": f"surprise removal during writes (the box withdraws the device; device_del "
                             f"{REMOVAL_GRACE:g} s later)", "mode": "remote"}
    observed = False
    try:
        bdf = att.guest_bdf
        ns = nvme_disk(vm, bdf, 1)
        vm.run(f"dd if=/dev/urandom of=/tmp/rkeep bs=128k count=32 2>/dev/null; "
               f"dd if=/tmp/rkeep of=/dev/{ns} bs=128k oflag=direct 2>/dev/null; sync")  # flushed before
        dmesg_nvme(vm)
        vm.run(f"rm -f /tmp/rm.rc; (rc=0; i=0; while [ $i -lt 100000 ]; do dd if=/dev/zero of=/dev/{ns} bs=128k "
               f"count=8 seek=64 oflag=direct 2>/tmp/rm.err || {{ rc=$?; break; }}; i=$((i+1)); done; "
               "echo \"$rc $i $(cut -d' ' -f1 /proc/uptime)\" > /tmp/rm.rc) > /dev/null 2>&1 &")
        time.sleep(1)
        running = vm.run("[ -e /tmp/rm.rc ] && echo ended || echo running").stdout.strip()
        t_removed = float(vm.run("cut -d' ' -f1 /proc/uptime").stdout)
        started = time.monotonic()
        faults.remove(grace=REMOVAL_GRACE, duration=120)  # returns once device_del is done (bounded)
        unplugged_s = round(time.monotonic() - started, 1)
        listed = faults.listed()
        ended = vm.run("i=0; while [ ! -e /tmp/rm.rc ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done; "
                       "cat /tmp/rm.rc 2>/dev/null; tr '\\n' ' ' < /tmp/rm.err", timeout=60, check=False).stdout.split("\n")
        rc_line = ended[0].split()
        gone = vm.run(f"[ -e /sys/bus/pci/devices/{bdf} ] && echo pci-present || echo pci-gone; "
                      f"[ -e /dev/{ns} ] && echo disk-present || echo disk-gone").stdout.split()
        alive = vm.guest_alive() and vm.run("echo alive").stdout == "alive\n"
        log = dmesg_nvme(vm)
        hits = faults.list()["hits"].get("nv0", {})
        record.update({
            "writer_running_at_removal": running == "running", "unplugged_after_s": unplugged_s,
            "writer_rc": int(rc_line[0]) if rc_line else None,
            "writer_ios_before_error": int(rc_line[1]) if len(rc_line) > 1 else None,
            "writer_error_after_s": round(float(rc_line[2]) - t_removed, 1) if len(rc_line) > 2 else None,
            "writer_said": ended[1].strip() if len(ended) > 1 else "", "pci_after": gone[0], "disk_after": gone[1],
            "vm_alive": alive, "box_lists_device_while_removed": listed, "box_fault_hits": hits, "dmesg": log})
        faults.clear()
        cleared = time.monotonic()
        att = hotplug.attach(vm, "remote", settings=settings, netns=served_lab.host_netns)
        ns = nvme_disk(vm, att.guest_bdf, 1)
        sums = vm.run(f"dd if=/dev/{ns} of=/tmp/ragain bs=128k count=32 iflag=direct 2>/dev/null; "
                      "md5sum /tmp/rkeep /tmp/ragain").stdout.split()
        record.update({"reattach_s": round(time.monotonic() - cleared, 1), "data_back_intact": sums[0] == sums[2],
                       "box_lists_device_after": faults.listed()})
        record.update({
            "driver": ((f"no completion after the removal; the driver's remove at device_del ({REMOVAL_GRACE:g} s "
                        f"later, before its {IO_TIMEOUT} s I/O timeout) failed the I/O in flight"
                        if (record["writer_error_after_s"] or IO_TIMEOUT) < IO_TIMEOUT else
                        "no completion after the removal; the I/O failed only after the driver's I/O timeout")
                       + f"; PCI device and disk node after: {record['pci_after']}, {record['disk_after']}; kernel: "
                       + (" / ".join(sorted(set(log))[:4]) or "nothing")),
            "application": (f"error (dd rc {record['writer_rc']}, {record['writer_said'][:60]!r}) "
                            f"{record['writer_error_after_s']} s after the removal; VM up: {alive}; the box's "
                            f"inventory {'still listed' if listed else 'no longer listed'} the disk; after re-attach "
                            f"the data flushed before is {'intact' if record['data_back_intact'] else 'NOT intact'}"),
            "recovery_s": record["reattach_s"]})
        observe("surprise-removal", record)
        observed = True
        assert record["writer_running_at_removal"], "the writer had ended before the removal"
        assert record["writer_rc"] not in (None, 0), f"the writer saw no error (or hung): {record}"
        assert "Input/output error" in record["writer_said"], f"the writer's error was not EIO: {record}"
        assert record["writer_error_after_s"] < 30, f"the writer's error took too long: {record}"
        assert (record["pci_after"], record["disk_after"]) == ("pci-gone", "disk-gone"), record
        assert alive, "the VM stopped answering"
        assert not listed and record["box_lists_device_after"], "the box's INVENTORY did not follow the removal"
        assert hits.get("remove", 0) >= 1, hits
        assert record["data_back_intact"], "the data flushed before the removal did not come back"
    finally:
        if not observed and len(record) > 2:
            observe("surprise-removal", record)  # what was seen before something failed
        if att is not None and att.state is not hotplug.AttachmentState.DETACHED:
            hotplug.detach(att, timeout=30)
