"""Issue 18 item 3: a host that stops reading must not hold a box's device. The box applies
the host's dead-after rule whatever its own send side is doing: silent hosts, hosts that
flood reads and never take the completions, and hosts that let the device's DMA writes
pile up all lose the device within dead-after (plus a margin), and the next host gets it.
An in-process plaintext box on loopback and a raw fake host; both link streams."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from dxpu_vfio.link.protocol import Hello, LinkCommand, hello_proof, unpack_challenge
from dxpu_vfio.native import stream as native
from dxpu_vfio.remoteproxy.config import BoxConfig, BoxDevice
from dxpu_vfio.remoteproxy.proxy import RemoteProxy
from dxpu_vfio.vfio_user import protocol as vp
from dxpu_vfio.vfio_user.connection import Connection, ConnectionClosed

DEAD_AFTER = 1.0
MARGIN = 1.5  # the heartbeat period, a thread join, a loaded CI machine


@pytest.fixture(params=["native", "python"])
def box(request, monkeypatch):
    if request.param == "native" and not native.built():
        pytest.fail("the native stream is not built: run scripts/setup.sh")
    monkeypatch.setenv("DXPU_FASTLINK", "1" if request.param == "native" else "0")
    proxy = RemoteProxy(BoxConfig("box1", "127.0.0.1", 0, [BoxDevice("td0", "testdev", "t",
                                                                     {"memory_size": 1 << 20})],
                                  plaintext=True, dead_after=DEAD_AFTER, heartbeat=0.1)).start()
    yield proxy
    proxy.stop()


def hello(port: int) -> tuple[socket.socket, Connection, bool]:
    """A host's HELLO for td0: (socket, connection, whether the box gave it the device)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once when we stop reading
    conn = Connection(sock)
    sock.settimeout(5)
    conn.send(vp.message(1, LinkCommand.HELLO, Hello("td0").pack()))  # HELLO, challenge, HELLO with proof
    reply = conn.receive()
    if not reply.header.is_error:
        nonce = unpack_challenge(reply.payload)
        conn.send(vp.message(2, LinkCommand.HELLO, Hello("td0", nonce, hello_proof("t", "td0", nonce)).pack()))
        reply = conn.receive()
    sock.settimeout(None)
    return sock, conn, not reply.header.is_error


def flood_reads(conn: Connection, stop: threading.Event) -> None:
    """1 MiB reads of BAR2, never reading a completion."""
    request = vp.RegionAccess(2, 0, 1 << 20).pack()
    i = 0
    while not stop.is_set():
        try:
            conn.send(vp.message(i & 0x7FFF, LinkCommand.REGION_READ, request))
        except (ConnectionClosed, OSError):
            return
        i += 1


def dma_fills(conn: Connection, stop: threading.Event) -> None:
    """Bus master on, then 1 MiB DMA fills towards the host, one after the other (the box
    ignores a fill while one runs): posted DMA writes we never read. The host keeps
    talking, so only the box's bounded sends can tell it is dead."""
    conn.send(vp.message(2, LinkCommand.REGION_WRITE, vp.RegionAccess(vp.REGION_CONFIG, 4, 2, b"\x06\x00").pack()))
    regs = ((0x28, 0x100000), (0x2C, 0), (0x30, 1 << 20))  # DMA_DST, DMA_LEN
    fill = (0x34, 2 | 0x5A << 8)  # DMA_CMD: fill with 0x5a
    try:
        for reg, value in regs:
            conn.send(vp.message(3, LinkCommand.REGION_WRITE,
                                 vp.RegionAccess(0, reg, 4, value.to_bytes(4, "little")).pack(), no_reply=True))
        while not stop.wait(0.02):
            conn.send(vp.message(4, LinkCommand.REGION_WRITE,
                                 vp.RegionAccess(0, fill[0], 4, fill[1].to_bytes(4, "little")).pack(), no_reply=True))
    except (ConnectionClosed, OSError):
        return


@pytest.mark.parametrize("host", ["silent", "floods-reads", "dma-piles-up"])
def test_a_host_that_stops_reading_loses_the_device_within_dead_after(box, host):
    sock, conn, got = hello(box.port)
    assert got
    first, first_dma = box.slots["td0"].endpoint, box.slots["td0"].dma
    stop = threading.Event()
    started = time.monotonic()
    if host == "floods-reads":
        threading.Thread(target=flood_reads, args=(conn, stop), daemon=True).start()
    elif host == "dma-piles-up":
        threading.Thread(target=dma_fills, args=(conn, stop), daemon=True).start()
    try:
        others = []
        while True:
            other = hello(box.port)
            others.append(other)
            if other[2]:
                break
            assert time.monotonic() - started < DEAD_AFTER + MARGIN, \
                f"the device is still busy {DEAD_AFTER + MARGIN} s after its host stopped reading"
            time.sleep(0.05)
        assert not first.up, "a second host got the device while the first link is up"
        if host == "floods-reads":  # the box was answering (sending) when the host went dead
            assert first.stats()["handled"]["REGION_READ"]["count"] >= 1
        elif host == "dma-piles-up":
            assert first_dma.bytes_written >= 1 << 18
    finally:
        stop.set()
        sock.close()
        for s, _, _ in others:
            s.close()
