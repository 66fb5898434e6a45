"""The lab network with real namespaces, veth and processes; and its cleanup."""

import json
import os
import subprocess
import sys

import pytest
from pyroute2 import netns

from dxpu_vfio.hostproxy.process import HostProxyProcess
from dxpu_vfio.lab import lab
from dxpu_vfio.vfio_user.client import VfioUserClient
from qemu_device.testdev import ID_VALUE, REG_ID

TWO_BOXES = """
name = "lab"
[[box]]
name = "boxa"
plaintext = true
[[box.device]]
id = "d0"
model = "testdev"
[[box]]
name = "boxb"
delay_us = 300
[[box.device]]
id = "d1"
model = "testdev"
"""


@pytest.fixture
def two_boxes(labs):
    """Shared by this module's tests: each gives back what it changes (a delay). boxa
    serves without TLS (the benchmarks' --plaintext), boxb with."""
    return labs.shared(lab.Topology.parse(TWO_BOXES))


def ns_python(ns: str, code: str, timeout: float = 20) -> str:
    return subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=timeout, check=True).stdout


def test_up_builds_namespaces_links_and_proxies_in_the_benchmark_range(two_boxes):
    info = lab.status(two_boxes.name)
    assert info["up"] and all(info["namespaces"].values())
    boxes = {b["name"]: b for b in info["boxes"]}
    assert boxes["boxa"]["address"] == "198.18.1.2" and boxes["boxb"]["address"] == "198.18.2.2"
    assert all(b["proxy_alive"] for b in boxes.values())
    assert boxes["boxb"]["delay_mode"] in ("netem", "emulator") and boxes["boxb"]["delay_us"] == 300
    # the host node reaches each box's proxy over its veth, and nothing else is addressed
    for b in boxes.values():
        host, port = b["endpoint"].rsplit(":", 1)
        assert host.startswith("198.18.")
        ns_python(two_boxes.host_netns, f"import socket; socket.create_connection(('{host}', {port}), 3).close()")


def test_delay_is_injected_and_measured(two_boxes):
    """A TCP round trip through boxb's link is at least twice the one-way delay."""
    b = two_boxes.box("boxb")
    code = (f"import socket,time,ssl; s=socket.create_connection(('{b.endpoint.split(':')[0]}', "
            f"{b.endpoint.split(':')[1]}), 3); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1);"
            "t=time.perf_counter(); s.sendall(b'x'*10); s.settimeout(3);\n"
            "try: s.recv(10)\nexcept Exception: pass\n"
            "print(time.perf_counter()-t)")
    elapsed = float(ns_python(two_boxes.host_netns, code))
    assert elapsed >= 2 * 300e-6  # bytes go to the proxy, which answers with a TLS alert
    if b.delay_mode == "emulator":
        report = lab.delay_report(two_boxes, "boxb")
        assert report["asked_us"] == 300 and report["achieved_median_us"] >= 300 and report["packets"] > 0


def test_delay_changes_at_run_time(two_boxes):
    b = lab.set_delay(two_boxes, "boxa", 100)
    assert b.delay_mode in ("netem", "emulator") and lab.status(two_boxes.name)["boxes"][0]["delay_us"] == 100
    b = lab.set_delay(two_boxes, "boxa", 0)
    assert b.delay_mode == "none" and b.emulator_pid is None


def test_down_removes_everything_even_after_a_crash(labs):
    state = labs.own(lab.Topology.parse(TWO_BOXES))
    name, pids = state.name, list(state.pids)
    # the lab's own process "crashed": only the state file is left to go by
    removed = lab.down(name)
    assert all(f"pid {pid}" in removed for pid in pids)
    assert not any(ns.startswith(f"dx{name}-") for ns in netns.listnetns())
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]
    assert not lab.lab_dir(name).exists()
    assert lab.down(name) == []  # idempotent


def test_cli_up_status_down_json(labs):
    name = labs.adopt(f"c{os.getpid()}")  # down at the end also if the CLI fails to take it down
    run = lambda *a: subprocess.run([sys.executable, "-m", "dxpu_vfio.cli", "lab", *a, "--name", name],  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    up = run("up", "--no-vm", "--json")
    assert up.returncode == 0, up.stderr
    assert json.loads(up.stdout)["boxes"][0]["proxy_alive"]
    assert json.loads(run("status", "--json").stdout)["up"]
    assert run("down").returncode == 0
    status = run("status", "--json")
    assert status.returncode == 1 and json.loads(status.stdout)["up"] is False


@pytest.mark.parametrize("box, device", [("boxa", "d0"), ("boxb", "d1")], ids=["plaintext", "tls"])
def test_a_host_proxy_reaches_a_box_device_over_the_link_the_box_serves(two_boxes, tmp_path, box, device):
    """A plaintext box (``plaintext = true`` in the topology) is written as one, says so
    in the lab's status, and its host proxies connect without TLS; a TLS box's with."""
    settings = two_boxes.remote_settings(box, device)
    config = open(two_boxes.box(box).config).read()
    shown = {b["name"]: b["tls"] for b in lab.status(two_boxes.name)["boxes"]}
    if box == "boxa":
        assert settings.get("plaintext") is True and "tls_dir" not in settings
        assert "plaintext = true" in config and "tls_dir" not in config and shown[box] is False
    else:
        assert settings["tls_dir"] == str(two_boxes.certs) and "plaintext" not in settings
        assert f'tls_dir = "{two_boxes.certs}"' in config and shown[box] is True
    proxy = HostProxyProcess("remote", tmp_path / "d.sock", settings=settings, name=f"lab-{box}",
                             netns=two_boxes.host_netns).start()
    try:
        client = VfioUserClient(proxy.socket_path)
        try:
            client.negotiate()
            assert client.read32(0, REG_ID) == ID_VALUE
        finally:
            client.close()
    finally:
        proxy.stop()


def test_a_topology_plaintext_setting_must_be_a_boolean():
    with pytest.raises(lab.LabError, match="plaintext = 'yes': true or false"):
        lab.Topology.parse('[[box]]\nname = "b1"\nplaintext = "yes"\n')
