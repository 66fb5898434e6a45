"""The accelerator served two ways in one lab, for the benchmark and the sweep: *local*
(a host proxy process serves the model: no network) and *remote* (a host proxy in the
lab's host namespace forwarding over mutual TLS to the device in a GPU box). Both are
opened from the host side (:class:`~dxpu_vfio.lab.accel_workloads.HostSideAccel`), and
both give a flat snapshot of the counters the performance model needs: the device's
(kernel, DMA and ring-fetch time, fetches, copy batches, bytes), the host proxy's (its
waits on the link) and the box's (the device's DMA reads over the link).
"""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from dxpu_vfio import registry
from dxpu_vfio.hostproxy.process import HostProxyProcess
from dxpu_vfio.lab import lab
from dxpu_vfio.lab.accel_workloads import HostSideAccel

BOX, DEVICE = "box1", "acc0"
VRAM = 1 << 30
DEVICE_KEYS = ("kernel_ns", "dma_ns", "fetch_ns", "fetches", "doorbells", "entries", "copy_reads",
               "copy_writes", "h2d_bytes", "d2h_bytes")


def topology(name: str, threads: int = 1) -> lab.Topology:
    """One box with one accelerator (numpy's BLAS on ``threads`` threads, as locally)."""
    return lab.Topology(name, [lab.BoxSpec(BOX, [{"id": DEVICE, "model": "accel",
                                                  "settings": {"vram_size": VRAM, "threads": threads}}])])


class Served:
    """One served accelerator: its host proxy, and the box's proxy pid when remote."""

    def __init__(self, kind: str, proxy: HostProxyProcess, box_pid: int | None = None) -> None:
        self.kind, self.proxy, self.box_pid = kind, proxy, box_pid

    def counters(self) -> dict:
        """Cumulative counters (see the module docstring); zeros for the link when local."""
        stats = self.proxy.stats()["device"]
        out: dict = {"host_reads": 0, "host_read_wait_us": 0.0, "box_dma_read_msgs": 0, "box_dma_wait_us": 0.0,
                     "box_dma_write_msgs": 0}
        link = stats.get("link")
        if link is None:        # served here: the device's own counters
            device = stats
        else:
            reads = link["requests"].get("REGION_READ", {"count": 0, "wait_us": 0.0})
            out["host_reads"], out["host_read_wait_us"] = reads["count"], reads["wait_us"]
            entry = next(e for e in registry.entries() if e["pid"] == self.box_pid)
            box = registry.collect(entry)["devices"][DEVICE]
            dma = box["link"]["requests"].get("DMA_READ", {"count": 0, "wait_us": 0.0})
            out["box_dma_read_msgs"], out["box_dma_wait_us"] = dma["count"], dma["wait_us"]
            out["box_dma_write_msgs"] = box["link"]["posted"].get("DMA_WRITE", 0)
            device = box["device"]
        out.update({k: device.get(k, 0) for k in DEVICE_KEYS})
        return out


@contextmanager
def served(kind: str, state: lab.LabState | None, threads: int = 1) -> Iterator[tuple[Served, HostSideAccel]]:
    """``kind`` "local" (no lab needed) or "remote" (the box of ``state``); yields the
    served device and the runtime opened on it; stops the host proxy after."""
    work = Path(tempfile.mkdtemp(prefix="dxpu-accel-"))
    if kind == "local":
        proxy = HostProxyProcess("accel", work / "accel.sock", settings={"vram_size": VRAM, "threads": threads},
                                 name="bench-accel-local")
        box_pid = None
    else:
        assert state is not None, "a remote accelerator needs a lab"
        proxy = HostProxyProcess("remote", work / "accel.sock", settings=state.remote_settings(BOX, DEVICE),
                                 name="bench-accel-remote", netns=state.host_netns)
        box_pid = state.box(BOX).proxy_pid
    proxy.start()
    try:
        with HostSideAccel(proxy.socket_path) as accel:
            yield Served(kind, proxy, box_pid), accel
    finally:
        proxy.stop()
        for path in work.iterdir():
            path.unlink(missing_ok=True)
        work.rmdir()
