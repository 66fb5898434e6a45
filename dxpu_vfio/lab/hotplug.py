"""Hot-plugging into a VM the runner owns, for the lab, tests and demos.

The QMP side is VM control's (:meth:`dxpu_vfio.vmm.targets.VmTarget.plug` and
``unplug``); what this module adds is its own: it owns the device's host proxy
(started before ``device_add``, which runs the whole vfio-user handshake, and ended
after the unplug), and it confirms a plug from inside the guest (``attach`` returns
once the *guest* has the device). Every failure leaves the VM and the attachment in a
state that is reported and can be retried.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

from dxpu_vfio.errors import DxpuError, VmError
from dxpu_vfio.hostproxy.process import HostProxyProcess
from dxpu_vfio.lab import guest_output
from dxpu_vfio.vmm import rootports
from dxpu_vfio.vmm.errors import HotplugError, NoFreeRootPort, UnplugTimeout  # noqa: F401 - part of this API
from dxpu_vfio.vmm.qmp import QmpError
from dxpu_vfio.vms.runner import Vm

_ids = itertools.count(0)


class AttachmentState(enum.StrEnum):
    PLUGGED = "plugged"
    UNPLUG_PENDING = "unplug-pending"  # device_del sent, the guest has not let go yet
    DETACHED = "detached"


@dataclass
class Attachment:
    """One device plugged into one VM."""

    vm: Vm
    device_id: str
    port: str
    server: HostProxyProcess
    guest_bdf: str = ""
    guest_events: list = field(default_factory=list)  # udev events seen in the guest (full image)
    plugged_at: float = field(default_factory=time.monotonic)
    state: AttachmentState = AttachmentState.PLUGGED
    own_server: bool = True  # detach stops the server

    @property
    def socket_path(self) -> Path:
        return self.server.socket_path


def port_bdf(vm: Vm, port: str) -> str:
    """Guest BDF of root port ``rpN`` (the VM runner puts rpN at slot 0x10+N)."""
    n = int(port.removeprefix("rp"))
    return f"0000:00:{0x10 + n:02x}.0"


def free_root_port(vm: Vm) -> str:
    return rootports.free_root_port(vm.target, vm.config.name, vm.root_port_ids())


def guest_wait_for_child(vm: Vm, bridge: str, present: bool, timeout: float) -> str:
    """Poll sysfs in the guest until a device appears under (or leaves) ``bridge``: the
    device's PCI address (checked: callers drive it there), or "" once it left."""
    test = "[ -n \"$d\" ]" if present else "[ -z \"$d\" ]"
    script = (f"i=0; while [ $i -lt {int(timeout * 10)} ]; do "
              f"d=$(cd /sys/bus/pci/devices/{bridge} 2>/dev/null && ls -d 0000:[0-9a-f][0-9a-f]:[0-9a-f][0-9a-f].[0-7] 2>/dev/null | head -n1); "
              f"{test} && {{ echo \"$d\"; exit 0; }}; sleep 0.1; i=$((i+1)); done; exit 1")
    result = vm.run(script, timeout=timeout + 10, check=False)
    if result.rc != 0:
        raise HotplugError(f"guest did not {'see' if present else 'drop'} the device under "
                           f"{bridge} within {timeout:.0f} s", logs=vm.logs)
    return guest_output.pci_address(result.stdout, "the guest's sysfs poll") if present else ""


READY_WAIT = 60  # s the guest's udev watcher may take to start listening


class _GuestWatch:
    """Guest-side confirmation of a plug: udev events on full, sysfs polling on tiny.

    On the full image the pyudev watcher must be listening *before* device_add, so it
    is started first and confirmed ready; on tiny, sysfs is polled afterwards.
    """

    READY = "/run/dxpu-guest-events.ready"

    def __init__(self, vm: Vm, bridge: str, timeout: float) -> None:
        self.vm, self.bridge, self.timeout = vm, bridge, timeout
        self.pid: int | None = None
        self.events: list[dict] = []

    def arm(self) -> None:
        if self.vm.image.kind != "disk":
            return
        self.vm.run(f"rm -f {self.READY}")
        self.pid = self.vm.spawn(f"dxpu-guest-events --bridge {self.bridge} --want add "
                                 f"--timeout {self.timeout:.0f}")
        # bounded by time, not by a count of sleeps: a guest slowed by a loaded host (TCG)
        # takes seconds to start python3 + pyudev, and every sleep in the loop costs a fork
        self.vm.run(f"timeout {READY_WAIT} sh -c 'until [ -e {self.READY} ]; do sleep 0.1; done'",
                    timeout=READY_WAIT + 15)

    def confirm(self) -> str:
        if self.pid is None:
            return guest_wait_for_child(self.vm, self.bridge, True, self.timeout)
        result = self.vm.wait(self.pid, self.timeout + 10)
        self.events = guest_output.udev_events(result.stdout, "dxpu-guest-events")
        adds = [e for e in self.events if e.get("action") == "add"]
        if result.rc != 0 or not adds:
            raise HotplugError(f"guest reported no PCI add below {self.bridge}: {self.events}",
                               logs=self.vm.logs)
        return adds[0]["bdf"]


def attach(vm: Vm, model: str = "testdev", *, settings: dict | None = None, port: str | None = None,
           device_id: str | None = None, timeout: float = 30.0, allow_msix: bool = False,
           extra_props: dict | None = None, server: HostProxyProcess | None = None,
           netns: str | None = None) -> Attachment:
    """Serve ``model`` and plug it into ``vm``; returns when the guest sees it.

    ``server``: plug a device server that already runs (its device is then served to
    one VM after another); by default a new one is started and detach stops it.
    ``model="remote"`` with ``settings`` from ``LabState.remote_settings`` serves a device
    of a GPU box (host proxy in forward mode); ``netns`` runs the server in the lab's
    host namespace.
    """
    if not vm.alive():
        raise VmError(f"VM {vm.config.name} is not running", logs=vm.logs)
    port = port or free_root_port(vm)
    device_id = device_id or f"dxpu{next(_ids)}"
    own_server = server is None
    if server is None:
        server = HostProxyProcess(model, vm.workdir / f"{device_id}.sock", settings=settings,
                                     allow_msix=allow_msix, name=device_id, netns=netns)
        server.start()
        vm.device_servers.append(server)  # ended with the VM if nobody detaches it
    watch = _GuestWatch(vm, port_bdf(vm, port), timeout)
    try:
        watch.arm()
    except DxpuError:
        if own_server:
            server.stop()
        raise
    try:
        vm.target.plug(device_id, port, server.socket_path, timeout=timeout, extra_props=extra_props)
    except QmpError as exc:
        why = server.attach_error()
        if own_server:
            server.stop()
        raise HotplugError(f"device_add of {device_id} on {port} failed: {exc.message}"
                           + (f"; {why}" if why else ""), logs=vm.logs + [server.log_path]) from exc
    attachment = Attachment(vm, device_id, port, server, own_server=own_server)
    try:
        attachment.guest_bdf = watch.confirm()
        attachment.guest_events = watch.events
    except DxpuError:
        detach(attachment, timeout=timeout)  # roll back: never a plugged device nobody tracks
        raise
    return attachment


def detach(attachment: Attachment, timeout: float = 15.0) -> dict | None:
    """Unplug and stop the server; returns the server's final counters.

    Raises :class:`UnplugTimeout` if the guest holds on: the device then stays plugged
    and served (``attachment.state`` is ``UNPLUG_PENDING``), and QEMU will finish the
    removal if the guest lets go later; call ``detach`` again to wait for it.
    """
    vm = attachment.vm
    if attachment.state is AttachmentState.DETACHED:
        return None
    if vm.alive():
        request = attachment.state is AttachmentState.PLUGGED
        attachment.state = AttachmentState.UNPLUG_PENDING
        try:
            vm.target.unplug(attachment.device_id, timeout, request=request)
        except UnplugTimeout as exc:
            raise UnplugTimeout(f"guest of {vm.config.name} did not release {attachment.device_id} within "
                                f"{timeout:.0f} s; it stays plugged and served", logs=vm.logs,
                                hint="check the guest; detach again to keep waiting, or stop the VM") from exc
        except QmpError as exc:
            if request:
                attachment.state = AttachmentState.PLUGGED  # device_del did not take: ask again next time
            raise HotplugError(f"device_del of {attachment.device_id} failed: {exc.message}") from exc
    attachment.state = AttachmentState.DETACHED
    if not attachment.own_server:
        return None
    if attachment.server in vm.device_servers:
        vm.device_servers.remove(attachment.server)
    return attachment.server.stop()

