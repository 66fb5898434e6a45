#!/usr/bin/env python3
"""NVMe in the guest: our controller remote (GPU box over the lab network, TLS) vs local
(served by the host proxy) vs QEMU's own emulated nvme with a file backend, all in the
same full-image VM, measured by fio in the guest with the guest's own nvme driver.

Workloads: sequential 128 KiB read and write, random 4 KiB read and write (direct I/O,
libaio, iodepth 4). Prints a table with ratios and writes results/bench/nvme.json.

    .venv/bin/python scripts/bench_nvme.py [--runtime 8] [--size-mib 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dxpu_vfio.bench import table, write_json  # noqa: E402
from dxpu_vfio.lab import hotplug  # noqa: E402
from dxpu_vfio.lab import lab  # noqa: E402
from dxpu_vfio.lab.guest_devices import nvme_disk  # noqa: E402
from dxpu_vfio.vms.runner import Vm, VmConfig  # noqa: E402

WORKLOADS = {"seq-read-128k": ("read", "128k"), "seq-write-128k": ("write", "128k"),
             "rand-read-4k": ("randread", "4k"), "rand-write-4k": ("randwrite", "4k")}


def fio(vm: Vm, dev: str, rw: str, bs: str, runtime: int, size_mib: int) -> dict:
    out = vm.run(f"fio --name=b --filename=/dev/{dev} --direct=1 --ioengine=libaio --iodepth=4 --rw={rw} "
                 f"--bs={bs} --size={size_mib}M --runtime={runtime} --time_based --output-format=json",
                 timeout=runtime * 10 + 120).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["read"] if "read" in rw else job["write"]
    return {"MBps": side["bw_bytes"] / 1e6, "iops": side["iops"],
            "lat_mean_us": side["lat_ns"]["mean"] / 1000}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runtime", type=int, default=8)
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    size = args.size_mib << 20
    work = Path(tempfile.mkdtemp(prefix="dxpu-bench-nvme-"))
    qemu_disk = work / "qemu-nvme.img"
    with open(qemu_disk, "wb") as f:
        f.truncate(size)
    topology = lab.Topology("bn", [lab.BoxSpec("box1", [{"id": "nv0", "model": "nvme", "settings": {
        "namespaces": [{"size": size, "path": str(work / "remote.img")}]}}])])
    state = lab.up(topology)
    results: dict[str, dict] = {}
    try:
        extra = ["-drive", f"file={qemu_disk},if=none,id=qn,format=raw,cache=none,aio=threads",
                 "-device", "nvme,drive=qn,serial=QEMUNVME,addr=0x6"]
        with Vm(VmConfig(image="full", name="bench-nvme", extra_args=extra, boot_timeout=240)) as vm:
            vm.boot()
            qemu_dev = nvme_disk(vm, "0000:00:06.0")
            local = hotplug.attach(vm, "nvme", settings={"namespaces": [{"size": size, "path": str(work / "local.img")}]})
            remote = hotplug.attach(vm, "remote", settings=state.remote_settings("box1", "nv0"), netns=state.host_netns)
            devices = {"qemu-nvme": qemu_dev, "local": nvme_disk(vm, local.guest_bdf),
                       "remote": nvme_disk(vm, remote.guest_bdf)}
            for name, dev in devices.items():
                results[name] = {}
                for workload, (rw, bs) in WORKLOADS.items():
                    results[name][workload] = fio(vm, dev, rw, bs, args.runtime, args.size_mib)
                    print(f"  {name:9} {workload:15} {results[name][workload]['MBps']:8.1f} MB/s", flush=True)
            hotplug.detach(remote)
            hotplug.detach(local)
    finally:
        lab.down(state.name)
    rows = []
    for workload in WORKLOADS:
        q, lo, re = (results[d][workload]["MBps"] for d in ("qemu-nvme", "local", "remote"))
        rows.append([workload, q, lo, re, re / q, re / lo])
    print()
    print(table(["workload", "QEMU nvme MB/s", "local MB/s", "remote MB/s", "remote/QEMU", "remote/local"], rows))
    path = write_json("nvme", {"runtime_s": args.runtime, "size_mib": args.size_mib, "results": results}, args.out)
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
