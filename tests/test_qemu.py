"""Finding a QEMU with vfio-user-pci, and refusing the ones without it."""

from pathlib import Path

import pytest

from dxpu_vfio.errors import QemuNotFound
from dxpu_vfio.vms import qemu


def fake_qemu(tmp_path: Path, version: str, devices: tuple[str, ...] = ()) -> Path:
    """A stand-in binary: only what find_qemu asks (--version, -device X,help)."""
    script = tmp_path / "qemu-system-x86_64"
    cases = "".join(f'  *"{d},help"*) echo "{d} options:"; exit 0;;\n' for d in devices)
    script.write_text(
        "#!/bin/sh\n"
        f'[ "$1" = --version ] && {{ echo "QEMU emulator version {version}"; exit 0; }}\n'
        f'case "$*" in\n{cases}  *) echo "not found" >&2; exit 1;;\nesac\n')
    script.chmod(0o755)
    return script


@pytest.fixture(autouse=True)
def _fresh_probe_cache():
    qemu._check.cache_clear()
    yield
    qemu._check.cache_clear()


def test_setup_provides_qemu_with_vfio_user():
    found = qemu.find_qemu()
    assert found.version >= qemu.MIN_VERSION
    assert qemu.has_device(found.binary, "vfio-user-pci")
    assert qemu.has_device(found.binary, "pcie-root-port")


def test_has_device_is_false_for_unknown_device():
    assert not qemu.has_device(qemu.find_qemu().binary, "no-such-device-xyz")


def test_missing_binary_names_setup(monkeypatch):
    monkeypatch.setenv("DXPU_QEMU", "/nonexistent/qemu-system-x86_64")
    with pytest.raises(QemuNotFound) as err:
        qemu.find_qemu()
    assert "does not run" in str(err.value)
    assert "scripts/setup.sh" in str(err.value)


def test_too_old_qemu_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("DXPU_QEMU", str(fake_qemu(tmp_path, "7.2.0", ("vfio-user-pci",))))
    with pytest.raises(QemuNotFound, match=r"QEMU 7\.2\.0; vfio-user-pci needs 10\.1\.1"):
        qemu.find_qemu()


def test_new_qemu_without_vfio_user_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("DXPU_QEMU", str(fake_qemu(tmp_path, "11.1.2", ("edu",))))
    with pytest.raises(QemuNotFound, match="has no vfio-user-pci"):
        qemu.find_qemu()


def test_explicit_good_qemu_is_used(monkeypatch, tmp_path):
    monkeypatch.setenv("DXPU_QEMU", str(fake_qemu(tmp_path, "11.1.3", ("vfio-user-pci",))))
    found = qemu.find_qemu()
    assert found.version == (11, 1, 3) and found.source == "env"
