"""TestDevice: the project's own test device, small enough to reason about.

BAR0 (4 KiB, 32-bit) holds the registers below; BAR2 is a large 64-bit
prefetchable memory BAR backed by SparseMemory. The registers exercise every
path the proxies must carry: plain reads/writes, read side effects (COUNTER),
interrupts (DOORBELL, ISR) and device-initiated DMA (copy, fill, checksum).

All registers are 32-bit little-endian. Narrower or wider accesses work byte
lane by byte lane: a read returns the bytes of every register it touches (each
touched register is read once, so COUNTER counts the access), a write changes
only the written bytes of RW registers, and W1C/command registers act on the
written bytes with the others taken as zero.
"""

from __future__ import annotations

import logging
import threading
import zlib
from dataclasses import dataclass

from .bars import BarSpec
from .device import IrqConfig, PciFunction
from .header import PciIdentity
from .ports import DmaError
from .registers import read_registers, write_registers
from .sparse_memory import SparseMemory
from .worker import DeviceWorker

log = logging.getLogger(__name__)

VENDOR_ID = 0x1B36
DEVICE_ID = 0x10F0
CLASS_CODE = 0xFF0000
REVISION = 1

REGISTER_BAR = 0
MEMORY_BAR = 2
REGISTER_BAR_SIZE = 4096
DEFAULT_MEMORY_SIZE = 4 << 30
MSIX_TABLE_OFFSET = 0x800
MSIX_PBA_OFFSET = 0xC00
VECTORS = 4

# BAR0 registers
REG_ID = 0x00
REG_VERSION = 0x04
REG_SCRATCH0 = 0x08
REG_SCRATCH1 = 0x0C
REG_COUNTER = 0x10
REG_DOORBELL = 0x14
REG_ISR = 0x18
REG_IRQ_COUNT = 0x1C
REG_DMA_SRC_LO = 0x20
REG_DMA_SRC_HI = 0x24
REG_DMA_DST_LO = 0x28
REG_DMA_DST_HI = 0x2C
REG_DMA_LEN = 0x30
REG_DMA_CMD = 0x34
REG_DMA_STATUS = 0x38
REG_DMA_RESULT = 0x3C
REG_DMA_COUNT = 0x40

ID_VALUE = 0xD0C50001
VERSION_VALUE = 0x00010000
RW_REGISTERS = (REG_SCRATCH0, REG_SCRATCH1, REG_DMA_SRC_LO, REG_DMA_SRC_HI,
                REG_DMA_DST_LO, REG_DMA_DST_HI, REG_DMA_LEN)

# DMA_CMD fields
DMA_OP_MASK = 0xFF
DMA_OP_COPY = 1
DMA_OP_FILL = 2
DMA_OP_CHECKSUM = 3
DMA_FILL_SHIFT = 8
DMA_CMD_INTERRUPT = 1 << 16
DMA_VECTOR_SHIFT = 20
DMA_VECTOR_MASK = 0xF

# DMA_STATUS values and DMA_RESULT error codes
DMA_IDLE, DMA_BUSY, DMA_DONE, DMA_ERROR = 0, 1, 2, 3
ERR_BAD_OP, ERR_BAD_LENGTH, ERR_DMA_FAULT = 1, 2, 3

DMA_MAX_LENGTH = 1 << 20
DMA_CHUNK = 256 << 10
U32 = 0xFFFF_FFFF


@dataclass(frozen=True)
class DmaCommand:
    """A DMA command latched from the registers when DMA_CMD was written."""

    op: int
    src: int
    dst: int
    length: int
    fill: int
    interrupt: bool
    vector: int
    generation: int    # reset count when issued: a reset cancels the command


class TestDevice(PciFunction):
    """The test device (1b36:10f0, class ff0000). ``close()`` stops its DMA worker."""

    __test__ = False   # not a pytest test class, despite the name

    def __init__(self, *, msix: bool = False, memory_size: int = DEFAULT_MEMORY_SIZE,
                 config_size: int = 4096, pcie: bool = True) -> None:
        identity = PciIdentity(VENDOR_ID, DEVICE_ID, CLASS_CODE, REVISION)
        bars = [BarSpec(REGISTER_BAR, REGISTER_BAR_SIZE, "mem32"),
                BarSpec(MEMORY_BAR, memory_size, "mem64", prefetchable=True)]
        if msix:
            # MSI-X replaces MSI: QEMU picks one, and hot-unplug needs an MSI-only build.
            irq = IrqConfig(intx=True, msix_vectors=VECTORS, msix_bar=REGISTER_BAR,
                            msix_table_offset=MSIX_TABLE_OFFSET, msix_pba_offset=MSIX_PBA_OFFSET)
        else:
            irq = IrqConfig(intx=True, msi_vectors=VECTORS)
        super().__init__(identity, bars, irq, config_size=config_size, pcie=pcie)
        self.memory = SparseMemory(memory_size)
        self.worker = DeviceWorker(f"testdev-dma-{id(self):x}")
        self._dma_settled = threading.Condition(self.lock)
        self._generation = 0
        self.dma_commands_ignored = 0
        with self.lock:
            self.reset_registers()

    def close(self, timeout: float = 2.0) -> bool:
        """Stop the DMA worker; True if it ended within ``timeout`` seconds."""
        return self.worker.close(timeout)

    def wait_dma_idle(self, timeout: float = 2.0) -> bool:
        """Wait until no DMA is running; False on timeout."""
        with self._dma_settled:
            return self._dma_settled.wait_for(lambda: self._dma_status != DMA_BUSY, timeout)

    # -- PciFunction hooks ------------------------------------------------------------

    def reset_registers(self) -> None:
        """Power-on values; device memory is cleared too, so nothing leaks between leases."""
        self._generation += 1    # cancels a DMA in flight
        self._scratch = {REG_SCRATCH0: 0, REG_SCRATCH1: 0}
        self._dma_regs = {reg: 0 for reg in RW_REGISTERS if reg not in self._scratch}
        self._counter = 0
        self._isr = 0
        self._irq_count = 0
        self._dma_status = DMA_IDLE
        self._dma_result = 0
        self._dma_count = 0
        self.memory.clear()
        self._dma_settled.notify_all()

    def bar_read(self, index: int, offset: int, size: int) -> int | bytes:
        if index == MEMORY_BAR:
            return self.memory.read(offset, size)
        return read_registers(self._read_register, offset, size)

    def bar_write(self, index: int, offset: int, data: bytes) -> None:
        if index == MEMORY_BAR:
            self.memory.write(offset, data)
            return
        write_registers(self._write_register, offset, data)

    # -- registers ----------------------------------------------------------------------

    def _read_register(self, reg: int) -> int:
        if reg == REG_ID:
            return ID_VALUE
        if reg == REG_VERSION:
            return VERSION_VALUE
        if reg in self._scratch:
            return self._scratch[reg]
        if reg == REG_COUNTER:
            value, self._counter = self._counter, (self._counter + 1) & U32
            return value
        if reg == REG_ISR:
            return self._isr
        if reg == REG_IRQ_COUNT:
            return self._irq_count
        if reg in self._dma_regs:
            return self._dma_regs[reg]
        if reg == REG_DMA_STATUS:
            return self._dma_status
        if reg == REG_DMA_RESULT:
            return self._dma_result
        if reg == REG_DMA_COUNT:
            return self._dma_count
        return 0    # write-only (DOORBELL, DMA_CMD) and unused offsets read as zero

    def _write_register(self, reg: int, value: int, lanes: int) -> None:
        if reg in self._scratch:
            self._scratch[reg] = (self._scratch[reg] & ~lanes) | (value & lanes)
        elif reg in self._dma_regs:
            self._dma_regs[reg] = (self._dma_regs[reg] & ~lanes) | (value & lanes)
        elif reg == REG_DOORBELL:
            if value < 32:          # ISR has 32 bits; larger vectors are ignored
                self._signal(value)
        elif reg == REG_ISR:
            self._isr &= ~value
            if self._isr == 0:
                self.lower_interrupt()
        elif reg == REG_DMA_CMD:
            self._start_dma(value)
        # read-only and unused registers ignore writes

    def _signal(self, vector: int) -> None:
        """Set ISR bit ``vector``, count it, and interrupt the guest."""
        self._isr |= 1 << vector
        self._irq_count = (self._irq_count + 1) & U32
        self.raise_interrupt(vector)

    # -- DMA -------------------------------------------------------------------------------

    def _start_dma(self, cmd: int) -> None:
        """Latch the command; the worker does the DMA so this thread can reply at once."""
        if self._dma_status == DMA_BUSY:
            self.dma_commands_ignored += 1      # one command at a time
            return
        regs = self._dma_regs
        command = DmaCommand(
            op=cmd & DMA_OP_MASK,
            src=regs[REG_DMA_SRC_HI] << 32 | regs[REG_DMA_SRC_LO],
            dst=regs[REG_DMA_DST_HI] << 32 | regs[REG_DMA_DST_LO],
            length=regs[REG_DMA_LEN],
            fill=cmd >> DMA_FILL_SHIFT & 0xFF,
            interrupt=bool(cmd & DMA_CMD_INTERRUPT),
            vector=cmd >> DMA_VECTOR_SHIFT & DMA_VECTOR_MASK,
            generation=self._generation)
        if command.op not in (DMA_OP_COPY, DMA_OP_FILL, DMA_OP_CHECKSUM):
            self._finish_dma(command, DMA_ERROR, ERR_BAD_OP)
        elif not 1 <= command.length <= DMA_MAX_LENGTH:
            self._finish_dma(command, DMA_ERROR, ERR_BAD_LENGTH)
        else:
            self._dma_status = DMA_BUSY
            self._dma_result = 0
            self.worker.submit(lambda: self._run_dma(command))

    def _run_dma(self, command: DmaCommand) -> None:
        """Worker thread: the DMA itself, without the device lock held."""
        try:
            result = self._transfer(command)
            status = DMA_DONE
        except DmaError as error:
            log.debug("test device DMA fault: %s", error)
            status, result = DMA_ERROR, ERR_DMA_FAULT
        except Exception:
            log.exception("test device DMA port failed")
            status, result = DMA_ERROR, ERR_DMA_FAULT
        with self.lock:
            if command.generation == self._generation:
                self._finish_dma(command, status, result)

    def _transfer(self, command: DmaCommand) -> int:
        """Move the data in chunks of at most DMA_CHUNK (256 KiB); return DMA_RESULT. A copy
        or checksum reads its source as one scatter list of chunks (``dma_read_into``), so
        on a box the chunks' reads are in flight together and each chunk is written on as
        it arrives: the reads run ahead of the writes, as a DMA engine's do (the source is
        read as it was, like memmove)."""
        chunks = [(start, min(DMA_CHUNK, command.length - start)) for start in range(0, command.length, DMA_CHUNK)]
        if command.op == DMA_OP_FILL:
            for start, size in chunks:
                self._check_generation(command)
                self.dma_write(command.dst + start, bytes([command.fill]) * size)
            return 0
        crc = 0

        def sink(pos: int, data: memoryview) -> None:
            nonlocal crc
            self._check_generation(command)
            if command.op == DMA_OP_COPY:
                self.dma_write(command.dst + pos, data)
            else:
                crc = zlib.crc32(data, crc)
        self._check_generation(command)
        self.dma_read_into([(command.src + start, size) for start, size in chunks], sink)
        return crc if command.op == DMA_OP_CHECKSUM else 0

    def _check_generation(self, command: DmaCommand) -> None:
        if command.generation != self._generation:
            raise DmaError("device reset during DMA")

    def _finish_dma(self, command: DmaCommand, status: int, result: int) -> None:
        """Publish the outcome; the completion interrupt is raised on errors too."""
        self._dma_status = status
        self._dma_result = result
        if status == DMA_DONE:
            self._dma_count = (self._dma_count + 1) & U32
        if command.interrupt:
            self._signal(command.vector)
        self._dma_settled.notify_all()
