#!/usr/bin/env python3
"""Build the native stream (dxpu_vfio/native/fastlink.c) with Debian's gcc
and libssl-dev; scripts/setup.sh runs this. Variants for checking it:

    .venv/bin/python scripts/build_native.py             # dxpu_vfio/native/_fastlink*.so (what runs)
    .venv/bin/python scripts/build_native.py --sanitize  # build/native-asan/_fastlink*.so (ASan + UBSan)
    .venv/bin/python scripts/build_native.py --fuzz      # build/native-fuzz/fuzz_frame (libFuzzer, clang)

The sanitized build is loaded instead of the normal one when DXPU_FASTLINK_SO names it
(scripts/sanitize.sh does that); the fuzzer is run by scripts/fuzz_native.sh.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "dxpu_vfio" / "native"
WARNINGS = ["-Wall", "-Wextra", "-Wno-missing-field-initializers", "-Wno-unused-parameter", "-Werror"]


def compiler(name: str, hint: str) -> str:
    path = shutil.which(name)
    if path is None:
        sys.exit(f"{name} not found: {hint}")
    return path


def build_module(out_dir: Path, sanitize: bool) -> Path:
    out = out_dir / f"_fastlink{sysconfig.get_config_var('EXT_SUFFIX')}"
    flags = ["-O2", "-g", "-fPIC", "-shared", "-pthread", "-fvisibility=hidden"]
    if sanitize:
        flags = ["-O1", "-g", "-fPIC", "-shared", "-pthread", "-fno-omit-frame-pointer",
                 "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
    # built beside and renamed over: processes that have the old module mapped keep it intact
    tmp = out.with_name(out.name + ".tmp")
    cmd = [compiler("gcc", "apt-get install gcc (scripts/setup.sh does)"), *flags, *WARNINGS,
           f"-I{sysconfig.get_paths()['include']}", str(SRC / "fastlink.c"), "-o", str(tmp), "-lssl", "-lcrypto"]
    out_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        tmp.unlink(missing_ok=True)
        sys.exit(f"building {out.name} failed (is libssl-dev installed? scripts/setup.sh installs it):\n"
                 f"{' '.join(cmd)}\n{proc.stderr}")
    tmp.replace(out)
    return out


def build_fuzzer(out_dir: Path) -> Path:
    out = out_dir / "fuzz_frame"
    cmd = [compiler("clang", "apt-get install clang libclang-rt-14-dev"), "-O1", "-g",
           "-fsanitize=fuzzer,address,undefined", "-fno-sanitize-recover=undefined", *WARNINGS,
           str(SRC / "fuzz_frame.c"), "-o", str(out)]
    out_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"building the fuzzer failed:\n{' '.join(cmd)}\n{proc.stderr}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--sanitize", action="store_true", help="ASan + UBSan build under build/native-asan")
    group.add_argument("--fuzz", action="store_true", help="libFuzzer harness under build/native-fuzz")
    args = parser.parse_args()
    if args.fuzz:
        print(build_fuzzer(ROOT / "build" / "native-fuzz"))
    elif args.sanitize:
        print(build_module(ROOT / "build" / "native-asan", sanitize=True))
    else:
        print(build_module(ROOT / "dxpu_vfio" / "native", sanitize=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
