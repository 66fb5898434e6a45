"""The NVMe controller model against a driver-like sequence, with in-memory guest RAM
(FakeGuestRam: a unit-test stand-in; the real path is tested with Linux's nvme driver
in tests/test_nvme.py)."""

import os
import struct
import time

import pytest
from fakes import RAM_BASE, FakeGuestRam, RecordingIrqPort

from qemu_device import nvme

BAR0 = 0
ASQ, ACQ, IOSQ, IOCQ, BUF, PRPLIST = (RAM_BASE + n * 0x10000 for n in range(6))


class Driver:
    """Just enough of a host driver: queues, commands, completions, phase tags."""

    def __init__(self, dev: nvme.NvmeController, ram: FakeGuestRam) -> None:
        self.dev, self.ram = dev, ram
        self.tails = {0: 0, 1: 0}
        self.cq_heads = {0: 0, 1: 0}
        self.phases = {0: 1, 1: 1}
        self.cid = 0

    def w32(self, off: int, value: int) -> None:
        self.dev.region_write(BAR0, off, value.to_bytes(4, "little"))

    def r32(self, off: int) -> int:
        return int.from_bytes(self.dev.region_read(BAR0, off, 4), "little")

    def enable(self) -> None:
        self.w32(nvme.AQA, (31 << 16) | 31)
        for reg, addr in ((nvme.ASQ, ASQ), (nvme.ACQ, ACQ)):
            self.w32(reg, addr & 0xFFFFFFFF)
            self.w32(reg + 4, addr >> 32)
        self.w32(nvme.CC, (4 << 20) | (6 << 16) | 1)
        assert self.r32(nvme.CSTS) & 1

    def submit(self, qid: int, opcode: int, *, nsid=0, prp1=0, prp2=0, cdw=(0,) * 6) -> tuple[int, int]:
        self.cid += 1
        sqe = struct.pack("<BBHIQQQQ6I", opcode, 0, self.cid, nsid, 0, 0, prp1, prp2, *cdw)
        base = ASQ if qid == 0 else IOSQ
        off = base - RAM_BASE + self.tails[qid] * 64
        self.ram.ram[off:off + 64] = sqe
        self.tails[qid] = (self.tails[qid] + 1) % 32
        self.w32(nvme.DOORBELLS + 8 * qid, self.tails[qid])
        cq = (ACQ if qid == 0 else IOCQ) - RAM_BASE + self.cq_heads[qid] * 16
        deadline = time.monotonic() + 5
        while (struct.unpack_from("<H", self.ram.ram, cq + 14)[0] & 1) != self.phases[qid]:
            assert time.monotonic() < deadline, "no completion"
            time.sleep(0.001)
        result, _, _sqhd, _sqid, cid, status = struct.unpack_from("<IIHHHH", self.ram.ram, cq)
        assert cid == self.cid
        self.cq_heads[qid] = (self.cq_heads[qid] + 1) % 32
        if self.cq_heads[qid] == 0:
            self.phases[qid] ^= 1
        self.w32(nvme.DOORBELLS + 8 * qid + 4, self.cq_heads[qid])
        return status >> 1, result


@pytest.fixture
def ctrl(tmp_path):
    dev = nvme.NvmeController(namespaces=[{"size": 1 << 20, "path": str(tmp_path / "ns1")},
                                          {"size": 1 << 20, "path": str(tmp_path / "ns2")}])
    ram, irq = FakeGuestRam(), RecordingIrqPort()
    dev.attach(ram, irq)
    dev.config.write(4, 2, 0x6)  # memory + bus master
    drv = Driver(dev, ram)
    drv.enable()
    yield drv, irq
    dev.close()


def test_identify_controller_and_namespaces(ctrl):
    drv, _ = ctrl
    assert drv.submit(0, 0x06, prp1=BUF, cdw=(1, 0, 0, 0, 0, 0)) == (0, 0)
    ident = drv.ram.ram[BUF - RAM_BASE:BUF - RAM_BASE + 4096]
    assert ident[24:45] == b"dxpu-vfio pooled NVMe" and struct.unpack_from("<I", ident, 516)[0] == 2
    assert drv.submit(0, 0x06, prp1=BUF, cdw=(2, 0, 0, 0, 0, 0))[0] == 0
    assert struct.unpack_from("<3I", drv.ram.ram, BUF - RAM_BASE) == (1, 2, 0)
    assert drv.submit(0, 0x06, nsid=2, prp1=BUF, cdw=(0, 0, 0, 0, 0, 0))[0] == 0
    assert struct.unpack_from("<Q", drv.ram.ram, BUF - RAM_BASE)[0] == (1 << 20) // 512
    assert drv.submit(0, 0x06, nsid=9, prp1=BUF, cdw=(0, 0, 0, 0, 0, 0))[0] == nvme.Status.INVALID_NAMESPACE


def test_io_through_a_prp_list_round_trips_to_the_file(ctrl, tmp_path):
    drv, irq = ctrl
    assert drv.submit(0, 0x05, prp1=IOCQ, cdw=((31 << 16) | 1, 0b11 | (1 << 16), 0, 0, 0, 0))[0] == 0
    assert drv.submit(0, 0x01, prp1=IOSQ, cdw=((31 << 16) | 1, 1 | (1 << 16), 0, 0, 0, 0))[0] == 0
    data = os.urandom(3 * 4096 + 1024)  # 4 pages from an unaligned start: PRP1 + a PRP list
    start = BUF + 1024
    pages = [BUF + 4096 * i for i in range(1, 4)]
    drv.ram.ram[start - RAM_BASE:start - RAM_BASE + len(data)] = data
    drv.ram.ram[PRPLIST - RAM_BASE:PRPLIST - RAM_BASE + 24] = struct.pack("<3Q", *pages)
    nlb = len(data) // 512
    assert drv.submit(1, 0x01, nsid=1, prp1=start, prp2=PRPLIST, cdw=(8, 0, nlb - 1, 0, 0, 0)) == (0, 0)
    assert drv.submit(1, 0x00, nsid=1) == (0, 0)  # flush: on disk now
    with open(tmp_path / "ns1", "rb") as f:
        f.seek(8 * 512)
        assert f.read(len(data)) == data
    drv.ram.ram[start - RAM_BASE:start - RAM_BASE + len(data)] = bytes(len(data))
    assert drv.submit(1, 0x02, nsid=1, prp1=start, prp2=PRPLIST, cdw=(8, 0, nlb - 1, 0, 0, 0)) == (0, 0)
    assert bytes(drv.ram.ram[start - RAM_BASE:start - RAM_BASE + len(data)]) == data
    assert any(kind == "intx" for kind, _ in irq.events)  # MSI is off in this fake: INTx


def test_errors_have_the_right_status(ctrl):
    drv, _ = ctrl
    assert drv.submit(0, 0x7F)[0] == nvme.Status.INVALID_OPCODE
    assert drv.submit(0, 0x01, prp1=IOSQ, cdw=((31 << 16) | 1, 1 | (5 << 16), 0, 0, 0, 0))[0] == nvme.Status.INVALID_CQ
    assert drv.submit(0, 0x05, prp1=IOCQ, cdw=((9999 << 16) | 1, 1, 0, 0, 0, 0))[0] == nvme.Status.INVALID_QUEUE_SIZE
    assert drv.submit(0, 0x02, prp1=BUF, cdw=(0x7F | (127 << 16), 0, 0, 0, 0, 0))[0] == nvme.Status.INVALID_LOG_PAGE
    assert drv.submit(0, 0x05, prp1=IOCQ, cdw=((31 << 16) | 1, 0b11 | (1 << 16), 0, 0, 0, 0))[0] == 0
    assert drv.submit(0, 0x01, prp1=IOSQ, cdw=((31 << 16) | 1, 1 | (1 << 16), 0, 0, 0, 0))[0] == 0
    blocks = (1 << 20) // 512
    assert drv.submit(1, 0x02, nsid=1, prp1=BUF, cdw=(blocks - 1, 0, 1, 0, 0, 0))[0] == nvme.Status.LBA_OUT_OF_RANGE
    assert drv.submit(1, 0x02, nsid=1, prp1=0x1000, cdw=(0, 0, 0, 0, 0, 0))[0] == nvme.Status.DATA_TRANSFER_ERROR
    assert drv.submit(0, 0x04, cdw=(1, 0, 0, 0, 0, 0))[0] == nvme.Status.INVALID_QUEUE_DELETION  # CQ still used by SQ 1


def test_features_logs_and_held_async_event(ctrl):
    drv, _ = ctrl
    assert drv.submit(0, 0x09, cdw=(7, 0xFFFF00FF, 0, 0, 0, 0)) == (0, (7 << 16) | 7)
    assert drv.submit(0, 0x02, prp1=BUF, cdw=(2 | (127 << 16), 0, 0, 0, 0, 0))[0] == 0  # SMART
    drv.cid += 1
    off = ASQ - RAM_BASE + drv.tails[0] * 64
    drv.ram.ram[off:off + 64] = struct.pack("<BBHIQQQQ6I", 0x0C, 0, drv.cid, 0, 0, 0, 0, 0, *(0,) * 6)
    drv.tails[0] += 1
    drv.w32(nvme.DOORBELLS, drv.tails[0])
    assert drv.submit(0, 0x18) == (0, 0)  # the AER before it is held, later commands complete


def test_disable_and_shutdown(ctrl):
    drv, _ = ctrl
    drv.w32(nvme.CC, drv.r32(nvme.CC) | (1 << 14))
    assert drv.r32(nvme.CSTS) & nvme.CSTS_SHST_DONE
    drv.w32(nvme.CC, 0)
    assert drv.r32(nvme.CSTS) & 1 == 0


def test_msix_option_places_table_and_pba_above_the_doorbells(tmp_path):
    dev = nvme.NvmeController(namespaces=[{"size": 1 << 20, "path": str(tmp_path / "n")}], msix=True)
    try:
        assert dev.irq_counts()["msix"] == nvme.MAX_QUEUES + 1 and dev.irq_counts()["msi"] == 0
        dev.region_write(BAR0, nvme.MSIX_TABLE + 8, (0x4321).to_bytes(4, "little"))  # vector 0 data
        assert int.from_bytes(dev.region_read(BAR0, nvme.MSIX_TABLE + 8, 4), "little") == 0x4321
    finally:
        dev.close()
