"""Faults armed on a box's devices, for test authors: the box misbehaves on purpose.

The fault logic lives here, in the box, because that is where a completion is made: a
stalled MMIO-read completion is simply the box not answering yet, a completer abort is
the box answering with an error, a refused DMA is the box's DMA port raising as it would
on an unsupported request. Faults arrive as FAULT control requests from a manager
(:mod:`dxpu_vfio.remoteproxy.control`; the lab's client is :mod:`dxpu_vfio.lab.faults`).

Kinds (``target`` is the transaction class where the kind takes one):

* ``stall`` (``config-read``, ``mmio-read``, ``dma-read``): each completion is held for
  ``ms`` milliseconds, or (``ms`` None) until the fault is cleared or expires. Reads are
  held in the box's link reader, so everything behind them on the device's ordered
  stream waits too, and a read held past the host's completion timeout (1 s) ends as a
  master abort on the host, with its link down, as on PCIe;
* ``abort`` (``config-read``, ``mmio-read``): the read is answered with an error
  completion (a completer abort); QEMU gives the guest all-ones;
* ``refuse-dma`` (``dma-read``, ``dma-write``, ``dma``: both): the device's DMA port
  raises ``DmaError`` without asking the host (an unsupported request);
* ``drop-posted``: every posted write (MMIO write, write batch) is dropped;
* ``cut``: the device's link is taken down now (its TCP connection shut: the host sees
  the peer close); a link is never up again, recovery is a re-attach;
* ``remove``: surprise removal: the link goes down as for ``cut`` and the box refuses
  new links to the device (``ENXIO``) until the fault ends.

Every fault is bounded: it ends after ``duration`` seconds (at most ``MAX_DURATION``),
after ``count`` hits if given, or when cleared; every arm, first hit, end and clear is
logged with a timestamp and kept in a short history, and hits are counted per device in
the box's counters (``dxpu stats``). Stopping the box clears them all.
"""

from __future__ import annotations

import collections
import errno
import itertools
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from dxpu_vfio.vfio_user import protocol as vp

log = logging.getLogger("dxpu.remote.faults")

TARGETS = {"stall": ("config-read", "mmio-read", "dma-read"), "abort": ("config-read", "mmio-read"),
           "refuse-dma": ("dma-read", "dma-write", "dma"), "drop-posted": (), "cut": (), "remove": ()}
KINDS = tuple(TARGETS)
DEFAULT_DURATION = 30.0  # seconds
MAX_DURATION = 3600.0
HISTORY = 200  # events kept for FAULT list


class FaultError(ValueError):
    """A FAULT request that makes no sense (unknown kind, target or device; no bound)."""

    def __init__(self, message: str, err: int = errno.EINVAL) -> None:
        super().__init__(message)
        self.errno = err


@dataclass
class Fault:
    id: int
    device: str
    kind: str
    target: str | None = None
    ms: float | None = None  # stall: how long each completion is held (None: until cleared or expired)
    duration: float = DEFAULT_DURATION
    count: int | None = None  # hits after which it ends
    armed_at: float = field(default_factory=time.time)
    hits: int = 0
    ended: str | None = None  # why it ended: "cleared", "expired", "spent"
    ended_at: float | None = None
    _until: float = 0.0  # monotonic end
    _release: threading.Event = field(default_factory=threading.Event, repr=False)  # set: holds end now

    def __post_init__(self) -> None:
        self._until = time.monotonic() + self.duration

    def remaining(self) -> float:
        return max(0.0, self._until - time.monotonic())

    def matches(self, target: str | None) -> bool:
        if self.target == "dma":
            return target in ("dma-read", "dma-write")
        return self.target == target

    def to_dict(self) -> dict:
        return {"id": self.id, "device": self.device, "kind": self.kind, "target": self.target, "ms": self.ms,
                "duration": self.duration, "count": self.count, "armed_at": self.armed_at, "hits": self.hits,
                "remaining": round(self.remaining(), 3) if self.ended is None else 0.0,
                "ended": self.ended, "ended_at": self.ended_at}

    def hold(self) -> None:
        """Hold a completion: ``ms``, or until the fault ends (cleared or expired)."""
        wait = self.remaining() if self.ms is None else min(self.ms / 1000, self.remaining())
        self._release.wait(wait)


def _number(req: dict, key: str, kind: type, default=None):
    value = req.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise FaultError(f"{key} must be a non-negative number, not {value!r}")
    return kind(value)


def _device(req: dict, required: bool) -> str | None:
    """The request's device name (checked by type first: a list or an object is no key)."""
    device = req.get("device")
    if device is None and not required:
        return None
    if not isinstance(device, str):
        raise FaultError(f"device must be a device name (a string), not {device!r:.80}")
    return device


class FaultTable:
    """The box's armed faults, their history and their counters. ``actions`` maps ``cut``
    and ``remove`` to what the proxy does when one is armed: ``action(device, reason)``."""

    def __init__(self, devices: list[str], actions: dict[str, Callable[[str, str], None]] | None = None) -> None:
        self.devices = list(devices)
        self.actions = actions or {}
        self._lock = threading.Lock()
        self.armed: list[Fault] = []  # live faults; empty: the serving paths skip every check
        self._ids = itertools.count(1)
        self.history: collections.deque = collections.deque(maxlen=HISTORY)
        self.hits: dict[str, collections.Counter] = {d: collections.Counter() for d in self.devices}
        self._timer: threading.Timer | None = None
        self._holding: dict[int, Fault] = {}  # faults with a completion held now (a spent one too)

    # --- arming and clearing ------------------------------------------------------------
    def arm(self, device: str, kind: str, target: str | None = None, *, ms: float | None = None,
            duration: float | None = None, count: int | None = None) -> Fault:
        if device not in self.hits:
            raise FaultError(f"no device {device!r} in this box (it has {', '.join(self.devices) or 'none'})",
                             errno.ENODEV)
        if kind not in TARGETS:
            raise FaultError(f"unknown fault kind {kind!r} (one of {', '.join(KINDS)})")
        if TARGETS[kind] and target not in TARGETS[kind]:
            raise FaultError(f"fault {kind} needs a target: one of {', '.join(TARGETS[kind])}")
        if not TARGETS[kind] and target is not None:
            raise FaultError(f"fault {kind} takes no target")
        if ms is not None and kind != "stall":
            raise FaultError("ms is for stall faults only")
        duration = DEFAULT_DURATION if duration is None else duration
        if not 0 < duration <= MAX_DURATION:
            raise FaultError(f"duration must be above 0 and at most {MAX_DURATION:.0f} s")
        if count is not None and count < 1:
            raise FaultError("count must be at least 1")
        fault = Fault(next(self._ids), device, kind, target, ms, duration, count)
        with self._lock:
            self.armed = [*self.armed, fault]  # replaced, not changed: the serving threads read it unlocked
        self._event("armed", fault)
        self._schedule_expiry()
        if kind in ("cut", "remove"):
            self.hit(fault)
            action = self.actions.get(kind)
            if action is not None:
                action(device, f"{'link cut' if kind == 'cut' else 'device removed (surprise removal)'} "
                               f"by fault {fault.id}")
            if kind == "cut":
                self._end(fault, "spent")  # a link is down for good: nothing more to do
        return fault

    def clear(self, device: str | None = None, fault_id: int | None = None) -> list[Fault]:
        """End the matching active faults (all of them by default); held completions go on."""
        with self._lock:
            chosen = [f for f in self.armed if f.ended is None and (device is None or f.device == device)
                      and (fault_id is None or f.id == fault_id)]
            held = [f for f in self._holding.values() if f.ended == "spent" and (device is None or f.device == device)
                    and (fault_id is None or f.id == fault_id)]
        for fault in chosen:
            self._end(fault, "cleared")
        for fault in held:  # its last hit is still held: clearing lets it go too
            fault._release.set()
        return chosen

    def clear_all(self) -> None:
        self.clear()
        if self._timer is not None:
            self._timer.cancel()

    def _end(self, fault: Fault, why: str) -> None:
        with self._lock:
            if fault.ended is not None:
                return
            fault.ended, fault.ended_at = why, time.time()
            self.armed = [f for f in self.armed if f is not fault]
        if why != "spent":  # the hit that spent it is still to be held
            fault._release.set()
        self._event(why, fault)

    def _expire(self) -> None:
        with self._lock:
            late = [f for f in self.armed if f.remaining() <= 0]
        for fault in late:
            self._end(fault, "expired")
        self._schedule_expiry()

    def _schedule_expiry(self) -> None:
        """A timer for the next fault to expire: an expired fault is logged when it
        expires, not when it is next looked at, and a held completion is let go."""
        with self._lock:
            nxt = min((f.remaining() for f in self.armed), default=None)
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if nxt is not None:
                self._timer = threading.Timer(nxt + 0.001, self._expire)
                self._timer.daemon = True
                self._timer.start()

    # --- what the proxy asks while it serves -------------------------------------------
    def active(self, device: str, kind: str, target: str | None = None) -> Fault | None:
        """The oldest live fault of this kind (and target) on ``device``, without a hit."""
        faults = self.armed  # a list replaced, never changed in place: read without the lock
        if not faults:
            return None
        for fault in faults:
            if fault.device == device and fault.kind == kind and fault.ended is None \
                    and (not TARGETS[kind] or fault.matches(target)):
                if fault.remaining() <= 0:
                    self._end(fault, "expired")
                    continue
                return fault
        return None

    def take(self, device: str, kind: str, target: str | None = None) -> Fault | None:
        """As :meth:`active`, counting a hit (a fault with a count ends on its last)."""
        fault = self.active(device, kind, target)
        if fault is not None:
            self.hit(fault)
        return fault

    def hit(self, fault: Fault) -> None:
        with self._lock:
            fault.hits += 1
            self.hits[fault.device][f"{fault.kind}:{fault.target}" if fault.target else fault.kind] += 1
            first, spent = fault.hits == 1, fault.count is not None and fault.hits >= fault.count
        if first:
            self._event("hit", fault)
        if spent and fault.kind not in ("cut",):
            self._end(fault, "spent")

    def hold(self, fault: Fault) -> None:
        """Hold a completion for ``fault`` (see :meth:`Fault.hold`); :meth:`clear` ends it."""
        with self._lock:
            self._holding[id(fault)] = fault
        try:
            fault.hold()
        finally:
            with self._lock:
                self._holding.pop(id(fault), None)

    def read_fault(self, device: str, region: int) -> int | None:
        """Before a read is performed: hold it (stall) and/or answer with an errno (abort)."""
        if not self.armed:
            return None
        target = "config-read" if region == vp.REGION_CONFIG else "mmio-read"
        stall = self.take(device, "stall", target)
        if stall is not None:
            self.hold(stall)
        if self.take(device, "abort", target) is not None:
            return errno.EIO
        return None

    def drop_posted(self, device: str) -> bool:
        return bool(self.armed) and self.take(device, "drop-posted") is not None

    def removed(self, device: str) -> Fault | None:
        return self.active(device, "remove") if self.armed else None

    # --- reports -------------------------------------------------------------------------
    def _event(self, event: str, fault: Fault) -> None:
        now = time.time()
        self.history.append({"t": now, "event": event, "fault": fault.id, "device": fault.device,
                             "kind": fault.kind, "target": fault.target, "hits": fault.hits})
        log.warning("fault %d (%s%s on %s) %s at %s, %d hits", fault.id, fault.kind,
                    f" {fault.target}" if fault.target else "", fault.device, event,
                    time.strftime("%H:%M:%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z", fault.hits)

    def listing(self) -> dict:
        with self._lock:
            faults = [f.to_dict() for f in self.armed]
        return {"faults": faults, "log": list(self.history),
                "hits": {d: dict(c) for d, c in self.hits.items() if c}}

    def counters(self, device: str) -> dict:
        """For the device's counters: hits per kind, and how many are armed now."""
        return {"armed": sum(1 for f in self.armed if f.device == device), **self.hits[device]}

    def request(self, req: object) -> dict:
        """A FAULT request (JSON object) -> its answer; :class:`FaultError` if it is bad."""
        if not isinstance(req, dict):
            raise FaultError("a FAULT request is a JSON object")
        op = req.get("op")
        if op == "list":
            return self.listing()
        if op == "clear":
            fault_id = _number(req, "id", int)
            device = _device(req, required=False)
            if device is not None and device not in self.hits:
                raise FaultError(f"no device {device!r} in this box", errno.ENODEV)
            return {"cleared": [f.to_dict() for f in self.clear(device, fault_id)]}
        if op == "note":  # a fault done from outside the box (freeze: the box cannot see its own)
            device, kind = _device(req, required=True), req.get("kind")
            if device not in self.hits or not isinstance(kind, str) or len(kind) > 32:
                raise FaultError("note needs a device of this box and a kind", errno.ENODEV
                                 if isinstance(device, str) else errno.EINVAL)
            seconds = _number(req, "seconds", float) or 0.0
            with self._lock:
                self.hits[device][kind] += 1
            now = time.time()
            self.history.append({"t": now, "event": "noted", "fault": None, "device": device, "kind": kind,
                                 "target": None, "seconds": seconds})
            log.warning("fault %s on %s noted at %s (%.3f s, done from outside the box)", kind, device,
                        time.strftime("%H:%M:%S", time.gmtime(now)), seconds)
            return {"noted": kind}
        if op == "arm":
            device, kind, target = req.get("device"), req.get("kind"), req.get("target")
            if not isinstance(device, str) or not isinstance(kind, str) \
                    or not (target is None or isinstance(target, str)):
                raise FaultError("arm needs device and kind (strings), and target a string or null")
            fault = self.arm(device, kind, target, ms=_number(req, "ms", float),
                             duration=_number(req, "duration", float), count=_number(req, "count", int))
            return {"fault": fault.to_dict()}
        raise FaultError(f"unknown FAULT op {op!r} (arm, clear, list or note)")
