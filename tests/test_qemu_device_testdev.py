"""TestDevice: identity, BAR0 registers, BAR2 memory, DMA engine, interrupts, reset."""

from __future__ import annotations

import threading
import zlib

import pytest
from fakes import FakeGuestRam, RecordingIrqPort

from qemu_device import testdev as td
from qemu_device.capabilities import CAP_ID_MSI, CAP_ID_MSIX, walk_capabilities
from qemu_device.testdev import TestDevice

CONFIG = 7
RAM_BASE = 0x1_0000_0000
RAM_SIZE = 4 << 20
GiB = 1 << 30


@pytest.fixture
def dev():
    device = TestDevice()
    yield device
    assert device.close()


@pytest.fixture
def guest(dev):
    """The device attached to fake RAM, with Bus Master and Memory enabled."""
    ram, irq = FakeGuestRam(), RecordingIrqPort()
    dev.attach(ram, irq)
    cfg_write(dev, 0x04, 2, 0x0006)
    return dev, ram, irq


def cfg_write(dev, offset, size, value):
    dev.region_write(CONFIG, offset, value.to_bytes(size, "little"))


def cfg_read(dev, offset, size):
    return int.from_bytes(dev.region_read(CONFIG, offset, size), "little")


def reg_read(dev, reg, size=4):
    return int.from_bytes(dev.region_read(0, reg, size), "little")


def reg_write(dev, reg, value, size=4):
    dev.region_write(0, reg, value.to_bytes(size, "little"))


def run_dma(dev, op, *, src=0, dst=0, length=0, fill=0, irq_vector=None):
    reg_write(dev, td.REG_DMA_SRC_LO, src & 0xFFFF_FFFF)
    reg_write(dev, td.REG_DMA_SRC_HI, src >> 32)
    reg_write(dev, td.REG_DMA_DST_LO, dst & 0xFFFF_FFFF)
    reg_write(dev, td.REG_DMA_DST_HI, dst >> 32)
    reg_write(dev, td.REG_DMA_LEN, length)
    cmd = op | fill << 8
    if irq_vector is not None:
        cmd |= 1 << 16 | irq_vector << 20
    reg_write(dev, td.REG_DMA_CMD, cmd)
    assert dev.wait_dma_idle(2.0)
    return reg_read(dev, td.REG_DMA_STATUS), reg_read(dev, td.REG_DMA_RESULT)


# -- identity and layout -------------------------------------------------------------

def test_identity_and_layout():
    dev = TestDevice()
    assert cfg_read(dev, 0x00, 4) == 0x10F0_1B36
    assert cfg_read(dev, 0x08, 4) == 0xFF00_0001
    assert cfg_read(dev, 0x3D, 1) == 1
    assert [r.size for r in dev.regions()] == [4096, 0, 4 * GiB, 0, 0, 0, 0, 4096, 0]
    assert cfg_read(dev, 0x18, 4) == 0xC                       # 64-bit prefetchable
    assert [cap for _, cap in walk_capabilities(dev.config)] == [0x01, 0x05, 0x10]
    assert dev.caps.msi_vectors == 4 and dev.msix is None
    assert dev.irq_counts() == {"intx": 1, "msi": 4, "msix": 0, "err": 1, "req": 1}
    big = TestDevice(memory_size=64 * GiB)
    assert big.regions()[2].size == 64 * GiB


def test_msix_variant_has_table_in_bar0_and_no_msi():
    dev = TestDevice(msix=True)
    irq = RecordingIrqPort()
    dev.attach(FakeGuestRam(), irq)
    caps = [cap for _, cap in walk_capabilities(dev.config)]
    assert CAP_ID_MSIX in caps and CAP_ID_MSI not in caps
    off = dev.caps.offsets[CAP_ID_MSIX]
    assert cfg_read(dev, off + 4, 4) == 0x800 and cfg_read(dev, off + 8, 4) == 0xC00
    assert dev.irq_counts()["msix"] == 4 and dev.irq_counts()["msi"] == 0
    cfg_write(dev, off + 2, 2, 1 << 15)
    dev.region_write(0, 0x800 + 3 * 16 + 12, bytes(4))         # unmask vector 3
    reg_write(dev, td.REG_DOORBELL, 3)
    reg_write(dev, td.REG_DOORBELL, 1)                          # still masked -> PBA
    assert irq.events == [("msix", 3)]
    assert dev.region_read(0, 0xC00, 8)[0] == 0b10
    assert reg_read(dev, td.REG_ID) == td.ID_VALUE              # registers still there


# -- registers --------------------------------------------------------------------------

def test_read_only_registers(dev):
    assert reg_read(dev, td.REG_ID) == 0xD0C50001
    assert reg_read(dev, td.REG_VERSION) == 0x00010000
    reg_write(dev, td.REG_ID, 0)
    reg_write(dev, td.REG_VERSION, 0)
    reg_write(dev, td.REG_IRQ_COUNT, 7)
    assert reg_read(dev, td.REG_ID) == 0xD0C50001
    assert reg_read(dev, td.REG_VERSION) == 0x00010000
    assert reg_read(dev, td.REG_IRQ_COUNT) == 0
    assert reg_read(dev, 0x100) == 0 and reg_read(dev, 0xFFC) == 0


def test_scratch_registers_round_trip_with_byte_lanes(dev):
    reg_write(dev, td.REG_SCRATCH0, 0x11223344)
    reg_write(dev, td.REG_SCRATCH1, 0xCAFEF00D)
    assert reg_read(dev, td.REG_SCRATCH0) == 0x11223344
    reg_write(dev, td.REG_SCRATCH0 + 1, 0xAA, size=1)
    assert reg_read(dev, td.REG_SCRATCH0) == 0x1122AA44
    assert reg_read(dev, td.REG_SCRATCH0 + 2, size=2) == 0x1122
    reg_write(dev, td.REG_SCRATCH0, 0x0102030405060708, size=8)  # one 64-bit access
    assert reg_read(dev, td.REG_SCRATCH0) == 0x05060708
    assert reg_read(dev, td.REG_SCRATCH1) == 0x01020304


def test_counter_increments_on_every_read(dev):
    assert [reg_read(dev, td.REG_COUNTER) for _ in range(3)] == [0, 1, 2]
    assert reg_read(dev, td.REG_COUNTER, size=1) == 3             # a narrow read counts too
    assert reg_read(dev, td.REG_SCRATCH1, size=8) >> 32 == 4      # so does a wide one
    reg_write(dev, td.REG_COUNTER, 100)
    assert reg_read(dev, td.REG_COUNTER) == 5


def test_doorbell_isr_and_intx(dev):
    irq = RecordingIrqPort()
    dev.attach(FakeGuestRam(), irq)
    reg_write(dev, td.REG_DOORBELL, 1)
    reg_write(dev, td.REG_DOORBELL, 5)
    reg_write(dev, td.REG_DOORBELL, 32)                       # beyond ISR: ignored
    assert reg_read(dev, td.REG_DOORBELL) == 0                # write-only
    assert reg_read(dev, td.REG_ISR) == 0b100010
    assert reg_read(dev, td.REG_IRQ_COUNT) == 2
    assert irq.events == [("intx", True)]
    assert cfg_read(dev, 0x06, 2) & 0x08
    reg_write(dev, td.REG_ISR, 0b000010)                      # W1C one bit
    assert reg_read(dev, td.REG_ISR) == 0b100000
    assert irq.events == [("intx", True)]                     # still pending
    reg_write(dev, td.REG_ISR, 0xFFFF_FFFF)
    assert reg_read(dev, td.REG_ISR) == 0
    assert irq.events == [("intx", True), ("intx", False)]
    assert not cfg_read(dev, 0x06, 2) & 0x08


def test_doorbell_with_msi(dev):
    irq = RecordingIrqPort()
    dev.attach(FakeGuestRam(), irq)
    cfg_write(dev, dev.caps.offsets[CAP_ID_MSI] + 2, 2, (2 << 4) | 1)   # 4 vectors
    for vector in (0, 3, 4):
        reg_write(dev, td.REG_DOORBELL, vector)
    assert irq.events == [("msi", 0), ("msi", 3)]             # 4 is beyond what MSI granted
    assert reg_read(dev, td.REG_ISR) == 0b11001
    assert reg_read(dev, td.REG_IRQ_COUNT) == 3


def test_memory_bar_is_sparse(dev):
    dev.region_write(2, 3 * GiB + 5, b"hello")
    assert dev.region_read(2, 3 * GiB, 16) == b"\0" * 5 + b"hello" + b"\0" * 6
    assert dev.memory.resident_bytes == 4096
    assert dev.region_read(2, 4 * GiB - 4, 4) == bytes(4)
    with pytest.raises(ValueError):
        dev.region_read(2, 4 * GiB - 2, 4)


# -- DMA ---------------------------------------------------------------------------------

def test_dma_copy(guest):
    dev, ram, _ = guest
    payload = bytes(range(256)) * 512                         # 128 KiB
    ram.ram[0x1000:0x1000 + len(payload)] = payload
    status, result = run_dma(dev, td.DMA_OP_COPY, src=RAM_BASE + 0x1000,
                             dst=RAM_BASE + 0x200000, length=len(payload))
    assert (status, result) == (td.DMA_DONE, 0)
    assert bytes(ram.ram[0x200000:0x200000 + len(payload)]) == payload
    assert reg_read(dev, td.REG_DMA_COUNT) == 1


def test_dma_fill(guest):
    dev, ram, _ = guest
    status, _ = run_dma(dev, td.DMA_OP_FILL, dst=RAM_BASE + 10, length=1000, fill=0xA5)
    assert status == td.DMA_DONE
    assert ram.ram[9] == 0 and ram.ram[10:1010] == b"\xa5" * 1000 and ram.ram[1010] == 0


def test_dma_checksum_and_chunking(guest):
    dev, ram, _ = guest
    data = bytes((i * 7 + 3) & 0xFF for i in range(1 << 20))
    ram.ram[:len(data)] = data
    status, result = run_dma(dev, td.DMA_OP_CHECKSUM, src=RAM_BASE, length=1 << 20)
    assert (status, result) == (td.DMA_DONE, zlib.crc32(data))
    assert len(ram.calls) == 4 and max(n for _, _, n in ram.calls) == td.DMA_CHUNK == 256 << 10
    assert threading.current_thread().name not in ram.threads   # ran on the worker


def test_dma_fault_leaves_guest_memory_untouched(guest):
    dev, ram, _ = guest
    status, result = run_dma(dev, td.DMA_OP_COPY, src=0x1000, dst=RAM_BASE, length=4096)
    assert (status, result) == (td.DMA_ERROR, td.ERR_DMA_FAULT)
    assert [c for c in ram.calls if c[0] == "write"] == []
    status, result = run_dma(dev, td.DMA_OP_FILL, dst=RAM_BASE + RAM_SIZE, length=16, fill=1)
    assert (status, result) == (td.DMA_ERROR, td.ERR_DMA_FAULT)
    assert not any(ram.ram)
    assert reg_read(dev, td.REG_DMA_COUNT) == 0


def test_dma_refused_without_bus_master(guest):
    dev, ram, _ = guest
    cfg_write(dev, 0x04, 2, 0x0002)                            # memory on, bus master off
    status, result = run_dma(dev, td.DMA_OP_FILL, dst=RAM_BASE, length=64, fill=0xFF)
    assert (status, result) == (td.DMA_ERROR, td.ERR_DMA_FAULT)
    assert ram.calls == []


@pytest.mark.parametrize("op,length,code", [(0, 16, td.ERR_BAD_OP), (9, 16, td.ERR_BAD_OP),
                                            (1, 0, td.ERR_BAD_LENGTH),
                                            (2, (1 << 20) + 1, td.ERR_BAD_LENGTH)])
def test_dma_bad_command(guest, op, length, code):
    dev, ram, _ = guest
    status, result = run_dma(dev, op, src=RAM_BASE, dst=RAM_BASE, length=length)
    assert (status, result) == (td.DMA_ERROR, code)
    assert ram.calls == []


def test_dma_interrupt_on_completion(guest):
    dev, ram, irq = guest
    cfg_write(dev, dev.caps.offsets[CAP_ID_MSI] + 2, 2, (2 << 4) | 1)
    run_dma(dev, td.DMA_OP_FILL, dst=RAM_BASE, length=64, fill=1, irq_vector=2)
    assert irq.events == [("msi", 2)]
    assert reg_read(dev, td.REG_ISR) == 0b100 and reg_read(dev, td.REG_IRQ_COUNT) == 1
    run_dma(dev, td.DMA_OP_FILL, dst=0, length=64, irq_vector=1)     # faults: still signalled
    assert irq.events == [("msi", 2), ("msi", 1)]
    run_dma(dev, td.DMA_OP_FILL, dst=RAM_BASE, length=64)            # no interrupt requested
    assert len(irq.events) == 2


def test_region_accesses_answered_while_dma_in_flight(guest):
    """The server thread must never wait for DMA (QEMU serves DMA on the loop it blocks)."""
    dev, ram, _ = guest
    ram.gate = threading.Event()
    reg_write(dev, td.REG_DMA_LEN, 64)
    reg_write(dev, td.REG_DMA_DST_LO, RAM_BASE & 0xFFFF_FFFF)
    reg_write(dev, td.REG_DMA_DST_HI, RAM_BASE >> 32)
    reg_write(dev, td.REG_DMA_CMD, td.DMA_OP_FILL | 0x77 << 8)
    assert reg_read(dev, td.REG_DMA_STATUS) == td.DMA_BUSY
    reg_write(dev, td.REG_DMA_CMD, td.DMA_OP_FILL)             # busy: ignored
    assert dev.dma_commands_ignored == 1
    assert cfg_read(dev, 0x00, 2) == 0x1B36
    ram.gate.set()
    assert dev.wait_dma_idle(2.0)
    assert reg_read(dev, td.REG_DMA_STATUS) == td.DMA_DONE
    assert ram.ram[:64] == b"\x77" * 64 and reg_read(dev, td.REG_DMA_COUNT) == 1


# -- reset and close -------------------------------------------------------------------------

def test_reset(guest):
    dev, ram, irq = guest
    cfg_write(dev, 0x10, 4, 0xFEB0_0000)
    reg_write(dev, td.REG_SCRATCH0, 0x1234)
    reg_read(dev, td.REG_COUNTER)
    reg_write(dev, td.REG_DOORBELL, 0)
    run_dma(dev, td.DMA_OP_FILL, dst=RAM_BASE, length=16, fill=1)
    dev.region_write(2, 0, b"secret")
    dev.reset()
    assert cfg_read(dev, 0x10, 4) == 0 and cfg_read(dev, 0x04, 2) == 0
    for reg in (td.REG_SCRATCH0, td.REG_COUNTER, td.REG_ISR, td.REG_IRQ_COUNT,
                td.REG_DMA_LEN, td.REG_DMA_STATUS, td.REG_DMA_RESULT, td.REG_DMA_COUNT):
        assert reg_read(dev, reg) == 0, hex(reg)
    assert dev.region_read(2, 0, 6) == bytes(6) and dev.memory.resident_bytes == 0
    assert irq.events[-1] == ("intx", False)


def test_reset_cancels_dma_in_flight(guest):
    dev, ram, _ = guest
    ram.gate = threading.Event()
    reg_write(dev, td.REG_DMA_LEN, 1 << 20)
    reg_write(dev, td.REG_DMA_DST_HI, RAM_BASE >> 32)
    reg_write(dev, td.REG_DMA_CMD, td.DMA_OP_FILL | 0x55 << 8)
    dev.reset()                                               # also turns bus master off
    ram.gate.set()
    assert dev.close()                                        # worker drained and stopped
    assert reg_read(dev, td.REG_DMA_STATUS) == td.DMA_IDLE
    assert len(ram.calls) <= 1 and ram.ram.count(0x55) <= 64 << 10


def test_close_is_idempotent_and_worker_restarts_lazily(guest):
    dev, ram, _ = guest
    assert not dev.worker.running
    run_dma(dev, td.DMA_OP_FILL, dst=RAM_BASE, length=8, fill=2)
    assert dev.worker.running
    assert dev.close() and dev.close()
    assert not dev.worker.running
    status, _ = run_dma(dev, td.DMA_OP_FILL, dst=RAM_BASE, length=8, fill=3)
    assert status == td.DMA_DONE and ram.ram[0] == 3
