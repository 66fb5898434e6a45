#!/usr/bin/env python3
"""The lab's link emulator: its own floor and how well it does what it is asked.

One lab box, and beside its link (host - link namespace - box) a direct veth between the
same two namespaces, measured in the same run (Python TCP ping-pong of 32 bytes and a
bulk transfer each way, :mod:`dxpu_vfio.lab.floors`):

* floor at zero impairment: the direct veth; the lab link as it is by default (the
  kernel forwards in the link namespace, no emulator); the C emulator kept in the path
  with nothing to do (its tc programs count the packets and let the kernel forward them);
  the C emulator with every packet through its loop (the hop through user space a
  loss or reordering costs); the Python one (all through its loop);
* delay: asked vs achieved over a range, with and without jitter: the delay the emulator
  measured (p50, p99, std; from the packet's arrival in the link namespace where its tc
  program stamps it) and what TCP saw: the round trip's growth over the clean link's
  (kernel forwarding), halved, clean and delayed measured in turn ``--pairs`` times and
  the median taken, with the emulator SCHED_FIFO (the lab's default) and not;
* loss: asked vs achieved for random and Gilbert-Elliott loss, from numbered UDP
  datagrams (:mod:`dxpu_vfio.lab.udp_probe`): the rate and the mean run of losses.

It measures the emulator also where the kernel has netem (``netem=False``). Table on
stdout, JSON in results/bench/netem.json.

    .venv/bin/python scripts/bench_netem.py [--rounds 2] [--round-trips 3000] [--bulk-mib 128]
        [--datagrams 20000] [--floor-only | --delay-only] [--fifo-only] [--pairs 3] [--no-python]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dxpu_vfio.bench import table, write_json  # noqa: E402
from dxpu_vfio.lab import lab, udp_probe  # noqa: E402
from dxpu_vfio.lab.impairment import Impairment  # noqa: E402
from dxpu_vfio.procs import exit_on_sigterm, terminate  # noqa: E402

DIRECT_HOST, DIRECT_BOX = "198.19.1.1", "198.19.1.2"
PORT = 7210


def direct_veth(state: lab.LabState) -> None:
    """A veth straight from the host namespace to the box's, beside the lab's link."""
    b = state.box("box1")
    subprocess.run(["ip", "-n", state.host_netns, "link", "add", "direct", "type", "veth", "peer", "name", "direct",
                    "netns", b.netns], check=True)
    for ns, ip in ((state.host_netns, DIRECT_HOST), (b.netns, DIRECT_BOX)):
        subprocess.run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "direct"], check=True)
        subprocess.run(["ip", "-n", ns, "link", "set", "direct", "up"], check=True)


def measure(state: lab.LabState, address: str, round_trips: int, bulk: int) -> dict:
    out = subprocess.run(["ip", "netns", "exec", state.host_netns, sys.executable, "-m", "dxpu_vfio.lab.floors",
                          "client", "--address", f"{address}:{PORT}", "--round-trips", str(round_trips),
                          "--bulk-bytes", str(bulk)], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout)


def floor_rows(state: lab.LabState, rounds: int, round_trips: int, bulk: int, log, python: bool = True) -> dict:
    """Each path ``rounds`` times, interleaved (the machine is shared): medians of the rounds."""
    b = state.box("box1")
    paths = {"direct veth": (DIRECT_BOX, None), "lab link, kernel (default at zero)": (b.box_ip, None),
             "lab link, C emulator at zero": (b.box_ip, "c"),
             "lab link, C emulator, every packet through its loop": (b.box_ip, "c-loop"),
             "lab link, Python emulator at zero": (b.box_ip, "python")}
    if not python:
        del paths["lab link, Python emulator at zero"]
    runs: dict[str, list[dict]] = {p: [] for p in paths}
    for r in range(rounds):
        for name, (address, engine) in paths.items():
            if engine:
                lab.set_link(state, "box1", Impairment(), force_emulator=True, engine=engine.removesuffix("-loop"),
                             fast_path=not engine.endswith("-loop"), netem=False)
            runs[name].append(measure(state, address, round_trips, bulk))
            lab.set_link(state, "box1", Impairment(), netem=False)
            log(f"  round {r + 1} {name:36} rtt {runs[name][-1]['ping_pong']['median_us']:7.1f} µs  "
                f"bulk {runs[name][-1]['bulk']['to_box_MBps']:7.0f} MB/s")
    out = {}
    for name, got in runs.items():
        med = lambda f: statistics.median(f(g) for g in got)  # noqa: E731
        out[name] = {"rtt_median_us": med(lambda g: g["ping_pong"]["median_us"]),
                     "rtt_p99_us": med(lambda g: g["ping_pong"]["p99_us"]),
                     "to_box_MBps": med(lambda g: g["bulk"]["to_box_MBps"]),
                     "from_box_MBps": med(lambda g: g["bulk"]["from_box_MBps"]), "rounds": got}
    return out


def delay_rows(state: lab.LabState, round_trips: int, log, fifo: tuple[bool, ...] = (False, True),
               pairs: int = 3) -> list[dict]:
    b = state.box("box1")
    rows = []
    asks = [Impairment(delay_us=d) for d in (20, 50, 100, 200, 500, 1000, 2000)] + \
           [Impairment(delay_us=100, jitter_us=20), Impairment(delay_us=500, jitter_us=100),
            Impairment(delay_us=200, jitter_us=50, distribution="uniform")]
    for imp, realtime in ((i, rt) for i in asks for rt in fifo):
        # the floors right before each row (the machine's load moves): ping-pong alone, no queue,
        # every packet through a fresh emulator's loop (a running one would keep its fast path),
        # then the clean link (kernel forwarding, what a user compares to); then a fresh emulator
        lab.set_link(state, "box1", Impairment(), netem=False)
        lab.set_link(state, "box1", Impairment(), force_emulator=True, realtime=realtime, netem=False, fast_path=False)
        loop = measure(state, b.box_ip, round_trips // pairs, 0)["ping_pong"]["median_us"]
        # then clean link and delayed link in turn, ``pairs`` times (a burst of load from the
        # machine's other users moves one measurement by 10-30 µs): the median of the pairs'
        # growths, so one slow clean baseline does not make the delay look short
        cleans, rtts, growths = [], [], []
        for _ in range(pairs):
            lab.set_link(state, "box1", Impairment(), netem=False)
            cleans.append(measure(state, b.box_ip, round_trips // pairs, 0)["ping_pong"]["median_us"])
            lab.set_link(state, "box1", imp, realtime=realtime, netem=False)
            lab.reset_link_counters(state, "box1")
            rtts.append(measure(state, b.box_ip, round_trips // pairs, 0)["ping_pong"]["median_us"])
            growths.append(rtts[-1] - cleans[-1])
        report = lab.link_report(state, "box1")
        rep = report["up"]
        clean, rtt = statistics.median(cleans), statistics.median(rtts)
        tcp_one_way, over_loop = statistics.median(growths) / 2, (rtt - loop) / 2
        rows.append({"asked": imp.to_dict(), "realtime": realtime, "held_from": report.get("held_from", "read"),
                     "held_p50_us": rep["delay_us"]["p50"], "held_p99_us": rep["delay_us"]["p99"],
                     "held_std_us": rep["delay_us"]["std"], "arrival_wait_us": rep.get("arrival_wait_us"),
                     "handback_us": rep.get("handback_us"), "stamped": rep.get("stamped"),
                     "packets": rep["packets"], "rtt_us": rtt, "rtt_clean_us": clean, "rtt_loop_floor_us": loop,
                     "rtt_pairs": list(zip(cleans, rtts)),
                     "tcp_one_way_us": tcp_one_way, "tcp_over_loop_us": over_loop,
                     "held_error": rep["delay_us"]["p50"] / imp.delay_us - 1, "tcp_error": tcp_one_way / imp.delay_us - 1})
        log(f"  delay {imp.delay_us:6g} ± {imp.jitter_us:g} µs{' FIFO' if realtime else ''}: held p50 "
            f"{rep['delay_us']['p50']:8.1f}  TCP one way {tcp_one_way:8.1f} (over the loop's floor {over_loop:8.1f})")
    lab.set_link(state, "box1", Impairment(), realtime=False, netem=False)
    return rows


def loss_rows(state: lab.LabState, count: int, log) -> list[dict]:
    b = state.box("box1")
    rows = []
    asks = [Impairment(loss=p) for p in (0.001, 0.01, 0.05)] + \
           [Impairment(ge_p=0.01, ge_r=0.25), Impairment(ge_p=0.002, ge_r=0.1), Impairment(ge_p=0.01, ge_r=0.5, ge_loss_bad=0.5)]
    for imp in asks:
        lab.set_link(state, "box1", imp, netem=False)
        lab.reset_link_counters(state, "box1")
        got = udp_probe.across(b.netns, b.box_ip, state.host_netns, count)
        rep = lab.link_report(state, "box1")["up"]
        expected_run = 1 / imp.ge_r if imp.ge_p and imp.ge_loss_bad == 1 else None
        rows.append({"asked": imp.to_dict(), "expected_loss": imp.expected_loss, "achieved_loss": got["loss_rate"],
                     "emulator_loss": rep["loss_rate"], "mean_loss_run": got["mean_loss_run"],
                     "expected_run": expected_run, "datagrams": count})
        log(f"  loss {imp.expected_loss * 100:6.2f} %: achieved {got['loss_rate'] * 100:6.2f} %, "
            f"mean run {got['mean_loss_run']:.2f}")
    lab.set_link(state, "box1", Impairment(), netem=False)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--round-trips", type=int, default=3000)
    parser.add_argument("--bulk-mib", type=int, default=128)
    parser.add_argument("--datagrams", type=int, default=20000)
    parser.add_argument("--no-python", action="store_true", help="leave the Python emulator's floor row out")
    parser.add_argument("--floor-only", action="store_true", help="only the zero-impairment floor (no delay or loss rows)")
    parser.add_argument("--delay-only", action="store_true", help="only the delay rows (no floor or loss rows)")
    parser.add_argument("--pairs", type=int, default=3, help="clean/delayed measurements in turn per delay row")
    parser.add_argument("--fifo-only", action="store_true", help="delay rows with the emulator SCHED_FIFO only (the default)")
    args = parser.parse_args()
    exit_on_sigterm()  # a SIGTERM still runs the cleanup below: no VM or lab left
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    topology = lab.Topology(f"nb{os.getpid()}", [lab.BoxSpec("box1", [{"id": "td0", "model": "testdev"}])])
    server = None
    try:
        state = lab.up(topology)
        b = state.box("box1")
        direct_veth(state)
        server = subprocess.Popen(["ip", "netns", "exec", b.netns, sys.executable, "-m", "dxpu_vfio.lab.floors", "serve",
                                   "--listen", "0.0.0.0", "--port", str(PORT)], stdout=subprocess.PIPE,
                                  start_new_session=True)
        if b"serving" not in server.stdout.readline():
            raise RuntimeError("floor server did not start")
        floor, delays, losses = {}, [], []
        if not args.delay_only:
            log("floor at zero impairment")
            floor = floor_rows(state, args.rounds, args.round_trips, args.bulk_mib << 20, log, python=not args.no_python)
        if not args.floor_only:
            log("delay")
            delays = delay_rows(state, args.round_trips, log, (True,) if args.fifo_only else (False, True), args.pairs)
            if not args.delay_only:
                log("loss")
                losses = loss_rows(state, args.datagrams, log)
    finally:
        terminate(server)
        lab.down(topology.name)  # safe where lab.up never finished

    if floor:
        print_floor(floor)
    if delays:
        print_delays(delays)
    if losses:
        print_losses(losses)
    load = os.getloadavg()
    print(f"load average at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} (2 cores, shared)")
    name = "netem-floor" if args.floor_only else "netem-delay" if args.delay_only else "netem"
    path = write_json(name, {"floor": floor, "delay": delays, "loss": losses, "loadavg": load})
    print(f"\nJSON: {path}")
    return 0


def print_floor(floor: dict) -> None:
    direct = floor["direct veth"]
    print("\nfloor at zero impairment (Python TCP ping-pong of 32 B; bulk in 1 MiB sends), same run")
    print(table(["path", "RTT p50 µs", "RTT p99 µs", "RTT / direct", "to box MB/s", "from box MB/s", "throughput / direct"],
                [[name, r["rtt_median_us"], r["rtt_p99_us"], f"{r['rtt_median_us'] / direct['rtt_median_us']:.2f}",
                  f"{r['to_box_MBps']:.0f}", f"{r['from_box_MBps']:.0f}",
                  f"{min(r['to_box_MBps'] / direct['to_box_MBps'], r['from_box_MBps'] / direct['from_box_MBps']):.2f}"]
                 for name, r in floor.items()]))
    kernel, emu = floor["lab link, kernel (default at zero)"], floor["lab link, C emulator at zero"]
    loop = floor["lab link, C emulator, every packet through its loop"]

    def verdict(r: dict) -> str:
        added = r["rtt_median_us"] / direct["rtt_median_us"] - 1
        kept = min(r["to_box_MBps"] / direct["to_box_MBps"], r["from_box_MBps"] / direct["from_box_MBps"])
        return (f"RTT +{added * 100:.1f}% ({'meets' if added < 0.3 else 'MISSES'} < 30%), throughput kept "
                f"{kept * 100:.0f}% ({'meets' if kept >= 0.8 else 'MISSES'} >= 80%)")
    print(f"\ngoals vs the direct veth: lab link at zero (default, kernel forwarding): {verdict(kernel)}")
    print(f"                          C emulator kept in the path at zero:           {verdict(emu)}")
    print(f"                          C emulator, every packet through its loop:     {verdict(loop)}")


def print_losses(losses: list[dict]) -> None:
    print("\nloss (numbered UDP datagrams, host -> box)")
    print(table(["asked", "expected", "achieved", "emulator counted", "mean run", "expected run"],
                [[f"random {r['asked']['loss'] * 100:g}%" if r["asked"]["loss"] else
                  f"GE p {r['asked']['ge_p'] * 100:g}% r {r['asked']['ge_r'] * 100:g}% bad {r['asked']['ge_loss_bad'] * 100:g}%",
                  f"{r['expected_loss'] * 100:.2f}%", f"{r['achieved_loss'] * 100:.2f}%", f"{r['emulator_loss'] * 100:.2f}%",
                  f"{r['mean_loss_run']:.2f}", f"{r['expected_run']:.1f}" if r["expected_run"] else "-"] for r in losses]))


def print_delays(delays: list[dict]) -> None:
    print("\ndelay (one way, both directions): asked vs the emulator's held time (from the packet's arrival in the"
          "\nlink namespace where held_from is ingress, else from the emulator's read) and what TCP saw: the round"
          "\ntrip's growth over the clean link's (kernel forwarding; clean and delayed in turn, median of the pairs),"
          "\nhalved; and over the"
          "\nemulator loop's zero-impairment floor, halved. FIFO: the emulator SCHED_FIFO (the lab's default)")
    print(table(["asked µs", "jitter", "FIFO", "held p50", "held p99", "held std", "held err", "ingress->read",
                 "TCP one way", "TCP err", "over loop floor"],
                [[f"{r['asked']['delay_us']:g}", f"{r['asked']['jitter_us']:g} {r['asked']['distribution'] if r['asked']['jitter_us'] else ''}",
                  "yes" if r["realtime"] else "no", r["held_p50_us"], r["held_p99_us"], r["held_std_us"], f"{r['held_error'] * 100:+.1f}%",
                  r["arrival_wait_us"] if r["held_from"] == "ingress" else "-",
                  r["tcp_one_way_us"], f"{r['tcp_error'] * 100:+.1f}%", r["tcp_over_loop_us"]] for r in delays]))

    def worst(key: str, realtime: bool, jitter: bool = True) -> float:
        return max(abs(r[key]) for r in delays if r["asked"]["delay_us"] >= 50 and r["realtime"] == realtime
                   and (jitter or not r["asked"]["jitter_us"]))
    for realtime, label in ((True, "SCHED_FIFO (the default)"), (False, "SCHED_OTHER")):
        if not any(r["realtime"] == realtime for r in delays):
            continue
        held, tcp = worst("held_error", realtime), worst("tcp_error", realtime, jitter=False)
        print(f"delay from 50 µs up, {label}: held p50 within {held * 100:.1f}% of asked "
              f"({'meets' if held <= 0.1 else 'MISSES'} 10%), TCP-seen (no jitter) within {tcp * 100:.1f}% "
              f"({'meets' if tcp <= 0.1 else 'MISSES'} 10%)")


if __name__ == "__main__":
    sys.exit(main())
