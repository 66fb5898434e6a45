"""The box's reader waits in C and serves register accesses there (native/serve.c with a
wake_fd), leaving everything else, in order, for the Python reader; while a thread reads
the stream for itself (hold_serving) it serves nothing, so a request that thread leaves
to the Python reader is never overtaken by a later one."""

from __future__ import annotations

import os
import struct

import pytest
from fakes import host_and_box_streams

from dxpu_vfio.link.protocol import LinkCommand
from dxpu_vfio.native import stream as native
from dxpu_vfio.vfio_user import protocol as vp

ACCESS = struct.Struct("<QII")  # offset, region, count: vfio-user's REGION_READ/WRITE head


@pytest.fixture
def link():
    """(the host's Python end, the box's native stream, a wake pipe)."""
    host, box = host_and_box_streams()
    wake_r, wake_w = os.pipe()
    yield host, box, wake_r, wake_w
    host.close()
    box.close()
    os.close(wake_r)
    os.close(wake_w)


class Device:
    """Register callbacks as the box's proxy gives them (RemoteProxy._region_access)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def read(self, region: int, offset: int, count: int):
        self.calls.append(("read", offset))
        return offset.to_bytes(4, "little")[:count].ljust(count, b"\0")

    def write(self, region: int, offset: int, data: bytes, posted: bool):
        self.calls.append(("write", offset, bytes(data)))
        return None


def wait_serving(box, dev: Device, wake_r: int, timeout: float = 2.0):
    return native.require().serve_requests(box.stream, dev.read, dev.write, timeout, None, None, wake_r)


def test_it_serves_register_accesses_and_leaves_the_first_other_message_in_place(link):
    host, box, wake_r, _ = link
    dev = Device()
    host.send_message(1, LinkCommand.REGION_READ, vp.TYPE_COMMAND, ACCESS.pack(0x10, 0, 4))
    host.send_message(2, LinkCommand.REGION_WRITE, vp.TYPE_COMMAND | vp.FLAG_NO_REPLY,
                      ACCESS.pack(0x20, 0, 4) + b"abcd")
    host.send_message(7, LinkCommand.DMA_READ, vp.TYPE_REPLY, b"completion")  # Python's
    host.send_message(3, LinkCommand.REGION_READ, vp.TYPE_COMMAND, ACCESS.pack(0x30, 0, 4))
    assert wait_serving(box, dev, wake_r) is True
    assert dev.calls == [("read", 0x10), ("write", 0x20, b"abcd")]
    reply = host.receive()
    assert (reply.header.msg_id, bytes(reply.payload[16:])) == (1, (0x10).to_bytes(4, "little"))
    left = box.receive(timeout=0)  # still buffered, for the Python reader, before what follows
    assert (left.header.msg_id, bytes(left.payload)) == (7, b"completion")
    assert wait_serving(box, dev, wake_r, timeout=0.2) is None  # served, then nothing more came
    assert dev.calls[-1] == ("read", 0x30)
    assert host.receive().header.msg_id == 3


def test_a_wake_up_returns_false_and_stays_for_the_caller_and_a_quiet_link_times_out(link):
    host, box, wake_r, wake_w = link
    dev = Device()
    os.write(wake_w, b"w")
    assert wait_serving(box, dev, wake_r) is False
    assert os.read(wake_r, 64) == b"w"  # not drained by C: the caller's loop reads it
    assert wait_serving(box, dev, wake_r, timeout=0.05) is None
    assert dev.calls == []


def test_while_a_thread_reads_for_itself_nothing_is_served_here(link):
    host, box, wake_r, _ = link
    dev = Device()
    native.require().hold_serving(box.stream, True)
    host.send_message(1, LinkCommand.REGION_WRITE, vp.TYPE_COMMAND | vp.FLAG_NO_REPLY,
                      ACCESS.pack(0x40, 0, 4) + b"doorbell"[:4])
    host.send_message(2, LinkCommand.REGION_WRITE, vp.TYPE_COMMAND | vp.FLAG_NO_REPLY,
                      ACCESS.pack(0x44, 0, 4) + b"next")
    assert wait_serving(box, dev, wake_r) is True and dev.calls == []
    first = box.receive(timeout=5)  # the reading thread takes it (and may leave it to Python)
    assert first.header.msg_id == 1
    assert wait_serving(box, dev, wake_r) is True and dev.calls == []  # the second waits its turn too
    native.require().hold_serving(box.stream, False)
    assert wait_serving(box, dev, wake_r, timeout=0.2) is None
    assert dev.calls == [("write", 0x44, b"next")]


def test_a_peer_that_closes_ends_the_wait_with_an_error(link):
    host, box, wake_r, _ = link
    host.close()
    with pytest.raises(native.require().Closed):
        wait_serving(box, Device(), wake_r)
