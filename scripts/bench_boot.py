#!/usr/bin/env python3
"""Boot-to-shell time of the guest images: the median of several boots.

Boot-to-shell is from QEMU's exec to the first command answered in the guest
(serial agent on tiny, qemu-guest-agent on full). Prints a table, writes JSON.

    .venv/bin/python scripts/bench_boot.py [--boots 5] [--image tiny --image full] [--accel tcg]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dxpu_vfio.bench import summary, table, write_json  # noqa: E402
from dxpu_vfio.procs import exit_on_sigterm  # noqa: E402
from dxpu_vfio.vms.runner import Vm, VmConfig  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--boots", type=int, default=5)
    parser.add_argument("--image", action="append", choices=["tiny", "full"])
    parser.add_argument("--accel", default="tcg", choices=["tcg", "kvm"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    exit_on_sigterm()  # a SIGTERM still runs the cleanup below: no VM or lab left
    results = {}
    for image in args.image or ["tiny", "full"]:
        samples = []
        for i in range(args.boots):
            with Vm(VmConfig(image=image, name=f"bench-{image}-{i}", accel=args.accel)) as vm:
                vm.boot(timeout=300)
                samples.append(vm.boot_seconds)
                vm.shutdown()
            print(f"  {image} boot {i + 1}/{args.boots}: {samples[-1]:.2f} s", flush=True)
        results[image] = {"boot_to_shell_s": summary(samples), "samples_s": samples}
    print()
    print(table(["image", "boots", "median s", "min s", "max s"],
                [[name, r["boot_to_shell_s"]["n"], r["boot_to_shell_s"]["median"],
                  r["boot_to_shell_s"]["min"], r["boot_to_shell_s"]["max"]] for name, r in results.items()]))
    path = write_json("boot", {"accel": args.accel, "qemu": vm.qemu.version_text, "results": results}, args.out)
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
