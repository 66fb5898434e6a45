"""The ``dxpu`` command. Each subcommand is a thin layer over a module; ``--json``
prints machine-readable output; errors print what went wrong and what to run, exit 1."""

from __future__ import annotations

import argparse
import sys

from dxpu_vfio.cli import completion, lab, pool, proxies, vms
from dxpu_vfio.cli.output import report_error, wants_json
from dxpu_vfio.errors import DxpuError

WINGS = (vms, proxies, lab, pool, completion)  # each registers its commands (cli.commands)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dxpu", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for wing in WINGS:
        wing.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse (a usage error exits 2, from argparse), run the command, report a DxpuError (exit 1)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DxpuError as exc:
        return report_error(exc, wants_json(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
