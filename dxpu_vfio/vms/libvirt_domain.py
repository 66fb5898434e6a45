"""dxpu VMs under libvirt: the domain XML, define/undefine, the daemons, the guest channel.

Debian 12 ships libvirt 9.0, which knows nothing of vfio-user; it still runs our QEMU
(the sysroot wrapper from setup, named in ``<emulator>``) and lets the pool manager
hot-plug through its QMP passthrough (:mod:`.libvirt_target`). What a dxpu domain has:

* q35, TCG by default (``<cpu mode='maximum'>`` = ``-cpu max``), ``<acpi/>`` (without it
  libvirt 9.0 passes ``-no-acpi``, which QEMU 11 removed);
* guest RAM as a shared memfd, so vfio-user DMA_MAP messages carry an fd;
* N ``pcie-root-port`` controllers (libvirt ids ``pci.1`` .. ``pci.N``, at slots
  0x11.. like the VM runner's ``rpN``), each reserving a 16 GiB 64-bit prefetchable
  window and a 4 KiB I/O window (``io_reserve``) through ``<qemu:override>`` (libvirt
  has no element for ``pref64-reserve``);
  no USB controller and no balloon, so every root port stays free for dxpu;
* direct kernel boot of a dxpu guest image, whose kernel and initrd are copied into the
  domain's directory (a rebuilt image does not break a defined domain); the full
  image's disk is copied there too (sparse, ~1.5 s) and is the domain's own, kept
  across boots (``<transient/>`` would open the cached image read-write first and
  collide with VM-runner guests that use it with ``snapshot=on``);
* ttyS0 to ``serial.log`` and, on the tiny image, ttyS1 (the shell agent) as the UNIX
  socket ``guest.sock``, both in ``domain_dir(name)``.

Permissions: libvirt runs QEMU, and probes each emulator's capabilities, as the
``user``/``group`` of ``/etc/libvirt/qemu.conf`` (Debian: ``libvirt-qemu``), which cannot
enter ``/root`` where setup puts the QEMU sysroot and images. ``scripts/setup.sh`` sets
``user = "root"`` and ``group = "root"`` there (see :func:`qemu_conf_runs_as_root`); the
host then treats libvirt's QEMUs like the ones the VM runner starts, and the
host-proxy sockets need no extra grants (:meth:`.LibvirtTarget.socket_dir` still copes
with a QEMU that runs as another user).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dxpu_vfio.errors import GuestBootTimeout, GuestPanic, SetupError, VmError
from dxpu_vfio.procs import process_start_time
from dxpu_vfio.vmm.libvirt_conn import DAEMONS, DEFAULT_URI, connect, ensure_daemons, lookup, qemu_log_path
from dxpu_vfio.vmm.libvirt_target import socket_dir_for
from dxpu_vfio.vms.guest_exec import CommandResult, GuestDied, SerialChannel, run_checked, wait_ready
from dxpu_vfio.vms.images import load_image
from dxpu_vfio.vms.port_windows import io_reserve_bytes, size_bytes
from dxpu_vfio.vms.qemu import find_qemu

QEMU_CONF = Path("/etc/libvirt/qemu.conf")
QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"
DXPU_NS = "https://dxpu-vfio.invalid/libvirt/1"  # our metadata: which domains dxpu made
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
PANIC_MARKERS = ("Kernel panic - not syncing", "---[ end Kernel panic")
CONF_HINT = "scripts/setup.sh (sets user/group \"root\" in /etc/libvirt/qemu.conf), then restart libvirtd"


def state_root() -> Path:
    """What dxpu keeps for libvirt: $DXPU_LIBVIRT_DIR or /var/lib/dxpu-vfio.

    Not under /tmp: a defined domain must still start after a reboot.
    """
    return Path(os.environ.get("DXPU_LIBVIRT_DIR", "/var/lib/dxpu-vfio"))


def domains_root() -> Path:
    """Per-domain state: kernel, initrd, serial log, guest socket."""
    return state_root() / "vms"


def domain_dir(name: str) -> Path:
    return domains_root() / name


def qemu_conf_runs_as_root(path: Path = QEMU_CONF) -> bool:
    """Does libvirt's qemu.conf make QEMU run (and get probed) as root? See the module doc."""
    try:
        text = path.read_text()
    except OSError:
        return False
    values: dict[str, str] = {}
    for key, value in re.findall(r'^\s*(user|group)\s*=\s*"([^"]*)"', text, re.M):
        values.setdefault(key, value)  # libvirt's config parser takes the first one
    return values.get("user") in ("root", "+0") and values.get("group") in ("root", "+0")


def _process_start(pid: int) -> float:
    """Wall-clock start time of a process (its start in clock ticks after boot, plus boot time)."""
    ticks = process_start_time(pid)
    if ticks is None:
        raise ValueError(f"no process {pid}")
    btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                 if line.startswith("btime "))
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def check_libvirt_setup() -> None:
    """qemu.conf is set up, and the running libvirtd has read it."""
    if not qemu_conf_runs_as_root():
        raise SetupError(f"{QEMU_CONF} does not run QEMU as root: libvirt's QEMU (user libvirt-qemu) "
                         "cannot reach the QEMU sysroot and images under /root", hint=CONF_HINT)
    libvirtd = DAEMONS[1]
    try:
        pid = int(libvirtd.pidfile.read_text().split()[0])
        stale = _process_start(pid) < QEMU_CONF.stat().st_mtime - 1
    except (OSError, ValueError, StopIteration, IndexError):
        return
    if stale:
        raise SetupError(f"libvirtd (pid {pid}) started before {QEMU_CONF} last changed and runs "
                         "with the old settings", hint=f"kill {pid} && libvirtd -d")


# --- the emulator -------------------------------------------------------------------

SYSTEM_QEMU_MODULES = Path("/usr/lib/x86_64-linux-gnu/qemu")


def emulator_script(qemu_wrapper: Path) -> str:
    return (
        "#!/bin/sh\n"
        "# Generated by dxpu (dxpu_vfio/vms/libvirt_domain.py): libvirt's <emulator> for dxpu domains.\n"
        "# Runs the QEMU from setup with the system QEMU's module directory hidden (a private\n"
        "# mount namespace): QEMU falls back to that directory for modules its own build lacks,\n"
        "# and aborts on the system QEMU's (\"Only modules from the same build can be loaded\");\n"
        "# libvirt's capability probe (qom-list-types) loads every module.\n"
        f"if [ -d '{SYSTEM_QEMU_MODULES}' ]; then\n"
        "    exec unshare --mount --propagation private sh -c \\\n"
        f"        'mount -t tmpfs -o size=4k,mode=0755 dxpu-no-system-qemu-modules {SYSTEM_QEMU_MODULES} && exec \"$0\" \"$@\"' \\\n"
        f"        '{qemu_wrapper}' \"$@\"\n"
        "fi\n"
        f"exec '{qemu_wrapper}' \"$@\"\n")


def libvirt_emulator() -> Path:
    """Write (only when it changed: libvirt re-probes a touched binary) and return the emulator."""
    path = state_root() / "bin" / "qemu-system-x86_64"
    text = emulator_script(find_qemu().binary)
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.chmod(0o755)
        tmp.rename(path)
    return path


# --- the domain XML ----------------------------------------------------------------

@dataclass
class DomainConfig:
    name: str
    image: str = "tiny"
    memory_mib: int = 1024
    cpus: int = 2
    root_ports: int = 4
    accel: str = "tcg"  # "kvm" where KVM can run stock kernels
    pref64_reserve: str = "16G"  # per root port, as in the VM runner
    mem32_reserve: str = "64M"
    io_reserve: str = "4K"  # per root port, as in the VM runner; "0": no port I/O below the ports
    cmdline: str | None = None  # kernel command line; None: the image's own


def port_alias(index: int) -> str:
    """libvirt's id for the root port of controller ``index`` (what QMP calls it)."""
    return f"pci.{index}"


def domain_xml(config: DomainConfig, emulator: Path, kernel: Path, initrd: Path,
               directory: Path, image_kind: str, cmdline: str, disk: Path | None = None) -> str:
    """The libvirt domain XML of a dxpu VM (see the module docstring for what and why)."""
    ET.register_namespace("qemu", QEMU_NS)
    ET.register_namespace("dxpu", DXPU_NS)
    c = config
    dom = ET.Element("domain", type="kvm" if c.accel == "kvm" else "qemu")

    def sub(parent: ET.Element, tag: str, text: str | None = None, **attrs: str) -> ET.Element:
        el = ET.SubElement(parent, tag, attrs)
        if text is not None:
            el.text = text
        return el

    sub(dom, "name", c.name)
    meta = sub(sub(dom, "metadata"), f"{{{DXPU_NS}}}vm")
    sub(meta, f"{{{DXPU_NS}}}image", c.image)
    sub(meta, f"{{{DXPU_NS}}}directory", str(directory))
    sub(dom, "memory", str(c.memory_mib), unit="MiB")
    sub(dom, "vcpu", str(c.cpus))
    backing = sub(dom, "memoryBacking")
    sub(backing, "source", type="memfd")
    sub(backing, "access", mode="shared")
    os_el = sub(dom, "os")
    sub(os_el, "type", "hvm", arch="x86_64", machine="q35")
    sub(os_el, "kernel", str(kernel))
    sub(os_el, "initrd", str(initrd))
    sub(os_el, "cmdline", cmdline)
    sub(sub(dom, "features"), "acpi")
    sub(dom, "cpu", mode="host-passthrough" if c.accel == "kvm" else "maximum", check="none")
    sub(dom, "clock", offset="utc")
    sub(dom, "on_poweroff", "destroy")
    sub(dom, "on_reboot", "restart")
    sub(dom, "on_crash", "destroy")
    devices = sub(dom, "devices")
    sub(devices, "emulator", str(emulator))
    for i in range(1, c.root_ports + 1):
        ctl = sub(devices, "controller", type="pci", index=str(i), model="pcie-root-port")
        sub(ctl, "target", chassis=str(i), port=hex(0x10 + i))
        sub(ctl, "address", type="pci", domain="0x0000", bus="0x00", slot=hex(0x10 + i), function="0x0")
    sub(devices, "controller", type="usb", model="none")
    serial0 = sub(devices, "serial", type="file")
    sub(serial0, "source", path=str(directory / "serial.log"), append="off")
    sub(serial0, "target", type="isa-serial", port="0")
    if image_kind == "disk":
        assert disk is not None
        d = sub(devices, "disk", type="file", device="disk")
        sub(d, "driver", name="qemu", type="raw")
        sub(d, "source", file=str(disk))
        sub(d, "target", dev="vda", bus="virtio")
        sub(d, "address", type="pci", domain="0x0000", bus="0x00", slot="0x03", function="0x0")
        sub(devices, "controller", type="virtio-serial", index="0")
        ch = sub(devices, "channel", type="unix")  # libvirt itself talks to the guest agent
        sub(ch, "target", type="virtio", name="org.qemu.guest_agent.0")
    else:
        serial1 = sub(devices, "serial", type="unix")
        sub(serial1, "source", mode="bind", path=str(directory / "guest.sock"))
        sub(serial1, "target", type="isa-serial", port="1")
    sub(devices, "memballoon", model="none")
    override = sub(dom, f"{{{QEMU_NS}}}override")
    for i in range(1, c.root_ports + 1):
        front = sub(sub(override, f"{{{QEMU_NS}}}device", alias=port_alias(i)), f"{{{QEMU_NS}}}frontend")
        for prop, value in (("io-reserve", io_reserve_bytes(c.io_reserve, c.root_ports)),
                            ("mem-reserve", size_bytes(c.mem32_reserve)),
                            ("pref64-reserve", size_bytes(c.pref64_reserve))):
            sub(front, f"{{{QEMU_NS}}}property", name=prop, type="unsigned", value=str(value))
    ET.indent(dom)
    return ET.tostring(dom, encoding="unicode")


# --- define / undefine --------------------------------------------------------------

def dxpu_metadata(dom) -> dict | None:
    """What dxpu recorded in a domain it defined, or None for other domains."""
    import libvirt
    try:
        text = dom.metadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, DXPU_NS)
    except libvirt.libvirtError:
        return None
    el = ET.fromstring(text)
    return {child.tag.rsplit("}", 1)[-1]: child.text for child in el}


def define_domain(config: DomainConfig, uri: str = DEFAULT_URI, start: bool = False,
                  log: Callable[[str], None] = lambda _m: None) -> dict:
    """Write and define the domain (``virsh start NAME`` then boots it); returns what it made."""
    import libvirt
    if not NAME_RE.match(config.name):
        raise VmError(f"bad domain name {config.name!r}: letters, digits, '_', '.', '-', at most 64",
                      hint="pick another name")
    if config.accel not in ("tcg", "kvm"):
        raise VmError(f"unknown accelerator {config.accel!r}", hint="--accel tcg or --accel kvm")
    ensure_daemons(log=log)
    check_libvirt_setup()
    conn = connect(uri)
    try:
        try:
            conn.lookupByName(config.name)
            raise VmError(f"libvirt domain {config.name!r} already exists",
                          hint=f"dxpu vm undefine {config.name} (or pick another name)")
        except libvirt.libvirtError as exc:
            if exc.get_error_code() != libvirt.VIR_ERR_NO_DOMAIN:
                raise
        emulator = libvirt_emulator()
        image = load_image(config.image)
        directory = domain_dir(config.name)
        shutil.rmtree(directory, ignore_errors=True)  # leftovers of an earlier domain of that name
        directory.mkdir(parents=True, mode=0o755)
        kernel, initrd = directory / "vmlinuz", directory / "initrd.img"
        shutil.copyfile(image.kernel, kernel)
        shutil.copyfile(image.initrd, initrd)
        disk = None
        if image.disk is not None:
            disk = directory / "disk.img"
            subprocess.run(["cp", "--sparse=always", str(image.disk), str(disk)], check=True, timeout=300)
        xml = domain_xml(config, emulator, kernel, initrd, directory, image.kind,
                         config.cmdline or image.cmdline, disk)
        (directory / "domain.xml").write_text(xml)
        try:
            dom = conn.defineXML(xml)
        except libvirt.libvirtError as exc:
            shutil.rmtree(directory, ignore_errors=True)
            raise VmError(f"libvirt refused the domain {config.name}: {exc.get_error_message()}",
                          hint="see libvirtd's log; the XML dxpu wrote is above") from exc
        if start:
            try:
                dom.create()
            except libvirt.libvirtError as exc:
                raise VmError(f"domain {config.name} is defined but did not start: "
                              f"{exc.get_error_message()}", logs=[qemu_log_path(config.name)],
                              hint=f"fix the cause, then virsh start {config.name}") from exc
        log(f"libvirt: defined {config.name}" + (" and started it" if start else
                                                 f"; start it with: virsh start {config.name}"))
        return {"name": config.name, "uuid": dom.UUIDString(), "uri": uri, "running": bool(dom.isActive()),
                "image": config.image, "directory": str(directory), "emulator": str(emulator),
                "root_ports": [port_alias(i) for i in range(1, config.root_ports + 1)],
                "serial_log": str(directory / "serial.log"),
                "guest_socket": str(directory / "guest.sock") if image.kind != "disk" else None,
                "qemu_log": str(qemu_log_path(config.name))}
    finally:
        conn.close()


def undefine_domain(name: str, uri: str = DEFAULT_URI) -> dict:
    """Destroy (if running) and undefine a domain dxpu defined, and remove its files."""
    import libvirt
    conn = connect(uri)
    try:
        dom = lookup(conn, name)
        meta = dxpu_metadata(dom)
        if meta is None:
            raise VmError(f"domain {name} was not defined by dxpu; leaving it alone",
                          hint=f"virsh undefine {name}")
        was_running = bool(dom.isActive())
        if was_running:
            dom.destroy()
        dom.undefineFlags(libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE | libvirt.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA)
        shutil.rmtree(meta.get("directory") or domain_dir(name), ignore_errors=True)
        shutil.rmtree(socket_dir_for(name), ignore_errors=True)
        return {"name": name, "undefined": True, "destroyed": was_running}
    finally:
        conn.close()


# --- the tiny guest's shell, for tests and admins ----------------------------------

class LibvirtGuest:
    """Commands in a running dxpu domain's tiny guest, over its ttyS1 agent socket.

    The same channel the VM runner uses (:class:`SerialChannel`); alive = domain running.
    """

    def __init__(self, name: str, uri: str = DEFAULT_URI) -> None:
        self.name = name
        self.conn = connect(uri)
        self.dom = lookup(self.conn, name)
        meta = dxpu_metadata(self.dom) or {}
        if meta.get("image") != "tiny":
            raise VmError(f"domain {name} has no shell agent (image {meta.get('image')}): only tiny guests do")
        self.directory = Path(meta["directory"])
        self.channel: SerialChannel | None = None
        self._panic: str | None = None

    @property
    def serial_log(self) -> Path:
        return self.directory / "serial.log"

    @property
    def logs(self) -> list[Path]:
        return [self.serial_log, qemu_log_path(self.name)]

    def panicked(self) -> bool:
        if self._panic is None:
            try:
                text = self.serial_log.read_text(errors="replace")
            except OSError:
                return False
            self._panic = next((line.strip() for line in text.splitlines()
                                if any(m in line for m in PANIC_MARKERS)), None)
        return self._panic is not None

    def alive(self) -> bool:
        import libvirt
        try:
            return bool(self.dom.isActive()) and not self.panicked()
        except libvirt.libvirtError:
            return False

    def _died(self, when: str) -> VmError:
        if self.panicked():
            return GuestPanic(f"guest {self.name} panicked {when}: {self._panic}", logs=self.logs)
        return VmError(f"domain {self.name} stopped {when}", logs=self.logs)

    def wait_booted(self, timeout: float = 120.0) -> "LibvirtGuest":
        deadline = time.monotonic() + timeout
        channel = SerialChannel(self.directory / "guest.sock", self.alive)
        try:
            if wait_ready(channel, deadline):
                self.channel = channel
                return self
        except GuestDied as exc:
            channel.close()
            raise self._died("while booting") from exc
        channel.close()
        if not self.alive():
            raise self._died("while booting")
        raise GuestBootTimeout(f"guest of domain {self.name} did not reach its shell within {timeout:.0f} s",
                               logs=self.logs)

    def run(self, script: str, timeout: float = 60, check: bool = True) -> CommandResult:
        if self.channel is None:
            raise VmError(f"guest of domain {self.name} is not booted (call wait_booted)")
        return run_checked(self.channel, script, timeout, check, self._died, self.logs)

    def close(self) -> None:
        if self.channel:
            self.channel.close()
            self.channel = None
        self.conn.close()
