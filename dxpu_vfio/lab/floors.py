"""The machine's floor between a lab's host node and one of its boxes, in the same run
as a benchmark: what the network and the language cost before our proxies add anything.

* ping-pong: a 32-byte request and a 32-byte reply, blocking, plain TCP and TLS 1.3
  (the link's own security), median and p99 of N round trips;
* bulk: 64 MiB each way in 1 MiB ``sendall`` / ``recv_into``, plain TCP and TLS;
* bursts (``--burst-sizes``, native stream only): one message of each size echoed at a
  time, after an idle gap, median round trip per size. A benchmark's pass moves its bytes
  that way (a doorbell's inputs, then its outputs, with the ends asleep in between), so
  bulk, whose stages overlap across messages, is a floor below what a pass can reach.
* CPU per message (``--cpu-message-size``, native stream only): the box sends a stream of
  messages of one size and each end reports the CPU it spent (user + system, its whole
  process) per message: what moving those bytes over the link costs the cores it shares
  with everything else (a remote NVMe read's 128 KiB, say), whatever the rate.

Both ends are Python, like the proxies: a ratio of a proxy's number to these says what
our software costs on top of the same sockets. ``--native`` runs the same exchanges as
framed messages on the native stream (OpenSSL and the framing in C, what the proxies'
hot paths use; ``tls-native`` in :func:`measure_lab`, ``tcp-native`` for a plaintext
box's link): where a proxy moves bytes faster than Python's TLS can, this is the floor
that bounds it. The server runs in the box's namespace, the client in the host's; both
are ended by pid.

    python -m dxpu_vfio.lab.floors serve --listen IP --port P [--tls-dir D --role box1] [--native]
    python -m dxpu_vfio.lab.floors client --address IP:P [--tls-dir D] [--round-trips N] [--native]
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

from dxpu_vfio.link.transport import (TlsFiles, accept_native, client_context, connect_native, server_context,
                                     split_address, tune)
from dxpu_vfio.native import stream as native
from dxpu_vfio.procs import terminate
from dxpu_vfio.vfio_user.connection import ConnectionClosed

FLOOR_PORT = 7200
PING = 32
PIECE = 1 << 20
BURST_GAP_S = 0.002  # idle between two bursts, as between a pass's doorbell and the one before
BURST_COUNT = 200
CPU_MESSAGES = 2000  # messages of the CPU-per-message floor
OP = struct.Struct("<4sQ")  # b"PING"/b"BULK"/b"DOWN", count or bytes
DOWN_SIZE = struct.Struct("<Q")  # after DOWN: the size of each message the server sends
CPU_SPENT = struct.Struct("<d")  # the server's CPU seconds for them, its last message
KINDS = {"tcp": (FLOOR_PORT, False, False), "tls": (FLOOR_PORT + 1, True, False),
         "tls-native": (FLOOR_PORT + 2, True, True),
         "tcp-native": (FLOOR_PORT + 3, False, True)}  # kind -> (port, TLS, native stream)


def link_kinds(plaintext: bool) -> tuple[str, str]:
    """The floor kinds of the link a box serves, in Python and on the native stream:
    ``("tls", "tls-native")``, or ``("tcp", "tcp-native")`` for a plaintext box."""
    return ("tcp", "tcp-native") if plaintext else ("tls", "tls-native")


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


def _serve_native(conn) -> None:
    """:func:`_serve_one` on the native stream: the op in the first message, then each
    32-byte ping and each piece of a bulk transfer one framed message."""
    try:
        op, count = OP.unpack(conn.receive().payload)
        if op == b"PING":
            for _ in range(count):
                conn.send_message(0, 0, 0, conn.receive().payload)
        elif op == b"BULK":
            left = count
            while left > 0:
                left -= len(conn.receive().payload)
            conn.send_message(0, 0, 0, b"\0")
            piece = memoryview(bytes(PIECE))
            for pos in range(0, count, PIECE):
                conn.send_message(0, 0, 0, piece[:min(PIECE, count - pos)])
        elif op == b"DOWN":
            (size,) = DOWN_SIZE.unpack(conn.receive().payload)
            data, started = memoryview(bytes(min(size, PIECE))), _cpu_s()
            for _ in range(count):
                conn.send_message(0, 0, 0, data)
            conn.send_message(0, 0, 0, CPU_SPENT.pack(_cpu_s() - started))
    finally:
        conn.close()


def _cpu_s() -> float:
    """This process's CPU seconds so far, user and system (its threads and the kernel's
    work done on their behalf: TLS, TCP and what the loopback path runs in a send)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def serve(listen: str, port: int, tls: TlsFiles | None, native: bool = False) -> None:
    ctx = server_context(tls) if tls and not native else None
    listener = socket.create_server((listen, port))
    print("serving", flush=True)
    while True:
        sock, _ = listener.accept()
        if native:
            try:
                target, arg = _serve_native, accept_native(sock, tls, 5.0)
            except ConnectionClosed:  # a client that failed its handshake: the next one may not
                continue
        else:
            tune(sock)
            target, arg = _serve_one, ctx.wrap_socket(sock, server_side=True) if ctx is not None else sock
        threading.Thread(target=target, args=(arg,), daemon=True).start()


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
    return _latencies(times)


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


def _latencies(times: list[int]) -> dict:
    times = times[len(times) // 10:]  # the first ones warm caches and TLS
    times.sort()
    return {"median_us": statistics.median(times) / 1000, "p99_us": times[int(len(times) * 0.99)] / 1000}


def native_ping_pong(address: str, tls: TlsFiles | None, round_trips: int) -> dict:
    """:func:`ping_pong` as framed messages on the native stream."""
    conn = connect_native(*split_address(address), tls, timeout=30)
    try:
        conn.send_message(0, 0, 0, OP.pack(b"PING", round_trips))
        out, times = bytes(PING), []
        for _ in range(round_trips):
            started = time.perf_counter_ns()
            conn.send_message(0, 0, 0, out)
            conn.receive()
            times.append(time.perf_counter_ns() - started)
    finally:
        conn.close()
    return _latencies(times)


def native_bulk(address: str, tls: TlsFiles | None, total: int) -> dict:
    """:func:`bulk` as 1 MiB framed messages on the native stream (each received one
    a bytes object: a copy the socket floor does not make, so this floor is a little low)."""
    piece = memoryview(bytes(PIECE))
    conn = connect_native(*split_address(address), tls, timeout=30)
    try:
        conn.send_message(0, 0, 0, OP.pack(b"BULK", total))
        started = time.perf_counter()
        for pos in range(0, total, PIECE):
            conn.send_message(0, 0, 0, piece[:min(PIECE, total - pos)])
        conn.receive()
        sent = time.perf_counter() - started
        started = time.perf_counter()
        left = total
        while left > 0:
            left -= len(conn.receive().payload)
        received = time.perf_counter() - started
    finally:
        conn.close()
    return {"to_box_MBps": total / sent / 1e6, "from_box_MBps": total / received / 1e6}


def native_bursts(address: str, tls: TlsFiles | None, sizes: tuple[int, ...], count: int = BURST_COUNT,
                  gap_s: float = BURST_GAP_S) -> dict:
    """Per size: a message of that many bytes echoed whole, ``count`` times, one at a time
    after ``gap_s`` of idle (both ends asleep, as around a pass); round-trip latencies."""
    conn = connect_native(*split_address(address), tls, timeout=30)
    out = {}
    try:
        conn.send_message(0, 0, 0, OP.pack(b"PING", count * len(sizes)))  # the server echoes any size
        for size in sizes:
            data, times = bytes(size), []
            for _ in range(count):
                time.sleep(gap_s)
                started = time.perf_counter_ns()
                conn.send_message(0, 0, 0, data)
                got = len(conn.receive().payload)
                times.append(time.perf_counter_ns() - started)
                if got != size:
                    raise ConnectionError(f"burst floor: sent {size} bytes, {got} came back")
            out[str(size)] = _latencies(times)
    finally:
        conn.close()
    return out


def native_cpu_per_message(address: str, tls: TlsFiles | None, size: int, count: int = CPU_MESSAGES) -> dict:
    """The box sends ``count`` messages of ``size`` bytes (at most 1 MiB) back to back and
    this end receives them; each end's CPU per message in µs, and the rate. The receiver's
    figure includes making each message a bytes object, one copy, as the host's forwarder
    makes one into guest memory."""
    if not 0 < size <= PIECE:
        raise ValueError(f"CPU floor: a message of 1 to {PIECE} bytes, not {size}")
    conn = connect_native(*split_address(address), tls, timeout=30)
    try:
        conn.send_message(0, 0, 0, OP.pack(b"DOWN", count))
        conn.send_message(0, 0, 0, DOWN_SIZE.pack(size))
        started, wall = _cpu_s(), time.perf_counter()
        for _ in range(count):
            got = len(conn.receive().payload)
            if got != size:
                raise ConnectionError(f"CPU floor: asked for {size}-byte messages, one of {got} came")
        received, wall = _cpu_s() - started, time.perf_counter() - wall
        (sent,) = CPU_SPENT.unpack(conn.receive().payload)
    finally:
        conn.close()
    return {"size": size, "count": count, "sender_us": sent / count * 1e6, "receiver_us": received / count * 1e6,
            "both_us": (sent + received) / count * 1e6, "MBps": size * count / wall / 1e6}


def burst_one_way_s(bursts: dict, nbytes: float) -> float:
    """Half the round trip of a burst of ``nbytes``, interpolated linearly between the
    measured sizes (extrapolated from the two largest beyond them)."""
    points = sorted((int(size), row["median_us"] / 2e6) for size, row in bursts.items())
    if len(points) < 2:
        raise ValueError("burst floor: needs two sizes at least")
    if nbytes <= points[0][0]:
        return points[0][1]
    for (s0, t0), (s1, t1) in zip(points, points[1:]):
        if nbytes <= s1 or (s1, t1) == points[-1]:
            return t0 + (t1 - t0) * (nbytes - s0) / (s1 - s0)
    raise AssertionError("unreachable")


def measure(address: str, tls: TlsFiles | None, round_trips: int = 3000, bulk_bytes: int = 64 << 20,
            native: bool = False, burst_sizes: tuple[int, ...] = (), cpu_message_size: int = 0) -> dict:
    """The ping-pong, the bulk transfer unless ``bulk_bytes`` is 0 (``native``: on the
    native stream), bursts of ``burst_sizes`` and, with a ``cpu_message_size``, the CPU per
    message of that size (native only)."""
    if (burst_sizes or cpu_message_size) and not native:
        raise ValueError("burst and CPU floors are measured on the native stream: pass native=True")
    out = {"ping_pong": (native_ping_pong if native else ping_pong)(address, tls, round_trips)}
    if bulk_bytes:
        out["bulk"] = (native_bulk if native else bulk)(address, tls, bulk_bytes)
    if burst_sizes:
        out["burst"] = native_bursts(address, tls, burst_sizes)
    if cpu_message_size:
        out["cpu_per_message"] = native_cpu_per_message(address, tls, cpu_message_size)
    return out


def measure_lab(state, box: str, round_trips: int = 3000, bulk_bytes: int = 64 << 20,
                kinds: tuple[str, ...] = ("tcp", "tls"), burst_sizes: tuple[int, ...] = (),
                cpu_message_size: int = 0) -> dict:
    """Floors between ``state``'s host namespace and ``box``, same run: ``kinds`` of
    :data:`KINDS` (plain TCP, TLS, either on the native stream); ``burst_sizes`` and
    ``cpu_message_size`` on each native kind (under ``tls-native -> burst``,
    ``tls-native -> cpu_per_message`` and the same under ``tcp-native``). A kind named
    twice is measured once (a plaintext benchmark's link kinds include ``tcp``)."""
    kinds = tuple(dict.fromkeys(kinds))
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown floor kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    on_native_stream = [kind for kind in kinds if KINDS[kind][2]]
    if (burst_sizes or cpu_message_size) and not on_native_stream:
        raise ValueError("burst and CPU floors are measured on the native stream: "
                         "add tls-native (or tcp-native) to kinds")
    if on_native_stream:
        native.require()  # says what to build where the module is missing
    b = state.box(box)
    out = {}
    for label in kinds:
        port, tls, on_native = KINDS[label]
        tls_args = (["--tls-dir", str(state.certs)] if tls else []) + (["--native"] if on_native else [])
        native_args = ["--burst-sizes", ",".join(map(str, burst_sizes))] if on_native and burst_sizes else []
        if on_native and cpu_message_size:
            native_args += ["--cpu-message-size", str(cpu_message_size)]
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
                                     *tls_args, *native_args], capture_output=True, text=True, timeout=300)
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
    s.add_argument("--native", action="store_true", help="framed messages on the native stream")
    c = sub.add_parser("client")
    c.add_argument("--address", required=True)
    c.add_argument("--tls-dir", type=Path)
    c.add_argument("--round-trips", type=int, default=3000)
    c.add_argument("--bulk-bytes", type=int, default=64 << 20)
    c.add_argument("--native", action="store_true", help="framed messages on the native stream")
    c.add_argument("--burst-sizes", default="", help="comma-separated message sizes echoed one at a time after "
                   f"{BURST_GAP_S * 1000:g} ms idle (with --native)")
    c.add_argument("--cpu-message-size", type=int, default=0,
                   help=f"also the CPU each end spends per message of this many bytes, {CPU_MESSAGES} sent by the "
                        "server (with --native)")
    args = parser.parse_args(argv)
    try:
        burst_sizes = tuple(int(size) for size in args.burst_sizes.split(",") if size) if args.what == "client" else ()
    except ValueError:
        parser.error(f"--burst-sizes wants byte counts separated by commas, not {args.burst_sizes!r}")
    if burst_sizes and not args.native:
        parser.error("--burst-sizes measures the native stream: add --native")
    if args.what == "client" and args.cpu_message_size and not args.native:
        parser.error("--cpu-message-size measures the native stream: add --native")
    if args.what == "client" and not 0 <= args.cpu_message_size <= PIECE:
        parser.error(f"--cpu-message-size is 1 to {PIECE} bytes (0: not measured), not {args.cpu_message_size}")
    if args.what == "serve":
        serve(args.listen, args.port, TlsFiles.in_dir(args.tls_dir, args.role) if args.tls_dir else None, args.native)
        return 0
    tls = TlsFiles.in_dir(args.tls_dir, "host") if args.tls_dir else None
    print(json.dumps(measure(args.address, tls, args.round_trips, args.bulk_bytes, args.native, burst_sizes,
                             args.cpu_message_size)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
