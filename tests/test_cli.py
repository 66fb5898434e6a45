"""The dxpu command as an admin runs it: exit codes, --json, errors that say what to do."""

import json
import subprocess
import sys

import pytest

from dxpu_vfio.paths import run_dir


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
    before = set(run_dir().glob("vm-dxpu-run-*"))
    proc = dxpu("vm", "run", "echo hello from $(uname -r); exit 7")
    assert proc.returncode == 7
    assert proc.stdout.startswith("hello from 6.12")
    assert set(run_dir().glob("vm-dxpu-run-*")) == before  # its workdir went with it (no --keep-logs)


def test_wrong_image_name_is_a_usage_error():
    proc = dxpu("vm", "run", "true", "--image", "huge")
    assert proc.returncode == 2 and "invalid choice: 'huge'" in proc.stderr


@pytest.mark.vm
def test_demo_gets_nvme_display_and_accel_from_the_pool_uses_them_and_gives_them_back():
    proc = dxpu("demo", "--json", timeout=600)  # a TCG guest: ~5 min here
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
    fb = devices["box1/fb0"]["counters"]  # mapped (the default): the pattern went as the shadow's write-back
    assert fb["writeback_bytes"] >= 1024 * 768 * 4 and fb["writes_posted"] == 0
    runs = data["accel"]["workloads"]
    assert data["accel"]["match"] is True and sorted(runs) == ["mlp-b64", "transformer-s64"]
    for run in runs.values():   # each checked against numpy in the guest (a failed check fails the demo)
        assert run["local_ms"] > 0 and run["remote_ms"] > 0 and run["max_abs_error"] < 1e-2
    assert devices["box1/acc0"]["counters"]["dma_bytes_read"] > 0
    assert sorted(data["freed"]) == ["box1/acc0", "box1/fb0", "box1/nvme0"]
    assert not any(ns.startswith("dxdemo") for ns in subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True).stdout.split())  # the lab is gone


def _leaves(parser, path=()):
    """(command words, parser) of every leaf command under ``parser``."""
    import argparse
    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not groups:
        yield path, parser
    for group in groups:
        for name, sub in group.choices.items():
            yield from _leaves(sub, (*path, name))


def test_every_command_has_help_and_accepts_json():
    from dxpu_vfio.cli import build_parser
    leaves = dict(_leaves(build_parser()))
    for words in [("remote", "serve"), ("vm", "run"), ("vm", "define"), ("vm", "undefine"), ("box", "add"),
                  ("box", "rm"), ("manager", "serve"), ("manager", "metrics"), ("manager", "reconcile"),
                  ("lab", "up"), ("lab", "status"), ("lab", "down"), ("lab", "sweep"), ("attach",),
                  ("completion",), ("doctor",)]:
        assert words in leaves, words
    for words, parser in leaves.items():
        assert "--json" in parser._option_string_actions, f"dxpu {' '.join(words)} has no --json"
        assert parser.description, f"dxpu {' '.join(words)} has no help"


def test_bash_completion_completes_commands_and_options(tmp_path):
    proc = dxpu("completion", "bash")
    assert proc.returncode == 0, proc.stderr
    script = tmp_path / "dxpu.bash"
    script.write_text(proc.stdout)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    complete = lambda *words: subprocess.run(  # noqa: E731 - what bash offers after `dxpu WORDS<TAB>`
        ["bash", "-c", f"source {script}; COMP_WORDS=(dxpu {' '.join(words)}); COMP_CWORD={len(words)}; "
                       'COMP_LINE="${COMP_WORDS[*]}"; COMP_POINT=${#COMP_LINE}; _shtab_dxpu; echo "${COMPREPLY[@]}"'],
        capture_output=True, text=True, check=True).stdout.split()
    assert complete("att") == ["attach"]
    assert complete("manager", "''") == ["serve", "metrics", "reconcile"]
    assert "--json" in complete("vm", "run", "--")


def test_completion_json_wraps_the_script():
    data = json.loads(dxpu("completion", "zsh", "--json").stdout)
    assert data["shell"] == "zsh" and data["script"].startswith("#compdef dxpu")


def test_manager_not_running_is_one_error_in_text_and_json(tmp_path):
    db = tmp_path / "pool.db"
    proc = dxpu("attach", "vm.sock", "--db", str(db))
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == f"dxpu: error: no pool manager serves {db}\n  fix: start one: dxpu manager serve --db {db}\n"
    proc = dxpu("attach", "vm.sock", "--db", str(db), "--json")
    assert proc.returncode == 1 and proc.stderr.startswith("dxpu: error: no pool manager serves")
    assert json.loads(proc.stdout) == {"error": "ManagerUnavailable", "message": f"no pool manager serves {db}",
                                       "hint": f"start one: dxpu manager serve --db {db}", "logs": []}


def test_remote_serve_with_a_missing_config_says_so_in_json(tmp_path):
    proc = dxpu("remote", "serve", "--config", str(tmp_path / "nosuch.toml"), "--json")
    assert proc.returncode == 1 and "dxpu: error: cannot read the box config" in proc.stderr
    err = json.loads(proc.stdout)
    assert err["error"] == "BoxConfigError" and "nosuch.toml" in err["message"] and "config.py" in err["hint"]


def test_remote_serve_json_announces_serving_as_an_object(tmp_path):
    import signal
    config = tmp_path / "box.toml"
    config.write_text('name = "bx"\nlisten = "127.0.0.1"\nport = 0\nplaintext = true\n'
                      '[[device]]\nid = "td0"\nmodel = "testdev"\nlease = "t"\n')
    proc = subprocess.Popen([sys.executable, "-m", "dxpu_vfio.cli", "remote", "serve", "--config", str(config),
                             "--json"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "serving" in line  # what RemoteProxyProcess waits for
        event = json.loads(line)
        assert event["event"] == "serving" and event["box"] == "bx" and event["security"] == "plaintext"
        assert event["devices"] == [{"id": "td0", "model": "testdev"}]
        assert int(event["address"].rpartition(":")[2]) > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0


def test_detach_without_a_device_is_refused_before_asking_the_manager(tmp_path):
    proc = dxpu("detach", "vm.sock", "--db", str(tmp_path / "pool.db"))
    assert proc.returncode == 1 and proc.stderr.startswith("dxpu: error: name a device to detach")
    assert "fix: dxpu status vm.sock" in proc.stderr


def test_a_relayed_manager_error_keeps_its_type_name():
    from dxpu_vfio.cli.output import error_object
    from dxpu_vfio.pool.service import ManagerError, ManagerUnavailable
    assert error_object(ManagerError("0 free", kind="NoFreeDevice", hint="dxpu ls"))["error"] == "NoFreeDevice"
    assert error_object(ManagerUnavailable("down"))["error"] == "ManagerUnavailable"


def test_tables_mark_missing_cells_and_say_when_empty():
    from dxpu_vfio.cli.output import table
    assert table([], ["a"]) == "  (none)"
    text = table([{"name": "box1", "last_error": None}, {"name": "b2"}], ["name", "last_error"])
    assert [line.rstrip() for line in text.splitlines()] == [
        "  name  last_error", "  ----  ----------", "  box1  -", "  b2    -"]
