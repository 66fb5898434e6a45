"""How a wing module declares its commands: every leaf through :func:`command`, every
nested group (``dxpu vm ...``) through :func:`group`, so each command has help, a
description and ``--json``, and ``main()`` needs to know nothing about any of them."""

from __future__ import annotations

import argparse
from typing import Any, Callable

Subparsers = Any  # argparse's _SubParsersAction, which it does not export
Command = Callable[[argparse.Namespace], int]


def command(sub: Subparsers, name: str, func: Command, help: str, *,
            description: str | None = None, **kw: Any) -> argparse.ArgumentParser:
    """Add the leaf command ``name`` running ``func(args) -> exit status``; returns its parser."""
    parser = sub.add_parser(name, help=help, description=description or help, **kw)
    parser.add_argument("--json", action="store_true", help="machine-readable output (JSON on stdout)")
    parser.set_defaults(func=func, command_name=parser.prog)  # e.g. "dxpu box add", for messages
    return parser


def group(sub: Subparsers, name: str, help: str) -> Subparsers:
    """Add the command group ``name`` (``dxpu NAME VERB``); returns what :func:`command` takes."""
    parser = sub.add_parser(name, help=help, description=help)
    return parser.add_subparsers(dest=f"{name}_command", required=True)
