"""What every ``dxpu`` command prints, in one place, so all commands look and fail alike.

Success: with ``--json`` the command's data as JSON on stdout, else its text.

Failure (a :class:`~dxpu_vfio.errors.DxpuError`), exit 1:
  * always on stderr, for the person at the terminal::

        dxpu: error: <message>
          logs: <files to read>
          fix: <what to run>

  * and with ``--json`` also on stdout, so a script reads stdout alone, whatever happened::

        {"error": "<type name>", "message": ..., "hint": ... or null, "logs": [...]}

    (the same object the pool manager's API answers with; an error the manager relayed
    keeps the type name it had there).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any, Callable

from dxpu_vfio.bench import table as plain_table
from dxpu_vfio.errors import DxpuError


def wants_json(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "json", False))


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str), flush=True)


def emit(args: argparse.Namespace, data: Any, text: Callable[[Any], str]) -> None:
    """``data`` as JSON with ``--json``, else ``text(data)``."""
    if wants_json(args):
        print_json(data)
    else:
        print(text(data), flush=True)


def progress(args: argparse.Namespace) -> Callable[[str], None]:
    """A log for long commands: progress lines as text, silent with ``--json`` (stdout is the result)."""
    if wants_json(args):
        return lambda _msg: None
    return lambda msg: print(msg, flush=True)


def table(rows: list[dict], columns: list[str], *, indent: str = "  ") -> str:
    """Rows of dicts as a :func:`dxpu_vfio.bench.table`, indented; a missing or None cell is ``-``."""
    if not rows:
        return f"{indent}(none)"
    cells = [["-" if r.get(c) is None else r[c] for c in columns] for r in rows]
    return "\n".join(indent + line for line in plain_table(columns, cells).splitlines())


def size(n: float) -> str:
    """Bytes for people: 512 B, 4 KiB, 128 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.0f} {unit}"
        n /= 1024
    return str(n)


class JsonLogFormatter(logging.Formatter):
    """Log records as one JSON object a line, for long-running commands under ``--json``."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
               "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(args: argparse.Namespace, level: str | int) -> None:
    """Logging on stderr for a service: text lines, or JSON objects with ``--json``."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLogFormatter() if wants_json(args)
                         else logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])


def error_object(exc: DxpuError) -> dict:
    # ManagerError carries the relayed type in ``kind`` ("ManagerError" when it has none of its own)
    kind = getattr(exc, "kind", None)
    return {"error": kind if kind and kind != "ManagerError" else type(exc).__name__,
            "message": exc.message, "hint": exc.hint, "logs": [str(p) for p in exc.logs]}


def report_error(exc: DxpuError, as_json: bool) -> int:
    """Print ``exc`` in the one error format (see the module docstring); the exit status, 1."""
    if as_json:
        print(json.dumps(error_object(exc)), flush=True)
    print(f"dxpu: error: {exc}", file=sys.stderr, flush=True)
    return 1
