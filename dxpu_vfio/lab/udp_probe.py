"""Numbered UDP datagrams across a lab link, to see what the link really did to packets:
how many arrived, which were lost and in what runs, duplicated, out of order. TCP hides
all of that by retransmitting; tests and benchmarks of the link emulator use this.

    python -m dxpu_vfio.lab.udp_probe recv --listen IP --port P    (prints "ready", then JSON)
    python -m dxpu_vfio.lab.udp_probe send --to IP --port P --count N [--pps 20000]
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import subprocess
import sys
import time

SEQ = struct.Struct("<Q")
PAYLOAD = 200
PORT = 7300


def receive(listen: str, port: int, count: int, idle: float = 1.0) -> dict:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind((listen, port))
    print("ready", flush=True)
    seen: list[int] = []
    sock.settimeout(30)
    try:
        while True:
            data = sock.recv(2048)
            seq = SEQ.unpack_from(data)[0]
            if seq == (1 << 64) - 1:  # the sender's end mark
                break
            seen.append(seq)
            sock.settimeout(idle)
    except socket.timeout:
        pass
    unique = set(seen)
    missing = sorted(set(range(count)) - unique)
    runs, run = [], 0
    for i, seq in enumerate(missing):
        run = run + 1 if i and seq == missing[i - 1] + 1 else 1
        if i + 1 == len(missing) or missing[i + 1] != seq + 1:
            runs.append(run)
    highest, late = -1, 0
    for seq in seen:
        if seq < highest:
            late += 1
        highest = max(highest, seq)
    return {"sent": count, "received": len(seen), "unique": len(unique), "duplicates": len(seen) - len(unique),
            "lost": len(missing), "loss_rate": len(missing) / count if count else 0.0,
            "loss_runs": len(runs), "mean_loss_run": sum(runs) / len(runs) if runs else 0.0,
            "out_of_order": late}


def send(to: str, port: int, count: int, pps: float) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    pad = bytes(PAYLOAD - SEQ.size)
    start = time.perf_counter()
    burst = max(1, int(pps / 1000))  # a burst a millisecond, sleeping between: no core spent spinning
    for seq in range(count):
        if seq % burst == 0 and (wait := start + seq / pps - time.perf_counter()) > 0:
            time.sleep(wait)
        sock.sendto(SEQ.pack(seq) + pad, (to, port))
    time.sleep(0.05)
    for _ in range(20):  # the end mark may be lost too: send it a few times
        sock.sendto(SEQ.pack((1 << 64) - 1), (to, port))
        time.sleep(0.01)


PROBE = [sys.executable, "-m", "dxpu_vfio.lab.udp_probe"]


def send_from(send_ns: str, to_ip: str, count: int, pps: float = 20000, port: int = PORT) -> None:
    """Send ``count`` datagrams from namespace ``send_ns`` to ``to_ip`` (nobody need listen:
    a test of the link between them counts them on the way)."""
    subprocess.run(["ip", "netns", "exec", send_ns, *PROBE, "send", "--to", to_ip, "--port", str(port),
                    "--count", str(count), "--pps", str(pps)], check=True, timeout=120)


def across(recv_ns: str, recv_ip: str, send_ns: str, count: int, pps: float = 20000, port: int = PORT) -> dict:
    """Send ``count`` datagrams from namespace ``send_ns`` to ``recv_ip`` in ``recv_ns``;
    what the receiver saw."""
    receiver = subprocess.Popen(["ip", "netns", "exec", recv_ns, *PROBE, "recv", "--listen", recv_ip, "--port", str(port),
                                 "--count", str(count)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        if receiver.stdout.readline().strip() != "ready":
            raise RuntimeError("udp probe receiver did not start")
        send_from(send_ns, recv_ip, count, pps, port)
        out, _ = receiver.communicate(timeout=60)
        return json.loads(out)
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dxpu_vfio.lab.udp_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    r = sub.add_parser("recv")
    r.add_argument("--listen", required=True)
    r.add_argument("--port", type=int, default=PORT)
    r.add_argument("--count", type=int, required=True)
    s = sub.add_parser("send")
    s.add_argument("--to", required=True)
    s.add_argument("--port", type=int, default=PORT)
    s.add_argument("--count", type=int, required=True)
    s.add_argument("--pps", type=float, default=20000)
    args = parser.parse_args(argv)
    if args.what == "recv":
        print(json.dumps(receive(args.listen, args.port, args.count)))
    else:
        send(args.to, args.port, args.count, args.pps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
