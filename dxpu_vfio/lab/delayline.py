"""A userspace delay line: a TCP relay that holds every chunk for a fixed time.

This kernel has no sch_netem, so the lab puts this relay in the path between the host
node and a box when it must add delay: it listens on the host side of the veth and
forwards to the box, each direction delaying what it carries by ``delay_us`` (one way)
and keeping order. It measures what it really achieved (scheduling adds to the asked
delay) and reports it on SIGUSR1 / exit, so every benchmark can print the true value.

    python -m dxpu_vfio.lab.delayline --listen 198.18.1.1:7100 --to 198.18.1.2:7000 --delay-us 200
"""

from __future__ import annotations

import argparse
import signal
import socket
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path

from dxpu_vfio.procs import write_json_atomic


class DelayLine:
    """Threads, not asyncio: epoll's millisecond timeouts cannot hold a chunk for 50 µs,
    ``time.sleep`` (clock_nanosleep) can, to within the scheduler's wake-up time."""

    def __init__(self, listen: tuple[str, int], upstream: tuple[str, int], delay_us: float) -> None:
        self.listen = listen
        self.upstream = upstream
        self.delay = delay_us / 1e6
        self.achieved: deque[float] = deque(maxlen=100000)  # seconds chunks really waited
        self.chunks = 0
        self.bytes = 0
        self._stop = threading.Event()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        queue: deque = deque()
        ready = threading.Condition()

        def sender() -> None:
            while True:
                with ready:
                    while not queue:
                        ready.wait()
                    due, arrived, data = queue.popleft()
                if data is None:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                try:
                    dst.sendall(data)
                except OSError:
                    break
                self.achieved.append(time.monotonic() - arrived)
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

        thread = threading.Thread(target=sender, daemon=True)
        thread.start()
        try:
            while data := src.recv(65536):
                now = time.monotonic()
                self.chunks += 1
                self.bytes += len(data)
                with ready:
                    queue.append((now + self.delay, now, data))
                    ready.notify()
        except OSError:
            pass
        finally:
            with ready:
                queue.append((0, 0, None))
                ready.notify()
            thread.join()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        back = threading.Thread(target=self._pump, args=(upstream, client), daemon=True)
        back.start()
        self._pump(client, upstream)
        back.join()
        client.close()
        upstream.close()

    def report(self) -> dict:
        got = sorted(self.achieved)
        return {"asked_us": self.delay * 1e6, "chunks": self.chunks, "bytes": self.bytes,
                "achieved_median_us": statistics.median(got) * 1e6 if got else None,
                "achieved_p99_us": got[int(len(got) * 0.99)] * 1e6 if got else None}

    def run(self) -> None:
        listener = socket.create_server(self.listen, reuse_port=False)
        listener.settimeout(0.5)
        while not self._stop.is_set():
            try:
                client, _ = listener.accept()
            except socket.timeout:
                continue
            client.settimeout(None)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()
        listener.close()

    def stop(self) -> None:
        self._stop.set()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="TCP delay line")
    parser.add_argument("--listen", required=True)
    parser.add_argument("--to", required=True)
    parser.add_argument("--delay-us", type=float, default=0.0)
    parser.add_argument("--report", type=Path)
    args = parser.parse_args(argv)
    split = lambda s: (s.rpartition(":")[0], int(s.rpartition(":")[2]))  # noqa: E731
    line = DelayLine(split(args.listen), split(args.to), args.delay_us)

    def write_report(*_: object) -> None:
        if args.report:
            write_json_atomic(args.report, line.report())

    signal.signal(signal.SIGUSR1, write_report)
    signal.signal(signal.SIGTERM, lambda *_: line.stop())
    signal.signal(signal.SIGINT, lambda *_: line.stop())
    print(f"delay line {args.listen} -> {args.to}, {args.delay_us} µs each way", flush=True)
    line.run()
    write_report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
