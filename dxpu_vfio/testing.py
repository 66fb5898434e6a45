"""pytest support: the VM ladder (image -> configured VM -> booted VM) and the factory
that owns every VM a test starts; the lab factory that owns every lab of a session, and
devices served locally or from a GPU box of a lab; faults on demand on a lab's boxes
(``lab_faults``).

The VM factory kills every VM at teardown, by pid; the lab factory brings every lab
down at the end of the session. When a test fails, the serial log, QEMU's stderr and
command line, and the QMP event history of each of its VMs, and the remote proxy logs
and state files of each lab it used, are copied to ``results/<test>/`` and the failure
report names that directory. etcd clusters (one member for the session, three for a
test that kills members) start on free ports and are ended by pid. Registered as a pytest plugin by ``tests/conftest.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import os
import re
import shutil
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import pytest
from pyroute2 import netns

from dxpu_vfio.lab import lab
from dxpu_vfio.native import stream as native
from dxpu_vfio.paths import PROJECT_ROOT, run_dir
from dxpu_vfio.procs import exit_on_sigterm, pid_alive, request_json, wait_until
from dxpu_vfio.vms.images import Image, load_image
from dxpu_vfio.vms.runner import Vm, VmConfig

if TYPE_CHECKING:
    from dxpu_vfio.pool.etcd_cluster import EtcdCluster

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
    factories = getattr(item, "_dxpu_factories", [])
    if report.failed and factories:
        dest = _test_dir(item.nodeid)
        saved = [p for f in factories for p in f.save_logs(dest)]
        if saved:
            report.sections.append(("dxpu logs", f"saved in {dest}: " + ", ".join(p.name for p in saved)))


TRACEBACK = b"Traceback (most recent call last)"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "allow_tracebacks(why): the test provokes a logged Python traceback on purpose")
    _stop_on_sigterm()


def _stop_on_sigterm() -> None:
    """A test run stopped by SIGTERM (CI's time limit, a user's kill) ends as after Ctrl-C:
    pytest.exit unwinds the running test and pytest then tears every fixture down, so the
    session's labs, VMs, proxies and etcd go by pid as after a clean run. Python's default
    would end the process at once and leave them all running (found when a CI run was
    stopped: a lab and two host proxies outlived it)."""
    def stop(code: int) -> None:
        pytest.exit("stopped by SIGTERM: fixtures torn down", returncode=code)

    exit_on_sigterm(stop)


def _log_sizes(root: Path) -> dict[Path, int]:
    """Every *.log under ``root`` and its size. os.walk, not rglob: a lab or VM directory
    removed during the walk (a teardown in another process) is skipped, not an error."""
    sizes = {}
    for folder, _dirs, files in os.walk(root, onerror=lambda _exc: None):
        for name in files:
            if name.endswith(".log"):
                path = Path(folder, name)
                try:
                    sizes[path] = path.stat().st_size
                except OSError:  # removed while we looked
                    pass
    return sizes


def _tracebacks(before: dict[Path, int], after: dict[Path, int]) -> list[str]:
    """'file: the line after Traceback' for each log that got a Python traceback."""
    found = []
    for path, size in after.items():
        start = before.get(path, 0) if before.get(path, 0) <= size else 0
        try:
            with open(path, "rb") as f:
                f.seek(start)
                text = f.read()
        except OSError:
            continue
        at = text.find(TRACEBACK)
        if at >= 0:
            last = text[at:].strip().splitlines()[-1].decode("utf-8", "replace")
            found.append(f"{path}: {last[:300]}")
    return found


@pytest.fixture(autouse=True)
def no_tracebacks_in_logs(request: pytest.FixtureRequest) -> Iterator[None]:
    """No uncaught exception in any proxy or manager (issue 18): after each test, the logs
    its processes wrote (under the run directory, and its tmp_path) are read, and a Python
    traceback in them fails the test, naming the file. A test that provokes one on purpose
    says so with ``@pytest.mark.allow_tracebacks("why")``. (Threads of this process: an
    uncaught exception there is an error by pyproject's filterwarnings.)"""
    root = run_dir()
    before = _log_sizes(root)
    yield
    if request.node.get_closest_marker("allow_tracebacks"):
        return
    found = _tracebacks(before, _log_sizes(root))
    funcargs = getattr(request.node, "funcargs", None)  # None once a stopped run tears it down
    tmp = funcargs.get("tmp_path") if funcargs else None
    if isinstance(tmp, Path):
        found += _tracebacks({}, _log_sizes(tmp))
    if found:
        pytest.fail("a process this test ran logged a Python traceback:\n  " + "\n  ".join(found), pytrace=False)


def register(request: pytest.FixtureRequest, factory) -> None:
    """Make a (possibly shared) factory's VMs or labs part of this test's failure logs
    (anything with ``save_logs(dest) -> list[Path]``)."""
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


@pytest.fixture(params=["native", "python"])
def stream(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A test taking ``stream`` runs over both link streams: the native one (C) and the
    Python one (the reference); processes it starts inherit the choice (DXPU_FASTLINK)."""
    if request.param == "native" and not native.built():
        pytest.fail("the native stream is not built: run scripts/setup.sh")
    monkeypatch.setenv("DXPU_FASTLINK", "1" if request.param == "native" else "0")
    return request.param


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


# --- labs -----------------------------------------------------------------------------

# Lab names the factory gives: a label of up to 4 letters, the pid of the session, "x", a
# number. The pid tells a lab of a session that died (SIGKILL, a crash) from a live one.
_FACTORY_LAB = re.compile(r"^[a-z]{1,4}(\d+)x\d+$")
_FACTORY_NETNS = re.compile(r"^dx([a-z]{1,4}(\d+)x\d+)-")


def topology_key(topology: lab.Topology) -> str:
    """What makes two topologies the same lab: their boxes (names, devices, settings,
    delays), its etcd and hosts, not their names."""
    return json.dumps([[dataclasses.asdict(b) for b in topology.boxes], topology.etcd, topology.hosts],
                      sort_keys=True, default=str)


def _proc_state(pid: int | None) -> str | None:
    """The state letter of /proc/PID/stat (R, S, T, Z ...); None if there is no such process."""
    if not pid:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2]


def _gone(pid: int) -> bool:
    """Whether ``pid`` ended (reaping it if it is our child); a zombie holds no port."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    return _proc_state(pid) in (None, "Z", "X")


class LabFactory:
    """Brings up every lab of a test session and guarantees their end (``down_all``).

    ``shared(topology)`` gives one lab per distinct topology for the whole session,
    checked before each use: a box whose remote proxy a test killed or stopped gets a
    fresh one. ``up(topology)`` gives a lab of its own (for a test that takes a lab
    apart). Names are ``<label><pid>x<n>``: unique per session and short (namespace
    ``dx<name>-<box>``, sockets under ``<run>/lab-<name>``)."""

    def __init__(self, files: Path) -> None:
        self.files = files  # for files boxes serve (NVMe disks): stable for the session
        self.names: list[str] = []  # every lab made or adopted, in order
        self.labs: dict[str, lab.LabState] = {}
        self._topologies: dict[str, lab.Topology] = {}
        self._shared: dict[str, str] = {}  # topology key -> lab name
        self._n = itertools.count(1)

    def directory(self, name: str) -> Path:
        """A directory of the session for a topology's files, e.g. NVMe disk images."""
        path = self.files / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _name(self, topology: lab.Topology) -> str:
        label = re.sub(r"[^a-z]", "", topology.name.lower())[:4] or "lab"
        return f"{label}{os.getpid()}x{next(self._n)}"

    def up(self, topology: lab.Topology) -> lab.LabState:
        """A new lab with ``topology``'s boxes (``topology.name`` gives only the label)."""
        named = dataclasses.replace(topology, name=self._name(topology), boxes=copy.deepcopy(topology.boxes))
        self.names.append(named.name)  # before up: a lab that failed half way is also removed
        self._topologies[named.name] = named
        state = lab.up(named)
        self.labs[named.name] = state
        return state

    def shared(self, topology: lab.Topology) -> lab.LabState:
        """The session's lab with these boxes, brought up on first use, restored on later ones."""
        key = topology_key(topology)
        name = self._shared.get(key)
        if name is None or name not in self.labs:
            state = self.up(topology)
            self._shared[key] = state.name
            return state
        return self.restore(self.labs[name])

    def adopt(self, name: str) -> None:
        """Own a lab that something else brings up (``dxpu lab up --name NAME``)."""
        if name not in self.names:
            self.names.append(name)

    def restore(self, state: lab.LabState) -> lab.LabState:
        """Make a lab whole again: a box whose proxy is dead or stopped gets a new one, a link
        a test changed is set back to its topology's delay; a lab
        whose namespaces are gone is brought up again under its name (same object)."""
        existing = set(netns.listnetns())
        if any(ns not in existing for ns in state.namespaces):
            again = lab.up(self._topologies[state.name])
            state.__dict__.update(again.__dict__)
            return state
        specs = {b.name: b for b in self._topologies[state.name].boxes} if state.name in self._topologies else {}
        for box in state.boxes:  # a link a test changed is given back as the topology asked
            spec = specs.get(box.name)
            want = lab.Impairment(delay_us=spec.delay_us).to_dict() if spec else None
            if want and any(box.link.get(d, lab.Impairment().to_dict()) != want for d in ("up", "down")):
                lab.set_delay(state, box.name, spec.delay_us)
        for box in state.boxes:
            pid = box.proxy_pid
            if _proc_state(pid) in ("R", "S", "D"):
                continue
            if pid:
                if pid_alive(pid):
                    try:
                        os.kill(pid, signal.SIGKILL)  # a stopped proxy would hold its port
                    except ProcessLookupError:
                        pass
                wait_until(lambda: _gone(pid), 5)
                if pid in state.pids:
                    state.pids.remove(pid)  # never signal a pid the system may give to another process
            lab.restart_proxy(state, box.name)
        return state

    def down(self, name: str) -> list[str]:
        """Bring one lab down now (a lab of its own at the end of its test)."""
        self.labs.pop(name, None)
        self._shared = {k: v for k, v in self._shared.items() if v != name}
        return lab.down(name)

    def down_all(self) -> None:
        """Every lab down, also when some fail to go: the first failure is raised after."""
        errors = []
        for name in reversed(self.names):
            try:
                self.down(name)
            except Exception as exc:  # noqa: BLE001 - go on with the others, then report
                errors.append(exc)
        self.names.clear()
        if errors:
            raise errors[0]

    @staticmethod
    def remove_orphans() -> list[str]:
        """Bring down the labs of sessions that died before their end (their pid is gone)."""
        names = {d.name[4:] for d in run_dir().glob("lab-*")} | \
                {m.group(1) for ns in netns.listnetns() if (m := _FACTORY_NETNS.match(ns))}
        orphans = [n for n in names if (m := _FACTORY_LAB.match(n)) and not pid_alive(int(m.group(1)))]
        for name in sorted(orphans):
            lab.down(name)
        return orphans


class LabUse:
    """The labs one test uses: their logs join the test's failure logs, and the labs of
    its own (``own``, ``adopt``) go down at its end."""

    def __init__(self, factory: LabFactory) -> None:
        self.factory = factory
        self.used: list[str] = []
        self.owned: list[str] = []

    @property
    def files(self) -> Path:
        return self.factory.files

    def _use(self, name: str) -> None:
        if name not in self.used:
            self.used.append(name)

    def shared(self, topology: lab.Topology) -> lab.LabState:
        state = self.factory.shared(topology)
        self._use(state.name)
        return state

    def own(self, topology: lab.Topology) -> lab.LabState:
        """A lab for this test only: for a test that takes it apart."""
        state = self.factory.up(topology)  # one that fails half way removes itself (lab.up)
        self._track(state.name)
        return state

    def adopt(self, name: str) -> str:
        """A lab made by other means (the CLI) that this test owns."""
        self.factory.adopt(name)
        self._track(name)
        return name

    def _track(self, name: str) -> None:
        self._use(name)
        self.owned.append(name)

    def save_logs(self, dest: Path) -> list[Path]:
        return [p for name in self.used if (p := lab.save_logs(name, dest)) is not None]

    def close(self) -> None:
        for name in self.owned:
            self.factory.down(name)


@pytest.fixture(scope="session")
def lab_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabFactory]:
    """Every lab of the session; all brought down at its end, whatever the tests did.
    Labs left by sessions that died (SIGKILL) are removed first."""
    LabFactory.remove_orphans()
    factory = LabFactory(tmp_path_factory.mktemp("lab-files"))
    try:
        yield factory
    finally:
        factory.down_all()


@pytest.fixture
def labs(request: pytest.FixtureRequest, lab_factory: LabFactory) -> Iterator[LabUse]:
    """This test's view of the lab factory: ``labs.shared(topology)``, ``labs.own(topology)``."""
    use = LabUse(lab_factory)
    register(request, use)
    try:
        yield use
    finally:
        use.close()


@pytest.fixture
def lab_faults() -> Iterator:
    """Faults on demand on lab boxes (:mod:`dxpu_vfio.lab.faults`):
    ``lab_faults(state, "box1", "td0", attachment=att)`` -> a :class:`~dxpu_vfio.lab.faults.Faults`.
    At teardown every box it was used on is thawed and every fault armed there is cleared,
    whatever the test did."""
    from dxpu_vfio.lab.faults import Faults
    made: list[Faults] = []

    def make(state: lab.LabState, box: str, device: str | None = None, **kwargs) -> Faults:
        faults = Faults.for_lab(state, box, device, **kwargs)
        made.append(faults)
        return faults
    try:
        yield make
    finally:
        for faults in made:
            faults.close()


# --- devices served locally or from a GPU box ------------------------------------------

@dataclass(frozen=True)
class Serve:
    """A device a module serves in both modes: ``model`` with ``settings`` as device ``id``
    of GPU box ``box`` (remote), or by a local device server with ``local`` settings (by
    default the same settings)."""
    model: str
    id: str
    box: str = "box1"
    settings: dict = field(default_factory=dict)
    local: dict | None = None


def serve_topology(specs: list[Serve], label: str = "srv") -> lab.Topology:
    """The lab that serves ``specs`` remotely: one box per distinct ``box``, in first-use order."""
    boxes: dict[str, lab.BoxSpec] = {}
    for s in specs:
        box = boxes.setdefault(s.box, lab.BoxSpec(s.box, []))
        box.devices.append({"id": s.id, "model": s.model, **({"settings": s.settings} if s.settings else {})})
    return lab.Topology(label, list(boxes.values()))


@dataclass
class ServedDevice:
    """What ``hotplug.attach`` needs to plug one device of a mode; for ``remote`` also
    the lab, box and device id (for the box's stats and display probes)."""
    mode: str  # "local" or "remote"
    model: str  # what attach() serves: the model itself, or "remote" (a host proxy forwarding)
    settings: dict
    netns: str | None = None
    lab: lab.LabState | None = None
    box: str | None = None
    device: str | None = None

    @property
    def remote(self) -> bool:
        return self.mode == "remote"

    @property
    def name(self) -> str | None:
        """BOX/DEVICE, as ``dxpu stats`` and ``dxpu screenshot`` name a box's device."""
        return f"{self.box}/{self.device}" if self.remote else None

    def attach_args(self, **settings) -> dict:
        """Keyword arguments for ``hotplug.attach(vm, **args)``; ``settings`` are added."""
        return {"model": self.model, "settings": {**copy.deepcopy(self.settings), **settings}, "netns": self.netns}

    def box_stats(self, timeout: float = 5.0) -> dict:
        """The counters of the remote proxy serving this device (remote only)."""
        if not self.remote:
            raise ValueError("a locally served device has no box")
        b = self.lab.box(self.box)
        stats = request_json(b.proxy_pid, Path(b.config).with_suffix(".stats.json"), timeout)
        assert stats is not None, f"remote proxy of {self.box} (pid {b.proxy_pid}) gave no stats in {timeout} s"
        return stats


@pytest.fixture(scope="module", params=["local", "remote"])
def served(request: pytest.FixtureRequest) -> str:
    """Run a module's tests twice: devices served by a local device server, then from a
    GPU box in the lab. The module names its devices in a ``served_specs`` fixture
    (a list of :class:`Serve`) and takes them from ``served_device(s)``."""
    return request.param


def _module_label(request: pytest.FixtureRequest) -> str:
    return re.sub(r"^test_?", "", request.module.__name__.rsplit(".", 1)[-1]) or "srv"


@pytest.fixture
def served_lab(request: pytest.FixtureRequest, labs: LabUse, served_specs: list[Serve]) -> lab.LabState:
    """The session's lab that serves this module's ``served_specs`` (shared, restored)."""
    return labs.shared(serve_topology(served_specs, _module_label(request)))


@pytest.fixture
def served_devices(request: pytest.FixtureRequest, served: str, served_specs: list[Serve]) -> list[ServedDevice]:
    """This module's devices (``served_specs``), ready to attach in this mode."""
    if served == "local":
        return [ServedDevice("local", s.model, copy.deepcopy(s.settings if s.local is None else s.local))
                for s in served_specs]
    state = request.getfixturevalue("served_lab")
    return [ServedDevice("remote", "remote", state.remote_settings(s.box, s.id), state.host_netns, state, s.box, s.id)
            for s in served_specs]


@pytest.fixture
def served_device(served_devices: list[ServedDevice]) -> ServedDevice:
    """The first of this module's devices, ready to attach in this mode."""
    return served_devices[0]


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


# --- etcd ---------------------------------------------------------------------------
@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator["EtcdCluster"]:
    """One etcd member for the session, on free ports, data under tmp; tests share it by
    using a key prefix of their own (``etcd_prefix``). Members run with ``ETCD_*``
    scrubbed and are ended by pid (dxpu_vfio.pool.etcd_cluster)."""
    from dxpu_vfio.pool.etcd_cluster import EtcdCluster
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd1"), members=1).start()
    yield cluster
    cluster.stop()
    assert not any(m.alive() for m in cluster.members), "an etcd member outlived the session"


@pytest.fixture
def etcd_prefix(request: pytest.FixtureRequest) -> str:
    """A key prefix no other test uses, so tests share one etcd without seeing each other."""
    return f"/dxpu-test/{next(_ids)}-{re.sub(r'[^A-Za-z0-9]+', '-', request.node.name)[:60]}/v1/"


@pytest.fixture(params=["sqlite", "etcd"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[list]:
    """Two handles on one pool, as two hosts (or a manager and a host agent) hold them:
    one SQLite file opened twice, or two clients of the session's etcd under this test's
    prefix. A test taking ``stores`` runs on both stores."""
    from dxpu_vfio.pool.etcd_store import EtcdStore
    from dxpu_vfio.pool.store import Store
    if request.param == "sqlite":
        handles = [Store(tmp_path / "pool.db"), Store(tmp_path / "pool.db")]
    else:
        cluster, prefix = request.getfixturevalue("etcd"), request.getfixturevalue("etcd_prefix")
        handles = [EtcdStore(cluster.endpoints, path=tmp_path / f"h{i}.db", prefix=prefix) for i in (1, 2)]
    yield handles
    for handle in handles:
        handle.close()


@pytest.fixture
def etcd3(tmp_path: Path) -> Iterator["EtcdCluster"]:
    """A three-member cluster of this test alone (tests kill members of it)."""
    from dxpu_vfio.pool.etcd_cluster import EtcdCluster
    cluster = EtcdCluster(tmp_path / "etcd3", members=3).start()
    yield cluster
    cluster.stop()
