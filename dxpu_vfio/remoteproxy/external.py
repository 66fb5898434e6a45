"""A device behind an external vfio-user server, as the remote proxy serves it.

The remote proxy drives the external server with our vfio-user client, the way QEMU
would, but with no guest RAM of its own: it maps one descriptor-less DMA window over
the whole address space, so every DMA the server does arrives as a DMA_READ/DMA_WRITE
message, which goes over the link to the host proxy (which alone knows QEMU's real
windows, and checks them). The server's interrupts arrive on eventfds this module
hands it and leave as IRQ messages. To the remote proxy it looks like any model.
"""

from __future__ import annotations

import os
import select
import threading
from pathlib import Path

from dxpu_vfio.vfio_user import protocol as p
from dxpu_vfio.vfio_user.client import VfioUserClient
from qemu_device.device import RegionInfo
from qemu_device.ports import NullDmaPort, NullIrqPort

WHOLE_SPACE = 1 << 48  # every guest-physical address a q35 guest can have
IRQ_NAMES = {p.IRQ_INTX: "intx", p.IRQ_MSI: "msi", p.IRQ_MSIX: "msix", p.IRQ_ERR: "err", p.IRQ_REQ: "req"}


class ExternalFunction:
    coalesce_posted = False  # the features a served device declares (see qemu_device.device.PciFunction)
    event_source = None

    def __init__(self, socket: str | Path) -> None:
        self.lock = threading.RLock()
        self.dma = NullDmaPort()
        self.irq = NullIrqPort()
        self.suppressed_interrupts = 0
        self.client = VfioUserClient(Path(socket), dma_handler=self._dma)
        self.client.negotiate()
        _flags, regions, irqs = self.client.device_info()
        self._regions = []
        for index in range(min(regions, p.NUM_REGIONS)):
            size, flags = self.client.region_info(index)
            self._regions.append(RegionInfo(index, size, bool(flags & p.REGION_FLAG_READ),
                                            bool(flags & p.REGION_FLAG_WRITE), False))
        self._irq_counts = {IRQ_NAMES[i]: self.client.irq_info(i)[0] for i in range(min(irqs, p.NUM_IRQS))}
        self.client.dma_map(0, WHOLE_SPACE)
        self._eventfds: dict[int, tuple[int, int]] = {}  # fd -> (irq index, vector)
        for index in (p.IRQ_INTX, p.IRQ_MSI, p.IRQ_MSIX):
            count = self._irq_counts.get(IRQ_NAMES[index], 0)
            if count:
                fds = [os.eventfd(0, os.EFD_NONBLOCK) for _ in range(count)]
                self.client.set_irqs(index, fds)
                self._eventfds.update({fd: (index, v) for v, fd in enumerate(fds)})
        self._stop_r, self._stop_w = os.pipe()
        self._irq_thread = threading.Thread(target=self._irq_loop, name="external-irqs", daemon=True)
        self._irq_thread.start()

    # --- model face ---------------------------------------------------------------------
    def attach(self, dma, irq) -> None:
        self.dma, self.irq = dma, irq

    def regions(self) -> list[RegionInfo]:
        return list(self._regions)

    def irq_counts(self) -> dict[str, int]:
        return dict(self._irq_counts)

    def region_read(self, index: int, offset: int, size: int) -> bytes:
        return self.client.read(index, offset, size)

    def region_write(self, index: int, offset: int, data: bytes, posted: bool = False) -> None:
        self.client.write(index, offset, bytes(data), posted=posted)

    def reset(self) -> None:
        self.client.reset()

    def posted_idle(self) -> None:
        pass

    def close(self) -> None:
        os.write(self._stop_w, b"x")
        self._irq_thread.join(2)
        self.client.close()
        for fd in (*self._eventfds, self._stop_r, self._stop_w):
            os.close(fd)

    # --- the server's DMA and interrupts ------------------------------------------------
    def _dma(self, address: int, what: int | bytes, write: bool) -> bytes | None:
        if write:
            self.dma.write(address, what)
            return None
        return self.dma.read(address, what)

    def _irq_loop(self) -> None:
        watched = [*self._eventfds, self._stop_r]
        while True:
            ready, _, _ = select.select(watched, [], [])
            if self._stop_r in ready:
                return
            for fd in ready:
                try:
                    count = os.eventfd_read(fd)
                except BlockingIOError:
                    continue
                index, vector = self._eventfds[fd]
                for _ in range(min(count, 64)):
                    if index == p.IRQ_MSI:
                        self.irq.msi(vector)
                    elif index == p.IRQ_MSIX:
                        self.irq.msix(vector)
                    else:
                        # INTx reaches us as edges (the server automasks): pass a pulse on,
                        # then let the server signal again if its line stays high.
                        self.irq.intx(True)
                        self.irq.intx(False)
                        self.client.request(p.Command.DEVICE_SET_IRQS, p.SetIrqs(
                            p.IRQ_DATA_NONE | p.IRQ_ACTION_UNMASK, p.IRQ_INTX, 0, 1).pack())
