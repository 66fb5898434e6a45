"""What the hot-plug root ports reserve (port I/O windows included), and the warning
for a device Linux will give no BARs; no VM (the guest side: test_vm_tiny.py)."""

import logging
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from dxpu_vfio.errors import VmError
from dxpu_vfio.vmm.targets import VmTarget
from dxpu_vfio.vms.libvirt_domain import QEMU_NS, DomainConfig, domain_xml
from dxpu_vfio.vms.runner import Vm, VmConfig


def root_port_args(tmp_path, **config) -> list[str]:
    argv = Vm(VmConfig(**config), workdir=tmp_path).command_line()
    return [arg for arg in argv if arg.startswith("pcie-root-port,")]


def test_runner_root_ports_have_a_port_io_window_by_default(tmp_path):
    ports = root_port_args(tmp_path)
    assert len(ports) == 4 and all("io-reserve=4096," in port for port in ports), ports
    assert all("io-reserve=0," in port for port in root_port_args(tmp_path, io_reserve="0"))
    assert all("io-reserve=8192," in port for port in root_port_args(tmp_path, io_reserve="8K"))


@pytest.mark.parametrize("config, message", [
    (dict(io_reserve="6K"), "not a multiple of 4K"),
    (dict(io_reserve="4K", root_ports=12), "48 KiB of port I/O space"),
])
def test_io_windows_that_cannot_be_given_are_refused_before_qemu_starts(tmp_path, config, message):
    with pytest.raises(VmError, match=message):
        root_port_args(tmp_path, **config)
    root_port_args(tmp_path, **{**config, "io_reserve": "0"})  # no I/O windows: any number of ports


def test_libvirt_domains_root_ports_have_the_same_io_window(tmp_path):
    xml = domain_xml(DomainConfig(name="d", root_ports=3), Path("/usr/bin/qemu"), tmp_path / "k", tmp_path / "i",
                     tmp_path, "initrd", "console=ttyS0")
    props = [p.get("value") for p in ET.fromstring(xml).iter(f"{{{QEMU_NS}}}property") if p.get("name") == "io-reserve"]
    assert props == ["4096"] * 3


class FakeTarget(VmTarget):
    """A VM whose QEMU answers device_add and query-pci from a table (device -> class)."""

    key, name = "fake:vm", "vm"

    def __init__(self, classes: dict[str, int]) -> None:
        self.classes = classes

    def execute(self, command, arguments=None, timeout=30):
        if command == "device_add":
            return {}
        assert command == "query-pci"
        below = [{"bus": 1, "slot": 0, "qdev_id": dev, "class_info": {"class": cls}} for dev, cls in self.classes.items()]
        port = {"bus": 0, "slot": 17, "qdev_id": "rp1", "class_info": {"class": 0x0604},
                "pci_bridge": {"bus": {"number": 1}, "devices": below}}
        return [{"bus": 0, "devices": [port]}]

    def alive(self):
        return True

    def unplug(self, device_id, timeout, *, request=True):
        pass


def test_plug_warns_when_the_device_reports_class_zero(caplog):
    target = FakeTarget({"classless": 0x0000, "nvme": 0x0108})
    with caplog.at_level(logging.WARNING, logger="dxpu.vmm"):
        target.plug("nvme", "rp1", Path("/tmp/x.sock"))
        assert not caplog.records
        target.plug("classless", "rp1", Path("/tmp/x.sock"))
    [record] = caplog.records
    assert "class 0x000000" in record.getMessage() and "no BARs" in record.getMessage()
