"""The manager's API and metrics listeners against bad requests and idle or slow peers
(a manager served in-process on a temporary database; no boxes, no VMs)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import pytest

from dxpu_vfio.pool import service
from dxpu_vfio.pool.bounds import BoundedServer
from dxpu_vfio.pool.service import ManagerClient, ManagerError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def manager(tmp_path, monkeypatch):
    monkeypatch.setattr(BoundedServer, "request_deadline", 1.0)
    monkeypatch.setattr(service._MetricsHttpServer, "max_connections", 4)
    db, port = tmp_path / "pool.db", free_port()
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=service.serve, args=(db,),
                              kwargs={"heartbeat": 0.2, "metrics_address": f"127.0.0.1:{port}",
                                      "ready": ready, "stop": stop}, daemon=True)
    thread.start()
    assert ready.wait(20), "the manager did not start"
    yield ManagerClient(db, timeout=10), port
    stop.set()
    thread.join(10)


def http_on(path: str | tuple, head: bytes, timeout: float = 5.0) -> tuple[int, bytes]:
    family = socket.AF_UNIX if isinstance(path, str) else socket.AF_INET
    with socket.socket(family) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(head)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1]) if data else 0
    return status, data.partition(b"\r\n\r\n")[2]


@pytest.mark.parametrize("route, body, named", [
    ("/v1/attach", {"vm": ["a", "b"]}, "'vm'"),
    ("/v1/attach", {"vm": "x", "count": "many"}, "'count'"),
    ("/v1/attach", {"vm": "x", "count": True}, "'count'"),
    ("/v1/attach", {"vm": "x", "class": {"nvme": 1}}, "'class'"),
    ("/v1/detach", {"vm": "x", "all": "yes"}, "'all'"),
    ("/v1/boxes", {"address": True}, "'address'"),
    ("/v1/boxes", {"address": "10.0.0.1:7000", "tls_dir": False}, "'tls_dir'"),
    ("/v1/boxes/remove", {"name": 7}, "'name'"),
    ("/v1/boxes", {}, "missing field 'address'"),
])
def test_wrong_field_types_are_answered_400_naming_the_field(manager, route, body, named):
    client, _ = manager
    with pytest.raises(ManagerError) as exc:
        client.request("POST", route, body)
    assert exc.value.status == 400 and named in exc.value.message
    assert client.get("/v1/health")["db"]  # and the service still answers


@pytest.mark.parametrize("address", ["10.0.0.1:" + "9" * 30, "10.0.0.1:70000", "10.0.0.1:0", "10.0.0.1:\u0667\u0660",
                                     ":7000", "10.0.0.1"])
def test_a_box_address_with_a_bad_port_is_refused_by_name(manager, address):
    """Found by scripts/fuzz.py (manager, seed 2766665206): a 30-digit port reached the
    resolver, whose OverflowError became a 500."""
    client, _ = manager
    with pytest.raises(ManagerError) as exc:
        client.request("POST", "/v1/boxes", {"address": address})
    assert "bad box address" in exc.value.message and "HOST:PORT" in exc.value.message, exc.value.message
    assert exc.value.status != 500
    assert client.get("/v1/health")["db"]


def test_a_large_body_is_refused_before_it_is_read_and_the_token_checked_first(manager):
    client, _ = manager
    sock = str(client.paths.socket)
    started = time.monotonic()
    huge = b"POST /v1/attach HTTP/1.1\r\nContent-Length: 805306368\r\n"
    status, _ = http_on(sock, huge + b"Authorization: Bearer wrong\r\n\r\n")
    assert status == 401
    status, body = http_on(sock, huge + f"Authorization: Bearer {client._token()}\r\n\r\n".encode())
    assert status == 413 and b"65536" in body
    assert time.monotonic() - started < 3, "the manager waited for a body it should not read"


def test_idle_metrics_connections_are_bounded_in_number_and_time(manager):
    _, port = manager
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(12)]
    try:
        time.sleep(0.3)
        held = 0
        for s in idle:
            s.settimeout(0.1)
            try:
                held += s.recv(1) != b""
            except TimeoutError:
                held += 1
        assert held <= 4, f"{held} idle connections held (the limit is 4)"
        time.sleep(1.5)  # past the request deadline: the server closed them all
        for s in idle:
            s.settimeout(1.0)
            assert s.recv(1) == b""
    finally:
        for s in idle:
            s.close()
    status, body = http_on(("127.0.0.1", port), b"GET /metrics HTTP/1.0\r\n\r\n")
    assert status == 200 and b"dxpu_devices" in body


def test_a_slow_request_is_cut_at_the_deadline(manager):
    client, _ = manager
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(client.paths.socket))
        s.settimeout(3)
        started = time.monotonic()
        try:
            for _ in range(30):  # one header byte every 0.1 s: never a whole request
                s.sendall(b"X")
                time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert time.monotonic() - started < 2.5, "a trickled request held its connection past the deadline"
    assert json.loads(json.dumps(client.get("/v1/health")))["pid"]


# --- what the client makes of a manager's answers (a manager of another version, or
# something else on its socket): a ManagerError that quotes it, never a decoder's error ---
@contextlib.contextmanager
def fake_manager(db, answer: bytes, count: int = 1):
    """A fake manager on ``db``'s socket: reads each of ``count`` whole requests (head and
    Content-Length body, so the client's send never meets a closed socket) and sends
    ``answer`` to each."""
    db.with_suffix(".token").write_text("t0k\n")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(db.with_suffix(".sock")))
        listener.listen(4)
        listener.settimeout(30)

        def serve():
            for _ in range(count):
                conn, _ = listener.accept()
                with conn:
                    data = b""
                    while b"\r\n\r\n" not in data:
                        data += conn.recv(65536)
                    head, _, body = data.partition(b"\r\n\r\n")
                    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length:")), 0)
                    while len(body) < length:
                        body += conn.recv(65536)
                    conn.sendall(answer)
        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        yield
        thread.join(10)


@pytest.mark.parametrize("status, kind, body, says", [
    (200, "application/json", b"{", "with no JSON"),
    (200, "application/json", b"[" * 100_000 + b"]" * 100_000, "with no JSON"),  # past the parser's stack
    (200, "application/json", b'"ok"', "JSON that is neither an object nor a list"),
    (200, "text/plain", b"\xff\xfe", "text that is not UTF-8"),
    (409, "application/json", b'["NoFreeDevice"]', '["NoFreeDevice"]'),  # an error answer of another shape
    (409, "application/json", b'{"message": 7, "hint": ["x"], "logs": "/tmp/x"}', "HTTP 409"),
])
def test_a_manager_answer_the_client_cannot_read_is_a_manager_error(tmp_path, status, kind, body, says):
    db = tmp_path / "pool.db"
    reason = {200: "OK", 409: "Conflict"}[status]
    answer = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
              f"Connection: close\r\n\r\n").encode() + body
    with fake_manager(db, answer), pytest.raises(ManagerError) as caught:
        ManagerClient(db, timeout=5).post("/v1/attach", vm="qmp:/x")
    assert caught.value.status == status and says in str(caught.value)
    if status == 200:
        assert "the manager answered POST /v1/attach" in str(caught.value) and caught.value.hint


def test_the_manager_answers_fuzz_target_catches_the_client_before_it_checked(tmp_path):
    """The client's reading before it checked, put back in the fuzz target: found. The
    target itself runs in test_fuzz.py."""
    import dataclasses

    from dxpu_vfio.fuzz import manager_answers
    from dxpu_vfio.fuzz.readers import ReaderTarget
    from dxpu_vfio.fuzz.runner import Run

    def trusting(text):
        head, _, body = text.partition("\n")
        word, _, kind = head.partition(" ")
        data = body.encode()
        if word == "200":
            return data if kind == "image/png" else data.decode() if kind.startswith("text/") else json.loads(data)
        try:
            err = json.loads(data)
        except ValueError:
            err = {"message": data.decode(errors="replace")}
        raise ManagerError(err.get("message", "HTTP"), kind=err.get("error", "ManagerError"), hint=err.get("hint"),
                           logs=err.get("logs"))

    readers = tuple(dataclasses.replace(r, read=trusting) for r in manager_answers.target().readers)
    result = Run(ReaderTarget("manager-answers", readers), seed=3, stop=400, check_every=50, out=tmp_path).execute()
    assert result.violations > 0, [f.detail[:200] for f in result.findings]


@pytest.mark.parametrize("words, answer, says", [
    (("ls",), {"boxes": []}, "lacks what dxpu ls prints (KeyError: 'devices')"),
    (("host", "ls"), [{"name": "h1"}], "lacks what dxpu host ls prints (KeyError: 'alive')"),
    (("detach", "qmp:/x", "--all"), {"detached": 1}, "lacks what dxpu detach prints"),
    (("screenshot", "--pool", "box1/fb0", "shot.png"), {"png": "no"}, "with no PNG"),
])
def test_dxpu_says_what_a_manager_of_another_version_left_out_and_json_prints_it(tmp_path, words, answer, says):
    """The real ``dxpu`` against a fake manager whose 200 answers lack the fields the text
    is made of: exit 1 with an error naming what was missing and how to see the answer
    (``--json``), no traceback; with ``--json`` the answer as it came."""
    import subprocess
    import sys

    db = tmp_path / "pool.db"
    body = json.dumps(answer).encode()
    reply = (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
             f"Connection: close\r\n\r\n").encode() + body
    with fake_manager(db, reply, count=2):
        run = [sys.executable, "-m", "dxpu_vfio.cli", *words, "--db", str(db)]
        text = subprocess.run(run, capture_output=True, text=True, timeout=60, cwd=tmp_path)
        as_json = subprocess.run([*run, "--json"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert text.returncode == 1 and says in text.stderr and "Traceback" not in text.stderr, text.stderr
    assert "manager of another version" in text.stderr
    if words[0] != "screenshot":
        assert as_json.returncode == 0 and json.loads(as_json.stdout) == answer, as_json.stderr


@pytest.mark.parametrize("kind, body, quoted", [
    ("image/png", b"<html>not an image</html>", "<html>not an image"),  # labelled PNG, something else
    ("application/json", b'{"png": "no"}', "{'png': 'no'}"),
])
def test_a_screenshot_that_is_no_png_is_refused_before_anything_is_written(tmp_path, kind, body, quoted):
    """``dxpu screenshot --pool`` writes what the manager sent to a .png file: an answer
    without PNG's signature (however it was labelled) is a ManagerError quoting it, so
    nothing is written; a PNG is handed on as it came."""
    db = tmp_path / "pool.db"
    reply = (f"HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
             f"Connection: close\r\n\r\n").encode() + body
    with fake_manager(db, reply):
        with pytest.raises(ManagerError, match="with no PNG") as exc:
            ManagerClient(db).screenshot("box1/fb0")
    assert "another version" in exc.value.hint and quoted in str(exc.value)
    png = b"\x89PNG\r\n\x1a\n" + b"\0" * 32
    reply = (f"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: {len(png)}\r\n"
             f"Connection: close\r\n\r\n").encode() + png
    with fake_manager(tmp_path / "pool2.db", reply):
        assert ManagerClient(tmp_path / "pool2.db").screenshot("box1/fb0") == png
