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
def test_demo_gets_nvme_and_display_from_the_pool_uses_them_and_gives_them_back():
    proc = dxpu("demo", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["kernel"].startswith("6.12")
    assert data["nvme"]["match"] is True and data["nvme"]["disk"].startswith("nvme")
    assert data["display"]["driver"] == "bochs-drm" and data["display"]["pixel_exact"] is True
    assert data["display"]["png_size"] == [1024, 768]
    devices = {d["device"]: d for d in data["status"]["devices"]}
    nvme = devices["box1/nvme0"]
    assert nvme["link_up"] and nvme["in_vm"] and nvme["counters"]["dma_bytes_written"] >= 8 << 20
    assert nvme["counters"]["dma_refused"] == 0
    assert devices["box1/fb0"]["counters"]["writes_posted"] > 0
    assert sorted(data["freed"]) == ["box1/fb0", "box1/nvme0"]
    assert not any(ns.startswith("dxdemo") for ns in subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True).stdout.split())  # the lab is gone
