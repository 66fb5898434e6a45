"""The lab network: a host node and GPU boxes as network namespaces, a link namespace between.

``Lab(topology).up()`` creates, for a lab named N:

* namespace ``dxN-host`` (the host node: host proxies run here), ``dxN-<box>`` per box and,
  between them, the box's link namespace ``dxN-<box>-link``, a router joined to each side
  by a veth;
* addresses: host side ``198.18.<i>.1/24``, box side ``198.18.<i>.2/24`` (the RFC 2544
  benchmarking range, never other addresses); the link namespace has none (static
  neighbours on both sides), so to either end it is one wire;
* a lab CA and certificates, a BOX.toml and a remote proxy (``dxpu remote serve``) inside
  each box namespace, with a fresh lease token per device;
* impairments per link and direction (delay, jitter, loss, reordering, duplication,
  rate; ``set_link``): netem on the link namespace's veths where the kernel has it, else
  the lab's packet emulator (``dxpu_vfio/lab/netemu.py``) in the link namespace, with
  TBF for rates; which one is reported by ``status()``.

Everything made is written to ``<run>/lab-N/state.json`` *before* it is made, so
``Lab.down(name)`` removes every process, namespace and file also after a crash.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from pyroute2 import IPRoute, netns

from dxpu_vfio import registry
from dxpu_vfio.errors import DxpuError
from dxpu_vfio.lab.impairment import Impairment, config_text, netem_args, tbf_args
from dxpu_vfio.lab.netemu_build import binary as emulator_binary
from dxpu_vfio.link.transport import make_certs
from dxpu_vfio.paths import run_dir
from dxpu_vfio.procs import request_file, request_json, terminate_pid, wait_until, write_bytes_atomic
from dxpu_vfio.remoteproxy.config import spin_setting
from dxpu_vfio.remoteproxy.process import RemoteProxyProcess

BOX_PORT = 7000
EMU_TUN = "emu"
MAX_HOSTS = 8
TO_HOST, TO_BOX = "toh", "tob"  # the link namespace's veths: egress toward the host, toward the box
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
    read_spin_us: float | None = None  # BOX.toml's read_spin_us (None: the box's default)
    plaintext: bool = False  # the box and its host proxies without TLS (what TLS costs: benchmarks)


@dataclass
class Topology:
    name: str
    boxes: list[BoxSpec]
    etcd: int = 0  # members of an etcd cluster the lab runs (its boxes announce themselves there); 0: none
    hosts: int = 1  # host namespaces: the first is the lab's host; the others reach the boxes through it

    @classmethod
    def parse(cls, text: str) -> "Topology":
        raw = tomllib.loads(text)
        boxes = []
        for b in raw.get("box", []):
            spin = b.get("read_spin_us")
            try:
                spin = None if spin is None else spin_setting("read_spin_us", spin)
            except ValueError as exc:
                raise LabError(f"box {b['name']!r}: {exc}") from None
            plaintext = b.get("plaintext", False)
            if not isinstance(plaintext, bool):
                raise LabError(f"box {b['name']!r}: plaintext = {plaintext!r}: true or false")
            boxes.append(BoxSpec(b["name"], list(b.get("device", [])), float(b.get("delay_us", 0)), spin, plaintext))
        if not boxes:
            raise LabError("topology has no [[box]]")
        for b in boxes:
            if len(b.name) > 8 or not b.name.isalnum():
                raise LabError(f"box name {b.name!r}: use up to 8 letters and digits")
            if b.name.startswith("host") and b.name[4:].isdigit():
                raise LabError(f"box name {b.name!r}: hostN names the lab's host namespaces")
        etcd = raw.get("etcd", 0)
        if etcd not in (0, 1, 3, 5):
            raise LabError(f"etcd = {etcd!r}: a cluster of 1, 3 or 5 members (0: none)")
        hosts = raw.get("hosts", 1)
        if not isinstance(hosts, int) or not 1 <= hosts <= MAX_HOSTS:
            raise LabError(f"hosts = {hosts!r}: 1 to {MAX_HOSTS} host namespaces")
        return cls(raw.get("name", "lab"), boxes, etcd, hosts)

    @classmethod
    def load(cls, path: Path | None) -> "Topology":
        return cls.parse(Path(path).read_text() if path else DEFAULT_TOPOLOGY)


@functools.lru_cache(maxsize=1)
def netem_available() -> bool:
    """Whether this kernel has sch_netem (these machines do not); probed once a process."""
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
    delay_us: float = 0.0  # the up direction's, for reports that name one delay
    delay_mode: str = "none"  # none, netem, emulator, tbf (a rate only)
    link_netns: str = ""
    link: dict = field(default_factory=dict)  # "up"/"down" -> Impairment.to_dict()
    emulator_pid: int | None = None
    realtime: bool = True  # the emulator runs SCHED_FIFO
    tls_dir: str | None = None  # ca.pem + host.pem/key that reach it; None: a plaintext box

    @property
    def endpoint(self) -> str:
        """Where a host proxy (in the host namespace) connects to reach this box: the
        box itself, whatever the link does (impairments are on the path, not a relay)."""
        return f"{self.box_ip}:{BOX_PORT}"

    def impairment(self, direction: str) -> Impairment:
        return Impairment.from_dict(self.link.get(direction, {}))


@dataclass
class LabState:
    name: str
    directory: str
    host_netns: str
    namespaces: list[str] = field(default_factory=list)
    boxes: list[BoxState] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    etcd_ports: list[int] = field(default_factory=list)  # client ports of the lab's etcd members (host namespace)
    etcd_pids: list[int] = field(default_factory=list)
    extra_hosts: list[str] = field(default_factory=list)  # namespaces of hosts 2, 3, ... (routed by the first)

    def save(self) -> None:
        path = Path(self.directory) / "state.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"name": self.name, "directory": self.directory, "host_netns": self.host_netns,
                                   "namespaces": self.namespaces, "pids": self.pids,
                                   "etcd_ports": self.etcd_ports, "etcd_pids": self.etcd_pids,
                                   "extra_hosts": self.extra_hosts,
                                   "boxes": [b.__dict__ for b in self.boxes]}, indent=1))
        tmp.rename(path)

    @classmethod
    def load(cls, directory: Path) -> "LabState":
        raw = json.loads((directory / "state.json").read_text())
        known = {f.name for f in dataclasses.fields(BoxState)}  # a state file of an older lab too
        for b in raw["boxes"]:  # (whose boxes all had TLS, and no tls_dir in the file)
            b.setdefault("tls_dir", str(Path(raw["directory"]) / "certs"))
        boxes = [BoxState(**{k: v for k, v in b.items() if k in known}) for b in raw.pop("boxes")]
        return cls(**raw, boxes=boxes)

    @property
    def certs(self) -> Path:
        return Path(self.directory) / "certs"

    @property
    def etcd_endpoints(self) -> list[str]:
        """The lab's etcd, as its host namespace reaches it (a host agent or manager there)."""
        return [f"http://127.0.0.1:{port}" for port in self.etcd_ports]

    @property
    def hosts(self) -> list[str]:
        """Every host namespace: the lab's host first, then hosts 2, 3, ..."""
        return [self.host_netns, *self.extra_hosts]

    def etcd_endpoints_of_host(self, netns: str) -> list[str]:
        """The lab's etcd as host namespace ``netns`` reaches it (host 2 and on: the first
        host's end of their uplink)."""
        if netns == self.host_netns:
            return self.etcd_endpoints
        router = _host_subnet(self.extra_hosts.index(netns) + 2) + ".1"
        return [f"http://{router}:{port}" for port in self.etcd_ports]

    def etcd_endpoints_from(self, box: str) -> list[str]:
        """The lab's etcd, as box ``box`` reaches it: the host's end of its link."""
        host_ip = self.box(box).host_ip
        return [f"http://{host_ip}:{port}" for port in self.etcd_ports]

    def box(self, name: str) -> BoxState:
        for b in self.boxes:
            if b.name == name:
                return b
        raise LabError(f"lab {self.name} has no box {name!r}")

    def remote_settings(self, box: str, device: str) -> dict:
        """Settings for a host proxy in forward mode (``hotplug.attach(vm, "remote", ...)``)."""
        b = self.box(box)
        security = {"tls_dir": b.tls_dir, "tls_role": "host"} if b.tls_dir else {"plaintext": True}
        return {"address": b.endpoint, "device": device, "lease": b.devices[device]["lease"], **security}


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
        registry.sweep()  # the entries of its boxes that were killed and could not remove theirs
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


def _ip(ns: str, *args: str) -> None:
    proc = subprocess.run(["ip", "-n", ns, *args], capture_output=True, text=True)
    if proc.returncode:
        raise LabError(f"ip -n {ns} {' '.join(args)}: {proc.stderr.strip()}")


def _mac(ns: str, ifname: str) -> str:
    with IPRoute(netns=ns) as ipr:
        return ipr.get_links(ifname=ifname)[0].get_attr("IFLA_ADDRESS")


def _sysctl(ns: str, *settings: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", *settings], check=True, capture_output=True)


def _link(host_ns: str, link_ns: str, box_ns: str, index: int, box: str) -> tuple[str, str]:
    """host ``h-<box>`` = ``toh`` [link namespace: a router] ``tob`` = ``uplink`` box.

    The link namespace routes each end's /32 to the other side's veth (or into the
    emulator's TUN, see :func:`set_link`); it holds no address, and both ends have static
    neighbours for each other, so to them it is one wire."""
    host_if, box_if = f"h-{box}"[:15], "uplink"
    host_ip, box_ip = f"198.18.{index}.1", f"198.18.{index}.2"
    _sysctl(link_ns, "net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0",
            "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1")
    with IPRoute(netns=host_ns) as ipr:
        ipr.link("add", ifname=host_if, kind="veth", peer={"ifname": TO_HOST, "net_ns_fd": link_ns})
    with IPRoute(netns=link_ns) as ipr:
        ipr.link("add", ifname=TO_BOX, kind="veth", peer={"ifname": box_if, "net_ns_fd": box_ns})
    for ns, ifname, ip in ((host_ns, host_if, host_ip), (box_ns, box_if, box_ip)):
        with IPRoute(netns=ns) as ipr:
            idx = ipr.link_lookup(ifname=ifname)[0]
            ipr.addr("add", index=idx, address=ip, prefixlen=24)
            ipr.link("set", index=idx, state="up")
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
    for ifname in (TO_HOST, TO_BOX, "lo"):
        _ip(link_ns, "link", "set", ifname, "up")
    _ip(host_ns, "neigh", "replace", box_ip, "lladdr", _mac(link_ns, TO_HOST), "dev", host_if, "nud", "permanent")
    _ip(box_ns, "neigh", "replace", host_ip, "lladdr", _mac(link_ns, TO_BOX), "dev", box_if, "nud", "permanent")
    for ip, ifname, peer_ns, peer_if in ((host_ip, TO_HOST, host_ns, host_if), (box_ip, TO_BOX, box_ns, box_if)):
        _ip(link_ns, "neigh", "replace", ip, "lladdr", _mac(peer_ns, peer_if), "dev", ifname, "nud", "permanent")
        _ip(link_ns, "route", "add", f"{ip}/32", "dev", ifname, "metric", "100")
        _ip(link_ns, "route", "add", f"{ip}/32", "dev", ifname, "table", "100")  # for packets from the emulator
    _ip(link_ns, "rule", "add", "iif", EMU_TUN, "lookup", "100", "priority", "100")
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
        for number in range(2, topology.hosts + 1):
            _add_host(state, number)
        if topology.etcd:
            _start_etcd(state, topology.etcd)
        use_netem = netem_available() if any(b.delay_us for b in topology.boxes) else False
        for i, spec in enumerate(topology.boxes, start=1):
            ns, link_ns = f"dx{name}-{spec.name}", f"dx{name}-{spec.name}-link"
            state.namespaces += [ns, link_ns]
            state.save()
            netns.create(ns)
            netns.create(link_ns)
            host_ip, box_ip = _link(state.host_netns, link_ns, ns, i, spec.name)
            devices = {d["id"]: {"model": d["model"], "lease": secrets.token_hex(16),
                                 "settings": d.get("settings", {})} for d in spec.devices}
            config = directory / f"{spec.name}.toml"
            pool = ([f"http://{host_ip}:{port}" for port in state.etcd_ports]) if topology.etcd else None
            tls_dir = None if spec.plaintext else str(state.certs)
            config.write_text(_box_toml(spec.name, box_ip, tls_dir, devices, etcd=pool,
                                        read_spin_us=spec.read_spin_us))
            box = BoxState(spec.name, ns, host_ip, box_ip, str(config), devices, link_netns=link_ns,
                           tls_dir=tls_dir)
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


def _box_toml(name: str, ip: str, tls_dir: str | None, devices: dict[str, dict], etcd: list[str] | None = None,
              read_spin_us: float | None = None) -> str:
    security = f'tls_dir = "{tls_dir}"' if tls_dir else "plaintext = true"
    lines = [f'name = "{name}"', f'listen = "{ip}"', f"port = {BOX_PORT}", security]
    if read_spin_us is not None:
        lines.append(f"read_spin_us = {toml_value(read_spin_us)}")
    for dev_id, d in devices.items():
        lines += ["[[device]]", f'id = "{dev_id}"', f'model = "{d["model"]}"', f'lease = "{d["lease"]}"']
        if d["settings"]:
            lines.append(f"settings = {toml_value(d['settings'])}")
    if etcd:  # the box announces itself in the lab's etcd pool (no dxpu box add)
        lines += ["[pool]", 'store = "etcd"', f"etcd_endpoints = {toml_value(','.join(etcd))}", "ttl = 3"]
    return "\n".join(lines) + "\n"


def _host_subnet(number: int) -> str:
    """Host ``number`` (2, 3, ...) and the first host share ``198.18.<128 + number>.0/24``."""
    return f"198.18.{128 + number}"


def _add_host(state: LabState, number: int) -> None:
    """Host namespace ``number`` (2, 3, ...), joined to the first host by a veth: the
    first host routes it to every box and masquerades it as its own end of each link,
    so boxes, links and their emulators see one host address per link (the hosts share
    each box's wire, as hosts behind one top-of-rack switch share its uplink)."""
    ns = f"{state.host_netns}{number}"
    state.namespaces.append(ns)
    state.extra_hosts.append(ns)
    state.save()
    netns.create(ns)
    subnet, down_if = _host_subnet(number), f"host{number}"
    with IPRoute(netns=ns) as ipr:
        ipr.link("add", ifname="uplink", kind="veth", peer={"ifname": down_if, "net_ns_fd": state.host_netns})
    _ip(ns, "addr", "add", f"{subnet}.2/24", "dev", "uplink")
    _ip(state.host_netns, "addr", "add", f"{subnet}.1/24", "dev", down_if)
    for n, ifname in ((ns, "uplink"), (ns, "lo"), (state.host_netns, down_if), (state.host_netns, "lo")):
        _ip(n, "link", "set", ifname, "up")
    _ip(ns, "route", "add", "default", "via", f"{subnet}.1")
    _sysctl(state.host_netns, "net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0")
    nat = ["ip", "netns", "exec", state.host_netns, "iptables", "-t", "nat", "-A", "POSTROUTING", "-s",
            f"{subnet}.0/24", "!", "-d", f"{subnet}.0/24", "-j", "MASQUERADE"]
    proc = subprocess.run(nat, capture_output=True, text=True)
    if proc.returncode:
        raise LabError(f"cannot masquerade host {number} in {state.host_netns}: {proc.stderr.strip()}",
                       hint="the lab's extra hosts need iptables (nftables) with NAT: apt install iptables")


def _start_etcd(state: LabState, members: int) -> None:
    """An etcd cluster in the host namespace, data under the lab's directory: each member's
    pid is in the state before the next starts, so ``down`` ends them after a crash too."""
    from dxpu_vfio.pool.etcd_cluster import EtcdCluster
    _ip(state.host_netns, "link", "set", "lo", "up")  # the members' peer URLs are on 127.0.0.1
    cluster = EtcdCluster(Path(state.directory) / "etcd", members, netns=state.host_netns, listen_all=True)
    state.etcd_ports = [m.client_port for m in cluster.members]
    for member in cluster.members:
        cluster.start_member(member)
        state.etcd_pids.append(member.pid)
        state.pids.append(member.pid)
        state.save()
    cluster.wait_healthy()


def restart_proxy(state: LabState, box: str) -> int:
    """Start a box's remote proxy again (after it died or was killed); returns the new pid."""
    b = state.box(box)
    proxy = RemoteProxyProcess(Path(b.config), netns=b.netns).start()
    b.proxy_pid = proxy.pid
    state.pids.append(proxy.pid)
    state.save()
    return proxy.pid


def set_link(state: LabState, box: str, up: Impairment, down: Impairment | None = None,
             netem: bool | None = None, force_emulator: bool = False, engine: str = "c",
             realtime: bool | None = None, fast_path: bool = True) -> BoxState:
    """Change what a link does to each direction's packets (``down``: as ``up`` if not
    given), at run time: established connections stay up, they only see the new link.

    netem on the link namespace's veths where the kernel has it; else the packet emulator
    (started on first need, told by SIGHUP after that, ended when nothing is asked of it:
    the kernel then forwards directly) and TBF for rates. ``force_emulator`` keeps the
    emulator in the path with nothing to do (to measure what it costs). ``engine``: ``c``
    (built with the host's gcc; ``netemu.py`` where there is none) or ``python``, for a
    run that is started now (a running emulator keeps its engine). ``fast_path`` (C engine,
    for a run started now): tc programs on the veths let the kernel forward a direction
    that asks for nothing and send only the others through the emulator's loop; off, every
    packet goes through the loop (what the benchmark measures as the loop's own floor). ``realtime`` (on unless
    turned off; kept until changed): the emulator runs SCHED_FIFO, as netem's timers run
    ahead of every process, so on a busy machine it is not kept waiting for a core (at
    load 10, 50 µs asked: held p50 63 µs and std 313 µs without, 50.1 and 3 with). It
    spins at most ~100 µs per packet it releases; the kernel's RT throttling bounds it."""
    b = state.box(box)
    down = up if down is None else down
    netem = netem_available() if netem is None else netem
    b.link = {"up": up.to_dict(), "down": down.to_dict()}
    b.delay_us = up.delay_us
    b.realtime = b.realtime if realtime is None else realtime
    egress = {TO_BOX: up, TO_HOST: down}
    if netem and not force_emulator:
        _stop_emulator(state, b)
        for dev, imp in egress.items():
            _qdisc(b.link_netns, dev, netem_args(imp) if imp.needs_emulator or imp.rate_bps else None)
        b.delay_mode = "netem" if up.needs_emulator or down.needs_emulator or up.rate_bps or down.rate_bps else "none"
    else:
        for dev, imp in egress.items():
            _qdisc(b.link_netns, dev, tbf_args(imp.rate_bps) if imp.rate_bps else None)
        if force_emulator or up.needs_emulator or down.needs_emulator:
            _emulate(state, b, engine, fast_path)
            b.delay_mode = "emulator"
            policy = os.SCHED_FIFO if b.realtime else os.SCHED_OTHER
            os.sched_setscheduler(b.emulator_pid, policy, os.sched_param(10 if b.realtime else 0))
        else:
            _stop_emulator(state, b)
            b.delay_mode = "tbf" if up.rate_bps or down.rate_bps else "none"
    state.save()
    return b


def set_delay(state: LabState, box: str, delay_us: float, netem: bool | None = None) -> BoxState:
    """The same one-way delay both ways and nothing else (what the sweep varies)."""
    return set_link(state, box, Impairment(delay_us=delay_us), netem=netem)


def _qdisc(ns: str, dev: str, args: list[str] | None) -> None:
    if args is None:
        subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
        return
    proc = subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *args],
                          capture_output=True, text=True)
    if proc.returncode:
        raise LabError(f"tc qdisc {args[0]} on {dev} in {ns}: {proc.stderr.strip()}",
                       hint="this kernel lacks the qdisc: check `tc qdisc add dev lo root tbf rate 1gbit "
                            "burst 100k latency 10ms` in a namespace")


def _emulator_files(state: LabState, box: str) -> tuple[Path, Path, Path]:
    d = Path(state.directory)
    return d / f"link-{box}.conf", d / f"link-{box}.report.json", d / f"link-{box}.log"


def _emulate(state: LabState, b: BoxState, engine: str = "c", fast_path: bool = True) -> None:
    """Start the emulator and route both ends' /32 into its TUN, or send it the new config."""
    config, report, log = _emulator_files(state, b.name)
    write_bytes_atomic(config, config_text({d: b.impairment(d) for d in ("up", "down")}).encode())
    if b.emulator_pid:
        pid = b.emulator_pid
        before = report.stat().st_mtime_ns if report.exists() else 0
        if _running(pid):
            os.kill(pid, signal.SIGHUP)  # it re-reads the config, then rewrites its report
        taken = lambda: report.exists() and report.stat().st_mtime_ns != before  # noqa: E731
        wait_until(lambda: taken() or not _running(pid), 5)
        if taken() and _running(pid):
            return
        if _running(pid):
            raise LabError(f"the emulator of {b.name} did not take its new config", logs=[log])
        # it died (or is dying: its TUN and routes went first): a new one below
        _stop_emulator(state, b)
    built = emulator_binary() if engine == "c" else None
    program = [str(built)] if built else [sys.executable, "-m", "dxpu_vfio.lab.netemu"]
    argv = ["ip", "netns", "exec", b.link_netns, *program, "--tun", EMU_TUN, "--up-dst", b.box_ip,
            "--down-dst", b.host_ip, "--config", str(config), "--report", str(report)]
    if built and fast_path:  # the C one steers packets with tc programs on the veths (its kernel fast path), if it can
        argv += ["--up-if", TO_HOST, "--down-if", TO_BOX]
    offset = log.stat().st_size if log.exists() else 0  # the log keeps earlier runs
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    b.emulator_pid = proc.pid
    state.pids.append(proc.pid)
    state.save()
    if not wait_until(lambda: b"emulator on" in log.read_bytes()[offset:] or proc.poll() is not None, 10) \
            or proc.poll() is not None:
        raise LabError(f"the emulator of {b.name} did not start", logs=[log])
    _ip(b.link_netns, "link", "set", EMU_TUN, "txqueuelen", "10000", "up")  # no loss nobody asked for
    if b"kernel fast path" in log.read_bytes()[offset:]:
        return  # its programs send a direction into the TUN while it asks for something; gone with it
    for ip in (b.host_ip, b.box_ip):  # ahead of the direct routes (metric 100); gone with the TUN
        _ip(b.link_netns, "route", "replace", f"{ip}/32", "dev", EMU_TUN, "metric", "10")


def _running(pid: int) -> bool:
    """Alive and not a zombie (which would never answer a signal)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def _stop_emulator(state: LabState, b: BoxState) -> None:
    """End the emulator (it sends what it holds); its TUN and routes go with it, so the
    kernel forwards directly again."""
    if b.emulator_pid:
        terminate_pid(b.emulator_pid)
        if b.emulator_pid in state.pids:
            state.pids.remove(b.emulator_pid)
        b.emulator_pid = None


def link_report(state: LabState, box: str, timeout: float = 5.0) -> dict | None:
    """What the emulator really did per direction since its counters were last zeroed
    (packets, bytes, losses, held-time percentiles); None where it is not in the path."""
    b = state.box(box)
    if not b.emulator_pid:
        return None
    return request_json(b.emulator_pid, _emulator_files(state, box)[1], timeout=timeout)


def reset_link_counters(state: LabState, box: str) -> None:
    """Zero the emulator's counters (a benchmark's step starts from nothing)."""
    b = state.box(box)
    if b.emulator_pid:
        request_file(b.emulator_pid, _emulator_files(state, box)[1], sig=signal.SIGUSR2)


def delay_report(state: LabState, box: str, timeout: float = 5.0) -> dict | None:
    """The held time the emulator achieved, both directions together (median, p99), for
    reports that name one delay; None where no emulator is in the path."""
    report = link_report(state, box, timeout)
    if report is None:
        return None
    up, down = report["up"], report["down"]
    return {"asked_us": up["asked"]["delay_us"], "packets": up["packets"] + down["packets"],
            "bytes": up["bytes"] + down["bytes"],
            "achieved_median_us": (up["delay_us"]["p50"] + down["delay_us"]["p50"]) / 2,
            "achieved_p99_us": max(up["delay_us"]["p99"], down["delay_us"]["p99"])}


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
            "hosts": state.hosts,
            "namespaces": {ns: ns in existing for ns in state.namespaces},
            "etcd": [{"endpoint": url, "pid": pid, "alive": alive(pid)}
                     for url, pid in zip(state.etcd_endpoints, state.etcd_pids)],
            "boxes": [{"name": b.name, "netns": b.netns, "address": b.box_ip, "endpoint": b.endpoint,
                       "proxy_pid": b.proxy_pid, "proxy_alive": alive(b.proxy_pid),
                       "tls": b.tls_dir is not None,
                       "delay_us": b.delay_us, "delay_mode": b.delay_mode, "link_netns": b.link_netns,
                       "link": b.link, "emulator_pid": b.emulator_pid, "realtime": b.realtime, "emulator_alive": alive(b.emulator_pid),
                       "devices": {d: v["model"] for d, v in b.devices.items()}} for b in state.boxes]}


def save_logs(name: str, dest: Path) -> Path | None:
    """Copy a lab's files (state.json, each box's BOX.toml, remote proxy log and stats,
    link emulator config, report and log) and its status to ``dest/lab-NAME``; not the certificates (keys)."""
    src = lab_dir(name)
    if not src.is_dir():
        return None
    target = dest / f"lab-{name}"
    target.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file():  # sockets and the certs directory stay
            shutil.copy2(path, target / path.name)
    (target / "status.json").write_text(json.dumps(status(name), indent=1))
    return target
