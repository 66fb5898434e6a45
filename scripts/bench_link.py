#!/usr/bin/env python3
"""The link's own software cost, without a guest: register reads through the host proxy
and a box over mutual TLS on loopback, with the CPU each process spends per read.

A Python vfio-user client stands in for QEMU (so the absolute latency includes a Python
client), the host proxy (forward mode) and the box's remote proxy run as the processes
they are in production. For the reads of a fixed interval it prints the median latency,
and per process and thread the user and system CPU time and the context switches per
read (from /proc/PID/task/*/stat and status), beside the TLS ping-pong floor measured on
the same loopback in the same run. Table on stdout, JSON in results/bench/link.json.

    .venv/bin/python scripts/bench_link.py [--seconds 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dxpu_vfio.bench import table, thread_times, write_json  # noqa: E402
from dxpu_vfio.hostproxy.process import HostProxyProcess  # noqa: E402
from dxpu_vfio.lab import floors  # noqa: E402
from dxpu_vfio.link.transport import TlsFiles, make_certs  # noqa: E402
from dxpu_vfio.remoteproxy.process import RemoteProxyProcess  # noqa: E402
from dxpu_vfio.vfio_user.client import VfioUserClient  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--spin-us", type=float, default=0.0,
                        help="adaptive polling in both proxies: spin this long before sleeping")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dxpu-bench-link-") as tmp:
        d = Path(tmp)
        make_certs(d / "certs", ["host", "blink"])
        port, floor_port = free_port(), free_port()
        (d / "blink.toml").write_text(
            f'name = "blink"\nlisten = "127.0.0.1"\nport = {port}\ntls_dir = "{d / "certs"}"\n'
            f'spin_us = {args.spin_us}\n'
            '[[device]]\nid = "td0"\nmodel = "testdev"\nlease = "bench"\nsettings = { memory_size = 1048576 }\n')
        box = RemoteProxyProcess(d / "blink.toml").start()
        host = None
        try:
            host = HostProxyProcess("remote", d / "h.sock", settings={
                "address": f"127.0.0.1:{port}", "device": "td0", "lease": "bench",
                "tls_dir": str(d / "certs"), "spin_us": args.spin_us}).start()
            client = VfioUserClient(d / "h.sock")
            client.negotiate()
            for _ in range(500):  # warm up
                client.read(0, 0, 4)
            pids = {"host proxy": host.pid, "remote proxy": box.pid, "client": os.getpid()}
            before = {name: thread_times(pid) for name, pid in pids.items()}
            times = []
            end = time.monotonic() + args.seconds
            while time.monotonic() < end:
                started = time.perf_counter_ns()
                client.read(0, 0, 4)
                times.append(time.perf_counter_ns() - started)
            after = {name: thread_times(pid) for name, pid in pids.items()}
            client.close()
            link = host.stats()["device"]["link"]
        finally:
            if host is not None:
                host.stop()
            box.stop()
        floor = floors.measure_tls_loopback(TlsFiles.in_dir(d / "certs", "host"), d / "certs", "blink", floor_port)
    reads = len(times)
    rows, per_process = [], {}
    for name in pids:
        user = sys_ = switches = 0.0
        for tid, (u1, s1, c1, _) in after[name].items():
            u0, s0, c0, _ = before[name].get(tid, (0, 0, 0, 0))
            if (u1 - u0) + (s1 - s0) + (c1 - c0) == 0:
                continue
            user += u1 - u0
            sys_ += s1 - s0
            switches += c1 - c0
        per_process[name] = {"user_us_per_read": user / TICK / reads * 1e6, "sys_us_per_read": sys_ / TICK / reads * 1e6,
                             "switches_per_read": switches / reads}
        rows.append([name, per_process[name]["user_us_per_read"], per_process[name]["sys_us_per_read"],
                     per_process[name]["switches_per_read"]])
    times.sort()
    result = {"spin_us": args.spin_us, "reads": reads, "read_median_us": statistics.median(times) / 1000,
              "read_p99_us": times[int(reads * 0.99)] / 1000, "processes": per_process,
              "self_received": link.get("self_received"), "floor_tls_loopback": floor}
    print(f"{reads} reads in {args.seconds:g} s: median {result['read_median_us']:.1f} µs, "
          f"p99 {result['read_p99_us']:.1f} µs; TLS ping-pong on loopback {floor['median_us']:.1f} µs "
          f"(same run); completions received by the waiting thread: {result['self_received']}")
    print(table(["process", "user µs / read", "system µs / read", "context switches / read"], rows))
    print(f"\nJSON: {write_json('link', result, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
