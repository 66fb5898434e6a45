"""The lab's commands: ``dxpu lab up/status/down/sweep`` (host and GPU boxes in network
namespaces) and ``dxpu demo`` (the whole story on embedded defaults)."""

from __future__ import annotations

import argparse
import json
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


def cmd_lab_sweep(args: argparse.Namespace) -> int:
    from dxpu_vfio.lab.sweep import run_sweep
    from dxpu_vfio.procs import exit_on_sigterm
    exit_on_sigterm()  # the sweep's finally then removes its lab and disks on SIGTERM too
    results = run_sweep([float(d) for d in args.delays.split(",")],
                        [float(d) for d in args.calibration.split(",")], Path(args.out), log=progress(args))
    emit(args, results, _sweep_text)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from dxpu_vfio.lab.demo import run_demo
    return run_demo(image=args.image, accel=args.accel, as_json=args.json)


def _sweep_text(results: dict) -> str:
    lines = ["", "workload      T_local   k      round trips  10% overhead at RTT   held-out errors"]
    for w, d in results["workloads"].items():
        m = d["model"]
        errs = ", ".join(f"{h['delay_us']:g}µs: {h['error'] * 100:+.1f}%" for h in d["held_out"])
        lines.append(f"{w:12} {m['t_local_s'] * 1000:7.1f} ms {m['k']:5.2f} {m['round_trips']:12.0f}  "
                     f"{d['rtt_for_10pct_us']:10.1f} µs         {errs}")
    return "\n".join(lines)


def _lab_text(info: dict) -> str:
    if not info["up"]:
        return f"lab {info['name']} is down"
    lines = [f"lab {info['name']}: host namespace {info['host_netns']}, state in {info['directory']}"]
    for b in info["boxes"]:
        lines.append(f"  box {b['name']:<8} netns {b['netns']:<14} {b['address']}  proxy pid {b['proxy_pid']} "
                     f"({'alive' if b['proxy_alive'] else 'DEAD'})  delay {b['delay_us']:.0f} µs ({b['delay_mode']})  "
                     f"devices: {', '.join(f'{k} ({v})' for k, v in b['devices'].items())}")
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
             ("sweep", cmd_lab_sweep,
              "run guest workloads at several link delays, fit and check the performance model")]
    parsers = {verb: command(lab, verb, func, text) for verb, func, text in verbs}
    for verb in ("up", "status", "down"):  # the sweep brings up a lab of its own
        parsers[verb].add_argument("--name", default=None,
                                   help=f"lab name (default: the topology's, or {DEFAULT_NAME!r})")
    p = parsers["up"]
    p.add_argument("--topology", help="LAB.toml (default: one box with one test device)")
    p.add_argument("--no-vm", action="store_true", help="boxes only")
    add_guest_options(p)
    p = parsers["sweep"]
    p.add_argument("--delays", default="0,100,250,500,1000", help="added one-way delays, µs")
    p.add_argument("--calibration", default="0,250,1000", help="delays the model is fitted on")
    p.add_argument("--out", default="results/sweep")

    p = command(sub, "demo", cmd_demo, "the main demo on the embedded defaults")
    p.add_argument("--image", default="full", choices=["full"], help="the display needs the full image")
    p.add_argument("--accel", default="tcg", choices=["tcg", "kvm"])
