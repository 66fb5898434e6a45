"""The lab factory: every lab of a test session, shared per topology and restored
before each use, or a test's own; all brought down at the end of the session, and labs
of sessions that died are removed first. Faults on demand on a lab's boxes."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import os
import re
import signal
from pathlib import Path
from typing import Iterator

import pytest
from pyroute2 import netns

from dxpu_vfio.lab import lab
from dxpu_vfio.paths import run_dir
from dxpu_vfio.procs import pid_alive, wait_until
from dxpu_vfio.testing.reports import register


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
