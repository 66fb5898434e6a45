"""The lab network: a host node and GPU boxes as network namespaces joined by veth.

``Lab(topology).up()`` creates, for a lab named N:

* namespace ``dxN-host`` (the host node: host proxies run here) and ``dxN-<box>`` per box;
* a veth per box, host side ``198.18.<i>.1/24``, box side ``198.18.<i>.2/24`` (the RFC 2544
  benchmarking range, never other addresses);
* a lab CA and certificates, a BOX.toml and a remote proxy (``dxpu remote serve``) inside
  each box namespace, with a fresh lease token per device;
* added delay per link: netem where the kernel has it, else a delay line (a TCP relay in
  the host namespace) in the path; which one is reported by ``status()``.

Everything made is written to ``<run>/lab-N/state.json`` *before* it is made, so
``Lab.down(name)`` removes every process, namespace and file also after a crash.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from pyroute2 import IPRoute, netns

from dxpu_vfio.errors import DxpuError
from dxpu_vfio.link.transport import make_certs
from dxpu_vfio.paths import run_dir
from dxpu_vfio.procs import request_json, terminate_pid
from dxpu_vfio.remoteproxy.process import RemoteProxyProcess

BOX_PORT = 7000
DELAY_PORT = 7100
DEFAULT_TOPOLOGY = """
name = "lab"
[[box]]
name = "box1"
[[box.device]]
id = "td0"
model = "testdev"
"""


class LabError(DxpuError):
    pass


@dataclass
class BoxSpec:
    name: str
    devices: list[dict]
    delay_us: float = 0.0


@dataclass
class Topology:
    name: str
    boxes: list[BoxSpec]

    @classmethod
    def parse(cls, text: str) -> "Topology":
        raw = tomllib.loads(text)
        boxes = [BoxSpec(b["name"], list(b.get("device", [])), float(b.get("delay_us", 0)))
                 for b in raw.get("box", [])]
        if not boxes:
            raise LabError("topology has no [[box]]")
        for b in boxes:
            if len(b.name) > 8 or not b.name.isalnum():
                raise LabError(f"box name {b.name!r}: use up to 8 letters and digits")
        return cls(raw.get("name", "lab"), boxes)

    @classmethod
    def load(cls, path: Path | None) -> "Topology":
        return cls.parse(Path(path).read_text() if path else DEFAULT_TOPOLOGY)


def netem_available() -> bool:
    """Whether this kernel has sch_netem (these machines do not)."""
    probe = f"dxnetem{os.getpid()}"
    netns.create(probe)
    try:
        proc = subprocess.run(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                              capture_output=True, text=True)
        return proc.returncode == 0
    finally:
        netns.remove(probe)


@dataclass
class BoxState:
    name: str
    netns: str
    host_ip: str
    box_ip: str
    config: str
    devices: dict[str, dict]  # id -> {"model", "lease"}
    proxy_pid: int | None = None
    delay_us: float = 0.0
    delay_mode: str = "none"  # none, netem, delayline
    delayline_pid: int | None = None

    @property
    def endpoint(self) -> str:
        """Where a host proxy (in the host namespace) connects to reach this box."""
        if self.delay_mode == "delayline":
            return f"{self.host_ip}:{DELAY_PORT}"
        return f"{self.box_ip}:{BOX_PORT}"


@dataclass
class LabState:
    name: str
    directory: str
    host_netns: str
    namespaces: list[str] = field(default_factory=list)
    boxes: list[BoxState] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)

    def save(self) -> None:
        path = Path(self.directory) / "state.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"name": self.name, "directory": self.directory, "host_netns": self.host_netns,
                                   "namespaces": self.namespaces, "pids": self.pids,
                                   "boxes": [b.__dict__ for b in self.boxes]}, indent=1))
        tmp.rename(path)

    @classmethod
    def load(cls, directory: Path) -> "LabState":
        raw = json.loads((directory / "state.json").read_text())
        boxes = [BoxState(**b) for b in raw.pop("boxes")]
        return cls(**raw, boxes=boxes)

    @property
    def certs(self) -> Path:
        return Path(self.directory) / "certs"

    def box(self, name: str) -> BoxState:
        for b in self.boxes:
            if b.name == name:
                return b
        raise LabError(f"lab {self.name} has no box {name!r}")

    def remote_settings(self, box: str, device: str) -> dict:
        """Settings for a host proxy in forward mode (``hotplug.attach(vm, "remote", ...)``)."""
        b = self.box(box)
        return {"address": b.endpoint, "device": device, "lease": b.devices[device]["lease"],
                "tls_dir": str(self.certs), "tls_role": "host"}


def lab_dir(name: str) -> Path:
    return run_dir() / f"lab-{name}"


def down(name: str) -> list[str]:
    """Remove everything lab ``name`` made; safe after a crash and when nothing is left."""
    directory = lab_dir(name)
    removed = []
    if (directory / "state.json").exists():
        state = LabState.load(directory)
        for pid in state.pids:
            terminate_pid(pid)
            removed.append(f"pid {pid}")
        for ns in state.namespaces:
            if ns in netns.listnetns():
                netns.remove(ns)
                removed.append(f"netns {ns}")
    for ns in netns.listnetns():  # namespaces of a crash before the state was written
        if ns.startswith(f"dx{name}-"):
            netns.remove(ns)
            removed.append(f"netns {ns}")
    if directory.exists():
        shutil.rmtree(directory)
        removed.append(str(directory))
    return removed


def _veth(host_ns: str, box_ns: str, index: int, box: str) -> tuple[str, str]:
    host_if, box_if = f"h-{box}"[:15], "uplink"
    host_ip, box_ip = f"198.18.{index}.1", f"198.18.{index}.2"
    with IPRoute(netns=host_ns) as ipr:
        ipr.link("add", ifname=host_if, kind="veth", peer={"ifname": box_if, "net_ns_fd": box_ns})
        idx = ipr.link_lookup(ifname=host_if)[0]
        ipr.addr("add", index=idx, address=host_ip, prefixlen=24)
        ipr.link("set", index=idx, state="up")
        ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
    with IPRoute(netns=box_ns) as ipr:
        idx = ipr.link_lookup(ifname=box_if)[0]
        ipr.addr("add", index=idx, address=box_ip, prefixlen=24)
        ipr.link("set", index=idx, state="up")
        ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
    return host_ip, box_ip


def up(topology: Topology) -> LabState:
    """Bring the lab up (after removing the leftovers of an earlier one of that name)."""
    name = topology.name
    down(name)
    directory = lab_dir(name)
    directory.mkdir(parents=True)
    state = LabState(name, str(directory), f"dx{name}-host")
    state.save()
    try:
        state.namespaces.append(state.host_netns)
        state.save()
        netns.create(state.host_netns)
        make_certs(state.certs, ["host", *(b.name for b in topology.boxes)])
        use_netem = any(b.delay_us for b in topology.boxes) and netem_available()
        for i, spec in enumerate(topology.boxes, start=1):
            ns = f"dx{name}-{spec.name}"
            state.namespaces.append(ns)
            state.save()
            netns.create(ns)
            host_ip, box_ip = _veth(state.host_netns, ns, i, spec.name)
            devices = {d["id"]: {"model": d["model"], "lease": secrets.token_hex(16),
                                 "settings": d.get("settings", {})} for d in spec.devices}
            config = directory / f"{spec.name}.toml"
            config.write_text(_box_toml(spec.name, box_ip, state.certs, devices))
            box = BoxState(spec.name, ns, host_ip, box_ip, str(config), devices, delay_us=spec.delay_us)
            state.boxes.append(box)
            proxy = RemoteProxyProcess(config, netns=ns)
            proxy.start()
            box.proxy_pid = proxy.pid
            state.pids.append(proxy.pid)
            state.save()
            if spec.delay_us:
                set_delay(state, spec.name, spec.delay_us, netem=use_netem)
        return state
    except BaseException:  # SystemExit from SIGTERM too (procs.exit_on_sigterm): nothing half made stays
        down(name)
        raise


def toml_value(value: object) -> str:
    """Inline TOML for the plain values device settings hold (no None: TOML has no null)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items() if v is not None) + " }"
    raise LabError(f"cannot write {value!r} into a box config")


def _box_toml(name: str, ip: str, certs: Path, devices: dict[str, dict]) -> str:
    lines = [f'name = "{name}"', f'listen = "{ip}"', f"port = {BOX_PORT}", f'tls_dir = "{certs}"']
    for dev_id, d in devices.items():
        lines += ["[[device]]", f'id = "{dev_id}"', f'model = "{d["model"]}"', f'lease = "{d["lease"]}"']
        if d["settings"]:
            lines.append(f"settings = {toml_value(d['settings'])}")
    return "\n".join(lines) + "\n"


def restart_proxy(state: LabState, box: str) -> int:
    """Start a box's remote proxy again (after it died or was killed); returns the new pid."""
    b = state.box(box)
    proxy = RemoteProxyProcess(Path(b.config), netns=b.netns).start()
    b.proxy_pid = proxy.pid
    state.pids.append(proxy.pid)
    state.save()
    return proxy.pid


def set_delay(state: LabState, box: str, delay_us: float, netem: bool | None = None) -> BoxState:
    """Change a link's one-way added delay at run time (new links see it at once)."""
    b = state.box(box)
    if b.delayline_pid:
        terminate_pid(b.delayline_pid)
        state.pids.remove(b.delayline_pid)
        b.delayline_pid = None
    netem = netem_available() if netem is None else netem
    b.delay_us = delay_us
    if not delay_us:
        b.delay_mode = "none"
    elif netem:
        for ns, dev in ((state.host_netns, f"h-{box}"[:15]), (b.netns, "uplink")):
            subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "netem", "delay",
                            f"{int(delay_us)}us"], check=True, capture_output=True)
        b.delay_mode = "netem"
    else:
        log = Path(state.directory) / f"delayline-{box}.log"
        argv = ["ip", "netns", "exec", state.host_netns, sys.executable, "-m", "dxpu_vfio.lab.delayline",
                "--listen", f"{b.host_ip}:{DELAY_PORT}", "--to", f"{b.box_ip}:{BOX_PORT}",
                "--delay-us", str(delay_us), "--report", str(Path(state.directory) / f"delayline-{box}.json")]
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        b.delayline_pid = proc.pid
        state.pids.append(proc.pid)
        deadline = time.monotonic() + 10
        while b"delay line" not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise LabError(f"delay line for {box} did not start", logs=[log])
            time.sleep(0.05)
        b.delay_mode = "delayline"
    state.save()
    return b


def delay_report(state: LabState, box: str, timeout: float = 5.0) -> dict | None:
    """What the delay line really achieved (median/p99 of the held time), if one runs."""
    b = state.box(box)
    if not b.delayline_pid:
        return None
    return request_json(b.delayline_pid, Path(state.directory) / f"delayline-{box}.json", timeout)


def status(name: str) -> dict:
    directory = lab_dir(name)
    if not (directory / "state.json").exists():
        return {"name": name, "up": False}
    state = LabState.load(directory)

    def alive(pid: int | None) -> bool:
        if not pid:
            return False
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False

    existing = set(netns.listnetns())
    return {"name": name, "up": True, "directory": state.directory, "host_netns": state.host_netns,
            "namespaces": {ns: ns in existing for ns in state.namespaces},
            "boxes": [{"name": b.name, "netns": b.netns, "address": b.box_ip, "endpoint": b.endpoint,
                       "proxy_pid": b.proxy_pid, "proxy_alive": alive(b.proxy_pid),
                       "delay_us": b.delay_us, "delay_mode": b.delay_mode,
                       "devices": {d: v["model"] for d, v in b.devices.items()}} for b in state.boxes]}
