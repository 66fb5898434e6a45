"""Guest images built from the recipes in ``vm_images/``.

An image lives in ``<cache>/images/<name>-<recipe hash>/``: it is rebuilt only when
its recipe (any file under ``vm_images/<name>/``, the guest tools, or this builder)
changes. Every downloaded package is checked against the sha256 pinned in the recipe,
and every built file against the sha256 in the image's manifest before it is used.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import tempfile
import tomllib
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dxpu_vfio.errors import ImageError, SetupError
from dxpu_vfio.paths import VM_IMAGES_DIR, cache_dir
from dxpu_vfio.vms.qemu import MIRROR  # one Debian mirror for images and the QEMU sysroot

IMAGE_NAMES = ("tiny", "full")
BUILDER_VERSION = 1  # bump to rebuild every image after a change to this module
Log = Callable[[str], None]


@dataclass(frozen=True)
class Image:
    """A built guest image, ready for the VM runner."""

    name: str
    kind: str  # "initramfs" (tiny) or "disk" (full)
    directory: Path
    kernel: Path
    initrd: Path
    disk: Path | None
    cmdline: str
    kernel_release: str


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def recipe_dir(name: str) -> Path:
    if name not in IMAGE_NAMES:
        raise ImageError(f"unknown image {name!r}; known: {', '.join(IMAGE_NAMES)}")
    return VM_IMAGES_DIR / name


def load_recipe(name: str) -> dict:
    with open(recipe_dir(name) / "recipe.toml", "rb") as f:
        return tomllib.load(f)


def recipe_hash(name: str) -> str:
    """Hash of everything that determines the image's content."""
    digest = hashlib.sha256(f"builder {BUILDER_VERSION}\n".encode())
    sources = sorted(recipe_dir(name).rglob("*")) + sorted((VM_IMAGES_DIR / "tools").glob("*.[ch]"))
    sources.append(VM_IMAGES_DIR / "tools" / "Makefile")
    for path in sources:
        if path.is_file():
            digest.update(str(path.relative_to(VM_IMAGES_DIR)).encode() + b"\0")
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def image_dir(name: str) -> Path:
    return cache_dir() / "images" / f"{name}-{recipe_hash(name)}"


# --- loading ---------------------------------------------------------------------

def _verified(directory: Path, manifest: dict) -> None:
    """Check every file against the manifest; big files are re-hashed only when touched."""
    stamp_path = directory / ".verified.json"
    try:
        stamps = json.loads(stamp_path.read_text())
    except (OSError, ValueError):
        stamps = {}
    changed = False
    for fname, meta in manifest["files"].items():
        path = directory / fname
        if not path.is_file():
            raise ImageError(f"image file {path} is missing", hint=f"dxpu setup images {manifest['name']}")
        st = path.stat()
        if st.st_size != meta["size"]:
            raise ImageError(f"image file {path} is corrupt: {st.st_size} bytes, expected "
                             f"{meta['size']}", hint=f"dxpu setup images {manifest['name']} --rebuild")
        key = [st.st_size, st.st_mtime_ns]
        if stamps.get(fname) == key and st.st_size > (64 << 20):
            continue
        if sha256_file(path) != meta["sha256"]:
            raise ImageError(f"image file {path} is corrupt: sha256 differs from its manifest",
                             hint=f"dxpu setup images {manifest['name']} --rebuild")
        stamps[fname] = key
        changed = True
    if changed:
        stamp_path.write_text(json.dumps(stamps))


def load_image(name: str) -> Image:
    """The built image for the current recipe; :class:`ImageError` says how to build it."""
    directory = image_dir(name)
    manifest_path = directory / "manifest.json"
    if not manifest_path.is_file():
        raise ImageError(f"guest image {name!r} is not built for the current recipe "
                         f"(expected {directory})", hint=f"dxpu setup images {name}")
    try:
        manifest = json.loads(manifest_path.read_text())
    except ValueError as exc:
        raise ImageError(f"manifest {manifest_path} is unreadable: {exc}",
                         hint=f"dxpu setup images {name} --rebuild") from exc
    _verified(directory, manifest)
    files = manifest["files"]
    return Image(name=name, kind=manifest["kind"], directory=directory,
                 kernel=directory / "vmlinuz", initrd=directory / "initrd.img",
                 disk=directory / "disk.img" if "disk.img" in files else None,
                 cmdline=manifest["cmdline"], kernel_release=manifest["kernel_release"])


# --- building --------------------------------------------------------------------

def fetch_package(pkg: dict, log: Log = print) -> Path:
    """Download one pinned .deb into the cache (once) and check its sha256."""
    debs = cache_dir() / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    dest = debs / Path(pkg["path"]).name
    if dest.exists() and sha256_file(dest) == pkg["sha256"]:
        return dest
    url = f"{MIRROR}/{pkg['path']}"
    log(f"images: downloading {pkg['name']} ({url})")
    tmp = dest.with_suffix(".part")
    try:
        with urllib.request.urlopen(url, timeout=120) as resp, open(tmp, "wb") as out:
            shutil.copyfileobj(resp, out, 1 << 20)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise SetupError(f"cannot download {url}: {exc}",
                         hint="check access to the Debian mirror; if the version was "
                              "removed from the archive, re-pin it in the recipe") from exc
    got = sha256_file(tmp)
    if got != pkg["sha256"]:
        tmp.unlink()
        raise ImageError(f"{url} has sha256 {got}, the recipe pins {pkg['sha256']}",
                         hint="the mirror served a different file; re-pin the recipe if intended")
    tmp.rename(dest)
    return dest


def build_tools(out: Path) -> list[Path]:
    """Compile the static guest tools (dxpu-mmio, dxpu-dmabuf) with the host gcc."""
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["make", "-C", str(VM_IMAGES_DIR / "tools"), f"OUT={out}"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SetupError(f"building guest tools failed: {proc.stderr.strip()[-800:]}",
                         hint="apt-get install gcc make libc6-dev")
    return sorted(p for p in out.iterdir() if p.is_file() and os.access(p, os.X_OK))


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SetupError(f"{what} failed (exit {proc.returncode}): {proc.stderr.strip()[-1200:]}")


def _module_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    return lzma.decompress(data) if path.suffix == ".xz" else data


def _module_closure(moddir: Path, names: list[str]) -> dict[str, bytes]:
    """The modules ``names`` and everything they depend on, dependencies first.

    Dependencies are read from each module's ``.modinfo`` strings (``depends=a,b``),
    so no host kmod tools are needed.
    """
    index = {p.name.split(".ko")[0].replace("-", "_"): p for p in moddir.rglob("*.ko*")}
    ordered: dict[str, bytes] = {}

    def visit(name: str) -> None:
        key = name.replace("-", "_")
        if key not in index:
            raise ImageError(f"kernel module {name} is not in the kernel package")
        if key in ordered:
            return
        data = _module_bytes(index[key])
        match = re.search(rb"(?:^|\0)depends=([^\0]*)", data)
        for dep in filter(None, (match.group(1).decode() if match else "").split(",")):
            visit(dep)
        ordered[key] = data

    for name in names:
        visit(name)
    return ordered


def _build_tiny(recipe: dict, work: Path, dest: Path, log: Log) -> dict:
    debs = [fetch_package(p, log) for p in recipe["package"]]
    extract = work / "pkgs"
    for deb in debs:
        _run(["dpkg-deb", "-x", str(deb), str(extract)], f"unpacking {deb.name}")
    kernel = next((extract / "boot").glob("vmlinuz-*"))
    release = kernel.name.removeprefix("vmlinuz-")
    root = work / "initramfs"
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "proc", "sys", "dev", "tmp", "run",
              "etc", "lib/modules", "root"):
        (root / d).mkdir(parents=True, exist_ok=True)
    busybox = next(p for p in (extract / "usr/bin/busybox", extract / "bin/busybox") if p.exists())
    shutil.copy2(busybox, root / "bin/busybox")
    (root / "bin/sh").symlink_to("busybox")  # /init's interpreter, before --install runs
    shutil.copy2(recipe_dir("tiny") / "init", root / "init")
    shutil.copy2(recipe_dir("tiny") / "dxpu-serial-agent", root / "bin/dxpu-serial-agent")
    for tool in build_tools(work / "tools"):
        shutil.copy2(tool, root / "usr/bin" / tool.name)
    modules = _module_closure(extract / "usr/lib/modules" / release, recipe.get("modules", []))
    for name, data in modules.items():
        (root / "lib/modules" / f"{name}.ko").write_bytes(data)
    (root / "etc/modules-load").write_text("".join(f"{name}\n" for name in modules))
    shutil.copy2(kernel, dest / "vmlinuz")
    _run(["sh", "-c", f"cd '{root}' && find . | sort | cpio -o -H newc --quiet | gzip -6 > '{dest}/initrd.img'"],
         "packing the initramfs")
    return {"kernel_release": release}


def _build_full(recipe: dict, work: Path, dest: Path, log: Log) -> dict:
    if not shutil.which("mmdebstrap"):
        raise SetupError("mmdebstrap is missing", hint="apt-get install mmdebstrap")
    kernel_debs = [fetch_package(p, log) for p in recipe["package"]]
    tools = work / "tools"
    build_tools(tools)
    shutil.copy2(recipe_dir("full") / "dxpu-guest-events", tools / "dxpu-guest-events")
    rootfs = work / "rootfs"
    log(f"images: mmdebstrap {recipe['suite']} rootfs (~60-90 s)")
    _run(["mmdebstrap", "--variant=minbase", "--include=" + ",".join(recipe["include"]),
          *[f"--include={deb}" for deb in kernel_debs],
          "--aptopt=Acquire::Check-Valid-Until \"false\"",
          f"--customize-hook={recipe_dir('full') / 'customize.sh'} \"$1\" {tools}",
          recipe["suite"], str(rootfs), MIRROR], "mmdebstrap of the full rootfs")
    kernel = next((rootfs / "boot").glob("vmlinuz-*"))
    release = kernel.name.removeprefix("vmlinuz-")
    shutil.copy2(kernel, dest / "vmlinuz")
    shutil.copy2(rootfs / "boot" / f"initrd.img-{release}", dest / "initrd.img")
    log(f"images: mke2fs {recipe['disk_size']} disk")
    _run(["mke2fs", "-q", "-t", "ext4", "-L", "dxpu-root", "-d", str(rootfs),
          str(dest / "disk.img"), recipe["disk_size"]], "mke2fs of the full disk")
    return {"kernel_release": release}


BUILDERS = {"initramfs": _build_tiny, "disk": _build_full}


def build_image(name: str, *, rebuild: bool = False, log: Log = print) -> Image:
    """Build ``name`` unless the current recipe's image is already there and intact."""
    if not rebuild:
        try:
            image = load_image(name)
            log(f"images: {name} is up to date ({image.directory})")
            return image
        except ImageError:
            pass
    recipe = load_recipe(name)
    dest = image_dir(name)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    log(f"images: building {name} into {dest}")
    with tempfile.TemporaryDirectory(prefix=f"dxpu-img-{name}-", dir=cache_dir()) as work:
        try:
            extra = BUILDERS[recipe["kind"]](recipe, Path(work), tmp, log)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    files = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(tmp.iterdir())}
    manifest = {"name": name, "kind": recipe["kind"], "recipe_hash": recipe_hash(name),
                "cmdline": recipe["cmdline"], "files": files, **extra}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    for old in dest.parent.glob(f"{name}-*"):  # images of older recipes
        if old != dest:
            shutil.rmtree(old, ignore_errors=True)
    image = load_image(name)
    log(f"images: {name} built (kernel {image.kernel_release})")
    return image

