"""The host's own commands: ``dxpu setup``, ``dxpu doctor``, and guests: ``dxpu vm run/define/undefine``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dxpu_vfio.cli.commands import Subparsers, command, group
from dxpu_vfio.cli.output import emit, print_json, progress


def cmd_setup(args: argparse.Namespace) -> int:
    from dxpu_vfio.vms import images, qemu
    log = progress(args)
    out: dict[str, Any] = {}
    if args.what in ("all", "qemu"):
        q = qemu.install_sysroot(log=log)
        out["qemu"] = {"binary": str(q.binary), "version": q.version_text, "source": q.source}
    if args.what in ("all", "images"):
        out["images"] = {}
        for name in args.names or list(images.IMAGE_NAMES):
            img = images.build_image(name, rebuild=args.rebuild, log=log)
            out["images"][name] = {"directory": str(img.directory), "kernel": img.kernel_release}
    if args.json:  # the text form is the progress lines above
        print_json(out)
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from dxpu_vfio.doctor import run_checks
    checks = run_checks(accel=args.accel)
    emit(args, [c.as_dict() for c in checks],
         lambda rows: "\n".join(
             f"{'ok ' if r['ok'] else 'BAD'} {r['name']:<14} {r['detail']}"
             + ("" if r["ok"] or not r["fix"] else f"\n    fix: {r['fix']}") for r in rows))
    return 0 if all(c.ok or c.optional for c in checks) else 1


def cmd_vm_run(args: argparse.Namespace) -> int:
    import os

    from dxpu_vfio.paths import run_dir
    from dxpu_vfio.vms.runner import Vm, VmConfig
    config = VmConfig(image=args.image, name=args.name, accel=args.accel,
                      memory_mib=args.memory, cpus=args.cpus, edu=args.edu)
    # the workdir (serial log, QEMU stderr) goes after a clean run unless --keep-logs;
    # a boot that failed keeps it either way (Vm keeps its logs after an exception)
    workdir = run_dir() / f"vm-{config.name}-{os.getpid()}" if args.keep_logs else None
    with Vm(config, workdir=workdir) as vm:
        vm.boot()
        result = vm.run(args.command, timeout=args.timeout, check=False)
        vm.shutdown()
    if args.json:
        print_json({"rc": result.rc, "stdout": result.stdout, "stderr": result.stderr,
                    "boot_seconds": vm.boot_seconds, "workdir": str(vm.workdir) if args.keep_logs else None})
    else:  # the guest command's own output, as if it ran here
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
    return result.rc


def cmd_vm_define(args: argparse.Namespace) -> int:
    from dxpu_vfio.vms.libvirt_domain import DomainConfig, define_domain
    info = define_domain(DomainConfig(name=args.name, image=args.image, memory_mib=args.memory,
                                      cpus=args.cpus, root_ports=args.root_ports, accel=args.accel,
                                      io_reserve=args.io_reserve),
                         uri=args.uri, start=args.start, log=progress(args))

    def text(info: dict) -> str:
        shell = (f"; guest shell socket {info['guest_socket']}" if info["guest_socket"] else
                 f"; guest agent: virsh qemu-agent-command {info['name']} ...")
        return (f"  serial log {info['serial_log']}{shell}; QEMU log {info['qemu_log']}\n"
                f"  root ports for dxpu attach: {', '.join(info['root_ports'])}")
    emit(args, info, text)
    return 0


def cmd_vm_undefine(args: argparse.Namespace) -> int:
    from dxpu_vfio.vms.libvirt_domain import undefine_domain
    info = undefine_domain(args.name, uri=args.uri)
    emit(args, info, lambda i: f"{i['name']}: {'destroyed and ' if i['destroyed'] else ''}undefined, files removed")
    return 0


def add_guest_options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--image and --accel, as every command that boots a guest takes them."""
    p.add_argument("--image", default="tiny", choices=["tiny", "full"])
    p.add_argument("--accel", default="tcg", choices=["tcg", "kvm"])
    return p


def register(sub: Subparsers) -> None:
    p = command(sub, "setup", cmd_setup, "install the QEMU sysroot and build guest images (idempotent)")
    p.add_argument("what", choices=["all", "qemu", "images"], nargs="?", default="all")
    p.add_argument("names", nargs="*", help="images to build (default: all)")
    p.add_argument("--rebuild", action="store_true", help="rebuild images even if up to date")

    p = command(sub, "doctor", cmd_doctor, "check this host: QEMU, accelerators, images, libvirtd, netns")
    p.add_argument("--accel", default="tcg", choices=["tcg", "kvm"])

    vm = group(sub, "vm", "run guests")
    p = add_guest_options(command(vm, "run", cmd_vm_run,
                                  "boot a guest, run one command in it, print its output; exit with its code"))
    p.add_argument("command")
    p.add_argument("--name", default="dxpu-run")
    p.add_argument("--memory", type=int, default=1024, help="MiB")
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--edu", action="store_true", help="add QEMU's edu device")
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--keep-logs", action="store_true", help="keep the guest's workdir (serial log, QEMU stderr)")

    p = add_guest_options(command(vm, "define", cmd_vm_define,
                                  "define a libvirt domain for dxpu (q35, shared memfd RAM, root ports, "
                                  "the QEMU from setup); start it with virsh start NAME"))
    p.add_argument("name")
    p.add_argument("--memory", type=int, default=1024, help="MiB")
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--root-ports", type=int, default=4, help="hot-pluggable pcie-root-ports")
    p.add_argument("--io-reserve", default="4K", help="port I/O window of each root port (0: none)")
    p.add_argument("--start", action="store_true", help="start the domain too")
    p.add_argument("--uri", default="qemu:///system", help="libvirt URI")

    p = command(vm, "undefine", cmd_vm_undefine,
                "destroy (if running) and undefine a domain dxpu defined; remove its files")
    p.add_argument("name")
    p.add_argument("--uri", default="qemu:///system", help="libvirt URI")
