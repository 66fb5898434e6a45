"""The host's shadow of a box's host-mappable BAR (a framebuffer), written back to the box.

QEMU maps a BAR only from a descriptor, and a box's memory has none on the host. So the
host proxy keeps a :class:`~qemu_device.mapped_memory.MappedMemory` of the BAR's size,
which QEMU maps into the guest (guest stores reach it at memory speed, no message), and
sends the box what changed:

* **Dirty detection: snapshot compare.** ``known`` is what the box has (a numpy copy);
  a flush compares the shadow with it in 1 MiB blocks (``np.array_equal``, memory bound:
  ~3 ms for 16 MiB here, so ~18 % of a core at 60 Hz), then the changed blocks page by page, and sends each run of
  changed pages as a posted REGION_WRITE on the device's stream (in pieces of at most
  ``MAX_PIECE``). Write-protect faults (userfaultfd) cannot see QEMU's stores: they
  are made through QEMU's own mapping, in another process. A static screen sends nothing.
* **When.** A thread flushes ``rate_hz`` times a second (default 60: the box is never more
  than one period, plus a flush, behind the guest), and the device flushes whenever
  ordering demands it: before every non-posted access of the device (a register read,
  any MMIO write, which QEMU sends non-posted once a region is mapped, so a mode change
  or a scanout offset cannot pass the pixels before it), before a reset (unplug ends the
  session with one), and when the shadow closes.
* **A link that is down** sends nothing and costs no scan; the guest keeps drawing into
  the shadow. **A new link** (every attach: a re-attach after a link failure is a new host proxy)
  starts with ``full``: the first flush sends the whole BAR, whatever the box kept.

Reads of the BAR (QEMU's, when it did not map it) are served from the shadow; writes go
into it and leave with the next flush.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterator

import numpy as np

from qemu_device.mapped_memory import MappedMemory

PAGE = 4096
BLOCK = 1 << 20  # first pass of the compare
MAX_PIECE = 512 << 10  # bytes in one posted write (a link message is at most 1 MiB + 4 KiB)
PIECES_A_SEND = 4  # 2 MiB: half the forwarder's posted-bytes window (POSTED_BYTES_WINDOW)
DEFAULT_RATE_HZ = 60.0

log = logging.getLogger("dxpu.hostproxy.shadow")

Post = Callable[[list[tuple[int, int, memoryview]]], None]  # runs (region, offset, data), posted in order
Room = Callable[[], int]  # bytes the box may still queue before the host waits for it (the posted window)
CatchUp = Callable[[], Callable[[], None]]  # sends a SYNC in stream order; the call it returns waits for it


def _unbounded() -> int:
    return 1 << 62


def _no_wait() -> Callable[[], None]:
    return lambda: None


class ShadowBar:
    """Region ``index`` of ``size`` bytes: ``memory`` is what QEMU maps; ``flush`` sends
    what changed through ``post`` (the device's posted writes, in stream order) under
    ``lock`` (the device's: a flush never interleaves with a request on the stream).

    **Waiting for the box.** Once ``room`` says the posted window is full, the box must catch
    up (``catch_up``: a SYNC) before more is sent. An ordered flush waits for it under the
    lock: its caller is the vfio-user session thread, which reads the link itself. The
    periodic write-back waits with the lock let go: the session thread may be waiting for
    the lock (a register read from QEMU) while it is the only reader of the link, and the
    SYNC's completion would reach no one until its timeout took the link down."""

    def __init__(self, index: int, size: int, post: Post, lock: threading.RLock, *,
                 rate_hz: float = DEFAULT_RATE_HZ, name: str = "shadow",
                 live: Callable[[], bool] = lambda: True, room: Room = _unbounded,
                 catch_up: CatchUp = _no_wait) -> None:
        if size <= 0 or size % PAGE:
            raise ValueError(f"shadowed BAR of {size} bytes: whole pages only")
        self.index, self.size, self.rate_hz = index, size, float(rate_hz)
        self.memory = MappedMemory(size, f"dxpu-shadow-{index}")
        self._now = np.frombuffer(self.memory.buf, np.uint8)
        self.known = np.zeros(size, np.uint8)  # what the box has, as far as the host knows
        self._now64, self._known64 = self._now.view(np.uint64), self.known.view(np.uint64)
        self._stale = np.ones(size // PAGE, bool)  # pages sent whatever they compare (a new link: all)
        self._post, self._lock, self._live = post, lock, live  # live: the stream is up (else nothing to send)
        self._room, self._catch_up = room, catch_up
        self.counters = {"flushes": 0, "flushes_sent": 0, "pages_sent": 0, "bytes_sent": 0, "scan_ns": 0,
                         "scan_ns_max": 0, "periodic": 0, "ordered": 0, "catch_ups": 0}
        self.last_sent = 0.0  # monotonic time of the last flush that sent something
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._name = name

    def start(self) -> None:
        """Start the periodic write-back (once the device's stream is up)."""
        if self.rate_hz > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"{self._name}-writeback", daemon=True)
            self._thread.start()

    # --- what the device does with it --------------------------------------------------
    def read(self, offset: int, size: int) -> bytes:
        return bytes(self.memory.buf[offset:offset + size])

    def write(self, offset: int, data: bytes | memoryview) -> None:
        self.memory.buf[offset:offset + len(data)] = data

    def flush(self, why: str = "ordered") -> int:
        """Send everything that changed since the last flush, waiting for the box under the
        lock where the window fills (see the class doc: for the session thread); returns
        the bytes sent."""
        with self._lock:
            sent, _more = self._flush_some(why, None)
            return sent

    def _flush_periodic(self) -> int:
        """The write-back's flush: a window's worth at a time under the lock, and the wait
        for the box between windows with the lock let go."""
        sent = 0
        while True:
            with self._lock:
                room = self._room()
                if room > 0:
                    got, more = self._flush_some("periodic", room)
                    sent += got
                    if not more:
                        return sent
                if self.memory.fd < 0 or not self._live():
                    return sent
                self.counters["catch_ups"] += 1
                wait = self._catch_up()  # sent under the lock: in stream order, after the pieces
            wait()

    def _flush_some(self, why: str, limit: int | None) -> tuple[int, bool]:
        """Scan and post changed pages, about ``limit`` bytes at most (None: all, waiting
        for the box where the window fills); (bytes sent, whether more may be left).
        Each 1 MiB block's changes are posted as soon as it is scanned: the box takes
        them in while the host scans on (a whole-frame change reaches it ~a scan sooner)."""
        if self.memory.fd < 0 or not self._live():
            return 0, False  # closed, or the link is down: the guest keeps its shadow, the box gets nothing
        c = self.counters
        sent = scan = 0
        blocks = self._changed_blocks(limit)
        while True:
            started = time.perf_counter_ns()
            try:
                runs = next(blocks)
            except StopIteration as done:
                more = bool(done.value)  # the scan stopped at the limit: blocks are left
                scan += time.perf_counter_ns() - started
                break
            scan += time.perf_counter_ns() - started
            # known now holds the new contents (copied by the scan): the pieces are views of
            # it, so a guest store during the send is not torn into what the box is told it
            # has; sent a few at a time, so the stream's posted-write window is checked between
            pieces = [(self.index, pos, memoryview(self.known[pos:min(end, pos + MAX_PIECE)]).cast("B"))
                      for start, end in runs for pos in range(start, end, MAX_PIECE)]
            for first in range(0, len(pieces), PIECES_A_SEND):
                if limit is None and self._room() <= 0:
                    c["catch_ups"] += 1
                    self._catch_up()()
                self._post(pieces[first:first + PIECES_A_SEND])
            sent += sum(end - start for start, end in runs)
        c["flushes"] += 1
        c[why] += 1
        c["scan_ns"] += scan
        c["scan_ns_max"] = max(c["scan_ns_max"], scan)
        if sent:
            c["flushes_sent"] += 1
            c["pages_sent"] += sent // PAGE
            c["bytes_sent"] += sent
            self.last_sent = time.monotonic()
        return sent, more

    def _changed_blocks(self, limit: int | None = None) -> Iterator[list[tuple[int, int]]]:
        """For each 1 MiB block with changed (or stale) pages, its runs [start, end) of
        them, with ``known`` updated to the shadow's contents there; stops before the next
        block once ``limit`` bytes were found, and then returns True (blocks are left)."""
        now, known, stale = self._now, self.known, self._stale
        found = 0
        now64, known64 = self._now64, self._known64  # 8 bytes a compare: a third faster than bytes
        per_page = PAGE // 8
        for block in range(0, self.size, BLOCK):
            if limit is not None and found >= limit:
                return True
            end = min(self.size, block + BLOCK)
            a, b = now64[block // 8:end // 8], known64[block // 8:end // 8]
            forced = stale[block // PAGE:end // PAGE]
            any_forced = bool(forced.any())
            if not any_forced and np.array_equal(a, b):
                continue
            pages = (a.reshape(-1, per_page) != b.reshape(-1, per_page)).any(axis=1)
            if any_forced:
                pages |= forced
                forced[:] = False
            # runs of changed pages in this block: where the mask steps up, and down
            edges = np.flatnonzero(np.diff(np.concatenate(([False], pages, [False])).astype(np.int8)))
            runs = []
            for first, last in zip(edges[0::2], edges[1::2]):
                lo, hi = block + int(first) * PAGE, block + int(last) * PAGE
                known[lo:hi] = now[lo:hi]
                found += hi - lo
                runs.append((lo, hi))
            yield runs
        return False

    def resend_all(self) -> None:
        """The box's copy is unknown (a new link): the next flush sends the whole BAR."""
        with self._lock:
            self._stale[:] = True

    # --- the periodic write-back ---------------------------------------------------------
    def _run(self) -> None:
        period = 1.0 / self.rate_hz
        due = time.monotonic()
        while True:  # on a fixed beat: a slow flush does not stretch the period
            due = max(due + period, time.monotonic())  # behind: flush now, then on the beat again
            if self._stop.wait(max(0.0, due - time.monotonic())):
                return
            try:
                self._flush_periodic()
            except Exception:  # noqa: BLE001 - the write-back must outlive one failure
                log.exception("shadow of region %d: write-back failed", self.index)

    def close(self) -> None:
        """Stop the write-back after a last flush, and free the shadow (QEMU's mapping of
        it stays valid until QEMU unmaps it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        try:
            self.flush()
        except Exception:  # noqa: BLE001 - closing: the link may be gone
            pass
        with self._lock:
            self._now = self._now64 = None
            self.memory.close()

    def stats(self) -> dict:
        c = dict(self.counters)
        c["scan_us_mean"] = round(c["scan_ns"] / c["flushes"] / 1000, 1) if c["flushes"] else None
        c["rate_hz"] = self.rate_hz
        return c
