"""pytest support: the VM ladder (image -> configured VM -> booted VM) and the factory
that owns every VM a test starts.

The factory kills every VM at teardown, by pid. When a test fails, the serial log,
QEMU's stderr and command line, and the QMP event history of each of its VMs are
copied to ``results/<test>/`` and the failure report names that directory.
Registered as a pytest plugin by ``tests/conftest.py``.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
from pathlib import Path
from typing import Iterator

import pytest

from dxpu_vfio.vms.images import Image, load_image
from dxpu_vfio.paths import PROJECT_ROOT, run_dir
from dxpu_vfio.procs import wait_until
from dxpu_vfio.vms.runner import Vm, VmConfig

RESULTS_DIR = Path(os.environ.get("DXPU_RESULTS", PROJECT_ROOT / "results"))
_ids = itertools.count(1)


def save_vm_logs(vm: Vm, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("serial.log", "qemu.stderr", "qemu.cmdline"):
        src = vm.workdir / name
        if src.exists():
            shutil.copy2(src, dest / name)
    (dest / "qmp-events.json").write_text(json.dumps(vm.qmp.history, indent=1, default=str))


class VmFactory:
    """Creates VMs for one test (or one module) and guarantees their end."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.vms: list[Vm] = []

    def build(self, image: str = "tiny", **overrides) -> Vm:
        """A configured, not yet started VM (first rung of the ladder)."""
        n = next(_ids)
        config = VmConfig(image=image, name=overrides.pop("name", f"t{n}"), **overrides)
        # Socket paths must stay under 108 bytes: keep the workdir short.
        vm = Vm(config, workdir=run_dir() / f"t{os.getpid()}-{n}")
        self.vms.append(vm)
        return vm

    def booted(self, image: str = "tiny", **overrides) -> Vm:
        """A VM whose guest answers commands (top rung)."""
        return self.build(image, **overrides).boot()

    def save_logs(self, dest: Path) -> list[Path]:
        saved = []
        for vm in self.vms:
            target = dest / vm.config.name
            save_vm_logs(vm, target)
            saved.append(target)
        return saved

    def kill_all(self) -> None:
        for vm in self.vms:
            vm.kill()
            shutil.rmtree(vm.workdir, ignore_errors=True)
        self.vms.clear()


def _test_dir(nodeid: str) -> Path:
    return RESULTS_DIR / re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    factories: list[VmFactory] = getattr(item, "_dxpu_factories", [])
    if report.failed and factories:
        dest = _test_dir(item.nodeid)
        saved = [p for f in factories for p in f.save_logs(dest)]
        if saved:
            report.sections.append(("dxpu VM logs", f"serial log, QEMU stderr and QMP events saved in {dest}"))


def register(request: pytest.FixtureRequest, factory: VmFactory) -> None:
    """Make a (possibly shared) factory's VMs part of this test's failure logs."""
    node = request.node
    if not hasattr(node, "_dxpu_factories"):
        node._dxpu_factories = []
    node._dxpu_factories.append(factory)


def shared_vm(request: pytest.FixtureRequest, factory: VmFactory) -> Vm:
    """The first VM of a module-scoped factory, for one test: its logs join the test's
    failure logs, and a guest that died in an earlier test fails this one plainly."""
    register(request, factory)
    vm = factory.vms[0]
    if not vm.guest_alive():
        pytest.fail(f"the shared guest died earlier; see {vm.workdir}")
    return vm


def eventually(predicate, timeout: float = 5.0, what: str = "condition", interval: float = 0.02) -> None:
    """Like :func:`wait_until`, failing the test with ``what`` on timeout."""
    assert wait_until(predicate, timeout, interval), f"{what} did not happen within {timeout} s"


_loops = itertools.count()


class GuestLoop:
    """``while :; do BODY; done`` in the background of a guest, until :meth:`stop`.

    The loop runs from a script file of its own so that it can be found: a subshell
    started with ``(... &)`` shows only its parent's command line. Stopping kills, by pid,
    every process whose command line names the loop or one of ``tools`` (found in /proc:
    the tiny image's busybox has no pkill), until none is left: a survivor would go on
    driving whatever is plugged at the same address next.
    """

    def __init__(self, vm: Vm, body: str, log: str = "/dev/null", tools: tuple[str, ...] = ()) -> None:
        self.vm = vm
        n = next(_loops)
        self.script, self.stopper = f"/tmp/dxpu-loop{n}.sh", f"/tmp/dxpu-loop{n}.stop"
        patterns = "|".join(f'*"{p}"*' for p in (self.script, *tools))
        vm.run(f"cat > {self.script} <<'EOF'\nwhile :; do {body}; done\nEOF")
        vm.run(f"cat > {self.stopper} <<'EOF'\n"  # a file of its own: its command line names no pattern
               "i=0\nwhile :; do\n  found=\n  for d in /proc/[0-9]*; do\n"
               "    cmd=$(tr '\\0' ' ' < $d/cmdline 2>/dev/null) || continue\n"
               f"    case \"$cmd\" in {patterns}) kill -9 ${{d#/proc/}} 2>/dev/null && found=1;; esac\n"
               "  done\n  [ -z \"$found\" ] && exit 0\n  i=$((i+1)); [ $i -ge 100 ] && exit 1\n  sleep 0.1\ndone\nEOF")
        vm.run(f"(sh {self.script} > {log} 2>&1 &)")

    def stop(self, timeout: float = 30) -> None:
        self.vm.run(f"sh {self.stopper}", timeout=timeout)


@pytest.fixture(scope="session")
def tiny_image() -> Image:
    """The built tiny image; fails naming the setup command if it is missing."""
    return load_image("tiny")


@pytest.fixture(scope="session")
def full_image() -> Image:
    return load_image("full")


@pytest.fixture
def vm_factory(request: pytest.FixtureRequest, tiny_image: Image) -> Iterator[VmFactory]:
    factory = VmFactory(request.node.name)
    register(request, factory)
    yield factory
    factory.kill_all()


@pytest.fixture
def tiny_vm(vm_factory: VmFactory) -> Vm:
    """A booted tiny guest of its own, with QEMU's edu device as a local baseline."""
    return vm_factory.booted("tiny", edu=True)


@pytest.fixture(scope="module")
def _shared_full_factory(full_image: Image) -> Iterator[VmFactory]:
    factory = VmFactory("shared-full")
    yield factory
    factory.kill_all()


@pytest.fixture(scope="module")
def _shared_tiny_factory(tiny_image: Image) -> Iterator[VmFactory]:
    factory = VmFactory("shared-tiny")
    yield factory
    factory.kill_all()


def _first_booted(request: pytest.FixtureRequest, factory: VmFactory, image: str, **overrides) -> Vm:
    if not factory.vms:
        factory.booted(image, name=image, **overrides)
    return shared_vm(request, factory)


@pytest.fixture
def full_vm(request: pytest.FixtureRequest, _shared_full_factory: VmFactory) -> Vm:
    """One booted full guest shared by the tests of a module (its boot takes ~30 s)."""
    return _first_booted(request, _shared_full_factory, "full", boot_timeout=240)


@pytest.fixture
def shared_tiny_vm(request: pytest.FixtureRequest, _shared_tiny_factory: VmFactory) -> Vm:
    """One booted tiny guest shared by the tests of a module (hot-plug tests, which
    give back what they plug, need no guest of their own)."""
    return _first_booted(request, _shared_tiny_factory, "tiny")


@pytest.fixture(scope="module", params=["local", "remote"])
def served(request: pytest.FixtureRequest) -> str:
    """Run a module's tests twice: devices served by a local device server, then from a
    GPU box in the lab (the module says how it builds each)."""
    return request.param


# --- libvirt ------------------------------------------------------------------------

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
        from dxpu_vfio.vms.libvirt_domain import DomainConfig, LibvirtGuest, define_domain
        from dxpu_vfio.vmm.libvirt_target import LibvirtTarget
        define_domain(DomainConfig(name=self.name, image="tiny"), start=True)
        self.target = LibvirtTarget(self.name)
        self.guest = LibvirtGuest(self.name).wait_booted(timeout)
        return self

    def run(self, script: str, timeout: float = 60, check: bool = True):
        return self.guest.run(script, timeout, check)

    @property
    def logs(self) -> list[Path]:
        from dxpu_vfio.vms.libvirt_domain import domain_dir
        from dxpu_vfio.vmm.libvirt_conn import qemu_log_path
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
