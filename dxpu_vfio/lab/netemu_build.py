"""The C emulator's binary: built from ``netemu.c`` with the host's gcc on first use and
cached by the source's hash, so an edit rebuilds it and nothing is built twice."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from dxpu_vfio.paths import cache_dir

SOURCE = Path(__file__).with_name("netemu.c")


def binary() -> Path | None:
    """The built emulator, or None where there is no C compiler (then the lab runs
    ``netemu.py``, which does the same more slowly)."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    path = cache_dir() / "bin" / f"netemu-{digest}"
    if path.exists():
        return path
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    proc = subprocess.run([cc, "-O2", "-Wall", "-o", str(tmp), str(SOURCE), "-lm"], capture_output=True, text=True)
    if proc.returncode:
        tmp.unlink(missing_ok=True)
        return None
    tmp.rename(path)
    return path
