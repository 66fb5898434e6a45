"""Parent-side handle on a host proxy process (:mod:`dxpu_vfio.hostproxy.main`): start it
(optionally inside a lab namespace), wait until it serves, read its counters and
screenshots, end it by pid.

Secret settings (the lease token) never go on the command line or into the environment,
which any local user can read (``ps``, /proc/PID/cmdline): the child reads them from a
pipe it inherits (``--secrets-fd``), once, at start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dxpu_vfio import registry
from dxpu_vfio.daemon import screenshot_error_path, screenshot_path
from dxpu_vfio.errors import DxpuError
from dxpu_vfio.procs import ChildProcess, RequestRefused, request_file, request_json, terminate
from dxpu_vfio.vfio_user.server import claim_socket_path


SECRET_SETTINGS = frozenset({"lease"})  # moved from settings to the secrets pipe


class HostProxyError(DxpuError):
    """The host proxy process failed to start or to stop."""


class HostProxyProcess(ChildProcess):
    """One host proxy process: start, stats, screenshot, stop by pid."""

    def __init__(self, model: str, socket_path: Path, *, settings: dict | None = None,
                 secrets: dict | None = None, log_path: Path | None = None, allow_msix: bool = False,
                 write_multiple: bool = False, name: str | None = None, netns: str | None = None,
                 dma_needs_fd: bool = False) -> None:
        self.model = model
        self.socket_path = Path(socket_path)
        settings = dict(settings or {})
        self.secrets = {**{k: settings.pop(k) for k in SECRET_SETTINGS & set(settings)}, **(secrets or {})}
        self.settings = settings
        self.stats_path = self.socket_path.with_suffix(".stats.json")
        self.log_path = log_path or self.socket_path.with_suffix(".log")
        self.allow_msix = allow_msix
        self.write_multiple = write_multiple
        self.dma_needs_fd = dma_needs_fd  # refuse DMA windows without a descriptor (tests)
        self.name = name or model
        self.netns = netns  # run inside this network namespace (the lab's host node)
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 15.0) -> "HostProxyProcess":
        try:
            claim_socket_path(self.socket_path)
        except OSError as exc:
            raise HostProxyError(str(exc), hint="detach the device using it, or pick another socket path") from exc
        argv = [sys.executable, "-m", "dxpu_vfio.hostproxy", "--model", self.model,
                "--socket", str(self.socket_path), "--stats", str(self.stats_path), "--name", self.name]
        argv += [a for k, v in self.settings.items() for a in ("--set", f"{k}={json.dumps(v)}")]
        argv += ["--allow-msix"] * self.allow_msix + ["--write-multiple"] * self.write_multiple
        argv += ["--dma-needs-fd"] * self.dma_needs_fd
        read_end = self._secrets_pipe() if self.secrets else None
        if read_end is not None:
            argv += ["--secrets-fd", str(read_end)]
        if self.netns:
            argv = ["ip", "netns", "exec", self.netns, *argv]  # execs: the pid stays the server's
        try:
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True,
                                                pass_fds=(read_end,) if read_end is not None else ())
        finally:
            if read_end is not None:
                os.close(read_end)
        deadline = time.monotonic() + timeout
        entry = registry.entry_path("host", self.name, self.process.pid)
        while not (self.socket_path.exists() and entry.exists()):  # serving, and known to the registry
            if not self.alive() or time.monotonic() > deadline:
                self.stop()
                raise HostProxyError(f"host proxy {self.model} did not open {self.socket_path}",
                                     logs=[self.log_path])
            time.sleep(0.02)
        return self

    def _secrets_pipe(self) -> int:
        """A pipe holding the secret settings as JSON, written and closed: its read end."""
        data = json.dumps(self.secrets).encode()
        read_end, write_end = os.pipe()
        try:
            if len(data) > 60000 or os.write(write_end, data) != len(data):  # a pipe holds 64 KiB unread
                raise HostProxyError("the host proxy's secret settings do not fit a pipe")
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        return read_end

    def stats(self, timeout: float = 5.0) -> dict:
        """Ask the server for its counters (SIGUSR1) and read them."""
        if not self.alive():
            raise HostProxyError(f"host proxy {self.model} is not running", logs=[self.log_path])
        stats = request_json(self.process.pid, self.stats_path, timeout)
        if stats is None:
            raise HostProxyError("host proxy did not write its stats", logs=[self.log_path])
        return stats

    def attach_error(self) -> str | None:
        """Why the device refused QEMU's attach, if it did (a box's external server that
        needs fd-mapped guest memory): for the error that reports a failed device_add."""
        try:
            return (self.stats(timeout=2.0).get("device") or {}).get("attach_error")
        except HostProxyError:
            return None

    def screenshot(self, timeout: float = 30.0) -> bytes:
        """The device's current scanout as PNG (display devices)."""
        path = screenshot_path(self.stats_path)
        try:
            png = request_file(self.process.pid, path, signal.SIGUSR2, timeout, error_path=screenshot_error_path(path)) \
                if self.alive() else None
        except RequestRefused as exc:
            raise HostProxyError(f"host proxy {self.name} cannot show its display: {exc}", logs=[self.log_path]) from exc
        if png is None:
            raise HostProxyError(f"host proxy {self.name} gave no screenshot (is it a display?)",
                                    logs=[self.log_path])
        return png

    def stop(self, timeout: float = 5.0) -> dict | None:
        """SIGTERM, then SIGKILL; returns the final counters if the server wrote them."""
        if self.process is None:
            return None
        terminate(self.process, timeout)
        registry.sweep()  # its entry, if it was killed and could not remove it
        self.socket_path.unlink(missing_ok=True)
        try:
            return json.loads(self.stats_path.read_text())
        except (OSError, ValueError):
            return None
        finally:
            png = screenshot_path(self.stats_path)
            for path in (self.stats_path, png, screenshot_error_path(png)):
                path.unlink(missing_ok=True)


