"""How an admin names a VM: a QMP socket path (``qmp:PATH``) or a libvirt domain
(``libvirt:NAME``, or a bare name), and the store key that names it for good."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from dxpu_vfio.vmm.errors import UnknownVm
from dxpu_vfio.vmm.libvirt_target import LibvirtTarget
from dxpu_vfio.vmm.targets import QmpTarget, VmTarget


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
        return LibvirtTarget(name[8:], uri=libvirt_uri)
    if is_qmp_socket(name):
        return QmpTarget(Path(name))
    if "/" in name:
        raise UnknownVm(f"no VM at {name}: not a UNIX socket", hint="give the VM's QMP socket path")
    return LibvirtTarget(name, uri=libvirt_uri)


def target_key(name: str) -> str:
    """The store's name for a VM, worked out without reaching it (it may be gone)."""
    kind, sep, rest = name.partition(":")
    if sep and kind in ("qmp", "libvirt"):
        return f"qmp:{Path(rest).resolve()}" if kind == "qmp" else name
    if "/" in name or is_qmp_socket(name):
        return f"qmp:{Path(name).resolve()}"
    return f"libvirt:{name}"
