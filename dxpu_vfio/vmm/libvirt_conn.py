"""Reaching libvirt: its daemons, a connection, a domain by name, a domain's QEMU log.

Shared by VM control (:mod:`dxpu_vfio.vmm.libvirt_target`) and the VM runner's domain
definitions (:mod:`dxpu_vfio.vms.libvirt_domain`); every failure says what to run.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dxpu_vfio.errors import SetupError, VmError
from dxpu_vfio.procs import terminate_pid
from dxpu_vfio.vmm.errors import LibvirtUnavailable, UnknownVm

DEFAULT_URI = "qemu:///system"
QEMU_LOG_DIR = Path("/var/log/libvirt/qemu")
INSTALL_HINT = "apt-get install libvirt-daemon-system libvirt-clients (scripts/setup.sh does)"


def qemu_log_path(name: str) -> Path:
    """libvirt's own log of the domain's QEMU (command line, stderr)."""
    return QEMU_LOG_DIR / f"{name}.log"


@dataclass(frozen=True)
class Daemon:
    name: str  # the binary, started with -d
    socket: Path
    pidfile: Path


DAEMONS = (  # virtlogd first: libvirtd hands QEMU's stderr to it
    Daemon("virtlogd", Path("/run/libvirt/virtlogd-sock"), Path("/run/virtlogd.pid")),
    Daemon("libvirtd", Path("/run/libvirt/libvirt-sock"), Path("/run/libvirtd.pid")),
)


@dataclass(frozen=True)
class StartedDaemon:
    name: str
    pid: int


def _answers(path: Path) -> bool:
    """True if something accepts connections on the UNIX socket (a stale file does not)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        try:
            sock.connect(str(path))
            return True
        except OSError:
            return False


def daemons_running() -> dict[str, bool]:
    return {d.name: _answers(d.socket) for d in DAEMONS}


def ensure_daemons(timeout: float = 30.0, log: Callable[[str], None] = lambda _m: None) -> list[StartedDaemon]:
    """Start virtlogd and libvirtd (``-d``) if their sockets do not answer.

    Returns what this call started, so that a caller (a test fixture) can stop exactly
    those with :func:`stop_daemons`; daemons that already ran are left alone.
    """
    started = []
    for daemon in DAEMONS:
        if _answers(daemon.socket):
            continue
        if not shutil.which(daemon.name):
            raise SetupError(f"{daemon.name} is not installed", hint=INSTALL_HINT)
        proc = subprocess.run([daemon.name, "-d"], capture_output=True, text=True, timeout=timeout, cwd="/")
        deadline = time.monotonic() + timeout
        while not _answers(daemon.socket):
            if time.monotonic() > deadline:
                raise SetupError(f"{daemon.name} -d did not open {daemon.socket} within {timeout:.0f} s "
                                 f"(exit {proc.returncode}: {proc.stderr.strip()[-400:]})",
                                 hint=f"run {daemon.name} -v in a terminal to see why")
            time.sleep(0.1)
        pid = int(daemon.pidfile.read_text().split()[0])
        log(f"libvirt: started {daemon.name} (pid {pid})")
        started.append(StartedDaemon(daemon.name, pid))
    return started


def stop_daemons(started: list[StartedDaemon]) -> None:
    """End the daemons :func:`ensure_daemons` started, by pid, libvirtd first."""
    for daemon in reversed(started):
        terminate_pid(daemon.pid, timeout=10)


def connect(uri: str = DEFAULT_URI):
    """A libvirt connection; :class:`VmError` with what to run if libvirtd is not there."""
    import libvirt
    libvirt.registerErrorHandler(lambda _ctx, _err: None, None)  # errors are raised, not printed
    try:
        return libvirt.open(uri)
    except libvirt.libvirtError as exc:
        if not daemons_running()["libvirtd"]:
            raise LibvirtUnavailable(f"cannot connect to libvirt at {uri}: libvirtd is not running "
                                     f"({exc.get_error_message()})",
                                     hint="virtlogd -d && libvirtd -d (dxpu vm define starts them)") from exc
        raise LibvirtUnavailable(f"cannot connect to libvirt at {uri}: {exc.get_error_message()}",
                                 hint="check the URI (qemu:///system) and libvirtd's log") from exc


def lookup(conn, name: str):
    """The domain called ``name``; :class:`UnknownVm` lists the domains there are."""
    import libvirt
    try:
        return conn.lookupByName(name)
    except libvirt.libvirtError as exc:
        if exc.get_error_code() != libvirt.VIR_ERR_NO_DOMAIN:
            raise VmError(f"libvirt lookup of {name!r} failed: {exc.get_error_message()}") from exc
        known = sorted(d.name() for d in conn.listAllDomains())
        raise UnknownVm(f"no libvirt domain {name!r} at {conn.getURI()} (known: {', '.join(known) or 'none'})",
                        hint="dxpu vm define NAME, or give a QMP socket path") from exc
