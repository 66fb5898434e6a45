"""Posted-write coalescing for the host proxy: many guest stores, few link messages.

A device whose posted writes come in floods (a framebuffer) would cost one link message
per store. :class:`PostedCoalescer` keeps them as runs (:class:`WriteRuns`) and hands
batches to ``send`` (one link message each):

* from its sender thread when the vfio-user server is about to wait for QEMU
  (:meth:`idle`) or at most ``delay`` seconds after a batch's first write: writes never
  linger, and the server thread goes back to reading while the link sends;
* inline from :meth:`add` when the batch is full;
* inline from :meth:`flush`, which also waits for a batch the sender thread is sending,
  before anything that must not pass them (a read, a non-posted write, a reset, the
  completion of a DMA read).

Invariant: batches reach ``send`` in the order their writes were added (one send-order
lock, taken under the batch lock), so coalescing never reorders posted writes.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from dxpu_vfio.vfio_user.posted import Run, WriteRuns

DEFAULT_COALESCE_DELAY = 0.002  # the longest a posted write waits in the host proxy


class PostedCoalescer:
    def __init__(self, send: Callable[[list[Run]], None], *, merge: bool, name: str,
                 delay: float = DEFAULT_COALESCE_DELAY) -> None:
        self._send = send
        self.delay = delay
        self._batch = WriteRuns(merge=merge)  # adjacent writes glued only if the device asks
        self._lock = threading.Lock()
        self._due = threading.Condition(self._lock)
        self._since = 0.0
        self._send_now = False
        self._send_order = threading.Lock()
        self._closing = False
        threading.Thread(target=self._sender, name=f"coalesce-{name}", daemon=True).start()

    def add(self, index: int, offset: int, data: bytes) -> None:
        """One posted write; sent inline if it fills the batch."""
        with self._lock:
            if not self._batch:
                self._since = time.monotonic()
                self._due.notify()
            if not self._batch.add(index, offset, data):
                return
            runs = self._batch.take()
            self._send_order.acquire()
        self._send_taken(runs)

    def flush(self) -> None:
        """Send what is pending now and wait until every batch taken before was sent:
        whatever the caller sends next goes after them."""
        with self._lock:
            runs = self._batch.take() if self._batch else None
            self._send_order.acquire()  # under the batch lock: batches go out in order
        self._send_taken(runs)

    def idle(self) -> None:
        """The server is about to wait: let the sender thread send what is pending."""
        with self._lock:
            if self._batch:
                self._send_now = True
                self._due.notify()

    def close(self) -> None:
        self.flush()
        with self._lock:
            self._closing = True
            self._due.notify_all()

    def _send_taken(self, runs: list[Run] | None) -> None:
        """Send ``runs`` (or nothing) holding the send-order lock the caller acquired."""
        try:
            if runs:
                self._send(runs)
        finally:
            self._send_order.release()

    def _sender(self) -> None:
        while True:
            with self._lock:
                while True:
                    if self._closing:
                        return
                    if not self._batch:
                        self._due.wait()
                        continue
                    left = self._since + self.delay - time.monotonic()
                    if self._send_now or left <= 0:
                        break
                    self._due.wait(left)
                runs, self._send_now = self._batch.take(), False
                self._send_order.acquire()
            self._send_taken(runs)
