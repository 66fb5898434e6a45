"""The etcd store's own HTTP/1.1 client (dxpu_vfio/pool/etcd_http.py) reads every answer
shape Go's server writes -- Content-Length, chunked (in pieces, with trailers), to the
end of the connection -- keeps one connection for many requests, and says when the
server closed it."""

from __future__ import annotations

import socket
import threading

import pytest

from dxpu_vfio.pool.etcd_http import Connection, ConnectionClosed


def serve(answers: list[bytes], close_after: set[int] = frozenset()) -> tuple[int, list[bytes], list[int]]:
    """A server that answers each request (read up to its body) with the next answer, in
    small pieces, and closes the connection after those in ``close_after`` and those
    that say so; returns its port, the requests it got and the connections it accepted."""
    listener = socket.create_server(("127.0.0.1", 0))
    got, accepted = [], []

    def run() -> None:
        pending = list(answers)
        while pending:
            conn, _ = listener.accept()
            accepted.append(1)
            buf = b""
            with conn:
                while pending:
                    while b"\r\n\r\n" not in buf:
                        data = conn.recv(65536)
                        if not data:
                            break
                        buf += data
                    if b"\r\n\r\n" not in buf:
                        break  # the client went away: accept the next
                    head, _, buf = buf.partition(b"\r\n\r\n")
                    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                    while len(buf) < length:
                        buf += conn.recv(65536)
                    got.append(head + b"\r\n\r\n" + buf[:length])
                    buf = buf[length:]
                    index, answer = len(answers) - len(pending), pending.pop(0)
                    try:
                        for i in range(0, len(answer), 7):
                            conn.sendall(answer[i:i + 7])
                    except OSError:
                        break  # the client stopped reading (an answer it refused): accept the next
                    if index in close_after or b"connection: close" in answer.lower() or \
                            b"content-length" not in answer.lower() and b"chunked" not in answer.lower():
                        break
        listener.close()

    threading.Thread(target=run, daemon=True).start()
    return listener.getsockname()[1], got, accepted


def test_reads_every_answer_shape_over_one_connection():
    body = b'{"header":{"revision":"7"}}'
    chunked = b'{"kvs":[' + b",".join(b'{"key":"a%d"}' % i for i in range(300)) + b"]}"
    pieces = b"".join(b"%x\r\n%s\r\n" % (len(chunked[i:i + 1000]), chunked[i:i + 1000])
                      for i in range(0, len(chunked), 1000))
    port, got, accepted = serve([
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body),
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + pieces + b"0\r\nX-Trailer: 1\r\n\r\n",
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 9\r\n\r\nno leader",
        b"HTTP/1.0 200 OK\r\n\r\n" + body,  # to the end of the connection
    ])
    conn = Connection("127.0.0.1", port, 5.0)
    assert conn.post("/v3/kv/range", b'{"key":"YQ=="}') == (200, body)
    assert conn.post("/v3/kv/range", b"{}") == (200, chunked)
    assert conn.post("/v3/kv/txn", b"{}") == (503, b"no leader")
    assert conn.post("/v3/kv/txn", b"{}") == (200, body) and conn.sock is None  # it closed: so did we
    assert len(accepted) == 1, "a new connection per request"
    assert got[0].startswith(b"POST /v3/kv/range HTTP/1.1\r\n") and got[0].endswith(b'\r\n\r\n{"key":"YQ=="}')
    assert b"Content-Type: application/json\r\n" in got[0]


def test_a_server_that_closes_mid_answer_is_an_error_and_the_next_call_reconnects():
    port, _, accepted = serve([b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort",
                               b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"], close_after={0})
    conn = Connection("127.0.0.1", port, 5.0)
    with pytest.raises(ConnectionClosed):
        conn.post("/v3/kv/range", b"{}")
    assert conn.sock is None
    assert conn.post("/v3/kv/range", b"{}") == (200, b"{}") and len(accepted) == 2


@pytest.mark.parametrize("answer, why", [
    (b"HTTP/1.1 200 OK\r\nX-Junk: " + b"j" * (70 << 10), "more than"),  # a head that never ends
    (b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999\r\n\r\n{}", "a body of"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -2\r\n\r\n{}", "Content-Length '-2'"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 1e3\r\n\r\n{}", "Content-Length '1e3'"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\n{}\r\n0\r\n\r\n", "chunk size b'-1'"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nfffffffffffffff\r\n{}", "a body of"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"4\r\nabcd\r\n" * 1100, "a body of"),
    (b"HTTP/1.0 200 OK\r\n\r\n" + b"x" * 5000, "more than"),  # to the end, past the limit
])
def test_an_answer_that_is_not_etcds_is_a_bounded_error_and_the_next_call_reconnects(answer, why, monkeypatch):
    """A wrong endpoint (or a hostile one) may send any bytes: a head or body past the
    limits, or a length that is not digits, is ConnectionClosed naming it, read no
    further than the limit; the connection is closed and the next call opens another."""
    from dxpu_vfio.pool import etcd_http
    monkeypatch.setattr(etcd_http, "MAX_BODY", 4096)
    port, _, accepted = serve([answer, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"], close_after={0})
    conn = Connection("127.0.0.1", port, 5.0)
    with pytest.raises(ConnectionClosed, match="malformed answer") as caught:
        conn.post("/v3/kv/range", b"{}")
    assert why in str(caught.value) and conn.sock is None and len(conn._buf) == 0
    assert conn.post("/v3/kv/range", b"{}") == (200, b"{}") and len(accepted) == 2


def test_a_server_that_trickles_its_answer_times_out_within_the_bound():
    """One byte every 0.2 s never trips a receive's 0.5 s timeout, but a whole answer
    must come within 4 x 0.5 s."""
    import time
    listener = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            try:
                for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 100:
                    conn.sendall(bytes([byte]))
                    time.sleep(0.2)
            except OSError:
                pass  # the client gave up
        listener.close()

    threading.Thread(target=run, daemon=True).start()
    conn = Connection("127.0.0.1", listener.getsockname()[1], 0.5)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="more than 2 s"):
        conn.post("/v3/kv/range", b"{}")
    assert 1.9 < time.monotonic() - started < 3.0 and conn.sock is None
