#!/usr/bin/env python3
"""Build the native stream (dxpu_vfio/native/fastlink.c) with Debian's gcc and Debian
testing's libssl-dev; scripts/setup.sh runs this. Variants for checking it:

    .venv/bin/python scripts/build_native.py             # dxpu_vfio/native/_fastlink*.so (what runs)
    .venv/bin/python scripts/build_native.py --sanitize  # build/native-asan/_fastlink*.so (ASan + UBSan)
    .venv/bin/python scripts/build_native.py --fuzz      # build/native-fuzz/fuzz_frame (libFuzzer, clang)

The sanitized build is loaded instead of the normal one when DXPU_FASTLINK_SO names it
(scripts/sanitize.sh does that); the fuzzer is run by scripts/fuzz_native.sh.

OpenSSL is Debian testing's libssl-dev (the suite the QEMU sysroot comes from), linked in
statically with its symbols hidden: bookworm's OpenSSL 3.0 seals AES-256-GCM at 4.9 GB/s
a core here, testing's (3.6) at 18 GB/s, with the AVX-512 VAES code 3.0 lacks
(docs/benchmarks.md, eighteenth session). The link's TLS is the native stream's, so that
is where it pays; Python's ssl module keeps the system's. The package is extracted (not
installed) into the cache by mmdebstrap, which checks the archive's signatures, and
glibc_compat.c supplies the three glibc 2.38 names its objects call.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SRC = ROOT / "dxpu_vfio" / "native"

from dxpu_vfio.errors import SetupError  # noqa: E402
from dxpu_vfio.paths import cache_dir  # noqa: E402
from dxpu_vfio.vms.qemu import SYSROOT_SUITE, testing_tree  # noqa: E402

STATIC_LIBS = (Path("usr/lib/x86_64-linux-gnu/libssl.a"), Path("usr/lib/x86_64-linux-gnu/libcrypto.a"))

# what the static OpenSSL needs from the system, loaded with the module
OPENSSL_SYSTEM_LIBS = ["-l:libz.so.1", "-l:libzstd.so.1", "-ldl"]
WARNINGS = ["-Wall", "-Wextra", "-Wno-missing-field-initializers", "-Wno-unused-parameter", "-Werror"]


def compiler(name: str, hint: str) -> str:
    path = shutil.which(name)
    if path is None:
        sys.exit(f"{name} not found: {hint}")
    return path


def testing_openssl() -> Path:
    """The root where Debian testing's libssl-dev is extracted (once; idempotent)."""
    root = cache_dir() / f"openssl-{SYSROOT_SUITE}"
    if all((root / lib).is_file() for lib in STATIC_LIBS):
        return root
    print(f"native: extracting libssl-dev from Debian {SYSROOT_SUITE} into {root} (~5 s, 40 MB)", flush=True)
    try:
        testing_tree(root, "extract", "libssl-dev", expect=STATIC_LIBS)
    except SetupError as exc:
        sys.exit(str(exc))
    return root


def build_module(out_dir: Path, sanitize: bool) -> Path:
    out = out_dir / f"_fastlink{sysconfig.get_config_var('EXT_SUFFIX')}"
    flags = ["-O2", "-g", "-fPIC", "-shared", "-pthread", "-fvisibility=hidden"]
    if sanitize:
        flags = ["-O1", "-g", "-fPIC", "-shared", "-pthread", "-fno-omit-frame-pointer",
                 "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
    # built beside and renamed over: processes that have the old module mapped keep it intact
    tmp = out.with_name(out.name + ".tmp")
    openssl = testing_openssl()
    cmd = [compiler("gcc", "apt-get install gcc (scripts/setup.sh does)"), *flags, *WARNINGS,
           f"-I{sysconfig.get_paths()['include']}", f"-I{openssl / 'usr' / 'include'}",
           f"-I{openssl / 'usr' / 'include' / 'x86_64-linux-gnu'}",
           str(SRC / "fastlink.c"), str(SRC / "glibc_compat.c"), "-o", str(tmp),
           *(str(openssl / lib) for lib in STATIC_LIBS), "-Wl,--exclude-libs,ALL", *OPENSSL_SYSTEM_LIBS]
    out_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        tmp.unlink(missing_ok=True)
        sys.exit(f"building {out.name} failed (are gcc and python3-dev installed? scripts/setup.sh installs them):\n"
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
