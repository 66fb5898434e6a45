#!/usr/bin/env python3
"""Framebuffer fill rate: our display adapter remote (framebuffer in a GPU box over the
lab network, TLS) and local (served by the host proxy), trapped (``mapped = false``, each
with and without posted-write coalescing) and mapped (``mapped = true``: QEMU maps the
framebuffer; from a box, the host proxy's shadow is written back), against QEMU's own bochs-display, all in
the same full-image VM and all driven by the guest's own bochs DRM driver. For the
mapped rows also the write-back traffic (MB/s over the fills) and the host proxy's CPU;
then the write-back's staleness (how late the box shows a frame), measured without a
guest on loopback (dxpu_vfio/lab/staleness.py).

The guest's KMS client (vm_images/tools/dxpu_kms.py) sets 1024x768x32 on the device's card,
maps the scanout buffer (VRAM, write-combined) and fills it with 1 KiB memcpys, ending
with a read (which cannot pass the posted writes); the first fill also pays for the
driver's clear of the new buffer, so the median of the others is reported. Prints a
table with ratios and writes results/bench/display.json.

    .venv/bin/python scripts/bench_display.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dxpu_vfio.bench import cpu_seconds, table, write_json  # noqa: E402
from dxpu_vfio.lab import lab  # noqa: E402
from dxpu_vfio.lab import guest_output, hotplug  # noqa: E402
from dxpu_vfio.lab import kms as guest_kms  # noqa: E402
from dxpu_vfio.lab import staleness  # noqa: E402
from dxpu_vfio.procs import exit_on_sigterm  # noqa: E402
from dxpu_vfio.vms.runner import Vm, VmConfig  # noqa: E402

QEMU_BDF = "0000:00:06.0"
FRAME = 1024 * 768 * 4


def card_of(vm: Vm, bdf: str, timeout: int = 120) -> str:
    """The /dev/dri/cardN the guest's driver made for the device at ``bdf``."""
    d = f"/sys/bus/pci/devices/{bdf}/drm"
    out = vm.run(f"i=0; while ! ls {d} 2>/dev/null | grep -q '^card'; do [ $i -ge {timeout * 10} ] && exit 1; "
                 f"sleep 0.1; i=$((i+1)); done; ls {d} | grep '^card'", timeout=timeout + 10).stdout
    return "/dev/dri/" + guest_output.word((out.split() or [""])[0], guest_output.DRM_CARD, "ls", "DRM card")


def fill(vm: Vm, kms: str, card: str, repeat: int) -> dict:
    out = vm.run(f"python3 {kms} --card {card} --mode 1024x768 --repeat {repeat}", timeout=600).stdout
    res = guest_output.kms_fill(out)
    rates = [res["bytes"] / s / 1e6 for s in res["fill_s"]]
    return {"bytes": res["bytes"], "fill_s": res["fill_s"], "MBps_each": rates,
            "MBps": statistics.median(rates[1:] if len(rates) > 1 else rates)}


def counters(att: hotplug.Attachment) -> dict:
    """What the host proxy saw: vfio-user messages in, and (forward mode) link messages out."""
    stats = att.server.stats()
    cmds = stats["server"]["commands"]
    out = {"region_write_msgs": cmds.get("REGION_WRITE", {}).get("count", 0),
           "write_multi_msgs": cmds.get("REGION_WRITE_MULTI", {}).get("count", 0)}
    dev = stats["device"]
    if dev.get("shadows"):
        out["shadow"] = dev["shadows"]["0"]
    if "link" in dev:
        out.update(writes_posted=dev["writes_posted"], link_posted_msgs=dev["posted_messages"],
                   link_posted=dev["link"]["posted"])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="fills per device (the first is not counted)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--skip-trapped", action="store_true", help="only QEMU's bochs-display and the mapped rows")
    args = parser.parse_args()
    topology = lab.Topology("bd", [lab.BoxSpec("gpubox", [{"id": "fb0", "model": "display",
                                                           "settings": {"mapped": False}},
                                                          {"id": "fbm", "model": "display",
                                                           "settings": {"mapped": True}}])])
    exit_on_sigterm()  # a SIGTERM still runs the finally below: the lab goes
    results: dict[str, dict] = {}
    try:
        state = lab.up(topology)
        extra = ["-device", f"bochs-display,addr={QEMU_BDF[-4:-2]}"]
        with Vm(VmConfig(image="full", name="bench-display", extra_args=extra, boot_timeout=240)) as vm:
            vm.boot()
            kms = guest_kms.install(vm)
            results["qemu-bochs-display"] = fill(vm, kms, card_of(vm, QEMU_BDF), args.repeat)
            print(f"  qemu-bochs-display   {results['qemu-bochs-display']['MBps']:9.2f} MB/s", flush=True)
            remote = state.remote_settings("gpubox", "fb0")
            trapped = {"mapped": False}
            cases = {"local": ("display", trapped), "local-uncoalesced": ("display", {**trapped, "coalesce": False}),
                     "remote": ("remote", remote), "remote-uncoalesced": ("remote", {**remote, "coalesce": False}),
                     "local-mapped": ("display", {"mapped": True}),
                     "remote-mapped": ("remote", state.remote_settings("gpubox", "fbm"))}
            if args.skip_trapped:
                cases = {k: v for k, v in cases.items() if k.endswith("mapped")}
            for name, (model, settings) in cases.items():
                netns = state.host_netns if model == "remote" else None
                started = time.monotonic()
                att = hotplug.attach(vm, model, settings=settings, netns=netns)
                try:
                    card = card_of(vm, att.guest_bdf)
                    bind_s = time.monotonic() - started
                    before, cpu0, t0 = counters(att), cpu_seconds(att.server.pid), time.monotonic()
                    results[name] = {**fill(vm, kms, card, args.repeat), "plug_to_card_s": bind_s}
                    took, cpu = time.monotonic() - t0, cpu_seconds(att.server.pid) - cpu0
                    after = counters(att)
                    results[name].update(host_proxy=after, host_proxy_cpu_s=cpu, host_proxy_cpu_share=cpu / took)
                    if "shadow" in after:  # the write-back while the guest filled (and the KMS client ran)
                        sent = after["shadow"]["bytes_sent"] - before["shadow"]["bytes_sent"]
                        results[name]["writeback_MBps"] = sent / took / 1e6
                finally:
                    hotplug.detach(att, timeout=60)  # the guest may still be flushing its console
                print(f"  {name:20} {results[name]['MBps']:9.2f} MB/s", flush=True)
    finally:
        lab.down(topology.name)  # safe where lab.up never finished
    print("  staleness (loopback, no guest) ...", flush=True)
    stale = {f"{label}": staleness.measure(frames=120, frame_hz=hz, changed=changed)
             for label, hz, changed in (("full frames 30/s", 30, FRAME), ("full frames 60/s", 60, FRAME),
                                        ("64 KiB 100/s", 100, 64 << 10))}
    q = results["qemu-bochs-display"]["MBps"]
    local = results.get("local", results.get("local-mapped"))["MBps"]
    rows = [[name, r["MBps"], r["MBps"] / q, r["MBps"] / local, r.get("writeback_MBps", "-"),
             r.get("host_proxy_cpu_share", "-")] for name, r in results.items()]
    print()
    print(table(["device", "fill MB/s", "/ QEMU bochs-display", "/ local", "write-back MB/s", "host proxy CPU"], rows))
    print()
    print(table(["write-back (60 Hz)", "staleness p50 ms", "p99 ms", "max ms", "write-back MB/s", "scan ms"],
                [[k, v["staleness_ms"]["p50"], v["staleness_ms"]["p99"], v["staleness_ms"]["max"], v["writeback_MBps"],
                  v["scan_ms_mean"]] for k, v in stale.items()]))
    path = write_json("display", {"repeat": args.repeat, "frame": "1024x768x32", "results": results,
                                  "staleness": stale}, args.out)
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
