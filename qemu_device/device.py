"""PciFunction: the base every device model subclasses.

It owns what every PCI function has - config space with header, BARs and
capabilities, interrupt signalling (INTx, MSI, MSI-X with its table and PBA)
and function-level reset - and hands the device-specific part to subclass
hooks: ``bar_read``/``bar_write`` for BAR accesses and ``reset_registers`` for
reset. Whoever serves the device (local vfio-user server or remote proxy)
calls the guest-facing methods and attaches the DMA and IRQ ports; the model
never knows which.

Threading: region accesses arrive on a server thread while a device's worker
may raise interrupts or do DMA. All device state is guarded by one re-entrant
lock, ``self.lock``, taken by every public method here; subclass hooks run
with it held. DMA through the port must be done *without* the lock (see
``dma_read``): QEMU serves our DMA on the same loop that waits for our region
replies, so holding the lock across a DMA could deadlock the server thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, ContextManager, NamedTuple, Sequence

from . import header
from .bars import BarSpec, install_bars, validate_bar_layout
from .capabilities import CAP_ID_MSI, MSI_VECTOR_COUNTS, CapabilityList
from .config_space import ConfigSpace, overlaps
from .header import PciIdentity
from .msix import MsixTable, pba_bytes, table_bytes
from .ports import DmaError, DmaPort, IrqPort, NullDmaPort, NullIrqPort, Ring, Sink

# vfio-user / VFIO region numbering
REGION_BAR0 = 0
REGION_ROM = 6
REGION_CONFIG = 7
REGION_VGA = 8
REGION_COUNT = 9

REGION_FLAG_READ = 1 << 0
REGION_FLAG_WRITE = 1 << 1
REGION_FLAG_MMAP = 1 << 2


class RegionInfo(NamedTuple):
    """One vfio-user region as GET_REGION_INFO reports it."""

    index: int
    size: int
    readable: bool
    writable: bool
    mappable: bool

    @property
    def flags(self) -> int:
        """VFIO_REGION_INFO_FLAG_* bits."""
        return ((REGION_FLAG_READ if self.readable else 0)
                | (REGION_FLAG_WRITE if self.writable else 0)
                | (REGION_FLAG_MMAP if self.mappable else 0))


@dataclass(frozen=True)
class IrqConfig:
    """Which interrupt mechanisms the function offers.

    MSI-X needs ``msix_bar``: the table sits at ``msix_table_offset`` and the PBA
    at ``msix_pba_offset`` (default: right after the table) inside that BAR.
    """

    intx: bool = True
    msi_vectors: int = 0
    msix_vectors: int = 0
    msix_bar: int | None = None
    msix_table_offset: int = 0
    msix_pba_offset: int | None = None
    msi_per_vector_masking: bool = False

    @property
    def pba_offset(self) -> int:
        if self.msix_pba_offset is not None:
            return self.msix_pba_offset
        return self.msix_table_offset + table_bytes(self.msix_vectors)


@dataclass(frozen=True)
class PcieLink:
    """What the PCI Express capability advertises (the link is virtual: any plausible value)."""

    max_payload: int = 256
    width: int = 1
    generation: int = 1


@dataclass(frozen=True)
class BegunFetch:
    """A queue fetch its doorbell began (:meth:`PciFunction.dma_fetch_begin`): the
    worker finishes it when it still starts at the queue's head and holds no more entries
    than are there now; else it reads for itself (the completion is dropped unread)."""

    first: int
    count: int
    finish: Callable[[], list[bytes]]

    def covers(self, first: int, count: int) -> bool:
        return self.first == first and self.count <= count


class PciFunction:
    """A PCI(e) endpoint function; subclass it and implement the BAR hooks."""

    # Optional features, declared (never probed): whoever serves the device reads these.
    coalesce_posted = False  # posted writes go to memory (a framebuffer): they may be glued into runs
    event_source = None  # events on a descriptor of the device's own (only the host proxy's link has one)
    native_forward = None  # region accesses may be forwarded in C (only the host proxy's link, on the native stream)
    wants_dma_windows = False  # told of QEMU's DMA windows (dma_mapped/dma_unmapped): a box's external server
    renders_screen = False  # render_png gives the screen (a display)
    attach_error: str | None = None  # why QEMU cannot have this device: its GET_INFO fails with it
    gone: str | None = None  # why the device answers nothing any more (a box's external server that died)

    def __init__(self, identity: PciIdentity, bars: Sequence[BarSpec],
                 irq: IrqConfig = IrqConfig(), *, config_size: int = 4096,
                 pcie: bool = True, link: PcieLink = PcieLink()) -> None:
        if config_size == 4096 and not pcie:
            raise ValueError("a 4 KiB config space needs pcie=True (conventional PCI has 256 bytes)")
        self.lock = threading.RLock()
        self.identity = identity
        self.bars: dict[int, BarSpec] = validate_bar_layout(list(bars))
        self.irq_config = irq
        self.config = ConfigSpace(config_size)
        header.install_type0_header(self.config, identity, intx=irq.intx)
        install_bars(self.config, list(self.bars.values()))
        self.caps = CapabilityList(self.config)
        self.caps.add_power_management()
        if irq.msi_vectors:
            if irq.msi_vectors not in MSI_VECTOR_COUNTS:
                raise ValueError(f"msi_vectors must be 0 or one of {MSI_VECTOR_COUNTS}, "
                                 f"not {irq.msi_vectors}")
            self.caps.add_msi(irq.msi_vectors, irq.msi_per_vector_masking)
        self.msix: MsixTable | None = None
        if irq.msix_vectors:
            self._check_msix_placement(irq)
            self.msix = MsixTable(irq.msix_vectors)
            self.caps.add_msix(irq.msix_vectors, irq.msix_bar, irq.msix_table_offset,
                               irq.msix_bar, irq.pba_offset)
        if pcie:
            self.caps.add_pcie_endpoint(link.max_payload, link.width, link.generation)
        self.config.on_write(self._on_config_write)

        self.dma: DmaPort = NullDmaPort()
        self.irq: IrqPort = NullIrqPort()
        self.suppressed_interrupts = 0   # raised while no usable vector: diagnostics only
        # Under vfio-user the VMM keeps the MSI-X table (the guest's table writes never reach
        # us) and masks vectors itself: set by whoever serves the device that way.
        self.vmm_masks_msix = False
        self._intx_line = False          # level last reported to the IRQ port
        self.save_power_on_config()

    def posted_idle(self) -> None:
        """Whoever serves the device is about to wait for more traffic (a no-op for models)."""

    def dma_mapped(self, address: int, size: int, flags: int) -> None:
        """QEMU mapped a DMA window; called only where ``wants_dma_windows``."""

    def dma_unmapped(self, address: int, size: int, flags: int) -> None:
        """QEMU unmapped a DMA window (``DMA_UNMAP_ALL``: all); only where ``wants_dma_windows``."""

    def render_png(self) -> bytes:
        """The screen as a PNG; only where ``renders_screen``."""
        raise NotImplementedError(f"{type(self).__name__} has no screen")

    def capacity_bytes(self) -> int:
        """What the device offers, for the box's inventory: its largest BAR by default
        (a disk or an accelerator says its capacity instead)."""
        return max((bar.size for bar in self.bars.values()), default=0)

    def stats(self) -> dict:
        """What the device did, for its serving process's stats file."""
        return {"suppressed_interrupts": self.suppressed_interrupts}

    def close(self) -> None:
        """The server stops for good: end the device's threads and free its memory."""

    def save_power_on_config(self) -> None:
        """Record config space as reset restores it.

        Called by the constructor; a subclass that changes config space after
        ``super().__init__()`` calls it again.
        """
        with self.lock:
            self._power_on_config = self.config.snapshot()

    # -- ports -------------------------------------------------------------------

    def attach(self, dma: DmaPort, irq: IrqPort) -> None:
        """Connect the device to its guest (done by whoever serves it)."""
        with self.lock:
            self.dma = dma
            self.irq = irq

    def detach(self) -> None:
        """Back to the null ports: DMA faults, interrupts are dropped."""
        with self.lock:
            self.dma = NullDmaPort()
            self.irq = NullIrqPort()

    # -- guest-facing API (used by the server) -------------------------------------

    def regions(self) -> list[RegionInfo]:
        """Regions 0-8 in vfio-user numbering; absent ones have size 0.

        Only a BAR declared ``host_mappable`` is mappable; every other access must reach
        the model (and, when remote, cross the network in order with DMA and interrupts).
        """
        infos = []
        for index in range(REGION_COUNT):
            mappable = False
            if index == REGION_CONFIG:
                size = self.config.size
            elif index in self.bars:
                size = self.bars[index].size
                mappable = self.bars[index].host_mappable
            else:
                size = 0
            infos.append(RegionInfo(index, size, size > 0, size > 0, mappable))
        return infos

    def bar_memory(self, index: int):
        """The :class:`~qemu_device.mapped_memory.MappedMemory` behind a host-mappable BAR
        (its ``fd`` is what the VMM maps); None for every other BAR. Subclasses with a
        host-mappable BAR override it."""
        return None

    def irq_counts(self) -> dict[str, int]:
        """Interrupt counts per vfio-user IRQ index (INTx, MSI, MSI-X, ERR, REQ)."""
        return {"intx": 1 if self.irq_config.intx else 0,
                "msi": self.irq_config.msi_vectors,
                "msix": self.irq_config.msix_vectors,
                "err": 1, "req": 1}

    def region_read(self, index: int, offset: int, size: int) -> bytes:
        """Guest read of ``size`` bytes; ValueError for absent regions or out of range."""
        if size < 1:
            raise ValueError(f"empty read of region {index}")
        with self.lock:
            if index == REGION_CONFIG:
                return self.config.read_bytes(offset, size)
            self._check_bar_access(index, offset, size)
            window = self._msix_window(index, offset, size)
            if window is not None:
                return self._msix_read(*window, size)
            value = self.bar_read(index, offset, size)
            data = value.to_bytes(size, "little") if isinstance(value, int) else bytes(value)
            if len(data) != size:
                raise RuntimeError(f"bar_read({index}, {offset:#x}, {size}) returned "
                                   f"{len(data)} bytes")
            return data

    def region_write(self, index: int, offset: int, data: bytes, posted: bool = False) -> None:
        """Guest write; ValueError for absent regions or out of range.

        ``posted`` (no completion awaited) changes nothing for a model; a proxy that
        carries the write elsewhere keeps it posted.
        """
        if not data:
            raise ValueError(f"empty write to region {index}")
        with self.lock:
            if index == REGION_CONFIG:
                self.config.write_bytes(offset, bytes(data))
                return
            self._check_bar_access(index, offset, len(data))
            window = self._msix_window(index, offset, len(data))
            if window is not None:
                self._msix_write(*window, bytes(data))
                return
            self.bar_write(index, offset, bytes(data))

    def reset(self) -> None:
        """Function-level reset: power-on config (BARs unassigned, interrupts off),
        MSI-X table masked and empty, INTx deasserted, device registers via
        ``reset_registers``."""
        with self.lock:
            self.config.restore(self._power_on_config)
            self.caps.reset_shadow_state()
            if self.msix is not None:
                self.msix.reset()
            self._update_intx_line()
            self.reset_registers()

    # -- subclass hooks -------------------------------------------------------------

    def bar_read(self, index: int, offset: int, size: int) -> int | bytes:
        """Read from BAR ``index`` (range already checked, lock held). Default: zeros.

        BARs are served even while Memory Space Enable is off: QEMU maps a BAR
        into the guest only while decode is on, so the gate is already applied
        upstream; checking it again here would only break in-process tools and
        tests that poke registers without programming Command.
        """
        return bytes(size)

    def bar_write(self, index: int, offset: int, data: bytes) -> None:
        """Write to BAR ``index`` (range already checked, lock held). Default: ignored."""

    def reset_registers(self) -> None:
        """Put device registers back to their power-on values (lock held)."""

    # -- device-side API ---------------------------------------------------------------

    def raise_interrupt(self, vector: int = 0) -> None:
        """Signal ``vector`` the way the guest configured the function.

        MSI-X if enabled (a masked vector, or a function-masked table, sets the
        vector's PBA bit instead and fires when unmasked); else MSI if enabled:
        the function may only use the vectors Multiple Message Enable granted
        (it signals a vector by changing the low bits of the data), so a vector
        beyond them is not raised at all; else INTx: Status.Interrupt is set and
        the line asserted unless Command.INTx Disable. A vector that cannot be
        signalled is counted in ``suppressed_interrupts``.
        """
        if vector < 0:
            raise ValueError(f"interrupt vector must be >= 0, not {vector}")
        with self.lock:
            if self.msix is not None and self.caps.msix_enabled():
                if self.vmm_masks_msix:
                    if vector < self.irq_config.msix_vectors:
                        self.irq.msix(vector)
                    else:
                        self.suppressed_interrupts += 1
                else:
                    self._raise_msix(vector)
            elif self.caps.msi_enabled():
                self._raise_msi(vector)
            elif self.irq_config.intx:
                header.set_status_bits(self.config, header.STATUS_INTX, True)
                self._update_intx_line()
            else:
                self.suppressed_interrupts += 1

    def intx_in_use(self) -> bool:
        """Would :meth:`raise_interrupt` assert INTx (neither MSI-X nor MSI enabled)?"""
        with self.lock:
            return not self._message_interrupts_enabled()

    def lower_interrupt(self) -> None:
        """Clear Status.Interrupt and deassert INTx (the IRQ port sees only level changes)."""
        with self.lock:
            header.set_status_bits(self.config, header.STATUS_INTX, False)
            self._update_intx_line()

    def bus_master_enabled(self) -> bool:
        with self.lock:
            return header.bus_master_enabled(self.config)

    def dma_read(self, addr: int, length: int) -> bytes:
        """DMA read through the port, refused while Bus Master Enable is off.

        Call without holding ``self.lock`` (see the module docstring).
        """
        return self._dma_port_checked().read(addr, length)

    def dma_read_many(self, pieces: list[tuple[int, int]]) -> list[bytes]:
        """Several DMA reads at once (scatter lists): one round trip for all of them on a
        port that pipelines, one read each on local memory."""
        return self._dma_port_checked().read_many(pieces)

    def dma_read_into(self, pieces: list[tuple[int, int]], sink: Sink) -> None:
        """Several DMA reads handed to ``sink`` as they arrive (:meth:`DmaPort.read_into`):
        for a device that stores them itself, without a buffer of the whole read."""
        self._dma_port_checked().read_into(pieces, sink)

    def dma_fetch_begin(self, first: int, count: int, pieces: list[tuple[int, int]]) -> BegunFetch | None:
        """A doorbell's queue fetch (``count`` entries from ``first``, at ``pieces``) begun
        now where DMA reads wait on a network and Bus Master is on (see
        :meth:`DmaPort.read_many_begin`), for the worker to finish; else None, and the
        worker reads as usual. Never waits on the network, so a doorbell's handler may
        call it with ``self.lock`` held."""
        if not (self.dma_reads_wait_on_network and self.bus_master_enabled()):
            return None
        return BegunFetch(first, count, self._dma_port_checked().read_many_begin(pieces))

    def dma_write(self, addr: int, data: bytes) -> None:
        """DMA write through the port, refused while Bus Master Enable is off."""
        self._dma_port_checked().write(addr, data)

    def dma_write_many(self, pieces: list[tuple[int, bytes | memoryview]]) -> None:
        """Several DMA writes in order (scatter lists): sent together on a remote port."""
        self._dma_port_checked().write_many(pieces)

    def dma_write_from_file(self, pieces: list[tuple[int, int]], fd: int, offset: int,
                            then: Sequence[tuple[int, bytes]] = ()) -> None:
        """A file's bytes DMA-written to the pieces, then ``then``'s writes (see
        :meth:`DmaPort.write_from_file`)."""
        self._dma_port_checked().write_from_file(pieces, fd, offset, then)

    def dma_read_into_file(self, pieces: list[tuple[int, int]], fd: int, offset: int) -> None:
        """The pieces DMA-read into a file (see :meth:`DmaPort.read_into_file`)."""
        self._dma_port_checked().read_into_file(pieces, fd, offset)

    def dma_watch_ring(self, slot: int, ring: Ring | None) -> None:
        """Declare or withdraw a doorbell-announced ring (see :meth:`DmaPort.watch_ring`)."""
        self.dma.watch_ring(slot, ring)

    def dma_posted_together(self) -> ContextManager[None]:
        """This thread's posted DMA writes and interrupts inside leave together (see
        :meth:`DmaPort.posted_together`)."""
        return self.dma.posted_together()

    @property
    def dma_reads_wait_on_network(self) -> bool:
        """Does a DMA read cost a network round trip here (see :class:`DmaPort`)?"""
        return self.dma.reads_wait_on_network

    @property
    def dma_reads_shadows(self) -> bool:
        """Does the port's host read a watched ring's shadow doorbell (see :class:`DmaPort`)?"""
        return self.dma.reads_shadows

    def _dma_port_checked(self) -> DmaPort:
        with self.lock:
            if not header.bus_master_enabled(self.config):
                raise DmaError("bus master enable is off: the device may not issue DMA")
            return self.dma

    # -- interrupts ----------------------------------------------------------------------

    def _raise_msix(self, vector: int) -> None:
        msix = self.msix
        assert msix is not None
        if vector >= msix.vectors:
            self.suppressed_interrupts += 1
        elif self.caps.msix_function_masked() or msix.is_masked(vector):
            msix.set_pending(vector, True)
        else:
            self.irq.msix(vector)

    def _raise_msi(self, vector: int) -> None:
        vectors, masked = self.caps.msi_vectors_masked()
        if vector >= vectors:
            self.suppressed_interrupts += 1
        elif masked >> vector & 1:
            self.caps.set_msi_pending(vector, True)
        else:
            self.irq.msi(vector)

    def _deliver_pending(self) -> None:
        """Send messages held back by masking once their vector is unmasked."""
        if self.msix is not None and self.caps.msix_enabled() \
                and not self.caps.msix_function_masked():
            for vector in self.msix.pending_vectors():
                if not self.msix.is_masked(vector):
                    self.msix.set_pending(vector, False)
                    self.irq.msix(vector)
        if self.caps.has(CAP_ID_MSI) and self.caps.msi_per_vector_masking:
            state = self.caps.msi_state()
            if state.enabled:
                for vector in range(state.vectors):
                    if state.pending >> vector & 1 and not state.masked >> vector & 1:
                        self.caps.set_msi_pending(vector, False)
                        self.irq.msi(vector)

    def _update_intx_line(self) -> None:
        """Drive INTx from Status.Interrupt, INTx Disable and MSI/MSI-X enable.

        A function enabled for MSI or MSI-X must not use its INTx pin, and INTx
        Disable masks the line without losing Status.Interrupt, so re-enabling
        re-asserts a still-pending interrupt.
        """
        config = self.config
        asserted = bool(self.irq_config.intx
                        and config.get_u16(header.STATUS) & header.STATUS_INTX
                        and not header.intx_disabled(config)
                        and not self._message_interrupts_enabled())
        if asserted != self._intx_line:
            self._intx_line = asserted
            self.irq.intx(asserted)

    def _message_interrupts_enabled(self) -> bool:
        if self.msix is not None and self.caps.msix_enabled():
            return True
        return self.caps.msi_enabled()

    def _on_config_write(self, offset: int, size: int) -> None:
        """React to Command, MSI and MSI-X control writes (cheap enough to run always)."""
        self._update_intx_line()
        self._deliver_pending()

    # -- BAR access helpers ------------------------------------------------------------

    def _check_bar_access(self, index: int, offset: int, size: int) -> None:
        spec = self.bars.get(index)
        if spec is None:
            raise ValueError(f"region {index} is absent on this device")
        if size < 1 or offset < 0 or offset + size > spec.size:
            raise ValueError(f"BAR {index} access [{offset:#x}, +{size}) outside its "
                             f"{spec.size:#x} bytes")

    def _msix_window(self, index: int, offset: int, size: int) -> tuple[str, int] | None:
        """("table"|"pba", offset inside it) if the access hits the MSI-X structures."""
        if self.msix is None or index != self.irq_config.msix_bar:
            return None
        for name, start, length in (
                ("table", self.irq_config.msix_table_offset, self.msix.table_size),
                ("pba", self.irq_config.pba_offset, self.msix.pba_size)):
            if overlaps(offset, size, start, length):
                if offset < start or offset + size > start + length:
                    raise ValueError(f"BAR {index} access [{offset:#x}, +{size}) straddles "
                                     f"the MSI-X {name}")
                return name, offset - start
        return None

    def _msix_read(self, name: str, offset: int, size: int) -> bytes:
        assert self.msix is not None
        if name == "table":
            return self.msix.read_table(offset, size)
        return self.msix.read_pba(offset, size)

    def _msix_write(self, name: str, offset: int, data: bytes) -> None:
        assert self.msix is not None
        if name == "table":
            self.msix.write_table(offset, data)
            self._deliver_pending()
        # The PBA is read-only: writes are dropped.

    def _check_msix_placement(self, irq: IrqConfig) -> None:
        bar = self.bars.get(irq.msix_bar) if irq.msix_bar is not None else None
        if bar is None:
            raise ValueError(f"MSI-X needs msix_bar naming one of the BARs "
                             f"{sorted(self.bars)}, not {irq.msix_bar}")
        table = (irq.msix_table_offset, table_bytes(irq.msix_vectors))
        pba = (irq.pba_offset, pba_bytes(irq.msix_vectors))
        for name, (start, length) in (("table", table), ("PBA", pba)):
            if start < 0 or start + length > bar.size:
                raise ValueError(f"MSI-X {name} [{start:#x}, +{length:#x}) does not fit in "
                                 f"BAR {bar.index} ({bar.size:#x} bytes)")
        if overlaps(table[0], table[1], pba[0], pba[1]):
            raise ValueError("MSI-X table and PBA overlap")
