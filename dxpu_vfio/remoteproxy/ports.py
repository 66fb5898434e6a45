"""The box side of a device's DMA and interrupts: guest memory and the guest's
interrupt controller are at the other end of the link.

A device model on the box reaches them through these ports exactly as it would through
the local vfio-user server's: it never knows it is remote. DMA reads are non-posted
(they wait for the host's completion); DMA writes and interrupts are posted on the same
ordered stream, so an interrupt never passes the DMA writes before it.

The host's completions are checked against what was asked (address, size, framing): a
malformed one is a :class:`DmaError` for the device, as a refused read is, and the
link goes on (its framing is intact).
"""

from __future__ import annotations

import collections
import os
import threading
from operator import itemgetter
from typing import Callable, ContextManager, Sequence

from dxpu_vfio.link.endpoint import LinkDown, LinkEndpoint, LinkError
from dxpu_vfio.link.protocol import (IRQ_INTX, IRQ_MSI, IRQ_MSIX, MAX_READV_RANGES, MAX_WRITEV_BYTES, LinkCommand,
                                    Push, RingWatch, pack_irq, pack_readv, pack_writev, unpack_push)
from dxpu_vfio.remoteproxy.faults import FaultTable
from dxpu_vfio.vfio_user import protocol as vp
from qemu_device.backing import write_all
from qemu_device.ports import DmaError, Ring, Sink, file_to_guest, guest_to_file

DMA_TIMEOUT = 2.0
CHUNK = vp.MAX_DATA_XFER
READ_PIECE = 256 << 10  # a large DMA read goes as several pieces in flight at once
READ_WINDOW_BYTES = 1 << 20  # in flight at most: a whole 128 KiB scatter list of 4 KiB pages
READ_WINDOW_PIECES = 64  # is one round trip, and a large read keeps 4 pieces of 256 KiB going
# With DMA_READV (a host that offers it), one request carries up to READ_PIECE of pieces:
# a 128 KiB scatter list of 32 pages is one request and one completion, not 32 of each.


def check_range(addr: int, length: int) -> None:
    """A guest range the link can name (u64 address, u64 end): else a DmaError for the device,
    as an unmapped address is, not a struct.error from packing it (found by scripts/fuzz.py)."""
    if addr < 0 or length < 0 or addr + length > 1 << 64:
        raise DmaError(f"DMA of {length} bytes at {addr:#x} runs past the 64-bit address space")


class RingMirror:
    """What the host pushed of one watched ring (DMA_PUSH): each entry's bytes as they were
    when the doorbell that announced it was rung, valid until the device reads it; and the
    bytes the entries point to (RingWatch.pointer_bytes), each range until it is read once.

    Why it is never stale: the driver rewrites an entry only after the device has read it,
    every read of ring entries (served here or by the network) makes them invalid, and an
    entry becomes valid again only with the push of the doorbell that announces it anew;
    a push the host could not make comes empty and makes every entry invalid. A pointed
    range is as fresh as the newest entry that points to it: each push carries the bytes of
    every entry's pointer (or an empty range where it could not read them, which forgets
    that address, or says it carries none, which forgets them all), and the driver does not
    rewrite what a command points to (its PRP list) while the command is the device's."""

    def __init__(self, watch: RingWatch) -> None:
        self.watch = watch
        self.start, self.end = watch.base, watch.base + watch.entries * watch.entry_size
        self.data = bytearray(self.end - self.start)
        self.valid = bytearray(watch.entries)  # 1: pushed, not read since
        self.pointed: dict[int, bytes] = {}  # address -> the bytes pushed there, oldest first
        # what the native reader needs to take a push of entries alone as push() would
        # (native/serve.c push_mirrored): a ring whose entries point to nothing pushed
        self.native = None if watch.pointer_bytes else (self.start, watch.entry_size, watch.entries,
                                                        self.data, self.valid)

    def overlaps(self, addr: int, length: int) -> bool:
        return addr < self.end and addr + length > self.start

    def _entries(self, addr: int, length: int) -> range | None:
        """The entries [addr, addr+length) covers exactly, or None if it is not whole entries of the ring."""
        size = self.watch.entry_size
        if addr < self.start or addr + length > self.end or (addr - self.start) % size or length % size:
            return None
        first = (addr - self.start) // size
        return range(first, first + length // size)

    def push(self, push: Push) -> bool:
        """Take a push; False (and every entry and pointed range forgotten) if its ranges are
        not whole entries of this ring."""
        at, spans = 0, []
        for addr, length in push.ranges:
            entries = self._entries(addr, length)
            if entries is None:
                self.forget()
                return False
            spans.append((addr - self.start, length, entries))
        if not push.ranges:
            self.forget()
        for offset, length, entries in spans:
            self.data[offset:offset + length] = push.data[at:at + length]
            self.valid[entries.start:entries.stop] = b"\1" * len(entries)
            at += length
        if push.pointed_unknown or not self.watch.pointer_bytes:
            self.pointed.clear()
        else:
            for addr, data in push.pointed:
                self.pointed.pop(addr, None)  # the newest goes last: the first to be dropped is the oldest
                if data:
                    self.pointed[addr] = bytes(data)
            while len(self.pointed) > self.watch.entries:  # one per entry is all a driver can have lent
                del self.pointed[next(iter(self.pointed))]
        return True

    def take(self, addr: int, length: int) -> bytes | None:
        """The range's bytes if every entry in it was pushed and not read since (they are
        read now: invalid after); else None, and the entries it covers are invalid too
        (the device reads them from guest memory)."""
        size = self.watch.entry_size
        first = max(0, (addr - self.start) // size)
        last = min(self.watch.entries, -(-(addr + length - self.start) // size))
        entries = self._entries(addr, length)
        hit = entries is not None and self.valid.find(0, entries.start, entries.stop) < 0  # C's scan, not all()'s
        self.valid[first:last] = bytes(last - first)
        return bytes(memoryview(self.data)[addr - self.start:addr - self.start + length]) if hit else None  # one copy

    def take_pointed(self, addr: int, length: int) -> bytes | None:
        """The first ``length`` bytes pushed at ``addr`` if there are that many (read once:
        forgotten now), else None."""
        data = self.pointed.get(addr)
        if data is None or len(data) < length:
            return None
        del self.pointed[addr]
        return data[:length]

    def forget(self) -> None:
        self.valid[:] = bytes(len(self.valid))
        self.pointed.clear()


Deliver = Callable[[list[tuple[int, int, int]], memoryview], None]
"""What a read does with a completion: (its request's pieces, their bytes back to back)."""


def _size(request: list[tuple[int, int, int]]) -> int:
    return sum(n for _, _, n in request)


class LinkDmaPort:
    """The device's DMA port on the box."""

    reads_wait_on_network = True

    def __init__(self, endpoint: LinkEndpoint, faults: FaultTable | None = None, device: str = "", *,
                 readv: bool = False, writev: bool = False, ring_push: bool = False, shadows: bool = False) -> None:
        self.endpoint = endpoint
        self.readv = readv  # the host offered DMA_READV in its HELLO
        self.writev = writev  # and DMA_WRITEV
        self.ring_push = ring_push  # and pushes ring entries with their doorbells (RING_WATCH / DMA_PUSH)
        self.reads_shadows = shadows  # and reads a watched ring's shadow doorbell for us (RingWatch.shadow)
        # watched rings by slot, and their lock (pushes come on the link reader, reads on any
        # thread); the native reader takes pushes into them itself (native/serve.c push_mirrored)
        self.mirrors: dict[int, RingMirror] = {}
        self.mirror_lock = threading.Lock()
        self.pushed_reads = 0  # reads served from pushed ring entries: no round trip
        self.pushes = 0  # DMA_PUSHes taken into a watched ring (an empty one too)
        self.pointed_reads = 0  # ranges read from the bytes pushed entries point to (PRP lists)
        self.requests = 0  # DMA read requests sent (one per piece, or per scatter list with readv)
        self.early_reads = 0  # reads begun by read_many_begin (on the thread that took a doorbell)
        self.bytes_read = 0
        self.bytes_written = 0
        self.faults, self.device = faults, device  # armed faults (refuse-dma, stall dma-read) of this device

    def _refused(self, target: str) -> None:
        """An armed refuse-dma fault: the DMA fails here, as an unsupported request would."""
        if self.faults is not None and self.faults.armed:
            fault = self.faults.take(self.device, "refuse-dma", target)
            if fault is not None:
                raise DmaError(f"unsupported request: {target} refused by fault {fault.id}")

    def read(self, addr: int, length: int) -> bytes:
        return self.read_many([(addr, length)])[0]

    def watch_ring(self, slot: int, ring: Ring | None) -> None:
        """Ask the host to push the entries of a ring with the doorbell that announces them
        (RING_WATCH), or with None to stop; nothing where the host did not offer it."""
        if not self.ring_push:
            return
        shadow = (ring.shadow, ring.event_index) if ring is not None and self.reads_shadows else (0, 0)
        watch = RingWatch(slot) if ring is None else RingWatch(slot, ring.region, ring.doorbell, ring.base,
                                                                ring.entry_size, ring.entries, ring.tail,
                                                                ring.pointer_offset, ring.pointer_bytes, *shadow)
        watch.check()  # the host's rules: a bad ring is the device's bug, said here
        with self.mirror_lock:
            if watch.entries:
                self.mirrors[slot] = RingMirror(watch)
            else:
                self.mirrors.pop(slot, None)
        self.endpoint.post(LinkCommand.RING_WATCH, watch.pack())

    def pushed(self, payload: memoryview) -> None:
        """A DMA_PUSH from the host (on the link reader, just before the doorbell it goes with)."""
        push = unpack_push(payload)
        with self.mirror_lock:
            mirror = self.mirrors.get(push.slot)
            if mirror is not None and mirror.push(push):
                self.pushes += 1

    def _from_pushes(self, ranges: list[tuple[int, int]]) -> list[bytes] | None:
        """The ranges' bytes if each lies in a watched ring's pushed entries (then nothing
        goes on the network); else None, every ring entry the ranges cover forgotten."""
        if not self.mirrors:
            return None
        with self.mirror_lock:
            out: list[bytes | None] = []
            for addr, length in ranges:
                got = None
                for mirror in self.mirrors.values():
                    if mirror.overlaps(addr, length):
                        got = mirror.take(addr, length)
                        break
                else:  # not ring memory: perhaps what an entry points to
                    for mirror in self.mirrors.values():
                        if (got := mirror.take_pointed(addr, length)) is not None:
                            self.pointed_reads += 1
                            break
                out.append(got)
        if any(got is None for got in out):
            return None
        self.pushed_reads += 1
        return out  # type: ignore[return-value]

    def _pushed_read(self, pushed: list[bytes]) -> list[bytes]:
        """A read served from pushes, as the device gets it: an armed stall holds it as it
        would a completion from the network (a read is a read wherever its bytes came from).
        Called by the thread that finishes the read, never by the link reader that began it."""
        self._take_stall()
        return pushed

    def _take_stall(self) -> None:
        if self.faults is not None and self.faults.armed:
            stall = self.faults.take(self.device, "stall", "dma-read")
            if stall is not None:  # the completion came; the device gets it late
                self.faults.hold(stall)

    def read_many(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Pipelined: up to READ_WINDOW_BYTES (and READ_WINDOW_PIECES) in flight across all
        ranges, each piece at most READ_PIECE, requests sent a windowful per call, so a
        scatter list costs about one round trip plus the transfer, not one per page. This
        thread receives the completions itself (the background reader stands aside).
        The ranges come back as the bytearrays they were assembled in (bytes-like; not
        copied again: on an accelerator's 16 MiB copy batches that copy and its fresh
        pages' faults were a tenth of the box's CPU per byte)."""
        self._check_read(ranges)
        pushed = self._from_pushes(ranges)
        if pushed is not None:
            return self._pushed_read(pushed)
        return self._finish_read(ranges, self._requests(ranges), collections.deque())

    def read_many_begin(self, ranges: list[tuple[int, int]]) -> Callable[[], list[bytes]]:
        """The requests of a read that fits one window leave now, from this thread (the
        link reader that took a doorbell); the call returned waits for their completions
        (:meth:`read_many`'s rules). A larger read, or one refused, starts when finished."""
        try:
            self._check_read(ranges)
            pushed = self._from_pushes(ranges)
            if pushed is not None:   # the finish, on the device's worker, takes an armed stall
                return lambda: self._pushed_read(pushed)
            requests = self._requests(ranges)
            if len(requests) > READ_WINDOW_PIECES or sum(map(_size, requests)) > READ_WINDOW_BYTES:
                return lambda: self.read_many(ranges)
            batch = requests[::-1]
            in_flight = collections.deque(zip(batch, self._send(batch)))
        except (DmaError, LinkDown) as exc:
            failure = exc if isinstance(exc, DmaError) else DmaError(f"link down during DMA read: {exc}")

            def refused() -> list[bytes]:
                raise failure
            return refused
        self.early_reads += 1
        return lambda: self._finish_read(ranges, [], in_flight)

    def _check_read(self, ranges: list[tuple[int, int]]) -> None:
        for addr, length in ranges:
            check_range(addr, length)
        self._refused("dma-read")

    def _requests(self, ranges: list[tuple[int, int]]) -> list[list[tuple[int, int, int]]]:
        """The read's requests, last first (popped from the end, in order)."""
        pieces = [(i, addr + pos, min(READ_PIECE, length - pos))
                  for i, (addr, length) in enumerate(ranges) for pos in range(0, length, READ_PIECE)]
        requests = self._group(pieces)
        requests.reverse()
        return requests

    def _send(self, batch: list[list[tuple[int, int, int]]]) -> list:
        if self.readv:
            sent = self.endpoint.send_requests(LinkCommand.DMA_READV,
                                               [pack_readv([(a, n) for _, a, n in req]) for req in batch])
        else:
            sent = self.endpoint.send_requests(LinkCommand.DMA_READ,
                                               [vp.DmaAccess(a, n).pack() for [(_, a, n)] in batch])
        self.requests += len(batch)
        return sent

    def read_into(self, ranges: list[tuple[int, int]], sink: Sink) -> None:
        """:meth:`read_many`'s pipeline, each completion handed to ``sink`` as a view of
        the stream's message (a DMA_READV's pieces are consecutive in the read, so one
        call each): no buffer of the whole read, no scatter copy into one."""
        self._check_read(ranges)
        pushed = self._from_pushes(ranges)
        if pushed is not None:
            at = 0
            for data in self._pushed_read(pushed):
                sink(at, memoryview(data))
                at += len(data)
            return
        starts, at = [], 0
        for _, length in ranges:
            starts.append(at)
            at += length

        def deliver(request: list[tuple[int, int, int]], data: memoryview) -> None:
            i, a, _ = request[0]
            sink(starts[i] + a - ranges[i][0], data)
        self._read(ranges, deliver, self._requests(ranges), collections.deque())

    def _finish_read(self, ranges: list[tuple[int, int]], requests: list, in_flight: collections.deque) -> list[bytes]:
        out = [bytearray(length) for _, length in ranges]

        def deliver(request: list[tuple[int, int, int]], data: memoryview) -> None:
            at = 0
            for i, a, n in request:
                pos = a - ranges[i][0]
                out[i][pos:pos + n] = data[at:at + n]
                at += n
        self._read(ranges, deliver, requests, in_flight)
        return out  # type: ignore[return-value]

    def _read(self, ranges: list[tuple[int, int]], deliver: Deliver, requests: list,
              in_flight: collections.deque) -> None:
        """The pipeline with this thread reading its own completions, its failures as
        DmaError, its bytes counted and an armed stall fault taken."""
        try:
            with self.endpoint.reading_own_completions():
                self._pipeline(deliver, requests, in_flight)
        except LinkError as exc:
            raise DmaError(f"host refused a DMA read: {exc}") from exc
        except vp.ProtocolError as exc:
            raise DmaError(f"host answered a DMA read with a malformed completion: {exc}") from exc
        except LinkDown as exc:
            raise DmaError(f"link down during DMA read: {exc}") from exc
        self.bytes_read += sum(n for _, n in ranges)
        self._take_stall()

    def _pipeline(self, deliver: Deliver, requests: list, in_flight: collections.deque) -> None:
        """Keep a window of ``requests`` in flight (some may be already: ``in_flight``)
        until every completion, checked to be exactly its request's bytes, is delivered."""
        flight_bytes = sum(_size(request) for request, _ in in_flight)
        while requests or in_flight:
            batch = []
            while requests and len(in_flight) + len(batch) < READ_WINDOW_PIECES and (
                    not (in_flight or batch) or flight_bytes + _size(requests[-1]) <= READ_WINDOW_BYTES):
                batch.append(requests.pop())
                flight_bytes += _size(batch[-1])
            if batch:
                in_flight.extend(zip(batch, self._send(batch)))
            request, pending = in_flight.popleft()
            payload = self.endpoint.wait(pending, DMA_TIMEOUT)
            flight_bytes -= _size(request)
            if self.readv:
                data = memoryview(payload)
                if len(data) != _size(request):
                    raise DmaError(f"host answered a DMA read of {_size(request)} bytes in {len(request)} ranges "
                                   f"with {len(data)} bytes")
            else:
                [(i, a, n)] = request
                data = vp.DmaAccess.answer(payload, a, n)  # a ProtocolError: a DmaError (_read)
            deliver(request, data)

    def _group(self, pieces: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
        """The requests the pieces go in: one each (DMA_READ), or with DMA_READV as many
        consecutive pieces as fit READ_PIECE bytes and MAX_READV_RANGES ranges."""
        if not self.readv:
            return [[piece] for piece in pieces]
        requests: list[list[tuple[int, int, int]]] = []
        for piece in pieces:
            last = requests[-1] if requests else None
            if last is None or len(last) == MAX_READV_RANGES or _size(last) + piece[2] > READ_PIECE:
                requests.append([piece])
            else:
                last.append(piece)
        return requests

    def write(self, addr: int, data: bytes) -> None:
        self.write_many([(addr, data)])

    def posted_together(self) -> ContextManager[None]:
        """The link's :meth:`~LinkEndpoint.posted_together`: DMA writes and interrupts (the
        IRQ port posts on the same stream) of this thread leave as one write."""
        return self.endpoint.posted_together()

    def write_from_file(self, pieces: list[tuple[int, int]], fd: int, offset: int,
                        then: Sequence[tuple[int, bytes]] = ()) -> None:
        """The file's bytes and ``then``: one DMA_WRITEV. Where they fit one message (an NVMe
        Read of up to 128 KiB: 32 pages and its completion entry) the file is read whole and
        sent as it is, behind the ranges that split it: no slice and no loop per page (for
        32 pages that was 62 µs of the box's Python per command, the read 6). Anything else
        goes through ``write_many``."""
        ranges = list(pieces) + [(addr, len(data)) for addr, data in then]
        lengths = list(map(itemgetter(1), ranges))  # builtins, not a loop per page: this runs per command
        total = sum(lengths[:len(pieces)])
        then_bytes = sum(lengths) - total
        addrs = list(map(itemgetter(0), ranges))  # none ends past 2^64 (stricter: the rest go the long way)
        if not (self.writev and 0 < len(ranges) <= MAX_READV_RANGES
                and total + then_bytes <= MAX_WRITEV_BYTES and 0 < min(lengths) and max(lengths) <= READ_PIECE
                and 0 <= min(addrs) and max(addrs) <= (1 << 64) - READ_PIECE):
            file_to_guest(self, pieces, fd, offset, then)  # (which refuses a range past 2^64 by name)
            return
        if not self.endpoint.up:
            raise DmaError(f"link down: {self.endpoint.down_reason}")
        self._refused("dma-write")
        data = os.pread(fd, total, offset)
        if len(data) < total:  # past the file's end: zeroes (a namespace shorter than its size)
            data = data.ljust(total, b"\0")
        self.endpoint.post_many(LinkCommand.DMA_WRITEV, [(pack_writev(ranges), data, *(d for _, d in then))])
        self.bytes_written += total + then_bytes

    def read_into_file(self, pieces: list[tuple[int, int]], fd: int, offset: int) -> None:
        """A read that is one DMA_READV request (an NVMe Write of up to 128 KiB) goes to the
        file straight from its completion, which comes whole or as one refusal: still all
        or nothing. Anything larger is read whole first (``guest_to_file``), so a DMA that
        fails part way writes nothing."""
        if self.readv and len(self._requests(pieces)) == 1:
            self.read_into(pieces, lambda pos, data: write_all(fd, [data], offset + pos))
        else:
            guest_to_file(self, pieces, fd, offset)

    def write_many(self, pieces: list[tuple[int, bytes | memoryview]]) -> None:
        """Posted, in order, sent together: a scatter list of pages is one DMA_WRITEV (up to
        256 ranges and about 1 MiB each; a DMA_WRITE per piece to a host that did not offer
        it), a few TLS records and one call into the stream, not one per page."""
        if not self.endpoint.up:
            raise DmaError(f"link down: {self.endpoint.down_reason}")
        for addr, data in pieces:
            check_range(addr, len(data))
        self._refused("dma-write")
        payloads = []
        if self.writev:
            ranges: list[tuple[int, int]] = []
            parts: list[memoryview] = []
            size = 0
            for addr, data in pieces:
                view = memoryview(data)
                for pos in range(0, len(view), READ_PIECE):
                    chunk = view[pos:pos + READ_PIECE]
                    if ranges and (len(ranges) == MAX_READV_RANGES or size + len(chunk) > MAX_WRITEV_BYTES):
                        payloads.append((pack_writev(ranges), *parts))
                        ranges, parts, size = [], [], 0
                    ranges.append((addr + pos, len(chunk)))
                    parts.append(chunk)
                    size += len(chunk)
                self.bytes_written += len(view)
            if ranges:
                payloads.append((pack_writev(ranges), *parts))
            self.endpoint.post_many(LinkCommand.DMA_WRITEV, payloads)
            return
        for addr, data in pieces:
            view = memoryview(data)
            for pos in range(0, len(view), CHUNK):
                chunk = view[pos:pos + CHUNK]
                payloads.append(vp.DmaAccess(addr + pos, len(chunk), chunk).parts())
            self.bytes_written += len(view)
        self.endpoint.post_many(LinkCommand.DMA_WRITE, payloads)


class LinkIrqPort:
    """The device's interrupt port on the box: every interrupt is one posted IRQ message."""

    def __init__(self, endpoint: LinkEndpoint) -> None:
        self.endpoint = endpoint
        self.sent = 0

    def _post(self, kind: int, vector: int, level: bool = True) -> None:
        self.sent += 1
        self.endpoint.post(LinkCommand.IRQ, pack_irq(kind, vector, level))

    def msi(self, vector: int) -> None:
        self._post(IRQ_MSI, vector)

    def msix(self, vector: int) -> None:
        self._post(IRQ_MSIX, vector)

    def intx(self, level: bool) -> None:
        self._post(IRQ_INTX, 0, level)
