"""The lab's link impairments with real namespaces: what the link's packets really go
through (numbered UDP datagrams and TCP round trips across it), changes at run time under
an established connection, and nothing left behind."""

import json
import os
import signal
import subprocess
import sys

import pytest
from pyroute2 import netns

from dxpu_vfio import registry
from dxpu_vfio.lab import floors, lab, udp_probe
from dxpu_vfio.procs import wait_until
from dxpu_vfio.lab.impairment import (Impairment, ImpairmentError, config_text, netem_args, parse_config_text,
                                      parse_fraction, parse_gilbert, parse_rate_bps, parse_time_us)

ONE_BOX = """
name = "net"
[[box]]
name = "box1"
[[box.device]]
id = "td0"
model = "testdev"
"""


@pytest.fixture
def net(labs):
    """One box; each test gives its link back clean (the factory's restore checks too)."""
    state = labs.shared(lab.Topology.parse(ONE_BOX))
    yield state
    lab.set_link(state, "box1", Impairment())


def test_units_and_netem_arguments():
    assert parse_time_us("50us") == 50 and parse_time_us("1.5ms") == 1500 and parse_time_us("200") == 200
    assert parse_fraction("0.1%") == pytest.approx(0.001) and parse_rate_bps("10gbit") == 10e9
    assert parse_gilbert("1%,25%") == {"ge_p": 0.01, "ge_r": 0.25}
    with pytest.raises(ImpairmentError):
        parse_time_us("fast")
    with pytest.raises(ImpairmentError):
        Impairment(loss=1.5)
    imp = Impairment(delay_us=50, jitter_us=10, ge_p=0.01, ge_r=0.25, rate_bps=1e9)
    assert netem_args(imp) == ["netem", "limit", "100000", "delay", "50us", "10us", "distribution", "normal",
                               "loss", "gemodel", "1%", "25%", "100%", "0%", "rate", "1000000000bit"]
    assert imp.expected_loss == pytest.approx(0.01 / 0.26)
    link = {"up": imp, "down": Impairment(loss=0.001, distribution="uniform")}
    assert parse_config_text(config_text(link)) == link


def ping_rtt_us(state: lab.LabState, round_trips: int = 400) -> float:
    """Median TCP round trip host -> box1 -> host (the floor server in the box)."""
    return floors.measure_lab(state, "box1", round_trips=round_trips, bulk_bytes=1 << 20,
                              kinds=("tcp",))["tcp"]["ping_pong"]["median_us"]


def test_delay_is_held_as_asked_and_seen_by_tcp(net):
    # Each round trip is the least of a few medians: a busy moment of this shared machine
    # only adds (CI runs saw a base of 189 us where 25 is usual, and a delayed round trip
    # 1272 us over the base for 600 asked, the emulator's own p50 right both times). A
    # delay not held shows all the same: waiting cannot make a round trip shorter.
    base = min(ping_rtt_us(net) for _ in range(3))
    b = lab.set_link(net, "box1", Impairment(delay_us=300))
    assert b.delay_mode in ("emulator", "netem")
    rtts: list[float] = []
    for _ in range(3):
        rtts.append(ping_rtt_us(net))
        if 600 * 0.9 <= min(rtts) - base <= 600 + 400:
            break
    rtt = min(rtts)
    assert 600 * 0.9 <= rtt - base <= 600 + 400, (base, rtts)  # the round trip crosses the delay twice
    if b.delay_mode == "emulator":
        report = lab.link_report(net, "box1")
        for d in ("up", "down"):
            assert report[d]["packets"] > 400 and report[d]["delay_us"]["p50"] == pytest.approx(300, rel=0.1)
        if report.get("fast_path"):  # timed from the tc program's stamp at the link's ingress, nearly every packet
            assert report["held_from"] == "ingress", report
            assert all(report[d]["stamped"] >= 0.9 * report[d]["packets"] for d in ("up", "down")), report
            assert all(0 < report[d]["handback_us"] < 300 for d in ("up", "down")), report


def test_random_and_bursty_loss_reach_the_packets(net):
    b = net.box("box1")
    lab.set_link(net, "box1", Impairment(loss=0.02))
    got = udp_probe.across(b.netns, b.box_ip, net.host_netns, 6000)
    assert 0.01 <= got["loss_rate"] <= 0.03 and got["mean_loss_run"] < 1.5, got
    lab.set_link(net, "box1", Impairment(ge_p=0.01, ge_r=0.25))  # mean 3.8 %, in runs of ~4
    lab.reset_link_counters(net, "box1")
    got = udp_probe.across(b.netns, b.box_ip, net.host_netns, 6000)
    assert 0.015 <= got["loss_rate"] <= 0.07 and got["mean_loss_run"] > 2, got
    report = lab.link_report(net, "box1")
    if report:  # the emulator counts what the receiver missed
        assert report["up"]["lost_burst"] == got["lost"] and report["up"]["loss_rate"] == pytest.approx(got["loss_rate"], abs=0.005)


def test_reordering_and_duplication(net):
    b = net.box("box1")
    lab.set_link(net, "box1", Impairment(delay_us=200, reorder=0.1, duplicate=0.05), down=Impairment())
    got = udp_probe.across(b.netns, b.box_ip, net.host_netns, 4000)
    assert got["lost"] == 0 and got["out_of_order"] > 100 and 100 <= got["duplicates"] <= 330, got


def test_change_at_run_time_keeps_an_established_connection(net):
    """One TCP connection, echoing across the link while the link changes under it: delay
    on, loss on, the emulator off again. Every echo comes back, the round trip follows."""
    b = net.box("box1")
    server = subprocess.Popen(["ip", "netns", "exec", b.netns, sys.executable, "-m", "dxpu_vfio.lab.floors", "serve",
                               "--listen", b.box_ip, "--port", "7250"], stdout=subprocess.PIPE, start_new_session=True)
    client = None
    try:
        assert b"serving" in server.stdout.readline()
        code = ("import socket,struct,sys,time\n"
                f"s=socket.create_connection(('{b.box_ip}',7250),5); s.setsockopt(6,1,1)\n"
                "s.sendall(struct.pack('<4sQ',b'PING',10**9))\n"
                "for line in sys.stdin:\n"
                "  t=time.perf_counter(); n=0\n"
                "  for i in range(int(line)):\n"
                "    s.sendall(bytes([i%256])*32); got=b''\n"
                "    while len(got)<32: got+=s.recv(32-len(got))\n"
                "    n+=got==bytes([i%256])*32\n"
                "  print(n, (time.perf_counter()-t)/int(line)*1e6, flush=True)\n")
        client = subprocess.Popen(["ip", "netns", "exec", net.host_netns, sys.executable, "-c", code],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)

        def echo(n: int = 200) -> float:
            client.stdin.write(f"{n}\n")
            client.stdin.flush()
            ok, rtt = client.stdout.readline().split()
            assert int(ok) == n
            return float(rtt)

        before = echo()
        lab.set_link(net, "box1", Impairment(delay_us=500))
        assert echo() > before + 800
        lab.set_link(net, "box1", Impairment(delay_us=100, loss=0.01))
        echo(100)
        lab.set_link(net, "box1", Impairment())
        assert net.box("box1").emulator_pid is None and echo() < before + 300
        links = subprocess.run(["ip", "-n", b.link_netns, "-o", "link"], capture_output=True, text=True).stdout
        assert " emu:" not in links  # the TUN went with the emulator
    finally:
        for proc in (client, server):
            if proc:
                proc.kill()
                proc.wait()


def test_a_clean_direction_is_forwarded_by_the_kernel_and_counted(net):
    """The C emulator's fast path: a direction that asks for nothing never reaches its
    loop (a tc program counts it and the kernel forwards it), the other one does."""
    b = lab.set_link(net, "box1", Impairment(), force_emulator=True, netem=False)
    assert lab.link_report(net, "box1").get("fast_path"), \
        "the C emulator runs without its kernel fast path: it needs gcc (scripts/setup.sh) and tc BPF in this kernel"
    got = udp_probe.across(b.netns, b.box_ip, net.host_netns, 2000)
    up = lab.link_report(net, "box1")["up"]
    assert got["lost"] == 0 and up["kernel_packets"] == up["packets"] == up["sent"] >= 2000, up
    assert up["held_samples"] == 0 and up["bytes"] >= 2000 * 28, up  # IP length, as the TUN counts it
    lab.set_link(net, "box1", Impairment(delay_us=200), down=Impairment(), netem=False)  # the same emulator
    lab.reset_link_counters(net, "box1")
    ping_rtt_us(net)
    report = lab.link_report(net, "box1")
    assert report["up"]["kernel_packets"] == 0 and report["up"]["delay_us"]["p50"] == pytest.approx(200, rel=0.1)
    assert report["down"]["packets"] >= 400 and report["down"]["kernel_packets"] == report["down"]["packets"]


def test_an_emulator_that_died_is_replaced_by_the_next_change(net):
    b = lab.set_link(net, "box1", Impairment(delay_us=100), netem=False)  # the emulator, also where netem is
    assert b.delay_mode == "emulator", b.delay_mode
    dead = b.emulator_pid
    os.kill(dead, signal.SIGKILL)  # its TUN, routes and tc programs go with it: the link is clean meanwhile
    assert wait_until(lambda: f" {lab.EMU_TUN}:" not in subprocess.run(
        ["ip", "-n", b.link_netns, "-o", "link"], capture_output=True, text=True).stdout, 5)
    assert udp_probe.across(b.netns, b.box_ip, net.host_netns, 500)["lost"] == 0
    b = lab.set_link(net, "box1", Impairment(delay_us=200), netem=False)
    assert b.emulator_pid != dead and dead not in net.pids
    assert lab.link_report(net, "box1")["up"]["asked"]["delay_us"] == 200


def dark_for_half_a_second(net, b: lab.BoxState, engine: str = "c") -> dict:
    """500 datagrams at 1000 a second into a link that loses every one (up), then 20 through:
    the report's ``blackout_ms`` while dark and after."""
    lab.set_link(net, "box1", Impairment(loss=1.0), down=Impairment(delay_us=50), engine=engine)
    lab.reset_link_counters(net, "box1")
    udp_probe.send_from(net.host_netns, b.box_ip, 500, pps=1000, port=9)
    dark = lab.link_report(net, "box1")["up"]
    lab.set_link(net, "box1", Impairment(delay_us=50), engine=engine)
    udp_probe.send_from(net.host_netns, b.box_ip, 20, pps=1000, port=9)
    return {"dark": dark, "after": lab.link_report(net, "box1")["up"]}


def test_a_blackout_is_timed_from_the_first_lost_packet_to_the_next_one_through(net):
    """What a fault test needs to tell a lossy link from a dark one: the longest time a
    direction let nothing through (a run of losses, from its first packet to the next packet
    that passed, or to now while it lasts)."""
    got = dark_for_half_a_second(net, net.box("box1"))
    assert got["dark"]["lost"] >= 500 and got["dark"]["sent"] == 0, got["dark"]
    assert 450 <= got["dark"]["blackout_ms"] <= 3000, got["dark"]
    assert got["after"]["sent"] >= 20 and got["dark"]["blackout_ms"] <= got["after"]["blackout_ms"] <= 4000, got["after"]
    # Gilbert-Elliott runs of ~4 packets at 20000 a second are dark for well under a ms; the
    # probe's end marks go 10 ms apart (a run among them lasts tens of ms), and a lost last
    # one stays open until the report
    lab.set_link(net, "box1", Impairment(ge_p=0.01, ge_r=0.25))
    lab.reset_link_counters(net, "box1")
    b = net.box("box1")
    got = udp_probe.across(b.netns, b.box_ip, net.host_netns, 6000)
    assert got["lost"] > 0 and 0 < lab.link_report(net, "box1")["up"]["blackout_ms"] < 300, got


def test_python_engine_does_the_same(net):
    """The fallback (no C compiler): the same losses; its hold is never short, and late by
    at most tens of µs (its loop is slower, more so on a loaded machine)."""
    b = lab.set_link(net, "box1", Impairment(delay_us=200, loss=0.02), engine="python")
    got = udp_probe.across(b.netns, b.box_ip, net.host_netns, 1500, pps=1000)  # one at a time: Python is slow
    report = lab.link_report(net, "box1")
    if b.delay_mode == "emulator":
        assert report["engine"] == "python" and report["held_from"] == "read" and 200 <= report["up"]["delay_us"]["p50"] <= 260, report["up"]
    assert 0.008 <= got["loss_rate"] <= 0.035, got
    if b.delay_mode == "emulator":
        dark = dark_for_half_a_second(net, b, engine="python")
        assert 450 <= dark["dark"]["blackout_ms"] <= dark["after"]["blackout_ms"] <= 4000, dark


def test_rate_limit_with_tbf(net):
    """The rate holds for plain TCP and for the floor of TLS in C (the native stream's
    framed messages), which so measures the link and not a shortcut around it."""
    b = lab.set_link(net, "box1", Impairment(rate_bps=100e6))
    assert b.delay_mode in ("tbf", "netem") and b.emulator_pid is None
    got = floors.measure_lab(net, "box1", round_trips=50, bulk_bytes=8 << 20, kinds=("tcp", "tls-native"))
    for kind in ("tcp", "tls-native"):
        bulk = got[kind]["bulk"]
        assert 8 <= bulk["to_box_MBps"] <= 13.5 and 8 <= bulk["from_box_MBps"] <= 13.5, (kind, bulk)  # 12.5 MB/s
    assert 0 < got["tls-native"]["ping_pong"]["median_us"] <= got["tls-native"]["ping_pong"]["p99_us"]


@pytest.mark.parametrize("kind", ["tls-native", "tcp-native"])
def test_burst_floor_echoes_each_size_whole_after_idle(net, kind):
    """The burst floor bench_accel measures a pass against (with TLS, or plain TCP for a
    plaintext box): every size comes back whole (the client checks each reply's length),
    and 256 KiB each way costs more than 32 bytes."""
    got = floors.measure_lab(net, "box1", round_trips=200, bulk_bytes=0, kinds=(kind,),
                             burst_sizes=(32, 256 << 10))[kind]
    assert "bulk" not in got and set(got["burst"]) == {"32", str(256 << 10)}, got
    small, large = got["burst"]["32"]["median_us"], got["burst"][str(256 << 10)]["median_us"]
    assert 0 < small < large, got
    with pytest.raises(ValueError, match="native"):
        floors.measure_lab(net, "box1", kinds=("tcp",), burst_sizes=(32,))


def test_cpu_floor_counts_each_ends_cpu_per_message(net):
    """The CPU floor bench_nvme judges a remote read's cost by: every message arrives whole
    (the client checks each length), both ends report CPU, and 128 KiB messages cost more
    CPU each than 4 KiB ones (a figure blind to size would be measuring something else)."""
    got = {size: floors.measure_lab(net, "box1", round_trips=50, bulk_bytes=0, kinds=("tls-native",),
                                    cpu_message_size=size)["tls-native"]["cpu_per_message"]
           for size in (4096, 128 << 10)}
    for size, row in got.items():
        assert row["size"] == size and row["count"] == floors.CPU_MESSAGES and row["MBps"] > 0, row
        assert row["sender_us"] > 0 and row["receiver_us"] > 0, row
        assert row["both_us"] == pytest.approx(row["sender_us"] + row["receiver_us"]), row
    assert got[128 << 10]["both_us"] > 2 * got[4096]["both_us"], got
    with pytest.raises(ValueError, match="native"):
        floors.measure_lab(net, "box1", kinds=("tcp",), cpu_message_size=4096)


def test_an_unknown_floor_kind_is_refused_by_name(net):
    with pytest.raises(ValueError, match="tls-native"):
        floors.measure_lab(net, "box1", kinds=("quic",))


def test_down_sweeps_the_registry_entry_of_a_box_that_was_killed(labs):
    """A box killed by SIGKILL cannot remove its entry from the run directory's registry:
    taking the lab down does, so no lab leaves one behind."""
    state = labs.own(lab.Topology.parse(ONE_BOX))
    pid = state.box("box1").proxy_pid
    entry = registry.find(pid, "remote")
    assert entry is not None, "the lab's box did not register"
    path = registry.entry_path("remote", entry["name"], pid)
    os.kill(pid, signal.SIGKILL)
    labs.factory.down(state.name)
    assert not path.exists()


def test_cli_link_and_down_leave_nothing(labs):
    name = labs.adopt(f"n{os.getpid()}")
    run = lambda *a: subprocess.run([sys.executable, "-m", "dxpu_vfio.cli", "lab", *a, "--name", name],  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    assert run("up", "--no-vm").returncode == 0
    changed = run("link", "box1", "--delay", "50us", "--jitter", "10us", "--loss", "0.1%", "--rate", "10gbit", "--json")
    assert changed.returncode == 0, changed.stderr
    info = json.loads(changed.stdout)
    assert info["asked"]["up"]["delay_us"] == 50 and info["asked"]["down"]["loss"] == pytest.approx(0.001)
    assert info["mode"] in ("emulator", "netem")
    pid = lab.status(name)["boxes"][0]["emulator_pid"]
    if info["mode"] == "emulator":  # SCHED_FIFO unless turned off
        assert os.sched_getscheduler(pid) == os.SCHED_FIFO
        assert run("link", "box1", "--realtime", "off").returncode == 0
        assert os.sched_getscheduler(pid) == os.SCHED_OTHER
    down_only = json.loads(run("link", "box1", "--dir", "down", "--delay", "1ms", "--json").stdout)
    assert down_only["asked"]["down"]["delay_us"] == 1000 and down_only["asked"]["up"]["delay_us"] == 50
    assert run("down").returncode == 0
    assert not any(ns.startswith(f"dx{name}-") for ns in netns.listnetns())
    assert not pid or not os.path.exists(f"/proc/{pid}")
    assert not lab.lab_dir(name).exists()
