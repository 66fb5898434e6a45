"""Which proxies run on this host, for ``dxpu stats``.

Each host proxy (device server) and remote proxy writes ``<run>/proxies/<kind>-<name>-<pid>.json``
when it starts and removes it when it ends; entries of processes that died without
cleaning up are dropped when read. Counters are then asked for with SIGUSR1.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dxpu_vfio.paths import run_dir
from dxpu_vfio.procs import request_json


def _dir() -> Path:
    d = run_dir() / "proxies"
    d.mkdir(parents=True, exist_ok=True)
    return d


def register(kind: str, name: str, stats_path: Path, **info: object) -> Path:
    entry = _dir() / f"{kind}-{name}-{os.getpid()}.json"
    entry.write_text(json.dumps({"kind": kind, "name": name, "pid": os.getpid(),
                                 "stats": str(stats_path), **info}))
    return entry


def unregister(entry: Path) -> None:
    entry.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    """The process runs and is still ours (a recycled pid runs something else)."""
    try:
        return b"dxpu_vfio" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def entries() -> list[dict]:
    found = []
    for path in sorted(_dir().glob("*.json")):
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _alive(entry["pid"]):
            found.append(entry)
        else:
            path.unlink(missing_ok=True)
    return found


def collect(entry: dict, timeout: float = 3.0) -> dict | None:
    """Ask one proxy for its counters (SIGUSR1) and read what it wrote."""
    return request_json(entry["pid"], Path(entry["stats"]), timeout)
