"""The lab's packet-level network emulator, for kernels without sch_netem.

It sits in a lab link's middle namespace, where the host's and the box's packets are
routed into one TUN device (``dxpu_vfio/lab/lab.py`` sets the routes). Every IPv4 packet
read from it is classed by its destination (``up``: to the box, ``down``: to the host),
then dropped (random or Gilbert-Elliott loss), duplicated, held for its delay (jitter
drawn per packet) or sent at once past the held ones (reordering), and written back into
the TUN, from where the kernel forwards it on. So the link's TCP sees real losses,
delays and reordering, unlike a relay that ends the connection. Rates are the kernel's
TBF, on the middle namespace's veth.

The poll loop is one thread: ``select`` (microsecond timeouts; the timer slack is set to
1 ns) on the TUN until the next packet is due, waking a little early by the overshoot
it has measured and spinning the rest, so a hold of 50 µs is 50 µs. The TUN carries
virtio-net headers with TSO on, so bulk traffic crosses as 64 KiB packets; while a
direction has loss, duplication or reordering, offloads are turned off and the kernel
hands over wire-sized packets (each one may be lost on its own).

This is the reference and the fallback: the lab runs the same loop in C (``netemu.c``,
built with the host's gcc) where it can, as this one costs ~10 µs of interpreter a packet.
The C one also has a kernel fast path (tc programs on the link's veths that let the kernel
forward a direction that asks for nothing, see ``netemu.c``); this one takes every packet
the routes send into its TUN.

Control: the config file (``up key=value ...`` per direction, see
:func:`~dxpu_vfio.lab.impairment.config_text`) is re-read on
SIGHUP (no packet or connection is dropped by a change), SIGUSR1 writes the report
(what it really did: packets, bytes, losses, held-time percentiles per direction),
SIGUSR2 zeroes the counters, SIGTERM sends what is held and exits.

    python -m dxpu_vfio.lab.netemu --tun emu0 --up-dst 198.18.1.2 --down-dst 198.18.1.1 \\
        --config link.conf --report report.json
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import heapq
import os
import random
import select
import signal
import socket
import struct
import sys
import time
from collections import deque
from pathlib import Path

from dxpu_vfio.lab.impairment import Impairment, parse_config_text
from dxpu_vfio.procs import write_json_atomic

TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TUN, IFF_NO_PI, IFF_VNET_HDR = 0x0001, 0x1000, 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6 = 0x01, 0x02, 0x04
VNET_HDR = 10  # struct virtio_net_hdr
DST = VNET_HDR + 16  # IPv4 destination address
PR_SET_TIMERSLACK = 29
SAMPLES = 200_000  # held times kept per direction for the percentiles


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI | IFF_VNET_HDR))
    return fd


def set_offload(fd: int, tso: bool) -> None:
    fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | (TUN_F_TSO4 | TUN_F_TSO6 if tso else 0))


def percentile(sorted_values: list[int], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))] / 1000 if sorted_values else 0.0


class Direction:
    """One direction's impairment, Gilbert-Elliott state and counters."""

    def __init__(self, name: str, rng: random.Random) -> None:
        self.name = name
        self.rng = rng
        self.imp = Impairment()
        self.bad = False  # Gilbert-Elliott state
        self.last_due = 0  # order is kept: no packet is due before the one ahead of it
        self.reset()

    def reset(self) -> None:
        self.packets = self.bytes = self.sent = self.sent_bytes = 0
        self.lost_random = self.lost_burst = self.duplicated = self.reordered = 0
        self.dark_since = self.blackout_ns = 0  # the current run of lost packets began (0: none), the longest's span
        self.held: deque[int] = deque(maxlen=SAMPLES)

    def configure(self, imp: Impairment) -> None:
        self.imp = imp
        if not imp.ge_p:
            self.bad = False

    @property
    def passthrough(self) -> bool:
        return not self.imp.needs_emulator

    def lost(self) -> bool:
        imp, rng = self.imp, self.rng
        if imp.ge_p:
            self.bad = rng.random() >= imp.ge_r if self.bad else rng.random() < imp.ge_p
            if rng.random() < (imp.ge_loss_bad if self.bad else imp.ge_loss_good):
                self.lost_burst += 1
                return True
        if imp.loss and rng.random() < imp.loss:
            self.lost_random += 1
            return True
        return False

    def hold_ns(self) -> int:
        imp = self.imp
        delay = imp.delay_us
        if imp.jitter_us:
            if imp.distribution == "uniform":
                delay += self.rng.uniform(-imp.jitter_us, imp.jitter_us)
            else:
                delay = self.rng.gauss(delay, imp.jitter_us)
        return int(max(delay, 0.0) * 1000)

    def report(self) -> dict:
        held = sorted(self.held)
        lost = self.lost_random + self.lost_burst
        mean = sum(held) / len(held) / 1000 if held else 0.0
        std = (sum((h / 1000 - mean) ** 2 for h in held) / len(held)) ** 0.5 if held else 0.0
        return {"asked": self.imp.to_dict(), "packets": self.packets, "bytes": self.bytes,
                "sent": self.sent, "sent_bytes": self.sent_bytes, "lost": lost,
                "lost_random": self.lost_random, "lost_burst": self.lost_burst,
                "loss_rate": lost / self.packets if self.packets else 0.0,
                "blackout_ms": max(self.blackout_ns, time.monotonic_ns() - self.dark_since if self.dark_since else 0) / 1e6,
                "duplicated": self.duplicated, "reordered": self.reordered,
                "kernel_packets": 0, "held_samples": len(held),
                "delay_us": {"mean": mean, "std": std, "p50": percentile(held, 0.5), "p90": percentile(held, 0.9),
                             "p99": percentile(held, 0.99), "max": held[-1] / 1000 if held else 0.0}}


class Emulator:
    def __init__(self, fd: int, up_dst: str, down_dst: str, seed: int | None = None) -> None:
        self.fd = fd
        rng = random.Random(seed)
        self.up, self.down = Direction("up", rng), Direction("down", rng)
        self.by_dst = {socket.inet_aton(up_dst): self.up, socket.inet_aton(down_dst): self.down}
        self.heap: list[tuple[int, int, int, Direction, bytes]] = []
        self.seq = 0
        self.other = 0  # packets to neither end (dropped)
        self.early_ns = 20_000  # how much earlier than due select is asked to return
        self.stopping = False
        self.tso = None

    def configure(self, config: dict[str, Impairment]) -> None:
        for d in (self.up, self.down):
            d.configure(config.get(d.name, Impairment()))
        tso = not (self.up.imp.per_packet or self.down.imp.per_packet)
        if tso != self.tso:
            set_offload(self.fd, tso)
            self.tso = tso

    def report(self) -> dict:
        return {"pid": os.getpid(), "engine": "python", "fast_path": False, "tso": self.tso, "other_dropped": self.other,
                "held_now": len(self.heap),
                "wake_early_us": self.early_ns / 1000, "held_from": "read",  # the C one: "ingress" with its tc stamp
                "up": self.up.report(), "down": self.down.report()}

    def _send(self, d: Direction, data: bytes | memoryview, arrived: int) -> None:
        """The held time is taken as the packet is handed back: the write itself runs the
        kernel's forwarding and the receiver's stack (in this thread), the far end's time."""
        held = time.monotonic_ns() - arrived
        try:
            os.write(self.fd, data)
        except BlockingIOError:
            return  # the kernel's backlog is full: lost, as on a wire
        d.sent += 1
        d.sent_bytes += len(data) - VNET_HDR
        d.held.append(held)

    def _arrive(self, view: memoryview, arrived: int) -> None:
        d = self.by_dst.get(bytes(view[DST:DST + 4]))
        if d is None:
            self.other += 1
            return
        d.packets += 1
        d.bytes += len(view) - VNET_HDR
        passthrough = d.passthrough
        if not passthrough and d.lost():
            d.dark_since = d.dark_since or arrived
            return
        if d.dark_since:  # a packet goes through: the run of losses (the dark) is over
            d.blackout_ns = max(d.blackout_ns, arrived - d.dark_since)
            d.dark_since = 0
        if passthrough:
            self._send(d, view, arrived)
            return
        copies = 2 if d.imp.duplicate and d.rng.random() < d.imp.duplicate else 1
        d.duplicated += copies - 1
        data = bytes(view)
        for _ in range(copies):
            if d.imp.reorder and d.rng.random() < d.imp.reorder:
                d.reordered += 1  # goes now, past the held ones
                self._send(d, data, arrived)
                continue
            due = arrived + d.hold_ns()
            due = d.last_due = max(due, d.last_due)
            if due <= arrived:
                self._send(d, data, arrived)
                continue
            self.seq += 1
            heapq.heappush(self.heap, (due, self.seq, arrived, d, data))

    def _release(self, now: int) -> None:
        heap = self.heap
        while heap and heap[0][0] <= now:
            _, _, arrived, d, data = heapq.heappop(heap)
            self._send(d, data, arrived)

    def run(self, wake_fd: int) -> None:
        """``wake_fd``: the read end of the pipe signals are written to (so a signal ends
        a wait at once: Python would retry the ``select`` after running the handler)."""
        buf = bytearray(VNET_HDR + 262144)
        view = memoryview(buf)
        fd, heap = self.fd, self.heap
        fds = [fd, wake_fd]
        readv, monotonic_ns, sel = os.readv, time.monotonic_ns, select.select
        while not self.stopping:
            now = monotonic_ns()
            if heap:
                self._release(now)
            timeout = None
            if heap:
                timeout = max(0, heap[0][0] - now - self.early_ns) / 1e9
            try:
                readable = sel(fds, [], [], timeout)[0]
            except InterruptedError:
                continue
            if wake_fd in readable:
                os.read(wake_fd, 512)
            if fd in readable:
                for _ in range(64):
                    try:
                        n = readv(fd, [buf])
                    except BlockingIOError:
                        break
                    self._arrive(view[:n], monotonic_ns())
            elif heap and not readable:  # woke for a due packet: learn the overshoot, spin to the due time
                due = heap[0][0]
                now = monotonic_ns()
                late = now - (due - self.early_ns)
                self.early_ns = max(2_000, min(100_000, (self.early_ns * 7 + late + 3_000) // 8))
                while now < due:
                    now = monotonic_ns()
        self._release(1 << 62)  # what is held goes out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dxpu_vfio.lab.netemu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tun", required=True)
    parser.add_argument("--up-dst", required=True, help="the box's address (packets to it go up)")
    parser.add_argument("--down-dst", required=True, help="the host's address (packets to it go down)")
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--seed", type=int)
    args = parser.parse_args(argv)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    emu = Emulator(open_tun(args.tun), args.up_dst, args.down_dst, args.seed)
    emu.configure(parse_config_text(args.config.read_text()) if args.config.exists() else {})

    def reload(*_: object) -> None:
        emu.configure(parse_config_text(args.config.read_text()))
        write_json_atomic(args.report, emu.report())

    def reset(*_: object) -> None:
        for d in (emu.up, emu.down):
            d.reset()
        emu.other = 0
        write_json_atomic(args.report, emu.report())

    def stop(*_: object) -> None:
        emu.stopping = True

    signal.signal(signal.SIGHUP, reload)
    signal.signal(signal.SIGUSR1, lambda *_: write_json_atomic(args.report, emu.report()))
    signal.signal(signal.SIGUSR2, reset)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    print(f"emulator on {args.tun}: up to {args.up_dst}, down to {args.down_dst}", flush=True)
    emu.run(wake_r)
    write_json_atomic(args.report, emu.report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
