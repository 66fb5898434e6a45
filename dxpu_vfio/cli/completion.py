"""``dxpu completion bash|zsh``: a shell completion script, generated from the parser itself
(shtab), so it knows every command and option without being kept in step by hand."""

from __future__ import annotations

import argparse

from dxpu_vfio.cli.commands import Subparsers, command
from dxpu_vfio.cli.output import emit

SHELLS = ["bash", "zsh"]


def cmd_completion(args: argparse.Namespace) -> int:
    import shtab

    from dxpu_vfio.cli import build_parser
    script = shtab.complete(build_parser(), args.shell)
    emit(args, {"shell": args.shell, "script": script}, lambda d: d["script"].rstrip("\n"))
    return 0


def register(sub: Subparsers) -> None:
    p = command(sub, "completion", cmd_completion, "print a shell completion script",
                description='print a shell completion script: eval "$(dxpu completion bash)" in ~/.bashrc, '
                            "or save it as /etc/bash_completion.d/dxpu (zsh: a _dxpu file on $fpath)")
    p.add_argument("shell", choices=SHELLS)
