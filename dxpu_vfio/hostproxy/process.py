"""A device model served over vfio-user in a process of its own.

Hot-plug needs the server to outlive the command that plugged it, and a server in its
own process keeps its latency away from the caller's Python threads. The parent talks
to it only through the process: it starts it, waits for its socket, asks for counters
with SIGUSR1 (written to ``--stats``), and ends it by pid with SIGTERM (then SIGKILL).

    python -m dxpu_vfio.hostproxy --model testdev --socket /tmp/d.sock [--set k=v ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from dxpu_vfio import registry
from dxpu_vfio.errors import DxpuError
from dxpu_vfio.procs import (ChildProcess, request_file, request_json, screenshot_path,
                             serve_until_terminated, terminate, write_bytes_atomic, write_json_atomic)


class DeviceServerError(DxpuError):
    """The device server process failed to start or to stop."""


def _parse_settings(items: list[str]) -> dict:
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


def remote_device(settings: dict):
    """Forward mode: the served device is a link to a remote proxy.

    settings: address "host:port", device, lease, and tls_dir (with tls_role, default
    "host") or plaintext=true; completion_timeout in seconds; coalesce (posted writes
    into fewer link messages; default: what the device asks for).
    """
    import errno

    from dxpu_vfio.hostproxy.forwarder import RemoteAttachError, connect_remote
    from dxpu_vfio.link.transport import TlsFiles

    try:
        plaintext = bool(settings.get("plaintext", False))
        tls = None if plaintext else TlsFiles.in_dir(Path(settings["tls_dir"]), settings.get("tls_role", "host"))
        deadline = time.monotonic() + 5
        while True:
            try:
                return connect_remote(settings["address"], settings["device"], str(settings["lease"]), tls,
                                      completion_timeout=float(settings.get("completion_timeout", 1.0)),
                                      coalesce=settings.get("coalesce"),
                                      on_down=lambda reason: logging.getLogger("dxpu.hostproxy").warning(
                                          "link down: %s", reason))
            except RemoteAttachError as exc:
                # the previous holder's link may be closing right now: busy is transient
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    except KeyError as exc:
        raise SystemExit(f"remote device needs setting {exc}")


def main(argv: list[str] | None = None) -> int:
    from qemu_device.models import create_model

    from dxpu_vfio.vfio_user.server import ServerOptions, VfioUserServer

    parser = argparse.ArgumentParser(description="serve one device model over vfio-user")
    parser.add_argument("--model", required=True)
    parser.add_argument("--socket", required=True, type=Path)
    parser.add_argument("--name", default=None)
    parser.add_argument("--stats", type=Path, help="where SIGUSR1 and exit write counters (JSON)")
    parser.add_argument("--set", action="append", default=[], help="model option key=value")
    parser.add_argument("--allow-msix", action="store_true")
    parser.add_argument("--write-multiple", action="store_true")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s: %(message)s")

    settings = _parse_settings(args.set)
    try:
        device = remote_device(settings) if args.model == "remote" else create_model(args.model, **settings)
    except Exception as exc:  # noqa: BLE001 - reported to the parent through the log
        print(f"device server: cannot create {args.model}: {exc}", file=sys.stderr, flush=True)
        return 3
    server = VfioUserServer(device, args.socket, name=args.name or args.model,
                            options=ServerOptions(advertise_write_multiple=args.write_multiple or bool(
                                getattr(device, "coalesce_posted", False)),
                                                  allow_msix=args.allow_msix))
    def write_stats() -> None:
        if args.stats:
            write_json_atomic(args.stats, {"pid": os.getpid(), "server": server.snapshot(),
                                           "device": device.stats() if hasattr(device, "stats") else
                                           {"suppressed_interrupts": device.suppressed_interrupts}})

    server.start()
    entry = registry.register("host", server.name, args.stats, model=args.model,
                              socket=str(args.socket)) if args.stats else None
    def screenshots() -> None:
        if args.stats and hasattr(device, "render_png"):
            write_bytes_atomic(screenshot_path(args.stats), device.render_png())

    try:
        serve_until_terminated(write_stats, entry, screenshots)
    finally:
        server.stop()
    return 0


class DeviceServerProcess(ChildProcess):
    """Parent-side handle on a device server process: start, stats, stop by pid."""

    def __init__(self, model: str, socket_path: Path, *, settings: dict | None = None,
                 log_path: Path | None = None, allow_msix: bool = False,
                 write_multiple: bool = False, name: str | None = None, netns: str | None = None) -> None:
        self.model = model
        self.socket_path = Path(socket_path)
        self.settings = settings or {}
        self.stats_path = self.socket_path.with_suffix(".stats.json")
        self.log_path = log_path or self.socket_path.with_suffix(".log")
        self.allow_msix = allow_msix
        self.write_multiple = write_multiple
        self.name = name or model
        self.netns = netns  # run inside this network namespace (the lab's host node)
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 15.0) -> "DeviceServerProcess":
        from dxpu_vfio.vfio_user.server import claim_socket_path
        try:
            claim_socket_path(self.socket_path)
        except OSError as exc:
            raise DeviceServerError(str(exc), hint="detach the device using it, or pick another socket path") from exc
        argv = [sys.executable, "-m", "dxpu_vfio.hostproxy", "--model", self.model,
                "--socket", str(self.socket_path), "--stats", str(self.stats_path), "--name", self.name]
        argv += [a for k, v in self.settings.items() for a in ("--set", f"{k}={json.dumps(v)}")]
        argv += ["--allow-msix"] * self.allow_msix + ["--write-multiple"] * self.write_multiple
        if self.netns:
            argv = ["ip", "netns", "exec", self.netns, *argv]  # execs: the pid stays the server's
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self.socket_path.exists():
            if not self.alive() or time.monotonic() > deadline:
                self.stop()
                raise DeviceServerError(f"device server {self.model} did not open {self.socket_path}",
                                        logs=[self.log_path])
            time.sleep(0.02)
        return self

    def stats(self, timeout: float = 5.0) -> dict:
        """Ask the server for its counters (SIGUSR1) and read them."""
        if not self.alive():
            raise DeviceServerError(f"device server {self.model} is not running", logs=[self.log_path])
        stats = request_json(self.process.pid, self.stats_path, timeout)
        if stats is None:
            raise DeviceServerError("device server did not write its stats", logs=[self.log_path])
        return stats

    def screenshot(self, timeout: float = 30.0) -> bytes:
        """The device's current scanout as PNG (display devices)."""
        import signal as _signal
        png = request_file(self.process.pid, screenshot_path(self.stats_path), _signal.SIGUSR2, timeout) \
            if self.alive() else None
        if png is None:
            raise DeviceServerError(f"device server {self.name} gave no screenshot (is it a display?)",
                                    logs=[self.log_path])
        return png

    def stop(self, timeout: float = 5.0) -> dict | None:
        """SIGTERM, then SIGKILL; returns the final counters if the server wrote them."""
        if self.process is None:
            return None
        terminate(self.process, timeout)
        self.socket_path.unlink(missing_ok=True)
        try:
            return json.loads(self.stats_path.read_text())
        except (OSError, ValueError):
            return None
        finally:
            self.stats_path.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
