"""How far a box's copy of a mapped framebuffer lags behind the host's shadow, measured
without a guest: a remote proxy on loopback serves a mapped display, the host proxy's
:class:`RemoteFunction` shadows it in this process, frames with counters are stored
into the shadow (as QEMU's guest stores would be) and a poller reads the counter back
from the box over the link (a REGION_READ that is not a flush: it sees what the
write-back delivered). Staleness of a frame = when the box first showed it - when it
was stored. For ``scripts/bench_display.py``."""

from __future__ import annotations

import socket
import struct
import tempfile
import threading
import time
from pathlib import Path

from dxpu_vfio.hostproxy.forwarder import connect_remote
from dxpu_vfio.link.protocol import LinkCommand
from dxpu_vfio.link.transport import TlsFiles, make_certs
from dxpu_vfio.remoteproxy.process import RemoteProxyProcess
from dxpu_vfio.vfio_user import protocol as vp

BOX = "stalebox"
FRAME = 1024 * 768 * 4


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"n": len(ordered), "p50": pick(0.5), "p99": pick(0.99), "max": ordered[-1]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(frames: int = 200, frame_hz: float = 100.0, writeback_hz: float = 60.0,
            changed: int = FRAME) -> dict:
    """Store ``frames`` frames (the first ``changed`` bytes each, a counter in its first
    8 bytes) at ``frame_hz``; staleness p50/p99 in ms, write-back bytes, scan cost."""
    with tempfile.TemporaryDirectory(prefix="dxpu-stale-") as tmp:
        d = Path(tmp)
        make_certs(d / "certs", ["host", BOX])
        port = _free_port()
        config = d / f"{BOX}.toml"
        config.write_text(f'name = "{BOX}"\nlisten = "127.0.0.1"\nport = {port}\ntls_dir = "{d / "certs"}"\n'
                          '[[device]]\nid = "fb0"\nmodel = "display"\nlease = "stale"\nsettings = { mapped = true }\n')
        box = RemoteProxyProcess(config).start()
        device = None
        try:
            device = connect_remote(f"127.0.0.1:{port}", "fb0", "stale", TlsFiles.in_dir(d / "certs", "host"),
                                    writeback_hz=writeback_hz, completion_timeout=2.0)
            shadow = device.shadows[0]
            shadow.flush()  # the new link's whole BAR, before the clock starts
            stored: dict[int, float] = {}
            seen: dict[int, float] = {}
            stop = threading.Event()

            def poll() -> None:
                last = -1
                while not stop.is_set():
                    # not under the device's lock: the write-back must not wait for the poller
                    reply = device.endpoint.request(LinkCommand.REGION_READ, vp.RegionAccess(0, 0, 8).pack(), 2.0)
                    counter = struct.unpack_from("<Q", vp.RegionAccess.unpack(reply, write=True).data)[0]
                    if counter != last:
                        now = time.monotonic()
                        for c in range(last + 1, counter + 1):
                            seen.setdefault(c, now)  # a frame overtaken by the next is shown as late as it
                        last = counter
                    time.sleep(0.001)

            poller = threading.Thread(target=poll, daemon=True)
            poller.start()
            before = dict(shadow.counters)
            fill = bytes(range(256)) * (changed // 256)
            started = time.monotonic()
            for n in range(1, frames + 1):
                due = started + n / frame_hz
                time.sleep(max(0.0, due - time.monotonic()))
                buf = shadow.memory.buf
                buf[8:changed] = fill[n % 256:][:changed - 8].ljust(changed - 8, b"\0")
                buf[0:8] = struct.pack("<Q", n)
                stored[n] = time.monotonic()
            deadline = time.monotonic() + 2
            while len([c for c in stored if c in seen]) < frames and time.monotonic() < deadline:
                time.sleep(0.01)
            elapsed = time.monotonic() - started
            stop.set()
            poller.join(2)
            lags = [(seen[c] - stored[c]) * 1000 for c in stored if c in seen]
            sent = shadow.counters["bytes_sent"] - before["bytes_sent"]
            scans = shadow.counters["flushes"] - before["flushes"]
            scan_ns = shadow.counters["scan_ns"] - before["scan_ns"]
            return {"frames": frames, "frame_hz": frame_hz, "writeback_hz": writeback_hz, "changed_bytes": changed,
                    "frames_seen": len(lags), "staleness_ms": percentiles(lags) if lags else None,
                    "writeback_MBps": sent / elapsed / 1e6, "bytes_sent": sent,
                    "scan_ms_mean": scan_ns / scans / 1e6 if scans else None, "period_ms": 1000 / writeback_hz}
        finally:
            if device is not None:
                device.close()
            box.stop()
