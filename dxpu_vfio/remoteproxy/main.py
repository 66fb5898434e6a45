"""The remote proxy process: serve a box's devices until SIGTERM/SIGINT.

    python -m dxpu_vfio.remoteproxy --config BOX.toml [--stats FILE]

(also ``dxpu remote serve``). With ``[pool]`` in the config the box announces itself
in that etcd pool (:mod:`dxpu_vfio.remoteproxy.announce`). Counters go to ``--stats`` on SIGUSR1 and at exit;
display scanouts next to it on SIGUSR2 (:mod:`dxpu_vfio.daemon`). It prints one
"serving" line once it listens: parents wait for it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dxpu_vfio.daemon import run_until_terminated
from dxpu_vfio.errors import DxpuError
from dxpu_vfio.procs import limit_malloc_arenas
from dxpu_vfio.remoteproxy.announce import announcer_for
from dxpu_vfio.remoteproxy.config import BoxConfig
from dxpu_vfio.remoteproxy.proxy import RemoteProxy


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--config", required=True, type=Path, help="BOX.toml (see dxpu_vfio.remoteproxy.config)")
    parser.add_argument("--stats", type=Path, help="write counters here on SIGUSR1 and at exit (JSON)")
    return parser


class BoxConfigError(DxpuError):
    """The box config could not be read or makes no sense."""


def load_config(path: Path) -> BoxConfig:
    try:
        return BoxConfig.load(path)
    except OSError as exc:
        raise BoxConfigError(f"cannot read the box config {path}: {exc.strerror or exc}",
                             hint="pass --config BOX.toml (its format: dxpu_vfio/remoteproxy/config.py)") from exc
    except ValueError as exc:
        raise BoxConfigError(str(exc), hint="its format: dxpu_vfio/remoteproxy/config.py") from exc


def serve(config_path: Path, stats_path: Path | None, *, as_json: bool = False) -> int:
    """Run one remote proxy; :class:`BoxConfigError` if the config is bad. ``as_json``: the
    "serving" line is a JSON object (``{"event": "serving", ...}``)."""
    config = load_config(config_path)
    limit_malloc_arenas()  # every link starts threads: without a cap, each may keep an arena
    proxy = RemoteProxy(config).start()
    try:
        announcer = announcer_for(config, proxy).start() if config.pool else None
    except BaseException:
        proxy.stop()
        raise
    address = f"{config.listen}:{proxy.port}"
    security = "plaintext" if config.plaintext else "mutual TLS"

    def announce() -> None:  # once SIGTERM is handled: a parent may stop us as soon as it reads this
        if as_json:
            print(json.dumps({"event": "serving", "box": config.name, "address": address, "security": security,
                              "devices": [{"id": d.id, "model": d.model} for d in config.devices]}), flush=True)
        else:
            print(f"remote proxy {config.name}: serving {config.device_list()} on {address} ({security})",
                  flush=True)
    def snapshot() -> dict:
        stats = proxy.snapshot()
        if announcer is not None:
            stats["announce"] = {"lease": announcer.lease, "generation": announcer.generation,
                                 "published": announcer.published}
        return stats
    try:
        slots = proxy.slots.values()  # in the registry entry: which box serves what (dxpu screenshot)
        run_until_terminated("remote", config.name, stats_path, snapshot, screenshots=proxy.screenshots,
                             on_ready=announce, address=address, devices=[s.spec.id for s in slots],
                             displays=[s.spec.id for s in slots if s.spec.model == "display"])
    finally:
        if announcer is not None:
            announcer.stop()
        proxy.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(
        prog="python -m dxpu_vfio.remoteproxy", description="serve a GPU box's devices over the link "
                                                            "(TCP + mutual TLS) until SIGTERM"))
    args = parser.parse_args(argv)
    try:
        return serve(args.config, args.stats)
    except DxpuError as exc:  # a bad config, an external server that cannot be reached
        print(f"dxpu: error: {exc}", file=sys.stderr)
        return 1
