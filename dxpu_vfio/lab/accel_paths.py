"""The accelerator served two ways in one lab, for the benchmark and the sweep: *local*
(a host proxy process serves the model: no network) and *remote* (a host proxy in the
lab's host namespace forwarding over mutual TLS to the device in a GPU box). Both are
opened from the host side (:class:`HostSideAccel`), and
both give a flat snapshot of the counters the performance model needs: the device's
(kernel, DMA and ring-fetch time, fetches, copy batches, bytes), the host proxy's (its
waits on the link) and the box's (the device's DMA reads over the link).
"""

from __future__ import annotations

import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from dxpu_vfio import registry
from dxpu_vfio.hostproxy.process import HostProxyProcess
from dxpu_vfio.lab import lab
from dxpu_vfio.lab.accel import load_runtime
from dxpu_vfio.lab.accel_direct import GUEST_BASE, GUEST_RAM, RuntimeOnGuestRam, sealed_guest_ram
from dxpu_vfio.link.endpoint import dma_read_requests
from dxpu_vfio.vfio_user import protocol as p
from dxpu_vfio.vfio_user.client import VfioUserClient

rt = load_runtime()
BOX, DEVICE = "box1", "acc0"
VRAM = 1 << 30
DEVICE_KEYS = ("kernel_ns", "dma_ns", "fetch_ns", "fetches", "doorbells", "entries", "copy_reads",
               "copy_writes", "inline_copies", "h2d_bytes", "d2h_bytes")


class _ClientMmio:
    """BAR0 through the vfio-user client; writes posted, as QEMU sends MMIO writes."""

    def __init__(self, client: VfioUserClient) -> None:
        self.client, self.bdf = client, "host-side"

    def read32(self, offset: int) -> int:
        return self.client.read32(0, offset)

    def write32(self, offset: int, value: int) -> None:
        self.client.write32(0, offset, value, posted=True)


class HostSideAccel(RuntimeOnGuestRam):
    """The runtime's ``Accel`` on a served device (a host proxy's vfio-user socket), with
    a memfd DMA-mapped as guest RAM. A context manager: ``close`` ends the session."""

    def __init__(self, socket_path: Path, ram_size: int = GUEST_RAM, timeout: float = 60.0,
                 inline_max: int | None = None) -> None:
        self.client = VfioUserClient(socket_path)
        self.client.negotiate()
        fd, self.ram = sealed_guest_ram(ram_size)
        try:
            self.client.dma_map(GUEST_BASE, ram_size, fd=fd)
        finally:
            os.close(fd)
        cmd = int.from_bytes(self.client.read(p.REGION_CONFIG, 4, 2), "little")
        self.client.write(p.REGION_CONFIG, 4, (cmd | 6).to_bytes(2, "little"))   # memory + bus master
        self.dev = rt.Accel(_ClientMmio(self.client), rt.MappedMemory(self.ram, GUEST_BASE), timeout=timeout,
                            inline_max=inline_max)

    def register_reads(self, count: int) -> float:
        """Mean seconds per BAR0 read seen by this client (a link round trip when remote)."""
        started = time.perf_counter()
        for _ in range(count):
            self.dev.mmio.read32(rt.REG_ID)
        return (time.perf_counter() - started) / count

    def _end(self) -> None:
        self.client.close()


def topology(name: str, threads: int = 1, plaintext: bool = False) -> lab.Topology:
    """One box with one accelerator (numpy's BLAS on ``threads`` threads, as locally);
    ``plaintext``: its link without TLS."""
    return lab.Topology(name, [lab.BoxSpec(BOX, [{"id": DEVICE, "model": "accel",
                                                  "settings": {"vram_size": VRAM, "threads": threads}}],
                                           plaintext=plaintext)])


class Served:
    """One served accelerator: its host proxy, and the box's proxy pid when remote."""

    def __init__(self, kind: str, proxy: HostProxyProcess, box_pid: int | None = None) -> None:
        self.kind, self.proxy, self.box_pid = kind, proxy, box_pid

    def counters(self) -> dict:
        """Cumulative counters (see the module docstring); zeros for the link when local."""
        stats = self.proxy.stats()["device"]
        out: dict = {"host_reads": 0, "host_read_wait_us": 0.0, "box_dma_read_msgs": 0, "box_dma_wait_us": 0.0,
                     "box_dma_write_msgs": 0, "pushed_reads": 0}
        link = stats.get("link")
        if link is None:        # served here: the device's own counters
            device = stats
        else:
            reads = link["requests"].get("REGION_READ", {"count": 0, "wait_us": 0.0})
            out["host_reads"], out["host_read_wait_us"] = reads["count"], reads["wait_us"]
            entry = next(e for e in registry.entries() if e["pid"] == self.box_pid)
            box = registry.collect(entry)["devices"][DEVICE]
            out["box_dma_read_msgs"], out["box_dma_wait_us"] = dma_read_requests(box["link"]["requests"])
            posted = box["link"]["posted"]
            out["box_dma_write_msgs"] = posted.get("DMA_WRITE", 0) + posted.get("DMA_WRITEV", 0)
            out["pushed_reads"] = box["pushed_reads"]   # ring fetches that came with their doorbell
            device = box["device"]
        out.update({k: device.get(k, 0) for k in DEVICE_KEYS})
        return out


@contextmanager
def served(kind: str, state: lab.LabState | None, threads: int = 1,
           inline_max: int | None = None) -> Iterator[tuple[Served, HostSideAccel]]:
    """``kind`` "local" (no lab needed) or "remote" (the box of ``state``); yields the
    served device and the runtime opened on it (``inline_max``: its limit for copies in
    the ring, 0 for none); stops the host proxy after."""
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
        with HostSideAccel(proxy.socket_path, inline_max=inline_max) as accel:
            yield Served(kind, proxy, box_pid), accel
    finally:
        proxy.stop()
        for path in work.iterdir():
            path.unlink(missing_ok=True)
        work.rmdir()
