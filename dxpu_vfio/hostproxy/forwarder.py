"""The host proxy in forward mode: the vfio-user server's device is the link.

:class:`RemoteFunction` looks like a device model to :class:`VfioUserServer` but carries
every access to the remote proxy. What it does that a plain forwarder would not:

* DMA from the remote is served only through the session's :class:`DmaTable` (QEMU's
  DMA_MAP windows and their rights): anything else is refused and counted.
* A read with no completion within ``completion_timeout`` answers all-ones, like a
  PCIe master abort, and the link is marked down; every later read answers all-ones at
  once, writes are dropped, the VM keeps running, and ``on_down`` tells the control
  plane, which can ``device_del`` and re-attach once the box is back.
* Posted writes are coalesced (``coalesce=True``) by :class:`PostedCoalescer`, and
  flushed before anything that must not pass them: a read, a non-posted write, a reset,
  and the completion of a DMA read from the remote.
* Nothing the box sends is trusted beyond what was asked and what it described: its
  device description is checked at attach (:mod:`dxpu_vfio.hostproxy.description`), a
  completion that does not answer the request (region, offset, size) is never forwarded
  (all-ones, and the link is down: it cannot be trusted any more), and its DMA is refused
  while the guest has Bus Master Enable off (the guest's writes to the command register
  are watched on their way to the box; a reset turns it off).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import threading
from typing import Callable

from dxpu_vfio.hostproxy.coalescer import DEFAULT_COALESCE_DELAY, PostedCoalescer
from dxpu_vfio.hostproxy.description import check_description
from dxpu_vfio.hostproxy.shadow import DEFAULT_RATE_HZ, ShadowBar
from dxpu_vfio.link.endpoint import LinkDown, LinkEndpoint, LinkError
from dxpu_vfio.link.protocol import (FEATURE_RING_PUSH, FEATURE_SHADOW_DOORBELLS, HOST_FEATURES, IRQ_INTX, IRQ_MSI, IRQ_MSIX,
                                    DeviceDescription, Hello, LinkCommand, RingWatch, hello_proof, unpack_challenge,
                                    unpack_irq, unpack_readv, unpack_writev)
from dxpu_vfio.link.transport import TlsFiles, connect, connect_native, peer_certificate, split_address
from dxpu_vfio.native import stream as native
from dxpu_vfio.vfio_user import protocol as vp
from dxpu_vfio.vfio_user.connection import Connection, ConnectionClosed
from dxpu_vfio.vfio_user.dma import DmaTable
from dxpu_vfio.vfio_user.posted import Run, pack_batch
from qemu_device.device import RegionInfo
from qemu_device.ports import DmaError, NullDmaPort, NullIrqPort

DEFAULT_COMPLETION_TIMEOUT = 1.0  # far below QEMU's 5 s x-msg-timeout
# The C forwarder spins this long for a read's completion while reads come back within it (the
# vCPU is stopped on the read meanwhile; native/forward.c says when it sleeps instead).
DEFAULT_READ_SPIN_US = 150.0
# Posted messages (and bytes) the box may have queued before the host waits for it to catch
# up with a SYNC: PCIe's posted-write credits. Without them a host faster than the box fills
# the box's socket with writes, and a read behind them waits out its completion timeout.
# (The same numbers bound the native forwarder: dxpu_vfio/native/forward.c.)
POSTED_WINDOW = 2048  # at the box's ~50 µs per posted write: at most ~0.1 s of its work queued
POSTED_BYTES_WINDOW = 4 << 20
COMMAND, BUS_MASTER = 0x04, 0x04  # the config space's command register and its Bus Master Enable bit

log = logging.getLogger("dxpu.hostproxy")


class RemoteAttachError(Exception):
    def __init__(self, message: str, err: int = errno.EIO) -> None:
        super().__init__(message)
        self.errno = err


class RemoteFunction:
    """A device reached over the link; the vfio-user server serves it like any model.

    Its ``event_source`` is the link: the vfio-user session thread serves the box's DMA
    requests and interrupts itself and receives its own read completions (no hand-off).
    """

    def __init__(self, conn: Connection, description: DeviceDescription, name: str, *,
                 completion_timeout: float = DEFAULT_COMPLETION_TIMEOUT,
                 on_down: Callable[[str], None] | None = None, heartbeat: float = 0.25,
                 dead_after: float = 3.0, coalesce: bool = False,
                 coalesce_delay: float = DEFAULT_COALESCE_DELAY, writeback_hz: float = DEFAULT_RATE_HZ,
                 map_bars: bool = True, read_spin_us: float = DEFAULT_READ_SPIN_US) -> None:
        self.description = description
        self.completion_timeout = completion_timeout
        self.read_spin_us = read_spin_us
        self.lock = threading.RLock()
        self.dma = NullDmaPort()
        self.irq = NullIrqPort()
        self.suppressed_interrupts = 0
        self.counters = {"reads": 0, "writes_posted": 0, "writes_nonposted": 0, "master_aborts": 0,
                         "dma_bytes_read": 0, "dma_bytes_written": 0, "dma_refused": 0, "irqs": 0,
                         "posted_messages": 0, "bad_completions": 0, "error_completions": 0}
        self.bus_master = False  # the guest's Bus Master Enable, as written on its way to the box (reset: off)
        self.coalesce = coalesce
        self._on_down = on_down
        self.endpoint = LinkEndpoint(conn, name, {
            LinkCommand.DMA_READ: self._dma_read,
            LinkCommand.DMA_READV: self._dma_readv,
            LinkCommand.DMA_WRITE: self._dma_write,
            LinkCommand.DMA_WRITEV: self._dma_writev,
            LinkCommand.IRQ: self._irq,
            LinkCommand.RING_WATCH: self._ring_watch,
        }, heartbeat=heartbeat, dead_after=dead_after, on_down=self._link_down, waiters_serve=True)
        # a box that stops reading fails the send of a posted write as a read would time out:
        # the read queued behind it is answered all-ones within the completion timeout
        self.endpoint.set_send_timeout(min(dead_after, completion_timeout))
        self.coalescer = PostedCoalescer(self._post_runs, merge=description.coalesce, name=name,
                                         delay=coalesce_delay) if coalesce else None
        self.conn = conn
        self._posted_since_sync = self._posted_bytes_since_sync = 0
        self._forwarder = None  # the native Forwarder serving this device now, if any
        self.rings: dict[int, RingWatch] = {}  # rings the box watches (RING_WATCH), by slot
        self._forwarded: dict[str, int] = {}  # counters of forwarders that ended
        self.attach_error: str | None = None  # why QEMU cannot have this device (the box refused its windows)
        self.vmm_masks_msix = False  # set by the session; the box's model is told so itself (remoteproxy/proxy.py)
        # --- host-mapped BARs (hostproxy/shadow.py): the shadows QEMU maps, written back to the box
        self.shadows: dict[int, ShadowBar] = {
            index: ShadowBar(index, description.regions[index][1], self._post_shadow, self.lock,
                             rate_hz=writeback_hz, name=name, live=lambda: self.endpoint.up,
                             room=self._posted_room, catch_up=self._catch_up)
            for index in (description.mappable if map_bars else [])}

    @property
    def event_source(self) -> LinkEndpoint:
        return self.endpoint

    @property
    def coalesce_posted(self) -> bool:  # the vfio-user server then offers write_multiple too
        return self.coalesce

    renders_screen = False  # a box's display renders in the box (dxpu screenshot asks it)

    @property
    def wants_dma_windows(self) -> bool:
        """The box's device maps QEMU's windows (an external vfio-user server there)."""
        return self.description.dma_windows

    # --- the native forwarder (dxpu_vfio/native/forward.c) --------------------------------
    @property
    def native_forward(self) -> "RemoteFunction | None":
        """Region accesses, DMA and MSI/MSI-X forwarded in C: on the native link stream,
        without posted-write coalescing (whose batching is Python's), while the link is up."""
        return (self if self.endpoint.native and self.coalescer is None and self.endpoint.up and not self.shadows
                else None)  # shadows: their write-back is Python's, ordered by flush_posted

    @property
    def link_stream(self):
        return self.conn.stream

    def forwarding(self, forwarder) -> None:
        if forwarder is None and self._forwarder is not None:
            self._forwarded = self._native_counters()  # keep what it did
        if forwarder is not None:  # the rings watched so far; their tails since are not known to it
            for w in list(self.rings.values()):  # a copy: the link's reader may add one meanwhile
                forwarder.set_ring(w.slot, w.region, w.offset, w.base, w.entry_size, w.entries, -1,
                                   w.pointer_offset, w.pointer_bytes, w.shadow, w.event_index)
        self._forwarder = forwarder

    def deliver(self, messages: list[tuple]) -> None:
        for got in messages:
            self.endpoint.deliver(got)

    def link_failed(self, reason: str, timeout: bool) -> None:
        if timeout:
            self.endpoint.timeouts += 1
            reason = f"completion timeout: no answer in {self.completion_timeout * 1000:.0f} ms"
        self.endpoint.mark_down(reason if timeout else f"peer closed the link ({reason})")

    def _native_counters(self) -> dict:
        if self._forwarder is None:
            return dict(self._forwarded)
        now = self._forwarder.counters()
        return {k: now.get(k, 0) + self._forwarded.get(k, 0) for k in now}

    @property
    def link_up(self) -> bool:
        return self.endpoint.up

    def _link_down(self, reason: str) -> None:
        if self._on_down:
            self._on_down(reason)

    # --- device model face (what VfioUserServer calls) -------------------------------
    def attach(self, dma, irq) -> None:
        self.dma, self.irq = dma, irq
        self._gate_dma()

    def _gate_dma(self) -> None:
        """The session's DMA table refuses the box's DMA while Bus Master Enable is off
        (and hands the native forwarder no windows then)."""
        if isinstance(self.dma, DmaTable):  # else a null port: it refuses everything anyway
            self.dma.bus_master = self.bus_master

    def _watch_command(self, index: int, offset: int, data: bytes) -> None:
        """A config write that covers the command register's low byte sets Bus Master Enable."""
        if index == vp.REGION_CONFIG and offset <= COMMAND < offset + len(data):
            self.bus_master = bool(data[COMMAND - offset] & BUS_MASTER)
            self._gate_dma()

    def _bad_completion(self, what: str) -> None:
        """A completion that does not answer its request: the link cannot be trusted."""
        self.counters["bad_completions"] += 1
        self.endpoint.mark_down(f"bad completion: {what}")

    def regions(self) -> list[RegionInfo]:
        return [RegionInfo(i, size, r, w, i in self.shadows) for i, size, r, w in self.description.regions]

    def bar_memory(self, index: int):
        """The shadow QEMU maps for a host-mappable BAR (None: not one)."""
        shadow = self.shadows.get(index)
        return shadow.memory if shadow is not None else None

    def irq_counts(self) -> dict[str, int]:
        return dict(self.description.irqs)

    def region_read(self, index: int, offset: int, size: int) -> bytes:
        if index in self.shadows:  # host-mapped: the shadow is the BAR (hostproxy/shadow.py)
            return self.shadows[index].read(offset, size)
        self.counters["reads"] += 1
        self.flush_posted()  # a read never passes an earlier posted write
        if not self.endpoint.up:
            self.counters["master_aborts"] += 1
            return b"\xff" * size
        try:
            reply = self._request(LinkCommand.REGION_READ, vp.RegionAccess(index, offset, size).pack())
            got = vp.RegionAccess.unpack(reply, write=True)
            if (got.region, got.offset, got.count) != (index, offset, size):
                self._bad_completion(f"a read of {size} bytes at region {index}+{offset:#x} answered with "
                                     f"{got.count} bytes at region {got.region}+{got.offset:#x}")
                raise LinkDown(self.endpoint.down_reason)
        except vp.ProtocolError as exc:
            self._bad_completion(f"a read of {size} bytes at region {index}+{offset:#x}: {exc}")
            self.counters["master_aborts"] += 1
            return b"\xff" * size
        except LinkDown:
            self.counters["master_aborts"] += 1
            return b"\xff" * size  # completion timeout: master abort semantics
        except LinkError as exc:
            self.counters["error_completions"] += 1  # e.g. a completer abort: QEMU gives the guest all-ones
            raise ValueError(f"remote refused read of region {index}+{offset:#x}: {exc}") from exc
        return got.data

    def region_write(self, index: int, offset: int, data: bytes, posted: bool = False) -> None:
        if index in self.shadows:  # into the shadow; it reaches the box with the next flush
            self.shadows[index].write(offset, data)
            return
        self._watch_command(index, offset, data)
        if posted:
            self.counters["writes_posted"] += 1
            if self.coalescer is None:
                self._post_runs([(index, offset, data)])
            else:
                self.coalescer.add(index, offset, data)
            return
        self.flush_posted()
        payload = vp.RegionAccess(index, offset, len(data), bytes(data)).pack()
        self.counters["writes_nonposted"] += 1
        if not self.endpoint.up:
            return  # dropped, like a write to a device that fell off the bus
        try:
            reply = self._request(LinkCommand.REGION_WRITE, payload)
            got = vp.RegionAccess.unpack(reply, write=False)
            if len(reply) != vp.REGION_RW.size or (got.region, got.offset, got.count) != (index, offset, len(data)):
                self._bad_completion(f"a write of {len(data)} bytes at region {index}+{offset:#x} answered for "
                                     f"{got.count} bytes at region {got.region}+{got.offset:#x}")
        except vp.ProtocolError as exc:
            self._bad_completion(f"a write of {len(data)} bytes at region {index}+{offset:#x}: {exc}")
        except LinkDown:
            pass
        except LinkError as exc:
            self.counters["error_completions"] += 1
            raise ValueError(f"remote refused write to region {index}+{offset:#x}: {exc}") from exc

    # --- posted-write coalescing --------------------------------------------------------
    def flush_posted(self) -> None:
        """Send the pending posted writes now: whatever the caller sends next goes after them
        (the shadows' changes too: hostproxy/shadow.py)."""
        if self.coalescer is not None:
            self.coalescer.flush()
        for shadow in self.shadows.values():
            shadow.flush()

    def posted_idle(self) -> None:
        """The vfio-user server is about to wait for QEMU: send what is pending soon."""
        if self.coalescer is not None:
            self.coalescer.idle()

    def _post_runs(self, runs: list[Run]) -> None:
        """One link message for ``runs``; a SYNC when the box may be too far behind."""
        self.counters["posted_messages"] += 1
        if len(runs) == 1:
            index, offset, data = runs[0]
            payload = vp.RegionAccess(index, offset, len(data), bytes(data)).pack()
            self.endpoint.post(LinkCommand.REGION_WRITE, payload)
        else:
            payload = pack_batch(runs)
            self.endpoint.post(LinkCommand.WRITE_BATCH, payload)
        self._posted_since_sync += 1
        self._posted_bytes_since_sync += len(payload)
        self._sync_if_behind()

    def _post_shadow(self, pieces: list[Run]) -> None:
        """A shadow's changed pages (hostproxy/shadow.py): posted REGION_WRITEs, sent
        together with their data framed in place (no copy of the pages before the send)."""
        self.counters["posted_messages"] += len(pieces)
        self.endpoint.post_many(LinkCommand.REGION_WRITE,
                                [(vp.REGION_RW.pack(offset, index, len(data)), data) for index, offset, data in pieces])
        self._posted_since_sync += len(pieces)
        self._posted_bytes_since_sync += sum(vp.REGION_RW.size + len(data) for _, _, data in pieces)

    def _posted_room(self) -> int:
        """Bytes the box may still have queued before the host waits for it (0: wait now)."""
        if self._posted_since_sync >= POSTED_WINDOW:
            return 0
        return max(0, POSTED_BYTES_WINDOW - self._posted_bytes_since_sync)

    def _catch_up(self) -> Callable[[], None]:
        """A SYNC sent now, in stream order (the caller holds the device's lock); the call
        returned waits for its completion and may be made without the lock (shadow.py: the
        periodic write-back must not hold it while the session thread reads the link)."""
        try:
            pending = self.endpoint.send_request(LinkCommand.SYNC, b"")
        except LinkDown:
            return lambda: None  # posted writes to a device that fell off the bus are dropped
        before = self._posted_since_sync, self._posted_bytes_since_sync

        def wait() -> None:
            try:
                self.endpoint.wait(pending, self.completion_timeout)
            except (LinkDown, LinkError):
                return  # down: nothing to wait for; an error completion still came after everything before it
            with self.lock:  # what was posted after the SYNC is still in the window
                self._posted_since_sync = max(0, self._posted_since_sync - before[0])
                self._posted_bytes_since_sync = max(0, self._posted_bytes_since_sync - before[1])
        return wait

    def _sync_if_behind(self) -> None:
        if self._posted_since_sync >= POSTED_WINDOW or self._posted_bytes_since_sync >= POSTED_BYTES_WINDOW:
            try:
                self._request(LinkCommand.SYNC, b"")
            except LinkError:
                pass  # an error completion (an older box: ENOSYS) still comes after everything before it
            except LinkDown:
                pass  # posted writes to a device that fell off the bus are dropped

    def _request(self, command: int, payload: bytes, timeout: float | None = None) -> memoryview:
        """A non-posted request; its completion means the box did everything before it."""
        reply = self.endpoint.request(command, payload, timeout or self.completion_timeout)
        self._posted_since_sync = self._posted_bytes_since_sync = 0
        return reply

    # --- QEMU's DMA windows, for a box that asks (an external server there) ------------
    def dma_mapped(self, address: int, size: int, flags: int) -> None:
        """QEMU mapped a window: a box whose device asks (``dma_windows``) maps it too,
        without a descriptor. A refusal is QEMU's DMA_MAP error (OSError with the errno)."""
        self._tell_window(LinkCommand.DMA_MAP, vp.DmaMap(flags, 0, address, size).pack(),
                          f"DMA window {address:#x}+{size:#x}")

    def dma_unmapped(self, address: int, size: int, flags: int) -> None:
        self._tell_window(LinkCommand.DMA_UNMAP, vp.DmaUnmap(flags, address, size).pack(),
                          f"DMA unmap {address:#x}+{size:#x}")

    def _tell_window(self, command: int, payload: bytes, what: str) -> None:
        if not self.endpoint.up:
            return  # a link that is down refuses every DMA anyway
        self.flush_posted()
        try:
            self._request(command, payload, max(self.completion_timeout, 5.0))
        except LinkDown:
            return
        except LinkError as exc:
            if exc.errno == errno.EOPNOTSUPP:
                message = (f"the box refused {what}: its external vfio-user server needs fd-mapped guest "
                           "memory, which a device behind a box cannot have (its DMA crosses the link as "
                           "messages); see the box's log")
            else:
                message = f"the box refused {what}: {os.strerror(exc.errno)} (see the box's log)"
            log.error("%s: %s", self.endpoint.name, message)
            if command == LinkCommand.DMA_MAP and exc.errno == errno.EOPNOTSUPP and self.attach_error is None:
                self.attach_error = message  # QEMU ignores a refused DMA_MAP: its GET_INFO fails instead
            raise OSError(exc.errno, message) from exc

    def reset(self) -> None:
        self.bus_master = False
        self._gate_dma()
        self.flush_posted()
        if self.endpoint.up:
            try:
                self._request(LinkCommand.DEVICE_RESET, b"", max(self.completion_timeout, 2.0))
            except (LinkDown, LinkError):
                pass

    def close(self) -> None:
        if self.coalescer is not None:
            self.coalescer.close()
        for shadow in self.shadows.values():
            shadow.close()  # after a last flush
        self.endpoint.close()

    def stats(self) -> dict:
        """The counters, with what the native forwarder did in C added in."""
        native = self._native_counters()
        counters = {k: v + native.get(k, 0) for k, v in self.counters.items()}
        # each posted write C forwarded went as its own link message, but a doorbell that a
        # later one in QEMU's buffer announced too (merged: it never left)
        counters["posted_messages"] += native.get("writes_posted", 0) - native.get("doorbells_merged", 0)
        link = self.endpoint.stats()
        for name, count, wait_ns in (("REGION_READ", "reads", "read_wait_ns"),
                                     ("REGION_WRITE", "writes_nonposted", "write_wait_ns")):
            if native.get(count):
                row = link["requests"].setdefault(name, {"count": 0, "wait_us": 0.0})
                row["count"] += native[count]
                row["wait_us"] = round(row["wait_us"] + native[wait_ns] / 1000, 1)
        if native:
            link["native"] = native
        out = {**counters, "link": link, "attach_error": self.attach_error}
        if self.shadows:
            out["shadows"] = {str(i): shadow.stats() for i, shadow in self.shadows.items()}
            out["writeback_bytes"] = sum(shadow.counters["bytes_sent"] for shadow in self.shadows.values())
        return out

    # --- the remote's requests (link reader thread, stream order) --------------------
    def _dma_read(self, msg) -> tuple:
        req = vp.DmaAccess.unpack(msg.payload, with_data=False)
        try:
            data = self.dma.read(req.address, req.count)
        except DmaError as exc:
            self.counters["dma_refused"] += 1
            raise LinkError(str(exc), errno.EFAULT) from exc
        self.counters["dma_bytes_read"] += req.count
        self.flush_posted()  # a completion never passes the posted writes before it
        return vp.DmaAccess(req.address, req.count, data).parts()

    def _dma_readv(self, msg) -> bytes:
        """A scatter list, answered with its bytes back to back; one range outside the
        windows refuses the whole request (EFAULT), as a DMA_READ of it would."""
        ranges = unpack_readv(msg.payload)
        try:
            data = [self.dma.read(address, length) for address, length in ranges]
        except DmaError as exc:
            self.counters["dma_refused"] += 1
            raise LinkError(str(exc), errno.EFAULT) from exc
        self.counters["dma_bytes_read"] += sum(n for _, n in ranges)
        self.flush_posted()  # a completion never passes the posted writes before it
        return b"".join(data)

    def _dma_write(self, msg) -> None:
        req = vp.DmaAccess.unpack(msg.payload, with_data=True)
        try:
            self.dma.write(req.address, req.data)
        except DmaError as exc:  # posted: the remote is not told, like an unsupported request
            self.counters["dma_refused"] += 1
            raise LinkError(str(exc), errno.EFAULT) from exc
        self.counters["dma_bytes_written"] += req.count

    def _dma_writev(self, msg) -> None:
        """A scatter list and its bytes, posted; one range outside the windows or their
        rights drops the whole message (counted), as the native forwarder does."""
        ranges, data = unpack_writev(msg.payload)
        at = 0
        try:
            if not isinstance(self.dma, DmaTable):
                raise DmaError("no DMA windows yet")  # a null port refuses everything
            self.dma.check_writable(ranges)
            for address, length in ranges:
                self.dma.write(address, data[at:at + length])
                at += length
        except DmaError as exc:  # posted: the remote is not told, like an unsupported request
            self.counters["dma_refused"] += 1
            raise LinkError(str(exc), errno.EFAULT) from exc
        finally:
            self.counters["dma_bytes_written"] += at

    def _ring_watch(self, msg) -> None:
        """The box watches a ring (or stops): checked here (a malformed one fails with its
        reason), kept for the C forwarders of later QEMU sessions, and handed to the one
        serving now, which pushes the entries each doorbell announces (forward.c). The box
        has the feature only from a host whose C forwarder sees its posted writes."""
        watch = RingWatch.unpack(msg.payload)
        if watch.entries:
            self.rings[watch.slot] = watch
        else:
            self.rings.pop(watch.slot, None)
        if self._forwarder is not None:
            self._forwarder.set_ring(watch.slot, watch.region, watch.offset, watch.base, watch.entry_size,
                                     watch.entries, watch.tail, watch.pointer_offset, watch.pointer_bytes,
                                     watch.shadow, watch.event_index)

    def _irq(self, msg) -> None:
        kind, vector, level = unpack_irq(msg.payload)
        self.counters["irqs"] += 1
        if kind == IRQ_MSI:
            self.irq.msi(vector)
        elif kind == IRQ_MSIX:
            self.irq.msix(vector)
        elif kind == IRQ_INTX:
            self.irq.intx(level)


def connect_remote(address: str, device: str, lease: str, tls: TlsFiles | None, *,
                   completion_timeout: float = DEFAULT_COMPLETION_TIMEOUT,
                   on_down: Callable[[str], None] | None = None, timeout: float = 5.0,
                   coalesce: bool | None = None, spin_us: float = 0.0,
                   box_sha256: str | None = None, writeback_hz: float = DEFAULT_RATE_HZ,
                   map_bars: bool = True, read_spin_us: float = DEFAULT_READ_SPIN_US) -> RemoteFunction:
    """Open the link to ``device`` on the box at ``host:port`` and return the device.

    ``lease``: the lease token, proven to the box by answering its challenge (it never
    crosses the link). ``box_sha256``: the SHA-256 of the certificate the box must
    present (the pool pins the one it registered), checked before the proof is sent.
    ``coalesce``: combine posted writes into fewer link messages; None follows the
    device's own hint (on for the display adapter). ``map_bars``: shadow the device's
    host-mappable BARs for QEMU to map, written back ``writeback_hz`` times a second
    (False: they stay trapped, every access a message). ``read_spin_us``: the native
    forwarder's spin for a read's completion (0: it always sleeps; native/forward.c)."""
    try:
        host, port = split_address(address)
        if native.enabled():
            conn = connect_native(host, port, tls, timeout)
        else:
            conn = Connection(connect(host, port, tls, timeout))
    except ValueError as exc:
        raise RemoteAttachError(str(exc), errno.EINVAL) from exc
    except (OSError, ConnectionClosed) as exc:
        raise RemoteAttachError(f"cannot reach remote proxy {address}: {exc}", getattr(exc, "errno", 0) or errno.EIO) from exc
    conn.sock.settimeout(timeout)
    # ring entries pushed with their doorbells (RING_WATCH), and their shadow doorbells read for
    # the box: only the C forwarder does it, so not where posted writes will be coalesced in Python
    features = HOST_FEATURES + ((FEATURE_RING_PUSH, FEATURE_SHADOW_DOORBELLS)
                                if conn.native and coalesce is not True else ())
    try:
        reply = _hello(conn, device, lease, box_sha256, features)
    except RemoteAttachError:
        conn.close()
        raise
    except Exception as exc:  # noqa: BLE001 - TLS refusals surface here
        conn.close()
        raise RemoteAttachError(f"remote proxy {address} closed the link during HELLO: {exc}") from exc
    if reply.header.is_error:
        conn.close()
        err = reply.header.error
        what = {errno.EACCES: "lease token refused", errno.ENODEV: "no such device",
                errno.EBUSY: "device is in use by another host", errno.EPROTO: "link version mismatch",
                errno.ENXIO: "device out of service"}
        why = bytes(reply.payload[:500]).decode("utf-8", "replace")  # the box may say why (ENXIO)
        raise RemoteAttachError(f"remote proxy {address} refused device {device!r}: {what.get(err, err)}"
                                + (f": {why}" if why else ""), err)
    try:
        description = DeviceDescription.unpack(reply.payload)
        check_description(description)
    except (vp.ProtocolError, ValueError) as exc:
        conn.close()
        raise RemoteAttachError(f"remote proxy {address} described device {device!r} in a way the host proxy "
                                f"cannot serve: {exc}", errno.EPROTO) from exc
    conn.sock.settimeout(None)
    if conn.native and spin_us:  # adaptive polling: spin before sleeping (docs/benchmarks.md)
        conn.stream.spin_us = spin_us
    if coalesce is None:  # the device says whether its posted writes come in floods
        coalesce = description.coalesce
    function = RemoteFunction(conn, description, f"{address}/{device}",
                              completion_timeout=completion_timeout, on_down=on_down, coalesce=coalesce,
                              writeback_hz=writeback_hz, map_bars=map_bars, read_spin_us=read_spin_us)
    function.endpoint.start()
    for shadow in function.shadows.values():
        shadow.start()
    return function


def _hello(conn: Connection, device: str, token: str, box_sha256: str | None, features: tuple[str, ...]):
    """HELLO, the box's nonce, HELLO with the proof (docs/link-protocol.md): the box's
    last reply (an error, or the device description)."""
    conn.send(vp.message(1, LinkCommand.HELLO, Hello(device, features=features).pack()))
    reply = conn.receive()
    if reply.header.is_error:
        return reply
    if box_sha256 is not None:
        der = peer_certificate(conn)
        seen = hashlib.sha256(der).hexdigest() if der else None
        if seen != box_sha256:
            raise RemoteAttachError(f"the box presented another certificate (sha256 {(seen or 'none')[:16]}..., "
                                    f"registered {box_sha256[:16]}...): no proof sent", errno.EACCES)
    nonce = unpack_challenge(reply.payload)
    proof = hello_proof(token, device, nonce)
    conn.send(vp.message(2, LinkCommand.HELLO, Hello(device, nonce, proof, features=features).pack()))
    return conn.receive()
