"""Interrupts to QEMU through the eventfds it hands over with SET_IRQS.

This is the device's :class:`IrqPort` on a vfio-user server. MSI and MSI-X vectors are
edges: one eventfd write each. INTx is a level, but QEMU only hears edges: like Linux's
vfio-pci we *automask* INTx when we signal it, and QEMU unmasks it (SET_IRQS UNMASK)
after the guest's end of interrupt; if the line is still high then, we signal again.

The descriptors come from the client and are not trusted: SET_IRQS takes eventfds only
(a pipe or a file is refused with EINVAL), and they are made non-blocking, so a signal
into a saturated eventfd is counted in ``lost`` instead of blocking the thread that
raised it (for QEMU, whose eventfds are non-blocking already, nothing changes).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading

from dxpu_vfio.vfio_user.protocol import (IRQ_ACTION_MASK, IRQ_ACTION_TRIGGER, IRQ_ACTION_UNMASK, IRQ_DATA_BOOL,
                                          IRQ_DATA_EVENTFD, IRQ_DATA_NONE, IRQ_INTX, IRQ_MSI, IRQ_MSIX, NUM_IRQS,
                                          ProtocolError, SetIrqs)

log = logging.getLogger("dxpu.vfio_user.irq")


def check_eventfd(fd: int) -> None:
    """Refuse a descriptor that is not an eventfd; make it non-blocking."""
    try:
        kind = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        kind = "unknown"
    if kind != "anon_inode:[eventfd]":
        raise ProtocolError(f"SET_IRQS descriptor is not an eventfd ({kind})", errno.EINVAL)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)


class EventfdIrqs:
    """Per-index eventfd tables plus the INTx level/mask state."""

    def __init__(self, counts: dict[int, int]) -> None:
        self.counts = counts  # irq index -> number of vectors the device has
        self._fds: dict[int, dict[int, int]] = {i: {} for i in range(NUM_IRQS)}
        self._lock = threading.Lock()
        self._intx_level = False
        self._intx_masked = False
        self.delivered = {"intx": 0, "msi": 0, "msix": 0}
        self.dropped = 0  # raised while no eventfd was set (guest had not enabled it)
        self.lost = 0  # the eventfd could not take the signal (saturated, or it failed)

    # --- from QEMU ------------------------------------------------------------------
    def set_irqs(self, req: SetIrqs, fds: list[int]) -> list[int]:
        """Apply one SET_IRQS; returns descriptors it did not keep (caller closes them)."""
        if req.count and req.start + req.count > self.counts.get(req.index, 0):
            raise ProtocolError(f"SET_IRQS {req.start}+{req.count} beyond the "
                                f"{self.counts.get(req.index, 0)} vectors of index {req.index}")
        with self._lock:
            if req.action == IRQ_ACTION_TRIGGER and req.data_type == IRQ_DATA_EVENTFD:
                if not fds:  # QEMU's teardown: "eventfd -1" cannot travel, so none travel
                    for vector in range(req.start, req.start + req.count):
                        old = self._fds[req.index].pop(vector, None)
                        if old is not None:
                            os.close(old)
                    return []
                if len(fds) != req.count:
                    raise ProtocolError(f"SET_IRQS with {req.count} vectors but {len(fds)} fds")
                for fd in fds:
                    check_eventfd(fd)
                table = self._fds[req.index]
                for vector, fd in zip(range(req.start, req.start + req.count), fds):
                    old = table.pop(vector, None)
                    if old is not None:
                        os.close(old)
                    table[vector] = fd
                return []
            if req.action == IRQ_ACTION_TRIGGER and req.data_type == IRQ_DATA_NONE and req.count == 0:
                self._close_index(req.index)  # disable the whole index
                return fds
            if req.index == IRQ_INTX and req.action in (IRQ_ACTION_MASK, IRQ_ACTION_UNMASK):
                masked = req.action == IRQ_ACTION_MASK
                if req.data_type == IRQ_DATA_BOOL and req.bools:
                    masked = masked if req.bools[0] else not masked
                self._intx_masked = masked
                if not masked and self._intx_level:
                    self._signal_intx_locked()
                return fds
            if req.action == IRQ_ACTION_TRIGGER and req.data_type in (IRQ_DATA_NONE, IRQ_DATA_BOOL):
                # Loopback trigger from the client: fire the vectors now.
                for i, vector in enumerate(range(req.start, req.start + req.count)):
                    if req.data_type == IRQ_DATA_NONE or req.bools[i]:
                        self._write(req.index, vector)
                return fds
        return fds  # masking MSI/MSI-X vectors: QEMU handles it itself

    def _close_index(self, index: int) -> None:
        for fd in self._fds[index].values():
            os.close(fd)
        self._fds[index].clear()

    def close(self) -> None:
        with self._lock:
            for index in self._fds:
                self._close_index(index)
            self._intx_level = self._intx_masked = False

    def vector_fds(self, index: int) -> dict[int, int]:
        """vector -> eventfd of one index (a copy), for the native forwarder (it borrows them)."""
        with self._lock:
            return dict(self._fds[index])

    def fd_count(self) -> int:
        with self._lock:
            return sum(len(t) for t in self._fds.values())

    # --- from the device (IrqPort) ----------------------------------------------------
    def _write(self, index: int, vector: int) -> bool:
        fd = self._fds[index].get(vector)
        if fd is None:
            self.dropped += 1
            return False
        try:
            os.eventfd_write(fd, 1)
        except OSError as exc:  # BlockingIOError: saturated; QEMU has that interrupt pending anyway
            self.lost += 1
            if self.lost in (1, 100) or self.lost % 10000 == 0:
                log.warning("interrupt %d/%d not signalled (%d so far): %s", index, vector, self.lost, exc)
            return False
        return True

    def msi(self, vector: int) -> None:
        with self._lock:
            if self._write(IRQ_MSI, vector):
                self.delivered["msi"] += 1

    def msix(self, vector: int) -> None:
        with self._lock:
            if self._write(IRQ_MSIX, vector):
                self.delivered["msix"] += 1

    def intx(self, level: bool) -> None:
        with self._lock:
            self._intx_level = level
            if level and not self._intx_masked:
                self._signal_intx_locked()

    def _signal_intx_locked(self) -> None:
        if self._write(IRQ_INTX, 0):
            self.delivered["intx"] += 1
            self._intx_masked = True  # automasked until QEMU unmasks after EOI
