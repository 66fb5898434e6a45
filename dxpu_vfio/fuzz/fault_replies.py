"""The ``fault-replies`` fuzz target: the lab's reader of a box's answers to FAULT
requests (:func:`dxpu_vfio.lab.faults.fault_reply`), as a box of another version or
something else at its address answers, with the generic reader fuzzing of
:mod:`dxpu_vfio.fuzz.readers`. The samples are the box's answers to ``arm``, ``clear``,
``list`` and ``note`` (:meth:`dxpu_vfio.remoteproxy.faults.FaultTable.request`); a reply
must be a JSON object whose faults, where the caller reads them, are objects with
integer ids, or the reader raises :class:`~dxpu_vfio.lab.faults.FaultError`.
"""

from __future__ import annotations

import functools
import json

from dxpu_vfio.fuzz.readers import Reader, ReaderTarget
from dxpu_vfio.lab.faults import FaultError, fault_reply

FAULT = {"id": 3, "device": "td0", "kind": "stall", "target": "mmio-read", "ms": 300.0, "duration": 10.0,
         "count": None, "armed_at": 1765000000.5, "hits": 2, "remaining": 8.5, "ended": None, "ended_at": None}
ANSWERS = {"arm": {"fault": FAULT},
           "clear": {"cleared": [FAULT, {**FAULT, "id": 4, "kind": "abort", "ended": "cleared"}]},
           "list": {"faults": [FAULT], "log": [{"t": 1765000001.0, "event": "hit", "id": 3}], "hits": {"td0": 2}},
           "note": {"noted": "freeze"}}


def _keeps(op: str, value: object) -> str | None:
    if not isinstance(value, dict):
        return "not an object"
    faults = [value.get("fault")] if op == "arm" else value.get("cleared") if op == "clear" else []
    if not isinstance(faults, list) or not all(isinstance(f, dict) and type(f.get("id")) is int for f in faults):
        return f"faults without integer ids: {str(value)[:200]}"
    return None


READERS = tuple(
    Reader(f"fault-{op}", json.dumps(answer), lambda t, op=op: fault_reply(op, t.encode(), "fzbox"),
           functools.partial(_keeps, op), answer, FaultError)
    for op, answer in ANSWERS.items())


def target() -> ReaderTarget:
    return ReaderTarget("fault-replies", READERS)
