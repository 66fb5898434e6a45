"""The ``dxpu`` command. Each subcommand is a thin layer over a module; ``--json``
prints machine-readable output; errors print what went wrong and what to run, exit 1."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

from dxpu_vfio.errors import DxpuError


def _emit(args: argparse.Namespace, data: Any, text: Callable[[Any], str]) -> None:
    print(json.dumps(data, indent=2, default=str) if getattr(args, "json", False) else text(data))


def cmd_setup(args: argparse.Namespace) -> int:
    from dxpu_vfio.vms import images, qemu
    log = (lambda _msg: None) if args.json else (lambda msg: print(msg, flush=True))
    out: dict[str, Any] = {}
    if args.what in ("all", "qemu"):
        q = qemu.install_sysroot(log=log)
        out["qemu"] = {"binary": str(q.binary), "version": q.version_text, "source": q.source}
    if args.what in ("all", "images"):
        names = args.names or list(images.IMAGE_NAMES)
        out["images"] = {}
        for name in names:
            img = images.build_image(name, rebuild=args.rebuild, log=log)
            out["images"][name] = {"directory": str(img.directory), "kernel": img.kernel_release}
    if args.json:
        print(json.dumps(out, indent=2))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from dxpu_vfio.doctor import run_checks
    checks = run_checks(accel=args.accel)
    _emit(args, [c.as_dict() for c in checks],
          lambda rows: "\n".join(
              f"{'ok ' if r['ok'] else 'BAD'} {r['name']:<14} {r['detail']}"
              + ("" if r["ok"] or not r["fix"] else f"\n    fix: {r['fix']}") for r in rows))
    return 0 if all(c.ok or c.optional for c in checks) else 1


def cmd_vm_run(args: argparse.Namespace) -> int:
    from dxpu_vfio.vms.runner import Vm, VmConfig
    config = VmConfig(image=args.image, name=args.name, accel=args.accel,
                      memory_mib=args.memory, cpus=args.cpus, edu=args.edu)
    with Vm(config) as vm:
        vm.boot()
        result = vm.run(args.command, timeout=args.timeout, check=False)
        vm.shutdown()
    if args.json:
        print(json.dumps({"rc": result.rc, "stdout": result.stdout, "stderr": result.stderr,
                          "boot_seconds": vm.boot_seconds, "workdir": str(vm.workdir)}))
    else:
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
    return result.rc


def cmd_vm_define(args: argparse.Namespace) -> int:
    """Write and define a libvirt domain for dxpu (``virsh start NAME`` boots it)."""
    from dxpu_vfio.vms.libvirt_domain import DomainConfig, define_domain
    log = (lambda _msg: None) if args.json else (lambda msg: print(msg, flush=True))
    info = define_domain(DomainConfig(name=args.name, image=args.image, memory_mib=args.memory,
                                      cpus=args.cpus, root_ports=args.root_ports, accel=args.accel),
                         uri=args.uri, start=args.start, log=log)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        shell = (f"; guest shell socket {info['guest_socket']}" if info["guest_socket"] else
                 f"; guest agent: virsh qemu-agent-command {info['name']} ...")
        print(f"  serial log {info['serial_log']}{shell}; QEMU log {info['qemu_log']}\n"
              f"  root ports for dxpu attach: {', '.join(info['root_ports'])}")
    return 0


def cmd_vm_undefine(args: argparse.Namespace) -> int:
    from dxpu_vfio.vms.libvirt_domain import undefine_domain
    info = undefine_domain(args.name, uri=args.uri)
    _emit(args, info, lambda i: f"{i['name']}: {'destroyed and ' if i['destroyed'] else ''}undefined, files removed")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from dxpu_vfio.lab.demo import run_demo
    return run_demo(image=args.image, accel=args.accel, as_json=args.json)


def cmd_remote_serve(args: argparse.Namespace) -> int:
    """Run a remote proxy until SIGTERM/SIGINT; counters to --stats on SIGUSR1 and at exit."""
    from dxpu_vfio.remoteproxy.main import serve
    return serve(args.config, args.stats)


def cmd_screenshot(args: argparse.Namespace) -> int:
    """The scanout of a display device, rendered where its framebuffer lives, as PNG."""
    import signal
    from pathlib import Path

    from dxpu_vfio import registry
    from dxpu_vfio.daemon import screenshot_path
    from dxpu_vfio.procs import request_file
    if args.pool:  # a pooled display, by lease or BOX/DEVICE: the manager asks its box
        from dxpu_vfio.pool.service import ManagerClient
        png = ManagerClient(args.db).get("/v1/screenshot", device=args.device)
        Path(args.out).write_bytes(png)
        _emit(args, {"device": args.device, "out": args.out, "bytes": len(png)},
              lambda d: f"wrote {d['out']} ({d['bytes']} bytes)")
        return 0
    box, _, dev = args.device.partition("/")
    found = False
    for entry in registry.entries():
        if entry["kind"] == "host" and entry["name"] == args.device:
            if entry.get("model") != "display":
                found = True  # a device of that name, but not a display: another may be
                continue
            path = screenshot_path(Path(entry["stats"]))
        elif entry["kind"] == "remote" and entry["name"] == box and dev:
            path = screenshot_path(Path(entry["stats"]), dev)
        else:
            continue
        png = request_file(entry["pid"], path, signal.SIGUSR2, 30)  # a busy display renders slowly
        if png is None:
            found = True
            continue
        Path(args.out).write_bytes(png)
        _emit(args, {"device": args.device, "out": args.out, "bytes": len(png)},
              lambda d: f"wrote {d['out']} ({d['bytes']} bytes)")
        return 0
    if found:
        print(f"dxpu: error: {args.device} gave no screenshot: is it a display device?", file=sys.stderr)
        return 1
    print(f"dxpu: error: no running proxy serves {args.device!r}\n  fix: see `dxpu stats` for the names "
          "(a host proxy's device id, or BOX/DEVICE on a GPU box)", file=sys.stderr)
    return 1


def stats_rows(entries: list[tuple[dict, dict | None]]) -> list[dict]:
    """One row per device and proxy: what crossed, what waited, what failed."""
    rows = []
    for entry, stats in entries:
        if stats is None:
            rows.append({"proxy": entry["kind"], "name": entry["name"], "pid": entry["pid"], "error": "no answer"})
            continue
        if entry["kind"] == "host":
            server, device = stats["server"], stats["device"]
            cmds = server["commands"]
            link = device.get("link")
            rows.append({
                "proxy": "host", "name": entry["name"], "pid": entry["pid"], "model": entry.get("model"),
                "link": None if link is None else ("up" if link["up"] else f"down: {link['down_reason']}"),
                "nonposted": cmds.get("REGION_READ", {}).get("count", 0) + device.get("writes_nonposted", 0),
                "posted_writes": device.get("writes_posted", cmds.get("REGION_WRITE", {}).get("count", 0)),
                "dma_read_bytes": device.get("dma_bytes_read", (server.get("dma") or {}).get("bytes_read", 0)),
                "dma_write_bytes": device.get("dma_bytes_written", (server.get("dma") or {}).get("bytes_written", 0)),
                "irqs": device.get("irqs", sum((server.get("irqs") or {}).get(k, 0) for k in ("intx", "msi", "msix"))),
                "timeouts": link["timeouts"] if link else 0,
                "link_wait_us": round(sum(r["wait_us"] for r in link["requests"].values()), 1) if link else 0.0,
                "dma_refused": device.get("dma_refused", (server.get("dma") or {}).get("refused", 0)),
            })
        else:
            for dev_id, dev in stats["devices"].items():
                link = dev["link"]
                reqs = link["requests"] if link else {}
                rows.append({
                    "proxy": "remote", "name": f"{entry['name']}/{dev_id}", "pid": entry["pid"], "model": dev["model"],
                    "link": None if link is None else ("up" if link["up"] else f"down: {link['down_reason']}"),
                    "nonposted": sum(r["count"] for r in reqs.values()),
                    "posted_writes": (link or {}).get("received", {}).get("REGION_WRITE", 0),
                    "dma_read_bytes": dev["dma_bytes_read"], "dma_write_bytes": dev["dma_bytes_written"],
                    "irqs": dev["irqs_sent"], "timeouts": link["timeouts"] if link else 0,
                    "link_wait_us": round(sum(r["wait_us"] for r in reqs.values()), 1),
                    "dma_refused": None,
                })
    return rows


def cmd_stats(args: argparse.Namespace) -> int:
    from dxpu_vfio import registry
    rows = stats_rows([(e, registry.collect(e)) for e in registry.entries()])

    def text(rows: list[dict]) -> str:
        if not rows:
            return "no proxies are running on this host"
        from dxpu_vfio.bench import table
        cols = ["proxy", "name", "model", "link", "nonposted", "posted_writes", "dma_read_bytes",
                "dma_write_bytes", "irqs", "timeouts", "link_wait_us"]
        return table(cols, [[r.get(c, "-") if r.get(c) is not None else "-" for c in cols] for r in rows])

    _emit(args, rows, text)
    return 0


def cmd_certs(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dxpu_vfio.link.transport import make_certs
    made = make_certs(Path(args.dir), args.roles)
    _emit(args, {"dir": args.dir, "made": [str(p) for p in made]},
          lambda d: "\n".join(f"made {p}" for p in d["made"]) or f"certificates in {d['dir']} are up to date")
    return 0


def cmd_lab(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dxpu_vfio.lab import lab
    name = args.name
    if args.lab_command == "sweep":
        from dxpu_vfio.lab.sweep import run_sweep
        results = run_sweep([float(d) for d in args.delays.split(",")],
                            [float(d) for d in args.calibration.split(",")], Path(args.out),
                            log=(lambda _m: None) if args.json else (lambda m: print(m, flush=True)))
        _emit(args, results, _sweep_text)
        return 0
    if args.lab_command == "down":
        removed = lab.down(name)
        _emit(args, {"removed": removed}, lambda d: "\n".join(f"removed {r}" for r in d["removed"]) or "nothing to remove")
        return 0
    if args.lab_command == "status":
        info = lab.status(name)
        _emit(args, info, _lab_text)
        return 0 if info["up"] else 1
    topology = lab.Topology.load(Path(args.topology) if args.topology else None)
    if args.name_given:
        topology.name = name
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
    _emit(args, lab.status(topology.name), _lab_text)
    return 0


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
    vm_file = __import__("pathlib").Path(info["directory"]) / "vm.json"
    if vm_file.exists():
        vm = json.loads(vm_file.read_text())
        lines.append(f"  vm pid {vm['pid']}, QMP {vm['qmp']}, serial log {vm['serial_log']}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dxpu", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, func: Callable, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(func=func)
        return p

    p = add("setup", cmd_setup, "install the QEMU sysroot and build guest images (idempotent)")
    p.add_argument("what", choices=["all", "qemu", "images"], nargs="?", default="all")
    p.add_argument("names", nargs="*", help="images to build (default: all)")
    p.add_argument("--rebuild", action="store_true", help="rebuild images even if up to date")

    p = add("doctor", cmd_doctor, "check this host: QEMU, accelerators, images, libvirtd, netns")
    p.add_argument("--accel", default="tcg", choices=["tcg", "kvm"])

    vm = sub.add_parser("vm", help="run guests").add_subparsers(dest="vm_command", required=True)
    p = vm.add_parser("run", help="boot a guest, run one command in it, print its output; exit with its code")
    p.add_argument("command")
    p.add_argument("--image", default="tiny", choices=["tiny", "full"])
    p.add_argument("--name", default="dxpu-run")
    p.add_argument("--accel", default="tcg", choices=["tcg", "kvm"])
    p.add_argument("--memory", type=int, default=1024, help="MiB")
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--edu", action="store_true", help="add QEMU's edu device")
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_vm_run)
    p = vm.add_parser("define", help="define a libvirt domain for dxpu (q35, shared memfd RAM, root ports, "
                                     "the QEMU from setup); start it with virsh start NAME")
    p.add_argument("name")
    p.add_argument("--image", default="tiny", choices=["tiny", "full"])
    p.add_argument("--memory", type=int, default=1024, help="MiB")
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--root-ports", type=int, default=4, help="hot-pluggable pcie-root-ports")
    p.add_argument("--accel", default="tcg", choices=["tcg", "kvm"])
    p.add_argument("--start", action="store_true", help="start the domain too")
    p.add_argument("--uri", default="qemu:///system", help="libvirt URI")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_vm_define)
    p = vm.add_parser("undefine", help="destroy (if running) and undefine a domain dxpu defined; remove its files")
    p.add_argument("name")
    p.add_argument("--uri", default="qemu:///system", help="libvirt URI")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_vm_undefine)

    remote = sub.add_parser("remote", help="the remote proxy of a GPU box").add_subparsers(
        dest="remote_command", required=True)
    p = remote.add_parser("serve", help="serve a box's devices over the link (TCP + mutual TLS)")
    from dxpu_vfio.remoteproxy.main import add_arguments
    add_arguments(p)
    p.set_defaults(func=cmd_remote_serve)

    add("stats", cmd_stats, "per-device counters of every host and remote proxy on this host")

    p = add("screenshot", cmd_screenshot, "a display device's current scanout as PNG")
    p.add_argument("device", help="host proxy device id (e.g. dxpu3), or BOX/DEVICE on a GPU box; "
                                  "with --pool a lease id or BOX/DEVICE of the pool")
    p.add_argument("out")
    p.add_argument("--pool", action="store_true", help="through the pool manager (fetched from the box over TLS)")
    p.add_argument("--db", default=None, help="with --pool: the pool database")

    p = add("certs", cmd_certs, "make a lab CA and certificates for hosts and boxes (openssl)")
    p.add_argument("dir")
    p.add_argument("roles", nargs="*", default=["host", "box1"], help="one certificate each (default: host box1)")

    lab_parser = sub.add_parser("lab", help="the lab network: host node and GPU boxes in namespaces")
    lab_sub = lab_parser.add_subparsers(dest="lab_command", required=True)
    for verb, text in (("up", "bring up boxes (namespaces, veth, remote proxies) and a VM"),
                       ("status", "show the lab"), ("down", "remove every process, namespace and file of the lab"),
                       ("sweep", "run guest workloads at several link delays, fit and check the performance model")):
        p = lab_sub.add_parser(verb, help=text, description=text)
        p.add_argument("--json", action="store_true")
        p.add_argument("--name", default=None, help="lab name (default: the topology's, or 'lab')")
        p.set_defaults(func=cmd_lab)
        if verb == "up":
            p.add_argument("--topology", help="LAB.toml (default: one box with one test device)")
            p.add_argument("--no-vm", action="store_true", help="boxes only")
            p.add_argument("--image", default="tiny", choices=["tiny", "full"])
            p.add_argument("--accel", default="tcg", choices=["tcg", "kvm"])
        if verb == "sweep":
            p.add_argument("--delays", default="0,100,250,500,1000", help="added one-way delays, µs")
            p.add_argument("--calibration", default="0,250,1000", help="delays the model is fitted on")
            p.add_argument("--out", default="results/sweep")

    from dxpu_vfio.cli.pool import add_commands as add_pool_commands
    add_pool_commands(sub, add)

    p = add("demo", cmd_demo, "the main demo on the embedded defaults")
    p.add_argument("--image", default="full", choices=["full"], help="the display needs the full image")
    p.add_argument("--accel", default="tcg", choices=["tcg", "kvm"])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "lab_command", None):
        args.name_given = args.name is not None
        args.name = args.name or "lab"
    try:
        return args.func(args)
    except DxpuError as exc:
        print(f"dxpu: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
