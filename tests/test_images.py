"""Guest images: pinned downloads, rebuild-on-change, and corrupt or missing images."""

import hashlib
import shutil

import pytest

from dxpu_vfio.errors import ImageError
from dxpu_vfio.vms import images


@pytest.fixture
def private_cache(monkeypatch, tmp_path, tiny_image):
    """A cache holding a copy of the tiny image, so a test may damage it."""
    cache = tmp_path / "cache"
    dest = cache / "images" / tiny_image.directory.name
    shutil.copytree(tiny_image.directory, dest)
    monkeypatch.setenv("DXPU_CACHE", str(cache))
    return dest


def test_tiny_image_is_built_and_verified(tiny_image):
    assert tiny_image.kernel.stat().st_size > 5_000_000
    assert tiny_image.kernel_release.endswith("cloud-amd64")
    assert "console=ttyS0" in tiny_image.cmdline


def test_full_image_has_disk_and_generic_kernel(full_image):
    assert full_image.disk is not None and full_image.disk.stat().st_size >= 1_400_000_000
    assert full_image.kernel_release.endswith("-amd64") and "cloud" not in full_image.kernel_release


def test_corrupt_initrd_is_refused(private_cache):
    initrd = private_cache / "initrd.img"
    data = bytearray(initrd.read_bytes())
    data[len(data) // 2] ^= 0xFF
    initrd.write_bytes(bytes(data))
    with pytest.raises(ImageError, match="corrupt: sha256") as err:
        images.load_image("tiny")
    assert "--rebuild" in str(err.value)


def test_truncated_kernel_is_refused(private_cache):
    with open(private_cache / "vmlinuz", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(ImageError, match="corrupt: 1000 bytes"):
        images.load_image("tiny")


def test_missing_image_names_the_setup_command(private_cache):
    shutil.rmtree(private_cache)
    with pytest.raises(ImageError, match="not built") as err:
        images.load_image("tiny")
    assert "dxpu setup images tiny" in str(err.value)


def test_unknown_image_name():
    with pytest.raises(ImageError, match="unknown image 'huge'"):
        images.load_image("huge")


def test_recipe_change_selects_a_new_image(monkeypatch, tmp_path):
    copy = tmp_path / "vm_images"
    shutil.copytree(images.VM_IMAGES_DIR, copy, ignore=shutil.ignore_patterns("build"))
    monkeypatch.setattr(images, "VM_IMAGES_DIR", copy)
    before = images.recipe_hash("tiny")
    assert images.recipe_hash("tiny") == before  # stable
    (copy / "tiny" / "init").write_text((copy / "tiny" / "init").read_text() + "# changed\n")
    assert images.recipe_hash("tiny") != before
    assert images.recipe_hash("full") == images.recipe_hash("full")


def _local_mirror(tmp_path, monkeypatch, content: bytes) -> dict:
    pool = tmp_path / "mirror" / "pool"
    pool.mkdir(parents=True)
    (pool / "pkg_1.0_amd64.deb").write_bytes(content)
    monkeypatch.setattr(images, "MIRROR", (tmp_path / "mirror").as_uri())
    monkeypatch.setenv("DXPU_CACHE", str(tmp_path / "cache"))
    return {"name": "pkg", "path": "pool/pkg_1.0_amd64.deb"}


def test_download_checked_by_sha256(tmp_path, monkeypatch):
    pkg = _local_mirror(tmp_path, monkeypatch, b"the real package")
    pkg["sha256"] = hashlib.sha256(b"the real package").hexdigest()
    path = images.fetch_package(pkg, log=lambda _m: None)
    assert path.read_bytes() == b"the real package"


def test_download_with_wrong_sha256_is_refused_and_not_kept(tmp_path, monkeypatch):
    pkg = _local_mirror(tmp_path, monkeypatch, b"a tampered package")
    pkg["sha256"] = hashlib.sha256(b"the real package").hexdigest()
    with pytest.raises(ImageError, match="the recipe pins"):
        images.fetch_package(pkg, log=lambda _m: None)
    assert not list((tmp_path / "cache" / "debs").iterdir())
