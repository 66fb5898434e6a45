"""The VM admin's commands: ``dxpu attach/detach/ls/status``, ``dxpu box``, ``dxpu manager``.

Every command but ``manager serve`` is a client of the running manager's API (so two
admins at once are serialised by the one process that owns the pool). ``--json``
prints what the API returned.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any, Callable

from dxpu_vfio.pool.service import ManagerClient


def _client(args: argparse.Namespace) -> ManagerClient:
    return ManagerClient(args.db)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.0f} {unit}"
        n /= 1024
    return str(n)


def _table(rows: list[dict], columns: list[str]) -> str:
    if not rows:
        return "  (none)"
    cells = [[str(r.get(c, "") if r.get(c) is not None else "-") for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  " + "  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _devices_text(devices: list[dict]) -> str:
    return _table([{**d, "capacity": _size(d["capacity"])} for d in devices],
                  ["lease", "device", "class", "vendor", "model", "capacity", "state", "qdev_id", "port"])


def cmd_attach(args: argparse.Namespace) -> int:
    from dxpu_vfio.cli import _emit
    result = _client(args).post("/v1/attach", vm=args.vm, **{"class": args.device_class}, count=args.count,
                                box=args.box, device=args.device, policy=args.policy)
    _emit(args, result, lambda r: f"attached to {args.vm}:\n{_devices_text(r)}")
    return 0


def cmd_detach(args: argparse.Namespace) -> int:
    from dxpu_vfio.cli import _emit
    if not args.device and not args.all:
        raise SystemExit("dxpu detach: name a device (lease id, BOX/DEVICE or device name) or pass --all")
    result = _client(args).post("/v1/detach", vm=args.vm, device=args.device, all=args.all or None)
    _emit(args, result, lambda r: "\n".join(
        f"detached {x['device']} (lease {x['lease']}) from {args.vm}" if x["why"] == "detached" else
        f"released {x['device']} (lease {x['lease']}): {x['why']}" for x in r) or f"{args.vm} held no devices")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    from dxpu_vfio.cli import _emit

    def text(r: dict) -> str:
        boxes = _table(r["boxes"], ["name", "address", "state", "devices", "leased", "last_error"])
        devices = _table([{**d, "capacity": _size(d["capacity"]),
                           "state": "leased" if d["lease"] else "free" if d["available"] else "unavailable"}
                          for d in r["devices"]], ["id", "class", "vendor", "model", "capacity", "state", "vm"])
        leases = _table(r["leases"], ["lease", "device", "vm", "state", "port", "proxy_pid"])
        return f"boxes:\n{boxes}\ndevices:\n{devices}\nleases:\n{leases}"
    _emit(args, _client(args).get("/v1/ls"), text)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from dxpu_vfio.cli import _emit

    def text(r: dict) -> str:
        head = f"{r['vm']}: {'running' if r['running'] else 'not running'}, {r['root_ports_free']} free root port(s)"
        rows = [{**d, "state": d["state"] + ("" if d.get("in_vm") else " (not in VM)")
                 + ("" if d["proxy_alive"] else " (proxy dead)") + ("" if d.get("link_up") else " (link down)")}
                for d in r["devices"]]
        return head + "\n" + _devices_text(rows)
    _emit(args, _client(args).get("/v1/status", vm=args.vm), text)
    return 0


def cmd_box(args: argparse.Namespace) -> int:
    from dxpu_vfio.cli import _emit
    if args.box_command == "add":
        result = _client(args).post("/v1/boxes", name=args.name, address=args.address, tls_dir=args.tls_dir)
        _emit(args, result, lambda r: f"box {r['box']} at {r['address']} registered with "
                                      f"{len(r['devices'])} device(s); certificate sha256 "
                                      f"{(r['certificate_sha256'] or 'none (plaintext)')[:16]}...:\n" + _table(
                                          [{**d, "capacity": _size(d["capacity"])} for d in r["devices"]],
                                          ["id", "class", "vendor", "model", "capacity"]))
    else:
        result = _client(args).post("/v1/boxes/remove", name=args.name)
        _emit(args, result, lambda r: f"box {r['removed']} removed from the pool")
    return 0


def cmd_manager(args: argparse.Namespace) -> int:
    from dxpu_vfio.cli import _emit
    if args.manager_command == "serve":
        from dxpu_vfio.pool.service import serve
        logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s: %(message)s")
        serve(args.db, heartbeat=args.heartbeat, dead_after=args.dead_after, metrics_address=args.metrics)
        return 0
    if args.manager_command == "metrics":
        print(_client(args).get("/metrics"), end="")
        return 0
    result = _client(args).post("/v1/reconcile")
    _emit(args, result, lambda r: "\n".join(f"{a['action']}: {a.get('device') or a.get('qdev_id')} "
                                            f"in {a['vm']} ({a['why']})" for a in r) or "nothing to reconcile")
    return 0


def add_commands(sub: Any, add: Callable[..., argparse.ArgumentParser]) -> None:
    """Register the pool commands on the top-level ``dxpu`` parser."""
    def with_db(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--db", default=None, help="pool database (default: $DXPU_POOL_DB or /var/lib/dxpu/pool.db)")
        return p

    vm_help = "the VM: its QMP socket path (e.g. a second -qmp monitor) or its libvirt domain name"
    p = with_db(add("attach", cmd_attach, "give a VM free devices from the pool (hot-plug)"))
    p.add_argument("vm", help=vm_help)
    p.add_argument("--class", dest="device_class", help="device class: nvme, testdev, display, external")
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--box", help="only devices of this GPU box")
    p.add_argument("--device", help="this device (BOX/DEVICE, or a device name)")
    p.add_argument("--policy", choices=["pack", "spread"], default="pack",
                   help="pack: fill boxes already lending first; spread: across boxes")

    p = with_db(add("detach", cmd_detach, "unplug devices from a VM and return them to the pool"))
    p.add_argument("vm", help=vm_help)
    p.add_argument("device", nargs="?", help="lease id, BOX/DEVICE or device name")
    p.add_argument("--all", action="store_true", help="every device the VM holds")

    with_db(add("ls", cmd_ls, "boxes, devices and leases of the pool"))
    p = with_db(add("status", cmd_status, "the devices a VM holds and whether they work"))
    p.add_argument("vm", help=vm_help)

    box = sub.add_parser("box", help="GPU boxes in the pool").add_subparsers(dest="box_command", required=True)
    p = with_db(box.add_parser("add", help="register a box: the manager fetches its inventory over mutual TLS"))
    p.add_argument("name")
    p.add_argument("address", help="HOST:PORT of its remote proxy")
    p.add_argument("--tls-dir", help="ca.pem + host.pem/host.key of the pool's CA (omit for a plaintext box)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_box)
    p = with_db(box.add_parser("rm", help="remove a box that lends no device"))
    p.add_argument("name")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_box)

    manager = sub.add_parser("manager", help="the pool manager service").add_subparsers(
        dest="manager_command", required=True)
    p = with_db(manager.add_parser("serve", help="run the manager: local API, heartbeats, reconciliation"))
    p.add_argument("--heartbeat", type=float, default=1.0, help="seconds between box probes")
    p.add_argument("--dead-after", type=float, default=3.0, help="a box unheard this long is down")
    p.add_argument("--metrics", help="also serve /metrics for Prometheus on HOST:PORT (no token)")
    p.add_argument("--log-level", default="WARNING")
    p.set_defaults(func=cmd_manager)
    p = with_db(manager.add_parser("metrics", help="print the Prometheus metrics"))
    p.set_defaults(func=cmd_manager)
    p = with_db(manager.add_parser("reconcile", help="make the store agree with what the VMs have, now"))
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_manager)
