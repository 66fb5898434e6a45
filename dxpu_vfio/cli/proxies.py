"""The proxies' commands: ``dxpu remote serve`` (a GPU box), ``dxpu stats``, ``dxpu screenshot``,
``dxpu certs`` (the link's TLS)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dxpu_vfio.cli.commands import Subparsers, command, group
from dxpu_vfio.cli.output import emit, table
from dxpu_vfio.errors import DxpuError


def cmd_remote_serve(args: argparse.Namespace) -> int:
    """Run a remote proxy until SIGTERM/SIGINT; counters to --stats on SIGUSR1 and at exit."""
    from dxpu_vfio.remoteproxy.main import serve
    return serve(args.config, args.stats, as_json=args.json)


def _wrote(args: argparse.Namespace, png: bytes) -> int:
    Path(args.out).write_bytes(png)
    emit(args, {"device": args.device, "out": args.out, "bytes": len(png)},
         lambda d: f"wrote {d['out']} ({d['bytes']} bytes)")
    return 0


def cmd_screenshot(args: argparse.Namespace) -> int:
    """The scanout of a display device, rendered where its framebuffer lives, as PNG."""
    import signal

    from dxpu_vfio import registry
    from dxpu_vfio.daemon import screenshot_error_path, screenshot_path
    from dxpu_vfio.procs import RequestRefused, request_file
    if args.pool:  # a pooled display, by lease or BOX/DEVICE: the manager asks its box
        from dxpu_vfio.pool.service import ManagerClient
        return _wrote(args, ManagerClient(args.db).screenshot(args.device))
    box, _, dev = args.device.partition("/")
    found = False
    for entry in registry.entries():
        if entry["kind"] == "host" and entry["name"] == args.device:
            if entry.get("model") != "display":
                found = True  # a device of that name, but not a display: another may be
                continue
            path = screenshot_path(Path(entry["stats"]))
        elif entry["kind"] == "remote" and entry["name"] == box and dev:
            # boxes of one name in several labs: ask only one that serves the device (a box
            # asked for another's never writes the file, and each ask waits 30 s)
            if dev not in entry.get("devices", [dev]):
                continue
            if dev not in entry.get("displays", [dev]):
                found = True
                continue
            path = screenshot_path(Path(entry["stats"]), dev)
        else:
            continue
        try:  # a busy display renders slowly
            png = request_file(entry["pid"], path, signal.SIGUSR2, 30, error_path=screenshot_error_path(path))
        except RequestRefused as exc:
            raise DxpuError(f"{args.device} shows nothing a screenshot can take: {exc}",
                            hint="the guest's driver sets the mode; `dxpu stats --json` shows the device's mode") from exc
        if png is None:
            found = True
            continue
        return _wrote(args, png)
    if found:
        raise DxpuError(f"{args.device} gave no screenshot: is it a display device?",
                        hint="dxpu stats lists every device with its model")
    raise DxpuError(f"no running proxy serves {args.device!r}",
                    hint="see `dxpu stats` for the names (a host proxy's device id, or BOX/DEVICE on a GPU box)")


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
                # a forwarding device counts its reads itself (the native forwarder's bypass the server)
                "nonposted": device.get("reads", cmds.get("REGION_READ", {}).get("count", 0))
                + device.get("writes_nonposted", 0),
                "posted_writes": device.get("writes_posted", cmds.get("REGION_WRITE", {}).get("count", 0)),
                "dma_read_bytes": device.get("dma_bytes_read", (server.get("dma") or {}).get("bytes_read", 0)),
                "dma_write_bytes": device.get("dma_bytes_written", (server.get("dma") or {}).get("bytes_written", 0)),
                "irqs": device.get("irqs", sum((server.get("irqs") or {}).get(k, 0) for k in ("intx", "msi", "msix"))),
                "timeouts": link["timeouts"] if link else 0,
                "link_wait_us": round(sum(r["wait_us"] for r in link["requests"].values()), 1) if link else 0.0,
                "dma_refused": device.get("dma_refused", (server.get("dma") or {}).get("refused", 0)),
                "master_aborts": device.get("master_aborts", 0),
                "error_completions": device.get("error_completions", 0),  # the box refused (a completer abort)
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
                    "faults": dev.get("faults") or {},  # armed now, and hits per fault kind (docs/testing.md)
                })
    return rows


STATS_COLUMNS = ["proxy", "name", "model", "link", "nonposted", "posted_writes", "dma_read_bytes",
                 "dma_write_bytes", "irqs", "timeouts", "link_wait_us"]


def cmd_stats(args: argparse.Namespace) -> int:
    from dxpu_vfio import registry
    rows = stats_rows([(e, registry.collect(e)) for e in registry.entries()])
    emit(args, rows, lambda rows: table(rows, STATS_COLUMNS, indent="") if rows
         else "no proxies are running on this host")
    return 0


def cmd_certs(args: argparse.Namespace) -> int:
    from dxpu_vfio.link.transport import make_certs
    made = make_certs(Path(args.dir), args.roles)
    emit(args, {"dir": args.dir, "made": [str(p) for p in made]},
         lambda d: "\n".join(f"made {p}" for p in d["made"]) or f"certificates in {d['dir']} are up to date")
    return 0


def register(sub: Subparsers) -> None:
    from dxpu_vfio.remoteproxy.main import add_arguments
    remote = group(sub, "remote", "the remote proxy of a GPU box")
    add_arguments(command(remote, "serve", cmd_remote_serve,
                          "serve a box's devices over the link (TCP + mutual TLS)",
                          description="serve a box's devices over the link (TCP + mutual TLS) until SIGTERM; "
                                      "counters to --stats on SIGUSR1 and at exit"))

    command(sub, "stats", cmd_stats, "per-device counters of every host and remote proxy on this host")

    p = command(sub, "screenshot", cmd_screenshot, "a display device's current scanout as PNG")
    p.add_argument("device", help="host proxy device id (e.g. dxpu3), or BOX/DEVICE on a GPU box; "
                                  "with --pool a lease id or BOX/DEVICE of the pool")
    p.add_argument("out")
    p.add_argument("--pool", action="store_true", help="through the pool manager (fetched from the box over TLS)")
    p.add_argument("--db", default=None, help="with --pool: the pool database")

    p = command(sub, "certs", cmd_certs, "make a lab CA and certificates for hosts and boxes (openssl)")
    p.add_argument("dir")
    p.add_argument("roles", nargs="*", default=["host", "box1"], help="one certificate each (default: host box1)")
