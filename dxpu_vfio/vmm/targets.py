"""A running VM as VM control sees it: a QEMU it can send QMP commands to.

:class:`VmTarget` is the one place where a vfio-user device is hot-plugged
(:meth:`~VmTarget.plug`: ``device_add``, synchronous, the server must already listen)
and unplugged (:meth:`~VmTarget.unplug`: ``device_del``, then wait until QEMU let the
device go). Implementations only say how a command reaches QEMU and how the end of an
unplug is observed: :class:`SessionTarget` over a QMP session someone already holds
(the VM runner's), :class:`QmpTarget` over a QMP socket it opens itself, and
:class:`dxpu_vfio.vmm.libvirt_target.LibvirtTarget` through libvirt.
"""

from __future__ import annotations

import logging
import socket
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from dxpu_vfio.errors import DxpuError, VmError
from dxpu_vfio.paths import run_dir
from dxpu_vfio.vmm.errors import UnplugTimeout, VmGone
from dxpu_vfio.vmm.qmp import QmpError, QmpSession, QmpTimeout
from dxpu_vfio.vmm.rootports import device_class, device_present

log = logging.getLogger("dxpu.vmm")


class VmTarget(ABC):
    """One VM reachable for QMP commands; see the module docstring."""

    key: str   # how the pool's store names it: "qmp:/abs/path" or "libvirt:name"
    name: str  # what the admin typed, for messages

    @abstractmethod
    def execute(self, command: str, arguments: dict | None = None, timeout: float = 30) -> Any:
        """Run one QMP command; :class:`QmpError` carries what was sent and received."""

    @abstractmethod
    def alive(self) -> bool: ...

    @abstractmethod
    def unplug(self, device_id: str, timeout: float, *, request: bool = True) -> None:
        """``device_del`` and wait until QEMU removed the device (:class:`UnplugTimeout`,
        the device then stays plugged). ``request=False`` only waits: for a removal asked
        for earlier that timed out. A device that is already gone returns at once."""

    def socket_dir(self) -> Path:
        """Where host-proxy sockets for this VM go: a place its QEMU can connect to."""
        path = run_dir() / "pool"
        path.mkdir(exist_ok=True, mode=0o700)
        return path

    def close(self) -> None:
        pass

    def plug(self, device_id: str, port: str, socket_path: Path, timeout: float = 30.0,
             extra_props: dict | None = None) -> None:
        """``device_add`` of a vfio-user-pci device below root port ``port``; warns when the
        device reports class 0x000000 (see :func:`warn_if_classless`)."""
        self.execute("device_add", {"driver": "vfio-user-pci", "id": device_id, "bus": port,
                                    "socket": {"type": "unix", "path": str(socket_path)}, **(extra_props or {})},
                     timeout=timeout)
        warn_if_classless(self, device_id)

    def __enter__(self) -> "VmTarget":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def warn_if_classless(target: VmTarget, device_id: str) -> bool:
    """Linux assigns no BARs to a hot-plugged device of class 0x000000 (a pre-2.0 "device
    built before class codes"), so the guest sees it but cannot reach its registers; say
    so at attach, where it can still be fixed (the device's class code). True if warned."""
    try:
        cls = device_class(target, device_id)
    except (DxpuError, OSError, KeyError, TypeError, ValueError):
        return False  # the plug itself succeeded; the check is only advice
    if cls != 0:
        return False
    log.warning("%s: device %s reports PCI class 0x000000; Linux assigns no BARs to a classless hot-plugged "
                "device, so the guest cannot use its regions: give the device a class code", target.name, device_id)
    return True


class SessionTarget(VmTarget):
    """A VM behind a connected :class:`QmpSession` (the caller owns the session)."""

    def __init__(self, session: QmpSession, name: str, key: str | None = None) -> None:
        self.session = session
        self.name = name
        self.key = key or f"qmp:{name}"

    def execute(self, command: str, arguments: dict | None = None, timeout: float = 30) -> Any:
        return self.session.execute(command, arguments, timeout)

    def alive(self) -> bool:
        try:
            self.execute("query-status", timeout=5)
            return True
        except QmpError:
            return False

    def unplug(self, device_id: str, timeout: float, *, request: bool = True) -> None:
        deleted = lambda ev: ev.get("data", {}).get("device") == device_id  # noqa: E731
        with self.session.listen("DEVICE_DELETED") as events:  # listening before device_del
            if request:
                try:
                    self.execute("device_del", {"id": device_id}, timeout=timeout)
                except QmpError:
                    if not device_present(self, device_id):
                        return  # already gone: nothing to wait for
                    raise
            elif not device_present(self, device_id):
                return  # the removal finished while nobody was waiting
            try:
                events.wait(timeout, deleted)
            except QmpTimeout as exc:
                raise UnplugTimeout(f"the guest of {self.name} did not release {device_id} within "
                                    f"{timeout:.0f} s; it stays plugged",
                                    hint="check the guest, then detach again (or stop the VM)") from exc


class QmpTarget(SessionTarget):
    """A VM named by a QMP socket: one connection per use (QEMU serves one client per monitor)."""

    def __init__(self, path: Path, timeout: float = 10.0) -> None:
        self.path = Path(path).resolve()
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(str(self.path))
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            raise VmGone(f"no QEMU listens on {path} ({exc.strerror}): the VM has exited",
                         hint="start the VM; dxpu detach VM --all releases what it held") from exc
        finally:
            probe.close()
        session = QmpSession(f"pool-{self.path.parent.name}")
        try:
            session.connect(self.path, timeout=timeout, alive=lambda: True)
        except VmError as exc:
            session.close()
            raise VmError(f"cannot reach the QMP monitor {path}: is the VM running and is this "
                          f"socket free (QEMU serves one client per monitor)?",
                          hint="give the VM a monitor of its own for dxpu: "
                               "-qmp unix:PATH,server=on,wait=off") from exc
        super().__init__(session, str(path), key=f"qmp:{self.path}")

    def close(self) -> None:
        self.session.close()
