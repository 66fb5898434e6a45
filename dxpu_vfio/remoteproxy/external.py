"""A device behind an external vfio-user server, as the remote proxy serves it.

The remote proxy drives the external server with our vfio-user client, the way QEMU
would, but with no guest RAM of its own: guest memory stays on the host. The host proxy
passes QEMU's DMA windows on (link DMA_MAP/DMA_UNMAP, for a device whose description
says ``dma_windows``) and this module maps each into the server *without a descriptor*,
so every DMA the server does arrives as a DMA_READ/DMA_WRITE message, which goes over the
link to the host proxy (which checks it against QEMU's windows again). The server's
interrupts arrive on eventfds this module hands it and leave as IRQ messages. To the
remote proxy it looks like any model.

A server that needs fd-mapped guest memory cannot work behind a box: it refuses such a
window, or closes the connection on it, and the map is answered ``EOPNOTSUPP`` (the
host's QEMU gets its DMA_MAP refused at attach) with the reason in the log. A server that
goes away at any other time (it exited) makes the device *gone*: every access fails with
``ENXIO``, ``on_gone`` tells the proxy (which takes the link down with that reason), and
nothing raises ``ConnectionClosed`` into a proxy thread.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import struct
import threading
from pathlib import Path
from typing import Callable

from dxpu_vfio.errors import DxpuError
from dxpu_vfio.vfio_user import protocol as p
from dxpu_vfio.vfio_user.client import ClientError, VfioUserClient
from qemu_device.device import RegionInfo
from qemu_device.ports import NullDmaPort, NullIrqPort

log = logging.getLogger("dxpu.remote")

IRQ_NAMES = {p.IRQ_INTX: "intx", p.IRQ_MSI: "msi", p.IRQ_MSIX: "msix", p.IRQ_ERR: "err", p.IRQ_REQ: "req"}
MAX_VECTORS = {p.IRQ_INTX: 1, p.IRQ_MSI: 32, p.IRQ_MSIX: 2048}  # what PCI allows a function of each kind
NO_FD = ("a box maps guest memory into its external servers without file descriptors (guest RAM stays on "
         "the host; DMA crosses the link as messages), so a server that needs fd-mapped guest memory "
         "cannot run behind a box")
# what a server answers to a window it will not take without a descriptor
FD_REFUSALS = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EFAULT, errno.EBADF, errno.ENODEV,
               errno.ECONNRESET}


class ExternalServerError(DxpuError):
    """The external vfio-user server of a box device cannot be reached or driven."""


class ExternalServerGone(OSError):
    """The external server went away: the device answers nothing any more (ENXIO)."""

    def __init__(self, reason: str) -> None:
        super().__init__(errno.ENXIO, reason)


class ExternalFunction:
    coalesce_posted = False  # the features a served device declares (see qemu_device.device.PciFunction)
    event_source = None
    wants_dma_windows = True  # the host proxy passes QEMU's DMA windows on (link DMA_MAP/DMA_UNMAP)
    renders_screen = False

    def __init__(self, socket: str | Path) -> None:
        self.socket = Path(socket)
        self.lock = threading.RLock()
        self.dma = NullDmaPort()
        self.irq = NullIrqPort()
        self.suppressed_interrupts = 0
        self.gone: str | None = None  # why the server is unusable, once it is
        self.on_gone: Callable[[str], None] | None = None  # set by the proxy: take the link down
        self.windows: dict[int, tuple[int, int]] = {}  # address -> (size, flags) mapped into the server
        self._state = threading.Lock()
        self._mapping: tuple[int, int] | None = None  # the window being mapped now (the server may die on it)
        try:
            self.client = VfioUserClient(self.socket, dma_handler=self._dma, on_close=self._closed)
        except OSError as exc:
            raise ExternalServerError(f"cannot reach the external vfio-user server at {self.socket}: "
                                      f"{exc.strerror or exc}",
                                      hint="start that server before the remote proxy, or fix the socket "
                                           "path in the box config") from exc
        self._eventfds: dict[int, tuple[int, int]] = {}  # fd -> (irq index, vector)
        try:
            self._describe()
        except (ClientError, OSError, struct.error, p.ProtocolError, ValueError) as exc:  # a reply too short or
            # malformed to parse, or numbers no device has: the server is not one we can drive
            self.client.close()
            for fd in self._eventfds:
                os.close(fd)
            raise ExternalServerError(f"the external vfio-user server at {self.socket} failed the handshake: "
                                      f"{exc}", hint="check that it is a vfio-user server and see its log") from exc
        self._stop_r, self._stop_w = os.pipe()
        self._irq_thread = threading.Thread(target=self._irq_loop, name="external-irqs", daemon=True)
        self._irq_thread.start()

    def _describe(self) -> None:
        self.client.negotiate()
        _flags, regions, irqs = self.client.device_info()
        self._regions = []
        for index in range(min(regions, p.NUM_REGIONS)):
            size, flags = self.client.region_info(index)
            self._regions.append(RegionInfo(index, size, bool(flags & p.REGION_FLAG_READ),
                                            bool(flags & p.REGION_FLAG_WRITE), False))
        self._irq_counts = {IRQ_NAMES[i]: self.client.irq_info(i)[0] for i in range(min(irqs, p.NUM_IRQS))}
        for index in (p.IRQ_INTX, p.IRQ_MSI, p.IRQ_MSIX):
            count = self._irq_counts.get(IRQ_NAMES[index], 0)
            if count > MAX_VECTORS[index]:  # an eventfd per vector: bounded before any is made
                raise ValueError(f"the server reports {count} {IRQ_NAMES[index]} vectors; PCI allows at most "
                                 f"{MAX_VECTORS[index]}")
            fds = []
            for vector in range(count):
                fds.append(os.eventfd(0, os.EFD_NONBLOCK))
                self._eventfds[fds[-1]] = (index, vector)  # so a failure after it still closes it
            if fds:
                self.client.set_irqs(index, fds)

    # --- the server's health ------------------------------------------------------------
    def _closed(self, reason: str) -> None:
        """The client's reader saw the session end (on its thread)."""
        with self._state:
            if self.gone is not None:
                return
            if self._mapping is not None:
                address, size = self._mapping
                self.gone = (f"the external vfio-user server at {self.socket} closed its connection when given "
                             f"DMA window {address:#x}+{size:#x} without a file descriptor: {NO_FD}")
                notify = False  # dma_map reports it, as the map's error
            else:
                self.gone = f"the external vfio-user server at {self.socket} went away: {reason}"
                notify = True
        log.error("%s", self.gone)
        if notify and self.on_gone is not None:
            self.on_gone(self.gone)

    def _call(self, what: str, fn, *args, **kwargs):
        """One request to the server: its refusal is an OSError with its errno; a server
        that is gone is :class:`ExternalServerGone` (never ConnectionClosed)."""
        if self.gone is not None:
            raise ExternalServerGone(self.gone)
        try:
            return fn(*args, **kwargs)
        except ClientError as exc:
            if self.client.closed_reason is not None or exc.errno == errno.ECONNRESET:
                self._closed(str(exc))
                raise ExternalServerGone(self.gone or str(exc)) from exc
            raise OSError(exc.errno, f"external vfio-user server at {self.socket}: {what}: {exc}") from exc

    # --- model face ---------------------------------------------------------------------
    def attach(self, dma, irq) -> None:
        self.dma, self.irq = dma, irq

    def regions(self) -> list[RegionInfo]:
        return list(self._regions)

    def capacity_bytes(self) -> int:
        """Its largest BAR (the server says nothing else about its capacity)."""
        return max((r.size for r in self._regions if r.index < p.REGION_CONFIG), default=0)

    def irq_counts(self) -> dict[str, int]:
        return dict(self._irq_counts)

    def region_read(self, index: int, offset: int, size: int) -> bytes:
        return self._call(f"read of region {index}+{offset:#x}", self.client.read, index, offset, size)

    def region_write(self, index: int, offset: int, data: bytes, posted: bool = False) -> None:
        self._call(f"write to region {index}+{offset:#x}", self.client.write, index, offset, bytes(data),
                   posted=posted)

    def reset(self) -> None:
        if self.gone is None:
            try:
                self._call("reset", self.client.reset)
            except OSError as exc:
                log.warning("reset of the external device at %s failed: %s", self.socket, exc)

    def posted_idle(self) -> None:
        pass

    # --- QEMU's DMA windows, passed on by the host proxy ----------------------------------
    def dma_map(self, address: int, size: int, flags: int) -> None:
        """Map a window without a descriptor: the server's DMA there comes as messages."""
        if self.gone is not None:
            raise ExternalServerGone(self.gone)
        with self._state:
            self._mapping = (address, size)
        try:
            self._call(f"DMA_MAP {address:#x}+{size:#x}", self.client.dma_map, address, size,
                       flags=flags & (p.DMA_FLAG_READ | p.DMA_FLAG_WRITE))
        except ExternalServerGone as exc:
            raise OSError(errno.EOPNOTSUPP, str(exc)) from exc
        except OSError as exc:
            if exc.errno not in FD_REFUSALS:
                raise
            reason = (f"the external vfio-user server at {self.socket} refused DMA window {address:#x}+{size:#x} "
                      f"without a file descriptor ({os.strerror(exc.errno)}): {NO_FD}")
            log.error("%s", reason)
            raise OSError(errno.EOPNOTSUPP, reason) from exc
        finally:
            with self._state:
                self._mapping = None
        self.windows[address] = (size, flags)

    def dma_unmap(self, address: int, size: int, flags: int = 0) -> None:
        """Unmap the windows inside [address, address+size) (every one with DMA_UNMAP_ALL)."""
        everything = bool(flags & p.DMA_UNMAP_ALL)
        for base, (length, _) in sorted(self.windows.items()):
            if everything or (address <= base and base + length <= address + size):
                del self.windows[base]
                self._call(f"DMA_UNMAP {base:#x}+{length:#x}", self.client.dma_unmap, base, length)

    def unmap_all(self) -> None:
        """The link that mapped them is gone: the next lease starts with no windows."""
        try:
            self.dma_unmap(0, 0, p.DMA_UNMAP_ALL)
        except OSError as exc:
            log.info("unmapping the windows of %s: %s", self.socket, exc)
        self.windows.clear()

    def stats(self) -> dict:
        return {"socket": str(self.socket), "gone": self.gone,
                "windows": [[a, n, f] for a, (n, f) in sorted(self.windows.items())],
                "dma_requests": self.client.dma_requests}

    def close(self) -> None:
        os.write(self._stop_w, b"x")
        self._irq_thread.join(2)
        self.client.close()
        for fd in (*self._eventfds, self._stop_r, self._stop_w):
            os.close(fd)

    # --- the server's DMA and interrupts ------------------------------------------------
    def _dma(self, address: int, what: int | bytes, write: bool) -> bytes | None:
        self.client.dma_requests += 1
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
                        try:
                            self._call("INTx unmask", self.client.request, p.Command.DEVICE_SET_IRQS, p.SetIrqs(
                                p.IRQ_DATA_NONE | p.IRQ_ACTION_UNMASK, p.IRQ_INTX, 0, 1).pack())
                        except ExternalServerGone:
                            return
                        except OSError as exc:
                            log.warning("%s", exc)
