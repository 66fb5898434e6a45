"""A box whose one device is an external vfio-user server, and the host side in front
of it (the host proxy's server in forward mode, our client in QEMU's place), for the
external-server tests."""

from __future__ import annotations

import mmap
import os
import socket

from dxpu_vfio.hostproxy.forwarder import connect_remote
from dxpu_vfio.link.transport import TlsFiles
from dxpu_vfio.remoteproxy.process import RemoteProxyProcess
from dxpu_vfio.vfio_user.client import VfioUserClient
from dxpu_vfio.vfio_user.server import VfioUserServer

BOX = f"xbox{os.getpid()}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Box:
    """A remote proxy whose one device, ext0, is the external server at ``socket``."""

    def __init__(self, tmp_path, certs, socket_path) -> None:
        self.port = free_port()
        self.certs = certs
        config = tmp_path / f"{BOX}.toml"
        config.write_text(f'name = "{BOX}"\nlisten = "127.0.0.1"\nport = {self.port}\ntls_dir = "{certs}"\n'
                          f'[[device]]\nid = "ext0"\nmodel = "vfio-user"\nlease = "l"\n'
                          f'settings = {{ socket = "{socket_path}" }}\n')
        self.proc = RemoteProxyProcess(config).start()

    def connect(self):
        return connect_remote(f"127.0.0.1:{self.port}", "ext0", "l", TlsFiles.in_dir(self.certs, "host"),
                              completion_timeout=2.0)

    def log(self) -> str:
        return self.proc.log_path.read_text(errors="replace")

    def assert_clean_log(self) -> None:
        """No proxy thread died with an exception."""
        text = self.log()
        assert "Traceback" not in text, text[-4000:]

    def assert_link_down_blames(self, socket_path) -> None:
        """The box took the link down naming its server (not "peer closed the link")."""
        line = next((line for line in self.log().splitlines() if "ext0 down:" in line), "")
        assert f"down: the external vfio-user server at {socket_path}" in line, self.log()[-4000:]


class Host:
    """The host proxy's server in forward mode, our client in QEMU's place."""

    def __init__(self, tmp_path, box: Box) -> None:
        self.device = box.connect()
        self.server = VfioUserServer(self.device, tmp_path / "host.sock", name="ext").start()
        self.client = VfioUserClient(self.server.socket_path)
        self.client.negotiate()

    def map(self, address: int, size: int) -> mmap.mmap:
        fd = os.memfd_create("guest")
        try:
            os.ftruncate(fd, size)
            ram = mmap.mmap(fd, size)
            self.client.dma_map(address, size, fd=fd)
        finally:
            os.close(fd)
        return ram

    def close(self) -> None:
        self.client.close()
        self.server.stop()
