"""Where dxpu-vfio keeps things: one place so every module and test agrees.

The cache (QEMU sysroot, guest images, downloaded packages) is large and survives
runs; the run directory holds sockets, whose paths must stay short (108 bytes).
"""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
VM_IMAGES_DIR = PROJECT_ROOT / "vm_images"


def cache_dir() -> Path:
    """Root of cached artefacts: $DXPU_CACHE, else ~/.cache/dxpu-vfio."""
    env = os.environ.get("DXPU_CACHE")
    path = Path(env) if env else Path.home() / ".cache" / "dxpu-vfio"
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_dir() -> Path:
    """Short directory for UNIX sockets and per-VM state: $DXPU_RUN, else /tmp/dxpu-<uid>."""
    env = os.environ.get("DXPU_RUN")
    path = Path(env) if env else Path("/tmp") / f"dxpu-{os.getuid()}"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path
