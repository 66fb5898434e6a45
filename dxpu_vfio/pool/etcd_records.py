"""The pool's records in etcd, checked by kind before the store uses any of them.

Every key under the pool's prefix is ``<kind>`` or ``<kind>/<name>`` (``claims/<box>/<device>``),
and its value is the JSON the etcd store writes for that kind
(:mod:`dxpu_vfio.pool.etcd_store` has the layout). A value of another shape -- changed
by hand with ``etcdctl``, or written by something else sharing the prefix -- would stop
the store somewhere in the middle of a listing or an allocation; checked here, it is a
:class:`BadRecord` that names the key and the command that shows or removes it. Kinds
this version does not know are passed on unchecked (a newer dxpu may add some).
"""

from __future__ import annotations

from typing import Callable

from dxpu_vfio.pool.states import BoxState, LeaseState
from dxpu_vfio.pool.storage import StoreError


class BadRecord(StoreError):
    """A key in the pool's prefix holds a value the store cannot use."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"the pool's key {key} {why}: it is not what dxpu writes there",
                         hint=f"look at it with: etcdctl get {key}; if nothing of dxpu's should be "
                              f"there, delete it: etcdctl del {key}")
        self.key = key


# A field's spec: the JSON types it may have (exact types: a bool is no number), or the
# strings it may be. Exact-type sets keep the check cheap: a full read of a big pool
# checks tens of thousands of fields.
Spec = frozenset
STR, OPT_STR = frozenset({str}), frozenset({str, type(None)})
NUM, OPT_NUM = frozenset({int, float}), frozenset({int, float, type(None)})
INT, OPT_INT = frozenset({int}), frozenset({int, type(None)})
_MISSING = object()

BOX = {"address": STR, "tls_dir": OPT_STR, "state": frozenset(s.value for s in BoxState),
       "registered_at": NUM, "last_error": OPT_STR, "cert_sha256": OPT_STR}
BOX_OPTIONAL = {"generation": OPT_STR}
DEVICE = {"name": STR, "class": STR, "vendor": STR, "model": STR, "capacity": INT}
LEASE = {"id": STR, "device": STR, "vm": STR, "state": frozenset(s.value for s in LeaseState), "qdev_id": STR}
LEASE_OPTIONAL = {"port": OPT_STR, "socket": OPT_STR, "proxy_pid": OPT_INT, "owner_pid": OPT_INT,
                  "created_at": NUM, "updated_at": NUM, "host": OPT_STR, "holder": OPT_STR,
                  "request": OPT_STR, "error": OPT_STR}  # exactly Lease's fields (fence aside)
HOST_OPTIONAL = {"holder": OPT_STR, "agent_pid": OPT_INT, "started_at": OPT_NUM, "expires_at": OPT_NUM}


def _fits(value: object, spec: Spec) -> bool:
    return type(value) in spec or (type(value) is str and value in spec)


def _object(value: object, required: dict[str, Spec], optional: dict[str, Spec], *,
            closed: bool = False) -> str | None:
    """Why ``value`` is not such an object (None: it is). ``closed``: no other fields."""
    if type(value) is not dict:
        return f"holds {type(value).__name__}, not an object"
    for name, spec in required.items():
        field = value.get(name, _MISSING)
        if type(field) not in spec and not (type(field) is str and field in spec):  # _fits, inlined: the hot loop
            return f"lacks its {name!r} field" if field is _MISSING else f"has {name!r} = {field!r:.60}"
    for name, spec in optional.items():
        if name in value and not _fits(value[name], spec):
            return f"has {name!r} = {value[name]!r:.60}"
    if closed and (extra := set(value) - set(required) - set(optional)):
        return f"has fields dxpu does not write: {', '.join(sorted(extra))[:80]}"
    return None


def _inventory(value: object) -> str | None:
    if type(value) is not list:
        return f"holds {type(value).__name__}, not a list of devices"
    for i, device in enumerate(value):
        if (why := _object(device, DEVICE, {})) is not None:
            return f"device {i} {why}"
    return None


def _lease(value: object) -> str | None:
    why = _object(value, LEASE, LEASE_OPTIONAL, closed=True)
    if why is None and "/" not in value["device"]:  # type: ignore[index]
        return f"has 'device' = {value['device']!r:.60}, not box/device"  # type: ignore[index]
    return why


def _plain(spec: Spec, what: str) -> Callable[[object], str | None]:
    return lambda v: None if type(v) in spec else f"holds {v!r:.60}, not {what}"


# kind -> (the parts its name has after the kind: 0, 1 or 2; the value's check)
KINDS: dict[str, tuple[int, Callable[[object], str | None]]] = {
    "schema": (0, lambda v: None if type(v) is int or type(v) is str and v.isdigit()
               else f"holds {v!r:.60}, not a version number"),
    "pool_id": (0, _plain(STR, "a pool id")),
    "alive": (1, lambda v: None),
    "boxes": (1, lambda v: _object(v, BOX, BOX_OPTIONAL)),
    "seen": (1, _plain(NUM, "a time")),
    "inventory": (1, _inventory),
    "claims": (2, _plain(STR, "a lease id")),
    "leases": (1, _lease),
    "hosts": (1, lambda v: _object(v, {}, HOST_OPTIONAL)),
    "fenced": (1, _plain(NUM, "a time")),
}


def check_record(prefix: str, key: str, value: object, deleted: bool = False) -> None:
    """BadRecord unless ``key`` (under ``prefix``) names a record of a known shape and,
    unless ``deleted``, ``value`` is that kind's JSON."""
    if not key.startswith(prefix):
        raise BadRecord(key, f"is outside the pool's prefix {prefix}")
    kind, _, name = key[len(prefix):].partition("/")
    if kind not in KINDS:
        return
    parts, check = KINDS[kind]
    names = name.split("/") if name else []
    if len(names) != parts or not all(names):
        raise BadRecord(key, f"is not {kind}" + "/<name>" * parts)
    if not deleted and (why := check(value)) is not None:
        raise BadRecord(key, why)
