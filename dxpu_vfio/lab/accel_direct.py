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

GUEST_BASE = 1 << 32        # where the memfd "guest RAM" sits in the device's DMA space
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


def sealed_guest_ram(size: int) -> tuple[int, mmap.mmap]:
    """A memfd of ``size`` bytes sealed against resizing as QEMU's memory-backend-memfd
    seals guest RAM (so a DMA table maps it, as it maps a VM's, rather than using
    pread/pwrite), and its mapping here; the caller closes the fd."""
    fd = os.memfd_create("dxpu-guest-ram", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        return fd, mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise


class RuntimeOnGuestRam:
    """The guest runtime's ``Accel`` (``self.dev``) on guest RAM mapped here
    (``self.ram``). A context manager: ``close`` ends whatever serves the device
    (``_end``), then unmaps the RAM once the runtime's buffers, views of it, are gone."""

    dev: object
    ram: mmap.mmap

    def _end(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._end()
        self.dev = None
        gc.collect()            # the runtime's buffers are views of the mapping
        try:
            self.ram.close()
        except BufferError:     # a caller still holds one: unmapped when it goes
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DirectAccel(RuntimeOnGuestRam):
    """The runtime on an :class:`AccelDevice` built here with ``settings`` (``backend``,
    ``threads``, ``vram_size``), its DMA through the model's own table."""

    def __init__(self, ram_size: int = GUEST_RAM, timeout: float = 60.0, **settings) -> None:
        settings.setdefault("vram_size", 1 << 30)
        self.device = AccelDevice(**settings)
        self.table = DmaTable()
        fd, self.ram = sealed_guest_ram(ram_size)
        try:
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

    def _end(self) -> None:
        self.device.close()
        self.table.clear()
