"""Faults on demand for test authors: make a lab box misbehave for one of its devices.

    faults = Faults(state, "box1", "td0", attachment=att)
    faults.abort("mmio-read", count=1)       # the next MMIO read completes all-ones
    faults.stall("mmio-read", ms=300)        # each MMIO read is answered 300 ms late
    faults.refuse_dma()                      # the device's DMA fails (unsupported request)
    faults.drop_posted(duration=2)           # posted writes vanish for 2 s
    faults.freeze(seconds=2)                 # SIGSTOP the box, SIGCONT after 2 s
    faults.remove(grace=1.0)                 # surprise removal, device_del 1 s later
    faults.clear()                           # everything armed on the box ends

Most faults are armed in the box (:mod:`dxpu_vfio.remoteproxy.faults`, where completions
are made) by a FAULT control request: mutual TLS with the lab's ``host`` certificate,
which the lab's boxes take admin commands from, like GRANT. The request is made from the
lab's host namespace (a thread that enters it), so it works from any process on the
machine. Freezing is done here (the box cannot stop itself and still count); the box is
told afterwards, so its counters and log have it too. Every fault is bounded (duration,
count); :meth:`Faults.close` (the ``lab_faults`` fixture's teardown) clears them all and
thaws a frozen box.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

from dxpu_vfio.errors import DxpuError
from dxpu_vfio.lab.lab import LabState
from dxpu_vfio.namespaces import in_netns
from dxpu_vfio.link.protocol import LinkCommand
from dxpu_vfio.pool import boxes
from dxpu_vfio.remoteproxy import process as box_process
from dxpu_vfio.remoteproxy.faults import DEFAULT_DURATION, MAX_DURATION
from dxpu_vfio.vfio_user import protocol as vp
from dxpu_vfio.vfio_user.connection import ConnectionClosed

log = logging.getLogger("dxpu.lab.faults")



class FaultError(DxpuError):
    """A fault could not be armed, cleared or listed."""


def fault_reply(op: str, payload: bytes, box: str) -> dict:
    """A box's answer to a FAULT request of ``op``, checked where its caller reads it: a
    JSON object; for ``arm`` its ``fault`` an object with an integer ``id``, for ``clear``
    its ``cleared`` a list of such. A box is a peer: a box of another version, or
    something else listening at its address, gets a FaultError that quotes it, not a
    KeyError in a test's fixture."""
    def refused(problem: str) -> FaultError:
        return FaultError(f"box {box} answered a FAULT {op} with {problem}: {payload[:200]!r}",
                          hint="a box of another version, or not a dxpu box at that address: dxpu lab status")

    try:
        answer = json.loads(payload)
    except (ValueError, RecursionError):  # (JSONDecodeError and invalid UTF-8 are ValueErrors)
        raise refused("no JSON") from None
    if not isinstance(answer, dict):
        raise refused("no JSON object")
    faults = [answer.get("fault")] if op == "arm" else answer.get("cleared") if op == "clear" else []
    if not isinstance(faults, list) or not all(isinstance(f, dict) and type(f.get("id")) is int for f in faults):
        raise refused(f"no {'fault' if op == 'arm' else 'cleared faults'} with integer ids")
    return answer


class Faults:
    """The fault API on one box (``address``, reached with the ``host`` certificate in
    ``tls_dir``, from namespace ``netns``); ``device`` is the default device of every
    call, ``attachment`` (from ``hotplug.attach``) the one :meth:`remove` unplugs, and
    ``proxy_pid`` the box's process (for :meth:`freeze`). A lab's box: :meth:`for_lab`."""

    def __init__(self, address: str, tls_dir: str | None, box: str, device: str, *, netns: str | None = None,
                 proxy_pid: int | None = None, attachment=None, timeout: float = 5.0) -> None:
        self.address, self.tls_dir, self.name, self.device = address, tls_dir, box, device
        self.netns, self.proxy_pid = netns, proxy_pid
        self.attachment = attachment
        self.timeout = timeout
        self.frozen_at: float | None = None
        self._thaw_timer: threading.Timer | None = None
        self.history: list[dict] = []  # what this client did, with timestamps

    @classmethod
    def for_lab(cls, state: LabState, box: str, device: str | None = None, **kwargs) -> "Faults":
        b = state.box(box)
        device = device or next(iter(b.devices), None)
        if device not in b.devices:
            raise FaultError(f"box {box} of lab {state.name} has no device {device!r} "
                             f"(it has {', '.join(b.devices) or 'none'})", hint=f"dxpu lab status --name {state.name}")
        return cls(b.endpoint, b.tls_dir, box, device, netns=state.host_netns, proxy_pid=b.proxy_pid,
                   **kwargs)

    # --- the box's FAULT service ---------------------------------------------------------
    def _ask(self, request: dict, thawed: bool = False) -> dict:
        if self.frozen_at is not None and not thawed:
            raise FaultError(f"box {self.name} is frozen: it answers nothing",
                             hint="thaw it first (Faults.thaw, or dxpu lab fault BOX thaw)")
        if self.netns is None:
            return self._exchange(request)
        return in_netns(self.netns, lambda: self._exchange(request))

    def _exchange(self, request: dict) -> dict:
        address = self.address
        conn = boxes._open(address, self.tls_dir, self.timeout)
        try:
            conn.send(vp.message(1, LinkCommand.FAULT, json.dumps(request).encode()))
            reply = conn.receive()
        except (ConnectionClosed, OSError) as exc:
            raise FaultError(f"box {self.name} ({address}) closed the link during a FAULT request: {exc}",
                             hint="a box older than this lab (restart it: dxpu lab down && dxpu lab up), "
                                  "or one that is frozen") from exc
        finally:
            conn.close()
        if reply.header.is_error:
            why = bytes(reply.payload).decode(errors="replace") or os.strerror(reply.header.error)
            raise FaultError(f"box {self.name} refused the fault: {why}",
                             hint="dxpu lab fault BOX list shows what is armed; kinds and targets: docs/testing.md")
        return fault_reply(str(request.get("op")), bytes(reply.payload), self.name)

    def _note(self, event: str, **what) -> None:
        entry = {"t": time.time(), "event": event, "box": self.name, "device": self.device, **what}
        self.history.append(entry)
        log.info("fault %s on %s/%s at %s %s", event, self.name, self.device,
                    time.strftime("%H:%M:%S", time.gmtime(entry["t"])), what or "")

    def arm(self, kind: str, target: str | None = None, *, ms: float | None = None,
            duration: float | None = None, count: int | None = None, device: str | None = None) -> dict:
        """Arm one fault in the box; returns it (``id``, ``armed_at``, ...)."""
        request = {"op": "arm", "device": device or self.device, "kind": kind, "target": target, "ms": ms,
                   "duration": duration, "count": count}
        fault = self._ask(request)["fault"]
        self._note("armed", kind=kind, target=target, id=fault["id"])
        return fault

    def stall(self, target: str = "mmio-read", ms: float | None = None, **bounds) -> dict:
        """Hold each completion of ``target`` (config-read, mmio-read, dma-read) for ``ms``,
        or until cleared (``ms=None``; still bounded by ``duration``)."""
        return self.arm("stall", target, ms=ms, **bounds)

    def abort(self, target: str = "mmio-read", **bounds) -> dict:
        """Answer reads of ``target`` with a completer abort: the guest reads all-ones."""
        return self.arm("abort", target, **bounds)

    def refuse_dma(self, target: str = "dma", **bounds) -> dict:
        """The device's DMA (dma-read, dma-write, or dma: both) fails as an unsupported request."""
        return self.arm("refuse-dma", target, **bounds)

    def drop_posted(self, **bounds) -> dict:
        """Drop every posted write to the device (MMIO writes, write batches)."""
        return self.arm("drop-posted", **bounds)

    def cut(self, device: str | None = None) -> dict:
        """Take the device's link down now (the host sees the peer close); re-attach to recover."""
        return self.arm("cut", device=device)

    def remove(self, grace: float | None = 1.0, duration: float = DEFAULT_DURATION,
               device: str | None = None, unplug_timeout: float = 30.0) -> dict:
        """Surprise removal: the box withdraws the device now (its link goes down, new links
        are refused for ``duration``); after ``grace`` seconds the control plane's
        ``device_del`` follows (``hotplug.detach`` of ``attachment``; ``grace=None``: not at all),
        waiting at most ``unplug_timeout`` s for the guest to let go (the guest's pciehp
        takes 5 s after the attention button, more in a loaded TCG guest)."""
        fault = self.arm("remove", device=device, duration=duration)
        if grace is not None and self.attachment is not None:
            time.sleep(grace)
            from dxpu_vfio.lab import hotplug
            self._note("device_del", grace=grace)
            hotplug.detach(self.attachment, timeout=unplug_timeout)
        return fault

    def clear(self, fault_id: int | None = None, device: str | None = None) -> list[dict]:
        """End armed faults (all of the box's by default); a held completion goes on."""
        cleared = self._ask({"op": "clear", "id": fault_id, "device": device})["cleared"]
        self._note("cleared", ids=[f["id"] for f in cleared])
        return cleared

    def list(self) -> dict:
        """What is armed on the box, its recent fault log and hits per device."""
        if self.frozen_at is not None:
            return {"faults": [], "log": [], "hits": {}, "frozen": True}
        return self._ask({"op": "list"})

    def listed(self, device: str | None = None) -> bool:
        """Whether the box's INVENTORY (what a pool refreshing the box sees) lists the
        device: a surprise removal takes it out until the fault ends."""
        def ask() -> dict:
            return boxes.fetch_inventory(self.address, self.tls_dir, self.timeout)
        inventory = ask() if self.netns is None else in_netns(self.netns, ask)
        return any(d["id"] == (device or self.device) for d in inventory["devices"])

    # --- freezing (done here: a stopped box cannot act) ----------------------------------
    def freeze(self, seconds: float | None = None) -> None:
        """SIGSTOP the box (every device of it); thawed after ``seconds`` (default
        DEFAULT_DURATION, at most MAX_DURATION) or by :meth:`thaw`."""
        if self.proxy_pid is None:
            raise FaultError(f"box {self.name} has no remote proxy running", hint="dxpu lab status")
        seconds = DEFAULT_DURATION if seconds is None else seconds
        if not 0 < seconds <= MAX_DURATION:
            raise FaultError(f"freeze for more than 0 and at most {MAX_DURATION:.0f} s")
        box_process.freeze(self.proxy_pid)
        self.frozen_at = time.monotonic()
        self._note("frozen", seconds=seconds)
        self._thaw_timer = threading.Timer(seconds, self.thaw)
        self._thaw_timer.daemon = True
        self._thaw_timer.start()

    def thaw(self, force: bool = False) -> float | None:
        """SIGCONT a box this client froze (``force``: any stopped box, e.g. one a killed
        ``dxpu lab fault`` left frozen); returns how long this client kept it frozen."""
        timer, self._thaw_timer = self._thaw_timer, None
        if timer is not None and timer is not threading.current_thread():
            timer.cancel()
        if self.frozen_at is None:
            if force and self.proxy_pid is not None:
                box_process.thaw(self.proxy_pid)
                self._note("thawed", forced=True)
            return None
        box_process.thaw(self.proxy_pid)
        seconds = time.monotonic() - self.frozen_at
        self._note("thawed", seconds=round(seconds, 3))
        try:  # before frozen_at goes: whoever sees the box thawed finds the freeze in its counters
            self._ask({"op": "note", "device": self.device, "kind": "freeze", "seconds": seconds}, thawed=True)
        except DxpuError as exc:  # the box's counters miss it; the freeze itself is over
            log.warning("box %s did not take the freeze note: %s", self.name, exc)
        self.frozen_at = None
        return seconds

    def wait_thawed(self) -> float:
        """Block until the thaw timer of :meth:`freeze` has run; how long it was frozen."""
        started = self.frozen_at
        timer = self._thaw_timer
        if timer is not None:
            timer.join()
        return time.monotonic() - started if started is not None else 0.0

    def close(self) -> None:
        """Teardown: thaw, then clear everything armed on the box."""
        self.thaw()
        try:
            self.clear()
        except DxpuError as exc:  # a box that died in the test has no faults left
            log.warning("clearing faults on %s failed: %s", self.name, exc)
