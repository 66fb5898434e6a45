"""The manager's box heartbeat against boxes that answer well, not at all, or by the byte
(fake boxes on loopback, plaintext; the store is a temporary database)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from dxpu_vfio.link.protocol import LinkCommand
from dxpu_vfio.pool.manager import Manager
from dxpu_vfio.pool.store import Store
from dxpu_vfio.vfio_user import protocol as vp


class FakeBox:
    """``answer``: "well" (a real inventory), "never" (accepts, stays silent) or "trickle"
    (a reply header, then one byte every 0.2 s: each read gets something before its timeout)."""

    def __init__(self, name: str, answer: str) -> None:
        self.name, self.answer = name, answer
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.stop = threading.Event()
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.recv(4096)
            if self.answer == "well":
                body = json.dumps({"box": self.name, "version": 1, "devices": []}).encode()
                conn.sendall(vp.message(1, LinkCommand.INVENTORY, body, reply=True))
            elif self.answer == "trickle":
                reply = vp.message(1, LinkCommand.INVENTORY, b" " * 4000, reply=True)
                conn.sendall(reply[:vp.HEADER_SIZE])
                for byte in reply[vp.HEADER_SIZE:]:
                    if self.stop.wait(0.2):
                        return
                    conn.sendall(bytes([byte]))
            self.stop.wait()
        except OSError:
            pass

    def close(self) -> None:
        self.stop.set()
        self.listener.close()
        for conn in self.conns:
            conn.close()


@pytest.fixture
def boxes(tmp_path):
    store = Store(tmp_path / "pool.db")
    fakes = [FakeBox("a-trickles", "trickle"), FakeBox("b-dead", "never"), FakeBox("c-well", "well")]
    for fake in fakes:
        store.register_box(fake.name, fake.address, None, [], None)
    yield store, fakes
    for fake in fakes:
        fake.close()
    store.close()


def test_a_trickling_box_keeps_no_dead_box_up(boxes):
    store, _ = boxes
    manager = Manager(store, dead_after=1.0)
    states = lambda: {b["name"]: b["state"] for b in store.boxes()}  # noqa: E731
    rounds: list[float] = []
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            started = time.monotonic()
            manager.heartbeat()
            rounds.append(time.monotonic() - started)
            stop.wait(0.2)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        # the round judges each box as its probe ends, in whatever order they end: wait
        # for both verdicts, not just the first
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline and "up" in (states()["b-dead"], states()["a-trickles"]):
            time.sleep(0.1)
        assert states()["b-dead"] == "down", f"the dead box stayed up for 6 s (dead-after 1 s): {states()}"
        assert states()["a-trickles"] == "down", "a box that never finishes its answer counts as up"
        assert states()["c-well"] == "up"
        assert "did not answer" in {b["name"]: b for b in store.boxes()}["a-trickles"]["last_error"]
    finally:
        stop.set()
        thread.join(6)
    assert rounds and max(rounds) < 3.5, f"heartbeat rounds took {rounds} s: a probe is not bounded"
