"""The README's demo on the embedded defaults.

A lab with one GPU box (its own network namespace, reached over veth with mutual TLS)
that holds an NVMe drive, a display adapter and an accelerator; the pool manager, which
registers the box; a guest VM (full image: the generic kernel has the bochs DRM driver)
that the manager gives the devices, hot-plugged; the guest uses them with its own drivers
(a checksummed write and read-back on the disk, a pattern drawn on /dev/fb0 and found
pixel-exact in the box's screenshot) and its accelerator runtime (MLP inference and a
transformer block, checked against numpy in the guest, timed on the box's device and on
one served locally); what the guest measured and what the host proxies
counted; and the devices given back. It grows with each capability of the DxPU path.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from dxpu_vfio.lab import accel as guest_accel
from dxpu_vfio.lab import guest_output, hotplug
from dxpu_vfio.lab import kms as guest_kms
from dxpu_vfio.lab import lab
from dxpu_vfio.lab.display_probe import DisplayProbe, png_pixels
from dxpu_vfio.lab.guest_devices import nvme_disk
from dxpu_vfio.lab.hotplug import guest_wait_for_child, port_bdf
from dxpu_vfio.paths import PROJECT_ROOT
from dxpu_vfio.pool.service import ManagerClient, ManagerProcess
from dxpu_vfio.procs import exit_on_sigterm
from dxpu_vfio.vms.runner import Vm, VmConfig

MiB = 1 << 20


def _guest_bdf(vm: Vm, port: str) -> str:
    """The guest's BDF of what the manager plugged on root port ``rpN``."""
    return guest_wait_for_child(vm, port_bdf(vm, port), True, 60)


def _use_nvme(vm: Vm, bdf: str) -> dict:
    disk = nvme_disk(vm, bdf, timeout=60)
    now = "cut -d' ' -f1 /proc/uptime"  # busybox and coreutils alike; 10 ms resolution
    io = vm.run(f"dd if=/dev/urandom of=/tmp/data bs=1M count=8 2>/dev/null; a=$({now}); "
                f"dd if=/tmp/data of=/dev/{disk} bs=128k oflag=direct 2>/dev/null; sync; b=$({now}); "
                f"echo 3 > /proc/sys/vm/drop_caches; c=$({now}); "
                f"dd if=/dev/{disk} of=/tmp/back bs=128k count=64 iflag=direct 2>/dev/null; d=$({now}); "
                f"echo write_s=$(echo $a $b | awk '{{print $2-$1}}') read_s=$(echo $c $d | awk '{{print $2-$1}}') "
                f"src=$(md5sum < /tmp/data | cut -c1-32) back=$(md5sum < /tmp/back | cut -c1-32)",
                timeout=300).stdout
    seconds, sums = guest_output.numbers(io, ("write_s", "read_s"), "the demo's dd"), guest_output.tokens(io)
    return {"disk": disk, "match": bool(sums.get("src")) and sums.get("src") == sums.get("back"),
            "write_MBps": round(8 * MiB / 1e6 / max(seconds["write_s"], 0.01), 1),
            "read_MBps": round(8 * MiB / 1e6 / max(seconds["read_s"], 0.01), 1)}


def _use_display(vm: Vm, bdf: str, probe: DisplayProbe, shot: Path) -> dict:
    mode = probe.wait_mode()
    driver = vm.run(f"basename $(readlink /sys/bus/pci/devices/{bdf}/driver)").stdout.strip()
    w, h = mode["xres"], mode["yres"]
    kms = guest_kms.install(vm)
    vm.run(f"python3 {kms} --mode {w}x{h} --pattern-file /tmp/pattern.raw", timeout=120)
    guest_kms.bind_console(vm, False)
    try:
        started = time.monotonic()
        vm.run("dd if=/tmp/pattern.raw of=/dev/fb0 bs=1M 2>/dev/null", timeout=60)
        probe.wait_pixels(w, h, guest_kms.pattern_rgb(w, h), timeout=180)
        seconds = time.monotonic() - started
        png = probe.screenshot()  # before the console comes back and draws over it
    finally:
        guest_kms.bind_console(vm, True)
    shot.write_bytes(png)
    return {"driver": driver, "mode": f"{w}x{h}x{mode['bpp']}", "pixel_exact": True,
            "seconds_to_screen": round(seconds, 1), "screenshot": str(shot), "png_size": png_pixels(png)[:2]}



DEMO_WORKLOADS = ("mlp-b64", "transformer-s64")   # of dxpu_vfio.lab.accel_workloads
DEMO_PASSES = 15   # each path's; the medians of 5 swung the ratio by 0.3-0.6 between runs


def _use_accel(vm: Vm, pool: ManagerClient, sock: str) -> dict:
    """AI workloads in the guest on the pool's accelerator (in box1) and on one served by a
    local host proxy (no network), pass by pass in turn, for the ratio; each checks its
    numerics against numpy in the guest (a failed check raises)."""
    [acc] = pool.post("/v1/attach", vm=sock, **{"class": "accel"})
    bdf = _guest_bdf(vm, acc["port"])
    local_att = hotplug.attach(vm, "accel")
    try:  # passes alternate between the two, so both see the same minutes of this shared machine
        runs = guest_accel.compare(vm, {"remote": bdf, "local": local_att.guest_bdf}, list(DEMO_WORKLOADS),
                                   passes=DEMO_PASSES)
    finally:
        hotplug.detach(local_att)
    remote, local = runs["remote"], runs["local"]
    runs = {name: {"what": remote[name]["what"], "remote_ms": round(remote[name]["median_s"] * 1e3, 2),
                   "local_ms": round(local[name]["median_s"] * 1e3, 2),
                   "remote_vs_local": round(remote[name]["median_s"] / max(local[name]["median_s"], 1e-9), 2),
                   "max_abs_error": max(remote[name]["max_abs_error"], local[name]["max_abs_error"])}
            for name in DEMO_WORKLOADS}
    return {"lease": acc["lease"], "device": acc["device"], "port": acc["port"], "bdf": bdf,
            "workloads": runs, "match": all(r["max_abs_error"] < 1e-2 for r in runs.values())}


def _save_failure_logs(lab_name: str, work: Path) -> None:
    """A failed demo keeps what explains it in ``results/demo-failed/`` before the
    teardown removes it: the lab's files (box proxy logs), the manager's log and each
    host proxy's log. The guest's own logs stay in its workdir (named in the output)."""
    dest = PROJECT_ROOT / "results" / "demo-failed"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    lab.save_logs(lab_name, dest)
    for log in [*work.glob("*.log"), *work.glob("*.logs/*.log")]:
        shutil.copy2(log, dest / log.name)
    print(f"demo: failed; logs saved in {dest}", file=sys.stderr)

def run_demo(image: str = "full", accel: str = "tcg", as_json: bool = False) -> int:
    say = (lambda _m: None) if as_json else (lambda m: print(m, flush=True))
    out: dict = {"image": image, "accel": accel}
    if image != "full":
        say("demo: the display needs the full image (its generic kernel has the bochs DRM driver); using full")
        image = out["image"] = "full"
    exit_on_sigterm()  # a SIGTERM still runs the finally below: no lab, pool database or disk image left
    work = Path(tempfile.mkdtemp(prefix="dxpu-demo-"))
    topology = lab.Topology(f"demo{os.getpid()}", [lab.BoxSpec("box1", [
        {"id": "nvme0", "model": "nvme", "settings": {"namespaces": [{"size": 128 * MiB, "path": str(work / "nvme0.img")}]}},
        {"id": "fb0", "model": "display"}, {"id": "acc0", "model": "accel"}])])
    manager = None
    try:
        say("demo: bringing up the lab: host namespace + GPU box 'box1' over veth (198.18.1.0/24), mutual TLS ...")
        state = lab.up(topology)
        box = state.box("box1")
        manager = ManagerProcess(work / "pool.db", netns=state.host_netns).start()
        pool = ManagerClient(work / "pool.db")
        reg = pool.post("/v1/boxes", name="box1", address=box.endpoint, tls_dir=box.tls_dir)
        say(f"demo: pool manager up (pid {manager.pid}, {work / 'pool.db'}); registered box1 at {box.endpoint}: "
            + ", ".join(f"{d['id']} ({d['class']} {d['vendor']}:{d['model']}, {d['capacity'] // MiB} MiB)"
                        for d in reg["devices"]))
        with Vm(VmConfig(image=image, name="dxpu-demo", accel=accel)) as vm:
            vm.boot(timeout=300)
            out["kernel"] = vm.run("uname -r").stdout.strip()
            out["boot_seconds"] = round(vm.boot_seconds, 1)
            say(f"demo: guest up under {accel} (QEMU {vm.qemu.version_text}, kernel {out['kernel']}) "
                f"in {vm.boot_seconds:.1f} s; logs in {vm.workdir}")
            sock = str(vm.admin_qmp_path)

            [nv] = pool.post("/v1/attach", vm=sock, **{"class": "nvme"})
            bdf = _guest_bdf(vm, nv["port"])
            say(f"demo: dxpu attach --class nvme -> lease {nv['lease']}: {nv['device']} on {nv['port']}, "
                f"guest {bdf}, driver nvme")
            out["nvme"] = {**_use_nvme(vm, bdf), "lease": nv["lease"]}
            say(f"demo: guest wrote 8 MiB of random data to /dev/{out['nvme']['disk']} with dd, dropped its caches, "
                f"read it back: {'checksums match' if out['nvme']['match'] else 'CHECKSUMS DIFFER'} "
                f"(write {out['nvme']['write_MBps']} MB/s, read {out['nvme']['read_MBps']} MB/s)")

            [fb] = pool.post("/v1/attach", vm=sock, **{"class": "display"})
            bdf = _guest_bdf(vm, fb["port"])
            probe = DisplayProbe.in_box(state, "box1", "fb0")
            out["display"] = {**_use_display(vm, bdf, probe, work / "screenshot.png"), "lease": fb["lease"]}
            d = out["display"]
            say(f"demo: dxpu attach --class display -> lease {fb['lease']}: {fb['device']} on {fb['port']}, guest {bdf}, "
                f"driver {d['driver']}, mode {d['mode']}")
            say(f"demo: guest drew a test pattern on /dev/fb0; box1's screenshot showed it pixel-exact "
                f"{d['seconds_to_screen']} s later ({d['screenshot']})")

            out["accel"] = _use_accel(vm, pool, sock)
            a = out["accel"]
            say(f"demo: dxpu attach --class accel -> lease {a['lease']}: {a['device']} on {a['port']}, guest {a['bdf']}")
            for name, w in a["workloads"].items():
                say(f"demo: guest ran {w['what']} ({name}): {w['remote_ms']} ms a pass from box1, {w['local_ms']} ms "
                    f"served locally ({w['remote_vs_local']}x); checked against numpy in the guest")

            status = pool.get("/v1/status", vm=sock)
            out["status"] = status
            for dev in status["devices"]:
                c = dev["counters"]
                writeback = (f", {c['writeback_bytes']} B of framebuffer written back from its shadow"
                             if "writeback_bytes" in c else "")
                say(f"demo: host proxy of {dev['device']}: {c.get('reads', 0)} reads and {c.get('writes_posted', 0)} "
                    f"posted writes ({c.get('posted_messages', c.get('writes_posted', 0))} link messages){writeback}, "
                    f"DMA {c.get('dma_bytes_read', 0)} B out of and {c.get('dma_bytes_written', 0)} B into guest "
                    f"memory, {c.get('irqs', 0)} interrupts, link {'up' if dev['link_up'] else 'DOWN'}")
            started = time.monotonic()
            freed = pool.post("/v1/detach", vm=sock, all=True)
            out["detach_seconds"] = round(time.monotonic() - started, 1)
            out["freed"] = [f["device"] for f in freed]
            left = [x["id"] for x in pool.get("/v1/ls")["devices"] if not x["available"]]
            say(f"demo: dxpu detach --all: {', '.join(out['freed'])} unplugged (the guest's drivers let go in "
                f"{out['detach_seconds']} s) and back in the pool ({'all free' if not left else 'still held: ' + ', '.join(left)})")
            vm.shutdown()
    except BaseException:
        _save_failure_logs(topology.name, work)
        raise
    finally:
        if manager is not None:
            try:  # a failed run left leases of its dead VM: their host proxies end with them
                ManagerClient(work / "pool.db", timeout=30).post("/v1/reconcile")
            except Exception as exc:  # noqa: BLE001 - the teardown goes on; the check below names leftovers
                print(f"demo: reconcile at teardown failed: {exc}", file=sys.stderr)
            manager.stop()
        lab.down(topology.name)  # safe where lab.up never finished
        shutil.rmtree(work, ignore_errors=True)  # the box's disk image and the pool database
    say("demo: pool manager stopped, lab down (namespaces, proxies, certificates, disk image removed)")
    results = PROJECT_ROOT / "results"
    results.mkdir(exist_ok=True)
    (results / "demo.json").write_text(json.dumps(out, indent=2, default=str))
    if as_json:
        print(json.dumps(out, indent=2, default=str))
    ok = out.get("nvme", {}).get("match") and out.get("display", {}).get("pixel_exact") \
        and out.get("accel", {}).get("match") and not left
    return 0 if ok else 1
