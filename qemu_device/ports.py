"""The two ports a device model uses to reach the guest: DMA and interrupts.

A device model never knows whether it is served locally or through the remote
proxy; whoever serves it attaches objects that satisfy these protocols. Until
then the null ports stand in, so a device can be built and probed without a
guest, and a stray DMA fails cleanly instead of touching nothing silently.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable, ContextManager, NamedTuple, Protocol, Sequence

from qemu_device.backing import write_all


class DmaError(Exception):
    """A DMA to an unmapped or forbidden guest address: the device must fail cleanly."""


Sink = Callable[[int, memoryview], None]
"""Where :meth:`DmaPort.read_into` hands a read's bytes: (position in the read, bytes)."""


class Ring(NamedTuple):
    """A ring of entries in guest memory whose new tail index the driver writes to a doorbell
    register (4 bytes at ``doorbell`` of BAR ``region``): an accelerator's command ring, an
    NVMe submission queue. ``tail``: where the device stands now. With ``pointer_bytes``:
    each entry's little-endian u64 at ``pointer_offset`` names memory the device reads next,
    up to that many bytes within its 4 KiB page (an NVMe command's PRP list), which a port
    may send along with the entry. With ``shadow``: the driver writes each new tail to that
    guest address first and rings the register only when the device's event index (a u32 at
    ``event_index``) asks; a port that :attr:`~DmaPort.reads_shadows` then has every doorbell
    carry the shadow's tail, and rings for the device when the shadow has moved by the time
    the device writes its event index."""

    region: int
    doorbell: int
    base: int
    entry_size: int
    entries: int
    tail: int = 0
    pointer_offset: int = 0
    pointer_bytes: int = 0
    shadow: int = 0
    event_index: int = 0


class DmaPort(Protocol):
    """Device-initiated reads and writes of guest memory (guest-physical / IOVA addresses)."""

    reads_wait_on_network: bool
    """True where a read costs a network round trip: a device then reads a batch's data
    ahead in one scatter list; on local memory that would only add a copy."""

    reads_shadows: bool
    """True where the port's host reads a watched ring's shadow doorbell for the device
    (:class:`Ring` ``shadow``): a device on a network may then offer shadow doorbells, which
    it would otherwise read at a round trip each."""

    def read(self, addr: int, length: int) -> bytes:
        """Return ``length`` bytes at ``addr`` or raise DmaError."""
        ...

    def write(self, addr: int, data: bytes) -> None:
        """Write ``data`` at ``addr`` or raise DmaError."""
        ...

    def read_many(self, pieces: list[tuple[int, int]]) -> list[bytes]:
        """Several ranges at once (a scatter list): a port whose reads cost a network
        round trip keeps them all in flight together."""
        ...

    def write_many(self, pieces: list[tuple[int, bytes | memoryview]]) -> None:
        """Several writes, in order: a port on a network sends them together."""
        ...

    def read_many_begin(self, pieces: list[tuple[int, int]]) -> Callable[[], list[bytes]]:
        """Start :meth:`read_many` now, finish it later: the call returned gives the
        ranges (or raises DmaError). On a network the requests leave now, so a device
        can send a doorbell's first read from the thread that took the doorbell and its
        worker, when it wakes, finds the completion there or on its way: the worker's
        wake-up overlaps the round trip. Never blocks on the network; local memory reads
        when finished."""
        ...

    def read_into(self, pieces: list[tuple[int, int]], sink: "Sink") -> None:
        """Guest-to-device DMA handed over as it arrives: ``sink(pos, data)`` gets
        consecutive parts of the pieces' bytes back to back (``pos`` counts from the start
        of the first piece), in order, all of them or DmaError (a prefix may have been
        sunk). ``data`` is valid only during the call. On a network each completion goes
        to the sink straight from the stream: no buffer of the whole read, no copy into one
        (an accelerator's copy to VRAM, a storage write)."""
        ...

    def write_from_file(self, pieces: list[tuple[int, int]], fd: int, offset: int,
                        then: Sequence[tuple[int, bytes]] = ()) -> None:
        """Device-to-guest DMA of a file's bytes (a storage read): the pieces, in order,
        get the file's bytes from ``offset`` (zeroes past its end), and then the writes of
        ``then`` are made, in order (a read's completion entry: on a network one message
        with its data). OSError for the file, DmaError for the DMA, which is checked whole
        before the file is read; neither leaves ``then`` written. On local memory the file
        is read straight into guest memory (one preadv, no copy between)."""
        ...

    def read_into_file(self, pieces: list[tuple[int, int]], fd: int, offset: int) -> None:
        """Guest-to-device DMA into a file (a storage write): the pieces' bytes, back to
        back, written at ``offset``, all of them or OSError (DmaError for the DMA)."""
        ...

    def watch_ring(self, slot: int, ring: Ring | None) -> None:
        """Declare the ring ``slot`` (or, with None, withdraw it): on a network the host may
        then send a doorbell's entries with the doorbell, and the device's fetch of them
        costs no round trip; the fetch is the same call either way. Only the device's own
        ring fetches may read a declared ring's memory. Local memory: nothing to do."""
        ...

    def posted_together(self) -> ContextManager[None]:
        """A block whose posted DMA writes and interrupts (this thread's) may reach the
        guest together when it ends: a command's data, its completion and its interrupt
        as one network write on a box, instead of one each. Ordering is unchanged (a read
        still sees every write before it; nothing passes anything); only their departure
        may wait, so a device ends the block before it computes or blocks for long. Local
        memory writes at once."""
        ...


def file_to_guest(port: DmaPort, pieces: list[tuple[int, int]], fd: int, offset: int,
                  then: Sequence[tuple[int, bytes]] = ()) -> None:
    """:meth:`DmaPort.write_from_file` through a buffer: the file read whole, then the
    port's ``write_many`` of its pieces and ``then`` (for ports that cannot place file data
    in guest memory; on a network that is one message)."""
    total = sum(n for _, n in pieces)
    data = memoryview(os.pread(fd, total, offset).ljust(total, b"\0"))
    out, pos = [], 0
    for addr, n in pieces:
        out.append((addr, data[pos:pos + n]))
        pos += n
    port.write_many(out + list(then))


def guest_to_file(port: DmaPort, pieces: list[tuple[int, int]], fd: int, offset: int) -> None:
    """:meth:`DmaPort.read_into_file` through buffers: ``read_many``, then the file (whole:
    a DMA that fails part way writes nothing)."""
    write_all(fd, port.read_many(pieces), offset)


class ScatterByPieces:
    """``read_many``/``write_many`` as one ``read``/``write`` per piece: for ports where
    a piece costs no more alone (local memory)."""

    reads_wait_on_network = False
    reads_shadows = False  # local memory: the device reads them itself, at a copy each

    def posted_together(self) -> ContextManager[None]:
        return contextlib.nullcontext()   # local memory: each write is already done

    def watch_ring(self, slot: int, ring: Ring | None) -> None:
        pass   # local memory: a fetch is a copy, there is no round trip to save

    def write_from_file(self, pieces: list[tuple[int, int]], fd: int, offset: int,
                        then: Sequence[tuple[int, bytes]] = ()) -> None:
        file_to_guest(self, pieces, fd, offset, then)  # type: ignore[arg-type]

    def read_into_file(self, pieces: list[tuple[int, int]], fd: int, offset: int) -> None:
        guest_to_file(self, pieces, fd, offset)  # type: ignore[arg-type]

    def read_many(self, pieces: list[tuple[int, int]]) -> list[bytes]:
        return [self.read(addr, length) for addr, length in pieces]  # type: ignore[attr-defined]

    def read_many_begin(self, pieces: list[tuple[int, int]]) -> Callable[[], list[bytes]]:
        return lambda: self.read_many(pieces)   # local memory: nothing to overlap

    def read_into(self, pieces: list[tuple[int, int]], sink: Sink) -> None:
        pos = 0
        for addr, length in pieces:
            sink(pos, memoryview(self.read(addr, length)))  # type: ignore[attr-defined]
            pos += length

    def write_many(self, pieces: list[tuple[int, bytes | memoryview]]) -> None:
        for addr, data in pieces:
            self.write(addr, data)  # type: ignore[attr-defined]


class IrqPort(Protocol):
    """Interrupt delivery: edge messages for MSI/MSI-X, a level for INTx.

    Called with the device lock held (so an interrupt stays ordered after the
    state change that caused it): implementations must not block on the guest.
    """

    def msi(self, vector: int) -> None:
        """Edge interrupt on MSI vector ``vector``."""
        ...

    def msix(self, vector: int) -> None:
        """Edge interrupt on MSI-X vector ``vector``."""
        ...

    def intx(self, level: bool) -> None:
        """Set the INTx line level (True = asserted)."""
        ...


class NullDmaPort(ScatterByPieces):
    """No DMA port attached yet: every access is a DMA fault."""

    def read(self, addr: int, length: int) -> bytes:
        raise DmaError("no DMA port attached")

    def write(self, addr: int, data: bytes) -> None:
        raise DmaError("no DMA port attached")


class NullIrqPort:
    """No interrupt port attached yet: interrupts are dropped, but counted for diagnosis."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.dropped: dict[str, int] = {"msi": 0, "msix": 0, "intx": 0}

    def _count(self, kind: str) -> None:
        with self._lock:
            self.dropped[kind] += 1

    def msi(self, vector: int) -> None:
        self._count("msi")

    def msix(self, vector: int) -> None:
        self._count("msix")

    def intx(self, level: bool) -> None:
        self._count("intx")
