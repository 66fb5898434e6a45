"""A device's own thread for slow work (DMA), off the thread serving the guest.

The thread that delivers a region access must reply without waiting for DMA:
QEMU answers our DMA requests on the same main loop that waits for that reply,
so doing the DMA inline would deadlock until the message timeout. A DeviceWorker
runs jobs one at a time, in submission order, which keeps a device's DMA ordered; a
WorkerPool runs independent jobs (NVMe I/O commands) side by side, so their DMA round
trips overlap.

Jobs wait in a ``queue.SimpleQueue`` (C), not a ``queue.Queue``: every doorbell hands a
job to a worker, and a hand-off there and back cost 32-33 µs of CPU with ``Queue`` (its
Condition allocates a lock per wait) against 16-17 with ``SimpleQueue``, two threads
ping-ponging on this machine.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)

Job = Callable[[], None]
_STOP = object()


class DeviceWorker:
    """One lazily started daemon thread running submitted jobs in order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(self, job: Job) -> None:
        """Queue ``job``; the thread starts on first use (and again after ``close``)."""
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._run, args=(self._jobs,),
                                                name=self.name, daemon=True)
                self._thread.start()
            self._jobs.put(job)

    def close(self, timeout: float = 2.0) -> bool:
        """Stop after the queued jobs; True if the thread ended within ``timeout`` s."""
        with self._start_lock:
            thread, self._thread = self._thread, None
            if thread is None:
                return True
            self._jobs.put(_STOP)
        thread.join(timeout)
        return not thread.is_alive()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @staticmethod
    def _run(jobs: queue.SimpleQueue[object]) -> None:
        while True:
            job = jobs.get()
            if job is _STOP:
                return
            try:
                job()   # type: ignore[operator]
            except Exception:   # a bug in one job must not kill the device's worker
                log.exception("device worker job failed")


class WorkerPool:
    """``size`` lazily started daemon threads taking jobs from one FIFO queue.

    Jobs run concurrently, but they are *taken* in submission order: when a job runs,
    every job submitted before it has been taken by some thread. A job may therefore
    wait for jobs submitted before it (an NVMe Flush waits for the writes ahead of it)
    without deadlocking the pool; it must never wait for a later one.
    """

    def __init__(self, name: str, size: int) -> None:
        if size < 1:
            raise ValueError(f"a worker pool needs at least one thread, not {size}")
        self.name, self.size = name, size
        self._jobs: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._start_lock = threading.Lock()

    def submit(self, job: Job) -> None:
        """Queue ``job``; the threads start on first use (and again after ``close``)."""
        with self._start_lock:
            if not self._threads:
                self._jobs = queue.SimpleQueue()
                self._threads = [threading.Thread(target=DeviceWorker._run, args=(self._jobs,),
                                                  name=f"{self.name}-{i}", daemon=True)
                                 for i in range(self.size)]
                for thread in self._threads:
                    thread.start()
            self._jobs.put(job)

    def close(self, timeout: float = 2.0) -> bool:
        """Stop after the queued jobs; True if every thread ended within ``timeout`` s in all."""
        with self._start_lock:
            threads, self._threads = self._threads, []
            for _ in threads:
                self._jobs.put(_STOP)
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in threads)

    @property
    def running(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)
