"""The dxpu command as an admin runs it: exit codes, --json, errors that say what to do."""

import json
import subprocess
import sys

import pytest


def dxpu(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dxpu_vfio.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_doctor_json_reports_every_check():
    proc = dxpu("doctor", "--json")
    rows = {row["name"]: row for row in json.loads(proc.stdout)}
    assert {"qemu", "tcg", "kvm", "image tiny", "image full", "libvirtd", "netns", "delay"} <= set(rows)
    assert "netem" in rows["delay"]["detail"]
    for name in ("qemu", "tcg", "image tiny", "image full", "netns", "delay"):
        assert rows[name]["ok"], rows[name]
    assert proc.returncode == 0


def test_doctor_says_what_to_run_when_qemu_is_wrong(tmp_path):
    import os
    env = dict(os.environ, DXPU_QEMU=str(tmp_path / "missing-qemu"))
    proc = dxpu("doctor", env=env)
    assert proc.returncode == 1
    assert "BAD qemu" in proc.stdout and "fix: run scripts/setup.sh" in proc.stdout


@pytest.mark.vm
def test_vm_run_passes_the_guest_exit_code_back():
    proc = dxpu("vm", "run", "echo hello from $(uname -r); exit 7")
    assert proc.returncode == 7
    assert proc.stdout.startswith("hello from 6.12")


def test_wrong_image_name_is_a_usage_error():
    proc = dxpu("vm", "run", "true", "--image", "huge")
    assert proc.returncode == 2 and "invalid choice: 'huge'" in proc.stderr


@pytest.mark.vm
def test_demo_plugs_uses_and_returns_the_test_device():
    proc = dxpu("demo", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["kernel"].startswith("6.12")
    assert list(data["pci"].values()).count("0x1b36:0x000c class=0x060400 driver=pcieport") == 4
    assert "0x1b36:0x10f0 class=0xff0000 driver=-" in data["pci"].values()
    guest = data["guest"]
    assert guest["dma_copy_64k"]["match"] == "yes" and guest["intx"]["received"] == "10"
    assert guest["dma_checksum_64k"]["device_crc"] == guest["dma_checksum_64k"]["tool_crc"]
    assert data["server"]["commands"]["REGION_READ"]["count"] > 2000
