"""The README's demo on the embedded defaults.

A lab with one GPU box (its own network namespace, reached over veth with mutual TLS)
that holds an NVMe drive and the test device; a guest VM that gets both hot-plugged,
uses them with its own kernel drivers and tools, shows what it measured and what the
proxies counted, and gives them back. It grows with each capability of the DxPU path.
"""

from __future__ import annotations

import json
import os
import tempfile

from . import hotplug
from .guest_devices import nvme_disk
from .lab import lab
from .vm import Vm, VmConfig

MiB = 1 << 20
EDU = "0000:00:05.0"


def _kv(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split() if "=" in item)


def run_demo(image: str = "tiny", accel: str = "tcg", as_json: bool = False) -> int:
    say = (lambda _m: None) if as_json else (lambda m: print(m, flush=True))
    out: dict = {"image": image, "accel": accel}
    disks = tempfile.mkdtemp(prefix="dxpu-demo-box-")
    topology = lab.Topology(f"demo{os.getpid()}", [lab.BoxSpec("box1", [
        {"id": "nvme0", "model": "nvme", "settings": {"namespaces": [{"size": 128 * MiB, "path": f"{disks}/nvme0.img"}]}},
        {"id": "td0", "model": "testdev"}])])
    say("demo: bringing up the lab: host namespace + GPU box 'box1' over veth (198.18.1.0/24), mutual TLS ...")
    state = lab.up(topology)
    try:
        box = state.box("box1")
        say(f"demo: box1 at {box.box_ip} serves nvme0 (NVMe, 128 MiB) and td0 (test device)")
        with Vm(VmConfig(image=image, name="dxpu-demo", accel=accel, edu=True)) as vm:
            vm.boot()
            out["kernel"] = vm.run("uname -r").stdout.strip()
            out["boot_seconds"] = vm.boot_seconds
            say(f"demo: guest up under {accel} (QEMU {vm.qemu.version_text}, kernel {out['kernel']}) "
                f"in {vm.boot_seconds:.1f} s; logs in {vm.workdir}")

            remote = lambda dev: {"model": "remote", "settings": state.remote_settings("box1", dev),  # noqa: E731
                                  "netns": state.host_netns}
            nvme = hotplug.attach(vm, **remote("nvme0"))
            disk = nvme_disk(vm, nvme.guest_bdf)
            say(f"demo: hot-plugged nvme0 from box1 -> guest {nvme.guest_bdf}, driver "
                f"{vm.run(f'basename $(readlink /sys/bus/pci/devices/{nvme.guest_bdf}/driver)').stdout.strip()}, "
                f"disk /dev/{disk}")
            # busybox dd prints no timing and busybox date has no %N: time with /proc/uptime (10 ms)
            now = "cut -d' ' -f1 /proc/uptime"
            io = vm.run(f"dd if=/dev/urandom of=/tmp/data bs=1M count=8 2>/dev/null; a=$({now}); "
                        f"dd if=/tmp/data of=/dev/{disk} bs=128k oflag=direct 2>/dev/null; sync; b=$({now}); "
                        f"echo 3 > /proc/sys/vm/drop_caches; c=$({now}); "
                        f"dd if=/dev/{disk} of=/tmp/back bs=128k count=64 iflag=direct 2>/dev/null; d=$({now}); "
                        f"echo write_s=$(echo $a $b | awk '{{print $2-$1}}') read_s=$(echo $c $d | awk '{{print $2-$1}}') "
                        f"src=$(md5sum < /tmp/data | cut -c1-32) back=$(md5sum < /tmp/back | cut -c1-32)",
                        timeout=300).stdout
            nv = _kv(io)
            out["nvme"] = {"disk": disk, "match": nv["src"] == nv["back"],
                           "write_MBps": 8 * MiB / 1e6 / max(float(nv["write_s"]), 0.01),
                           "read_MBps": 8 * MiB / 1e6 / max(float(nv["read_s"]), 0.01)}
            say(f"demo: guest wrote 8 MiB of random data with dd, dropped its caches, read it back: "
                f"{'checksums match' if out['nvme']['match'] else 'CHECKSUMS DIFFER'} "
                f"(write {out['nvme']['write_MBps']:.1f} MB/s, read {out['nvme']['read_MBps']:.1f} MB/s)")

            td = hotplug.attach(vm, **remote("td0"))
            bdf = td.guest_bdf
            vm.run("echo 2 > /proc/sys/vm/nr_hugepages; echo '1b36 10f0' > /sys/bus/pci/drivers/uio_pci_generic/new_id")
            guest = {
                "dma_copy_64k": _kv(vm.run(f"dxpu-testdev {bdf} dma-copy 65536").stdout),
                "intx": _kv(vm.run(f"dxpu-testdev {bdf} irq 10").stdout),
                "mmio_read": _kv(vm.run(f"dxpu-mmio {bdf} 0 time-read 8 1000").stdout),
                "edu_mmio_read": _kv(vm.run(f"dxpu-mmio {EDU} enable >/dev/null && dxpu-mmio {EDU} 0 time-read 0 1000").stdout),
            }
            out["testdev"] = guest
            say(f"demo: hot-plugged td0 from box1 -> guest {bdf}: DMA copy of 64 KiB between guest buffers "
                f"match={guest['dma_copy_64k']['match']}; INTx counted by uio_pci_generic "
                f"{guest['intx']['received']}/10; MMIO read {int(guest['mmio_read']['median_ns']) / 1000:.0f} µs "
                f"across the network vs {int(guest['edu_mmio_read']['median_ns']) / 1000:.2f} µs for QEMU's edu")

            out["proxies"] = {}
            for name, att in (("nvme0", nvme), ("td0", td)):
                dev = att.server.stats()["device"]
                link = dev["link"]
                out["proxies"][name] = dev
                reads = link["requests"].get("REGION_READ", {"count": 0, "wait_us": 0})
                say(f"demo: host proxy of {name}: {reads['count']} reads waited {reads['wait_us'] / 1000:.1f} ms on "
                    f"the link, {dev['writes_posted']} posted writes, DMA {dev['dma_bytes_read']} B out of and "
                    f"{dev['dma_bytes_written']} B into guest memory, {dev['irqs']} interrupts, "
                    f"{dev['dma_refused']} DMA refused")
            hotplug.detach(td)
            hotplug.detach(nvme)
            say("demo: both devices unplugged and returned to box1")
            vm.shutdown()
    finally:
        lab.down(state.name)
    say("demo: lab down (namespaces, proxies, certificates removed)")
    if as_json:
        print(json.dumps(out, indent=2, default=str))
    return 0 if out.get("nvme", {}).get("match") else 1
