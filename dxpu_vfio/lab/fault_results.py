"""What a fault test saw, kept for the table users read (docs/faults.md).

Each guest-driver fault test writes one JSON record, ``results/faults/<name>.json``
(``$DXPU_RESULTS/faults`` where that is set), with at least ``device`` (nvme, display,
testdev), ``fault``, ``mode`` (local or remote), ``driver`` (what the guest's driver did),
``application`` (what its user saw) and ``recovery_s`` (0: none needed; None: none);
``scripts/fault_table.py`` renders the records. A record is written even when the test
then fails, so the table can say what was seen.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from dxpu_vfio.paths import PROJECT_ROOT


def results_dir() -> Path:
    return Path(os.environ.get("DXPU_RESULTS", PROJECT_ROOT / "results")) / "faults"


def observe(name: str, record: dict) -> Path:
    """Write one test's observations (``record``) as ``<name>.json``, stamped with the
    time and the host's load; printed too, for the test's captured output."""
    directory = results_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps({"name": name, "recorded": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                "host_load": [round(x, 1) for x in os.getloadavg()], **record},
                               indent=1, default=str) + "\n")
    print(f"\n{name}: " + json.dumps(record, default=str))
    return path
