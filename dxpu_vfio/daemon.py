"""The process skeleton both proxies run in (host proxy and remote proxy mains).

One shape for every long-running proxy process, so the control plane can treat them
alike: a registry entry while it runs (:mod:`dxpu_vfio.registry`), its counters as JSON
on SIGUSR1 and once more at the end, display scanouts as PNG on SIGUSR2, and an
orderly end on SIGTERM or SIGINT (the parent ends it by pid, see :mod:`dxpu_vfio.procs`).
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Callable, Iterable

from dxpu_vfio import registry
from dxpu_vfio.procs import write_bytes_atomic, write_json_atomic

log = logging.getLogger("dxpu.daemon")

Screenshots = Callable[[], Iterable[tuple[str | None, Callable[[], bytes]]]]  # (device or None, its PNG's renderer)


def screenshot_path(stats_path: Path, device: str | None = None) -> Path:
    """Where a proxy writes a device's scanout PNG on SIGUSR2."""
    base = Path(stats_path)
    return base.with_name(base.name + (f".{device}" if device else "") + ".png")


def screenshot_error_path(png: Path) -> Path:
    """Where a proxy writes why it wrote no ``png`` (the guest's mode cannot be shown), for
    ``request_file(..., error_path=)``: whoever asked learns why at once."""
    return png.with_name(png.name + ".error")


def run_until_terminated(kind: str, name: str, stats_path: Path | None, snapshot: Callable[[], dict], *,
                         screenshots: Screenshots | None = None, on_ready: Callable[[], None] | None = None,
                         **info: object) -> None:
    """Serve until SIGTERM/SIGINT. ``snapshot()`` gives the counters written to
    ``stats_path``; without ``stats_path`` the process is not registered (nothing could
    ask it for counters). ``on_ready`` runs once the signals are handled and the entry is
    registered: whatever it announces, a parent may act on at once (even SIGTERM)."""
    done = threading.Event()

    def write_stats() -> None:
        if stats_path is not None:
            try:
                write_json_atomic(stats_path, snapshot())
            except Exception:  # noqa: BLE001 - raised in a signal handler, it would end the process
                log.exception("%s %s: stats not written", kind, name)

    def write_screenshots() -> None:
        # in a signal handler of the main thread, where an exception would end the process
        if stats_path is None or screenshots is None:
            return
        try:
            shots = list(screenshots())
        except Exception:  # noqa: BLE001
            log.exception("%s %s: no screenshots", kind, name)
            return
        for device, render in shots:  # one display's failure is its own
            png = screenshot_path(stats_path, device)
            what = f"screenshot{f' of {device}' if device else ''}"
            try:
                write_bytes_atomic(png, render())
                continue
            except (ValueError, OSError) as exc:  # the guest's mode cannot be shown, a full disk
                log.warning("%s %s: %s not written: %s", kind, name, what, exc)
                why = str(exc)
            except Exception as exc:  # noqa: BLE001 - a bug: logged with its traceback
                log.exception("%s %s: %s not written", kind, name, what)
                why = f"internal error: {exc!r}"
            try:
                write_bytes_atomic(screenshot_error_path(png), why.encode())
            except OSError:
                pass

    signal.signal(signal.SIGUSR1, lambda *_: write_stats())
    signal.signal(signal.SIGUSR2, lambda *_: write_screenshots())
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    entry = registry.register(kind, name, stats_path, **info) if stats_path is not None else None
    try:
        if on_ready is not None:
            on_ready()
        while not done.wait(1.0):
            pass
        write_stats()
    finally:
        if entry is not None:
            registry.unregister(entry)
