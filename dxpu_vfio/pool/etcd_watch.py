"""One etcd watch stream (the JSON gateway's ``/v3/watch``): the events on a key range
from a given revision on, in order, as they come.

A watch started at revision R delivers every change made at R or later (unless etcd
compacted past R: :class:`WatchCompacted`, and the caller must read everything again).
So whoever keeps "the revision up to which I have seen everything" and restarts its
watch just after it misses no event -- across a broken stream, a dead member, or a
watch it stopped on purpose. Used by the store's allocation view and the host agent.
"""

from __future__ import annotations

import json
import socket
from typing import Iterator, Protocol

import requests

from dxpu_vfio.pool.etcd_answers import check_events
from dxpu_vfio.pool.etcd_records import BadRecord


class WatchEndpoints(Protocol):
    """What a watch needs of the store's client (``EtcdClient``): its endpoints'
    streaming clients, the one that answered last first."""

    def watch_clients(self) -> list: ...


class WatchCompacted(Exception):
    """etcd compacted past the revision the watch asked for: read everything again."""

    def __init__(self, revision: int) -> None:
        super().__init__(f"etcd compacted its history up to revision {revision}")
        self.revision = revision


class WatchFailed(Exception):
    """No endpoint would open the watch stream."""


class Watch:
    """Events on ``[key, range_end)`` (both base64, as the gateway takes them) from
    ``start_revision`` on. Iterate for lists of events (each ``{"type", "kv"}``); the
    iteration ends when the stream ends (closed by :meth:`close`, or its member went away)."""

    def __init__(self, etcd: WatchEndpoints, key: str, range_end: str, start_revision: int,
                 prefix: str | None = None) -> None:
        """``prefix``: the pool's, whose records the events must hold (etcd_records)."""
        self.prefix = prefix
        self.failed: str | None = None  # why the stream was given up, where it was not etcd's
        body = json.dumps({"create_request": {"key": key, "range_end": range_end,
                                              "start_revision": start_revision}})
        self.start_revision = start_revision
        self.response: requests.Response | None = None
        errors = []
        for client in etcd.watch_clients():  # the endpoint that answered last first
            try:
                self.response = client.session.post(client.get_url("/watch"), data=body, stream=True,
                                                    timeout=(client.timeout, None))
                self.response.raise_for_status()
                return
            except requests.RequestException as exc:
                errors.append(f"{client.get_url('/watch')}: {type(exc).__name__}")
        raise WatchFailed("; ".join(errors))

    def __iter__(self) -> Iterator[list[dict]]:
        response = self.response
        if response is None:
            return
        try:
            for line in response.iter_lines():
                if not line:
                    continue
                result = json.loads(line).get("result") or {}
                compacted = int(result.get("compact_revision") or 0)
                if compacted:
                    raise WatchCompacted(compacted)
                if result.get("canceled"):
                    return
                if result.get("events"):
                    yield check_events(result["events"], self.prefix)
        except (requests.RequestException, OSError, AttributeError, TypeError):
            return  # the stream broke: closed by us, or its member went away
        except (ValueError, BadRecord) as exc:  # not etcd's, or a record the store cannot use:
            self.failed = str(exc)  # a full read will say which
            return

    def close(self) -> None:
        """End the stream; a thread iterating it returns (as etcd3gw's Watcher.stop: shut
        the socket down under the reading thread)."""
        response, self.response = self.response, None
        if response is None:
            return
        try:
            sock = socket.fromfd(response.raw._fp.fileno(), socket.AF_INET, socket.SOCK_STREAM)
            sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        except (OSError, AttributeError, ValueError):
            pass
        response.close()
