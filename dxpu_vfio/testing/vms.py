"""The VM ladder (image -> configured VM -> booted VM) and the factory that owns every
VM a test starts: killed by pid at teardown, logs saved when the test fails. A full
guest boots once per session and is handed from module to module while it stays clean;
a tiny one is shared by the tests of a module that give back what they plug."""

from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

import pytest

from dxpu_vfio.paths import run_dir
from dxpu_vfio.testing.reports import register
from dxpu_vfio.vms.images import Image, load_image
from dxpu_vfio.vms.runner import Vm, VmConfig

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


def shared_vm(request: pytest.FixtureRequest, factory: VmFactory) -> Vm:
    """The first VM of a module-scoped factory, for one test: its logs join the test's
    failure logs, and a guest that died in an earlier test fails this one plainly."""
    register(request, factory)
    vm = factory.vms[0]
    if not vm.guest_alive():
        pytest.fail(f"the shared guest died earlier; see {vm.workdir}")
    return vm


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


@pytest.fixture(scope="session")
def _shared_full_factory(full_image: Image) -> Iterator[VmFactory]:
    factory = VmFactory("shared-full")
    yield factory
    factory.kill_all()


def _guest_devices(vm: Vm) -> str:
    """The guest's PCI functions and the device nodes drivers made of them (framebuffers,
    DRM cards, disks): what a module must give back. A framebuffer can outlive its card
    (bochs-drm after a surprise removal, seen in test_display), and the next display would
    then be /dev/fb1 where a test writes /dev/fb0; a writer's dd once left a regular file
    named /dev/fb0)."""
    return vm.run("ls /sys/bus/pci/devices /sys/class/graphics /sys/class/drm /sys/block; "
                  "stat -c '%n %F' /dev/fb* /dev/dri/* 2>/dev/null; true").stdout


@pytest.fixture(scope="module")
def _module_full_vm(_shared_full_factory: VmFactory) -> Iterator[Vm]:
    """The session's full guest, handed to one module. A full boot costs ~40 s under TCG,
    so modules share one guest; what one module leaves must not reach the next: a guest
    that died, or that ends a module with other devices than it was handed over with (a
    device left plugged, a framebuffer that outlived its card), is killed, and the next
    module boots a fresh one."""
    factory = _shared_full_factory
    vm = factory.vms[-1] if factory.vms else None
    if vm is None or not vm.guest_alive():
        vm = factory.booted("full", name=f"full{len(factory.vms)}", boot_timeout=240)
    handed_over = _guest_devices(vm)
    yield vm
    try:
        clean = vm.guest_alive() and _guest_devices(vm) == handed_over
    except Exception:  # a guest that no longer answers is no guest to hand over
        clean = False
    if not clean:
        vm.kill()


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
def full_vm(request: pytest.FixtureRequest, _shared_full_factory: VmFactory, _module_full_vm: Vm) -> Vm:
    """One booted full guest shared by the tests of a session (see ``_module_full_vm``)."""
    register(request, _shared_full_factory)
    if not _module_full_vm.guest_alive():
        pytest.fail(f"the shared guest died earlier; see {_module_full_vm.workdir}")
    return _module_full_vm


@pytest.fixture
def shared_tiny_vm(request: pytest.FixtureRequest, _shared_tiny_factory: VmFactory) -> Vm:
    """One booted tiny guest shared by the tests of a module (hot-plug tests, which
    give back what they plug, need no guest of their own)."""
    return _first_booted(request, _shared_tiny_factory, "tiny")
