#!/usr/bin/env python3
"""What one NVMe command costs the device's worker, with no VM and no network: our
controller on the host proxy's DMA table over a sealed memfd (guest RAM as QEMU hands it
over), MSI on, each batch of Reads run by the worker's loop on this thread. Each Read's
pages are scattered (a 128 KiB Read is 32 pages in a PRP list), as a guest's pages are.

This is the Python the local data path pays per command (the namespace file's `preadv`
included, its page cache warm); `bench_nvme.py` measures the whole path in a guest. Prints
microseconds per command (median and tenth percentile of the batches) and writes
results/bench/nvme_cpu.json.

    .venv/bin/python scripts/bench_nvme_cpu.py [--batches 1500]
"""

from __future__ import annotations

import argparse
import fcntl
import mmap
import os
import random
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dxpu_vfio.bench import table, write_json  # noqa: E402
from dxpu_vfio.vfio_user.dma import DmaTable  # noqa: E402
from dxpu_vfio.vfio_user.protocol import DMA_FLAG_READ, DMA_FLAG_WRITE  # noqa: E402
from qemu_device import nvme, nvme_identity, nvme_spec  # noqa: E402
from qemu_device.capabilities import CAP_ID_MSI  # noqa: E402
from qemu_device.ports import NullIrqPort  # noqa: E402

BASE, RAM = 1 << 32, 64 << 20
ASQ, ACQ, IOSQ, IOCQ, LISTS = (BASE + n * 0x1000 for n in range(5))
DATA_PAGES = range(4096, 8192)  # page frames the data lands in (16-32 MiB)
ENTRIES = 64
SHAPES = [(4096, 8), (4096, 16), (131072, 4), (131072, 16)]  # (bytes a Read, Reads a batch)


class Bench:
    """A controller and just enough of a driver: queues in the memfd, commands posted,
    the batch run by the worker's loop here, completions consumed."""

    def __init__(self, namespace: str) -> None:
        fd = os.memfd_create("guest-ram", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, RAM)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        self.ram = mmap.mmap(fd, RAM)  # the driver's view of guest memory
        self.table = DmaTable()
        self.table.add(BASE, RAM, DMA_FLAG_READ | DMA_FLAG_WRITE, fd, 0)  # the device's (the table owns fd)
        self.dev = nvme.NvmeController(namespaces=[{"size": 8 << 20, "path": namespace}], io_workers=0)
        self.dev.attach(self.table, NullIrqPort())
        self.dev.config.write(4, 2, 0x6)  # memory space, bus master
        self.dev.config.write(self.dev.caps.offsets[CAP_ID_MSI] + 2, 2, 1)  # MSI on
        self.tails = {0: 0, 1: 0}
        self.heads = {0: 0, 1: 0}
        self.cid = 0
        self._w(nvme_spec.AQA, (ENTRIES - 1) << 16 | (ENTRIES - 1))
        for reg, addr in ((nvme_spec.ASQ, ASQ), (nvme_spec.ACQ, ACQ)):
            self._w(reg, addr & 0xFFFFFFFF)
            self._w(reg + 4, addr >> 32)
        self._w(nvme_spec.CC, (4 << 20) | (6 << 16) | 1)
        self.run(0, [(0x05, IOCQ, 0, ((ENTRIES - 1) << 16) | 1, 0b11, 0)])  # I/O CQ 1: contiguous, MSI vector 0
        self.run(0, [(0x01, IOSQ, 0, ((ENTRIES - 1) << 16) | 1, 1 | (1 << 16), 0)])  # I/O SQ 1 on CQ 1

    def _w(self, offset: int, value: int) -> None:
        self.dev.region_write(0, offset, value.to_bytes(4, "little"))

    def run(self, qid: int, commands: list[tuple[int, int, int, int, int, int]]) -> int:
        """Post ``commands`` (opcode, PRP1, PRP2, CDW10-12) to SQ ``qid``, run them,
        consume their completions; the nanoseconds the worker's loop took."""
        sq = ASQ if qid == 0 else IOSQ
        for opcode, prp1, prp2, cdw10, cdw11, cdw12 in commands:
            self.cid = (self.cid + 1) & 0xFFFF
            struct.pack_into("<BBHIQQQQ6I", self.ram, sq - BASE + self.tails[qid] * 64, opcode, 0, self.cid,
                             1 if qid else 0, 0, 0, prp1, prp2, cdw10, cdw11, cdw12, 0, 0, 0)
            self.tails[qid] = (self.tails[qid] + 1) % ENTRIES
        self.dev.sqs[qid].tail = self.tails[qid]  # as the doorbell's handler sets it
        started = time.perf_counter_ns()
        self.dev._process(qid)  # the worker's loop, on this thread
        took = time.perf_counter_ns() - started
        cq = ACQ if qid == 0 else IOCQ
        for _ in commands:
            status = struct.unpack_from("<H", self.ram, cq - BASE + self.heads[qid] * 16 + 14)[0] >> 1
            if status:
                raise RuntimeError(f"command failed with status {status:#x}")
            self.heads[qid] = (self.heads[qid] + 1) % ENTRIES
        self._w(nvme_spec.DOORBELLS + 8 * qid + 4, self.heads[qid])
        return took

    def reads(self, size: int, count: int, rng: random.Random) -> list[tuple[int, int, int, int, int, int]]:
        """``count`` Reads of ``size`` bytes, each into scattered pages (PRP lists as needed)."""
        pages, blocks = size // 4096, size >> nvme_identity.LBA_SHIFT
        out = []
        for i in range(count):
            frames = [BASE + f * 4096 for f in rng.sample(DATA_PAGES, pages)]
            prp2 = 0
            if pages == 2:
                prp2 = frames[1]
            elif pages > 2:
                prp2 = LISTS + i * 4096
                struct.pack_into(f"<{pages - 1}Q", self.ram, prp2 - BASE, *frames[1:])
            lba = rng.randrange(0, (8 << 20 >> nvme_identity.LBA_SHIFT) - blocks) & ~7
            out.append((0x02, frames[0], prp2, lba, 0, blocks - 1))
        return out

    def close(self) -> None:
        self.dev.close()
        self.table.clear()
        self.ram.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=1500, help="batches measured per shape (after 200 unmeasured)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rng = random.Random(1)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="dxpu-bench-nvme-cpu-") as work:
        namespace = os.path.join(work, "ns.img")
        with open(namespace, "wb") as f:
            f.write(os.urandom(8 << 20))  # in the page cache: the file's cost is a copy
        bench = Bench(namespace)
        try:
            for size, count in SHAPES:
                commands = bench.reads(size, count, rng)
                for _ in range(200):
                    bench.run(1, commands)
                took = sorted(bench.run(1, commands) / count / 1000 for _ in range(args.batches))
                results[f"read-{size // 1024}k-batch{count}"] = {
                    "us_per_command_median": took[len(took) // 2], "us_per_command_p10": took[len(took) // 10]}
        finally:
            bench.close()
    print(table(["workload", "µs per command (median)", "p10"],
                [[name, r["us_per_command_median"], r["us_per_command_p10"]] for name, r in results.items()]))
    path = write_json("nvme_cpu", {"batches": args.batches, "results": results}, args.out)
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
