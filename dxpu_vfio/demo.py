"""The README's demo on the embedded defaults.

Today: boot a guest, hot-plug the test device served by our vfio-user server, let the
guest's own tools and kernel use it (registers, DMA between guest buffers, INTx counted
by the kernel's uio driver, MMIO latency beside QEMU's own edu device), show what the
server counted, unplug it and shut down. It grows with each capability of the DxPU path.
"""

from __future__ import annotations

import json

from . import hotplug
from .vm import Vm, VmConfig

# Runs in the guest: busybox has no lspci, so read sysfs.
LIST_PCI = r"""
for d in /sys/bus/pci/devices/*; do
  drv=-; [ -e "$d/driver" ] && drv=$(basename "$(readlink "$d/driver")")
  echo "$(basename "$d") $(cat "$d/vendor"):$(cat "$d/device") class=$(cat "$d/class") driver=$drv"
done
"""
EDU = "0000:00:05.0"


def _kv(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split() if "=" in item)


def run_demo(image: str = "tiny", accel: str = "tcg", as_json: bool = False) -> int:
    say = (lambda _m: None) if as_json else (lambda m: print(m, flush=True))
    config = VmConfig(image=image, name="dxpu-demo", accel=accel, edu=True)
    out: dict = {"image": image, "accel": accel}
    with Vm(config) as vm:
        say(f"demo: booting a {image} guest under {accel} with QEMU {vm.qemu.version_text} "
            f"({config.root_ports} hot-plug root ports) ...")
        vm.boot()
        out["boot_seconds"] = vm.boot_seconds
        out["kernel"] = vm.run("uname -r").stdout.strip()
        say(f"demo: guest kernel {out['kernel']}, shell after {vm.boot_seconds:.1f} s; logs in {vm.workdir}")

        say("demo: hot-plugging the test device (vfio-user server in its own process) ...")
        att = hotplug.attach(vm, "testdev")
        bdf = att.guest_bdf
        out["pci"] = dict(line.split(" ", 1) for line in vm.run(LIST_PCI).stdout.splitlines() if line)
        say(f"demo: guest PCI devices after the plug ({att.port} -> {bdf}):")
        for dev, rest in out["pci"].items():
            say(f"  {dev}  {rest}{'   <- dxpu test device' if dev == bdf else ''}")

        vm.run("echo 2 > /proc/sys/vm/nr_hugepages; echo '1b36 10f0' > /sys/bus/pci/drivers/uio_pci_generic/new_id")
        guest = {
            "info": _kv(vm.run(f"dxpu-testdev {bdf} info").stdout),
            "scratch": _kv(vm.run(f"dxpu-testdev {bdf} scratch").stdout),
            "dma_copy_64k": _kv(vm.run(f"dxpu-testdev {bdf} dma-copy 65536").stdout),
            "dma_checksum_64k": _kv(vm.run(f"dxpu-testdev {bdf} dma-csum 65536").stdout),
            "intx": _kv(vm.run(f"dxpu-testdev {bdf} irq 10").stdout),
            "mmio_read": _kv(vm.run(f"dxpu-mmio {bdf} 0 time-read 8 2000").stdout),
            "edu_mmio_read": _kv(vm.run(f"dxpu-mmio {EDU} enable >/dev/null && dxpu-mmio {EDU} 0 time-read 0 2000").stdout),
        }
        out["guest"] = guest
        say(f"demo: guest DMA copy of 64 KiB between its buffers: match={guest['dma_copy_64k']['match']} "
            f"in {int(guest['dma_copy_64k']['ns']) / 1e6:.2f} ms; CRC32 by device "
            f"{guest['dma_checksum_64k']['device_crc']} = guest {guest['dma_checksum_64k']['tool_crc']}")
        say(f"demo: INTx interrupts counted by the guest's uio_pci_generic: {guest['intx']['received']}/10")
        say(f"demo: guest MMIO read latency: {int(guest['mmio_read']['median_ns']) / 1000:.1f} µs through "
            f"vfio-user vs {int(guest['edu_mmio_read']['median_ns']) / 1000:.2f} µs for QEMU's edu (median)")

        stats = att.server.stats()["server"]
        out["server"] = stats
        reads = stats["commands"]["REGION_READ"]
        say(f"demo: server counted {reads['count']} region reads ({reads['mean_us']} µs each inside the "
            f"server), {stats['dma']['bytes_read']} B DMA read, {stats['dma']['bytes_written']} B written, "
            f"{stats['irqs']['intx']} INTx")
        hotplug.detach(att)
        say(f"demo: unplugged {att.device_id}; guest sees it gone")
        vm.shutdown()
        say("demo: guest shut down")
    if as_json:
        print(json.dumps(out, indent=2, default=str))
    return 0
