"""The accelerator model in this process, driven by the guest runtime with no proxy, no
socket and no link between them: BAR0 accesses are direct calls, and a sealed memfd is
the guest RAM, reached through the model's own DMA table as a served device reaches a
VM's. What a pass costs here is the device's compute and its dispatch alone: the floor
under the served paths of :mod:`dxpu_vfio.lab.accel_paths`, and the way to run the
workloads on a kernel backend (a GPU's) on a machine where no lab can run.

Imports nothing beyond numpy, the device model and the DMA table, so it runs wherever
``qemu_device`` does (a GPU machine with its own Python, say).
"""

from __future__ import annotations

import fcntl
import gc
import mmap
import os

from dxpu_vfio.lab.accel import load_runtime
from dxpu_vfio.vfio_user.dma import DmaTable
from dxpu_vfio.vfio_user.protocol import DMA_FLAG_READ, DMA_FLAG_WRITE
from qemu_device.accel import AccelDevice
from qemu_device.ports import NullIrqPort

GUEST_BASE = 1 << 32
GUEST_RAM = 320 << 20       # the copy benchmark's 64 MiB buffers and the workloads' staging
CONFIG_REGION = 7
COMMAND_MEMORY_AND_BUS_MASTER = 0x6


class _DirectMmio:
    """BAR0 as calls into the model (a write is done when it returns, as a posted write
    is once the next read returns)."""

    def __init__(self, device: AccelDevice) -> None:
        self.device, self.bdf = device, "direct"

    def read32(self, offset: int) -> int:
        return int.from_bytes(self.device.region_read(0, offset, 4), "little")

    def write32(self, offset: int, value: int) -> None:
        self.device.region_write(0, offset, (value & 0xFFFFFFFF).to_bytes(4, "little"))


class DirectAccel:
    """The runtime's ``Accel`` (``self.dev``) on an :class:`AccelDevice` built here with
    ``settings`` (``backend``, ``threads``, ``vram_size``). A context manager: ``close``
    stops the device's worker and unmaps the guest RAM."""

    def __init__(self, ram_size: int = GUEST_RAM, timeout: float = 60.0, **settings) -> None:
        settings.setdefault("vram_size", 1 << 30)
        self.device = AccelDevice(**settings)
        self.table = DmaTable()
        fd = os.memfd_create("dxpu-guest-ram", os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, ram_size)
            # sealed as QEMU seals guest RAM, so the table maps it (DMA is a memcpy)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self.ram = mmap.mmap(fd, ram_size)
            self.table.add(GUEST_BASE, ram_size, DMA_FLAG_READ | DMA_FLAG_WRITE, os.dup(fd), 0)
        finally:
            os.close(fd)
        self.device.attach(self.table, NullIrqPort())
        self.device.region_write(CONFIG_REGION, 4, COMMAND_MEMORY_AND_BUS_MASTER.to_bytes(2, "little"))
        rt = load_runtime()
        self.dev = rt.Accel(_DirectMmio(self.device), rt.MappedMemory(self.ram, GUEST_BASE), timeout=timeout)

    def counters(self) -> dict:
        """The device's cumulative counters (kernel_ns, dma_ns, fetches, ...)."""
        return self.device.stats()

    def close(self) -> None:
        self.dev = None
        self.device.close()
        self.table.clear()
        gc.collect()            # the runtime's buffers are views of the mapping
        try:
            self.ram.close()
        except BufferError:     # a caller still holds one: unmapped when it goes
            pass

    def __enter__(self) -> "DirectAccel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
