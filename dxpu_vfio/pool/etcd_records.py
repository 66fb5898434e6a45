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


Check = Callable[[object], bool]


def _str(v: object) -> bool:
    return isinstance(v, str)


def _opt_str(v: object) -> bool:
    return v is None or isinstance(v, str)


def _num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _opt_num(v: object) -> bool:
    return v is None or _num(v)


def _opt_int(v: object) -> bool:
    return v is None or isinstance(v, int) and not isinstance(v, bool)


def _one_of(values: set[str]) -> Check:
    return lambda v: isinstance(v, str) and v in values


BOX = {"address": _str, "tls_dir": _opt_str, "state": _one_of({s.value for s in BoxState}),
       "registered_at": _num, "last_error": _opt_str, "cert_sha256": _opt_str}
BOX_OPTIONAL = {"generation": _opt_str}
DEVICE = {"name": _str, "class": _str, "vendor": _str, "model": _str,
          "capacity": lambda v: isinstance(v, int) and not isinstance(v, bool)}
LEASE = {"id": _str, "device": lambda v: isinstance(v, str) and "/" in v, "vm": _str,
         "state": _one_of({s.value for s in LeaseState}), "qdev_id": _str}
LEASE_OPTIONAL = {"port": _opt_str, "socket": _opt_str, "proxy_pid": _opt_int, "owner_pid": _opt_int,
                  "created_at": _num, "updated_at": _num, "host": _opt_str, "holder": _opt_str,
                  "request": _opt_str, "error": _opt_str}  # exactly Lease's fields (fence aside)
HOST_OPTIONAL = {"holder": _opt_str, "agent_pid": _opt_int, "started_at": _opt_num, "expires_at": _opt_num}


def _object(value: object, required: dict[str, Check], optional: dict[str, Check], *,
            closed: bool = False) -> str | None:
    """Why ``value`` is not such an object (None: it is). ``closed``: no other fields."""
    if not isinstance(value, dict):
        return f"holds {type(value).__name__}, not an object"
    for name, ok in required.items():
        if name not in value:
            return f"lacks its {name!r} field"
        if not ok(value[name]):
            return f"has {name!r} = {value[name]!r:.60}"
    for name, ok in optional.items():
        if name in value and not ok(value[name]):
            return f"has {name!r} = {value[name]!r:.60}"
    if closed and (extra := set(value) - set(required) - set(optional)):
        return f"has fields dxpu does not write: {', '.join(sorted(extra))[:80]}"
    return None


def _inventory(value: object) -> str | None:
    if not isinstance(value, list):
        return f"holds {type(value).__name__}, not a list of devices"
    for i, device in enumerate(value):
        if (why := _object(device, DEVICE, {})) is not None:
            return f"device {i} {why}"
    return None


def _plain(ok: Check, what: str) -> Callable[[object], str | None]:
    return lambda v: None if ok(v) else f"holds {v!r:.60}, not {what}"


# kind -> (the parts its name has after the kind: 0, 1 or 2; the value's check)
KINDS: dict[str, tuple[int, Callable[[object], str | None]]] = {
    "schema": (0, _plain(lambda v: isinstance(v, int) and not isinstance(v, bool)
                         or isinstance(v, str) and v.isdigit(), "a version number")),
    "pool_id": (0, _plain(_str, "a pool id")),
    "alive": (1, lambda v: None),
    "boxes": (1, lambda v: _object(v, BOX, BOX_OPTIONAL)),
    "seen": (1, _plain(_num, "a time")),
    "inventory": (1, _inventory),
    "claims": (2, _plain(_str, "a lease id")),
    "leases": (1, lambda v: _object(v, LEASE, LEASE_OPTIONAL, closed=True)),
    "hosts": (1, lambda v: _object(v, {}, HOST_OPTIONAL)),
    "fenced": (1, _plain(_num, "a time")),
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
