"""The errors of VM control: a VM that is gone, and hot-plug steps that failed.

Every one is a :class:`dxpu_vfio.errors.DxpuError` (message, hint, logs); QMP failures
themselves are :class:`dxpu_vfio.vmm.qmp.QmpError`, which carries what was sent and
received, and is the ``__cause__`` of a hot-plug error raised because of one.
"""

from __future__ import annotations

from dxpu_vfio.errors import DxpuError, VmError


class VmGone(VmError):
    """The VM does not exist or does not run: whatever was plugged into it is gone too.

    Only this error lets the manager release a VM's leases without unplugging; any other
    failure to reach a VM (libvirtd down, a busy monitor) leaves them alone."""


class UnknownVm(VmGone):
    """The name is neither a QMP socket nor a libvirt domain."""


class DomainNotRunning(VmGone):
    """The libvirt domain exists but its QEMU is not running."""


class LibvirtUnavailable(VmError):
    """libvirtd does not answer (not running, or a bad URI)."""


class HotplugError(DxpuError):
    """A hot-plug step failed; the message says which and what state things are in."""


class NoFreeRootPort(HotplugError):
    """Every hot-pluggable root port of the VM has a device below it."""


class UnplugTimeout(HotplugError):
    """The guest did not release the device in time; it is still plugged and served."""
