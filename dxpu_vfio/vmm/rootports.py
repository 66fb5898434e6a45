"""What is plugged where in a VM, from QEMU's own view (QOM and ``query-pci``).

Hot-plugged devices go below ``pcie-root-port``s (pcie.0 is not hot-pluggable); QEMU,
not any record of ours, is the authority on which ports are taken.
"""

from __future__ import annotations

from typing import Any, Protocol

from dxpu_vfio.vmm.errors import NoFreeRootPort


class Executor(Protocol):
    """Anything that runs QMP commands: a :class:`dxpu_vfio.vmm.qmp.QmpSession` or a VmTarget."""

    def execute(self, command: str, arguments: dict | None = None, timeout: float = 30) -> Any: ...


def root_ports(qmp: Executor) -> list[str]:
    """Ids of the VM's pcie-root-ports (only they take hot-plugged devices), in order."""
    ports = [child["name"] for child in qmp.execute("qom-list", {"path": "/machine/peripheral"})
             if child.get("type") == "child<pcie-root-port>"]
    return sorted(ports, key=lambda name: (len(name), name))


def used_root_ports(qmp: Executor) -> set[str]:
    """Root ports with a device below them."""
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


def device_class(qmp: Executor, device_id: str) -> int | None:
    """The PCI class (base class << 8 | subclass) QEMU reports for ``device_id``; None if
    it is not on any bus."""
    def walk(devices: list[dict]) -> int | None:
        for dev in devices:
            if dev.get("qdev_id") == device_id:
                return int(dev.get("class_info", {}).get("class", -1))
            found = walk((dev.get("pci_bridge") or {}).get("devices") or [])
            if found is not None:
                return found
        return None
    for bus in qmp.execute("query-pci"):
        found = walk(bus.get("devices") or [])
        if found is not None:
            return found
    return None


def device_present(qmp: Executor, device_id: str) -> bool:
    return any(p["name"] == device_id for p in qmp.execute("qom-list", {"path": "/machine/peripheral"}))


def plugged_devices(qmp: Executor, prefix: str) -> list[str]:
    """Ids of devices in the VM whose id starts with ``prefix`` (the manager's own)."""
    return sorted(p["name"] for p in qmp.execute("qom-list", {"path": "/machine/peripheral"})
                  if p["name"].startswith(prefix))
