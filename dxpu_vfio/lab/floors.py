"""The machine's floor between a lab's host node and one of its boxes, in the same run
as a benchmark: what the network and the language cost before our proxies add anything.

* ping-pong: a 32-byte request and a 32-byte reply, blocking, plain TCP and TLS 1.3
  (the link's own security), median and p99 of N round trips;
* bulk: 64 MiB each way in 1 MiB ``sendall`` / ``recv_into``, plain TCP and TLS.

Both ends are Python, like the proxies: a ratio of a proxy's number to these says what
our software costs on top of the same sockets. The server runs in the box's namespace,
the client in the host's; both are ended by pid.

    python -m dxpu_vfio.lab.floors serve --listen IP --port P [--tls-dir D --role box1]
    python -m dxpu_vfio.lab.floors client --address IP:P [--tls-dir D] [--round-trips N]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

from dxpu_vfio.link.transport import TlsFiles, client_context, server_context, split_address, tune
from dxpu_vfio.procs import terminate

FLOOR_PORT = 7200
PING = 32
PIECE = 1 << 20
OP = struct.Struct("<4sQ")  # b"PING"/b"BULK", count or bytes


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("peer closed")
        got += n


def _serve_one(sock: socket.socket) -> None:
    buf = bytearray(PIECE)
    view = memoryview(buf)
    with sock:
        head = bytearray(OP.size)
        _recv_exact(sock, memoryview(head))
        op, count = OP.unpack(head)
        if op == b"PING":
            for _ in range(count):
                _recv_exact(sock, view[:PING])
                sock.sendall(view[:PING])
        elif op == b"BULK":
            left = count
            while left:
                n = sock.recv_into(view[:min(PIECE, left)])
                if not n:
                    return
                left -= n
            sock.sendall(b"\0")  # all in: the client's clock for that direction stops
            for pos in range(0, count, PIECE):
                sock.sendall(view[:min(PIECE, count - pos)])


def serve(listen: str, port: int, tls: TlsFiles | None) -> None:
    ctx = server_context(tls) if tls else None
    listener = socket.create_server((listen, port))
    print("serving", flush=True)
    while True:
        sock, _ = listener.accept()
        tune(sock)
        if ctx is not None:
            sock = ctx.wrap_socket(sock, server_side=True)
        threading.Thread(target=_serve_one, args=(sock,), daemon=True).start()


def _connect(address: str, tls: TlsFiles | None) -> socket.socket:
    sock = tune(socket.create_connection(split_address(address), timeout=30))
    return client_context(tls).wrap_socket(sock) if tls else sock


def ping_pong(address: str, tls: TlsFiles | None, round_trips: int) -> dict:
    with _connect(address, tls) as sock:
        sock.sendall(OP.pack(b"PING", round_trips))
        out, back = bytes(PING), memoryview(bytearray(PING))
        times = []
        for _ in range(round_trips):
            started = time.perf_counter_ns()
            sock.sendall(out)
            _recv_exact(sock, back)
            times.append(time.perf_counter_ns() - started)
    times = times[len(times) // 10:]  # the first ones warm caches and TLS
    times.sort()
    return {"median_us": statistics.median(times) / 1000, "p99_us": times[int(len(times) * 0.99)] / 1000}


def bulk(address: str, tls: TlsFiles | None, total: int) -> dict:
    data = memoryview(bytes(PIECE))
    buf = memoryview(bytearray(PIECE))
    with _connect(address, tls) as sock:
        sock.sendall(OP.pack(b"BULK", total))
        started = time.perf_counter()
        for pos in range(0, total, PIECE):
            sock.sendall(data[:min(PIECE, total - pos)])
        _recv_exact(sock, buf[:1])
        sent = time.perf_counter() - started
        started = time.perf_counter()
        left = total
        while left:
            n = sock.recv_into(buf[:min(PIECE, left)])
            if not n:
                raise ConnectionError("peer closed during bulk")
            left -= n
        received = time.perf_counter() - started
    return {"to_box_MBps": total / sent / 1e6, "from_box_MBps": total / received / 1e6}


def measure(address: str, tls: TlsFiles | None, round_trips: int = 3000, bulk_bytes: int = 64 << 20) -> dict:
    """The ping-pong, and the bulk transfer unless ``bulk_bytes`` is 0."""
    out = {"ping_pong": ping_pong(address, tls, round_trips)}
    if bulk_bytes:
        out["bulk"] = bulk(address, tls, bulk_bytes)
    return out


def measure_lab(state, box: str, round_trips: int = 3000, bulk_bytes: int = 64 << 20,
                kinds: tuple[str, ...] = ("tcp", "tls")) -> dict:
    """Floors between ``state``'s host namespace and ``box``: plain TCP and TLS (``kinds``), same run."""
    b = state.box(box)
    out = {}
    for label, tls_args, port in (("tcp", [], FLOOR_PORT), ("tls", ["--tls-dir", str(state.certs)], FLOOR_PORT + 1)):
        if label not in kinds:
            continue
        server = subprocess.Popen(["ip", "netns", "exec", b.netns, sys.executable, "-m", "dxpu_vfio.lab.floors",
                                   "serve", "--listen", b.box_ip, "--port", str(port), "--role", box, *tls_args],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            line = server.stdout.readline()
            if b"serving" not in line:
                raise RuntimeError(f"floor server did not start: {line!r}")
            client = subprocess.run(["ip", "netns", "exec", state.host_netns, sys.executable, "-m",
                                     "dxpu_vfio.lab.floors", "client", "--address", f"{b.box_ip}:{port}",
                                     "--round-trips", str(round_trips), "--bulk-bytes", str(bulk_bytes),
                                     *tls_args], capture_output=True, text=True, timeout=300)
            if client.returncode:
                raise RuntimeError(f"floor client failed: {client.stderr[-800:]}")
            out[label] = json.loads(client.stdout)
        finally:
            terminate(server)
    return out


def measure_tls_loopback(client: TlsFiles, server_dir: Path, role: str, port: int, round_trips: int = 3000) -> dict:
    """The TLS ping-pong floor on loopback: a server process, this process the client."""
    server = subprocess.Popen([sys.executable, "-m", "dxpu_vfio.lab.floors", "serve", "--listen", "127.0.0.1",
                               "--port", str(port), "--tls-dir", str(server_dir), "--role", role],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        if b"serving" not in server.stdout.readline():
            raise RuntimeError("floor server did not start")
        return ping_pong(f"127.0.0.1:{port}", client, round_trips)
    finally:
        terminate(server)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dxpu_vfio.lab.floors", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--listen", required=True)
    s.add_argument("--port", type=int, default=FLOOR_PORT)
    s.add_argument("--tls-dir", type=Path)
    s.add_argument("--role", default="box1")
    c = sub.add_parser("client")
    c.add_argument("--address", required=True)
    c.add_argument("--tls-dir", type=Path)
    c.add_argument("--round-trips", type=int, default=3000)
    c.add_argument("--bulk-bytes", type=int, default=64 << 20)
    args = parser.parse_args(argv)
    if args.what == "serve":
        serve(args.listen, args.port, TlsFiles.in_dir(args.tls_dir, args.role) if args.tls_dir else None)
        return 0
    tls = TlsFiles.in_dir(args.tls_dir, "host") if args.tls_dir else None
    print(json.dumps(measure(args.address, tls, args.round_trips, args.bulk_bytes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
