"""The states a lease and a box can be in: one list for the code, the database's CHECK
constraints and the JSON the API prints (the members are the strings stored and shown)."""

from __future__ import annotations

import enum


class LeaseState(enum.StrEnum):
    """``attaching`` -> ``attached`` -> ``detaching`` -> (row deleted)."""

    ATTACHING = "attaching"  # row exists, device not (yet) in the VM for sure
    ATTACHED = "attached"  # in the VM, its host proxy serving it
    DETACHING = "detaching"  # leaving the VM; the row goes once it is out


class BoxState(enum.StrEnum):
    """What the manager's heartbeat last found; a down box lends nothing."""

    UP = "up"
    DOWN = "down"


def sql_check(column: str, states: type[enum.StrEnum]) -> str:
    """``CHECK (column IN ('a', 'b'))`` for a schema: the database refuses other values."""
    quoted = ", ".join("'" + s.value.replace("'", "''") + "'" for s in states)
    return f"CHECK ({column} IN ({quoted}))"
