"""A display device seen from the host: its own state (mode, counters) and its scanout,
asked of the process that holds its framebuffer (the device server when served locally,
the remote proxy of its GPU box when served from the lab). Tests and benchmarks use it.
"""

from __future__ import annotations

import io
import mmap
import os
import signal
import time
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from dxpu_vfio.daemon import screenshot_error_path, screenshot_path
from dxpu_vfio.procs import request_file, request_json


class DisplayProbe:
    def __init__(self, *, server=None, box_pid: int | None = None, box_stats: Path | None = None,
                 device: str | None = None) -> None:
        self.server, self.box_pid, self.box_stats, self.device = server, box_pid, box_stats, device

    @classmethod
    def of(cls, attachment, lab_state=None, box: str | None = None, device: str | None = None) -> "DisplayProbe":
        """For a local attachment, or (with ``lab_state``) for ``box``/``device`` in the lab."""
        if lab_state is None:
            return cls(server=attachment.server)
        return cls.in_box(lab_state, box, device)

    @classmethod
    def in_box(cls, lab_state, box: str, device: str) -> "DisplayProbe":
        """For ``box``/``device`` of the lab, however it was plugged (e.g. by the pool manager)."""
        b = lab_state.box(box)
        return cls(box_pid=b.proxy_pid, box_stats=Path(b.config).with_suffix(".stats.json"), device=device)

    def state(self, timeout: float = 10.0) -> dict:
        """The device's own stats: mode (enabled, xres, yres, bpp ...), framebuffer writes."""
        if self.server is not None:
            return self.server.stats(timeout)["device"]
        stats = request_json(self.box_pid, self.box_stats, timeout)
        if stats is None:
            raise TimeoutError(f"the remote proxy (pid {self.box_pid}) gave no stats in {timeout} s")
        return stats["devices"][self.device]["device"]

    def screenshot(self, timeout: float = 30.0) -> bytes:
        if self.server is not None:
            return self.server.screenshot(timeout)
        path = screenshot_path(self.box_stats, self.device)  # (RequestRefused: the guest's mode cannot be shown)
        png = request_file(self.box_pid, path, signal.SIGUSR2, timeout, error_path=screenshot_error_path(path))
        if png is None:
            raise TimeoutError(f"the remote proxy (pid {self.box_pid}) gave no screenshot in {timeout} s")
        return png

    def wait_mode(self, want=lambda m: m["enabled"], timeout: float = 120.0) -> dict:
        """The mode once ``want(mode)`` holds; AssertionError naming the last mode on timeout."""
        deadline = time.monotonic() + timeout
        while not want(mode := self.state()["mode"]):
            if time.monotonic() > deadline:
                raise AssertionError(f"display mode still {mode} after {timeout:.0f} s")
            time.sleep(0.5)
        return mode

    def wait_pixels(self, width: int, height: int, rgb: bytes, timeout: float = 120.0) -> float:
        """Seconds until the scanout is exactly ``rgb`` (width x height); AssertionError
        with the number of differing pixels on timeout."""
        started = time.monotonic()
        while True:
            w, h, got = png_pixels(self.screenshot())
            if (w, h) == (width, height) and got == rgb:
                return time.monotonic() - started
            if time.monotonic() - started > timeout:
                bad = sum(got[i:i + 3] != rgb[i:i + 3] for i in range(0, min(len(got), len(rgb)), 3))
                raise AssertionError(f"scanout {w}x{h} (want {width}x{height}), {bad} pixels differ "
                                     f"after {timeout:.0f} s")
            time.sleep(1)


def png_pixels(png: bytes) -> tuple[int, int, bytes]:
    """(width, height, RGB bytes, 3 per pixel, row after row) of a PNG."""
    try:
        with Image.open(io.BytesIO(png), formats=["PNG"]) as image:
            rgb = image.convert("RGB")
    except UnidentifiedImageError as exc:
        raise ValueError(f"not a PNG ({len(png)} bytes)") from exc
    return rgb.width, rgb.height, rgb.tobytes()


def host_shadow(pid: int, index: int = 0) -> mmap.mmap:
    """A read-only mapping of the shadow that host proxy ``pid`` keeps of a box device's
    mapped BAR ``index`` (``hostproxy/shadow.py``): the very memfd QEMU maps into the guest,
    opened through /proc (root only), so it holds what the guest has drawn with no
    write-back in between. Tests compare the box's screenshots with it."""
    name = f"/memfd:dxpu-shadow-{index} "
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed while we looked
            continue
        if target.startswith(name):
            with open(fd, "rb") as f:  # the memfd itself, not a copy; the mapping outlives the file
                return mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    raise LookupError(f"host proxy {pid} has no shadow of BAR {index}: is its device a box's mapped display?")
