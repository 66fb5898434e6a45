"""The NVMe controller model against a driver-like sequence, with in-memory guest RAM
(FakeGuestRam: a unit-test stand-in; the real path is tested with Linux's nvme driver
in tests/test_nvme.py)."""

import os
import struct
import subprocess
import threading
import time

import pytest
from fakes import RAM_BASE, FakeGuestRam, PostedBlocks, RecordingIrqPort

from dxpu_vfio.testing import needs_root
from qemu_device import nvme, nvme_identity, nvme_prp, nvme_spec
from qemu_device.capabilities import CAP_ID_MSI
from qemu_device.device import REGION_CONFIG

BAR0 = 0
ASQ, ACQ, IOSQ, IOCQ, BUF, PRPLIST = (RAM_BASE + n * 0x10000 for n in range(6))
QUEUES = 3  # admin + two I/O queue pairs, 32 entries each; I/O queue q at IOSQ/IOCQ + (q - 1) pages


def sq_base(qid: int) -> int:
    return ASQ if qid == 0 else IOSQ + (qid - 1) * 0x1000


def cq_base(qid: int) -> int:
    return ACQ if qid == 0 else IOCQ + (qid - 1) * 0x1000


class HoldingRam(FakeGuestRam):
    """Guest RAM whose accesses touching a held address wait until it is released:
    a command caught in the middle of its DMA, as a slow network round trip leaves it."""

    def __init__(self) -> None:
        super().__init__()
        self.holds: dict[int, tuple[threading.Event, threading.Event]] = {}  # addr -> (reached, release)

    def hold(self, addr: int) -> tuple[threading.Event, threading.Event]:
        self.holds[addr] = (threading.Event(), threading.Event())
        return self.holds[addr]

    def _window(self, addr: int, length: int) -> slice:
        for start, (reached, release) in list(self.holds.items()):
            if addr <= start < addr + length:
                reached.set()
                assert release.wait(10), "a held DMA was never released"
        return super()._window(addr, length)

    def cq_writes(self, qid: int) -> int:
        """DMA writes into completion queue ``qid`` so far."""
        base = cq_base(qid)
        return sum(1 for kind, addr, _ in list(self.calls) if kind == "write" and base <= addr < base + 32 * 16)


class Driver:
    """Just enough of a host driver: queues, commands, completions, phase tags."""

    def __init__(self, dev: nvme.NvmeController, ram: FakeGuestRam) -> None:
        self.dev, self.ram = dev, ram
        self.tails = dict.fromkeys(range(QUEUES), 0)
        self.cq_heads = dict.fromkeys(range(QUEUES), 0)
        self.phases = dict.fromkeys(range(QUEUES), 1)
        self.cid = 0

    def w32(self, off: int, value: int) -> None:
        self.dev.region_write(BAR0, off, value.to_bytes(4, "little"))

    def r32(self, off: int) -> int:
        return int.from_bytes(self.dev.region_read(BAR0, off, 4), "little")

    def enable(self) -> None:
        self.w32(nvme_spec.AQA, (31 << 16) | 31)
        for reg, addr in ((nvme_spec.ASQ, ASQ), (nvme_spec.ACQ, ACQ)):
            self.w32(reg, addr & 0xFFFFFFFF)
            self.w32(reg + 4, addr >> 32)
        self.w32(nvme_spec.CC, (4 << 20) | (6 << 16) | 1)
        assert self.r32(nvme_spec.CSTS) & 1

    def post(self, qid: int, opcode: int, *, nsid=0, prp1=0, prp2=0, cdw=(0,) * 6) -> int:
        """Put a command in submission queue ``qid`` without ringing; returns its CID."""
        self.cid += 1
        sqe = struct.pack("<BBHIQQQQ6I", opcode, 0, self.cid, nsid, 0, 0, prp1, prp2, *cdw)
        off = sq_base(qid) - RAM_BASE + self.tails[qid] * 64
        self.ram.ram[off:off + 64] = sqe
        self.tails[qid] = (self.tails[qid] + 1) % 32
        return self.cid

    def ring(self, qid: int) -> None:
        self.w32(nvme_spec.DOORBELLS + 8 * qid, self.tails[qid])

    def reap(self, qid: int, count: int = 1, timeout: float = 5) -> list[tuple[int, int, int, int]]:
        """The next ``count`` completions of CQ ``qid`` as (cid, status, result, sq head)."""
        out = []
        deadline = time.monotonic() + timeout
        while len(out) < count:
            cq = cq_base(qid) - RAM_BASE + self.cq_heads[qid] * 16
            if (struct.unpack_from("<H", self.ram.ram, cq + 14)[0] & 1) != self.phases[qid]:
                assert time.monotonic() < deadline, f"{count - len(out)} completions missing"
                time.sleep(0.001)
                continue
            result, _, sqhd, _sqid, cid, status = struct.unpack_from("<IIHHHH", self.ram.ram, cq)
            out.append((cid, status >> 1, result, sqhd))
            self.cq_heads[qid] = (self.cq_heads[qid] + 1) % 32
            if self.cq_heads[qid] == 0:
                self.phases[qid] ^= 1
            self.w32(nvme_spec.DOORBELLS + 8 * qid + 4, self.cq_heads[qid])
        return out

    def nothing_completes(self, qid: int, seconds: float = 0.3) -> bool:
        try:
            self.reap(qid, 1, timeout=seconds)
        except AssertionError:
            return True
        return False

    def submit(self, qid: int, opcode: int, **kw) -> tuple[int, int]:
        cid = self.post(qid, opcode, **kw)
        self.ring(qid)
        [(got, status, result, _)] = self.reap(qid)
        assert got == cid
        return status, result

    def io_queues(self, count: int) -> None:
        """Create I/O queue pairs 1..count (32 entries, interrupts on vector q)."""
        for q in range(1, count + 1):
            assert self.submit(0, 0x05, prp1=cq_base(q), cdw=((31 << 16) | q, 0b11 | (q << 16), 0, 0, 0, 0))[0] == 0
            assert self.submit(0, 0x01, prp1=sq_base(q), cdw=((31 << 16) | q, 1 | (q << 16), 0, 0, 0, 0))[0] == 0

    def read(self, qid: int, buf: int, lba: int = 0, nsid: int = 1, blocks: int = 8) -> int:
        return self.post(qid, 0x02, nsid=nsid, prp1=buf, cdw=(lba, 0, blocks - 1, 0, 0, 0))

    def write(self, qid: int, buf: int, lba: int = 0, nsid: int = 1, blocks: int = 8) -> int:
        return self.post(qid, 0x01, nsid=nsid, prp1=buf, cdw=(lba, 0, blocks - 1, 0, 0, 0))


def enabled_controller(tmp_path, namespaces: list[dict] | None = None, **settings) -> tuple[Driver, RecordingIrqPort]:
    settings.setdefault("io_workers", 4)  # these tests are about commands in flight
    namespaces = namespaces or [{"size": 1 << 20, "path": str(tmp_path / "ns1")},
                                {"size": 1 << 20, "path": str(tmp_path / "ns2")}]
    dev = nvme.NvmeController(namespaces=namespaces, **settings)
    ram, irq = HoldingRam(), RecordingIrqPort()
    dev.attach(ram, irq)
    dev.config.write(4, 2, 0x6)  # memory + bus master
    drv = Driver(dev, ram)
    drv.enable()
    return drv, irq


@pytest.fixture
def ctrl(tmp_path):
    drv, irq = enabled_controller(tmp_path)
    yield drv, irq
    for _, release in drv.ram.holds.values():
        release.set()
    drv.dev.close()


def test_identify_controller_and_namespaces(ctrl):
    drv, _ = ctrl
    assert drv.submit(0, 0x06, prp1=BUF, cdw=(1, 0, 0, 0, 0, 0)) == (0, 0)
    ident = drv.ram.ram[BUF - RAM_BASE:BUF - RAM_BASE + 4096]
    assert ident[24:45] == b"dxpu-vfio pooled NVMe" and struct.unpack_from("<I", ident, 516)[0] == 2
    assert drv.submit(0, 0x06, prp1=BUF, cdw=(2, 0, 0, 0, 0, 0))[0] == 0
    assert struct.unpack_from("<3I", drv.ram.ram, BUF - RAM_BASE) == (1, 2, 0)
    assert drv.submit(0, 0x06, nsid=2, prp1=BUF, cdw=(0, 0, 0, 0, 0, 0))[0] == 0
    assert struct.unpack_from("<Q", drv.ram.ram, BUF - RAM_BASE)[0] == (1 << 20) // 512
    assert drv.submit(0, 0x06, nsid=9, prp1=BUF, cdw=(0, 0, 0, 0, 0, 0))[0] == nvme_spec.Status.INVALID_NAMESPACE


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


class CountingRam(FakeGuestRam):
    """Guest RAM that records each read_many call: on a remote port each is one round trip
    (it says it is one, so the controller reads a batch's write data ahead as on a box)."""

    reads_wait_on_network = True

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[tuple[int, int]]] = []
        self.begun_by: list[str] = []   # the threads that began reads (a doorbell's SQ fetch)

    def read_many(self, pieces):
        self.batches.append(list(pieces))
        return super().read_many(pieces)

    def read_many_begin(self, pieces):
        self.begun_by.append(threading.current_thread().name)
        return super().read_many_begin(pieces)


def on_a_box(tmp_path, ram_type: type = CountingRam) -> tuple[nvme.NvmeController, CountingRam, Driver]:
    """A 1 MiB namespace, one worker, guest RAM that counts reads as a box's does; enabled."""
    dev = nvme.NvmeController(namespaces=[{"size": 1 << 20, "path": str(tmp_path / "ns1")}], io_workers=0)
    ram = ram_type()
    dev.attach(ram, RecordingIrqPort())
    dev.config.write(4, 2, 0x6)
    drv = Driver(dev, ram)
    drv.enable()
    return dev, ram, drv


def test_the_prp_lists_of_a_batch_are_fetched_in_one_round_trip(tmp_path):
    """Four 16 KiB reads rung with one doorbell: their PRP lists come in one read_many
    (one network round trip on a box) before the commands run, and the data still lands
    where each list says."""
    dev, ram, drv = on_a_box(tmp_path)
    drv.io_queues(1)
    disk = os.urandom(64 << 10)
    with open(tmp_path / "ns1", "r+b") as f:
        f.write(disk)
    lists = [PRPLIST + 64 * i for i in range(4)]
    for i, list_addr in enumerate(lists):
        pages = [BUF + (4 * i + 3 - j) * 4096 for j in range(4)]  # each command's pages in reverse order
        ram.ram[list_addr - RAM_BASE:list_addr - RAM_BASE + 24] = struct.pack("<3Q", *pages[1:])
        drv.read(1, pages[0], lba=32 * i, blocks=32)
        off = sq_base(1) - RAM_BASE + ((drv.tails[1] - 1) % 32) * 64
        struct.pack_into("<Q", ram.ram, off + 32, list_addr)  # PRP2: the list
    ram.batches.clear()
    ram.calls.clear()
    ram.begun_by.clear()
    drv.ring(1)
    assert [status for _, status, _, _ in drv.reap(1, 4)] == [0, 0, 0, 0]
    # the doorbell's SQ fetch (begun on the doorbell's thread), then one read_many: the four lists
    assert ram.batches == [[(sq_base(1), 4 * 64)], [(a, 24) for a in lists]]
    assert ram.begun_by == [threading.current_thread().name]     # the doorbell's thread began the fetch
    assert [addr for kind, addr, _ in ram.calls if kind == "read" and addr in lists] == lists  # none read again
    for i in range(4):
        for j in range(4):
            page = BUF + (4 * i + 3 - j) * 4096 - RAM_BASE
            assert bytes(ram.ram[page:page + 4096]) == disk[(4 * i + j) * 4096:(4 * i + j + 1) * 4096]


def test_the_write_data_of_a_batch_is_read_in_one_scatter_list(tmp_path):
    """Four 16 KiB writes from scattered pages rung with one doorbell: after their PRP
    lists, every page of all four comes in one more read_many (one pipelined transfer on a
    box, not a round trip per command), and each lands where its LBA says. A fifth Write
    with a bad PRP in the same batch fails alone."""
    dev, ram, drv = on_a_box(tmp_path)
    drv.io_queues(1)
    data = os.urandom(64 << 10)
    lists = [PRPLIST + 64 * i for i in range(4)]
    wanted = []
    for i, list_addr in enumerate(lists):
        pages = [BUF + (4 * i + 3 - j) * 4096 for j in range(4)]  # each command's pages in reverse order
        for j, page in enumerate(pages):
            ram.ram[page - RAM_BASE:page - RAM_BASE + 4096] = data[(4 * i + j) * 4096:(4 * i + j + 1) * 4096]
        wanted += [(page, 4096) for page in pages]
        ram.ram[list_addr - RAM_BASE:list_addr - RAM_BASE + 24] = struct.pack("<3Q", *pages[1:])
        drv.write(1, pages[0], lba=32 * i, blocks=32)
        off = sq_base(1) - RAM_BASE + ((drv.tails[1] - 1) % 32) * 64
        struct.pack_into("<Q", ram.ram, off + 32, list_addr)  # PRP2: the list
    bad = drv.post(1, 0x01, nsid=1, prp1=BUF + 2, cdw=(0, 0, 7, 0, 0, 0))  # PRP1 not dword aligned
    ram.batches.clear()
    drv.ring(1)
    done = {cid: status for cid, status, _, _ in drv.reap(1, 5)}
    assert status_of(done.pop(bad)) == nvme_spec.Status.INVALID_PRP_OFFSET
    assert list(done.values()) == [0, 0, 0, 0]
    # the SQ fetch its doorbell began, the lists, then all the data at once
    assert ram.batches == [[(sq_base(1), 5 * 64)], [(a, 24) for a in lists], wanted]
    with open(tmp_path / "ns1", "rb") as f:
        assert f.read(64 << 10) == data
    dev.close()


def test_errors_have_the_right_status(ctrl):
    drv, _ = ctrl
    assert drv.submit(0, 0x7F)[0] == nvme_spec.Status.INVALID_OPCODE
    assert drv.submit(0, 0x01, prp1=IOSQ, cdw=((31 << 16) | 1, 1 | (5 << 16), 0, 0, 0, 0))[0] == nvme_spec.Status.INVALID_CQ
    assert drv.submit(0, 0x05, prp1=IOCQ, cdw=((9999 << 16) | 1, 1, 0, 0, 0, 0))[0] == nvme_spec.Status.INVALID_QUEUE_SIZE
    assert drv.submit(0, 0x02, prp1=BUF, cdw=(0x7F | (127 << 16), 0, 0, 0, 0, 0))[0] == nvme_spec.Status.INVALID_LOG_PAGE
    assert drv.submit(0, 0x05, prp1=IOCQ, cdw=((31 << 16) | 1, 0b11 | (1 << 16), 0, 0, 0, 0))[0] == 0
    assert drv.submit(0, 0x01, prp1=IOSQ, cdw=((31 << 16) | 1, 1 | (1 << 16), 0, 0, 0, 0))[0] == 0
    blocks = (1 << 20) // 512
    assert drv.submit(1, 0x02, nsid=1, prp1=BUF, cdw=(blocks - 1, 0, 1, 0, 0, 0))[0] == nvme_spec.Status.LBA_OUT_OF_RANGE
    assert drv.submit(1, 0x02, nsid=1, prp1=0x1000, cdw=(0, 0, 0, 0, 0, 0))[0] == nvme_spec.Status.DATA_TRANSFER_ERROR
    assert drv.submit(0, 0x04, cdw=(1, 0, 0, 0, 0, 0))[0] == nvme_spec.Status.INVALID_QUEUE_DELETION  # CQ still used by SQ 1


def test_features_logs_and_held_async_event(ctrl):
    drv, _ = ctrl
    assert drv.submit(0, 0x09, cdw=(7, 0xFFFF00FF, 0, 0, 0, 0)) == (0, (7 << 16) | 7)
    assert drv.submit(0, 0x02, prp1=BUF, cdw=(2 | (127 << 16), 0, 0, 0, 0, 0))[0] == 0  # SMART
    drv.cid += 1
    off = ASQ - RAM_BASE + drv.tails[0] * 64
    drv.ram.ram[off:off + 64] = struct.pack("<BBHIQQQQ6I", 0x0C, 0, drv.cid, 0, 0, 0, 0, 0, *(0,) * 6)
    drv.tails[0] += 1
    drv.w32(nvme_spec.DOORBELLS, drv.tails[0])
    assert drv.submit(0, 0x18) == (0, 0)  # the AER before it is held, later commands complete


def test_disable_and_shutdown(ctrl):
    drv, _ = ctrl
    drv.w32(nvme_spec.CC, drv.r32(nvme_spec.CC) | (1 << 14))
    assert drv.r32(nvme_spec.CSTS) & nvme_spec.CSTS_SHST_DONE
    drv.w32(nvme_spec.CC, 0)
    assert drv.r32(nvme_spec.CSTS) & 1 == 0


def test_msix_option_places_table_and_pba_above_the_doorbells(tmp_path):
    dev = nvme.NvmeController(namespaces=[{"size": 1 << 20, "path": str(tmp_path / "n")}], msix=True)
    try:
        assert dev.irq_counts()["msix"] == nvme.MAX_QUEUES + 1 and dev.irq_counts()["msi"] == 0
        dev.region_write(BAR0, nvme.MSIX_TABLE + 8, (0x4321).to_bytes(4, "little"))  # vector 0 data
        assert int.from_bytes(dev.region_read(BAR0, nvme.MSIX_TABLE + 8, 4), "little") == 0x4321
    finally:
        dev.close()


# --- commands in flight ----------------------------------------------------------------------

def bufs(n: int) -> list[int]:
    return [BUF + 0x1000 * i for i in range(n)]


def test_commands_in_flight_complete_out_of_order_each_cid_once(ctrl):
    drv, _ = ctrl
    drv.io_queues(1)
    a, b, c, d = bufs(4)
    data = os.urandom(4096)
    drv.ram.ram[d - RAM_BASE:d - RAM_BASE + 4096] = data
    reached, release = drv.ram.hold(a)  # the first read's data DMA is slow
    cids = [drv.read(1, a), drv.read(1, b, lba=8), drv.read(1, c, lba=16), drv.write(1, d, lba=24)]
    drv.ring(1)  # one doorbell, one batch
    assert reached.wait(5)
    early = drv.reap(1, 3)
    assert sorted(cid for cid, *_ in early) == cids[1:], "the others waited for the slow one"
    release.set()
    late = drv.reap(1, 1)
    assert late[0][0] == cids[0] and drv.nothing_completes(1)
    assert all(status == 0 for _, status, _, _ in early + late)
    assert {sqhd for *_, sqhd in early + late} == {4}  # the batch was taken whole
    assert drv.dev.stats()["io_in_flight_peak"] >= 2
    assert drv.submit(1, 0x02, nsid=1, prp1=a, cdw=(24, 0, 7, 0, 0, 0)) == (0, 0)
    assert bytes(drv.ram.ram[a - RAM_BASE:a - RAM_BASE + 4096]) == data


def test_flush_waits_for_the_writes_of_its_namespace_taken_before_it(ctrl, monkeypatch):
    drv, _ = ctrl
    drv.io_queues(1)
    a, b = bufs(2)
    reached, release = drv.ram.hold(a)  # the write's data is slow to arrive
    write = drv.write(1, a, nsid=1)
    flush = drv.post(1, 0x00, nsid=1)
    other = drv.post(1, 0x00, nsid=2)  # another namespace's flush need not wait
    read = drv.read(1, b, nsid=2)
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(nvme.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    drv.ring(1)
    assert reached.wait(5)
    assert sorted(cid for cid, *_ in drv.reap(1, 2)) == [other, read]
    assert drv.nothing_completes(1), "the flush did not wait for the write before it"
    release.set()
    assert [cid for cid, *_ in drv.reap(1, 2)] == [write, flush]
    assert synced[-1] == drv.dev.namespaces[1].fd


def test_two_io_queues_are_served_side_by_side(ctrl):
    drv, _ = ctrl
    drv.io_queues(2)
    a, b = bufs(2)
    reached, release = drv.ram.hold(a)
    slow = drv.read(1, a)
    drv.ring(1)
    assert reached.wait(5)
    assert drv.submit(2, 0x02, nsid=1, prp1=b, cdw=(0, 0, 7, 0, 0, 0)) == (0, 0)  # queue 2 is not stuck behind 1
    release.set()
    assert drv.reap(1)[0][:2] == (slow, 0)


def held_read(drv: Driver) -> tuple[int, "threading.Event"]:
    """One read on a new I/O queue 1 whose data DMA is held: (its CID, the release)."""
    drv.io_queues(1)
    reached, release = drv.ram.hold(BUF)
    cid = drv.read(1, BUF)
    drv.ring(1)
    assert reached.wait(5)
    return cid, release


def test_delete_sq_completes_after_its_commands_in_flight(ctrl):
    drv, _ = ctrl
    read, release = held_read(drv)
    delete = drv.post(0, 0x00, cdw=(1, 0, 0, 0, 0, 0))
    drv.ring(0)
    assert drv.nothing_completes(0)
    release.set()
    assert drv.reap(1)[0][:2] == (read, 0)
    assert drv.reap(0)[0][:2] == (delete, 0)


def test_reset_with_commands_in_flight_writes_no_completion_after_it(ctrl):
    drv, irq = ctrl
    drv.io_queues(1)
    reached, release = drv.ram.hold(BUF)
    drv.read(1, BUF)
    drv.read(1, BUF + 0x1000)
    drv.ring(1)
    assert reached.wait(5)
    drv.reap(1, 1)  # the other one completed
    drv.w32(nvme_spec.CC, 0)  # reset with the first in flight
    assert drv.r32(nvme_spec.CSTS) & nvme_spec.CSTS_RDY, "RDY fell while a command could still write"
    writes = drv.ram.cq_writes(1)
    irq.take()
    release.set()
    deadline = time.monotonic() + 5
    while drv.r32(nvme_spec.CSTS) & nvme_spec.CSTS_RDY:
        assert time.monotonic() < deadline, "RDY stayed up after the command ended"
        time.sleep(0.001)
    assert drv.ram.cq_writes(1) == writes, "a completion was written into a queue of before the reset"
    assert not [e for e in irq.take() if e != ("intx", False)], "an interrupt for it after the reset"


def test_shutdown_with_commands_in_flight_is_done_after_them(ctrl):
    drv, _ = ctrl
    read, release = held_read(drv)
    drv.w32(nvme_spec.CC, drv.r32(nvme_spec.CC) | (1 << 14))
    assert drv.r32(nvme_spec.CSTS) & nvme_spec.CSTS_SHST == nvme_spec.CSTS_SHST_OCCURRING
    release.set()
    assert drv.reap(1)[0][:2] == (read, 0)
    deadline = time.monotonic() + 5
    while drv.r32(nvme_spec.CSTS) & nvme_spec.CSTS_SHST != nvme_spec.CSTS_SHST_DONE:
        assert time.monotonic() < deadline, "shutdown never reported done"
        time.sleep(0.001)


def test_close_ends_the_io_threads(tmp_path):
    drv, _ = enabled_controller(tmp_path, io_workers=3)
    drv.io_queues(1)
    for i in range(6):
        drv.read(1, BUF + 0x1000 * i)
    drv.ring(1)
    assert sorted(cid for cid, *_ in drv.reap(1, 6)) == list(range(drv.cid - 5, drv.cid + 1))
    assert len([t for t in threading.enumerate() if t.name.startswith("nvme-io")]) >= 3
    assert drv.dev.close(timeout=2)
    assert not drv.dev.io_pool.running and not drv.dev.worker.running


def test_io_workers_must_not_be_negative(tmp_path):
    with pytest.raises(ValueError):
        nvme.NvmeController(namespaces=[{"size": 1 << 20, "path": str(tmp_path / "n")}], io_workers=-1)


def test_io_inline_by_default_runs_commands_in_order(tmp_path):
    """Without a pool (the default) a slow command holds the ones after it: in order, one at a time."""
    drv, _ = enabled_controller(tmp_path, io_workers=0)
    drv.io_queues(1)
    a, b, c = bufs(3)
    reached, release = drv.ram.hold(a)
    cids = [drv.read(1, a), drv.read(1, b, lba=8), drv.read(1, c, lba=16)]
    drv.ring(1)
    assert reached.wait(5)
    assert drv.nothing_completes(1), "a command passed the slow one before it"
    release.set()
    assert [cid for cid, *_ in drv.reap(1, 3)] == cids
    assert drv.dev.close()


def test_a_reads_data_and_its_completion_entry_are_one_dma_write_on_the_worker(tmp_path):
    """On the worker a Read's file bytes and then its completion entry go to the port as one
    scatter list (on a box: one DMA_WRITEV, not one for the data and one for the entry), the
    entry after its data; a Read whose PRP is refused still completes, its entry alone."""
    drv, _ = enabled_controller(tmp_path, io_workers=0)
    drv.io_queues(1)
    batches: list[list[tuple[int, int]]] = []
    write_many = drv.ram.write_many
    drv.ram.write_many = lambda pieces: (batches.append([(a, len(d)) for a, d in pieces]), write_many(pieces))
    a, b = bufs(2)
    os.pwrite(drv.dev.namespaces[1].fd, b"\x5a" * 4096, 8 * 512)
    bad = BUF - 0x10000000  # not guest RAM
    cids = [drv.read(1, a), drv.read(1, b, lba=8), drv.read(1, bad)]
    drv.ring(1)
    got = drv.reap(1, 3)
    assert [cid for cid, *_ in got] == cids
    assert [status for _, status, *_ in got] == [0, 0, nvme_spec.Status.DATA_TRANSFER_ERROR]
    cq = cq_base(1)
    assert batches == [[(a, 4096), (cq, 16)], [(b, 4096), (cq + 16, 16)], [(bad, 4096), (cq + 32, 16)]]
    assert drv.ram.calls[-1] == ("write", cq + 32, 16), "the refused Read's entry was not written alone"
    assert bytes(drv.ram.ram[b - RAM_BASE:b - RAM_BASE + 4096]) == b"\x5a" * 4096
    assert drv.dev.close()


def test_doorbells_while_the_worker_is_busy_queue_one_more_round_not_one_each(tmp_path):
    """Four doorbells that come while the worker runs a command: the worker takes their
    entries when it is free, and one more round of the queue is queued for all of them
    (it finds the queue empty), not one round per doorbell."""
    drv, _ = enabled_controller(tmp_path, io_workers=0)
    drv.io_queues(1)
    rounds = []
    process = drv.dev._process
    drv.dev._process = lambda qid: (rounds.append(qid), process(qid))
    first, *rest = bufs(5)
    reached, release = drv.ram.hold(first)
    cids = [drv.read(1, first)]
    drv.ring(1)
    assert reached.wait(5)
    for i, buf in enumerate(rest):
        cids.append(drv.read(1, buf, lba=8 * (i + 1)))
        drv.ring(1)
    release.set()
    assert [cid for cid, *_ in drv.reap(1, 5)] == cids
    wait_for(lambda: len(rounds) >= 2)
    time.sleep(0.2)                        # a round per doorbell would be here by now
    assert rounds == [1, 1]
    assert drv.dev.close()


def test_a_disable_waits_for_a_completion_entry_still_being_written(tmp_path):
    """RDY must not fall (the host then frees the queues) while a completion entry is
    still being written: a command counts in flight until its entry is out."""
    drv, _ = enabled_controller(tmp_path, io_workers=0)
    drv.io_queues(1)
    reached, release = drv.ram.hold(cq_base(1))    # where the first completion goes
    drv.read(1, bufs(1)[0])
    drv.ring(1)
    assert reached.wait(5)
    drv.w32(nvme_spec.CC, 0)
    assert drv.r32(nvme_spec.CSTS) & 1, "RDY fell while a completion entry was being written"
    release.set()
    wait_for(lambda: not drv.r32(nvme_spec.CSTS) & 1)
    assert drv.dev.close()


def test_completions_of_one_batch_share_one_interrupt(tmp_path):
    """Three reads rung with one doorbell run one after another on the worker: each
    completion is in the CQ as it finishes, one MSI follows the last (what Linux's handler
    reaps in one go). A command alone is signalled at once."""
    drv, irq = enabled_controller(tmp_path, io_workers=0)
    drv.dev.region_write(REGION_CONFIG, drv.dev.caps.offsets[CAP_ID_MSI] + 2, (3 << 4 | 1).to_bytes(2, "little"))
    drv.io_queues(1)
    irq.take()
    a, b, c = bufs(3)
    cids = [drv.read(1, a), drv.read(1, b, lba=8), drv.read(1, c, lba=16)]
    drv.ring(1)
    assert [cid for cid, *_ in drv.reap(1, 3)] == cids
    wait_for(lambda: irq.events)
    assert irq.take() == [("msi", 1)]
    drv.submit(1, 0x02, nsid=1, prp1=a, cdw=(0, 0, 7, 0, 0, 0))
    assert irq.take() == [("msi", 1)]
    assert drv.dev.close()


def test_a_batch_rung_while_another_runs_shares_its_interrupt(tmp_path):
    """A doorbell that comes while the worker runs a batch: the first batch's interrupt
    waits for the second (its entries are already in the queue), and one MSI follows the
    last completion of both, not one each (TCG pays for every interrupt the guest takes).
    Once the queue is dry the interrupt goes at once."""
    drv, irq = enabled_controller(tmp_path, io_workers=0)
    drv.dev.region_write(REGION_CONFIG, drv.dev.caps.offsets[CAP_ID_MSI] + 2, (3 << 4 | 1).to_bytes(2, "little"))
    drv.io_queues(1)
    irq.take()
    a, b, c = bufs(3)
    reached, release = drv.ram.hold(a)
    first = [drv.read(1, a), drv.read(1, b, lba=8)]
    drv.ring(1)
    assert reached.wait(5)                 # the first batch is running
    second = [drv.read(1, c, lba=16)]
    drv.ring(1)
    release.set()
    assert [cid for cid, *_ in drv.reap(1, 3)] == first + second
    wait_for(lambda: irq.events)
    time.sleep(0.1)                        # an interrupt per batch would be here by now
    assert irq.take() == [("msi", 1)]
    drv.submit(1, 0x02, nsid=1, prp1=a, cdw=(0, 0, 7, 0, 0, 0))
    assert irq.take() == [("msi", 1)]
    assert drv.dev.close()


def test_on_a_box_a_batch_shares_an_interrupt_until_a_command_that_may_wait_on_the_network(tmp_path):
    """On a box reads whose pages need nothing from the network share one interrupt, as
    locally (a TCG guest pays for each). A command that may wait for guest memory over the
    network (up to a completion timeout: here a Flush, whose fsync takes the disk's time
    too) gets the completions before it signalled first: they do not wait with it."""
    dev = nvme.NvmeController(namespaces=[{"size": 1 << 20, "path": str(tmp_path / "ns1")}], io_workers=0)
    ram, irq = CountingRam(), RecordingIrqPort()
    dev.attach(ram, irq)
    dev.config.write(4, 2, 0x6)
    dev.region_write(REGION_CONFIG, dev.caps.offsets[CAP_ID_MSI] + 2, (3 << 4 | 1).to_bytes(2, "little"))
    drv = Driver(dev, ram)
    drv.enable()
    drv.io_queues(1)
    irq.take()
    for i, buf in enumerate(bufs(3)):
        drv.read(1, buf, lba=8 * i)
    drv.ring(1)
    assert len(drv.reap(1, 3)) == 3
    wait_for(lambda: irq.events)
    assert irq.take() == [("msi", 1)]
    for i in range(2):  # 4 pages each, through a PRP list: the batch's lists came with one read
        ram.ram[PRPLIST + 0x100 * i - RAM_BASE:PRPLIST + 0x100 * i - RAM_BASE + 24] = struct.pack(
            "<3Q", *[BUF + 0x1000 * (4 * i + j) for j in range(1, 4)])
        drv.post(1, 0x02, nsid=1, prp1=BUF + 0x4000 * i, prp2=PRPLIST + 0x100 * i, cdw=(8 * i, 0, 31, 0, 0, 0))
    drv.ring(1)
    assert [status for _, status, *_ in drv.reap(1, 2)] == [0, 0]
    wait_for(lambda: irq.events)
    assert irq.take() == [("msi", 1)]
    a, b = bufs(2)
    drv.read(1, a)
    drv.post(1, 0x00, nsid=1)            # Flush
    drv.read(1, b, lba=8)
    drv.ring(1)
    assert len(drv.reap(1, 3)) == 3
    wait_for(lambda: len(irq.events) == 2)
    assert irq.take() == [("msi", 1)] * 2, "the read before the Flush did not leave before it"
    assert dev.close()


# --- shadow doorbells (Doorbell Buffer Config) ---------------------------------------------------

SHADOW, EVENT_INDEX = PRPLIST + 0x4000, PRPLIST + 0x5000


def wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.001)


def shadow_value(drv: Driver, page: int, qid: int, cq: bool = False) -> int:
    return struct.unpack_from("<I", drv.ram.ram, page - RAM_BASE + qid * 8 + (4 if cq else 0))[0]


def shadow_ring(drv: Driver, qid: int) -> bool:
    """Linux's nvme_dbbuf_update_and_check_event: the tail into the shadow, then an MMIO
    doorbell only if the event index lies in [old tail, new tail); returns whether it rang."""
    new, off = drv.tails[qid], SHADOW - RAM_BASE + qid * 8
    old = struct.unpack_from("<I", drv.ram.ram, off)[0]
    struct.pack_into("<I", drv.ram.ram, off, new)
    event = shadow_value(drv, EVENT_INDEX, qid)
    if (new - event - 1) % 0x10000 < (new - old) % 0x10000:
        drv.ring(qid)
        return True
    return False


def test_shadow_doorbells_take_entries_without_mmio_and_publish_the_event_index(tmp_path):
    """After Doorbell Buffer Config the tail of an I/O SQ is read from its shadow: entries
    the guest adds while the worker is busy are taken without an MMIO doorbell, and an idle
    worker publishes the tail it saw as the event index, so the next entry rings. A late
    MMIO value older than the shadow moves nothing back."""
    drv, _ = enabled_controller(tmp_path, io_workers=0)
    drv.io_queues(1)
    assert drv.submit(0, 0x06, prp1=BUF, cdw=(1, 0, 0, 0, 0, 0)) == (0, 0)
    assert struct.unpack_from("<H", drv.ram.ram, BUF - RAM_BASE + 256)[0] & nvme_spec.OACS_DBBUF
    struct.pack_into("<I", drv.ram.ram, SHADOW - RAM_BASE + 8, 0xDEAD)  # config sets it to the doorbell's value
    assert drv.submit(0, nvme_spec.AdminOpcode.DOORBELL_BUFFER_CONFIG, prp1=SHADOW, prp2=EVENT_INDEX) == (0, 0)
    assert shadow_value(drv, SHADOW, 1) == 0 and shadow_value(drv, SHADOW, 1, cq=True) == 0
    a, b, c, d = bufs(4)
    first = drv.read(1, a)
    assert shadow_ring(drv, 1), "the event index (0) asks for the first doorbell"
    assert drv.reap(1)[0][:2] == (first, 0)
    wait_for(lambda: shadow_value(drv, EVENT_INDEX, 1) == 1)  # idle: the tail it saw
    reached, release = drv.ram.hold(b)
    held = drv.read(1, b, lba=8)
    assert shadow_ring(drv, 1)
    assert reached.wait(5)
    later = [drv.read(1, c, lba=16), drv.read(1, d, lba=24)]
    assert not shadow_ring(drv, 1), "the worker is busy: no doorbell is asked for"
    release.set()
    assert [cid for cid, *_ in drv.reap(1, 3)] == [held, *later]
    wait_for(lambda: shadow_value(drv, EVENT_INDEX, 1) == 4)
    assert drv.dev.stats()["shadow_tails"] >= 3
    drv.w32(nvme_spec.DOORBELLS + 8, 2)  # a stale MMIO value: only a kick, the shadow says 4
    assert drv.nothing_completes(1), "a stale doorbell value ran old entries again"
    assert drv.dev.close()


def test_doorbell_buffer_config_checks_its_pages_and_ends_with_a_reset(ctrl):
    drv, _ = ctrl
    drv.io_queues(1)
    assert status_of(drv.submit(0, 0x7C, prp1=SHADOW + 8, prp2=EVENT_INDEX)[0]) == nvme_spec.Status.INVALID_FIELD
    assert drv.dev.dbbuf is None
    assert drv.submit(0, 0x7C, prp1=SHADOW, prp2=EVENT_INDEX) == (0, 0)
    drv.w32(nvme_spec.CC, 0)  # a reset: the controller forgets the buffers, MMIO doorbells count again
    wait_not_ready(drv)
    assert drv.dev.dbbuf is None
    recover_like_linux(drv)
    assert drv.submit(1, 0x02, nsid=1, prp1=BUF, cdw=(0, 0, 7, 0, 0, 0)) == (0, 0)


def test_a_controller_on_a_gpu_box_offers_no_shadow_doorbells(tmp_path):
    """On a box a read of a shadow is a network round trip, a doorbell a posted write: unless
    its host reads the shadows for it (below), a box's controller does not offer them."""
    dev, ram, drv = on_a_box(tmp_path)
    assert drv.submit(0, 0x06, prp1=BUF, cdw=(1, 0, 0, 0, 0, 0)) == (0, 0)
    assert not struct.unpack_from("<H", ram.ram, BUF - RAM_BASE + 256)[0] & nvme_spec.OACS_DBBUF
    assert status_of(drv.submit(0, 0x7C, prp1=SHADOW, prp2=EVENT_INDEX)[0]) == nvme_spec.Status.INVALID_OPCODE
    assert dev.close()


class ShadowReadingRam(CountingRam, HoldingRam):
    """A box's port whose host reads the shadow doorbells (the link's RingWatch.shadow): the
    rings the device watches are recorded."""

    reads_shadows = True

    def __init__(self) -> None:
        super().__init__()
        self.watches: dict[int, object] = {}

    def watch_ring(self, slot, ring) -> None:
        self.watches[slot] = ring


def test_on_a_box_whose_host_reads_the_shadows_the_controller_offers_them_and_never_reads_one(tmp_path):
    """With a host that reads the shadows, a box's controller offers Doorbell Buffer Config:
    its SQs are watched again with their shadow and event index, a doorbell's value (the
    shadow's tail, from the host) is taken when it moves the tail on, an idle worker writes
    the tail it saw as the event index (the host then reads the shadow for it), and no
    shadow is ever read over the network."""
    dev, ram, drv = on_a_box(tmp_path, ShadowReadingRam)
    drv.io_queues(1)
    assert ram.watches[1].shadow == 0
    assert drv.submit(0, 0x06, prp1=BUF, cdw=(1, 0, 0, 0, 0, 0)) == (0, 0)
    assert struct.unpack_from("<H", ram.ram, BUF - RAM_BASE + 256)[0] & nvme_spec.OACS_DBBUF
    assert drv.submit(0, nvme_spec.AdminOpcode.DOORBELL_BUFFER_CONFIG, prp1=SHADOW, prp2=EVENT_INDEX) == (0, 0)
    watch = ram.watches[1]
    assert (watch.shadow, watch.event_index, watch.doorbell) == (SHADOW + 8, EVENT_INDEX + 8, nvme_spec.DOORBELLS + 8)
    a, b, c = bufs(3)
    first = drv.read(1, a)
    assert shadow_ring(drv, 1)
    assert drv.reap(1)[0][:2] == (first, 0)
    wait_for(lambda: shadow_value(drv, EVENT_INDEX, 1) == 1)  # idle: published for the host
    reached, release = ram.hold(b)
    held = drv.read(1, b, lba=8)
    assert shadow_ring(drv, 1), "the event index (1) asks for this one"
    assert reached.wait(5)
    later = drv.read(1, c, lba=16)
    assert not shadow_ring(drv, 1), "the worker is busy: no doorbell is asked for"
    release.set()
    assert drv.reap(1)[0][0] == held
    wait_for(lambda: shadow_value(drv, EVENT_INDEX, 1) == 2)  # idle again at 2: the host reads the shadow now
    assert drv.nothing_completes(1), "the box cannot know of the entry: the host reads the shadow"
    drv.w32(nvme_spec.DOORBELLS + 8, 3)  # what the host sends after reading it
    assert drv.reap(1)[0][0] == later
    wait_for(lambda: shadow_value(drv, EVENT_INDEX, 1) == 3)
    last = drv.read(1, a, lba=24)
    with dev.lock:  # the worker waits: announced, not taken yet
        drv.w32(nvme_spec.DOORBELLS + 8, 4)
        drv.w32(nvme_spec.DOORBELLS + 8, 3)  # a register write that came late: behind the tail, stale
    assert drv.reap(1)[0][0] == last, "a stale doorbell value took an announced entry back"
    shadows = range(SHADOW, SHADOW + 4096)
    assert not [c for c in ram.calls if c[0] == "read" and c[1] in shadows], "a shadow was read over the network"
    assert drv.dev.stats()["shadow_tails"] == 0
    assert dev.close()


# --- a hostile guest's PRPs, a full or sparse backing file (issue 18) --------------------------

PAGE = nvme_identity.PAGE
DATA = RAM_BASE + (1 << 20)  # room for 128 KiB transfers clear of the queues and the PRP list


def status_of(status: int) -> nvme_spec.Status:
    """A completion's status without the DNR bit."""
    return nvme_spec.Status(status & ~nvme_spec.DNR)


def put(drv: Driver, addr: int, data: bytes) -> None:
    drv.ram.ram[addr - RAM_BASE:addr - RAM_BASE + len(data)] = data


def get(drv: Driver, addr: int, length: int) -> bytes:
    return bytes(drv.ram.ram[addr - RAM_BASE:addr - RAM_BASE + length])


def rw_through_list(drv: Driver, opcode: int, lba: int, length: int, buf: int = DATA) -> int:
    """A read or write of ``length`` bytes from page-aligned ``buf`` through a valid PRP list; its status."""
    pages = [buf + PAGE * i for i in range(1, length // PAGE)]
    put(drv, PRPLIST, struct.pack(f"<{len(pages)}Q", *pages))
    prp2 = PRPLIST if len(pages) > 1 else pages[0]
    return drv.submit(1, opcode, nsid=1, prp1=buf, prp2=prp2, cdw=(lba, 0, length // 512 - 1, 0, 0, 0))[0]


@pytest.mark.parametrize("prp1, prp2, entries", [
    (BUF, PRPLIST + 0xFF8, {PRPLIST + 0xFF8: PRPLIST + 0xFF8}),  # a list whose one entry points at itself
    (BUF, PRPLIST + 0xFFC, {}),  # a list pointer that is not qword aligned (the walk found no entry)
    (BUF, PRPLIST, {PRPLIST: BUF + PAGE + 0x200}),  # a list entry with an offset
    (BUF, PRPLIST + 0xFF8, {PRPLIST + 0xFF8: PRPLIST + 0x1004}),  # a next-list pointer with an offset
    (BUF + 1, PRPLIST, {}),  # PRP1 not dword aligned
], ids=["self-referencing", "misaligned-list", "entry-offset", "next-list-offset", "prp1-offset"])
def test_invalid_prps_complete_with_invalid_prp_offset(ctrl, prp1, prp2, entries):
    """Whatever the guest programs, the command completes, with the status the spec gives
    (Invalid PRP Offset, Do Not Retry), and the queue keeps working."""
    drv, _ = ctrl
    drv.io_queues(1)
    put(drv, PRPLIST, struct.pack("<512Q", *(BUF + PAGE * i for i in range(1, 513))))  # valid by default
    for addr, value in entries.items():
        put(drv, addr, struct.pack("<Q", value))
    status, _ = drv.submit(1, 0x02, nsid=1, prp1=prp1, prp2=prp2, cdw=(0, 0, 4 * PAGE // 512 - 1, 0, 0, 0))
    assert status_of(status) == nvme_spec.Status.INVALID_PRP_OFFSET and status & nvme_spec.DNR
    assert rw_through_list(drv, 0x02, 0, 4 * PAGE) == 0  # the next command is served


def test_a_batch_on_the_worker_completes_each_command_in_order_and_ends_them_all(tmp_path):
    """One doorbell, run on the worker (no I/O pool): Reads, bad Reads, a Write, a Flush and
    a Read after it. Each completes with its own status in order, the Read after the Flush
    sees the Write, and nothing is left counted in flight: a disable drops RDY at once."""
    drv, _ = enabled_controller(tmp_path, io_workers=0)
    try:
        drv.io_queues(1)
        data = os.urandom(PAGE)
        put(drv, DATA + PAGE, data)
        posted = [
            drv.read(1, DATA, lba=0),                       # fine
            drv.read(1, DATA, lba=0, nsid=9),               # no such namespace
            drv.read(1, DATA, lba=(1 << 20) // 512 - 4),    # runs past the namespace's end
            drv.write(1, DATA + PAGE, lba=16),              # fine
            drv.post(1, 0x00, nsid=1),                      # Flush: after the commands before it
            drv.read(1, DATA + 2 * PAGE, lba=16),           # reads what the Write wrote
        ]
        drv.ring(1)
        got = drv.reap(1, len(posted))
        assert [cid for cid, *_ in got] == posted
        assert [status_of(status) for _, status, _, _ in got] == [
            nvme_spec.Status.SUCCESS, nvme_spec.Status.INVALID_NAMESPACE, nvme_spec.Status.LBA_OUT_OF_RANGE,
            nvme_spec.Status.SUCCESS, nvme_spec.Status.SUCCESS, nvme_spec.Status.SUCCESS]
        assert bytes(drv.ram.ram[DATA + 2 * PAGE - RAM_BASE:DATA + 3 * PAGE - RAM_BASE]) == data
        drv.w32(nvme_spec.CC, 0)
        assert not drv.r32(nvme_spec.CSTS) & nvme_spec.CSTS_RDY, "a command of the batch is still counted in flight"
    finally:
        drv.dev.close()


@pytest.mark.parametrize("frames, expected", [
    ([9, 3, 7, 5], [(0x200, 0xE00), (9, 1), (3, 1), (7, 1), (5, 0.25)]),  # scattered: as listed
    ([1, 2, 3, 4], [(0x200, 0xE00 + 3.25 * PAGE)]),                    # PRP1's page and the list adjacent
    ([8, 2, 3, 6], [(0x200, 0xE00), (8, 1), (2, 2), (6, 0.25)]),         # adjacent pages in the list merged
], ids=["scattered", "contiguous", "partly-adjacent"])
def test_prp_segments_merge_adjacent_pages_only(frames, expected):
    """A transfer's (address, length) pieces: the guest's pages as it listed them, adjacent
    ones merged, the first from PRP1's offset and the last only as long as the transfer
    (a Read's pieces become the ranges of one DMA_WRITEV, so each extra piece is a range).
    ``expected``: PRP1's piece in bytes, then (page frame, length in pages). The list page
    was prefetched with its batch: the walk reads nothing more."""
    pages = [f * PAGE for f in frames]
    length = 0xE00 + 3 * PAGE + 0x400  # PRP1 from 0x200 to its page's end, then 3 pages and a quarter
    lists = {(0x7000, 8 * len(pages)): struct.pack(f"<{len(pages)}Q", *pages)}
    want = [expected[0]] + [(frame * PAGE, int(n * PAGE)) for frame, n in expected[1:]]

    def read(address: int, size: int) -> bytes:
        raise AssertionError(f"read {size} bytes at {address:#x}: the list page was prefetched")
    assert nvme_prp.segments(0x200, 0x7000, length, read, lists) == [(a, int(n)) for a, n in want]



def test_any_prps_a_guest_writes_walk_to_the_transfer_or_to_invalid_prp_offset():
    """PRPs are the guest's: random PRP1, PRP2, lengths and list pages (pointers that are
    unaligned, point back at their own page or run on through chained pages) either walk
    to segments that cover exactly the transfer -- the first from PRP1, every other on a
    page boundary, no two adjacent left unmerged -- or end in Invalid PRP Offset; never
    another exception, and never more list reads than the transfer has pages (+1 per
    chained page)."""
    import random
    rng = random.Random(11)
    memory: dict[int, bytes] = {}

    def read(address: int, size: int) -> bytes:
        reads.append(size)
        page = memory.get(address & ~(PAGE - 1), bytes(PAGE))
        start = address % PAGE
        return page[start:start + size].ljust(size, b"\0")

    def pointer() -> int:  # mostly page aligned, often adjacent to another
        base = rng.randrange(1, 16) * PAGE
        return base if rng.random() < 0.97 else base + rng.choice((8 * rng.randrange(512), rng.randrange(PAGE)))

    walked = refused = 0
    for _ in range(3000):
        memory.clear()
        for _ in range(rng.randrange(4)):  # list pages: entries, a pointer onwards, junk
            page = [pointer() if rng.random() < 0.995 else rng.randrange(1 << 64) for _ in range(512)]
            memory[rng.randrange(1, 16) * PAGE] = struct.pack("<512Q", *page)
        prp1 = pointer() + rng.choice((0, 4 * rng.randrange(1024), rng.randrange(PAGE)))
        prp2 = pointer() + rng.choice((0, 0, 8 * rng.randrange(512)))
        length = rng.choice((rng.randrange(1, 2 * PAGE), rng.randrange(1, PAGE << nvme_identity.MDTS),
                             PAGE << nvme_identity.MDTS))
        reads: list[int] = []
        try:
            got = nvme_prp.segments(prp1, prp2, length, read)
        except nvme_spec.CommandError as exc:
            assert exc.status == nvme_spec.Status.INVALID_PRP_OFFSET, exc
            refused += 1
            continue
        walked += 1
        assert sum(n for _, n in got) == length and got[0][0] == prp1
        assert all(a % PAGE == 0 for a, _ in got[1:]), got
        assert all(a + n != b for (a, n), (b, _) in zip(got, got[1:])), "adjacent pieces left unmerged"
        pages = (length + PAGE - 1) // PAGE + 1
        assert sum(reads) <= 8 * 2 * pages, (reads, length)
    assert walked > 300 and refused > 300, (walked, refused)

def test_prp_list_in_unmapped_memory_is_a_data_transfer_error(ctrl):
    drv, _ = ctrl
    drv.io_queues(1)
    status, _ = drv.submit(1, 0x02, nsid=1, prp1=BUF, prp2=0x2000, cdw=(0, 0, 4 * PAGE // 512 - 1, 0, 0, 0))
    assert status == nvme_spec.Status.DATA_TRANSFER_ERROR
    assert drv.dev.stats()["commands"] >= 1 and not drv.dev.csts & nvme_spec.CSTS_CFS


def test_transfers_over_mdts_are_refused(ctrl):
    drv, _ = ctrl
    drv.io_queues(1)
    too_long = (PAGE << nvme_identity.MDTS) // 512 + 8
    assert drv.submit(1, 0x02, nsid=1, prp1=BUF, prp2=PRPLIST, cdw=(0, 0, too_long - 1, 0, 0, 0))[0] == \
        nvme_spec.Status.INVALID_FIELD


@pytest.fixture
def small_disk(tmp_path):
    """A file system of 200 KiB (tmpfs), unmounted after the test."""
    needs_root("mounting a small tmpfs")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k,mode=0700", "dxpu-test-small", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_write_the_full_disk_takes_only_in_part_is_a_write_fault(tmp_path, small_disk):
    """The second 128 KiB write fits only in part: it completes with Write Fault (never
    success), later ones too, and a read returns what is really in the file."""
    path = small_disk / "ns1"
    drv, _ = enabled_controller(tmp_path, namespaces=[{"size": 1 << 20, "path": str(path)}], io_workers=0)
    try:
        drv.io_queues(1)
        chunk = 128 << 10
        data = os.urandom(chunk)
        put(drv, DATA, data)
        assert rw_through_list(drv, 0x01, 0, chunk) == 0
        for lba in (chunk // 512, 2 * chunk // 512):
            status = rw_through_list(drv, 0x01, lba, chunk)
            assert status_of(status) == nvme_spec.Status.WRITE_FAULT and status & nvme_spec.DNR
        with open(path, "rb") as f:
            on_disk = f.read()
        assert on_disk[:chunk] == data  # what did complete is there, whole
        put(drv, DATA, bytes(chunk))
        assert rw_through_list(drv, 0x02, chunk // 512, chunk) == 0
        assert get(drv, DATA, chunk) == on_disk[chunk:2 * chunk]
        assert drv.dev.stats()["bytes_written"] == chunk
    finally:
        drv.dev.close()


def allocated(path) -> int:
    return os.stat(path).st_blocks * 512


def dsm_deallocate(drv: Driver, ranges: list[tuple[int, int]]) -> int:
    """Dataset Management with AD set over (start lba, blocks) ranges; its status."""
    put(drv, PRPLIST, b"".join(struct.pack("<IIQ", 0, nlb, start) for start, nlb in ranges))
    return drv.submit(1, 0x09, nsid=1, prp1=PRPLIST, cdw=(len(ranges) - 1, 4, 0, 0, 0, 0))[0]


def test_deallocate_punches_holes_that_read_zero(ctrl, tmp_path):
    drv, _ = ctrl
    drv.io_queues(1)
    assert drv.submit(0, 0x06, nsid=1, prp1=BUF, cdw=(0, 0, 0, 0, 0, 0))[0] == 0
    assert get(drv, BUF, PAGE)[33] & 0x07 == 1  # DLFEAT: a deallocated block reads zero
    put(drv, DATA, os.urandom(128 << 10))
    for lba in range(0, 1024, 256):  # 512 KiB written
        assert rw_through_list(drv, 0x01, lba, 128 << 10) == 0
    assert drv.submit(1, 0x00, nsid=1)[0] == 0
    assert allocated(tmp_path / "ns1") >= 512 << 10
    assert dsm_deallocate(drv, [(0, 256), (256, 768)]) == 0
    assert allocated(tmp_path / "ns1") < 64 << 10, "the blocks are still allocated"
    assert os.path.getsize(tmp_path / "ns1") == 1 << 20
    assert rw_through_list(drv, 0x02, 128, 128 << 10) == 0
    assert get(drv, DATA, 128 << 10) == bytes(128 << 10)


def test_deallocate_over_2_gib_frees_and_zeroes_all_of_it(tmp_path):
    size = 3 << 30  # sparse: costs what is written
    drv, _ = enabled_controller(tmp_path, namespaces=[{"size": size, "path": str(tmp_path / "big")}], io_workers=0)
    try:
        drv.io_queues(1)
        far = (5 << 29) // 512  # 2.5 GiB
        put(drv, DATA, os.urandom(4 * PAGE))
        assert rw_through_list(drv, 0x01, far, 4 * PAGE) == 0
        assert dsm_deallocate(drv, [(0, size // 512)]) == 0
        assert allocated(tmp_path / "big") == 0
        assert rw_through_list(drv, 0x02, far, 4 * PAGE) == 0
        assert get(drv, DATA, 4 * PAGE) == bytes(4 * PAGE)
    finally:
        drv.dev.close()


def test_deallocate_out_of_range_changes_nothing(ctrl, tmp_path):
    drv, _ = ctrl
    drv.io_queues(1)
    data = os.urandom(4 * PAGE)
    put(drv, DATA, data)
    assert rw_through_list(drv, 0x01, 0, 4 * PAGE) == 0
    assert dsm_deallocate(drv, [(0, 32), ((1 << 20) // 512 - 1, 2)]) == nvme_spec.Status.LBA_OUT_OF_RANGE
    assert rw_through_list(drv, 0x02, 0, 4 * PAGE) == 0 and get(drv, DATA, 4 * PAGE) == data


def test_write_zeroes_with_deac_deallocates_without_it_zeroes(ctrl, tmp_path):
    drv, _ = ctrl
    drv.io_queues(1)
    put(drv, DATA, os.urandom(128 << 10))
    assert rw_through_list(drv, 0x01, 0, 128 << 10) == 0
    assert rw_through_list(drv, 0x01, 256, 128 << 10) == 0
    assert drv.submit(1, 0x00, nsid=1)[0] == 0
    before = allocated(tmp_path / "ns1")
    assert drv.submit(1, 0x08, nsid=1, cdw=(0, 0, 255 | (1 << 25), 0, 0, 0))[0] == 0  # DEAC
    assert drv.submit(1, 0x08, nsid=1, cdw=(256, 0, 255, 0, 0, 0))[0] == 0
    assert allocated(tmp_path / "ns1") <= before - (128 << 10)
    assert rw_through_list(drv, 0x02, 0, 128 << 10) == 0 and get(drv, DATA, 128 << 10) == bytes(128 << 10)
    assert rw_through_list(drv, 0x02, 256, 128 << 10) == 0 and get(drv, DATA, 128 << 10) == bytes(128 << 10)


def test_a_namespace_without_path_leaves_no_file_whatever_ends_the_process(tmp_path):
    """Without ``path`` a namespace is a file with no name: it works, and nothing is left
    in the temp dir while the device runs or after SIGTERM (it used to be 64 MiB each time)."""
    import signal
    import sys
    script = ("import os, sys\n"
              "from qemu_device.nvme import NvmeController\n"
              "dev = NvmeController()\n"
              "ns = dev.namespaces[1]\n"
              "os.pwrite(ns.fd, b'x' * 4096, 0)\n"
              "assert os.pread(ns.fd, 4096, 0) == b'x' * 4096 and os.fstat(ns.fd).st_size == 64 << 20\n"
              "print('ready', flush=True)\n"
              "sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        assert proc.stdout.readline() == "ready\n"
        assert os.listdir(tmp_path) == []
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    assert os.listdir(tmp_path) == []


# --- controller reset, Abort and what Linux's nvme driver does on recovery (issue 17) ------------

def abort(drv: Driver, sqid: int, cid: int) -> tuple[int, int]:
    """Abort (CDW10: SQID | CID << 16); its (status, Dword 0)."""
    return drv.submit(0, 0x08, cdw=(sqid | cid << 16, 0, 0, 0, 0, 0))


def wait_not_ready(drv: Driver, timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while drv.r32(nvme_spec.CSTS) & nvme_spec.CSTS_RDY:
        assert time.monotonic() < deadline, "CSTS.RDY stayed up"
        time.sleep(0.001)


def fresh_queues(drv: Driver) -> None:
    """What a driver does before it enables again: its queue memory zeroed, its indexes back to 0."""
    for qid in range(QUEUES):
        for base in (sq_base(qid), cq_base(qid)):
            put(drv, base, bytes(0x1000))
    drv.tails = dict.fromkeys(range(QUEUES), 0)
    drv.cq_heads = dict.fromkeys(range(QUEUES), 0)
    drv.phases = dict.fromkeys(range(QUEUES), 1)


def test_abort_takes_back_a_command_not_started_and_leaves_a_running_one(tmp_path):
    """One I/O thread, held in the first read's DMA: the second read is taken but not
    started. Abort of it: it completes at once with Command Abort Requested, and the
    Abort's Dword 0 bit 0 is 0 (aborted). Abort of the running one: bit 0 is 1, and it
    completes normally once its DMA goes on."""
    drv, _ = enabled_controller(tmp_path, io_workers=1)
    try:
        drv.io_queues(1)
        a, b = bufs(2)
        reached, release = drv.ram.hold(a)
        running, waiting = drv.read(1, a), drv.read(1, b, lba=8)
        drv.ring(1)
        assert reached.wait(5)
        assert abort(drv, 1, waiting) == (0, 0), "the command not started was not aborted"
        [(cid, status, _, _)] = drv.reap(1)
        assert (cid, status) == (waiting, nvme_spec.Status.ABORT_REQUESTED)
        assert abort(drv, 1, running) == (0, 1), "a running command cannot be aborted here"
        assert abort(drv, 1, 999) == (0, 1)  # a CID not outstanding
        assert drv.nothing_completes(1, 0.2)
        release.set()
        assert drv.reap(1)[0][:2] == (running, 0)
        assert drv.nothing_completes(1, 0.2), "the aborted command completed a second time"
        assert not [c for c in drv.ram.calls if c[0] == "write" and c[1] == b], "the aborted read moved data"
        assert drv.dev.stats()["aborted"] == 1 and drv.dev.stats()["aborts"] == 3
    finally:
        drv.ram.holds[a][1].set()
        drv.dev.close()


def test_disable_during_the_fetch_of_entries_drops_rdy_only_after_it(ctrl):
    """CC.EN=0 while the controller is still reading the SQ entries a doorbell announced:
    RDY stays up until that read is over, and nothing from it runs after (no DMA once RDY
    is 0: the host frees the queue memory then)."""
    drv, _ = ctrl
    drv.io_queues(1)
    reached, release = drv.ram.hold(sq_base(1))
    drv.read(1, BUF)
    drv.ring(1)
    assert reached.wait(5)
    drv.w32(nvme_spec.CC, 0)
    assert drv.r32(nvme_spec.CSTS) & nvme_spec.CSTS_RDY, "RDY fell while the controller was reading the SQ"
    release.set()
    wait_not_ready(drv)
    seen = len(drv.ram.calls)
    time.sleep(0.2)
    assert drv.ram.calls[seen:] == [], "DMA after RDY fell"
    assert not [c for c in drv.ram.calls if c[1] == BUF], "a command fetched before the disable ran"


def test_disable_drops_commands_not_started_and_waits_for_the_running_one(tmp_path):
    drv, irq = enabled_controller(tmp_path, io_workers=1)
    try:
        drv.io_queues(1)
        a, b = bufs(2)
        reached, release = drv.ram.hold(a)
        drv.read(1, a)
        drv.read(1, b, lba=8)
        drv.ring(1)
        assert reached.wait(5)
        drv.w32(nvme_spec.CC, 0)
        assert drv.r32(nvme_spec.CSTS) & nvme_spec.CSTS_RDY
        writes, _ = drv.ram.cq_writes(1), irq.take()
        release.set()
        wait_not_ready(drv)
        time.sleep(0.2)
        assert drv.ram.cq_writes(1) == writes, "a completion into a queue of before the disable"
        assert not [c for c in drv.ram.calls if c[1] == b], "a command not started ran after the disable"
        assert not [e for e in irq.take() if e != ("intx", False)]
    finally:
        drv.ram.holds[a][1].set()
        drv.dev.close()


def test_delete_sq_completes_commands_not_started_as_aborted(tmp_path):
    drv, _ = enabled_controller(tmp_path, io_workers=1)
    try:
        drv.io_queues(1)
        a, b = bufs(2)
        reached, release = drv.ram.hold(a)
        running, waiting = drv.read(1, a), drv.read(1, b, lba=8)
        drv.ring(1)
        assert reached.wait(5)
        delete = drv.post(0, 0x00, cdw=(1, 0, 0, 0, 0, 0))
        drv.ring(0)
        [(cid, status, _, _)] = drv.reap(1)
        assert (cid, status) == (waiting, nvme_spec.Status.ABORTED_SQ_DELETION)
        assert drv.nothing_completes(0, 0.2), "Delete SQ did not wait for the running command"
        release.set()
        assert drv.reap(1)[0][:2] == (running, 0)
        assert drv.reap(0)[0][:2] == (delete, 0)
    finally:
        drv.ram.holds[a][1].set()
        drv.dev.close()


def recover_like_linux(drv: Driver) -> None:
    """nvme_reset_work after nvme_dev_disable: enable, then what nvme_init_ctrl_finish,
    nvme_setup_io_queues and the namespace scan send; every command must succeed."""
    fresh_queues(drv)
    drv.enable()
    assert drv.submit(0, 0x06, prp1=BUF, cdw=(1, 0, 0, 0, 0, 0)) == (0, 0)  # Identify Controller
    ident = get(drv, BUF, PAGE)
    assert ident[261] & 0x02 and ident[258] == nvme_identity.ABORT_LIMIT  # LPA: effects log; ACL
    assert drv.submit(0, 0x02, prp1=BUF, cdw=(5 | (1023 << 16), 0, 0, 0, 0, 0))[0] == 0  # effects log
    assert struct.unpack_from("<I", drv.ram.ram, BUF - RAM_BASE + 1024 + 4)[0] == 0b11  # Write: CSUPP, LBCC
    assert drv.submit(0, 0x06, prp1=BUF, cdw=(6, 0, 0, 0, 0, 0))[0] == 0  # Identify NVM CS controller
    assert drv.submit(0, 0x09, cdw=(7, 1 | 1 << 16, 0, 0, 0, 0)) == (0, (7 << 16) | 7)  # Number of Queues
    assert drv.submit(0, 0x06, prp1=BUF, cdw=(2, 0, 0, 0, 0, 0))[0] == 0  # active namespaces
    assert drv.submit(0, 0x06, nsid=1, prp1=BUF, cdw=(3, 0, 0, 0, 0, 0))[0] == 0  # descriptors
    assert drv.submit(0, 0x06, nsid=1, prp1=BUF, cdw=(0, 0, 0, 0, 0, 0))[0] == 0  # Identify Namespace
    drv.io_queues(1)


def test_reset_with_io_in_flight_then_recovery_as_linux_does_it(ctrl):
    """nvme_dev_disable with a write in flight: Delete SQ and CQ, CC.EN=0, RDY=0; then the
    recovery's admin commands, all answered; the data written before and after is intact."""
    drv, _ = ctrl
    drv.io_queues(1)
    before, after = os.urandom(4096), os.urandom(4096)
    a, b = bufs(2)
    put(drv, a, before)
    reached, release = drv.ram.hold(a)
    write = drv.write(1, a, lba=40)
    drv.ring(1)
    assert reached.wait(5)
    delete_sq = drv.post(0, 0x00, cdw=(1, 0, 0, 0, 0, 0))
    drv.ring(0)
    release.set()  # the write ends, then Delete SQ completes
    assert drv.reap(1)[0][:2] == (write, 0)
    assert drv.reap(0)[0][:2] == (delete_sq, 0)
    assert drv.submit(0, 0x04, cdw=(1, 0, 0, 0, 0, 0)) == (0, 0)  # Delete CQ
    drv.w32(nvme_spec.CC, drv.r32(nvme_spec.CC) & ~1)
    wait_not_ready(drv)
    refused = drv.dev.stats()["admin_refused"]
    recover_like_linux(drv)
    assert drv.dev.stats()["admin_refused"] == refused, "a recovery command was refused"
    put(drv, b, after)
    assert drv.submit(1, 0x01, nsid=1, prp1=b, cdw=(48, 0, 7, 0, 0, 0)) == (0, 0)
    for lba, data in ((40, before), (48, after)):
        assert drv.submit(1, 0x02, nsid=1, prp1=BUF + 0x8000, cdw=(lba, 0, 7, 0, 0, 0)) == (0, 0)
        assert get(drv, BUF + 0x8000, 4096) == data


def test_shutdown_then_disable_then_enable_again(ctrl):
    """nvme_dev_disable(shutdown) keeps CC.EN=1 and sets CC.SHN; a later reset clears EN,
    then enables: the controller comes back with working queues."""
    drv, _ = ctrl
    drv.io_queues(1)
    drv.w32(nvme_spec.CC, drv.r32(nvme_spec.CC) | (1 << 14))
    assert drv.r32(nvme_spec.CSTS) & nvme_spec.CSTS_SHST == nvme_spec.CSTS_SHST_DONE
    drv.w32(nvme_spec.CC, drv.r32(nvme_spec.CC) & ~(1 | 3 << 14))
    wait_not_ready(drv)
    assert drv.r32(nvme_spec.CSTS) == 0
    recover_like_linux(drv)
    assert drv.submit(1, 0x02, nsid=1, prp1=BUF, cdw=(0, 0, 7, 0, 0, 0)) == (0, 0)


def test_repeated_resets_with_io_in_flight_leak_no_threads(tmp_path):
    """Twenty resets, each with reads in flight at CC.EN=0: the device's threads stay the
    worker and its pool, and every reset ends with RDY=0."""
    drv, _ = enabled_controller(tmp_path, io_workers=3)
    try:
        counts = []
        for _ in range(20):
            drv.io_queues(1)
            for i in range(6):
                drv.read(1, BUF + 0x1000 * i, lba=8 * i)
            drv.ring(1)
            drv.w32(nvme_spec.CC, 0)
            wait_not_ready(drv)
            counts.append(len([t for t in threading.enumerate() if t.name.startswith("nvme")]))
            fresh_queues(drv)
            drv.enable()
        assert max(counts) <= 1 + 3, counts
        assert drv.dev.stats()["enables"] == 21 and drv.dev.stats()["disables"] == 20
        assert drv.dev._in_flight == 0 and not drv.dev._not_started
    finally:
        drv.dev.close()


def test_log_page_offset_and_unknown_cs_identify(ctrl):
    drv, _ = ctrl
    assert drv.submit(0, 0x02, prp1=BUF, cdw=(5 | (255 << 16), 0, 1024, 0, 0, 0))[0] == 0  # from byte 1024
    assert struct.unpack_from("<I", drv.ram.ram, BUF - RAM_BASE + 4)[0] == 0b11  # the I/O Write entry
    assert drv.submit(0, 0x02, prp1=BUF, cdw=(2 | (1 << 16), 0, 4096, 0, 0, 0))[0] == nvme_spec.Status.INVALID_FIELD
    assert drv.submit(0, 0x06, prp1=BUF, cdw=(6, 2 << 24, 0, 0, 0, 0))[0] == nvme_spec.Status.INVALID_FIELD  # ZNS


class GatheringRam(PostedBlocks, CountingRam):
    """Guest RAM that logs posted-together blocks (tests/fakes.py)."""


def blocks(log: list[str]) -> list[list[str]]:
    """The writes of each posted-together block, in order (a write outside one fails)."""
    assert "write alone" not in log, log
    return [b.split()[1:] for b in " ".join(log).split("end") if b.strip()]


def test_a_batchs_data_and_completions_leave_together_until_a_command_that_may_wait(tmp_path):
    """The Reads of one doorbell, their pages and completion entries (and the interrupt
    after them) are one posted-together block: on a box one write to the network and one
    wake-up of the host's reader, not one per command. A command that may wait on the
    network (a Flush here) starts a block of its own: what was done leaves before it."""
    dev, ram, drv = on_a_box(tmp_path, GatheringRam)
    try:
        drv.io_queues(1)
        ram.log.clear()
        for i in range(2):
            drv.read(1, BUF + i * 8192, lba=16 * i, blocks=16)   # 8 KiB: two pages each
        drv.ring(1)
        assert len(drv.reap(1, 2)) == 2
        assert blocks(ram.log) == [["write"] * 6]
        ram.log.clear()
        drv.read(1, BUF, blocks=16)
        drv.post(1, 0x00, nsid=1)                                   # Flush
        drv.read(1, BUF + 8192, lba=16, blocks=16)
        drv.ring(1)
        assert len(drv.reap(1, 3)) == 3
        assert blocks(ram.log) == [["write"] * 3, ["write"] * 4], "the read before the Flush did not leave before it"
    finally:
        dev.close()
