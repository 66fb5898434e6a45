"""The VM admin's commands: ``dxpu attach/detach/ls/status``, ``dxpu box``, ``dxpu manager``.

Every command but ``manager serve`` is a client of the running manager's API (so two
admins at once are serialised by the one process that owns the pool). ``--json``
prints what the API returned; the text is made from the fields the manager of the same
version writes, and an answer without them (a manager of another version) is an error
that says so (:func:`_emit`).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

from dxpu_vfio.cli.commands import Subparsers, command, group
from dxpu_vfio.cli.output import emit, setup_logging, size, table
from dxpu_vfio.errors import DxpuError
from dxpu_vfio.pool.service import ManagerClient, ManagerError


def _client(args: argparse.Namespace) -> ManagerClient:
    return ManagerClient(args.db)


def _emit(args: argparse.Namespace, data: object, text: Callable[[Any], str]) -> None:
    """:func:`emit` of a manager's answer: as it came with ``--json``; as text only if it
    has what the text is made of, else a ManagerError that says what was missing and how
    to see the answer anyway."""
    try:
        emit(args, data, text)
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
        raise ManagerError(f"the manager's answer lacks what {args.command_name} prints "
                           f"({type(exc).__name__}: {exc!s:.100}): {str(data)[:200]}",
                           hint="a manager of another version: restart it (dxpu manager serve); "
                                "--json prints its answer as it came") from exc


def _sized(devices: list[dict]) -> list[dict]:
    return [{**d, "capacity": size(d["capacity"])} for d in devices]


def _devices_text(devices: list[dict]) -> str:
    return table(_sized(devices),
                 ["lease", "device", "class", "vendor", "model", "capacity", "state", "qdev_id", "port"])


def _step_text(step: dict) -> str:
    """One step of a --dry-run plan, on one line (or a few, for a transaction)."""
    import json
    if step["do"] == "qmp":
        return f"qmp: {json.dumps({'execute': step['execute'], 'arguments': step['arguments']})}"
    text = f"{step['do']}: {step.get('what', '')}"
    if "request" in step:
        text += f" {step['box']} {json.dumps(step['request'])}"
    if "command" in step:
        text += "\n    " + " ".join(step["command"])
    txn = step.get("transaction")
    if isinstance(txn, dict):
        text += "".join(f"\n    if {c}" for c in txn["compare"]) + "".join(f"\n    then {o}" for o in txn["success"])
    elif txn:
        text += "".join(f"\n    {statement}" for statement in txn)
    return text


def _plan_text(plan: dict) -> str:
    return (f"dry run (nothing done): for {plan['vm']} on host {plan['host']}:\n"
            + "\n".join(f"{i}. {_step_text(step)}" for i, step in enumerate(plan["steps"], 1)))


def cmd_attach(args: argparse.Namespace) -> int:
    result = _client(args).post("/v1/attach", vm=args.vm, **{"class": args.device_class}, count=args.count,
                                box=args.box, device=args.device, policy=args.policy, host=args.host,
                                dry_run=args.dry_run or None)
    _emit(args, result, _plan_text if args.dry_run else lambda r: f"attached to {args.vm}:\n{_devices_text(r)}")
    return 0


def cmd_detach(args: argparse.Namespace) -> int:
    if not args.device and not args.all:
        raise DxpuError("name a device to detach (lease id, BOX/DEVICE or device name), or pass --all",
                        hint=f"dxpu status {args.vm} lists its devices")
    result = _client(args).post("/v1/detach", vm=args.vm, device=args.device, all=args.all or None, host=args.host,
                                dry_run=args.dry_run or None)
    if args.dry_run:
        _emit(args, result, _plan_text)
        return 0
    _emit(args, result, lambda r: "\n".join(
        f"detached {x['device']} (lease {x['lease']}) from {args.vm}" if x["why"] == "detached" else
        f"released {x['device']} (lease {x['lease']}): {x['why']}" for x in r) or f"{args.vm} held no devices")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    def text(r: dict) -> str:
        boxes = table(r["boxes"], ["name", "address", "state", "devices", "leased", "last_error"])
        devices = table([{**d, "state": "leased" if d["lease"] else "free" if d["available"] else "unavailable"}
                         for d in _sized(r["devices"])], ["id", "class", "vendor", "model", "capacity", "state", "vm"])
        leases = table(r["leases"], ["lease", "device", "vm", "state", "port", "proxy_pid"])
        return f"boxes:\n{boxes}\ndevices:\n{devices}\nleases:\n{leases}"
    _emit(args, _client(args).get("/v1/ls"), text)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    def text(r: dict) -> str:
        head = f"{r['vm']}: {'running' if r['running'] else 'not running'}, {r['root_ports_free']} free root port(s)"
        rows = [{**d, "state": d["state"] + ("" if d.get("in_vm") else " (not in VM)")
                 + ("" if d["proxy_alive"] else " (proxy dead)") + ("" if d.get("link_up") else " (link down)")}
                for d in r["devices"]]
        return head + "\n" + _devices_text(rows)
    _emit(args, _client(args).get("/v1/status", vm=args.vm), text)
    return 0


def cmd_box_add(args: argparse.Namespace) -> int:
    result = _client(args).post("/v1/boxes", name=args.name, address=args.address, tls_dir=args.tls_dir)
    _emit(args, result, lambda r: f"box {r['box']} at {r['address']} registered with "
                                 f"{len(r['devices'])} device(s); certificate sha256 "
                                 f"{(r['certificate_sha256'] or 'none (plaintext)')[:16]}...:\n"
                                 + table(_sized(r["devices"]), ["id", "class", "vendor", "model", "capacity"]))
    return 0


def cmd_box_rm(args: argparse.Namespace) -> int:
    result = _client(args).post("/v1/boxes/remove", name=args.name)
    _emit(args, result, lambda r: f"box {r['removed']} removed from the pool")
    return 0


def cmd_manager_serve(args: argparse.Namespace) -> int:
    """Until SIGTERM/SIGINT; its log (the "manager serving" line first) on stderr, JSON lines with --json."""
    from dxpu_vfio.pool.service import serve
    setup_logging(args, args.log_level)
    from dxpu_vfio.pool.etcd_client import endpoints_from
    serve(args.db, heartbeat=args.heartbeat, dead_after=args.dead_after, metrics_address=args.metrics,
          store=args.store, etcd_endpoints=endpoints_from(args.etcd_endpoints), etcd_tls_dir=args.etcd_tls_dir,
          host=args.host)
    return 0


def cmd_manager_metrics(args: argparse.Namespace) -> int:
    _emit(args, {"metrics": _client(args).get("/metrics")}, lambda r: r["metrics"].rstrip("\n"))
    return 0


def cmd_manager_reconcile(args: argparse.Namespace) -> int:
    result = _client(args).post("/v1/reconcile", dry_run=args.dry_run or None)
    _emit(args, result, lambda r: ("dry run (nothing done):\n" if args.dry_run else "") + ("\n".join(
        f"{a['action']}: {a.get('device') or a.get('qdev_id')} in {a['vm']} ({a['why']})"
        + "".join(f"\n  {i}. {_step_text(step)}" for i, step in enumerate(a.get("plan", []), 1))
        for a in r) or "nothing to reconcile"))
    return 0


def cmd_host_ls(args: argparse.Namespace) -> int:
    def text(r: list) -> str:
        return table([{**h, "agent": "alive" if h["alive"] else "none", "state": "fenced" if h["fenced"] else "-"}
                      for h in r], ["name", "agent", "state", "leases", "holder", "agent_pid"])
    _emit(args, _client(args).get("/v1/hosts"), text)
    return 0


def cmd_host_fence(args: argparse.Namespace) -> int:
    result = _client(args).post("/v1/hosts/fence", host=args.host)

    def text(r: dict) -> str:
        lines = [f"host {r['host']} fenced: it gets no device until dxpu host unfence {r['host']}"]
        lines += [f"  took {x['device']} (lease {x['lease']}, VM {x['vm']}, fence {x['fence']}): token {x['token']}"
                  for x in r["leases"]] or ["  it held no lease"]
        return "\n".join(lines)
    _emit(args, result, text)
    return 0


def cmd_host_unfence(args: argparse.Namespace) -> int:
    result = _client(args).post("/v1/hosts/unfence", host=args.host)
    _emit(args, result, lambda r: f"host {r['host']} is no longer fenced")
    return 0


def cmd_agent_serve(args: argparse.Namespace) -> int:
    """Until SIGTERM/SIGINT, or until the host is fenced (exit 3: it must not plug anything)."""
    import signal
    from dxpu_vfio.pool.agent import HostAgent
    from dxpu_vfio.pool.etcd_client import endpoints_from
    from dxpu_vfio.pool.manager import default_host
    from dxpu_vfio.pool.service import ManagerPaths, open_store
    setup_logging(args, args.log_level)
    store = open_store(args.store, db=ManagerPaths.for_db(args.db).db, endpoints=endpoints_from(args.etcd_endpoints),
                       tls_dir=args.etcd_tls_dir)
    agent = HostAgent(store, args.host or default_host(), ttl=args.ttl, resync=args.resync).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: agent._stop.set())
    try:
        agent.wait()
    finally:
        agent.stop()
        store.close()
    if agent.lost:
        raise DxpuError(agent.lost, hint=f"dxpu host ls; once its VMs are gone: dxpu host unfence {agent.host}")
    return 0


def _with_db(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--db", default=None, help="pool database (default: $DXPU_POOL_DB or /var/lib/dxpu/pool.db)")
    return p


def register(sub: Subparsers) -> None:
    vm_help = "the VM: its QMP socket path (e.g. a second -qmp monitor) or its libvirt domain name"
    p = _with_db(command(sub, "attach", cmd_attach, "give a VM free devices from the pool (hot-plug)"))
    p.add_argument("vm", help=vm_help)
    p.add_argument("--class", dest="device_class", help="device class: nvme, testdev, display, accel, external")
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--box", help="only devices of this GPU box")
    p.add_argument("--device", help="this device (BOX/DEVICE, or a device name)")
    p.add_argument("--policy", choices=["pack", "spread"], default="pack",
                   help="pack: fill boxes already lending first; spread: across boxes")
    p.add_argument("--host", help="the VM runs on this host of the pool: its agent plugs the device")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (store transaction, box requests, QMP commands) and do nothing")

    p = _with_db(command(sub, "detach", cmd_detach, "unplug devices from a VM and return them to the pool"))
    p.add_argument("vm", help=vm_help)
    p.add_argument("device", nargs="?", help="lease id, BOX/DEVICE or device name")
    p.add_argument("--all", action="store_true", help="every device the VM holds")
    p.add_argument("--host", help="the VM runs on this host of the pool: its agent unplugs the device")
    p.add_argument("--dry-run", action="store_true", help="print the plan and do nothing")

    _with_db(command(sub, "ls", cmd_ls, "boxes, devices and leases of the pool"))
    p = _with_db(command(sub, "status", cmd_status, "the devices a VM holds and whether they work"))
    p.add_argument("vm", help=vm_help)

    box = group(sub, "box", "GPU boxes in the pool")
    p = _with_db(command(box, "add", cmd_box_add, "register a box: the manager fetches its inventory over mutual TLS"))
    p.add_argument("name")
    p.add_argument("address", help="HOST:PORT of its remote proxy")
    p.add_argument("--tls-dir", help="ca.pem + host.pem/host.key of the pool's CA (omit for a plaintext box)")
    p = _with_db(command(box, "rm", cmd_box_rm, "remove a box that lends no device"))
    p.add_argument("name")

    host = group(sub, "host", "hosts of the pool: their agents, fencing")
    _with_db(command(host, "ls", cmd_host_ls, "hosts, whether their agent is alive, whether they are fenced"))
    p = _with_db(command(host, "fence", cmd_host_fence,
                         "fence a dead host: take its leases, revoke its tokens at the boxes, cut its links",
                         description="Fence HOST: the pool gives it no device, takes every lease it holds "
                                     "(its devices go back to the pool), and revokes their tokens at the boxes, "
                                     "which cuts the host's live links and refuses its old tokens. Its VMs lose "
                                     "those devices. Use it for a host whose agent died, once you accept that."))
    p.add_argument("host", help="the host's name in the pool (dxpu host ls)")
    p = _with_db(command(host, "unfence", cmd_host_unfence, "let a fenced host get devices again"))
    p.add_argument("host")

    agent = group(sub, "agent", "the host agent: plugs the pool's devices into this host's VMs")
    p = _with_db(command(agent, "serve", cmd_agent_serve,
                         "run this host's agent: hold the host lease, serve lease records for this host"))
    p.add_argument("--host", default=None, help="this host's name in the pool (default $DXPU_HOST or the hostname)")
    p.add_argument("--ttl", type=float, default=10.0, help="seconds the host lease lives without a keepalive")
    p.add_argument("--resync", type=float, default=30.0,
                   help="etcd: seconds between full reads of the lease records (a watch drives the agent meanwhile)")
    p.add_argument("--store", choices=["sqlite", "etcd"], default=os.environ.get("DXPU_POOL_STORE") or "sqlite")
    p.add_argument("--etcd-endpoints", default=None, metavar="URL,URL")
    p.add_argument("--etcd-tls-dir", default=None, metavar="DIR")
    p.add_argument("--log-level", default="WARNING")

    manager = group(sub, "manager", "the pool manager service")
    p = _with_db(command(manager, "serve", cmd_manager_serve, "run the manager: local API, heartbeats, reconciliation"))
    p.add_argument("--heartbeat", type=float, default=1.0, help="seconds between box probes")
    p.add_argument("--dead-after", type=float, default=3.0, help="a box unheard this long is down")
    p.add_argument("--metrics", help="also serve /metrics for Prometheus on HOST:PORT (no token)")
    p.add_argument("--store", choices=["sqlite", "etcd"], default=os.environ.get("DXPU_POOL_STORE") or "sqlite",
                   help="where the pool's state lives (default $DXPU_POOL_STORE or sqlite: the --db file)")
    p.add_argument("--etcd-endpoints", default=None, metavar="URL,URL",
                   help="etcd client URLs for --store etcd (default $DXPU_ETCD_ENDPOINTS)")
    p.add_argument("--etcd-tls-dir", default=None, metavar="DIR",
                   help="ca.pem + host.pem/host.key for etcd over https with client certificates")
    p.add_argument("--host", default=None, help="this host's name in the pool (default $DXPU_HOST or the hostname)")
    p.add_argument("--log-level", default="WARNING")
    _with_db(command(manager, "metrics", cmd_manager_metrics, "print the Prometheus metrics"))
    p = _with_db(command(manager, "reconcile", cmd_manager_reconcile,
                         "make the store agree with what the VMs have, now"))
    p.add_argument("--dry-run", action="store_true", help="print what it would do, and the steps, and do nothing")
