"""An NVMe 1.4 controller that Linux's own nvme driver and nvme-cli drive.

What is here is what that driver uses: the controller registers and doorbells, enable,
disable, shutdown and reset; admin commands Identify (controller, namespace, active
namespace list, namespace descriptors), Create/Delete I/O SQ and CQ, Get/Set Features,
Get Log Page (error, SMART, firmware slot), Asynchronous Event Request (held), Abort,
Doorbell Buffer Config (shadow doorbells, where DMA reads are local);
I/O commands Read, Write, Flush, Write Zeroes and Dataset Management; PRP entries and
PRP lists; phase tags; one interrupt vector per completion queue (MSI; INTx works too).
The specification's names (registers, opcodes, statuses) are in :mod:`.nvme_spec`; what
the controller reports about itself (Identify data, log pages) is built by
:mod:`.nvme_identity`; a command's PRPs are walked by :mod:`.nvme_prp`.

Namespaces are files (sparse: only what is written costs disk); a completed Flush has
fsynced them. A write the file does not take whole is a Write Fault, deallocation punches
holes, and PRPs are checked and walked within the transfer's length (docs/devices/nvme.md,
"What a guest or a full disk cannot do"). Data moves through the DMA port in as few, as large transfers as the PRPs
allow (adjacent pages are merged).

Concurrency (docs/devices/nvme.md, "Commands in flight"): nothing runs on the thread that
delivered the doorbell write. The device's worker fetches the entries a doorbell announced
(one DMA read per batch) and runs admin commands itself, one at a time and in order. I/O
commands run on the worker too, in order (``io_workers = 0``, the default), or on a pool
of ``io_workers`` threads, so their DMA round trips overlap; they complete in the order
they finish. The pool pays off where DMA waits for a network round trip (a box); served
locally its hand-offs cost more than they overlap on this 2-core machine
(docs/benchmarks.md, "NVMe"). A Flush waits for the commands of its namespace
dispatched before it, then fsyncs. A queue pair deleted or reset while commands are in
flight gets no completion for them: Delete SQ waits for its commands, CC.EN=0 keeps
CSTS.RDY up until the commands in flight have ended.
"""

from __future__ import annotations

import enum
import itertools
import logging
import os
import struct
import tempfile
import threading
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from . import nvme_prp as prp
from .backing import punch_hole, write_all, zero_range
from .bars import BarSpec
from .device import BegunFetch, IrqConfig, PciFunction
from .header import PciIdentity
from .nvme_identity import LBA_SHIFT, MDTS, PAGE, identify, log_page
from .nvme_spec import (ACQ, AQA, ASQ, CAP, CC, CC_EN, CSTS, CSTS_CFS, CSTS_RDY, CSTS_SHST, CSTS_SHST_DONE,
                        CSTS_SHST_OCCURRING, DNR, DOORBELLS, INTMC, INTMS, OACS_DBBUF, VS, AdminOpcode,
                        CommandError, Feature, IoOpcode, Status)
from .ports import DmaError, Ring
from .worker import DeviceWorker, WorkerPool

log = logging.getLogger(__name__)

READ_FIELDS = struct.Struct("<I16xQQQI")  # from an entry's NSID: NSID, PRP1, PRP2, SLBA, CDW12
MAX_QUEUES = 8  # I/O queue pairs
MQES = 1023  # max queue entries - 1
PRP2_OFFSET = 32  # in a submission queue entry
PRP_LIST_PUSH = 8 << MDTS  # the most of a PRP list a transfer of MDTS reads (one entry a page, one more unaligned)
IO_WORKERS = 0  # I/O commands on the worker itself, in order; N > 0: a pool of N threads
PREFETCH_BYTES = 4 << 20  # the most write data one batch reads ahead (16 commands of 128 KiB: 2 MiB)
# An interrupt waits for the next batch only while the completions it covers moved at most
# this much: what the guest saves is an interrupt, what it pays is the wait for the next
# batch's bytes (with 128 KiB reads held too, local sequential reads lost 13-20 %: see
# docs/devices/nvme.md, "Doorbells and interrupts").
HOLD_BYTES = 64 << 10
DELETE_WAIT = 10.0  # s Delete SQ waits for the queue's commands in flight before dropping them
MSIX_TABLE, MSIX_PBA = 0x3000, 0x3800

# Set Features stores these and Get Features returns what was set (0 before); they change
# nothing here. Number of Queues is answered, not stored; any other FID is refused.
STORED_FEATURES = frozenset(Feature) - {Feature.NUMBER_OF_QUEUES}


# An admin command answered with these asked for something not served (counted, logged).
REFUSED = frozenset({Status.INVALID_OPCODE, Status.INVALID_FIELD, Status.INVALID_LOG_PAGE})

# Retrying these cannot help (the guest's own PRPs, a full or failing backing file): DNR set.
NO_RETRY = frozenset({Status.INVALID_PRP_OFFSET, Status.WRITE_FAULT, Status.UNRECOVERED_READ_ERROR})


class Deferred(enum.Enum):
    """An admin command's result when its completion is posted later, not now."""

    HELD = enum.auto()  # an Asynchronous Event Request: completes when there is an event


@dataclass(frozen=True)
class ReadData:
    """A Read's transfer, checked and not yet made: the file's bytes from ``offset`` to the
    PRP ``segments``. :meth:`NvmeController._complete` moves them together with the command's
    completion entry, so on a box the data and the entry are one DMA write (one message and
    one call into the link, not two), in that order: the entry never passes its data."""

    segments: list[tuple[int, int]]
    fd: int
    offset: int
    length: int


@dataclass
class WriteData:
    """A Write's PRP segments, checked, and its data if it was read ahead with its batch
    (``None``: that read failed, so the command reads again on its own)."""

    segments: list[tuple[int, int]]
    pieces: list[bytes] | None


@dataclass
class Queue:
    qid: int
    base: int
    size: int  # entries
    cqid: int = 0  # SQ: its completion queue
    vector: int = 0  # CQ: interrupt vector
    interrupts: bool = True  # CQ
    head: int = 0
    tail: int = 0
    phase: int = 1  # CQ
    begun: BegunFetch | None = None  # SQ on a network: the fetch its doorbell began
    sq_ids: set = field(default_factory=set)  # CQ: SQs that post here
    in_flight: int = 0  # SQ: commands taken from it that have not ended yet
    scheduled: bool = False  # SQ: a _process of it is queued and has not started yet


@dataclass(eq=False)
class IoJob:
    """An I/O command taken from its SQ and handed to the pool; until a thread starts it,
    an Abort (or its SQ's deletion) can still take it back."""

    sq: Queue
    sqe: memoryview
    nsid: int
    ticket: int
    lists: dict | None = None
    fetched: WriteData | None = None  # its data, read ahead with its batch (a Write)
    cancelled: bool = False  # completed by Abort or Delete SQ: the job does nothing when it runs
    key: tuple[int, int] = field(init=False)  # (SQ, CID): what an Abort names

    def __post_init__(self) -> None:
        self.key = self.sq.qid, struct.unpack_from("<H", self.sqe, 2)[0]


class Namespace:
    def __init__(self, nsid: int, path: str | None, size: int) -> None:
        self.nsid = nsid
        self.temporary = path is None
        if path is None:  # a file with no name: nothing is left behind, whatever ends the process
            self.fd, path = tempfile.mkstemp(prefix=f"dxpu-nvme-ns{nsid}-")
            os.unlink(path)
        else:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.path = path
        if os.fstat(self.fd).st_size < size:
            os.ftruncate(self.fd, size)  # sparse: costs nothing until written
        self.blocks = size >> LBA_SHIFT
        self.uuid = uuid.uuid5(uuid.NAMESPACE_URL, f"dxpu-nvme:{os.path.abspath(path)}").bytes

    def close(self) -> None:
        os.close(self.fd)


class NvmeController(PciFunction):
    """``namespaces``: list of {"size": bytes, "path": file or None (a temp file)}."""

    def __init__(self, *, namespaces: list[dict] | None = None, serial: str | None = None,
                 msi_vectors: int = 8, msix: bool = False, io_workers: int = IO_WORKERS) -> None:
        # MSI-X (table and PBA in BAR0 above the doorbells) only on request: QEMU 11.1
        # aborts when a vfio-user device with MSI-X is unplugged (docs/architecture.md, "QEMU").
        irq = IrqConfig(intx=True, msix_vectors=MAX_QUEUES + 1, msix_bar=0, msix_table_offset=MSIX_TABLE,
                        msix_pba_offset=MSIX_PBA) if msix else IrqConfig(intx=True, msi_vectors=msi_vectors)
        super().__init__(PciIdentity(0x1B36, 0x10F1, 0x010802, revision=1), [BarSpec(0, 16 << 10, "mem64")], irq)
        specs = namespaces or [{"size": 64 << 20, "path": None}]
        self.namespaces = {i: Namespace(i, s.get("path"), int(s["size"])) for i, s in enumerate(specs, start=1)}
        # The serial names the NVM subsystem: two controllers with one serial are refused by
        # Linux ("duplicate cntlid"). By default it follows the backing files, so a device
        # keeps its identity across replugs and restarts of its proxy.
        self.serial = serial or "DX" + uuid.uuid5(uuid.NAMESPACE_URL, "|".join(
            ns.path for ns in self.namespaces.values())).hex[:18].upper()
        self.worker = DeviceWorker("nvme")  # fetches entries, runs admin commands in order
        if io_workers < 0:
            raise ValueError(f"io_workers must be 0 (I/O on the worker) or a thread count, not {io_workers}")
        self.io_pool = WorkerPool("nvme-io", io_workers) if io_workers else None  # I/O side by side
        self.stats_counters = {"commands": 0, "errors": 0, "bytes_read": 0, "bytes_written": 0, "flushes": 0,
                               "io_in_flight_peak": 0, "aborts": 0, "aborted": 0, "admin_refused": 0,
                               "enables": 0, "disables": 0, "sq_fetches": 0, "shadow_tails": 0}
        self._features: dict[int, int] = {}
        # Commands in flight survive a reset of the registers (they are still running):
        self._ended = threading.Condition(self.lock)  # notified whenever a command ends
        self._in_flight = 0  # commands taken from any SQ that have not ended
        self._fetches = 0  # SQ entries or PRP lists being read for commands not yet counted in flight
        self._not_started: dict[tuple[int, int], IoJob] = {}  # (sqid, cid) -> a job no thread has started
        self._tickets = itertools.count()  # I/O commands in the order they were taken
        self._ns_pending: dict[int, set[int]] = {}  # nsid -> tickets of its commands in flight
        self.sqs: dict[int, Queue] = {}
        self.reset_registers()

    # --- registers -----------------------------------------------------------------------
    def reset_registers(self) -> None:
        for qid in self.sqs:  # the I/O SQs' doorbells announce nothing any more
            if qid:
                self.dma_watch_ring(qid, None)
        self.cc = self.csts = self.aqa = self.asq = self.acq = self.intms = 0
        self.sqs: dict[int, Queue] = {}
        self.cqs: dict[int, Queue] = {}
        self.pending_aers: list[int] = []
        self._features = {}
        # Doorbell Buffer Config: (shadow doorbells page, event index page) in guest memory
        self.dbbuf: tuple[int, int] | None = None
        self._draining = False  # CC.EN went to 0 with commands in flight: RDY falls when they end
        self._shutdown_pending = False  # CC.SHN with commands in flight: done when they end

    def _cap(self) -> int:
        return MQES | (1 << 16) | (10 << 24) | (1 << 37)  # CQR, 5 s timeout, NVM command set

    def bar_read(self, index: int, offset: int, size: int) -> int:
        regs = {CAP: self._cap(), VS: 0x00010400, INTMS: self.intms, INTMC: self.intms, CC: self.cc,
                CSTS: self.csts, AQA: self.aqa, ASQ: self.asq, ACQ: self.acq}
        base = offset & ~7 if offset & ~7 in (CAP, ASQ, ACQ) else offset & ~3
        value = regs.get(base, 0)
        return (value >> ((offset - base) * 8)) & ((1 << (size * 8)) - 1)

    def bar_write(self, index: int, offset: int, data: bytes) -> None:
        value = int.from_bytes(data, "little")
        if offset >= DOORBELLS:
            self._doorbell((offset - DOORBELLS) // 4, value & 0xFFFF)
        elif offset == CC:
            self._write_cc(value)
        elif offset == AQA:
            self.aqa = value
        elif offset in (ASQ, ASQ + 4, ACQ, ACQ + 4):
            reg = ASQ if offset in (ASQ, ASQ + 4) else ACQ
            shift = 32 if offset & 4 else 0
            old = self.asq if reg == ASQ else self.acq
            new = (old & ~(((1 << (len(data) * 8)) - 1) << shift)) | (value << shift)
            if reg == ASQ:
                self.asq = new
            else:
                self.acq = new
        elif offset == INTMS:
            self.intms |= value
        elif offset == INTMC:
            self.intms &= ~value

    def _busy(self) -> bool:
        """Whether a command or a fetch may still touch the queues' or buffers' memory (lock held)."""
        return bool(self._in_flight or self._fetches)

    def _write_cc(self, value: int) -> None:
        was, self.cc = self.cc, value
        if value & CC_EN and not was & CC_EN:
            self.sqs = {0: Queue(0, self.asq & ~0xFFF, (self.aqa & 0xFFF) + 1)}
            self.cqs = {0: Queue(0, self.acq & ~0xFFF, ((self.aqa >> 16) & 0xFFF) + 1, sq_ids={0})}
            self.csts = CSTS_RDY
            self.stats_counters["enables"] += 1
        elif not value & CC_EN and was & CC_EN:
            self.reset_registers()  # the queues are gone: nothing in flight completes into them
            self.cc = value
            self.stats_counters["disables"] += 1
            self.lower_interrupt()  # no completion is left to signal
            # Commands taken but not started are dropped now; running ones and fetches end
            # on their own. The host waits for RDY=0 before it reuses queue and buffer memory,
            # so RDY stays up until the last of them has ended (_ended_one).
            for job in self._not_started.values():
                job.cancelled = True
                self._end_accounting(job.sq, job.nsid, job.ticket)
            self._not_started.clear()
            self._ended.notify_all()
            if self._busy():
                self._draining, self.csts = True, CSTS_RDY
        if (value >> 14) & 3:  # shutdown notification: flush and report done
            if self._busy():  # the last command to end does it (_ended_one)
                self._shutdown_pending = True
                self.csts = (self.csts & ~CSTS_SHST) | CSTS_SHST_OCCURRING
            else:
                self._fsync_all()
                self.csts = (self.csts & ~CSTS_SHST) | CSTS_SHST_DONE

    def _fsync_all(self) -> None:
        for ns in self.namespaces.values():
            os.fsync(ns.fd)

    def _doorbell(self, index: int, value: int) -> None:
        qid, is_cq = index // 2, index % 2
        if not self.csts & CSTS_RDY:
            return
        if is_cq:
            cq = self.cqs.get(qid)
            if cq is not None:
                cq.head = value % cq.size
                if all(q.head == q.tail for q in self.cqs.values()):
                    self.lower_interrupt()  # INTx: the line stays up while entries wait
            return
        sq = self.sqs.get(qid)
        if sq is not None:
            if self._shadow_slots(qid) is not None:
                if not self.dma_reads_wait_on_network:
                    # only a kick: the worker reads the tail from the shadow, which the guest
                    # wrote first, so a late MMIO value can never move the tail back
                    self._schedule(sq)
                    return
                # on a box the host read the shadow for us and sent its tail (RingWatch.shadow);
                # one that would move the tail back (a register write that came late) is stale
                if (value - sq.head) % sq.size < (sq.tail - sq.head) % sq.size:
                    return
            sq.tail = value % sq.size
            if sq.begun is None and sq.head != sq.tail:
                # on a network the fetch's request leaves from the thread that took the
                # doorbell: the worker's wake-up overlaps its round trip instead of preceding it
                first, count = sq.head, min((sq.tail - sq.head) % sq.size, sq.size - sq.head)
                sq.begun = self.dma_fetch_begin(first, count, [(sq.base + first * 64, count * 64)])
            self._schedule(sq)

    def _schedule(self, sq: Queue) -> None:
        """Have the worker take what ``sq`` holds (lock held). One queued :meth:`_process`
        per SQ is enough: it starts after this doorbell and reads the tail then, so the
        doorbells that come while it waits in line add nothing (on a busy box a doorbell
        per command each cost the reader a queue put and the worker an empty round)."""
        if not sq.scheduled:
            sq.scheduled = True
            self.worker.submit(lambda: self._process(sq.qid))

    # --- the command loop (worker thread, I/O pool) -------------------------------------------
    def _process(self, qid: int) -> None:
        """Take what the submission queue holds (on the worker). All entries the doorbell
        announced are fetched with one DMA read (up to the ring's end): on a remote device
        that is one network round trip for the batch, not one per command. Admin commands
        run here, in order; I/O commands go to the pool, or run here as runs whose
        interrupts may wait in ``held`` for the next batch (:meth:`_process_batches`);
        whatever way this ends, an interrupt owed is raised."""
        with self.lock:
            sq = self.sqs.get(qid)
            if sq is not None:
                sq.scheduled = False  # a doorbell from now on queues another round
        held: dict[int, Queue] = {}  # CQs owed an interrupt for completions already written
        try:
            self._process_batches(qid, held)
        finally:
            if held:
                self._signal(held.values())

    def _process_batches(self, qid: int, held: dict[int, Queue]) -> None:
        held_bytes = 0  # data moved by the completions ``held`` covers
        while True:
            if not self._has_entries(qid):
                return
            with self.lock:
                sq = self.sqs.get(qid)
                if sq is None or sq.head == sq.tail or not self.csts & CSTS_RDY:
                    return
                first = sq.head
                count = (sq.tail - first) % sq.size
                count = min(count, sq.size - first)  # do not wrap inside one read
                self._fetches += 1  # a disable keeps RDY up until this read is over
                self.stats_counters["sq_fetches"] += 1  # commands / sq_fetches: the batch a doorbell brings
                begun, sq.begun = sq.begun, None
                if begun is not None and begun.covers(first, count):
                    count, finish = begun.count, begun.finish  # what the doorbell fetched; the rest next round
                else:
                    finish = None
            try:
                raw = finish()[0] if finish is not None else self.dma_read(sq.base + first * 64, count * 64)
                batch = memoryview(raw)
            except DmaError:
                with self.lock:
                    self.csts |= CSTS_CFS  # the controller cannot reach its own queue
                self._fetch_done()
                return
            except BaseException:  # never leave a fetch counted: RDY would never fall
                self._fetch_done()
                raise
            if qid == 0:
                self._fetch_done()  # from here each command counts itself in flight
                for i in range(count):
                    with self.lock:
                        if self.sqs.get(qid) is not sq:
                            return  # deleted or reset meanwhile
                        sq.head = (first + i + 1) % sq.size
                        self._begin(sq)
                    try:
                        self._execute(sq, batch[i * 64:(i + 1) * 64])
                    finally:
                        self._end(sq)
                continue
            try:
                with self.lock:
                    if self.sqs.get(qid) is not sq:
                        return
                    sq.head = (first + count) % sq.size  # the whole batch is in our hands
                    sqes = [batch[i * 64:(i + 1) * 64] for i in range(count)]
                lists = self._prefetch_prp_lists(sqes)  # one round trip for the batch's PRP lists
                # and, run inline, one for its write data (a pool overlaps each command's own reads)
                # (on local memory a read ahead would only add a copy: the file takes it from the mapping)
                ahead = self.io_pool is None and self.dma_reads_wait_on_network
                fetched = self._prefetch_write_data(sqes, lists) if ahead else {}
                with self.lock:
                    if self.sqs.get(qid) is not sq:
                        return
                    jobs = [self._dispatch(sq, sqe, lists, fetched.get(i)) for i, sqe in enumerate(sqes)]
            finally:
                self._fetch_done()
            if self.io_pool is not None:
                for job in jobs:  # in ticket order: a Flush is never taken before what it waits for
                    self.io_pool.submit(lambda job=job: self._run_io(job))
                continue
            # inline, in order (a Flush after what it waits for), as runs: one interrupt per
            # run, after its last completion (what Linux's handler reaps in one go), and on a
            # box the run's data, completions and interrupt leave as one network write. A run
            # ends before a command that may wait on the network (up to a completion
            # timeout): what is done must not wait with it. The batch's last run keeps its
            # interrupt for the next batch while more entries are already waiting: one
            # interrupt for both, where the guest would take one for each (TCG pays for
            # every one); the queue holds at most its size, so the wait is bounded.
            runs = list(self._runs(jobs))
            for i, run in enumerate(runs):
                with self.dma_posted_together():
                    self._run_inline(run, held)
                    held_bytes += sum(map(self._data_bytes, run))
                    if held and (i < len(runs) - 1 or held_bytes > HOLD_BYTES
                                 or not self._has_entries(qid, publish=False)):
                        self._signal(held.values())
                        held.clear()
                        held_bytes = 0

    @classmethod
    def _data_bytes(cls, job: IoJob) -> int:
        """The bytes a Read or Write moves through guest memory (0 for other commands)."""
        return prp.transfer(job.sqe)[2] if job.sqe[0] in (IoOpcode.READ, IoOpcode.WRITE) else 0

    def _runs(self, jobs: list[IoJob]) -> Iterator[list[IoJob]]:
        """A batch's jobs in order, cut before each that :meth:`_may_wait_on_network`."""
        run: list[IoJob] = []
        for job in jobs:
            if run and self._may_wait_on_network(job):
                yield run
                run = []
            run.append(job)
        if run:
            yield run

    def _may_wait_on_network(self, job: IoJob) -> bool:
        """Whether running ``job`` may wait on a box for guest memory over the network: a
        Write whose data was not read ahead with its batch, a Read whose PRP list was not
        (or spans a second page), a Flush (its fsync takes the disk's time), anything else
        that reads guest memory. Conservative: False only where nothing can wait."""
        if not self.dma_reads_wait_on_network:
            return False
        opcode = job.sqe[0]
        if opcode == IoOpcode.WRITE:
            return job.fetched is None or job.fetched.pieces is None
        if opcode == IoOpcode.WRITE_ZEROES:
            return False
        if opcode != IoOpcode.READ:
            return True
        page = prp.first_list_page(job.sqe)
        if page is None:
            return False  # PRP1 and PRP2 are the pages (or the PRPs are refused unread)
        first, continues = page
        return continues or not job.lists or first not in job.lists

    # --- shadow doorbells (Doorbell Buffer Config) -------------------------------------------
    def _shadow_slots(self, qid: int, cq: bool = False) -> tuple[int, int] | None:
        """(shadow doorbell, event index) addresses of an I/O queue, or None (lock held or
        not: ``dbbuf`` is replaced whole). Laid out as the doorbells are (stride 0)."""
        dbbuf = self.dbbuf
        if dbbuf is None or qid == 0:
            return None
        offset = qid * 8 + (4 if cq else 0)
        return dbbuf[0] + offset, dbbuf[1] + offset

    def _has_entries(self, qid: int, publish: bool = True) -> bool:
        """Does SQ ``qid`` hold entries not taken yet (worker)? With a shadow doorbell the
        guest rings the MMIO doorbell only when the event index asks, so the tail is read
        from the shadow; before going idle the worker publishes the tail it has seen as
        the event index (the guest's next entry then rings) and reads the shadow once more,
        for an entry written in between. Without ``publish`` (a run asking whether to hold
        its interrupt, not a worker going idle) it only reads. On a box the next batch is
        served from the host's pushes, or, where the host could not push it, costs a round
        trip a held interrupt waits."""
        with self.lock:
            sq = self.sqs.get(qid)
            if sq is None or not self.csts & CSTS_RDY:
                return False
            if sq.head != sq.tail:
                return True
            slots = self._shadow_slots(qid)
        if slots is None:
            return False
        doorbell, event_index = slots
        try:
            if self.dma_reads_wait_on_network:
                # on a box the host reads the shadow (a round trip here): we publish the tail
                # we have seen, and after that write the host reads the shadow and rings for
                # us if the guest went past it meanwhile (RingWatch.shadow)
                if publish:
                    self.dma_write(event_index, struct.pack("<I", sq.tail))
                return False
            if self._read_shadow_tail(sq, doorbell):
                return True
            if not publish:
                return False
            self.dma_write(event_index, struct.pack("<I", sq.tail))
            return self._read_shadow_tail(sq, doorbell)
        except DmaError:
            with self.lock:
                self.csts |= CSTS_CFS  # the controller cannot reach its own doorbells
            return False

    def _read_shadow_tail(self, sq: Queue, doorbell: int) -> bool:
        value = struct.unpack("<I", self.dma_read(doorbell, 4))[0]
        with self.lock:
            if self.sqs.get(sq.qid) is not sq:
                return False
            sq.tail = value % sq.size  # as an MMIO doorbell's value would be
            self.stats_counters["shadow_tails"] += 1
            return sq.head != sq.tail

    def _doorbell_buffer_config(self, shadow: int, event_index: int) -> None:
        """Doorbell Buffer Config: both pages page aligned; the I/O queues that exist get
        their shadows set to the doorbells' values now (as QEMU's nvme does), and every
        I/O queue is read through its shadow from here until the controller is reset."""
        if not self._identify_oacs() & OACS_DBBUF:
            raise CommandError(Status.INVALID_OPCODE)
        if shadow % PAGE or event_index % PAGE:
            raise CommandError(Status.INVALID_FIELD)
        with self.lock:
            self.dbbuf = (shadow, event_index)
            values = [(qid * 8, sq.tail) for qid, sq in self.sqs.items() if qid] + \
                     [(qid * 8 + 4, cq.head) for qid, cq in self.cqs.items() if qid]
        self.dma_write_many([(shadow + offset, struct.pack("<I", value)) for offset, value in values])
        with self.lock:  # on a box the host reads the shadows from now on (written first: no old bytes)
            for sq in self.sqs.values():
                if sq.qid:
                    self.dma_watch_ring(sq.qid, self._sq_ring(sq))

    def _identify_oacs(self) -> int:
        """Shadow doorbells save the guest its MMIO doorbell writes (a trap into QEMU and a
        message each), but on a GPU box every read of a shadow would be a network round trip:
        there the controller offers them only where the host reads the shadows for it
        (``DmaPort.reads_shadows``, the link's RingWatch.shadow)."""
        return OACS_DBBUF if not self.dma_reads_wait_on_network or self.dma_reads_shadows else 0

    def _begin(self, sq: Queue) -> None:
        """Count a command as in flight (lock held)."""
        sq.in_flight += 1
        self._in_flight += 1

    def _prefetch_prp_lists(self, sqes: list[memoryview]) -> dict[tuple[int, int], bytes]:
        """The first PRP list page of every read and write in a batch, fetched together:
        on a remote device one round trip for the batch instead of one per command. Only
        what :func:`.nvme_prp.segments` would read first, keyed by (address, length); it checks them."""
        wanted = [first for first, _ in filter(None, map(prp.first_list_page, sqes))]
        if not wanted:
            return {}
        try:
            return dict(zip(wanted, self.dma_read_many(wanted)))
        except DmaError:
            return {}  # each command then reads (and fails) on its own

    def _prefetch_write_data(self, sqes: list[memoryview],
                             lists: dict[tuple[int, int], bytes]) -> dict[int, WriteData]:
        """The data of the batch's Writes (up to PREFETCH_BYTES), read with one scatter list:
        on a remote device the batch's pages are one pipelined transfer, not a round trip
        per command. Keyed by the entry's place in the batch; a Write whose PRPs are bad, or
        that does not fit, is left to read (and fail) on its own. Reading the data before
        the command runs is what a controller may do: nothing orders commands in a queue."""
        chosen: dict[int, list[tuple[int, int]]] = {}
        total = 0
        for i, sqe in enumerate(sqes):
            if sqe[0] != IoOpcode.WRITE:
                continue
            prp1, prp2, length = prp.transfer(sqe)
            if length > (PAGE << MDTS) or total + length > PREFETCH_BYTES:
                continue
            try:
                chosen[i] = prp.segments(prp1, prp2, length, self.dma_read, lists)
            except (CommandError, DmaError):
                continue
            total += length
        if not chosen:
            return {}
        wanted = [segment for segments in chosen.values() for segment in segments]
        try:
            pieces = iter(self.dma_read_many(wanted))
        except DmaError:  # each command reads again on its own and fails with its own status
            return {i: WriteData(segments, None) for i, segments in chosen.items()}
        return {i: WriteData(segments, [next(pieces) for _ in segments]) for i, segments in chosen.items()}

    def _dispatch(self, sq: Queue, sqe: memoryview, lists: dict[tuple[int, int], bytes] | None = None,
                  fetched: WriteData | None = None) -> IoJob:
        """An I/O command as a job, counted in flight from now on and abortable until a
        thread starts it (lock held)."""
        nsid = struct.unpack_from("<I", sqe, 4)[0]
        job = IoJob(sq, sqe, nsid, next(self._tickets), lists, fetched)
        self._ns_pending.setdefault(nsid, set()).add(job.ticket)
        self._begin(sq)
        self._not_started[job.key] = job
        peak = self.stats_counters["io_in_flight_peak"]
        self.stats_counters["io_in_flight_peak"] = max(peak, self._in_flight)
        return job

    def _run_io(self, job: IoJob, held: dict[int, Queue] | None = None) -> None:
        """One I/O command on a pool thread (or the worker); dropped if its queue went away
        before it ran, nothing at all if an Abort or a disable took it back. With ``held``
        it runs inside its run's posted block; alone it is a block of its own."""
        sq = job.sq
        with self.lock:
            if not self._take(job):
                return
        try:  # from here the command ends whatever happens (_end)
            with self.lock:
                if self.sqs.get(sq.qid) is not sq:
                    return
                if job.sqe[0] == IoOpcode.FLUSH:  # after the commands of its namespace taken before it
                    self._ended.wait_for(lambda: min(self._ns_pending[job.nsid]) == job.ticket)
            if held is not None:
                self._execute(sq, job.sqe, job.lists, job.fetched, held)
                return
            with self.dma_posted_together():  # a Read's data, its completion and interrupt: one write on a box
                self._execute(sq, job.sqe, job.lists, job.fetched, held)
        finally:
            self._end(sq, job.nsid, job.ticket)

    def _take(self, job: IoJob) -> bool:
        """A thread starts ``job`` (lock held): no Abort can take it back from now on. False
        if one did, or a disable, first (its completion, if any, is posted and it has ended)."""
        if self._not_started.get(job.key) is job:
            del self._not_started[job.key]
        return not job.cancelled

    def _run_inline(self, run: list[IoJob], held: dict[int, Queue]) -> None:
        """A run on the worker, in order: each stretch of Reads by :meth:`_run_reads`,
        anything else by :meth:`_run_io`."""
        for is_read, stretch in itertools.groupby(run, lambda job: job.sqe[0] == IoOpcode.READ):
            if is_read:
                self._run_reads(list(stretch), held)
            else:
                for job in stretch:
                    self._run_io(job, held)

    def _run_reads(self, jobs: list[IoJob], held: dict[int, Queue]) -> None:
        """Reads of one SQ run on the worker: :meth:`_run_io`'s and :meth:`_execute`'s steps
        for each, each completed with its data, and all of them ended together after the
        last. Per Read that is one lock round to take it instead of two, and no lock round
        and wake-up to end it (the controller's Python is most of a box's CPU per 4 KiB
        read). Ending them together is safe: a Flush, the one command that waits for others
        to end, is never among them, and a disable or shutdown waiting for the queues to go
        quiet waits for the run."""
        taken: list[IoJob] = []
        try:
            for job in jobs:
                sq = job.sq
                with self.lock:
                    if not self._take(job):
                        continue
                    taken.append(job)
                    if self.sqs.get(sq.qid) is not sq:
                        continue
                status, data = Status.SUCCESS, None
                try:
                    data = self._read_data(job.sqe, job.lists)
                except Exception as exc:  # noqa: BLE001 - the command completes whatever happened
                    status = self._failed(exc, IoOpcode.READ, sq.qid)
                self._complete(sq, job.key[1], status, 0, held, data)
        finally:
            with self.lock:
                for job in taken:
                    self._end_accounting(job.sq, job.nsid, job.ticket)
            if taken:
                self._ended_one()

    def _take_back(self, job: IoJob, status: Status) -> bool:
        """Complete a command no thread has started with ``status`` and end it (Abort,
        Delete SQ); the job then does nothing when a thread gets to it. False if a thread
        started it first (call without the lock: the completion is a DMA)."""
        with self.lock:
            if self._not_started.get(job.key) is not job or job.cancelled:
                return False
            del self._not_started[job.key]
            job.cancelled = True
            self.stats_counters["aborted"] += 1
        self._complete(job.sq, job.key[1], status, 0)
        self._end(job.sq, job.nsid, job.ticket)
        return True

    def _end_accounting(self, sq: Queue, nsid: int | None, ticket: int | None) -> None:
        """Count a command as ended (lock held); :meth:`_ended_one` then acts on it."""
        if ticket is not None:
            pending = self._ns_pending[nsid]
            pending.discard(ticket)
            if not pending:  # a guest naming many bad NSIDs must not grow this
                del self._ns_pending[nsid]
        sq.in_flight -= 1
        self._in_flight -= 1

    def _end(self, sq: Queue, nsid: int | None = None, ticket: int | None = None) -> None:
        """A command has ended (its completion, if any, written): wake who waits for that."""
        with self.lock:
            self._end_accounting(sq, nsid, ticket)
        self._ended_one()

    def _fetch_done(self) -> None:
        with self.lock:
            self._fetches -= 1
        self._ended_one()

    def _ended_one(self) -> None:
        """After a command or fetch ended: once nothing may touch guest memory any more, a
        pending disable drops RDY and a pending shutdown fsyncs and reports done."""
        with self.lock:
            shutdown = False
            if not self._busy():
                if self._draining:
                    self._draining = False
                    if not self.cc & CC_EN:
                        self.csts &= ~CSTS_RDY
                shutdown, self._shutdown_pending = self._shutdown_pending, False
            self._ended.notify_all()
        if shutdown:
            self._fsync_all()
            with self.lock:
                self.csts = (self.csts & ~CSTS_SHST) | CSTS_SHST_DONE

    def _execute(self, sq: Queue, sqe: memoryview, lists: dict[tuple[int, int], bytes] | None = None,
                 fetched: WriteData | None = None, held: dict[int, Queue] | None = None) -> None:
        opcode, cid = sqe[0], struct.unpack_from("<H", sqe, 2)[0]
        result: int | Deferred | ReadData = 0
        status = Status.SUCCESS
        try:
            result = (self._admin(opcode, sqe) if sq.qid == 0 else self._io(opcode, sqe, lists, fetched)) or 0
        except Exception as exc:  # noqa: BLE001 - the command completes whatever happened
            status = self._failed(exc, opcode, sq.qid)
        if result is Deferred.HELD:
            return
        if isinstance(result, ReadData):
            if held is not None:  # a run on the worker: nothing completes between slot and entry
                self._complete(sq, cid, status, 0, held, result)
                return
            # on a pool the slot is taken once the data is there: a slow transfer must not
            # keep the completions of the commands beside it from the guest
            status, result = self._move_read(result) or Status.SUCCESS, 0
        if sq.qid == 0 and status in REFUSED:  # what a driver asked that is not served: worth knowing
            log.info("NVMe admin opcode %#x (CDW10 %#x) refused: %s", opcode,
                     struct.unpack_from("<I", sqe, 40)[0], status.name)
            self._count("admin_refused")
        self._complete(sq, cid, status, result, held)

    @staticmethod
    def _failed(exc: Exception, opcode: int, qid: int) -> Status:
        """The status a command completes with when running it raised ``exc``."""
        if isinstance(exc, CommandError):
            return exc.status
        if isinstance(exc, DmaError):
            return Status.DATA_TRANSFER_ERROR
        if not isinstance(exc, OSError):  # a bug or a case not foreseen: the command still completes
            log.error("NVMe opcode %#x on queue %d failed", opcode, qid, exc_info=exc)
        return Status.INTERNAL_ERROR

    def _complete(self, sq: Queue, cid: int, status: Status, result: int, held: dict[int, Queue] | None = None,
                  data: ReadData | None = None) -> None:
        """Post a completion: the CQ slot, phase and the SQ head it reports are taken under
        the lock (several threads complete at once); the entry is written without it. A
        Read's ``data`` is moved first, in the same DMA write; if that fails, the entry
        alone says so (Unrecovered Read Error for the file, Data Transfer Error for DMA)."""
        with self.lock:
            cq = self.cqs.get(sq.cqid)
            if self.sqs.get(sq.qid) is not sq or cq is None:
                return  # the queue pair was deleted or the controller reset
            self.stats_counters["commands"] += 1
            self.stats_counters["errors"] += status != Status.SUCCESS
            head, phase = sq.head, cq.phase
            entry = self._entry(result, head, sq.qid, cid, status, phase)
            addr = cq.base + cq.tail * 16
            cq.tail = (cq.tail + 1) % cq.size
            if cq.tail == 0:
                cq.phase ^= 1
            slots = self._shadow_slots(cq.qid, cq=True)
            if slots is not None and not self.intx_in_use():
                slots = None
            event = (cq.tail - 1) % cq.size
        try:
            if data is None:
                self.dma_write(addr, entry)
            elif (failed := self._move_read(data, [(addr, entry)])) is not None:
                self._count("errors")
                self.dma_write(addr, self._entry(0, head, sq.qid, cid, failed, phase))
            if slots is not None:  # INTx stays asserted until every CQ is consumed: the
                # guest must ring the head doorbell once it has taken this entry
                self.dma_write(slots[1], struct.pack("<I", event))
        except DmaError:
            return
        if held is not None:
            held[cq.qid] = cq
        else:
            self._signal((cq,))

    @staticmethod
    def _entry(result: int, sq_head: int, sqid: int, cid: int, status: Status, phase: int) -> bytes:
        field = status | DNR if status in NO_RETRY else status
        return struct.pack("<IIHHHH", result & 0xFFFFFFFF, 0, sq_head, sqid, cid, (field << 1) | phase)

    def _move_read(self, data: ReadData, then: Sequence[tuple[int, bytes]] = ()) -> Status | None:
        """A Read's file bytes into guest memory, then ``then`` (its completion entry): one
        DMA write. None if it was all written, else the status the command completes with
        instead (the file's error, or the DMA's, which is checked whole before the file is
        read)."""
        try:
            with _FileErrors(Status.UNRECOVERED_READ_ERROR):
                self.dma_write_from_file(data.segments, data.fd, data.offset, then)
        except CommandError as exc:
            return exc.status
        except DmaError:
            return Status.DATA_TRANSFER_ERROR
        self._count("bytes_read", data.length)
        return None

    def _signal(self, cqs) -> None:
        """Raise the interrupt of each CQ that still exists and asked for one."""
        with self.lock:
            for cq in cqs:
                if self.cqs.get(cq.qid) is cq and cq.interrupts:
                    self.raise_interrupt(cq.vector)

    def _count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.stats_counters[name] += n

    # --- admin commands ----------------------------------------------------------------------
    def _admin(self, opcode: int, sqe: memoryview) -> int | Deferred:
        cdw10, cdw11 = struct.unpack_from("<II", sqe, 40)
        prp1, prp2 = struct.unpack_from("<QQ", sqe, 24)
        nsid = struct.unpack_from("<I", sqe, 4)[0]
        match opcode:
            case AdminOpcode.IDENTIFY:
                self._write_prp(prp1, prp2, self._identify(cdw10 & 0xFF, nsid, cdw11 >> 24))
            case AdminOpcode.SET_FEATURES:
                return self._set_feature(cdw10 & 0xFF, cdw11)
            case AdminOpcode.GET_FEATURES:
                fid = cdw10 & 0xFF
                if fid == Feature.NUMBER_OF_QUEUES:
                    return (MAX_QUEUES - 1) << 16 | (MAX_QUEUES - 1)
                return self._features.get(fid, 0)
            case AdminOpcode.CREATE_CQ:
                self._create_cq(cdw10, cdw11, prp1)
            case AdminOpcode.CREATE_SQ:
                self._create_sq(cdw10, cdw11, prp1)
            case AdminOpcode.DELETE_SQ | AdminOpcode.DELETE_CQ:
                self._delete_queue(cdw10 & 0xFFFF, cq=opcode == AdminOpcode.DELETE_CQ)
            case AdminOpcode.GET_LOG_PAGE:
                cdw12, cdw13 = struct.unpack_from("<II", sqe, 48)
                self._write_prp(prp1, prp2, self._log_page(cdw10, cdw11, cdw13 << 32 | cdw12))
            case AdminOpcode.ASYNC_EVENT_REQUEST:  # held until there is an event
                with self.lock:
                    self.pending_aers.append(struct.unpack_from("<H", sqe, 2)[0])
                return Deferred.HELD
            case AdminOpcode.ABORT:
                return self._abort(cdw10 & 0xFFFF, cdw10 >> 16)
            case AdminOpcode.KEEP_ALIVE:
                return 0
            case AdminOpcode.DOORBELL_BUFFER_CONFIG:
                self._doorbell_buffer_config(prp1, prp2)
            case _:
                raise CommandError(Status.INVALID_OPCODE)
        return 0

    def _abort(self, sqid: int, cid: int) -> int:
        """Abort: a command taken but not started yet is completed now with Command Abort
        Requested, and Dword 0 bit 0 is 0 (aborted). One already running (or done, or never
        seen: the admin queue's commands run in order, so every one before this Abort has
        ended) is left to complete normally: bit 0 is 1."""
        with self.lock:
            self.stats_counters["aborts"] += 1
            job = self._not_started.get((sqid, cid))
            if job is None or self.sqs.get(sqid) is not job.sq:
                return 1
        return 0 if self._take_back(job, Status.ABORT_REQUESTED) else 1

    def _identify(self, cns: int, nsid: int, csi: int = 0) -> bytes:
        return identify(cns, nsid, csi, serial=self.serial, oacs=self._identify_oacs(), namespaces=self.namespaces)

    def _set_feature(self, fid: int, value: int) -> int:
        if fid == Feature.NUMBER_OF_QUEUES:  # we grant what we have
            return (MAX_QUEUES - 1) << 16 | (MAX_QUEUES - 1)
        if fid in STORED_FEATURES:
            self._features[fid] = value
            return 0
        raise CommandError(Status.INVALID_FIELD)

    def _log_page(self, cdw10: int, cdw11: int, offset: int = 0) -> bytes:
        return log_page(cdw10, cdw11, offset, bytes_read=self.stats_counters["bytes_read"],
                        bytes_written=self.stats_counters["bytes_written"])

    def _create_cq(self, cdw10: int, cdw11: int, base: int) -> None:
        qid, size = cdw10 & 0xFFFF, (cdw10 >> 16) + 1
        if not 0 < qid <= MAX_QUEUES or qid in self.cqs:
            raise CommandError(Status.INVALID_QID)
        if size < 2 or size > MQES + 1:
            raise CommandError(Status.INVALID_QUEUE_SIZE)
        vector = cdw11 >> 16
        vectors = self.irq_config.msix_vectors or self.irq_config.msi_vectors
        if vectors and vector >= vectors:
            raise CommandError(Status.INVALID_VECTOR)
        with self.lock:
            self.cqs[qid] = Queue(qid, base & ~0xFFF, size, vector=vector, interrupts=bool(cdw11 & 2))

    def _create_sq(self, cdw10: int, cdw11: int, base: int) -> None:
        qid, size, cqid = cdw10 & 0xFFFF, (cdw10 >> 16) + 1, cdw11 >> 16
        if not 0 < qid <= MAX_QUEUES or qid in self.sqs:
            raise CommandError(Status.INVALID_QID)
        if cqid not in self.cqs or cqid == 0:
            raise CommandError(Status.INVALID_CQ)
        if size < 2 or size > MQES + 1:
            raise CommandError(Status.INVALID_QUEUE_SIZE)
        with self.lock:
            self.sqs[qid] = Queue(qid, base & ~0xFFF, size, cqid=cqid)
            self.cqs[cqid].sq_ids.add(qid)
            # on a box the host then sends a doorbell's commands with it, and the PRP list each
            # one's PRP2 may point to: no round trip to fetch them
            self.dma_watch_ring(qid, self._sq_ring(self.sqs[qid]))

    def _sq_ring(self, sq: Queue) -> Ring:
        """An I/O SQ as its port watches it (lock held): its doorbell, its entries and their
        PRP lists, and its shadow doorbell while shadows are configured."""
        shadow, event_index = self._shadow_slots(sq.qid) or (0, 0)
        return Ring(0, DOORBELLS + 8 * sq.qid, sq.base, 64, sq.size, sq.tail, pointer_offset=PRP2_OFFSET,
                    pointer_bytes=PRP_LIST_PUSH, shadow=shadow, event_index=event_index)

    def _delete_queue(self, qid: int, cq: bool) -> None:
        with self.lock:
            table = self.cqs if cq else self.sqs
            if qid == 0 or qid not in table:
                raise CommandError(Status.INVALID_QID)
            if cq and table[qid].sq_ids:
                raise CommandError(Status.INVALID_QUEUE_DELETION)
            target = table[qid]
            waiting = [] if cq else [j for j in self._not_started.values() if j.sq is target]
        for job in waiting:  # not started: completed as aborted (posting it is a DMA: no lock held)
            self._take_back(job, Status.ABORTED_SQ_DELETION)
        with self.lock:
            if not cq:  # the running ones complete first (into the CQ, which stays); one
                # stuck longer is dropped: its completion finds no SQ
                self._ended.wait_for(lambda: target.in_flight == 0, DELETE_WAIT)
            if table.get(qid) is not target:  # reset or deleted meanwhile (table is the old dict)
                raise CommandError(Status.INVALID_QID)
            queue = table.pop(qid)
            if not cq:
                self.cqs.get(queue.cqid, Queue(0, 0, 1)).sq_ids.discard(qid)
                self.dma_watch_ring(qid, None)

    # --- I/O commands --------------------------------------------------------------------------
    def _io(self, opcode: int, sqe: memoryview, lists: dict[tuple[int, int], bytes] | None = None,
            fetched: WriteData | None = None) -> int | ReadData:
        if opcode == IoOpcode.READ:
            return self._read_data(sqe, lists)
        ns = self._namespace(struct.unpack_from("<I", sqe, 4)[0])
        if opcode == IoOpcode.FLUSH:  # durable from here on (_run_io waited for earlier writes)
            with _FileErrors(Status.WRITE_FAULT):  # a write lost at writeback shows here
                os.fsync(ns.fd)
            self._count("flushes")
            return 0
        prp1, prp2 = struct.unpack_from("<QQ", sqe, 24)
        slba, cdw12 = struct.unpack_from("<QI", sqe, 40)
        if opcode in (IoOpcode.WRITE, IoOpcode.WRITE_ZEROES):
            offset, length = self._extent(ns, slba, cdw12, transfer=opcode == IoOpcode.WRITE)
            if opcode == IoOpcode.WRITE:
                with _FileErrors(Status.WRITE_FAULT):  # all of it on the file, or a write fault
                    if fetched is not None and fetched.pieces is not None:  # read with the rest of its batch
                        write_all(ns.fd, fetched.pieces, offset)  # from the DMA buffers, not joined first
                    else:  # locally: pwritev from guest memory
                        segments = fetched.segments if fetched else prp.segments(prp1, prp2, length, self.dma_read, lists)
                        self.dma_read_into_file(segments, ns.fd, offset)
                self._count("bytes_written", length)
            else:  # IoOpcode.WRITE_ZEROES; DEAC (CDW12 bit 25): deallocate, as Identify's DLFEAT says
                with _FileErrors(Status.WRITE_FAULT):
                    (punch_hole if cdw12 & (1 << 25) else zero_range)(ns.fd, offset, length)
            return 0
        if opcode == IoOpcode.DATASET_MANAGEMENT:  # deallocated blocks read back as zeroes (DLFEAT)
            ranges = (struct.unpack_from("<I", sqe, 40)[0] & 0xFF) + 1
            table = self._read_prp(prp1, prp2, ranges * 16)
            extents = [struct.unpack_from("<IIQ", table, i * 16)[1:] for i in range(ranges)]
            if any(start + nlb > ns.blocks for nlb, start in extents):
                raise CommandError(Status.LBA_OUT_OF_RANGE)  # checked whole: nothing done
            if struct.unpack_from("<I", sqe, 44)[0] & 4:  # AD: deallocate
                with _FileErrors(Status.WRITE_FAULT):
                    for nlb, start in extents:
                        punch_hole(ns.fd, start << LBA_SHIFT, nlb << LBA_SHIFT)
            return 0
        raise CommandError(Status.INVALID_OPCODE)

    def _read_data(self, sqe: memoryview, lists: dict[tuple[int, int], bytes] | None) -> ReadData:
        """A Read checked (namespace, LBA range, MDTS, PRPs, in that order) and its transfer,
        not yet made: the data moves with the completion (:meth:`_complete`)."""
        nsid, prp1, prp2, slba, cdw12 = READ_FIELDS.unpack_from(sqe, 4)
        ns = self._namespace(nsid)
        offset, length = self._extent(ns, slba, cdw12, transfer=True)
        return ReadData(prp.segments(prp1, prp2, length, self.dma_read, lists), ns.fd, offset, length)

    def _namespace(self, nsid: int) -> Namespace:
        """The namespace an I/O command names, or Invalid Namespace."""
        ns = self.namespaces.get(nsid)
        if ns is None:
            raise CommandError(Status.INVALID_NAMESPACE)
        return ns

    @staticmethod
    def _extent(ns: Namespace, slba: int, cdw12: int, transfer: bool) -> tuple[int, int]:
        """(offset, length) in the namespace's file of the blocks a Read, Write or Write
        Zeroes names (SLBA, CDW12's NLB), checked: inside the namespace, and for a
        ``transfer`` through guest memory within MDTS."""
        nlb = (cdw12 & 0xFFFF) + 1
        if slba + nlb > ns.blocks:
            raise CommandError(Status.LBA_OUT_OF_RANGE)
        length = nlb << LBA_SHIFT
        if transfer and length > (PAGE << MDTS):
            raise CommandError(Status.INVALID_FIELD)
        return slba << LBA_SHIFT, length

    # --- PRPs --------------------------------------------------------------------------------------
    def _read_prp(self, prp1: int, prp2: int, length: int) -> bytes:
        return b"".join(self.dma_read_many(prp.segments(prp1, prp2, length, self.dma_read)))

    def _write_prp(self, prp1: int, prp2: int, data: bytes) -> None:
        self._write_segments(prp.segments(prp1, prp2, len(data), self.dma_read), data)

    def _write_segments(self, segments: list[tuple[int, int]], data: bytes) -> None:
        view, pieces, pos = memoryview(data), [], 0
        for addr, n in segments:
            pieces.append((addr, view[pos:pos + n]))
            pos += n
        self.dma_write_many(pieces)

    # --- lifecycle -------------------------------------------------------------------------------
    def capacity_bytes(self) -> int:
        """What the pool lists for this device: the sum of its namespaces."""
        return sum(ns.blocks << LBA_SHIFT for ns in self.namespaces.values())

    def stats(self) -> dict:
        return {**self.stats_counters, "suppressed_interrupts": self.suppressed_interrupts}

    def close(self, timeout: float = 2.0) -> bool:
        """Stop the worker, then the I/O threads (each within ``timeout`` s), then the files."""
        done = self.worker.close(timeout)
        done = (self.io_pool is None or self.io_pool.close(timeout)) and done
        for ns in self.namespaces.values():
            ns.close()
        return done


class _FileErrors:
    """The backing file's OSError (ENOSPC, EIO, ...) as the command's NVMe status. A class,
    not a generator context manager: it wraps every I/O command, and costs a third as much."""

    __slots__ = ("status",)

    def __init__(self, status: Status) -> None:
        self.status = status

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: object) -> bool:
        if isinstance(exc, OSError):
            log.warning("NVMe backing file: %s; completing with %s", exc, self.status.name)
            raise CommandError(self.status) from exc
        return False
