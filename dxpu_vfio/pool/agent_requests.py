"""What a manager asks of a host's agent through a lease record, and waiting for the
answer. Apart from :mod:`dxpu_vfio.pool.agent` so that the manager, which writes the
requests, and the agent, which runs a manager to serve them, do not import each other."""

from __future__ import annotations

import time
from typing import Callable

from dxpu_vfio.pool.storage import Lease, PoolStore

ATTACH, DETACH = "attach", "detach"  # a lease record's ``request``


def wait_for_agent(store: PoolStore, lease_ids: list[str], until: Callable[[Lease | None], bool],
                   timeout: float, poll: float = 0.1) -> dict[str, Lease | None]:
    """The leases (None: deleted) once ``until`` holds for each, or at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        by_id = {lease.id: lease for lease in store.leases() if lease.id in lease_ids}
        now = {lease_id: by_id.get(lease_id) for lease_id in lease_ids}
        if all(until(lease) for lease in now.values()) or time.monotonic() >= deadline:
            return now
        time.sleep(poll)
