"""The manager API's request fields: each route says what it takes, and a request whose
field has the wrong type is answered 400 naming that field (never a 500 from deep
inside an operation)."""

from __future__ import annotations


class BadField(ValueError):
    """A request field is missing or has the wrong type; the message names it."""


_TYPE_NAMES = {str: "a string", int: "an integer", bool: "true or false"}


def field(args: dict, name: str, kind: type, *, required: bool = False, default: object = None) -> object:
    """``args[name]`` if it is of ``kind`` (bool is not an int here); ``default`` if absent."""
    if name not in args or args[name] is None:
        if required:
            raise BadField(f"missing field {name!r}")
        return default
    value = args[name]
    if kind is int and isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)  # query strings carry numbers as text
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise BadField(f"field {name!r} must be {_TYPE_NAMES.get(kind, kind.__name__)}, "
                       f"not {type(value).__name__} ({str(value)[:40]!r})")
    if kind is str and ("\0" in value or len(value) > 4096):
        raise BadField(f"field {name!r} is not a usable string (NUL byte, or longer than 4096)")
    return value


def count(args: dict, name: str = "count") -> int:
    """A device count: an integer (the store says how many there may be)."""
    return field(args, name, int, default=1)
