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


def _armed_ids(answer) -> list:
    return [answer["fault"]["id"]]


def _cleared_ids(answer) -> list:
    return [fault["id"] for fault in answer["cleared"]]


def _mapping(answer) -> list:
    answer.items()  # list and note hand the answer on as a mapping
    return []


# What :class:`~dxpu_vfio.lab.faults.Faults` reads of each answer (the ids of the faults
# it armed or cleared, the listing as a mapping): written from the callers' side, not
# from the reader's checks, so that a check the reader lost is a finding.
CALLERS = {"arm": _armed_ids, "clear": _cleared_ids, "list": _mapping, "note": _mapping}


def _keeps(op: str, value: object) -> str | None:
    try:
        ids = CALLERS[op](value)
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        return f"what Faults reads of it fails ({type(exc).__name__}: {exc!s:.80}): {str(value)[:200]}"
    if not all(type(i) is int for i in ids):
        return f"fault ids that are not integers: {ids!r:.200}"
    return None


READERS = tuple(
    Reader(f"fault-{op}", json.dumps(answer), lambda t, op=op: fault_reply(op, t.encode(), "fzbox"),
           functools.partial(_keeps, op), answer, FaultError)
    for op, answer in ANSWERS.items())


def target() -> ReaderTarget:
    return ReaderTarget("fault-replies", READERS)
