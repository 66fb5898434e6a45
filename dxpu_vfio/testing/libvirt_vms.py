"""libvirtd for the session (only the daemons it started are stopped) and a tiny guest
in a libvirt domain of its own per test, destroyed and undefined at teardown."""

from __future__ import annotations

import itertools
import os
import re
import shutil
from pathlib import Path
from typing import Iterator

import pytest

from dxpu_vfio.testing.reports import register
from dxpu_vfio.vms.images import Image

_ids = itertools.count(1)
_LIBVIRT_TEST_NAME = re.compile(r"^dxpu-t(\d+)-\d+$")


@pytest.fixture(scope="session")
def libvirtd() -> Iterator[list]:
    """virtlogd + libvirtd running for the session; at the end it stops only the daemons
    it started itself (by pid). Domains left by dead test processes are removed first."""
    from dxpu_vfio.vmm.libvirt_conn import ensure_daemons, stop_daemons
    from dxpu_vfio.vms.libvirt_domain import check_libvirt_setup
    started = ensure_daemons()
    try:
        check_libvirt_setup()
        _remove_orphan_test_domains()
        yield started
    finally:
        stop_daemons(started)


def _remove_orphan_test_domains() -> None:
    from dxpu_vfio.vmm.libvirt_conn import connect
    from dxpu_vfio.vms.libvirt_domain import undefine_domain
    conn = connect()
    try:
        names = [d.name() for d in conn.listAllDomains()]
    finally:
        conn.close()
    for name in names:
        match = _LIBVIRT_TEST_NAME.match(name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            undefine_domain(name)


class LibvirtVm:
    """A running tiny-image libvirt domain of one test: its name, a LibvirtTarget for
    QMP, and ``run()`` for guest commands (the VM runner's serial channel)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.target = None
        self.guest = None

    def boot(self, timeout: float = 120.0) -> "LibvirtVm":
        from dxpu_vfio.vmm.libvirt_target import LibvirtTarget
        from dxpu_vfio.vms.libvirt_domain import DomainConfig, LibvirtGuest, define_domain
        define_domain(DomainConfig(name=self.name, image="tiny"), start=True)
        self.target = LibvirtTarget(self.name)
        self.guest = LibvirtGuest(self.name).wait_booted(timeout)
        return self

    def run(self, script: str, timeout: float = 60, check: bool = True):
        return self.guest.run(script, timeout, check)

    @property
    def logs(self) -> list[Path]:
        from dxpu_vfio.vmm.libvirt_conn import qemu_log_path
        from dxpu_vfio.vms.libvirt_domain import domain_dir
        return [domain_dir(self.name) / "serial.log", qemu_log_path(self.name)]

    def save_logs(self, dest: Path) -> list[Path]:
        from dxpu_vfio.vms.libvirt_domain import domain_dir
        target = dest / self.name
        target.mkdir(parents=True, exist_ok=True)
        for src in (*self.logs, domain_dir(self.name) / "domain.xml"):
            if src.exists():
                shutil.copy2(src, target / ("qemu.log" if src.parent.name == "qemu" else src.name))
        return [target]

    def destroy(self) -> None:
        """Close the connections, destroy and undefine the domain, remove its files."""
        from dxpu_vfio.errors import DxpuError
        from dxpu_vfio.vms.libvirt_domain import undefine_domain
        for holder in (self.guest, self.target):
            if holder is not None:
                holder.close()
        try:
            undefine_domain(self.name)
        except DxpuError:  # never defined (define failed): nothing to remove
            pass


@pytest.fixture
def libvirt_vm(request: pytest.FixtureRequest, libvirtd: list, tiny_image: Image) -> Iterator[LibvirtVm]:
    """A tiny guest in a libvirt domain of its own (``dxpu-t<pid>-<n>``), booted; destroyed
    and undefined at teardown, its serial and QEMU logs saved if the test failed."""
    vm = LibvirtVm(f"dxpu-t{os.getpid()}-{next(_ids)}")
    register(request, vm)
    try:
        yield vm.boot()
    finally:
        vm.destroy()
