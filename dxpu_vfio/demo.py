"""The README's demo on the embedded defaults.

Today: boot a guest, show its kernel and the PCI devices it sees (with the empty
hot-plug root ports that pooled devices will be plugged into), and shut it down.
It grows with each capability of the DxPU path.
"""

from __future__ import annotations

import json

from .vm import Vm, VmConfig

# Runs in the guest: busybox has no lspci, so read sysfs.
LIST_PCI = r"""
for d in /sys/bus/pci/devices/*; do
  drv=-; [ -e "$d/driver" ] && drv=$(basename "$(readlink "$d/driver")")
  echo "$(basename "$d") $(cat "$d/vendor"):$(cat "$d/device") class=$(cat "$d/class") driver=$drv"
done
"""


def run_demo(image: str = "tiny", accel: str = "tcg", as_json: bool = False) -> int:
    say = (lambda _m: None) if as_json else (lambda m: print(m, flush=True))
    config = VmConfig(image=image, name="dxpu-demo", accel=accel)
    with Vm(config) as vm:
        say(f"demo: booting a {image} guest under {accel} with QEMU {vm.qemu.version_text} "
            f"({config.root_ports} hot-plug root ports) ...")
        vm.boot()
        say(f"demo: guest shell after {vm.boot_seconds:.1f} s; logs in {vm.workdir}")
        kernel = vm.run("uname -r").stdout.strip()
        devices = [line.split(" ", 1) for line in vm.run(LIST_PCI).stdout.splitlines() if line]
        say(f"demo: guest kernel {kernel}")
        say("demo: guest PCI devices:")
        for bdf, rest in devices:
            say(f"  {bdf}  {rest}")
        vm.shutdown()
        say("demo: guest shut down")
    if as_json:
        print(json.dumps({"image": image, "accel": accel, "boot_seconds": vm.boot_seconds,
                          "kernel": kernel, "pci": dict(devices), "workdir": str(vm.workdir)}, indent=2))
    return 0
