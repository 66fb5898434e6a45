"""The remote proxy's door: slow-loris peers, crowds of unauthenticated connections and
accept() errors must never make a box stop serving (plaintext boxes on loopback)."""

from __future__ import annotations

import re
import resource
import socket
import subprocess
import sys
import time

import pytest

from dxpu_vfio.link.protocol import LinkCommand
from dxpu_vfio.pool.boxes import fetch_inventory
from dxpu_vfio.remoteproxy.config import BoxConfig, BoxDevice
from dxpu_vfio.remoteproxy.proxy import RemoteProxy
from dxpu_vfio.vfio_user import protocol as vp


@pytest.fixture
def box():
    proxy = RemoteProxy(BoxConfig("box1", "127.0.0.1", 0, [BoxDevice("td0", "testdev", "t")], plaintext=True))
    proxy.admission.handshake_timeout = 0.5
    proxy.max_admitting = 8
    proxy.start()
    yield proxy
    proxy.stop()


def held(socks: list[socket.socket]) -> int:
    """How many of these connections the box still keeps open."""
    n = 0
    for s in socks:
        s.settimeout(0.05)
        try:
            n += s.recv(1) != b""
        except TimeoutError:
            n += 1
        except OSError:
            pass
    return n


def test_idle_connections_are_bounded_in_number_and_time(box):
    idle = [socket.create_connection(("127.0.0.1", box.port)) for _ in range(40)]
    try:
        time.sleep(0.2)
        assert held(idle) <= 8, "the box admits any number of unauthenticated connections at once"
        assert box.refused["crowd"] >= 1
        time.sleep(0.8)  # past the handshake deadline
        assert held(idle) == 0, "silent connections outlived the handshake deadline"
    finally:
        for s in idle:
            s.close()
    assert fetch_inventory(f"127.0.0.1:{box.port}", None)["box"] == "box1"


def test_a_trickled_first_message_is_cut_at_the_deadline(box):
    with socket.create_connection(("127.0.0.1", box.port)) as s:
        started = time.monotonic()
        closed = False
        hello = vp.message(1, LinkCommand.HELLO, b"{}" + b" " * 1000)
        for byte in hello:  # one byte every 0.1 s: each read gets something before its timeout
            try:
                s.sendall(bytes([byte]))
                time.sleep(0.1)
                closed = s.recv(1, socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                continue
            except OSError:
                closed = True
            if closed:
                break
        assert closed and time.monotonic() - started < 2.0, "a trickling peer held its admission for 5 s"
    assert box.refused["hello"] >= 1



def test_the_accept_loop_survives_running_out_of_descriptors(tmp_path):
    config = tmp_path / "box.toml"
    config.write_text('name = "box1"\nlisten = "127.0.0.1"\nport = 0\nplaintext = true\n'
                      '[[device]]\nid = "td0"\nmodel = "testdev"\nlease = "t"\n')
    limit = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (24, 24))  # noqa: E731
    proc = subprocess.Popen([sys.executable, "-m", "dxpu_vfio.remoteproxy", "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=limit)
    crowd: list[socket.socket] = []
    try:
        line = proc.stdout.readline()
        port = int(re.search(r"127\.0\.0\.1:(\d+)", line).group(1))
        for _ in range(40):  # more than it has descriptors for
            try:
                crowd.append(socket.create_connection(("127.0.0.1", port), timeout=0.5))
            except OSError:
                pass  # the backlog is full
        time.sleep(0.5)
        assert proc.poll() is None
        for s in crowd:
            s.close()
        crowd = []
        deadline = time.monotonic() + 10
        while True:  # after the crowd left, the box serves again
            try:
                assert fetch_inventory(f"127.0.0.1:{port}", None, timeout=1.0)["box"] == "box1"
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    finally:
        for s in crowd:
            s.close()
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
    assert "accept() failed" in out, out[-2000:]
    assert "Traceback" not in out, out[-4000:]


@pytest.mark.parametrize("command, payload", [
    (LinkCommand.HELLO, b"[" * 100_000 + b"]" * 100_000),
    (LinkCommand.SCREENSHOT, b'{"device": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
])
def test_a_first_message_of_json_nested_too_deep_is_refused_and_the_box_serves_on(box, command, payload, monkeypatch):
    """Found by scripts/fuzz.py: a RecursionError killed the admission thread (a traceback)."""
    import threading
    died: list = []
    monkeypatch.setattr(threading, "excepthook", died.append)
    with socket.create_connection(("127.0.0.1", box.port)) as s:
        s.sendall(vp.message(1, command, payload))
        s.settimeout(3)
        data = s.recv(65536)
        while data and len(data) < 16:
            data += s.recv(65536)
    assert data == b"" or vp.Header.unpack(data).is_error  # refused: an error reply, or closed
    time.sleep(0.2)
    assert not died, [str(d.exc_value)[:200] for d in died]
    assert fetch_inventory(f"127.0.0.1:{box.port}", None)["box"] == "box1"
