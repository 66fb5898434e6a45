"""Devices served locally or from a GPU box: a module names its devices (``served_specs``)
and its tests run twice, once against a local device server and once against a box of
the session's lab. And ``stream``: a test taking it runs over both link streams."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dxpu_vfio.lab import lab
from dxpu_vfio.native import stream as native
from dxpu_vfio.procs import request_json
from dxpu_vfio.testing.labs import LabUse


@pytest.fixture(params=["native", "python"])
def stream(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A test taking ``stream`` runs over both link streams: the native one (C) and the
    Python one (the reference); processes it starts inherit the choice (DXPU_FASTLINK)."""
    if request.param == "native" and not native.built():
        pytest.fail("the native stream is not built: run scripts/setup.sh")
    monkeypatch.setenv("DXPU_FASTLINK", "1" if request.param == "native" else "0")
    return request.param


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
