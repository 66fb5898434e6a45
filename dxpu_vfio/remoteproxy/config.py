"""A GPU box's configuration: its name, where it listens, TLS, and its devices.

BOX.toml::

    name = "box1"
    listen = "198.18.0.2"
    port = 7000
    tls_dir = "/path/to/certs"   # ca.pem + box1.pem/key (+ host.pem); or: plaintext = true
    managers = ["host"]          # whose certificates (ROLE.pem in tls_dir) may GRANT tokens
    [[device]]
    id = "td0"
    model = "testdev"
    settings = { memory_size = 4294967296 }
    [[device]]
    id = "ext0"
    model = "vfio-user"          # an external vfio-user server, driven as a client
    lease = "static-token"       # optional: a token for use without a pool (never sent)
    settings = { socket = "/run/ext0.sock" }

    [pool]                       # optional: announce the box in an etcd pool (no `dxpu box add`)
    store = "etcd"
    etcd_endpoints = "http://10.0.0.1:2379,http://10.0.0.2:2379"
    etcd_tls_dir = "/etc/dxpu/etcd"  # optional: ca.pem, host.pem, host.key for etcd's https
    prefix = "/dxpu/v1/"         # the pool's key prefix
    ttl = 10                     # s: the box lease; a dead box is down after at most this
    address = "198.18.0.2:7000"  # how hosts reach the box (default: listen and the bound port)
    host_tls_dir = "/etc/dxpu/certs"  # where hosts keep the pool's CA and host certificate
                                 # (default: this box's tls_dir; none for a plaintext box)

With ``[pool]`` the remote proxy publishes its inventory under a box lease it renews
(:mod:`dxpu_vfio.remoteproxy.announce`). A pool manager gets a fresh token per lease from the box (GRANT,
:mod:`dxpu_vfio.remoteproxy.grants`); ``lease`` is only for host proxies started by hand.
``dead_after`` (default 3 s) and ``heartbeat`` (0.25 s) are the link's liveness rule on
the box, as on the host: a host unheard for ``dead_after`` loses its device, and no send
to a host that stops reading waits longer than that.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

EXTERNAL_MODEL = "vfio-user"  # a device behind an external vfio-user server


@dataclass
class BoxDevice:
    id: str
    model: str
    lease: str | None = None  # a static token (no pool); None: only tokens the box granted admit
    settings: dict = field(default_factory=dict)


@dataclass
class PoolConfig:
    """Where the box announces itself (``[pool]``)."""

    etcd_endpoints: list[str]
    store: str = "etcd"
    etcd_tls_dir: str | None = None
    prefix: str = "/dxpu/v1/"
    ttl: float = 10.0
    address: str | None = None
    host_tls_dir: str | None = None

    @classmethod
    def parse(cls, raw: dict) -> "PoolConfig":
        endpoints = raw.get("etcd_endpoints", [])
        endpoints = endpoints.split(",") if isinstance(endpoints, str) else [str(e) for e in endpoints]
        pool = cls([e.strip() for e in endpoints if e.strip()], str(raw.get("store", "etcd")),
                   raw.get("etcd_tls_dir"), str(raw.get("prefix", "/dxpu/v1/")), float(raw.get("ttl", 10.0)),
                   raw.get("address"), raw.get("host_tls_dir"))
        if pool.store != "etcd":
            raise ValueError(f"[pool] store = {pool.store!r}: only an etcd pool takes announcements from boxes "
                             "(a SQLite pool registers boxes with dxpu box add)")
        if not pool.etcd_endpoints:
            raise ValueError("[pool] needs etcd_endpoints")
        if pool.ttl < 1:
            raise ValueError(f"[pool] ttl must be at least 1 s, not {pool.ttl}")
        return pool


# A guest's read loop on a box over this lab's veth: 95-110 µs from one read's answer to the
# next read without the spin, 20-40 µs with it (docs/benchmarks-history.md, Remote, tenth session):
# the spin must cover the gap it shortens, or it never starts.
DEFAULT_READ_SPIN_US = 150.0


def spin_setting(key: str, value: object) -> float:
    """A spin of BOX.toml (µs, 0 to 1e6, what the native stream takes) as a float, or a
    ValueError that names its key; a lab topology checks its boxes' with it too."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1e6:
        raise ValueError(f"{key} must be a number of µs, 0 to 1000000, not {value!r}")
    return float(value)


@dataclass
class BoxConfig:
    name: str
    listen: str
    port: int
    devices: list[BoxDevice]
    tls_dir: Path | None = None
    plaintext: bool = False
    spin_us: float = 0.0  # adaptive polling on the native stream: spin before sleeping (0: off)
    managers: list[str] = field(default_factory=lambda: ["host"])  # roles whose certificates may GRANT
    # a host unheard this long loses its device (heartbeats every heartbeat s); sends to it
    # are bounded by the same time, so a host that stops reading cannot hold the device longer
    dead_after: float = 3.0
    heartbeat: float = 0.25
    pool: PoolConfig | None = None  # announce the box there
    # the reader spins this long for the next message after answering a register read, while
    # such gaps average within it (native/serve.c; 0: off): a read loop pays no wake-up per read
    read_spin_us: float = DEFAULT_READ_SPIN_US

    @classmethod
    def load(cls, path: Path) -> "BoxConfig":
        with open(path, "rb") as f:
            raw = tomllib.load(f)
        try:
            devices = [BoxDevice(d["id"], d["model"], str(d["lease"]) if d.get("lease") is not None else None,
                                 d.get("settings", {})) for d in raw.get("device", [])]
            config = cls(raw["name"], raw.get("listen", "127.0.0.1"), int(raw.get("port", 7000)), devices,
                         Path(raw["tls_dir"]) if raw.get("tls_dir") else None, bool(raw.get("plaintext", False)),
                         spin_setting("spin_us", raw.get("spin_us", 0.0)), [str(r) for r in raw.get("managers", ["host"])],
                         float(raw.get("dead_after", 3.0)), float(raw.get("heartbeat", 0.25)),
                         PoolConfig.parse(raw["pool"]) if "pool" in raw else None,
                         read_spin_us=spin_setting("read_spin_us", raw.get("read_spin_us", DEFAULT_READ_SPIN_US)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: bad box config: {exc}") from exc
        if not 0 < config.heartbeat < config.dead_after:
            raise ValueError(f"{path}: heartbeat ({config.heartbeat} s) must be above 0 and below dead_after "
                             f"({config.dead_after} s)")
        if config.tls_dir is None and not config.plaintext:
            raise ValueError(f"{path}: set tls_dir, or plaintext = true to run without TLS")
        return config

    def device_list(self) -> str:
        return ", ".join(f"{d.id} ({d.model})" for d in self.devices)
