"""The remote proxy process: serve a box's devices until SIGTERM/SIGINT.

    python -m dxpu_vfio.remoteproxy --config BOX.toml [--stats FILE]

(also ``dxpu remote serve``). Counters go to ``--stats`` on SIGUSR1 and at exit;
display scanouts next to it on SIGUSR2 (:mod:`dxpu_vfio.daemon`). It prints one
"serving" line once it listens: parents wait for it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dxpu_vfio.daemon import run_until_terminated
from dxpu_vfio.remoteproxy.config import BoxConfig
from dxpu_vfio.remoteproxy.proxy import RemoteProxy


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--config", required=True, type=Path, help="BOX.toml (see dxpu_vfio.remoteproxy.config)")
    parser.add_argument("--stats", type=Path, help="write counters here on SIGUSR1 and at exit (JSON)")
    return parser


def serve(config_path: Path, stats_path: Path | None) -> int:
    """Run one remote proxy; 1 with a message on stderr if the config is bad."""
    try:
        config = BoxConfig.load(config_path)
    except (OSError, ValueError) as exc:
        print(f"dxpu: error: {exc}", file=sys.stderr)
        return 1
    proxy = RemoteProxy(config).start()
    print(f"remote proxy {config.name}: serving {config.device_list()} on {config.listen}:{proxy.port} "
          f"({'plaintext' if config.plaintext else 'mutual TLS'})", flush=True)
    try:
        run_until_terminated("remote", config.name, stats_path, proxy.snapshot, screenshots=proxy.screenshots,
                             address=f"{config.listen}:{proxy.port}")
    finally:
        proxy.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(
        prog="python -m dxpu_vfio.remoteproxy", description="serve a GPU box's devices over the link "
                                                            "(TCP + mutual TLS) until SIGTERM"))
    args = parser.parse_args(argv)
    return serve(args.config, args.stats)
