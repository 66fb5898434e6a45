"""The accelerator model against a driver-like sequence, with in-memory guest RAM
(FakeGuestRam: a unit-test stand-in for the DMA port, as in the NVMe model's tests)."""

from __future__ import annotations

import os
import random
import struct
import threading

import numpy as np
import pytest
from fakes import RAM_BASE, FakeGuestRam, PostedBlocks, RecordingIrqPort

from qemu_device import accel as ac
from qemu_device import accel_kernels as ak
from qemu_device.capabilities import CAP_ID_MSI
from qemu_device.models import create_model

CONFIG = 7
RING = RAM_BASE                 # the ring: up to 1024 entries (64 KiB)
FENCES = RAM_BASE + 0x10000     # fence and timestamp slots, 8 bytes each
SGL = RAM_BASE + 0x20000        # scatter lists
BUF = RAM_BASE + 0x100000       # data buffers (3 MiB)
MiB = 1 << 20


class CountingRam(FakeGuestRam):
    """Guest RAM that records each read_many and read_into call: on a remote port each is
    one round trip."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[tuple[int, int]]] = []

    def read_many(self, pieces):
        self.batches.append(list(pieces))
        return super().read_many(pieces)

    def read_into(self, pieces, sink):
        self.batches.append(list(pieces))
        return super().read_into(pieces, sink)


class Driver:
    """Just enough of a driver: the ring, the doorbell, fences, errors."""

    def __init__(self, dev: ac.AccelDevice, ram: CountingRam, ring_size: int = 64) -> None:
        self.dev, self.ram, self.size = dev, ram, ring_size
        self.tail = 0
        self.fence = 0
        self.base = RING

    def w32(self, off: int, value: int) -> None:
        self.dev.region_write(0, off, value.to_bytes(4, "little"))

    def r32(self, off: int) -> int:
        return int.from_bytes(self.dev.region_read(0, off, 4), "little")

    def r64(self, off: int) -> int:
        return int.from_bytes(self.dev.region_read(0, off, 8), "little")

    def enable(self, base: int = RING) -> None:
        self.w32(ac.REG_RING_BASE_LO, base & 0xFFFFFFFF)
        self.w32(ac.REG_RING_BASE_HI, base >> 32)
        self.w32(ac.REG_RING_SIZE, self.size)
        self.w32(ac.REG_CONTROL, ac.CONTROL_ENABLE)
        self.tail, self.base = 0, base

    def post(self, entry: bytes) -> int:
        """Write one entry at the tail without ringing; returns its ring index."""
        index = self.tail
        off = self.base - RAM_BASE + index * ac.ENTRY_SIZE
        self.ram.ram[off:off + ac.ENTRY_SIZE] = entry
        self.tail = (self.tail + 1) % self.size
        return index

    def post_inline(self, vram: int, data: bytes, length: int | None = None) -> int:
        """A COPY_INLINE entry and its data in the entries after it; returns its index."""
        index = self.post(ac.encode_entry(ac.OP_COPY_INLINE, vram, len(data) if length is None else length))
        padded = data + bytes(-len(data) % ac.ENTRY_SIZE)
        for at in range(0, len(padded), ac.ENTRY_SIZE):
            self.post(padded[at:at + ac.ENTRY_SIZE])
        return index

    def ring(self) -> None:
        self.w32(ac.REG_DOORBELL, self.tail)

    def run(self, *entries: bytes, fence: bool = True) -> None:
        """Post entries (+ a fence), ring once, wait until the device is idle."""
        for entry in entries:
            self.post(entry)
        if fence:
            self.fence += 1
            self.post(ac.encode_entry(ac.OP_FENCE, FENCES, self.fence))
        self.ring()
        assert self.dev.wait_idle(10)
        if fence and not self.r32(ac.REG_ERROR_CODE):
            assert self.fence_value() == self.fence

    def fence_value(self, slot: int = 0) -> int:
        return struct.unpack_from("<Q", self.ram.ram, FENCES - RAM_BASE + 8 * slot)[0]

    def put(self, addr: int, data: bytes) -> None:
        self.ram.ram[addr - RAM_BASE:addr - RAM_BASE + len(data)] = data

    def get(self, addr: int, length: int) -> bytes:
        return bytes(self.ram.ram[addr - RAM_BASE:addr - RAM_BASE + length])

    def upload(self, vram: int, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array).tobytes()
        self.put(BUF, data)
        self.run(ac.encode_entry(ac.OP_COPY_H2D, BUF, len(data), vram))

    def download(self, vram: int, shape, dtype=np.float32) -> np.ndarray:
        length = int(np.prod(shape)) * np.dtype(dtype).itemsize
        self.run(ac.encode_entry(ac.OP_COPY_D2H, BUF, length, vram))
        return np.frombuffer(self.get(BUF, length), dtype=dtype).reshape(shape)

    def error(self) -> tuple[int, int, int, int]:
        return (self.r32(ac.REG_ERROR_CODE), self.r32(ac.REG_ERROR_INDEX),
                self.r32(ac.REG_ERROR_OPCODE), self.r64(ac.REG_ERROR_INFO_LO))


def make(ring_size: int = 64, **settings):
    settings.setdefault("vram_size", 64 * MiB)
    dev = ac.AccelDevice(**settings)
    ram, irq = CountingRam(), RecordingIrqPort()
    dev.attach(ram, irq)
    dev.region_write(CONFIG, 4, (0x6).to_bytes(2, "little"))  # memory + bus master
    drv = Driver(dev, ram, ring_size)
    drv.enable()
    return drv, irq


@pytest.fixture
def drv():
    drv, _ = make()
    yield drv
    drv.ram.gate = None
    drv.dev.close()


# -- identity -------------------------------------------------------------------------

def test_identity_bars_and_interrupts():
    dev = ac.AccelDevice()
    try:
        config = dev.region_read(CONFIG, 0, 64)
        assert struct.unpack_from("<HH", config, 0) == (ac.VENDOR_ID, ac.DEVICE_ID)
        assert int.from_bytes(config[9:12], "little") == 0x120000
        bar2 = struct.unpack_from("<I", config, 0x18)[0]
        assert bar2 & 0b1110 == 0b1100          # 64-bit, prefetchable
        assert dev.regions()[2].size == 1 << 30  # 1 GiB VRAM by default ...
        assert dev.vram.resident_bytes == 0      # ... that costs nothing until written
        assert dev.irq_counts()["msi"] == 4 and dev.irq_counts()["intx"] == 1
        assert dev.capacity_bytes() == 1 << 30
        regs = {r: int.from_bytes(dev.region_read(0, r, 4), "little")
                for r in (ac.REG_ID, ac.REG_CAPS, ac.REG_ENTRY_SIZE, ac.REG_VRAM_SIZE_HI, ac.REG_MAX_RING)}
        assert regs == {ac.REG_ID: ac.ID_VALUE, ac.REG_CAPS: ac.CAPS_VALUE, ac.REG_ENTRY_SIZE: 64,
                        ac.REG_VRAM_SIZE_HI: 0, ac.REG_MAX_RING: ac.MAX_RING}
        assert int.from_bytes(dev.region_read(0, ac.REG_VRAM_SIZE_LO, 8), "little") == 1 << 30
    finally:
        dev.close()


def test_served_by_name_with_settings():
    dev = create_model("accel", vram_size=str(16 * MiB))   # --set values arrive as strings
    assert dev.regions()[2].size == 16 * MiB
    dev.close()
    with pytest.raises(ValueError, match="power of two"):
        create_model("accel", vram_size=3 * MiB)
    with pytest.raises(ValueError, match="unknown accel backend"):
        create_model("accel", backend="tpu")


def test_vram_bar_is_guest_memory(drv):
    drv.dev.region_write(2, 0x1234, b"hello")
    assert drv.dev.region_read(2, 0x1234, 5) == b"hello"
    assert drv.download(0x1234, (5,), np.uint8).tobytes() == b"hello"


# -- copies, fill, fences -------------------------------------------------------------

def test_copy_host_to_vram_and_back(drv):
    data = os.urandom(MiB + 123)
    drv.put(BUF, data)
    drv.run(ac.encode_entry(ac.OP_COPY_H2D, BUF, len(data), 3 * MiB + 7))
    assert drv.dev.region_read(2, 3 * MiB + 7, len(data)) == data
    drv.put(BUF, bytes(len(data)))
    drv.run(ac.encode_entry(ac.OP_COPY_D2H, BUF, len(data), 3 * MiB + 7))
    assert drv.get(BUF, len(data)) == data
    stats = drv.dev.stats()
    assert stats["h2d_bytes"] == stats["d2h_bytes"] == len(data)


def test_copies_with_scatter_lists(drv):
    pieces = [(BUF + 0x3000 + 5, 1000), (BUF + 0x1000, 4096), (BUF + 0x20000 + 1, 70000)]
    chunks = [os.urandom(n) for _, n in pieces]
    for (addr, _), chunk in zip(pieces, chunks):
        drv.put(addr, chunk)
    drv.put(SGL, b"".join(struct.pack("<QQ", a, n) for a, n in pieces))
    drv.run(ac.encode_entry(ac.OP_COPY_H2D, SGL, len(pieces), 0x100, flags=ac.FLAG_SG))
    assert drv.dev.region_read(2, 0x100, sum(n for _, n in pieces)) == b"".join(chunks)
    # and back, into a different gather of buffers
    total = sum(n for _, n in pieces)
    out = [(BUF + 0x40000, 2000), (BUF + 0x50000, total - 2000)]
    drv.put(SGL, b"".join(struct.pack("<QQ", a, n) for a, n in out))
    drv.run(ac.encode_entry(ac.OP_COPY_D2H, SGL, len(out), 0x100, flags=ac.FLAG_SG))
    assert drv.get(out[0][0], out[0][1]) + drv.get(out[1][0], out[1][1]) == b"".join(chunks)


def test_copy_back_of_vram_never_written_is_zeros_cut_at_the_guest_pieces(drv):
    """VRAM pages never written go back as zeros, written ones as they are, each guest
    piece getting exactly its bytes where pieces and VRAM pages end in different places."""
    drv.dev.region_write(2, 0x10000 - 10, b"\x5a" * 20)          # across a 64 KiB page boundary
    pieces = [(BUF + 0x8000 + 3, 0x10000 - 0x8000 - 3 - 12), (BUF + 0x30000, 100), (BUF + 0x50000, 0x20000)]
    total = sum(n for _, n in pieces)
    for addr, n in pieces:
        drv.put(addr, b"\xee" * n)
    drv.put(SGL, b"".join(struct.pack("<QQ", a, n) for a, n in pieces))
    drv.run(ac.encode_entry(ac.OP_COPY_D2H, SGL, len(pieces), 0x8000 + 3, flags=ac.FLAG_SG))
    got = b"".join(drv.get(a, n) for a, n in pieces)
    assert got == drv.dev.region_read(2, 0x8000 + 3, total) and got.count(b"\x5a") == 20
    assert got.index(b"\x5a") == 0x10000 - 10 - 0x8000 - 3


def test_large_copy_goes_in_batches(drv, monkeypatch):
    monkeypatch.setattr(ac, "COPY_BATCH", 256 << 10)
    data = os.urandom(MiB + 1000)
    drv.put(BUF, data)
    drv.ram.batches.clear()
    drv.run(ac.encode_entry(ac.OP_COPY_H2D, BUF, len(data), 0), fence=False)
    copy_batches = drv.ram.batches[1:]    # the first read fetched the ring
    assert len(copy_batches) == 5 and sum(n for b in copy_batches for _, n in b) == len(data)
    assert drv.dev.region_read(2, 0, len(data)) == data
    stats = drv.dev.stats()               # what the performance model counts: one wait per batch
    assert stats["copy_reads"] == 5 and stats["fetches"] == 1 and stats["copy_writes"] == 0
    assert 0 < stats["fetch_ns"] < stats["dma_ns"]


def test_vram_to_vram_and_fill(drv):
    drv.dev.region_write(2, 0, b"abcdefgh" * 512)
    drv.run(ac.encode_entry(ac.OP_COPY_D2D, 0, 10 * MiB + 1, 4096),
            ac.encode_entry(ac.OP_FILL, 20 * MiB, 4099, 0x44332211))
    assert drv.dev.region_read(2, 10 * MiB + 1, 4096) == b"abcdefgh" * 512
    assert drv.dev.region_read(2, 20 * MiB, 4099) == (b"\x11\x22\x33\x44" * 1025)[:4099]
    assert drv.dev.region_read(2, 20 * MiB + 4099, 1) == b"\0"


def test_fence_interrupt_and_masking(drv):
    irq = drv.dev.irq
    drv.run(ac.encode_entry(ac.OP_FENCE, FENCES + 8, 0xDEADBEEF_0000_0001, flags=ac.FLAG_INTERRUPT), fence=False)
    assert drv.fence_value(1) == 0xDEADBEEF_0000_0001
    assert drv.r64(ac.REG_FENCE_LO) == 0xDEADBEEF_0000_0001
    assert drv.r32(ac.REG_IRQ_CAUSE) == ac.CAUSE_COMPLETION
    assert irq.take() == [("intx", True)]                   # MSI is off: INTx
    drv.w32(ac.REG_IRQ_CAUSE, ac.CAUSE_COMPLETION)          # W1C drops the line
    assert irq.take() == [("intx", False)] and drv.r32(ac.REG_IRQ_CAUSE) == 0
    drv.w32(ac.REG_IRQ_MASK, ac.CAUSE_COMPLETION)
    drv.run(ac.encode_entry(ac.OP_NOP, flags=ac.FLAG_INTERRUPT))
    assert irq.take() == [] and drv.r32(ac.REG_IRQ_CAUSE) == ac.CAUSE_COMPLETION  # noted, not raised
    drv.w32(ac.REG_IRQ_CAUSE, ac.CAUSE_COMPLETION)
    drv.run(ac.encode_entry(ac.OP_NOP))
    assert irq.take() == []                                  # no interrupt unless the entry asks


def test_msi_vector_chosen_by_the_entry(drv):
    msi = drv.dev.caps.offsets[CAP_ID_MSI]
    drv.dev.region_write(CONFIG, msi + 2, ((2 << 4) | 1).to_bytes(2, "little"))   # 4 vectors
    drv.run(ac.encode_entry(ac.OP_NOP, flags=ac.FLAG_INTERRUPT, vector=2),
            ac.encode_entry(ac.OP_NOP, flags=ac.FLAG_INTERRUPT, vector=1))
    assert drv.dev.irq.take() == [("msi", 2), ("msi", 1)]


def test_timestamps_are_device_nanoseconds(drv):
    drv.run(ac.encode_entry(ac.OP_TIMESTAMP, FENCES + 8),
            ac.encode_entry(ac.OP_GEMM, 0, 0, 0, 64, 64, 64),
            ac.encode_entry(ac.OP_TIMESTAMP, FENCES + 16))
    t1, t2 = drv.fence_value(1), drv.fence_value(2)
    assert 0 < t1 < t2 <= drv.dev.device_time_ns()
    lo = drv.r32(ac.REG_TIME_LO)
    assert (drv.r32(ac.REG_TIME_HI) << 32 | lo) >= t2


# -- the ring -------------------------------------------------------------------------

def test_many_commands_per_doorbell_fetched_in_one_read(drv):
    drv.ram.batches.clear()
    for i in range(40):
        drv.post(ac.encode_entry(ac.OP_FENCE, FENCES + 8 * (i % 8), i))
    drv.ring()
    assert drv.dev.wait_idle(10)
    assert len(drv.ram.batches) == 1 and drv.ram.batches[0] == [(RING, 40 * ac.ENTRY_SIZE)]
    assert drv.r32(ac.REG_RING_HEAD) == 40 and drv.r64(ac.REG_COMPLETED_LO) == 40
    assert [drv.fence_value(s) for s in range(8)] == [32, 33, 34, 35, 36, 37, 38, 39]


def test_ring_wraps_and_a_batch_across_the_end_is_one_read():
    drv, _ = make(ring_size=8)
    try:
        for round_ in range(5):
            drv.ram.batches.clear()
            for i in range(5):
                drv.post(ac.encode_entry(ac.OP_FENCE, FENCES + 8 * i, 100 * round_ + i))
            drv.ring()
            assert drv.dev.wait_idle(10)
            assert [drv.fence_value(i) for i in range(5)] == [100 * round_ + i for i in range(5)]
            assert len(drv.ram.batches) == 1
            assert sum(n for _, n in drv.ram.batches[0]) == 5 * ac.ENTRY_SIZE
        assert drv.r32(ac.REG_RING_HEAD) == 25 % 8 and drv.dev.stats()["completed"] == 25
    finally:
        drv.dev.close()


def test_a_wrapping_batch_is_two_pieces_of_one_read_many():
    drv, _ = make(ring_size=8)
    try:
        drv.run(*[ac.encode_entry(ac.OP_NOP)] * 5)          # head at 6 (5 + the fence)
        drv.ram.batches.clear()
        drv.run(*[ac.encode_entry(ac.OP_NOP)] * 4)          # entries 6, 7, 0, 1, fence at 2
        assert drv.ram.batches == [[(RING + 6 * 64, 2 * 64), (RING, 3 * 64)]]
    finally:
        drv.dev.close()


def make_big_ring() -> Driver:
    """A 32768-entry ring (2 MiB, at BUF: past the fences and lists): more than two fetches."""
    drv, _ = make(ring_size=32768)
    drv.w32(ac.REG_CONTROL, ac.CONTROL_RESET)
    drv.enable(BUF)
    return drv


class NetworkRam(CountingRam):
    """Guest RAM that says its reads wait on a network, as the box's port does, and records
    which thread began each read."""

    reads_wait_on_network = True

    def __init__(self) -> None:
        super().__init__()
        self.begun: list[tuple[str, list[tuple[int, int]]]] = []

    def read_many_begin(self, pieces):
        self.begun.append((threading.current_thread().name, list(pieces)))
        return lambda: self.read_many(pieces)


def test_on_a_network_the_doorbell_begins_the_ring_fetch():
    """The fetch's requests leave from the thread that wrote the doorbell (the box's link
    reader), not from the worker after its wake-up; the worker finishes that same read."""
    drv, _ = make()
    try:
        drv.dev.dma = drv.ram = NetworkRam()
        drv.post(ac.encode_entry(ac.OP_FILL, 0, 64, 0x01010101))
        drv.run()                                               # the fill + the fence: one doorbell
        assert drv.ram.begun == [(threading.current_thread().name, [(RING, 2 * ac.ENTRY_SIZE)])]
        assert drv.ram.batches == [[(RING, 2 * ac.ENTRY_SIZE)]] and drv.dev.stats()["fetches"] == 1
        assert drv.dev.region_read(2, 0, 64) == b"\x01" * 64
    finally:
        drv.dev.close()


def test_more_entries_than_one_fetch():
    drv = make_big_ring()
    try:
        drv.run(*[ac.encode_entry(ac.OP_NOP)] * (2 * ac.MAX_FETCH + 99))
        assert drv.dev.stats()["fetches"] == 3 and drv.dev.stats()["completed"] == 2 * ac.MAX_FETCH + 100
    finally:
        drv.dev.close()


# -- kernels --------------------------------------------------------------------------

A, B, C, D = (n * MiB for n in (1, 2, 3, 4))
RNG = np.random.default_rng(16)


def rand(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def test_gemm_fp32(drv):
    a, b = rand(33, 70), rand(70, 17)
    drv.upload(A, a)
    drv.upload(B, b)
    drv.run(ac.encode_entry(ac.OP_GEMM, A, B, C, 33, 17, 70))
    np.testing.assert_allclose(drv.download(C, (33, 17)), a @ b, rtol=1e-5, atol=1e-5)


def test_gemm_transposes_and_accumulate(drv):
    a_t, b_t, c0 = rand(70, 33), rand(17, 70), rand(33, 17)
    drv.upload(A, a_t)
    drv.upload(B, b_t)
    drv.upload(C, c0)
    drv.run(ac.encode_entry(ac.OP_GEMM, A, B, C, 33, 17, 70,
                            flags=ac.FLAG_TRANS_A | ac.FLAG_TRANS_B | ac.FLAG_ACCUMULATE))
    np.testing.assert_allclose(drv.download(C, (33, 17)), c0 + a_t.T @ b_t.T, rtol=1e-5, atol=1e-5)


def test_gemm_bf16(drv):
    a, b = rand(16, 32), rand(32, 8)
    drv.upload(A, ak.to_bf16(a))
    drv.upload(B, ak.to_bf16(b))
    drv.run(ac.encode_entry(ac.OP_GEMM, A, B, C, 16, 8, 32, dtype=ac.DTYPE_BF16))
    got = ak.from_bf16(drv.download(C, (16, 8), np.uint16))
    want = ak.from_bf16(ak.to_bf16(a)) @ ak.from_bf16(ak.to_bf16(b))
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)


def _gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _softmax(x):
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _layer_norm(x, g=None, b=None, eps=1e-5):
    y = (x - x.mean(axis=1, keepdims=True)) / np.sqrt(x.var(axis=1, keepdims=True) + eps)
    return y if g is None else y * g + b


ELEMENTWISE = {
    ac.OP_ADD: lambda x, y: x + y,
    ac.OP_MUL: lambda x, y: x * y,
    ac.OP_RELU_GRAD: lambda x, y: np.where(x > 0, y, 0),
}


@pytest.mark.parametrize("op", sorted(ELEMENTWISE))
def test_binary_kernels(drv, op):
    x, y = rand(1000), rand(1000)
    drv.upload(A, x)
    drv.upload(B, y)
    drv.run(ac.encode_entry(op, A, B, C, 1000))
    np.testing.assert_allclose(drv.download(C, (1000,)), ELEMENTWISE[op](x, y), rtol=1e-6)


def test_axpy_is_an_sgd_update(drv):
    w, g = rand(500), rand(500)
    drv.upload(A, w)
    drv.upload(B, g)
    drv.run(ac.encode_entry(ac.OP_AXPY, A, B, A, 500, ac.f32_bits(-0.01)))
    np.testing.assert_allclose(drv.download(A, (500,)), w - 0.01 * g, rtol=1e-6)


@pytest.mark.parametrize("op,reference", [(ac.OP_RELU, lambda x: np.maximum(x, 0)), (ac.OP_GELU, _gelu)])
def test_activations(drv, op, reference):
    x = rand(4096) * 4
    drv.upload(A, x)
    drv.run(ac.encode_entry(op, A, 0, B, 4096))
    np.testing.assert_allclose(drv.download(B, (4096,)), reference(x), rtol=1e-5, atol=1e-6)


def test_bias_add_softmax_and_sum_rows(drv):
    x, bias = rand(12, 40), rand(40)
    drv.upload(A, x)
    drv.upload(B, bias)
    drv.run(ac.encode_entry(ac.OP_BIAS_ADD, A, B, C, 12, 40),
            ac.encode_entry(ac.OP_SOFTMAX, C, 0, D, 12, 40),
            ac.encode_entry(ac.OP_SUM_ROWS, A, 0, C, 12, 40))
    np.testing.assert_allclose(drv.download(D, (12, 40)), _softmax(x + bias), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(drv.download(C, (40,)), x.sum(axis=0), rtol=1e-5, atol=1e-5)


def test_softmax_of_large_values_stays_finite(drv):
    x = rand(4, 16) * 1000
    drv.upload(A, x)
    drv.run(ac.encode_entry(ac.OP_SOFTMAX, A, 0, B, 4, 16))
    got = drv.download(B, (4, 16))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got.sum(axis=1), 1, rtol=1e-5)


def test_layer_norm_plain_and_affine(drv):
    x, g, b = rand(8, 64) * 3 + 1, rand(64), rand(64)
    drv.upload(A, x)
    drv.upload(B, g)
    drv.upload(D, b)
    drv.run(ac.encode_entry(ac.OP_LAYER_NORM, A, 0, C, 8, 64))
    np.testing.assert_allclose(drv.download(C, (8, 64)), _layer_norm(x), rtol=1e-4, atol=1e-5)
    drv.run(ac.encode_entry(ac.OP_LAYER_NORM, A, B, C, 8, 64, D, ac.f32_bits(1e-3), flags=ac.FLAG_AFFINE))
    np.testing.assert_allclose(drv.download(C, (8, 64)), _layer_norm(x, g, b, 1e-3), rtol=1e-4, atol=1e-5)


def test_kernel_time_is_counted(drv):
    drv.run(ac.encode_entry(ac.OP_GEMM, 0, 0, 0, 128, 128, 128))
    stats = drv.dev.stats()
    assert stats["kernel_ns"] > 0 and stats["opcodes"]["0x10"] == 1


# -- errors ---------------------------------------------------------------------------

def test_inline_copy_comes_with_the_ring_fetch(drv):
    """COPY_INLINE: the bytes are in the ring, so the doorbell's one fetch is all the DMA."""
    data = bytes(range(256)) * 3 + b"odd tail"                  # 776 bytes: 13 entries, the last padded
    drv.ram.batches.clear()
    index = drv.post_inline(4096, data)
    after = drv.post(ac.encode_entry(ac.OP_FENCE, FENCES + 8, 7))
    drv.run()
    assert after == index + 1 + 13
    assert drv.dev.region_read(2, 4096, len(data)) == data
    assert drv.dev.region_read(2, 4096 + len(data), 8) == bytes(8)   # the padding stays out of VRAM
    assert drv.ram.batches == [[(RING, (1 + 13 + 1 + 1) * ac.ENTRY_SIZE)]]
    stats = drv.dev.stats()
    assert stats["copy_reads"] == 0 and stats["inline_bytes"] == len(data) and stats["completed"] == 3
    assert drv.fence_value(1) == 7 and drv.r32(ac.REG_RING_HEAD) == after + 2


def test_inline_data_may_wrap_the_ring():
    drv, _ = make(ring_size=16)
    try:
        drv.run(*[ac.encode_entry(ac.OP_NOP)] * 9)              # head at 10
        data = np.arange(96, dtype=np.uint8).tobytes() * 4     # 384 bytes: 6 entries, 10..15 and 0
        drv.post_inline(0, data)
        drv.run()
        assert drv.dev.region_read(2, 0, len(data)) == data and drv.error()[0] == 0
    finally:
        drv.dev.close()


def test_inline_copy_whose_data_is_past_one_fetch_is_fetched_again():
    drv = make_big_ring()
    try:
        data = np.random.default_rng(3).bytes(ac.MAX_INLINE)
        for _ in range(ac.MAX_FETCH - 10):
            drv.post(ac.encode_entry(ac.OP_NOP))
        drv.post_inline(1 << 20, data)                          # its data runs past the first fetch
        drv.run()
        assert drv.dev.region_read(2, 1 << 20, len(data)) == data and drv.error()[0] == 0
        assert drv.dev.stats()["fetches"] == 2 and drv.dev.stats()["completed"] == ac.MAX_FETCH - 10 + 2
    finally:
        drv.dev.close()


@pytest.mark.parametrize("length", [0, ac.MAX_INLINE + 1])
def test_inline_copy_of_a_bad_length_is_refused(drv, length):
    index = drv.post_inline(0, b"", length)
    drv.ring()
    assert drv.dev.wait_idle(10)
    assert drv.error()[:3] == (ac.ERR_BAD_INLINE, index, ac.OP_COPY_INLINE)
    drv.w32(ac.REG_ERROR_CLEAR, 1)                              # skips the one entry
    drv.run()
    assert drv.error()[0] == 0


def test_inline_copy_outside_vram_is_skipped_with_its_data(drv):
    """ERROR_CLEAR skips the refused copy and its data: the data is never run as commands."""
    index = drv.post_inline(64 * MiB - 8, encode_nonsense := ac.encode_entry(0x7E) * 2)
    drv.ring()
    assert drv.dev.wait_idle(10)
    assert drv.error()[:3] == (ac.ERR_VRAM_RANGE, index, ac.OP_COPY_INLINE)
    drv.w32(ac.REG_ERROR_CLEAR, 1)
    drv.run()
    assert drv.error()[0] == 0 and drv.r32(ac.REG_RING_HEAD) == index + 1 + len(encode_nonsense) // 64 + 1


def test_doorbell_inside_inline_data_is_refused(drv):
    index = drv.post_inline(0, bytes(640))                      # 1 + 10 entries
    drv.w32(ac.REG_DOORBELL, index + 5)                         # rings half of the data
    assert drv.dev.wait_idle(10)
    assert drv.error()[:3] == (ac.ERR_BAD_INLINE, index, ac.OP_COPY_INLINE)
    drv.dev.region_write(0, ac.REG_CONTROL, ac.CONTROL_RESET.to_bytes(4, "little"))
    drv.enable()
    drv.run(ac.encode_entry(ac.OP_NOP))
    assert drv.error()[0] == 0


def test_unknown_opcode_stops_the_ring_until_cleared(drv):
    irq = drv.dev.irq
    drv.post(ac.encode_entry(ac.OP_FENCE, FENCES, 1))
    bad = drv.post(ac.encode_entry(0x7E))
    drv.post(ac.encode_entry(ac.OP_FENCE, FENCES, 2))
    drv.ring()
    assert drv.dev.wait_idle(10)
    assert drv.error() == (ac.ERR_BAD_OPCODE, bad, 0x7E, 0x7E)
    assert drv.r32(ac.REG_STATUS) & ac.STATUS_ERROR and drv.r32(ac.REG_RING_HEAD) == bad
    assert drv.fence_value() == 1                                # nothing after it ran
    assert drv.r32(ac.REG_IRQ_CAUSE) == ac.CAUSE_ERROR and irq.take() == [("intx", True)]
    drv.w32(ac.REG_ERROR_CLEAR, 1)                               # skip it and go on
    assert drv.dev.wait_idle(10)
    assert drv.error()[0] == 0 and drv.fence_value() == 2 and drv.r32(ac.REG_RING_HEAD) == 3
    assert irq.take() == [("intx", False)]


BAD_COMMANDS = {
    "vram range": (ac.encode_entry(ac.OP_COPY_D2D, 0, 64 * MiB - 10, 11), ac.ERR_VRAM_RANGE),
    "copy past vram": (ac.encode_entry(ac.OP_COPY_H2D, BUF, 4096, 64 * MiB - 4095), ac.ERR_VRAM_RANGE),
    "fill huge": (ac.encode_entry(ac.OP_FILL, 0, 1 << 63, 0), ac.ERR_VRAM_RANGE),
    "negative-looking offset": (ac.encode_entry(ac.OP_RELU, (1 << 64) - 8, 0, 0, 4), ac.ERR_VRAM_RANGE),
    "gemm overflow": (ac.encode_entry(ac.OP_GEMM, 0, 0, 0, 1 << 24, 1 << 24, 1 << 24), ac.ERR_VRAM_RANGE),
    "gemm dimension": (ac.encode_entry(ac.OP_GEMM, 0, 0, 0, 1 << 40, 1, 1), ac.ERR_BAD_SHAPE),
    "zero shape": (ac.encode_entry(ac.OP_SOFTMAX, 0, 0, 0, 0, 4), ac.ERR_BAD_SHAPE),
    "dtype": (ac.encode_entry(ac.OP_ADD, 0, 0, 0, 4, dtype=9), ac.ERR_BAD_DTYPE),
    "fence outside guest memory": (ac.encode_entry(ac.OP_FENCE, 0x1000, 1), ac.ERR_DMA_FAULT),
    "copy from outside guest memory": (ac.encode_entry(ac.OP_COPY_H2D, RAM_BASE - 4096, 8192, 0), ac.ERR_DMA_FAULT),
    "scatter list outside": (ac.encode_entry(ac.OP_COPY_H2D, 0x10, 2, 0, flags=ac.FLAG_SG), ac.ERR_DMA_FAULT),
    "scatter list too long": (ac.encode_entry(ac.OP_COPY_H2D, SGL, ac.MAX_SG + 1, 0, flags=ac.FLAG_SG), ac.ERR_BAD_SG),
    "empty copy": (ac.encode_entry(ac.OP_COPY_D2H, BUF, 0, 0), ac.ERR_BAD_SG),
    "layer norm eps": (ac.encode_entry(ac.OP_LAYER_NORM, 0, 0, 0, 2, 2, 0, ac.f32_bits(-1.0)), ac.ERR_BAD_SHAPE),
}


@pytest.mark.parametrize("name", sorted(BAD_COMMANDS))
def test_bad_commands_set_the_error_state_and_never_crash(drv, name):
    entry, code = BAD_COMMANDS[name]
    drv.dev.region_write(2, 0, b"\x01" * 16)
    index = drv.post(entry)
    drv.ring()
    assert drv.dev.wait_idle(10)
    assert drv.error()[:3] == (code, index, entry[0])
    drv.w32(ac.REG_ERROR_CLEAR, 1)
    drv.run(ac.encode_entry(ac.OP_RELU, 0, 0, 64, 4))           # the device works on
    assert drv.error()[0] == 0 and drv.dev.region_read(2, 64, 16) == b"\x01" * 16
    assert drv.dev.stats()["errors"] == 1


def test_zeroed_sg_entry_is_refused(drv):
    drv.put(SGL, struct.pack("<QQQQ", BUF, 16, BUF + 64, 0))
    drv.run(ac.encode_entry(ac.OP_COPY_H2D, SGL, 2, 0, flags=ac.FLAG_SG), fence=False)
    assert drv.error()[0] == ac.ERR_BAD_SG


def test_bad_ring_and_doorbell():
    dev = ac.AccelDevice(vram_size=1 << 16)
    drv = Driver(dev, CountingRam(), ring_size=12)              # not a power of two
    dev.attach(drv.ram, RecordingIrqPort())
    dev.region_write(CONFIG, 4, (0x6).to_bytes(2, "little"))
    drv.enable()
    assert drv.error()[0] == ac.ERR_BAD_RING and not drv.r32(ac.REG_STATUS) & ac.STATUS_ENABLED
    drv.w32(ac.REG_ERROR_CLEAR, 1)
    drv.size = 16
    drv.enable(RING + 8)                                        # not entry aligned
    assert drv.error()[0] == ac.ERR_BAD_RING
    drv.w32(ac.REG_ERROR_CLEAR, 1)
    drv.enable()
    assert drv.r32(ac.REG_STATUS) == ac.STATUS_ENABLED
    drv.w32(ac.REG_RING_SIZE, 4)                                # fixed while enabled
    assert drv.r32(ac.REG_RING_SIZE) == 16
    drv.w32(ac.REG_DOORBELL, 16)
    assert drv.error()[0] == ac.ERR_BAD_DOORBELL
    drv.w32(ac.REG_ERROR_CLEAR, 1)
    drv.run(ac.encode_entry(ac.OP_NOP))
    assert drv.r32(ac.REG_RING_HEAD) == 2
    dev.close()


def test_ring_outside_guest_memory_is_a_dma_fault():
    drv, _ = make()
    try:
        drv.w32(ac.REG_CONTROL, 0)
        drv.enable(base=0x40000)
        drv.w32(ac.REG_DOORBELL, 1)
        assert drv.dev.wait_idle(10)
        assert drv.error()[0] == ac.ERR_DMA_FAULT and drv.error()[3] == 0x40000
    finally:
        drv.dev.close()


def test_bus_master_off_is_a_dma_fault(drv):
    drv.dev.region_write(CONFIG, 4, (0x2).to_bytes(2, "little"))
    drv.w32(ac.REG_DOORBELL, 1)
    assert drv.dev.wait_idle(10) and drv.error()[0] == ac.ERR_DMA_FAULT


def test_random_entries_never_crash_the_device(drv):
    rng = random.Random(16)
    entries = []
    for _ in range(300):
        raw = bytearray(rng.randbytes(64))
        raw[0] = rng.choice(sorted(ac.OPCODES) + [0x55, 0xFF])
        for i in range(8, 64, 8):   # mostly small numbers, so some commands are valid
            if rng.random() < 0.7:
                raw[i:i + 8] = rng.randrange(0, 1 << 21).to_bytes(8, "little")
        raw[3] = rng.choice([0, 0, 1, 7])
        entries.append(bytes(raw))
    for entry in entries:
        drv.post(entry)
        if drv.tail % 16 == 0:
            drv.ring()
            assert drv.dev.wait_idle(30)
            while drv.r32(ac.REG_ERROR_CODE):
                drv.w32(ac.REG_ERROR_CLEAR, 1)
                assert drv.dev.wait_idle(30)
    assert drv.dev.worker.running
    stats = drv.dev.stats()
    assert sum(e[0] == ac.OP_COPY_INLINE for e in entries) > 5      # inline copies eating entries as data
    assert stats["errors"] > 50 and stats["completed"] > 30   # both refused and run commands (inline copies too)
    drv.dev.reset()
    drv.dev.region_write(CONFIG, 4, (0x6).to_bytes(2, "little"))
    drv.enable()
    drv.run(ac.encode_entry(ac.OP_NOP))
    assert drv.error()[0] == 0


# -- reset ----------------------------------------------------------------------------

def test_reset_clears_everything_and_the_device_works_again(drv):
    drv.upload(A, rand(64))
    drv.post(ac.encode_entry(0x7E))
    drv.ring()
    assert drv.dev.wait_idle(10) and drv.error()[0] == ac.ERR_BAD_OPCODE
    drv.dev.reset()                                              # FLR, or a new lease
    assert drv.dev.vram.resident_bytes == 0
    assert (drv.r32(ac.REG_STATUS), drv.error()[0], drv.r32(ac.REG_RING_HEAD)) == (0, 0, 0)
    drv.dev.region_write(CONFIG, 4, (0x6).to_bytes(2, "little"))
    drv.enable()
    x = rand(64)
    drv.upload(A, x)
    drv.run(ac.encode_entry(ac.OP_RELU, A, 0, B, 64))
    np.testing.assert_array_equal(drv.download(B, (64,)), np.maximum(x, 0))


def test_engine_reset_keeps_vram(drv):
    drv.dev.region_write(2, 0, b"kept")
    drv.post(ac.encode_entry(0x7E))
    drv.ring()
    assert drv.dev.wait_idle(10)
    drv.w32(ac.REG_CONTROL, ac.CONTROL_RESET)
    assert drv.error()[0] == 0 and drv.r32(ac.REG_STATUS) == 0
    assert drv.dev.region_read(2, 0, 4) == b"kept"
    drv.enable()
    drv.run(ac.encode_entry(ac.OP_NOP))


def test_reset_during_a_copy_drops_its_result(drv):
    data = os.urandom(64 << 10)
    drv.put(BUF, data)
    drv.run(ac.encode_entry(ac.OP_NOP))
    reached, release = threading.Event(), threading.Event()
    read_into = drv.ram.read_into

    def slow_read_into(pieces, sink):  # the copy's DMA waits: a slow round trip
        if pieces[0][0] == BUF:
            reached.set()
            release.wait(5)
        return read_into(pieces, sink)

    drv.ram.read_into = slow_read_into
    drv.post(ac.encode_entry(ac.OP_COPY_H2D, BUF, len(data), 0))
    drv.ring()
    assert reached.wait(5)
    drv.dev.reset()                     # while the copy is in flight
    release.set()
    assert drv.dev.close(5)
    assert drv.dev.vram.resident_bytes == 0 and drv.dev.stats()["completed"] == 0


# -- backends -------------------------------------------------------------------------

def test_numpy_backend_through_the_interface():
    backend = ak.get_backend("numpy")
    x = rand(5, 7)
    assert backend.name == "numpy"
    np.testing.assert_allclose(backend.layer_norm(x, None, None, 1e-5), _layer_norm(x), rtol=1e-5, atol=1e-6)
    assert backend.gemm(x, x.T).dtype == np.float32


def test_bf16_round_trip():
    x = np.array([1.0, -2.5, 3.140625, 1e-3, np.inf, np.nan], dtype=np.float32)
    back = ak.from_bf16(ak.to_bf16(x))
    np.testing.assert_array_equal(back[:3], x[:3])          # exactly representable
    assert abs(back[3] - 1e-3) < 1e-5 and back[4] == np.inf and np.isnan(back[5])
    assert ak.to_bf16(np.array([1.00390625], dtype=np.float32))[0] == 0x3F80   # ties to even


def test_blas_threads_are_limited_where_numpy_uses_openblas():
    with open("/proc/self/maps") as maps:
        openblas = any("openblas" in line.lower() for line in maps)
    assert ak.limit_blas_threads(1) is openblas
    with pytest.raises(ValueError, match="threads"):
        ac.AccelDevice(vram_size=1 << 16, threads=0)


def test_disabling_stops_the_ring_after_the_running_entry(drv):
    reached, release = threading.Event(), threading.Event()
    write = drv.ram.write

    def slow_write(addr, data):          # the first fence's DMA waits
        if addr == FENCES:
            reached.set()
            release.wait(5)
        write(addr, data)

    drv.ram.write = slow_write
    drv.post(ac.encode_entry(ac.OP_FENCE, FENCES, 1))
    drv.post(ac.encode_entry(ac.OP_FENCE, FENCES + 8, 2))
    drv.ring()
    assert reached.wait(5)
    drv.w32(ac.REG_CONTROL, 0)
    release.set()
    assert drv.dev.wait_idle(5)
    assert drv.r32(ac.REG_RING_HEAD) == 1 and drv.fence_value(1) == 0 and drv.r32(ac.REG_STATUS) == 0


def test_operand_buffers_are_kept_from_one_entry_to_the_next():
    """The operands of one entry get buffers of their own; the next entry reuses them
    (no fresh multi-megabyte buffer, with its page faults, per operand)."""
    buffers = ac.OperandBuffers()
    a, b = buffers.take(4 * MiB), buffers.take(1000)
    assert a.size == 4 * MiB and b.size == 1000 and not np.shares_memory(a, b)
    buffers.release()
    again = buffers.take(2 * MiB)
    assert np.shares_memory(again, a) and again.size == 2 * MiB
    bigger = buffers.take(3000)                           # the second slot grows
    assert bigger.size == 3000 and not np.shares_memory(bigger, again)


def test_a_gemm_that_accumulates_loads_three_operands_apart(drv):
    """A, B and the C it adds to are loaded into three buffers within one entry; entry
    after entry, the results stay right while the buffers are reused."""
    for step in range(3):
        a, b, c0 = rand(48, 64), rand(64, 32), rand(48, 32)
        drv.upload(A, a)
        drv.upload(B, b)
        drv.upload(C, c0)
        drv.run(ac.encode_entry(ac.OP_GEMM, A, B, C, 48, 32, 64, flags=ac.FLAG_ACCUMULATE),
                ac.encode_entry(ac.OP_COPY_D2D, C, D, 48 * 32 * 4))   # D2D: through a buffer too
        np.testing.assert_allclose(drv.download(D, (48, 32)), c0 + a @ b, rtol=1e-5, atol=1e-5)


class GatheringRam(PostedBlocks, CountingRam):
    """Guest RAM that logs posted-together blocks (tests/fakes.py)."""


def test_a_copy_back_and_its_fence_leave_together_and_a_kernel_ends_the_run():
    """On a box a block is one write to the network: the copy back's bytes and the fence
    after it go together, but writes before a kernel leave before it computes."""
    dev = ac.AccelDevice(vram_size=64 * MiB)
    ram = GatheringRam()
    dev.attach(ram, RecordingIrqPort())
    dev.region_write(CONFIG, 4, (0x6).to_bytes(2, "little"))
    drv = Driver(dev, ram)
    drv.enable()
    try:
        ram.log.clear()
        drv.run(ac.encode_entry(ac.OP_COPY_D2H, BUF, 4096, 0))
        assert ram.log == ["begin", "write", "write", "end"]
        ram.log.clear()
        drv.run(ac.encode_entry(ac.OP_COPY_D2H, BUF, 4096, 0),
                ac.encode_entry(ac.OP_GEMM, 0, 4096, 8192, 8, 8, 8),
                ac.encode_entry(ac.OP_COPY_D2H, BUF, 256, 8192))
        assert ram.log == ["begin", "write", "end", "begin", "write", "write", "end"]
        assert not drv.r32(ac.REG_ERROR_CODE)
    finally:
        dev.close()


def test_a_timestamp_waits_across_a_kernel_for_the_copy_back_but_an_interrupt_does_not():
    """A driver reads timestamps only after a fence, so a pass's first timestamp may stay in
    the run through its kernels and leave with the copy back and fence (one write on a box,
    not two); a kernel that asks for an interrupt ends the run first, and its interrupt is
    not held behind the next kernel."""
    dev = ac.AccelDevice(vram_size=64 * MiB)
    ram = GatheringRam()
    irqs = RecordingIrqPort()
    dev.attach(ram, irqs)
    dev.region_write(CONFIG, 4, (0x6).to_bytes(2, "little"))
    drv = Driver(dev, ram)
    drv.enable()
    try:
        ram.log.clear()
        drv.run(ac.encode_entry(ac.OP_TIMESTAMP, FENCES + 8),
                ac.encode_entry(ac.OP_GEMM, 0, 4096, 8192, 8, 8, 8),
                ac.encode_entry(ac.OP_COPY_D2H, BUF, 256, 8192),
                ac.encode_entry(ac.OP_TIMESTAMP, FENCES + 16))
        assert ram.log == ["begin", "write", "write", "write", "write", "end"]
        ram.log.clear()
        drv.run(ac.encode_entry(ac.OP_TIMESTAMP, FENCES + 8),
                ac.encode_entry(ac.OP_GEMM, 0, 4096, 8192, 8, 8, 8, flags=ac.FLAG_INTERRUPT),
                ac.encode_entry(ac.OP_GEMM, 0, 4096, 8192, 8, 8, 8))
        assert ram.log == ["begin", "write", "end", "begin", "write", "end"]
        assert not drv.r32(ac.REG_ERROR_CODE)
    finally:
        dev.close()
