"""Work inside a network namespace from a process that stays outside it."""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Callable, TypeVar

T = TypeVar("T")
CLONE_NEWNET = 0x40000000


def in_netns(ns: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` in a thread that entered network namespace ``ns`` (setns acts on the
    calling thread only, and this thread ends with it): sockets it makes live there."""
    out: dict = {}

    def run() -> None:
        try:
            fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
            try:
                if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {ns} failed")
            finally:
                os.close(fd)
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            out["error"] = exc
    thread = threading.Thread(target=run, name=f"netns-{ns}", daemon=True)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]
