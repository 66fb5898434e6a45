"""A device's own thread for slow work (DMA), off the thread serving the guest.

The thread that delivers a region access must reply without waiting for DMA:
QEMU answers our DMA requests on the same main loop that waits for that reply,
so doing the DMA inline would deadlock until the message timeout. Jobs run one
at a time, in submission order, which keeps a device's DMA ordered.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

log = logging.getLogger(__name__)

Job = Callable[[], None]
_STOP = object()


class DeviceWorker:
    """One lazily started daemon thread running submitted jobs in order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.Queue[object] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(self, job: Job) -> None:
        """Queue ``job``; the thread starts on first use (and again after ``close``)."""
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._jobs = queue.Queue()
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
    def _run(jobs: queue.Queue[object]) -> None:
        while True:
            job = jobs.get()
            if job is _STOP:
                return
            try:
                job()   # type: ignore[operator]
            except Exception:   # a bug in one job must not kill the device's worker
                log.exception("device worker job failed")
