"""The device side of vfio-user: what :class:`~dxpu_vfio.vfio_user.server.VfioUserServer`
serves, as one named interface.

Two kinds of object implement it: a device model (:class:`qemu_device.device.PciFunction`,
blind to whether it is served locally or in a GPU box) and the host proxy's link to a box
(:class:`dxpu_vfio.hostproxy.forwarder.RemoteFunction`). Optional features are declared
as attributes and read by the server, never probed with ``hasattr``: a device says what
it does, and the server calls only what that enables.
"""

from __future__ import annotations

import threading
from typing import Protocol

from dxpu_vfio.vfio_user import protocol as p


class EventSource(Protocol):
    """A device's own descriptor of events, served by the session thread (see module doc)."""

    def fileno(self) -> int: ...

    def ready(self) -> bool:
        """Events are buffered already: serve them before waiting on the descriptor."""

    def service(self) -> None:
        """Handle the events that are ready; never waits long."""

    def claim(self) -> None:
        """The calling thread serves the events from now on (until :meth:`release`)."""

    def release(self) -> None: ...


class VfioDevice(Protocol):
    """What the server serves: a device model (:class:`qemu_device.device.PciFunction`)
    or the host proxy's link to a box (:class:`dxpu_vfio.hostproxy.forwarder.RemoteFunction`).
    Optional features are declared as attributes, never probed: the server reads
    ``coalesce_posted``, ``event_source``, ``native_forward`` and ``wants_dma_windows``
    and calls only what they enable."""

    lock: threading.RLock
    coalesce_posted: bool  # posted writes may be glued into runs (write_multiple is offered)
    event_source: EventSource | None
    native_forward: NativeForward | None
    wants_dma_windows: bool  # dma_mapped/dma_unmapped are called
    attach_error: str | None  # set: GET_INFO fails with it (QEMU ignores a refused DMA_MAP)
    vmm_masks_msix: bool  # set by the session: QEMU keeps the MSI-X table and masks vectors itself

    def regions(self) -> list: ...
    def bar_memory(self, index: int): ...
    def irq_counts(self) -> dict[str, int]: ...
    def region_read(self, index: int, offset: int, size: int) -> bytes: ...
    def region_write(self, index: int, offset: int, data: bytes, posted: bool = False) -> None: ...
    def posted_idle(self) -> None: ...
    def attach(self, dma, irq) -> None: ...
    def reset(self) -> None: ...
    def dma_mapped(self, address: int, size: int, flags: int) -> None: ...
    def dma_unmapped(self, address: int, size: int, flags: int) -> None: ...
    def close(self) -> None: ...


class NativeForward(Protocol):
    """A device whose region accesses the session may forward in C (a ``Forwarder`` of
    :mod:`dxpu_vfio.native`, which also serves the link's DMA and MSI/MSI-X) while QEMU's
    socket is a native stream; declared as ``native_forward`` (None: not this device)."""

    link_stream: object  # the link's native Stream
    completion_timeout: float
    read_spin_us: float  # how long the forwarder may spin for a read's completion (0: never)

    def forwarding(self, forwarder: object | None) -> None:
        """The forwarder now serving the device (None: no more), for its counters."""

    def deliver(self, messages: list[tuple]) -> None:
        """Link messages the forwarder leaves to Python, in stream order."""

    def link_failed(self, reason: str, timeout: bool) -> None:
        """The link closed or a completion timed out: the device's link is down from now on."""


IRQ_INDEX = {"intx": p.IRQ_INTX, "msi": p.IRQ_MSI, "msix": p.IRQ_MSIX, "err": p.IRQ_ERR, "req": p.IRQ_REQ}


def irq_vector_counts(device: VfioDevice) -> dict[int, int]:
    """The device's vector counts keyed by vfio-user IRQ index."""
    return {IRQ_INDEX[name]: count for name, count in device.irq_counts().items()}
