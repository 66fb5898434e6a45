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
import asyncio
import json
import signal
import socket
import statistics
import sys
import time
from pathlib import Path


class DelayLine:
    def __init__(self, listen: tuple[str, int], upstream: tuple[str, int], delay_us: float) -> None:
        self.listen = listen
        self.upstream = upstream
        self.delay = delay_us / 1e6
        self.achieved: list[float] = []  # seconds each chunk really waited (sampled)
        self.chunks = 0
        self.bytes = 0

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def sender() -> None:
            while True:
                due, arrived, data = await queue.get()
                if data is None:
                    break
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                if self.chunks % 16 == 0 and len(self.achieved) < 100000:
                    self.achieved.append(loop.time() - arrived)
            writer.close()

        task = asyncio.create_task(sender())
        try:
            while data := await reader.read(65536):
                now = loop.time()
                self.chunks += 1
                self.bytes += len(data)
                queue.put_nowait((now + self.delay, now, data))
        except ConnectionError:
            pass
        finally:
            queue.put_nowait((0, 0, None))
            await task

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        for w in (writer, up_writer):
            w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer),
                             return_exceptions=True)

    def report(self) -> dict:
        got = sorted(self.achieved)
        return {"asked_us": self.delay * 1e6, "chunks": self.chunks, "bytes": self.bytes,
                "achieved_median_us": statistics.median(got) * 1e6 if got else None,
                "achieved_p99_us": got[int(len(got) * 0.99)] * 1e6 if got else None}

    async def run(self, stop: asyncio.Event) -> None:
        server = await asyncio.start_server(self._serve, *self.listen)
        async with server:
            await stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="TCP delay line")
    parser.add_argument("--listen", required=True)
    parser.add_argument("--to", required=True)
    parser.add_argument("--delay-us", type=float, default=0.0)
    parser.add_argument("--report", type=Path)
    args = parser.parse_args(argv)
    split = lambda s: (s.rpartition(":")[0], int(s.rpartition(":")[2]))  # noqa: E731
    line = DelayLine(split(args.listen), split(args.to), args.delay_us)

    def write_report() -> None:
        if args.report:
            tmp = args.report.with_suffix(".tmp")
            tmp.write_text(json.dumps(line.report()))
            tmp.rename(args.report)

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGUSR1, write_report)
        print(f"delay line {args.listen} -> {args.to}, {args.delay_us} µs each way", flush=True)
        await line.run(stop)

    asyncio.run(runner())
    write_report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
