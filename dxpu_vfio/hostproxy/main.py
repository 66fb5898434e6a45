"""The host proxy process: one device served over vfio-user to one QEMU.

Hot-plug needs the server to outlive the command that plugged it, and a server in its
own process keeps its latency away from the caller's Python threads. The device is a
local model (``--model testdev``) or, in forward mode (``--model remote``), a device of
a GPU box reached over the link (:mod:`dxpu_vfio.hostproxy.forwarder`). The parent
(:class:`dxpu_vfio.hostproxy.process.HostProxyProcess`) starts it, waits for its socket,
asks for counters with SIGUSR1 and ends it by pid.

    python -m dxpu_vfio.hostproxy --model testdev --socket /tmp/d.sock [--set k=v ...]
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
import time
from pathlib import Path

from dxpu_vfio.daemon import run_until_terminated
from dxpu_vfio.hostproxy.forwarder import DEFAULT_READ_SPIN_US, RemoteAttachError, RemoteFunction, connect_remote
from dxpu_vfio.link.transport import TlsFiles
from dxpu_vfio.vfio_user.server import ServerOptions, VfioUserServer
from qemu_device.models import create_model


def parse_settings(items: list[str]) -> dict:
    """``--set key=value``: values are JSON where they parse as JSON, else strings."""
    settings = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set wants key=value, got {item!r}")
        try:
            settings[key] = json.loads(value)
        except ValueError:
            settings[key] = value  # a bare string typed by hand
    return settings


def read_secrets(fd: int) -> dict:
    """The secret settings the parent wrote into an inherited pipe (never argv or env)."""
    chunks = []
    with os.fdopen(fd, "rb") as pipe:
        while chunk := pipe.read(65536):
            chunks.append(chunk)
    try:
        secrets = json.loads(b"".join(chunks))
    except ValueError as exc:
        raise SystemExit(f"--secrets-fd {fd}: not JSON: {exc}")
    if not isinstance(secrets, dict):
        raise SystemExit(f"--secrets-fd {fd}: not a JSON object")
    return secrets


def remote_device(settings: dict) -> RemoteFunction:
    """Forward mode: the served device is a link to a remote proxy.

    settings: address "host:port", device, lease (the token: through --secrets-fd), and
    tls_dir (with tls_role, default "host") or plaintext=true; box_sha256 (the box's
    certificate must be this one); completion_timeout in seconds; spin_us (spin before every
    sleep on the link, default 0) and read_spin_us (for a read's completion only, while reads
    come back within it; default 150, 0 off); coalesce (posted writes
    into fewer link messages; default: what the device asks for); map_bars (default true:
    host-mappable BARs are shadowed for QEMU to map) and writeback_hz (their write-back
    rate, default 60; hostproxy/shadow.py).
    """
    try:
        plaintext = bool(settings.get("plaintext", False))
        tls = None if plaintext else TlsFiles.in_dir(Path(settings["tls_dir"]), settings.get("tls_role", "host"))
        deadline = time.monotonic() + 5
        while True:
            try:
                return connect_remote(settings["address"], settings["device"], str(settings["lease"]), tls,
                                      completion_timeout=float(settings.get("completion_timeout", 1.0)),
                                      coalesce=settings.get("coalesce"),
                                      spin_us=float(settings.get("spin_us", 0.0)),
                                      read_spin_us=float(settings.get("read_spin_us", DEFAULT_READ_SPIN_US)),
                                      box_sha256=settings.get("box_sha256"),
                                      writeback_hz=float(settings.get("writeback_hz", 60.0)),
                                      map_bars=bool(settings.get("map_bars", True)),
                                      on_down=lambda reason: logging.getLogger("dxpu.hostproxy").warning(
                                          "link down: %s", reason))
            except RemoteAttachError as exc:
                # the previous holder's link may be closing right now: busy is transient
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    except KeyError as exc:
        raise SystemExit(f"remote device needs setting {exc}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dxpu_vfio.hostproxy",
                                     description="serve one device (a local model, or a GPU box's device "
                                                 "with --model remote) to QEMU over vfio-user")
    parser.add_argument("--model", required=True, help="testdev, nvme, display, accel, ... or remote (forward mode)")
    parser.add_argument("--socket", required=True, type=Path, help="vfio-user socket QEMU connects to")
    parser.add_argument("--name", default=None, help="device name in dxpu stats (default: the model)")
    parser.add_argument("--stats", type=Path, help="where SIGUSR1 and exit write counters (JSON)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="model option (forward mode: address, device, lease, tls_dir, ...)")
    parser.add_argument("--secrets-fd", type=int, default=None, metavar="FD",
                        help="read secret settings (JSON: lease) from this inherited descriptor, then close it")
    parser.add_argument("--allow-msix", action="store_true", help="offer MSI-X (QEMU 11.1 aborts on its unplug)")
    parser.add_argument("--write-multiple", action="store_true", help="offer REGION_WRITE_MULTI")
    parser.add_argument("--dma-needs-fd", action="store_true",
                        help="refuse DMA windows without a file descriptor (acts as a server that needs "
                             "fd-mapped guest memory)")
    parser.add_argument("--log-level", default="WARNING")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s: %(message)s")
    settings = parse_settings(args.set)
    if args.secrets_fd is not None:
        settings.update(read_secrets(args.secrets_fd))
    try:
        device = remote_device(settings) if args.model == "remote" else create_model(args.model, **settings)
    except Exception as exc:  # noqa: BLE001 - reported to the parent through the log
        print(f"host proxy: cannot create {args.model}: {exc}", file=sys.stderr, flush=True)
        return 3
    server = VfioUserServer(device, args.socket, name=args.name or args.model,
                            options=ServerOptions(advertise_write_multiple=args.write_multiple or bool(
                                device.coalesce_posted), allow_msix=args.allow_msix,
                                dma_needs_fd=args.dma_needs_fd))

    def snapshot() -> dict:
        return {"pid": os.getpid(), "server": server.snapshot(),
                "device": device.stats()}

    def screenshots():
        if device.renders_screen:
            yield None, device.render_png

    server.start()
    try:
        run_until_terminated("host", server.name, args.stats, snapshot, screenshots=screenshots,
                             model=args.model, socket=str(args.socket))
    finally:
        server.stop()
    return 0
