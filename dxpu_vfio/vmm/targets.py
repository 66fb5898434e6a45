"""A running VM as the pool manager sees it: a QEMU it can send QMP commands to.

An admin names a VM by its QMP socket path or by its libvirt domain name; both become a
:class:`VmTarget`. Everything the manager does to a VM (find a free root port,
``device_add`` a vfio-user device, ``device_del`` it and wait until QEMU let it go)
is written once here on top of :meth:`VmTarget.execute`; a backend only says how a
command reaches QEMU and how the end of an unplug is observed.
"""

from __future__ import annotations

import os
import socket
import stat
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Protocol

from dxpu_vfio.errors import DxpuError, VmError
from dxpu_vfio.paths import run_dir
from dxpu_vfio.vmm.qmp import QmpError, QmpSession, QmpTimeout


class Executor(Protocol):
    def execute(self, command: str, arguments: dict | None = None, timeout: float = 30) -> Any: ...


class VmGone(VmError):
    """The VM does not exist or does not run: whatever was plugged into it is gone too.

    Only this error lets the manager release a VM's leases without unplugging; any other
    failure to reach a VM (libvirtd down, a busy monitor) leaves them alone."""


class UnknownVm(VmGone):
    """The name is neither a QMP socket nor a libvirt domain."""


class HotplugError(DxpuError):
    """A hot-plug step failed; the message says which and what state things are in."""


class NoFreeRootPort(HotplugError):
    """Every hot-pluggable root port of the VM has a device below it."""


class UnplugTimeout(HotplugError):
    """The guest did not release the device in time; it is still plugged and served."""


def root_ports(qmp: Executor) -> list[str]:
    """Ids of the VM's pcie-root-ports (only they take hot-plugged devices), in order."""
    ports = [child["name"] for child in qmp.execute("qom-list", {"path": "/machine/peripheral"})
             if child.get("type") == "child<pcie-root-port>"]
    return sorted(ports, key=lambda name: (len(name), name))


def used_root_ports(qmp: Executor) -> set[str]:
    """Root ports with a device below them, from QEMU's own view (query-pci)."""
    used = set()
    for bus in qmp.execute("query-pci"):
        for dev in bus["devices"]:
            bridge = dev.get("pci_bridge")
            if bridge and dev.get("qdev_id") and bridge.get("devices"):
                used.add(dev["qdev_id"])
    return used


def free_root_port(qmp: Executor, vm_name: str, ports: list[str] | None = None) -> str:
    ports = root_ports(qmp) if ports is None else ports
    used = used_root_ports(qmp)
    for port in ports:
        if port not in used:
            return port
    raise NoFreeRootPort(f"VM {vm_name} has no free root port ({len(ports)} ports, all used: {sorted(used)})",
                         hint="detach a device, or give the VM more pcie-root-ports "
                              "(VmConfig.root_ports, dxpu vm define --root-ports N)")


def device_present(qmp: Executor, device_id: str) -> bool:
    return any(p["name"] == device_id for p in qmp.execute("qom-list", {"path": "/machine/peripheral"}))


def plugged_devices(qmp: Executor, prefix: str) -> list[str]:
    """Ids of devices in the VM whose id starts with ``prefix`` (the manager's own)."""
    return sorted(p["name"] for p in qmp.execute("qom-list", {"path": "/machine/peripheral"})
                  if p["name"].startswith(prefix))


class VmTarget(ABC):
    """One VM reachable for QMP commands; see the module docstring."""

    key: str   # how the store names it: "qmp:/abs/path" or "libvirt:name"
    name: str  # what the admin typed, for messages

    @abstractmethod
    def execute(self, command: str, arguments: dict | None = None, timeout: float = 30) -> Any:
        """Run one QMP command; :class:`QmpError` carries what was sent and received."""

    @abstractmethod
    def alive(self) -> bool: ...

    @abstractmethod
    def unplug(self, device_id: str, timeout: float) -> None:
        """``device_del`` and wait until QEMU removed the device (:class:`UnplugTimeout`)."""

    def socket_dir(self) -> Path:
        """Where host-proxy sockets for this VM go: a place its QEMU can connect to."""
        path = run_dir() / "pool"
        path.mkdir(exist_ok=True, mode=0o700)
        return path

    def close(self) -> None:
        pass

    def plug(self, device_id: str, port: str, socket_path: Path, timeout: float = 30.0) -> None:
        self.execute("device_add", {"driver": "vfio-user-pci", "id": device_id, "bus": port,
                                    "socket": {"type": "unix", "path": str(socket_path)}}, timeout=timeout)

    def __enter__(self) -> "VmTarget":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class QmpTarget(VmTarget):
    """A VM named by a QMP socket: one connection per use (QEMU serves one client per monitor)."""

    def __init__(self, path: Path, timeout: float = 10.0) -> None:
        self.path = Path(path).resolve()
        self.key = f"qmp:{self.path}"
        self.name = str(path)
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(str(self.path))
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            raise VmGone(f"no QEMU listens on {path} ({exc.strerror}): the VM has exited",
                         hint="start the VM; dxpu detach VM --all releases what it held") from exc
        finally:
            probe.close()
        self.session = QmpSession(f"pool-{self.path.parent.name}")
        try:
            self.session.connect(self.path, timeout=timeout, alive=lambda: True)
        except VmError as exc:
            self.session.close()
            raise VmError(f"cannot reach the QMP monitor {path}: is the VM running and is this "
                          f"socket free (QEMU serves one client per monitor)?",
                          hint="give the VM a monitor of its own for dxpu: "
                               "-qmp unix:PATH,server=on,wait=off") from exc

    def execute(self, command: str, arguments: dict | None = None, timeout: float = 30) -> Any:
        return self.session.execute(command, arguments, timeout)

    def alive(self) -> bool:
        try:
            self.execute("query-status", timeout=5)
            return True
        except QmpError:
            return False

    def unplug(self, device_id: str, timeout: float) -> None:
        deleted = lambda ev: ev.get("data", {}).get("device") == device_id  # noqa: E731
        with self.session.listen("DEVICE_DELETED") as events:
            try:
                self.execute("device_del", {"id": device_id}, timeout=timeout)
            except QmpError:
                if not device_present(self, device_id):
                    return  # already gone: nothing to wait for
                raise
            try:
                events.wait(timeout, deleted)
            except QmpTimeout as exc:
                raise UnplugTimeout(f"the guest of {self.name} did not release {device_id} within "
                                    f"{timeout:.0f} s; it stays plugged",
                                    hint="check the guest, then detach again") from exc

    def close(self) -> None:
        self.session.close()


def is_qmp_socket(name: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(name).st_mode)
    except OSError:
        return False


def open_target(name: str, *, libvirt_uri: str = "qemu:///system") -> VmTarget:
    """The VM an admin named: a QMP socket path, ``qmp:PATH``, or a libvirt domain name."""
    if name.startswith("qmp:"):
        name = name[4:]
    elif name.startswith("libvirt:"):
        from dxpu_vfio.vmm.libvirt_target import LibvirtTarget
        return LibvirtTarget(name[8:], uri=libvirt_uri)
    if is_qmp_socket(name):
        return QmpTarget(Path(name))
    if "/" in name:
        raise UnknownVm(f"no VM at {name}: not a UNIX socket", hint="give the VM's QMP socket path")
    from dxpu_vfio.vmm.libvirt_target import LibvirtTarget
    return LibvirtTarget(name, uri=libvirt_uri)


def target_key(name: str) -> str:
    """The store's name for a VM, worked out without reaching it (it may be gone)."""
    kind, sep, rest = name.partition(":")
    if sep and kind in ("qmp", "libvirt"):
        return f"qmp:{Path(rest).resolve()}" if kind == "qmp" else name
    if "/" in name or is_qmp_socket(name):
        return f"qmp:{Path(name).resolve()}"
    return f"libvirt:{name}"
