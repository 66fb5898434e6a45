"""External vfio-user servers behind a box, without a VM: a real remote proxy process
drives the server as a vfio-user client; the host proxy's server (forward mode) runs
here with our client in QEMU's place. The external server is our own device server in a
process of its own, which, like libvfio-user, refuses DMA windows over 8 TiB and reports
the windows it was given (tests/test_libvfio_user.py runs libvfio-user's own sample)."""

import errno
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from external_box import BOX, Box, Host, free_port

from dxpu_vfio.hostproxy.forwarder import RemoteAttachError
from dxpu_vfio.hostproxy.process import HostProxyProcess
from dxpu_vfio.link.transport import make_certs
from dxpu_vfio.testing import eventually
from dxpu_vfio.vfio_user import protocol as p
from dxpu_vfio.vfio_user.client import ClientError

BAR0 = 0
GUEST = 0x100000
MEM = 1 << 20


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    make_certs(d, ["host", BOX])
    return d


@pytest.fixture
def external(tmp_path):
    proc = HostProxyProcess("testdev", tmp_path / "ext.sock", settings={"memory_size": 1 << 20},
                            name=f"ext{os.getpid()}").start()
    yield proc
    proc.stop()


def enable_dma(client) -> None:
    cmd = int.from_bytes(client.read(p.REGION_CONFIG, 4, 2), "little")
    client.write(p.REGION_CONFIG, 4, (cmd | 6).to_bytes(2, "little"))


def dma_copy(client, src: int, dst: int, length: int) -> int:
    for reg, value in ((0x20, src), (0x24, src >> 32), (0x28, dst), (0x2C, dst >> 32), (0x30, length), (0x34, 1)):
        client.write32(BAR0, reg, value, posted=True)
    eventually(lambda: client.read32(BAR0, 0x38) != 1, what="the external device's DMA")
    return client.read32(BAR0, 0x38)


def test_the_external_server_gets_qemus_dma_windows_and_does_its_dma_by_messages(tmp_path, certs, stream, external):
    """The box used to map one 2^48-byte window, which a server with libvfio-user's 8 TiB
    limit (ours has it too) refuses: the box could not start. Now each window QEMU maps or
    unmaps reaches the server, without a descriptor, and the session's end unmaps them."""
    box = Box(tmp_path, certs, external.socket_path)
    try:
        host = Host(tmp_path, box)
        ram = host.map(GUEST, MEM)
        assert external.stats()["server"]["dma"]["maps"] == [[GUEST, MEM, 3, False]]  # QEMU's window, no fd
        extra = host.map(0x4000_0000, 1 << 16)
        assert [m[:2] for m in external.stats()["server"]["dma"]["maps"]] == [[GUEST, MEM], [0x4000_0000, 1 << 16]]
        host.client.dma_unmap(0x4000_0000, 1 << 16)
        assert external.stats()["server"]["dma"]["maps"] == [[GUEST, MEM, 3, False]]
        assert box.proc.stats()["devices"]["ext0"]["device"]["windows"] == [[GUEST, MEM, 3]]
        enable_dma(host.client)
        data = os.urandom(20000)
        ram[0:len(data)] = data
        assert dma_copy(host.client, GUEST, GUEST + 0x40000, len(data)) == 2
        assert ram[0x40000:0x40000 + len(data)] == data
        dma = external.stats()["server"]["dma"]
        assert dma["bytes_read"] == dma["bytes_written"] == len(data)  # by DMA_READ/DMA_WRITE messages
        host.close()  # QEMU went away: its windows go with it
        eventually(lambda: external.stats()["server"]["dma"]["maps"] == [], what="the session's windows unmapped")
        ram.close()
        extra.close()
        box.assert_clean_log()
    finally:
        box.proc.stop()


def test_an_external_server_that_needs_fd_mapped_memory_is_refused_at_attach(tmp_path, certs, caplog):
    """QEMU's first DMA_MAP (during device_add) is refused with EOPNOTSUPP and a reason
    naming the cause in the host's and the box's logs; the box keeps serving."""
    needy = HostProxyProcess("testdev", tmp_path / "needy.sock", name=f"needy{os.getpid()}",
                             dma_needs_fd=True).start()
    box = Box(tmp_path, certs, needy.socket_path)
    try:
        host = Host(tmp_path, box)
        with pytest.raises(ClientError) as refused:
            host.map(GUEST, MEM)
        assert refused.value.errno == errno.EOPNOTSUPP
        assert "needs fd-mapped guest memory" in caplog.text  # the host proxy's log
        assert host.server.session.dma.windows() == []  # the host's table took it back
        with pytest.raises(ClientError) as no_device:  # QEMU only logs a refused DMA_MAP: GET_INFO fails device_add
            host.client.device_info()
        assert no_device.value.errno == errno.EOPNOTSUPP
        assert "needs fd-mapped guest memory" in host.device.stats()["attach_error"]
        assert "refused DMA window 0x100000+0x100000 without a file descriptor" in box.log()
        assert "needs fd-mapped guest memory" in box.log()
        assert host.client.read32(p.REGION_CONFIG, 0) == 0x10F01B36  # the device still answers
        host.close()
        box.assert_clean_log()
    finally:
        box.proc.stop()
        needy.stop()


EXITS_ON_WINDOWS_WITHOUT_FD = textwrap.dedent("""
    import os, sys, time
    from dxpu_vfio.vfio_user import protocol as p
    from dxpu_vfio.vfio_user.handlers import HANDLERS
    from dxpu_vfio.vfio_user.server import VfioUserServer
    from qemu_device.models import create_model

    def dma_map(session, msg):
        if not msg.fds:
            os._exit(3)  # like a server that asserts its guest memory is mapped
        return HANDLERS[p.Command.DMA_MAP](session, msg)

    server = VfioUserServer(create_model("testdev"), sys.argv[1], name="exits")
    server.handlers[p.Command.DMA_MAP] = dma_map
    server.start()
    print("serving", flush=True)
    time.sleep(600)
""")


def test_an_external_server_that_exits_on_a_window_without_fd_is_refused_at_attach(tmp_path, certs):
    sock = tmp_path / "exits.sock"
    proc = subprocess.Popen([sys.executable, "-c", EXITS_ON_WINDOWS_WITHOUT_FD, str(sock)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "serving"
        box = Box(tmp_path, certs, sock)
        try:
            host = Host(tmp_path, box)
            with pytest.raises(ClientError) as refused:
                host.map(GUEST, MEM)
            assert refused.value.errno == errno.EOPNOTSUPP
            assert proc.wait(5) == 3
            eventually(lambda: not host.device.link_up, what="the box takes the link down")
            assert "closed its connection when given DMA window 0x100000+0x100000 without a file descriptor" \
                in box.log()
            box.assert_link_down_blames(sock)
            host.close()
            with pytest.raises(RemoteAttachError) as again:  # the next attach says why at once
                box.connect()
            assert again.value.errno == errno.ENXIO
            assert "needs fd-mapped guest memory" in str(again.value)
            assert "reconnecting failed" in str(again.value)
            box.assert_clean_log()
        finally:
            box.proc.stop()
    finally:
        proc.kill()
        proc.wait()


def test_an_external_server_that_goes_away_takes_the_link_down_with_its_reason(tmp_path, certs, external):
    """The server exits while a host holds the device: the box takes the link down saying
    so (no uncaught ConnectionClosed in its threads), reads master-abort on the host, a new
    attach is refused naming the server, and once it is back the device serves again."""
    box = Box(tmp_path, certs, external.socket_path)
    try:
        host = Host(tmp_path, box)
        host.map(GUEST, MEM).close()
        assert host.client.read32(BAR0, 0) == 0xD0C50001
        os.kill(external.process.pid, signal.SIGKILL)
        external.process.wait()
        eventually(lambda: not host.device.link_up, what="the box takes the link down")
        assert host.client.read32(BAR0, 0) == 0xFFFFFFFF  # master abort
        eventually(lambda: "went away" in box.log(), what="the box's log names its server")
        box.assert_link_down_blames(external.socket_path)
        host.close()
        with pytest.raises(RemoteAttachError) as refused:
            box.connect()
        assert refused.value.errno == errno.ENXIO and "went away" in str(refused.value)
        external.socket_path.unlink(missing_ok=True)
        external.start()  # restarted: the box reconnects at the next attach
        host = Host(tmp_path, box)
        host.map(GUEST, MEM).close()
        assert host.client.read32(BAR0, 0) == 0xD0C50001
        host.close()
        box.assert_clean_log()
    finally:
        box.proc.stop()


def test_a_box_whose_external_server_is_not_there_says_so(tmp_path, certs):
    """`dxpu remote serve` with an external device whose server is not running exits with
    an error naming the socket, not a traceback."""
    config = tmp_path / "b.toml"
    config.write_text(f'name = "{BOX}"\nlisten = "127.0.0.1"\nport = {free_port()}\ntls_dir = "{certs}"\n'
                      f'[[device]]\nid = "ext0"\nmodel = "vfio-user"\nlease = "l"\n'
                      f'settings = {{ socket = "{tmp_path}/nobody.sock" }}\n')
    out = subprocess.run([sys.executable, "-m", "dxpu_vfio.cli", "remote", "serve", "--config", str(config)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "cannot reach the external vfio-user server" in out.stderr and "nobody.sock" in out.stderr
    assert "Traceback" not in out.stderr


class ScriptedServer:
    """A vfio-user server that answers the box right (as the vfio-user-client fuzz target's
    server does), but for the commands in ``wrong``, whose replies are the given payloads
    (what a buggy or hostile external server may send). Serves one connection, in a thread."""

    def __init__(self, path, wrong: dict) -> None:
        import socket
        import threading
        self.wrong = wrong
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(1)
        threading.Thread(target=self._serve, daemon=True).start()

    def _answer(self, command: int, payload: bytes) -> bytes:
        from dxpu_vfio.fuzz.external import right_answer  # the fuzzed server's right answers
        return self.wrong[command] if command in self.wrong else right_answer(command, payload)

    def _serve(self) -> None:
        import array
        import socket
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        with conn:
            while True:
                head = b""
                while len(head) < p.HEADER_SIZE:
                    msg, anc, _, _ = conn.recvmsg(p.HEADER_SIZE - len(head), socket.CMSG_SPACE(16 * 4))
                    for level, kind, data in anc:  # close what the box hands us (eventfds)
                        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                            for fd in array.array("i", data[:len(data) - len(data) % 4]):
                                os.close(fd)
                    if not msg:
                        return
                    head += msg
                hdr = p.Header.unpack(head)
                payload = b""
                while len(payload) < hdr.size - p.HEADER_SIZE:
                    chunk = conn.recv(hdr.size - p.HEADER_SIZE - len(payload))
                    if not chunk:
                        return
                    payload += chunk
                if not hdr.no_reply:
                    conn.sendall(p.message(hdr.msg_id, hdr.command, self._answer(hdr.command, payload), reply=True))

    def close(self) -> None:
        self.listener.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("command, reply", [
    (p.Command.VERSION, b"\x00"),
    (p.Command.VERSION, p.VERSION.pack(0, 0) + b"{not json"),
    (p.Command.DEVICE_GET_INFO, b"\x01\x02"),
    (p.Command.DEVICE_GET_REGION_INFO, p.REGION_INFO.pack(p.REGION_INFO.size, 0, 0, 0, 0, 0)[:12]),
    (p.Command.DEVICE_GET_IRQ_INFO, b""),
    (p.Command.DEVICE_GET_IRQ_INFO, p.IRQ_INFO.pack(p.IRQ_INFO.size, 0, p.IRQ_MSI, 0xFFFFFFFF)),
], ids=["short-version", "bad-json", "short-device-info", "short-region-info", "empty-irq-info", "4G-vectors"])
def test_a_handshake_answered_wrong_is_an_error_that_says_so_and_leaks_nothing(tmp_path, command, reply):
    """What the box parses from an external server's handshake replies is checked: a short
    or malformed reply, or an interrupt count no device has, is an ExternalServerError that
    names the server (the box then refuses that device, or the link on a reconnect), not
    a struct.error or ProtocolError out of the box's thread, nor a descriptor per vector."""
    from dxpu_vfio.remoteproxy.external import ExternalFunction, ExternalServerError
    server = ScriptedServer(tmp_path / "ext.sock", {command: reply})
    before = _open_fds()
    try:
        with pytest.raises(ExternalServerError, match="failed the handshake"):
            ExternalFunction(tmp_path / "ext.sock")
    finally:
        server.close()
    assert _open_fds() <= before, "the handshake left descriptors open"


@pytest.mark.parametrize("reply", [b"\x00\x01", p.RegionAccess(0, 8, 8, b"\x11" * 8).pack(),
                                   p.RegionAccess(2, 0, 4, b"\x11" * 4).pack()],
                         ids=["unframed", "twice-the-bytes", "another-region"])
def test_a_read_answered_with_something_else_is_an_error_not_the_bytes(tmp_path, reply):
    """The box hands the host what its external server answers to a register read: a reply
    that is not the read asked (unparsable, another size, another place) is refused as a
    protocol error (EPROTO: the host's read fails), and the server stays usable."""
    from dxpu_vfio.remoteproxy.external import ExternalFunction
    server = ScriptedServer(tmp_path / "ext.sock", {p.Command.REGION_READ: reply})
    try:
        device = ExternalFunction(tmp_path / "ext.sock")
        try:
            with pytest.raises(OSError) as caught:
                device.region_read(0, 0, 4)
            assert caught.value.errno == errno.EPROTO and device.gone is None, caught.value
        finally:
            device.close()
    finally:
        server.close()
