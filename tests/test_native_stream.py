"""The native link stream (dxpu_vfio/native/fastlink.c) on its own: framing, TLS
against Python's ssl on the other end, bounded waits, and bytes that are not messages.
Real sockets on loopback; the C module must be built (scripts/setup.sh builds it)."""

import array
import os
import random
import socket
import ssl
import threading
import time

import pytest

from dxpu_vfio.native import stream as native_stream
from dxpu_vfio.link.transport import TlsFiles, accept_native, client_context, make_certs, server_context
from dxpu_vfio.vfio_user import protocol as vp
from dxpu_vfio.vfio_user.connection import Connection, ConnectionClosed, ReceiveTimeout


@pytest.fixture(scope="module", autouse=True)
def _built():
    if not native_stream.built():
        pytest.fail("the native link stream is not built: run scripts/setup.sh")


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    make_certs(d, ["host", "box"])
    return d


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    return client, server


def native_pair(certs=None):
    """(native client, native server); TLS when certs is given (handshakes run concurrently)."""
    a, b = tcp_pair()
    out = {}
    server = threading.Thread(target=lambda: out.update(server=accept_native(
        b, TlsFiles.in_dir(certs, "box") if certs else None, 5.0)))
    server.start()
    client = native_stream.tcp(a, TlsFiles.in_dir(certs, "host") if certs else None, server=False,
                                 handshake_timeout=5.0)
    server.join(10)
    return client, out["server"]


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
def test_messages_of_every_size_arrive_whole_and_in_order(certs, tls):
    client, server = native_pair(certs if tls else None)
    sizes = [0, 1, 15, 16, 4095, 16384, 65536 - 16, 65536, 300_000, vp.MAX_DATA_XFER]
    payloads = [bytes((i + n) % 251 for i in range(n)) for n in sizes]

    def send():
        for i, data in enumerate(payloads):
            if i % 2:
                client.send_message(i, 9, vp.TYPE_COMMAND, (data[:7], data[7:]))  # in parts
            else:
                client.send(vp.message(i, 9, data))  # framed by the caller

    sender = threading.Thread(target=send)
    sender.start()
    for i, data in enumerate(payloads):
        msg = server.receive(timeout=10)
        assert (msg.header.msg_id, msg.header.command, msg.header.size) == (i, 9, 16 + len(data))
        assert bytes(msg.payload) == data
    sender.join(10)
    assert server.stats()["messages_in"] == len(payloads)
    client.close()
    server.close()


def test_native_client_and_python_ssl_server_talk_tls(certs):
    a, b = tcp_pair()
    result = {}

    def python_server():
        tls = server_context(TlsFiles.in_dir(certs, "box")).wrap_socket(b, server_side=True)
        conn = Connection(tls)
        msg = conn.receive()
        conn.send(vp.message(msg.header.msg_id, msg.header.command, bytes(msg.payload[::-1]), reply=True))
        result["ok"] = True
        conn.close()

    thread = threading.Thread(target=python_server)
    thread.start()
    client = native_stream.tcp(a, TlsFiles.in_dir(certs, "host"), server=False, handshake_timeout=5.0)
    client.send_message(7, vp.Command.REGION_READ, vp.TYPE_COMMAND, b"abc")
    reply = client.receive(timeout=5)
    assert reply.header.is_reply and bytes(reply.payload) == b"cba"
    thread.join(5)
    assert result == {"ok": True}
    client.close()


def test_python_ssl_client_and_native_server_talk_tls(certs):
    a, b = tcp_pair()
    out = {}
    thread = threading.Thread(target=lambda: out.update(conn=accept_native(b, TlsFiles.in_dir(certs, "box"), 5.0)))
    thread.start()
    tls = client_context(TlsFiles.in_dir(certs, "host")).wrap_socket(a)
    thread.join(5)
    py = Connection(tls)
    py.send(vp.message(3, 4, b"hello"))
    msg = out["conn"].receive(timeout=5)
    assert bytes(msg.payload) == b"hello"
    out["conn"].send_message(3, 4, vp.TYPE_REPLY, b"world")
    assert bytes(py.receive().payload) == b"world"
    py.close()
    out["conn"].close()


def test_a_certificate_from_another_ca_is_refused(certs, tmp_path):
    make_certs(tmp_path / "other", ["host"])
    a, b = tcp_pair()
    errors = []

    def server():
        try:
            accept_native(b, TlsFiles.in_dir(certs, "box"), 5.0)
        except ConnectionClosed as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=server)
    thread.start()
    with pytest.raises((ConnectionClosed, ssl.SSLError, OSError)):
        conn = native_stream.tcp(a, TlsFiles.in_dir(tmp_path / "other", "host"), server=False, handshake_timeout=5.0)
        conn.receive(timeout=2)  # TLS 1.3: the client may learn of the refusal only here
    thread.join(10)
    assert errors and "TLS handshake" in errors[0]  # the box refused the link


def test_a_silent_peer_cannot_hold_the_handshake(certs):
    a, b = tcp_pair()  # nobody speaks TLS on `a`
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        accept_native(b, TlsFiles.in_dir(certs, "box"), 0.3)
    assert time.monotonic() - started < 2
    a.close()


def test_receive_timeout_keeps_a_partial_message_for_the_next_call():
    client, server = native_pair()
    framed = vp.message(1, 9, b"x" * 100)
    client.send(framed[:20])
    with pytest.raises(ReceiveTimeout):
        server.receive(timeout=0.05)
    client.send(framed[20:])
    assert bytes(server.receive(timeout=5).payload) == b"x" * 100
    client.close()
    server.close()


class RecordClient:
    """A TLS client whose records the test writes to the socket itself, in any pieces:
    Python's ssl on memory BIOs, against a native server stream."""

    def __init__(self, certs) -> None:
        self.sock, server_sock = tcp_pair()
        out: dict = {}
        accept = threading.Thread(target=lambda: out.update(conn=accept_native(
            server_sock, TlsFiles.in_dir(certs, "box"), 5.0)))
        accept.start()
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = client_context(TlsFiles.in_dir(certs, "host")).wrap_bio(self.incoming, self.outgoing)
        self.sock.settimeout(5)
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self.sock.sendall(self.outgoing.read())
                self.incoming.write(self.sock.recv(65536))
        self.sock.sendall(self.outgoing.read())  # the client's Finished
        accept.join(10)
        self.server = out["conn"]

    def records(self, *messages: bytes) -> bytes:
        """The TLS records of ``messages`` (one write each), not yet sent."""
        for msg in messages:
            self.tls.write(msg)
        return self.outgoing.read()

    def close(self) -> None:
        self.sock.close()
        self.server.close()


def test_part_of_a_tls_record_is_not_pending_so_a_waiting_reader_sleeps_instead_of_spinning(certs):
    """Read ahead hides whole records from poll(2), so a reader asks the stream what it holds
    before it sleeps. Part of a record cannot become data without the socket: reported as
    pending, the host's forwarder spun on read(2) (61 EAGAINs in a row) on the CPU the box
    needed to send the rest. Whole records behind a message are still pending."""
    client = RecordClient(certs)
    try:
        record = client.records(vp.message(1, 9, b"r" * 8000))
        client.sock.sendall(record[:3000])
        with pytest.raises(ReceiveTimeout):
            client.server.receive(timeout=0.05)
        assert not client.server.pending(), "part of a record reported as readable without the socket"
        started = time.monotonic()
        assert not client.server.readable(0.1), "a wait for the rest of a record returned at once"
        assert time.monotonic() - started >= 0.09
        client.sock.sendall(record[3000:])
        assert bytes(client.server.receive(timeout=5).payload) == b"r" * 8000

        client.sock.sendall(client.records(vp.message(2, 9, b"a" * 100), vp.message(3, 9, b"b" * 100)))
        assert client.server.receive(timeout=5).header.msg_id == 2
        assert client.server.has_message() or client.server.pending(), "a whole record behind it was hidden"
        assert client.server.receive(timeout=0).header.msg_id == 3
    finally:
        client.close()


def test_a_pass_sized_send_leaves_in_slices_and_others_in_one_write(certs):
    """A 256 KiB message (a copy's DMA completion, an accelerator's input pushed with its
    doorbell) leaves in 32 KiB slices, so the peer opens the first while the rest is sealed;
    one of 96 KiB is one write, and a corked one still holds its last slice for the uncork."""
    client, server = native_pair(certs)
    try:
        rng = random.Random(7)
        for size, writes in ((96 << 10, 1), (256 << 10, 8), ((256 << 10) + 100, 8)):
            data = rng.randbytes(size)
            before = client.stats()["writes"]
            client.send_message(size & 0xFFFF, 9, vp.FLAG_NO_REPLY, data)
            assert client.stats()["writes"] - before == writes, size
            assert bytes(server.receive(timeout=5).payload) == data
        client.cork()
        before = client.stats()["writes"]
        client.send_message(1, 9, vp.FLAG_NO_REPLY, rng.randbytes(256 << 10))
        assert client.stats()["writes"] - before == 7, "the last slice waits for the uncork"
        client.uncork()
        assert client.stats()["writes"] - before == 8 and len(server.receive(timeout=5).payload) == 256 << 10
    finally:
        client.close()


def test_writes_count_the_system_calls_that_sent_bytes(certs):
    """``writes`` counts write(2)s, each of which wakes the peer's reader: a corked thread's
    two posted messages and the request after them leave in one."""
    client, server = native_pair(certs)
    before = client.stats()["writes"]
    client.send_message(1, 9, vp.TYPE_COMMAND, b"one")
    assert client.stats()["writes"] == before + 1
    client.cork()
    client.send_message(2, 9, vp.FLAG_NO_REPLY, b"posted")
    client.send_message(3, 9, vp.FLAG_NO_REPLY, b"posted")
    client.send_message(4, 9, vp.TYPE_COMMAND, b"request")
    assert client.stats()["writes"] == before + 2
    client.uncork()
    assert client.stats()["writes"] == before + 2, "uncork with nothing held wrote"
    assert [server.receive(timeout=5).header.msg_id for _ in range(4)] == [1, 2, 3, 4]
    client.close()
    server.close()


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
def test_a_large_message_survives_a_timeout_inside_it_and_takes_nothing_behind_it(certs, tls):
    """A DMA completion's size (300 KB) arriving in two sends with a receive timeout between:
    the part that came stays buffered, and the message behind it in the same send is
    neither taken with it nor lost; a peer that dies inside one is reported."""
    client, server = native_pair(certs if tls else None)
    big = os.urandom(300_000)
    framed = vp.message(1, 9, big)
    client.send(framed[:100_000])
    with pytest.raises(ReceiveTimeout):
        server.receive(timeout=0.1)
    client.send(framed[100_000:] + vp.message(2, 9, b"behind"))
    msg = server.receive(timeout=5)
    assert (msg.header.msg_id, bytes(msg.payload)) == (1, big)
    msg = server.receive(timeout=5)
    assert (msg.header.msg_id, bytes(msg.payload)) == (2, b"behind")
    assert not server.has_message() and server.stats()["messages_in"] == 2
    client.send(vp.message(3, 9, big)[:70_000])                  # the peer dies inside one
    client.close()
    with pytest.raises(ConnectionClosed):
        server.receive(timeout=5)
    server.close()


@pytest.mark.parametrize("size", [0, 15, vp.MAX_MESSAGE + 1, 0xFFFFFFFF])
def test_a_length_that_cannot_be_a_message_is_refused_before_it_is_read(size):
    client, server = native_pair()
    client.send(vp.HEADER.pack(1, 9, size, 0, 0))
    with pytest.raises(vp.ProtocolError):
        server.receive(timeout=5)
    client.close()
    server.close()


def test_a_send_to_a_peer_that_does_not_read_times_out():
    client, server = native_pair()
    client.set_send_timeout(0.3)
    started = time.monotonic()
    with pytest.raises(ConnectionClosed, match="timed out"):
        for _ in range(1000):  # fills both socket buffers; the peer never reads
            client.send_message(1, 12, vp.TYPE_COMMAND | vp.FLAG_NO_REPLY, bytes(1 << 20))
    assert time.monotonic() - started < 5
    client.close()
    server.close()


def test_a_reader_waiting_does_not_block_a_sender_and_shutdown_wakes_it():
    client, server = native_pair()
    woke = []

    def reader():
        try:
            server.receive(timeout=30)
        except ConnectionClosed as exc:
            woke.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    time.sleep(0.1)
    client.send_message(1, 9, vp.TYPE_COMMAND, b"while you wait")  # another thread sends meanwhile
    thread.join(5)
    assert not woke  # it got the message
    thread = threading.Thread(target=reader)
    thread.start()
    time.sleep(0.1)
    started = time.monotonic()
    server.shutdown()
    thread.join(5)
    assert woke and time.monotonic() - started < 2
    server.close()
    client.close()


def test_the_peer_closing_is_reported_not_hung():
    client, server = native_pair()
    client.close()
    with pytest.raises(ConnectionClosed):
        server.receive(timeout=5)
    server.close()
    assert server.fileno() == -1  # the descriptor is freed at close


def test_descriptors_travel_with_their_message_on_a_unix_socket():
    a, b = socket.socketpair()
    native, python = native_stream.unix(b), Connection(a)
    r1, w1 = os.pipe()
    python.send(vp.message(1, vp.Command.DMA_MAP, b"first"), [w1])
    python.send(vp.message(2, vp.Command.VERSION, b"second"))
    first, second = native.receive(timeout=5), native.receive(timeout=5)
    assert bytes(first.payload) == b"first" and len(first.fds) == 1 and second.fds == []
    os.write(first.fds[0], b"!")  # the very pipe: a working descriptor in this process
    assert os.read(r1, 1) == b"!"
    first.close_fds()
    os.close(w1)
    os.close(r1)
    native.close()
    python.close()


def test_more_descriptors_than_a_message_may_carry_end_the_stream_and_are_closed():
    a, b = socket.socketpair()
    native = native_stream.unix(b)
    fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(20)]
    before = len(os.listdir("/proc/self/fd"))
    a.sendmsg([vp.message(1, 2, b"x")], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    with pytest.raises(ConnectionClosed, match="descriptors"):
        native.receive(timeout=5)
    assert len(os.listdir("/proc/self/fd")) <= before  # none of what arrived is kept
    for fd in fds:
        os.close(fd)
    native.close()
    a.close()


def _arrived(conn, timeout=0.2) -> list[int]:
    """The message ids that reach ``conn`` within ``timeout`` (whatever is there by then)."""
    ids = []
    while True:
        try:
            ids.append(conn.receive(timeout=timeout).header.msg_id)
        except ReceiveTimeout:
            return ids


def test_a_corked_threads_posted_messages_wait_for_uncork_and_keep_their_order(certs):
    """The box's device worker gathers a command's DMA writes and interrupt into one write:
    held while corked, then all of them, in order; a request it sends takes them along."""
    client, server = native_pair(certs)
    posted = vp.FLAG_NO_REPLY
    client.cork()
    client.send_message(1, 12, posted, b"a" * 4096)
    client.send_messages([(2, 12, posted, b"b" * 100_000), (3, 0x101, posted, b"irq")])
    assert _arrived(server) == [], "posted messages of the corked thread left before uncork"
    client.uncork()
    assert _arrived(server) == [1, 2, 3]
    client.cork()
    client.send_message(4, 12, posted, b"c")
    client.send_message(5, 11, vp.TYPE_COMMAND, b"read")  # non-posted: everything leaves now
    assert _arrived(server) == [4, 5]
    client.uncork()
    client.close()
    server.close()


def test_a_corked_run_of_small_messages_is_sealed_as_one_tls_write(certs):
    """A box's worker sends a command's data, then its completion, then the next command's:
    corked, they wait as plaintext and are sealed together when they leave, so both ends
    pay for one TLS record of the run, not one per send (seals were 1 per send before)."""
    client, server = native_pair(certs)
    posted = vp.FLAG_NO_REPLY
    before = client.stats()["seals"]
    client.cork()
    for i in range(8):
        client.send_message(i, 12, posted, bytes([i]) * 4096)
        client.send_messages([(100 + i, 12, posted, b"cqe" * 5)])
    assert client.stats()["seals"] == before, "a held send was sealed before the run left"
    client.uncork()
    assert client.stats()["seals"] - before <= 3, "the run took a TLS write per send"  # 33 KiB: 16 KiB records
    got = [server.receive(timeout=5) for _ in range(16)]
    assert [m.header.msg_id for m in got] == [i for j in range(8) for i in (j, 100 + j)]
    assert [bytes(m.payload) for m in got[::2]] == [bytes([i]) * 4096 for i in range(8)]
    client.close()
    server.close()


def test_another_threads_message_takes_the_held_ones_first(certs):
    """A reply from the link reader (a register read answered while the worker holds DMA
    writes) must not pass them: PCIe's read completions push posted writes."""
    client, server = native_pair(certs)
    client.cork()
    client.send_message(1, 12, vp.FLAG_NO_REPLY, b"dma")
    other = threading.Thread(target=lambda: client.send_message(2, 9, vp.TYPE_REPLY, b"reg"))
    other.start()
    other.join(5)
    assert _arrived(server) == [1, 2]
    client.uncork()
    assert _arrived(server) == []
    client.close()
    server.close()


def test_cork_holds_nothing_on_plain_tcp():
    client, server = native_pair()
    client.cork()
    client.send_message(1, 12, vp.FLAG_NO_REPLY, b"x")
    assert _arrived(server) == [1]
    client.uncork()
    client.close()
    server.close()


def test_uncork_on_a_closed_peer_says_so(certs):
    client, server = native_pair(certs)
    client.cork()
    client.send_message(1, 12, vp.FLAG_NO_REPLY, b"x" * 1000)
    server.close()
    client.shutdown()
    with pytest.raises(ConnectionClosed):
        client.uncork()
    client.close()


def test_two_threads_corking_at_once_lose_nothing_and_keep_their_order(certs):
    """NVMe's I/O threads each gather their command's writes: however their corks interleave,
    every message arrives, each thread's in its order (holding is only ever deferred sending)."""
    client, server = native_pair(certs)
    per_thread, start = 200, threading.Barrier(2)

    def work(base: int) -> None:
        start.wait(5)
        for i in range(per_thread):
            client.cork()
            client.send_message(base + 2 * i, 12, vp.FLAG_NO_REPLY, b"d" * 700)
            client.send_message(base + 2 * i + 1, 0x101, vp.FLAG_NO_REPLY, b"irq")
            client.uncork()

    threads = [threading.Thread(target=work, args=(base,)) for base in (0, 1000)]
    for t in threads:
        t.start()
    got = [server.receive(timeout=10).header.msg_id for _ in range(4 * per_thread)]
    for t in threads:
        t.join(10)
    assert [i for i in got if i < 1000] == list(range(2 * per_thread))
    assert [i for i in got if i >= 1000] == list(range(1000, 1000 + 2 * per_thread))
    client.close()
    server.close()


def test_the_link_seals_with_the_openssl_setup_links_in_not_the_systems():
    """scripts/build_native.py links Debian testing's OpenSSL (3.1 and later seal AES-GCM
    with AVX-512 VAES: 18 GB/s a core here against bookworm's 3.0 at 4.9). A module built
    against the system's would still pass every other test, at a third of the speed."""
    version = native_stream.require().OPENSSL_VERSION
    major, minor = (int(n) for n in version.split()[1].split(".")[:2])
    assert (major, minor) >= (3, 1), f"the native stream has {version}: rebuild it with scripts/build_native.py"
    assert version != ssl.OPENSSL_VERSION or ssl.OPENSSL_VERSION_INFO[:2] >= (3, 1), version
