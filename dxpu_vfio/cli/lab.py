"""The lab's commands: ``dxpu lab up/status/down/link/fault/sweep`` (host and GPU boxes in network
namespaces) and ``dxpu demo`` (the whole story on embedded defaults)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dxpu_vfio.cli.commands import Subparsers, command, group
from dxpu_vfio.cli.output import emit, progress
from dxpu_vfio.cli.vms import add_guest_options

DEFAULT_NAME = "lab"


def _name(args: argparse.Namespace) -> str:
    return args.name or DEFAULT_NAME


def cmd_lab_up(args: argparse.Namespace) -> int:
    from dxpu_vfio.lab import lab
    topology = lab.Topology.load(Path(args.topology) if args.topology else None)
    if args.name:  # else the topology's own name
        topology.name = args.name
    if args.etcd is not None:
        topology.etcd = args.etcd
    if args.hosts is not None:
        topology.hosts = args.hosts
    state = lab.up(topology)
    if not args.no_vm:
        from dxpu_vfio.vms.runner import Vm, VmConfig
        vm = Vm(VmConfig(image=args.image, name=f"lab-{topology.name}", accel=args.accel),
                workdir=Path(state.directory) / "vm")
        state.pids.append(vm.start().pid)
        state.save()
        vm.wait_booted()
        info_vm = {"pid": vm.pid, "qmp": str(vm.qmp_path), "serial_log": str(vm.serial_log),
                   "boot_seconds": vm.boot_seconds}
        vm.release()
        (Path(state.directory) / "vm.json").write_text(json.dumps(info_vm))
    emit(args, lab.status(topology.name), _lab_text)
    return 0


def cmd_lab_status(args: argparse.Namespace) -> int:
    from dxpu_vfio.lab import lab
    info = lab.status(_name(args))
    emit(args, info, _lab_text)
    return 0 if info["up"] else 1


def cmd_lab_down(args: argparse.Namespace) -> int:
    from dxpu_vfio.lab import lab
    removed = lab.down(_name(args))
    emit(args, {"removed": removed}, lambda d: "\n".join(f"removed {r}" for r in d["removed"]) or "nothing to remove")
    return 0


# option -> (Impairment field, parser name in dxpu_vfio.lab.impairment)
LINK_OPTIONS = {"delay": ("delay_us", "parse_time_us"), "jitter": ("jitter_us", "parse_time_us"),
                "loss": ("loss", "parse_fraction"), "reorder": ("reorder", "parse_fraction"),
                "duplicate": ("duplicate", "parse_fraction"), "rate": ("rate_bps", "parse_rate_bps")}


def cmd_lab_link(args: argparse.Namespace) -> int:
    from dxpu_vfio.lab import impairment, lab
    state = lab.LabState.load(_existing_lab(_name(args)))
    b = state.box(args.box)
    changes: dict = {}
    for option, (field, parser) in LINK_OPTIONS.items():
        if getattr(args, option) is not None:
            changes[field] = getattr(impairment, parser)(getattr(args, option))
    if args.distribution:
        changes["distribution"] = args.distribution
    if args.gilbert:
        changes.update(impairment.parse_gilbert(args.gilbert))
    if changes or args.clear or args.realtime:
        directions = ("up", "down") if args.dir == "both" else (args.dir,)
        link = {d: impairment.Impairment() if args.clear else b.impairment(d) for d in ("up", "down")}
        for d in directions:
            link[d] = link[d].replace(**changes)
        lab.set_link(state, args.box, link["up"], link["down"],
                     realtime=None if args.realtime is None else args.realtime == "on")
    elif args.reset:
        lab.reset_link_counters(state, args.box)
    info = {"box": b.name, "mode": b.delay_mode, "link_netns": b.link_netns, "realtime": b.realtime,
            "asked": {d: b.impairment(d).to_dict() for d in ("up", "down")},
            "achieved": lab.link_report(state, args.box)}
    emit(args, info, _link_text)
    return 0


def _existing_lab(name: str) -> Path:
    from dxpu_vfio.lab import lab
    directory = lab.lab_dir(name)
    if not (directory / "state.json").exists():
        raise lab.LabError(f"lab {name} is not up", hint=f"dxpu lab up --name {name} --no-vm")
    return directory


def _link_text(info: dict) -> str:
    lines = [f"box {info['box']}: link {info['mode']}{' (SCHED_FIFO)' if info['realtime'] else ''} "
             f"(namespace {info['link_netns']})"]
    achieved = info["achieved"] or {}
    for d in ("up", "down"):
        a = info["asked"][d]
        asked = ", ".join(f"{k} {v:g}" for k, v in a.items() if k != "distribution" and v
                          and not (k in ("ge_r", "ge_loss_bad") and v == 1.0)) or "nothing"
        lines.append(f"  {d:4} ({'host -> box' if d == 'up' else 'box -> host'}) asked: {asked}")
        if d in achieved:
            r = achieved[d]
            q = r["delay_us"]
            lines.append(f"       achieved: {r['packets']} packets, {r['bytes']} bytes, loss {r['loss_rate'] * 100:.3f} %, "
                         f"{r['duplicated']} duplicated, {r['reordered']} reordered; held p50 {q['p50']:.1f} µs, "
                         f"p90 {q['p90']:.1f}, p99 {q['p99']:.1f}, std {q['std']:.1f}")
    if not achieved:
        lines.append("  (no emulator in the path: nothing to report)")
    return "\n".join(lines)


FAULT_ACTIONS = ("list", "stall", "abort", "refuse-dma", "drop-posted", "cut", "remove", "freeze", "thaw", "clear")


def cmd_lab_fault(args: argparse.Namespace) -> int:
    from dxpu_vfio.lab import lab
    from dxpu_vfio.lab.faults import FaultError, Faults
    state = lab.LabState.load(_existing_lab(_name(args)))
    faults = Faults.for_lab(state, args.box, args.device)
    action, target = args.action, args.target
    if target is not None and action not in ("stall", "abort", "refuse-dma"):
        raise FaultError(f"{action} takes no target ({target!r})",
                         hint=f"dxpu lab fault {args.box} stall mmio-read --ms 200 (targets: stall, abort, refuse-dma)")
    if args.ms is not None and action != "stall":
        raise FaultError("--ms is for stall only", hint=f"dxpu lab fault {args.box} stall mmio-read --ms {args.ms:g}")
    if action in ("stall", "abort") and target is None:
        raise FaultError(f"{action} needs a target",
                         hint=f"dxpu lab fault {args.box} {action} mmio-read (or config-read"
                              f"{', dma-read' if action == 'stall' else ''})")
    bounds = {"duration": args.duration, "count": args.count}
    info: dict
    if action == "list":
        info = faults.list()
    elif action == "clear":
        info = {"cleared": faults.clear(args.id)}
    elif action == "freeze":  # this command holds the freeze: a box is never left stopped by it
        faults.freeze(seconds=args.duration)
        info = {"frozen_s": faults.wait_thawed()}
    elif action == "thaw":
        faults.thaw(force=True)
        info = {"thawed": args.box}
    elif action == "cut":
        info = {"fault": faults.cut()}
    elif action == "remove":
        info = {"fault": faults.remove(grace=None, duration=args.duration or 30.0)}
    else:
        kwargs = {"ms": args.ms} if action == "stall" else {}
        info = {"fault": faults.arm(action, target or ("dma" if action == "refuse-dma" else None), **kwargs, **bounds)}
    emit(args, info, _fault_text)
    return 0


def _fault_text(info: dict) -> str:
    def one(f: dict) -> str:
        what = f["kind"] + (f" {f['target']}" if f["target"] else "") + (f" {f['ms']:g} ms" if f.get("ms") else "")
        hits = f"{f['hits']}/{f['count']}" if f["count"] else str(f["hits"])
        ended = f" ({f['ended']})" if f.get("ended") else ""
        return f"  fault {f['id']:<3} {f['device']:<8} {what:<24} {f['remaining']:.1f} s left, {hits} hits{ended}"
    if "fault" in info:
        return "armed:\n" + one(info["fault"])
    if "cleared" in info:
        return "\n".join(["cleared:"] + [one(f) for f in info["cleared"]]) if info["cleared"] else "nothing armed"
    if "frozen_s" in info:
        return f"box frozen for {info['frozen_s']:.2f} s, thawed"
    if "thawed" in info:
        return f"box {info['thawed']} thawed"
    lines = ["armed:"] + [one(f) for f in info["faults"]] if info["faults"] else ["nothing armed"]
    for device, hits in info.get("hits", {}).items():
        lines.append(f"  hits on {device}: " + ", ".join(f"{k} {v}" for k, v in hits.items()))
    for e in info.get("log", [])[-10:]:
        stamp = time.strftime("%H:%M:%S", time.gmtime(e["t"])) + f".{int(e['t'] * 1000) % 1000:03d}Z"
        lines.append(f"  {stamp} fault {e['fault'] or '-'} {e['kind']}{' ' + e['target'] if e.get('target') else ''} "
                     f"{e['event']}")
    return "\n".join(lines)


def cmd_lab_sweep(args: argparse.Namespace) -> int:
    from dxpu_vfio.lab.sweep import run_sweep
    from dxpu_vfio.procs import exit_on_sigterm
    exit_on_sigterm()  # the sweep's finally then removes its lab and disks on SIGTERM too
    workloads = args.workloads.split(",") if args.workloads else None
    results = run_sweep([float(d) for d in args.delays.split(",")],
                        [float(d) for d in args.calibration.split(",")], Path(args.out), workloads=workloads,
                        log=progress(args), passes=args.passes)
    emit(args, results, _sweep_text)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from dxpu_vfio.lab.demo import run_demo
    return run_demo(image=args.image, accel=args.accel, as_json=args.json)


def _sweep_text(results: dict) -> str:
    lines = ["", "workload                T_local   k      round trips  10% overhead at RTT   held-out errors"]
    for w, d in results["workloads"].items():
        m = d["model"]
        errs = ", ".join(f"{h['delay_us']:g}µs: {h['error'] * 100:+.1f}%" for h in d["held_out"])
        lines.append(f"{w:22} {m['t_local_s'] * 1000:7.1f} ms {m['k']:5.2f} {m['round_trips']:12.0f}  "
                     f"{d['rtt_for_10pct_us']:10.1f} µs         {errs}")
    accel = [(w, d) for w, d in results["workloads"].items() if "bandwidth_for_10pct_MBps" in d]
    if accel:
        lines += ["", "accelerator workload    compute share  overhead at the lab's floor  round trips/launch  "
                  "/copy  10% crossed below link bandwidth (at the floor's RTT)"]
        for w, d in accel:
            lines.append(f"{w:22} {d['compute_share'] * 100:10.0f}%  {d['overhead_at_floor'] * 100:+20.1f}%  "
                         f"{d['round_trips_per_launch']:18.2f}  {d['round_trips_per_copy']:5.2f}  "
                         f"{d['bandwidth_for_10pct_MBps']:10.1f} MB/s")
    return "\n".join(lines)


def _lab_text(info: dict) -> str:
    if not info["up"]:
        return f"lab {info['name']} is down"
    lines = [f"lab {info['name']}: host namespace {info['host_netns']}, state in {info['directory']}"]
    for b in info["boxes"]:
        lines.append(f"  box {b['name']:<8} netns {b['netns']:<14} {b['address']}  proxy pid {b['proxy_pid']} "
                     f"({'alive' if b['proxy_alive'] else 'DEAD'})  {'TLS' if b['tls'] else 'PLAINTEXT'}  "
                     f"delay {b['delay_us']:.0f} µs ({b['delay_mode']})  "
                     f"devices: {', '.join(f'{k} ({v})' for k, v in b['devices'].items())}")
    if len(info.get("hosts", [])) > 1:
        lines.append(f"  hosts: {', '.join(info['hosts'])} (2 and on reach the boxes through the first)")
    if info.get("etcd"):
        lines.append("  etcd (from the host namespace; boxes use the host end of their link): " + ", ".join(
            f"{m['endpoint']} pid {m['pid']} ({'alive' if m['alive'] else 'DEAD'})" for m in info["etcd"]))
    vm_file = Path(info["directory"]) / "vm.json"
    if vm_file.exists():
        vm = json.loads(vm_file.read_text())
        lines.append(f"  vm pid {vm['pid']}, QMP {vm['qmp']}, serial log {vm['serial_log']}")
    return "\n".join(lines)


def register(sub: Subparsers) -> None:
    lab = group(sub, "lab", "the lab network: host node and GPU boxes in namespaces")
    verbs = [("up", cmd_lab_up, "bring up boxes (namespaces, veth, remote proxies) and a VM"),
             ("status", cmd_lab_status, "show the lab"),
             ("down", cmd_lab_down, "remove every process, namespace and file of the lab"),
             ("link", cmd_lab_link, "show or change what a box's link does to packets (delay, loss, rate...)"),
             ("fault", cmd_lab_fault, "list, arm or clear faults on a box's device (stall, abort, refuse-dma, ...)"),
             ("sweep", cmd_lab_sweep,
              "run guest workloads at several link delays, fit and check the performance model")]
    parsers = {verb: command(lab, verb, func, text) for verb, func, text in verbs}
    for verb in ("up", "status", "down", "link", "fault"):  # the sweep brings up a lab of its own
        parsers[verb].add_argument("--name", default=None,
                                   help=f"lab name (default: the topology's, or {DEFAULT_NAME!r})")
    p = parsers["up"]
    p.add_argument("--topology", help="LAB.toml (default: one box with one test device)")
    p.add_argument("--no-vm", action="store_true", help="boxes only")
    p.add_argument("--etcd", type=int, choices=[0, 1, 3, 5], default=None,
                   help="run an etcd cluster of this many members in the host namespace; the boxes announce "
                        "themselves there (default: the topology's etcd, 0)")
    p.add_argument("--hosts", type=int, default=None, metavar="N",
                   help="host namespaces (default: the topology's hosts, 1); hosts 2..N reach the boxes "
                        "through the first, sharing each box's link")
    add_guest_options(p)
    p = parsers["link"]
    p.add_argument("box", help="the box whose link to show or change")
    p.add_argument("--delay", help="one-way delay, e.g. 50us, 1.5ms")
    p.add_argument("--jitter", help="per-packet jitter, e.g. 10us (see --distribution)")
    p.add_argument("--distribution", choices=["normal", "uniform"],
                   help="jitter: normal (sigma = jitter, cut at 0; default) or uniform (delay +- jitter)")
    p.add_argument("--loss", help="random loss, e.g. 0.1%%")
    p.add_argument("--gilbert", metavar="P,R[,BAD[,GOOD]]",
                   help="bursty loss (Gilbert-Elliott): good->bad P, bad->good R, loss in bad (100%%) and good (0%%)")
    p.add_argument("--reorder", help="share of packets sent at once, past the held ones, e.g. 1%%")
    p.add_argument("--duplicate", help="share of packets sent twice, e.g. 0.1%%")
    p.add_argument("--rate", help="rate limit, e.g. 10gbit, 500mbit")
    p.add_argument("--dir", choices=["both", "up", "down"], default="both",
                   help="direction to change: up is host -> box (default both)")
    p.add_argument("--clear", action="store_true", help="start from a clean link (else options change the current one)")
    p.add_argument("--reset", action="store_true", help="zero the emulator's counters")
    p.add_argument("--realtime", choices=["on", "off"],
                   help="the emulator SCHED_FIFO (default on): holds on time on a busy machine (kept until changed)")
    p = parsers["fault"]
    p.add_argument("box", help="the box whose device misbehaves")
    p.add_argument("action", choices=FAULT_ACTIONS,
                   help="list, arm one (stall, abort, refuse-dma, drop-posted, cut, remove), freeze the "
                        "box for --duration s (this command waits and thaws), thaw, or clear (all, or --id)")
    p.add_argument("target", nargs="?", help="stall: config-read, mmio-read, dma-read; abort: config-read, "
                                            "mmio-read; refuse-dma: dma-read, dma-write, dma (default)")
    p.add_argument("--device", help="the box's device (default: its first)")
    p.add_argument("--ms", type=float, help="stall: hold each completion this long (default: until cleared)")
    p.add_argument("--duration", type=float, help="seconds until the fault ends by itself (default 30, at most 3600)")
    p.add_argument("--count", type=int, help="the fault ends after this many hits")
    p.add_argument("--id", type=int, help="clear: only this fault")
    p = parsers["sweep"]
    p.add_argument("--delays", default="0,100,250,500,1000", help="added one-way delays, µs")
    p.add_argument("--calibration", default="0,250,1000", help="delays the model is fitted on")
    p.add_argument("--out", default="results/sweep")
    p.add_argument("--workloads", help="comma-separated: mmio-loop, dma-64k, dma-1m, nvme-read, nvme-write (the "
                   "default: all five, in a guest) and the accelerator's accel-mlp-b1, accel-mlp-b8, accel-mlp-b64, "
                   "accel-transformer-s64, accel-transformer-s256, accel-train-step (from the host side)")
    p.add_argument("--passes", type=int, default=3, help="accel-*: timed passes per point (the median counts)")

    p = command(sub, "demo", cmd_demo, "the main demo on the embedded defaults")
    p.add_argument("--image", default="full", choices=["full"], help="the display needs the full image")
    p.add_argument("--accel", default="tcg", choices=["tcg", "kvm"])
