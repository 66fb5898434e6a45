"""A VM named by its libvirt domain: QMP through libvirt's passthrough.

libvirt (9.0 here) has no vfio-user devices, so dxpu hot-plugs behind its back with
``virDomainQemuMonitorCommand``: libvirt marks the domain tainted ("custom-monitor") and
does not list the devices in its XML, but QEMU is the authority the pool manager asks
anyway (``query-pci``, ``qom-list``). ``DEVICE_DELETED`` comes through
``virConnectDomainQemuMonitorEventRegister``, which needs a libvirt event loop: one
thread per process runs it, registered before any connection of ours is opened.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from dxpu_vfio.vmm.errors import DomainNotRunning, UnplugTimeout
from dxpu_vfio.vmm.libvirt_conn import DEFAULT_URI, connect, lookup, qemu_log_path
from dxpu_vfio.vmm.qmp import QmpError, QmpTimeout
from dxpu_vfio.vmm.rootports import device_present
from dxpu_vfio.vmm.targets import VmTarget

SOCKETS_ROOT = Path("/run/dxpu-libvirt")  # short: socket paths must stay under 108 bytes

_loop_lock = threading.Lock()
_loop_thread: threading.Thread | None = None


def ensure_event_loop() -> None:
    """Register libvirt's default event implementation and run it on a daemon thread (once)."""
    global _loop_thread
    import libvirt
    with _loop_lock:
        if _loop_thread is not None:
            return
        libvirt.virEventRegisterDefaultImpl()

        def run() -> None:
            while True:
                libvirt.virEventRunDefaultImpl()

        _loop_thread = threading.Thread(target=run, name="libvirt-events", daemon=True)
        _loop_thread.start()


def socket_dir_for(name: str) -> Path:
    return SOCKETS_ROOT / name


def prepare_socket_dir(name: str, uid: int, gid: int) -> Path:
    """``/run/dxpu-libvirt/NAME`` for host-proxy sockets that a QEMU running as uid:gid
    connects to: outside any private /tmp; owner root, group gid, 0750 (0700 for root)."""
    SOCKETS_ROOT.mkdir(mode=0o755, exist_ok=True)
    path = socket_dir_for(name)
    path.mkdir(exist_ok=True)
    os.chown(path, 0, gid)
    path.chmod(0o700 if uid == 0 else 0o750)
    return path


def grant_socket(socket_path: Path, uid: int, gid: int) -> None:
    """Let a QEMU running as uid:gid connect (connect() needs write permission on the file)."""
    if uid != 0:
        os.chown(socket_path, uid, gid)


def dac_ids(live_xml: str) -> tuple[int, int]:
    """uid and gid the domain's QEMU runs as, from the live XML's DAC label (``+0:+0``)."""
    for label in ET.fromstring(live_xml).iterfind("seclabel[@model='dac']/label"):
        match = re.fullmatch(r"\+?(\d+):\+?(\d+)", (label.text or "").strip())
        if match:
            return int(match.group(1)), int(match.group(2))
    return 0, 0  # no DAC label: libvirt runs QEMU as itself


class LibvirtTarget(VmTarget):
    """A running libvirt domain; see the module docstring."""

    def __init__(self, name: str, uri: str = DEFAULT_URI) -> None:
        self.name = name
        self.uri = uri
        self.key = f"libvirt:{name}"
        self.last_unplug_seen = ""  # how the last unplug's end was seen: "DEVICE_DELETED" or "qom-list"
        ensure_event_loop()
        self.conn = connect(uri)
        try:
            self.dom = lookup(self.conn, name)
            if not self.dom.isActive():
                raise DomainNotRunning(f"libvirt domain {name} is defined but not running",
                                       hint=f"virsh start {name}")
        except BaseException:
            self.conn.close()
            raise

    @property
    def logs(self) -> list[Path]:
        return [qemu_log_path(self.name)]

    def execute(self, command: str, arguments: dict | None = None, timeout: float = 30) -> Any:
        """One QMP command through libvirt; :class:`QmpError` carries command, arguments, reply.

        libvirt's call blocks; it runs on a helper thread so that ``timeout`` holds.
        """
        import libvirt
        import libvirt_qemu
        message: dict[str, Any] = {"execute": command}
        if arguments:
            message["arguments"] = arguments
        outcome: dict[str, Any] = {}

        def call() -> None:
            try:
                outcome["reply"] = libvirt_qemu.qemuMonitorCommand(
                    self.dom, json.dumps(message), libvirt_qemu.VIR_DOMAIN_QEMU_MONITOR_COMMAND_DEFAULT)
            except libvirt.libvirtError as exc:
                outcome["error"] = exc

        worker = threading.Thread(target=call, name=f"libvirt-qmp-{command}", daemon=True)
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            raise QmpTimeout(f"QMP {command} through libvirt got no answer within {timeout:.0f} s",
                             command=command, arguments=arguments)
        if "error" in outcome:
            exc = outcome["error"]
            raise QmpError(f"libvirt could not pass {command} to the QEMU of {self.name}: "
                           f"{exc.get_error_message()}", command=command, arguments=arguments,
                           response=exc.get_error_message()) from exc
        reply = json.loads(outcome["reply"])
        if "error" in reply:
            err = reply["error"]
            raise QmpError(f"QMP {command} failed: {err.get('class')}: {err.get('desc')}",
                           command=command, arguments=arguments, response=reply)
        return reply.get("return")

    def alive(self) -> bool:
        import libvirt
        try:
            if not self.dom.isActive():
                return False
            self.execute("query-status", timeout=5)
            return True
        except (libvirt.libvirtError, QmpError):
            return False

    def unplug(self, device_id: str, timeout: float, *, request: bool = True) -> None:
        """``device_del``, then wait for QEMU's DEVICE_DELETED (registered first).

        QEMU's own view is checked every half second as well, so a lost event costs at
        most that, never a false timeout.
        """
        import libvirt_qemu
        gone = threading.Event()

        def on_event(_conn, _dom, _event, _sec, _usec, details, _opaque) -> None:
            try:
                data = json.loads(details) if details else {}
            except ValueError:
                return
            data = data.get("data", data)
            if data.get("device") == device_id:
                gone.set()

        callback = libvirt_qemu.qemuMonitorEventRegister(self.conn, self.dom, "DEVICE_DELETED",
                                                         on_event, None, 0)
        try:
            try:
                if request:
                    self.execute("device_del", {"id": device_id}, timeout=timeout)
            except QmpError:
                if not device_present(self, device_id):
                    return  # already gone: nothing to wait for
                raise
            deadline = time.monotonic() + timeout
            while not gone.wait(min(0.5, max(0.0, deadline - time.monotonic()))):
                if not device_present(self, device_id):
                    self.last_unplug_seen = "qom-list"
                    return
                if time.monotonic() >= deadline:
                    raise UnplugTimeout(f"the guest of {self.name} did not release {device_id} within "
                                        f"{timeout:.0f} s; it stays plugged",
                                        hint="check the guest, then detach again")
            self.last_unplug_seen = "DEVICE_DELETED"
        finally:
            libvirt_qemu.qemuMonitorEventDeregister(self.conn, callback)

    def qemu_ids(self) -> tuple[int, int]:
        """uid, gid of the domain's QEMU (root with dxpu's qemu.conf; see libvirt_domain)."""
        return dac_ids(self.dom.XMLDesc(0))

    def socket_dir(self) -> Path:
        """See :func:`prepare_socket_dir`; :meth:`plug` hands each socket to the QEMU's
        user if that is not root (:func:`grant_socket`)."""
        return prepare_socket_dir(self.name, *self.qemu_ids())

    def plug(self, device_id: str, port: str, socket_path: Path, timeout: float = 30.0) -> None:
        grant_socket(socket_path, *self.qemu_ids())
        super().plug(device_id, port, socket_path, timeout)

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:  # noqa: BLE001 - already closed or libvirtd gone
            pass
