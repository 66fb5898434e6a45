"""``dxpu doctor``: is this host ready, and if not, what to run.

Each check is independent and returns a :class:`Check`; nothing here changes the host.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from dxpu_vfio.errors import DxpuError
from dxpu_vfio.vms import images, qemu

SETUP = "scripts/setup.sh"


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    optional: bool = False  # a problem here does not make doctor fail

    def as_dict(self) -> dict:
        return asdict(self)


def check_qemu() -> Check:
    try:
        q = qemu.find_qemu()
    except DxpuError as exc:
        return Check("qemu", False, exc.message, exc.hint or SETUP)
    return Check("qemu", True, f"QEMU {q.version_text} with vfio-user-pci ({q.source}: {q.binary})")


def check_tcg() -> Check:
    try:
        q = qemu.find_qemu()
    except DxpuError:
        return Check("tcg", False, "no usable QEMU to test", SETUP)
    proc = subprocess.run([str(q.binary), "-accel", "help"], capture_output=True, text=True, timeout=30)
    ok = "tcg" in proc.stdout
    return Check("tcg", ok, "TCG accelerator available" if ok else f"QEMU lacks TCG: {proc.stdout!r}",
                 "" if ok else "install a QEMU built with TCG (scripts/setup.sh)")


def check_kvm(required: bool) -> Check:
    """KVM is optional: /dev/kvm on these hosts exists but cannot run stock kernels."""
    path = Path("/dev/kvm")
    if not path.exists():
        return Check("kvm", False, "no /dev/kvm: use --accel tcg (the default)",
                     "load kvm_intel/kvm_amd or keep TCG", optional=not required)
    if not os.access(path, os.R_OK | os.W_OK):
        return Check("kvm", False, "/dev/kvm is not accessible to this user",
                     "add the user to group kvm or keep TCG", optional=not required)
    return Check("kvm", True, "/dev/kvm is accessible (nested KVM may still fail to boot "
                 "stock kernels; TCG is the default)", optional=not required)


def check_image(name: str) -> Check:
    try:
        img = images.load_image(name)
    except DxpuError as exc:
        return Check(f"image {name}", False, exc.message, exc.hint or f"dxpu setup images {name}")
    return Check(f"image {name}", True, f"built, kernel {img.kernel_release} ({img.directory})")


def check_libvirtd() -> Check:
    if not shutil.which("libvirtd"):
        return Check("libvirtd", False, "libvirtd is not installed",
                     "apt-get install libvirt-daemon-system (scripts/setup.sh does)", optional=True)
    sock = Path("/var/run/libvirt/libvirt-sock")
    if not sock.exists():
        return Check("libvirtd", False, "libvirtd is installed but not running",
                     "libvirtd -d && virtlogd -d", optional=True)
    return Check("libvirtd", True, f"running ({sock})", optional=True)


def check_netns() -> Check:
    """Creating a throwaway namespace is the only honest test of the right to do so."""
    if not shutil.which("ip"):
        return Check("netns", False, "iproute2 is missing", "apt-get install iproute2")
    name = f"dxpu-doctor-{os.getpid()}"
    proc = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if proc.returncode != 0:
        return Check("netns", False, f"cannot create a network namespace: {proc.stderr.strip()}",
                     "run as root (or with CAP_NET_ADMIN and CAP_SYS_ADMIN)")
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    return Check("netns", True, "network namespaces can be created")


def check_delay() -> Check:
    """How the lab impairs its links here: netem if the kernel has it, else our emulator."""
    try:
        from dxpu_vfio.lab.lab import netem_available
        netem = netem_available()
    except Exception as exc:  # noqa: BLE001 - no namespaces: reported by the netns check
        return Check("delay", False, f"cannot probe netem: {exc}", "run as root", optional=True)
    if netem:
        return Check("delay", True, "kernel netem (sch_netem): the lab injects delay with tc")
    from dxpu_vfio.lab.netemu_build import binary
    engine = "in C" if binary() else "in Python (no gcc to build the C one: apt-get install gcc)"
    return Check("delay", True, f"no sch_netem in this kernel: the lab uses its packet emulator {engine} "
                 "(a TUN in each link namespace, TBF for rates; it reports what it achieved)")


def run_checks(accel: str = "tcg") -> list[Check]:
    return [check_qemu(), check_tcg(), check_kvm(required=accel == "kvm"),
            *(check_image(name) for name in images.IMAGE_NAMES),
            check_libvirtd(), check_netns(), check_delay()]
