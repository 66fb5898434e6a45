"""dxpu VMs under a real libvirtd (qemu:///system): ``dxpu vm define`` + ``virsh start``,
hot-plug and unplug of the test device through LibvirtTarget (QMP passthrough), and the
errors an admin meets. Domains are named ``dxpu-t<pid>-<n>`` and removed at teardown."""

import os
import subprocess
import sys

import pytest
from test_pool import pool, pool_lab  # noqa: F401 - the pool manager fixtures (lab with two boxes)

from dxpu_vfio.hostproxy.process import HostProxyProcess
from dxpu_vfio.lab.hotplug import guest_wait_for_child
from dxpu_vfio.testing.libvirt_vms import LibvirtVm
from dxpu_vfio.testing.reports import register
from dxpu_vfio.vmm.errors import DomainNotRunning, LibvirtUnavailable, UnknownVm
from dxpu_vfio.vmm.libvirt_target import LibvirtTarget, dac_ids, grant_socket, prepare_socket_dir
from dxpu_vfio.vmm.naming import open_target
from dxpu_vfio.vmm.qmp import QmpError
from dxpu_vfio.vmm.rootports import device_present, free_root_port, root_ports
from dxpu_vfio.vms.libvirt_domain import DomainConfig, LibvirtGuest, define_domain, domain_dir, undefine_domain

pytestmark = pytest.mark.vm

_n = iter(range(1, 1000))


def unique_name(tag: str) -> str:
    return f"dxpu-t{os.getpid()}-{tag}{next(_n)}"


def dxpu(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dxpu_vfio.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def port_bdf(target, port: str) -> str:
    """The guest address of a root port, from QEMU's own view (query-pci)."""
    for bus in target.execute("query-pci"):
        for dev in bus["devices"]:
            if dev.get("qdev_id") == port:
                return f"0000:{dev['bus']:02x}:{dev['slot']:02x}.{dev['function']}"
    raise AssertionError(f"root port {port} not in query-pci")


def test_vm_define_then_virsh_start_boots_the_guest(request, libvirtd, tiny_image):
    name = unique_name("d")
    vm = LibvirtVm(name)
    register(request, vm)  # logs saved on failure
    try:
        proc = dxpu("vm", "define", name, "--root-ports", "3", "--memory", "768", "--json")
        assert proc.returncode == 0, proc.stderr
        info = __import__("json").loads(proc.stdout)
        assert info["running"] is False and info["root_ports"] == ["pci.1", "pci.2", "pci.3"]
        start = subprocess.run(["virsh", "-c", "qemu:///system", "start", name], capture_output=True,
                               text=True, timeout=60)
        assert start.returncode == 0, start.stderr
        guest = vm.guest = LibvirtGuest(name).wait_booted(120)
        assert guest.run("uname -r").stdout.startswith("6.12")
        target = vm.target = LibvirtTarget(name)
        assert target.key == f"libvirt:{name}" and target.alive()
        assert root_ports(target) == ["pci.1", "pci.2", "pci.3"]
        assert target.execute("qom-get", {"path": "/machine/peripheral/pci.1",
                                          "property": "pref64-reserve"}) == 16 << 30
        ram = target.execute("query-memdev")
        assert len(ram) == 1 and ram[0]["share"] and ram[0]["size"] == 768 << 20
        # a second define of the same name is refused with what to do
        again = dxpu("vm", "define", name)
        assert again.returncode == 1 and f"dxpu vm undefine {name}" in again.stderr
    finally:
        vm.destroy()
    assert not domain_dir(name).exists()
    gone = dxpu("vm", "undefine", name)
    assert gone.returncode == 1 and "no libvirt domain" in gone.stderr


def test_testdev_hotplug_and_unplug_through_libvirt(libvirt_vm):
    target = libvirt_vm.target
    port = free_root_port(target, libvirt_vm.name)
    bridge = port_bdf(target, port)
    sock = target.socket_dir() / "dxpu0.sock"
    server = HostProxyProcess("testdev", sock, name="dxpu0").start()
    try:
        target.plug("dxpu0", port, sock)
        assert device_present(target, "dxpu0")
        assert free_root_port(target, libvirt_vm.name) != port
        bdf = guest_wait_for_child(libvirt_vm, bridge, True, 20)
        ids = libvirt_vm.run(f"cat /sys/bus/pci/devices/{bdf}/vendor /sys/bus/pci/devices/{bdf}/device").stdout
        assert ids.split() == ["0x1b36", "0x10f0"]
        # the device reaches guest RAM (libvirt's shared memfd, mapped from DMA_MAP's fd)
        copy = libvirt_vm.run(f"dxpu-testdev {bdf} dma-copy 4096").stdout
        assert " match=yes" in copy, copy
        dma = server.stats()["server"]["dma"]
        assert dma["windows"] > 0 and dma["refused"] == 0 and dma["bytes_read"] >= 4096

        target.unplug("dxpu0", timeout=15)
        assert target.last_unplug_seen == "DEVICE_DELETED"  # the libvirt event, not the fallback poll
        assert not device_present(target, "dxpu0")
        guest_wait_for_child(libvirt_vm, bridge, False, 20)
        # a QMP error through libvirt carries what was sent and what QEMU answered
        with pytest.raises(QmpError) as err:
            target.execute("device_del", {"id": "dxpu0"})
        assert err.value.command == "device_del" and err.value.arguments == {"id": "dxpu0"}
        assert err.value.response["error"]["class"] == "DeviceNotFound"
    finally:
        server.stop()
    assert not sock.exists()


def connects_as(uid: int, gid: int, path) -> bool:
    """Can a process of that user connect to the UNIX socket? (as libvirt's QEMU would)"""
    probe = "import socket, sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1])"
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
                           "/usr/bin/python3", "-c", probe, str(path)],
                          capture_output=True, timeout=30).returncode == 0


def test_socket_dir_and_plug_let_a_non_root_qemu_connect_and_nobody_else():
    """dxpu's domains run QEMU as root; a domain whose QEMU runs as libvirt's default user
    gets sockets that user (only) can connect to: what socket_dir() and plug() do."""
    import pwd
    import shutil
    import socket
    qemu = pwd.getpwnam("libvirt-qemu")
    xml = (f"<domain><seclabel type='dynamic' model='dac' relabel='yes'><label>+{qemu.pw_uid}:+{qemu.pw_gid}"
           "</label></seclabel></domain>")
    uid, gid = dac_ids(xml)
    assert (uid, gid) == (qemu.pw_uid, qemu.pw_gid)
    directory = prepare_socket_dir(unique_name("s"), uid, gid)
    listener = socket.socket(socket.AF_UNIX)
    try:
        listener.bind(str(directory / "dxpu0.sock"))
        listener.listen(4)
        assert not connects_as(uid, gid, directory / "dxpu0.sock")  # the socket is root's
        grant_socket(directory / "dxpu0.sock", uid, gid)
        assert connects_as(uid, gid, directory / "dxpu0.sock")
        assert not connects_as(65534, 65534, directory / "dxpu0.sock")  # nobody: cannot enter
    finally:
        listener.close()
        shutil.rmtree(directory)


def test_errors_unknown_domain_not_running_no_libvirtd(request, libvirtd, tiny_image):
    name = unique_name("e")
    vm = LibvirtVm(name)
    register(request, vm)
    try:
        define_domain(DomainConfig(name=name))  # defined, never started
        with pytest.raises(DomainNotRunning) as err:
            LibvirtTarget(name)
        assert f"virsh start {name}" in err.value.hint
        with pytest.raises(UnknownVm) as err:
            open_target("dxpu-no-such-domain")
        assert name in err.value.message and "dxpu vm define" in err.value.hint
        with pytest.raises(LibvirtUnavailable) as err:
            LibvirtTarget(name, uri="qemu:///system?socket=/run/dxpu-no-libvirtd.sock")
        assert err.value.hint
    finally:
        vm.destroy()
    with pytest.raises(UnknownVm):
        undefine_domain(name)


def test_pool_attach_and_detach_through_libvirt(pool, libvirt_vm):
    """The pool manager (in the lab's host namespace) reaches the domain by name, plugs a
    GPU box's test device through libvirt's QMP passthrough, and takes it back."""
    name = libvirt_vm.name
    [lease] = pool.json("attach", name, "--class", "testdev", "--box", "box2")
    assert lease["device"] == "box2/td1" and lease["state"] == "attached" and lease["port"] == "pci.1"
    [row] = pool.leases()
    assert row["vm"] == f"libvirt:{name}" and row["socket"].startswith(f"/run/dxpu-libvirt/{name}/")
    bridge = port_bdf(libvirt_vm.target, lease["port"])
    bdf = guest_wait_for_child(libvirt_vm, bridge, True, 30)
    ids = libvirt_vm.run(f"cat /sys/bus/pci/devices/{bdf}/vendor /sys/bus/pci/devices/{bdf}/device").stdout
    assert ids.split() == ["0x1b36", "0x10f0"]
    [dev] = pool.json("status", f"libvirt:{name}")["devices"]
    assert dev["in_vm"] and dev["proxy_alive"], dev
    [freed] = pool.json("detach", name, lease["lease"])
    assert freed["device"] == "box2/td1"
    assert not device_present(libvirt_vm.target, row["qdev_id"])
    guest_wait_for_child(libvirt_vm, bridge, False, 20)
    assert pool.leases() == [] and not os.path.exists(row["socket"])
    # an unknown domain is refused with the known ones named, and nothing is leased
    proc = pool.dxpu("attach", "dxpu-no-such-domain", "--class", "testdev", check=False)
    assert proc.returncode == 1 and "no libvirt domain 'dxpu-no-such-domain'" in proc.stderr, proc.stderr
    assert name in proc.stderr and pool.leases() == []
