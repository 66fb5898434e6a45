"""Where dxpu-vfio keeps things: one place so every module and test agrees.

The cache (QEMU sysroot, guest images, downloaded packages) is large and survives
runs; the run directory holds sockets, whose paths must stay short (108 bytes).

The run directory sits in /tmp, where any local user may have created it first (with
mode 0777 and symlinks planted in it): it is used only if it is a real directory owned
by us with mode 0700, and files in it are created exclusively, never through a link.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from dxpu_vfio.errors import DxpuError

PROJECT_ROOT = Path(__file__).resolve().parent.parent
VM_IMAGES_DIR = PROJECT_ROOT / "vm_images"


class UnsafeRunDir(DxpuError):
    """The run directory is not ours alone (another user made it, or it is open to others)."""


def cache_dir() -> Path:
    """Root of cached artefacts: $DXPU_CACHE, else ~/.cache/dxpu-vfio."""
    env = os.environ.get("DXPU_CACHE")
    path = Path(env) if env else Path.home() / ".cache" / "dxpu-vfio"
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_dir() -> Path:
    """Short directory for UNIX sockets and per-VM state: $DXPU_RUN, else /tmp/dxpu-<uid>;
    :class:`UnsafeRunDir` unless it is a directory (not a link) of ours with mode 0700."""
    env = os.environ.get("DXPU_RUN")
    path = Path(env) if env else Path("/tmp") / f"dxpu-{os.getuid()}"
    if env:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    check_private_dir(path)
    return path


def check_private_dir(path: Path) -> None:
    """Refuse a directory that another user could change (its owner or mode), or a link."""
    st = os.lstat(path)
    fix = (f"remove it (as root if need be: rm -rf {path}) and run again, "
           "or set DXPU_RUN to a directory of your own with mode 0700")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeRunDir(f"the run directory {path} is not a directory (a link or a file)", hint=fix)
    if st.st_uid != os.getuid():
        raise UnsafeRunDir(f"the run directory {path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()})",
                           hint=fix)
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise UnsafeRunDir(f"the run directory {path} has mode {stat.S_IMODE(st.st_mode):04o}; it must be 0700",
                           hint=f"chmod 700 {path}, if nobody else could have put anything in it; else {fix}")


def create_exclusive(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write a new file at ``path``: fails if anything (a file or a link) is already there,
    so nobody can make us write through a planted symlink."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
