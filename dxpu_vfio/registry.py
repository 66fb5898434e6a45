"""Which proxies run on this host, for ``dxpu stats``, screenshots and the pool manager.

Each host proxy and remote proxy writes ``<run>/proxies/<kind>-<name>-<pid>.json`` when
it starts (:mod:`dxpu_vfio.daemon`) and removes it when it ends. An entry names its
process by pid *and* start time: a process that died without cleaning up, or a pid the
kernel has since given to another process, no longer matches and is dropped when read.
This, not the command line, is how a proxy is recognised, so moving a module never
makes running proxies look dead. Counters are then asked for with SIGUSR1.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dxpu_vfio.paths import create_exclusive, run_dir
from dxpu_vfio.procs import process_start_time, request_json


def _dir() -> Path:
    d = run_dir() / "proxies"
    d.mkdir(exist_ok=True, mode=0o700)
    return d


def entry_path(kind: str, name: str, pid: int) -> Path:
    return _dir() / f"{kind}-{name.replace('/', '_')}-{pid}.json"


def register(kind: str, name: str, stats_path: Path, **info: object) -> Path:
    """Record this process; returns the entry to :func:`unregister` on the way out."""
    pid = os.getpid()
    entry = entry_path(kind, name, pid)
    tmp = entry.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)  # a leftover of a crashed process with our pid (a link is removed, not followed)
    create_exclusive(tmp, json.dumps({"kind": kind, "name": name, "pid": pid, "start_time": process_start_time(pid),
                                      "stats": str(stats_path), **info}).encode())
    tmp.rename(entry)  # readers never see half an entry
    return entry


def unregister(entry: Path) -> None:
    entry.unlink(missing_ok=True)


def alive(entry: dict) -> bool:
    """The entry's process still runs: same pid, same start time."""
    start = entry.get("start_time")
    return start is not None and process_start_time(int(entry["pid"])) == start


def entries() -> list[dict]:
    found = []
    for path in sorted(_dir().glob("*.json")):
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(entry, dict) and "pid" in entry and alive(entry):
            found.append(entry)
        else:
            path.unlink(missing_ok=True)
    return found


def sweep() -> None:
    """Drop the entries of proxies that are gone: one killed by a signal could not remove
    its own (a parent calls this after it ended one, so nothing outlives the process)."""
    entries()


def find(pid: int, kind: str | None = None) -> dict | None:
    """The live entry of process ``pid`` (of ``kind``), if it registered."""
    return next((e for e in entries() if e["pid"] == pid and (kind is None or e["kind"] == kind)), None)


def collect(entry: dict, timeout: float = 3.0) -> dict | None:
    """Ask one proxy for its counters (SIGUSR1) and read what it wrote."""
    return request_json(entry["pid"], Path(entry["stats"]), timeout)
