"""TCP + mutual TLS for the link, and ``dxpu certs``: a lab CA and its certificates.

Both ends present a certificate signed by the lab CA and check the other's against it
(mutual TLS); the names in certificates are not checked, the CA is the trust root.
Plaintext happens only when a caller passes ``tls=None`` explicitly.
"""

from __future__ import annotations

import socket
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

from dxpu_vfio.errors import SetupError
from dxpu_vfio.native import stream as native


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path

    @classmethod
    def in_dir(cls, directory: Path, role: str) -> "TlsFiles":
        """The files ``dxpu certs`` wrote for ``role`` (e.g. "host", "box1")."""
        d = Path(directory)
        return cls(d / "ca.pem", d / f"{role}.pem", d / f"{role}.key")


def server_context(files: TlsFiles) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(files.cert, files.key)
    ctx.load_verify_locations(files.ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(files: TlsFiles) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(files.cert, files.key)
    ctx.load_verify_locations(files.ca)
    ctx.check_hostname = False  # the lab CA is the trust root; boxes move between addresses
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


TCP_RTO_MIN_US = 45  # <linux/tcp.h>, Linux 6.15 and newer; Python has no name for it
LINK_RTO_MIN_US = 5000  # the kernel rounds it up to whole ticks (8 ms at HZ=250)


def tune(sock: socket.socket) -> socket.socket:
    """Small messages must not wait for Nagle: every read is a round trip. A lost segment
    must not wait for TCP's WAN-sized minimum retransmission timeout (200 ms, doubling on
    each loss): a burst of losses would outlast the link's 2 s completion timeout after
    three retransmissions and take the device down; with a datacenter-sized minimum
    (TCP_RTO_MIN_US, what ``ip route ... rto_min`` sets per route) eight fit in it. On a
    kernel without the option the default stays."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MIN_US, LINK_RTO_MIN_US)
    except OSError:  # ENOPROTOOPT before Linux 6.15
        pass
    return sock


def split_address(address: str) -> tuple[str, int]:
    """(host, port) of a box's ``HOST:PORT``; ValueError saying what is wrong otherwise (a
    port that is not 1-65535 in ASCII digits: int() would take "٧٠٠٠" or a 30-digit number,
    which the resolver then refuses with an OverflowError)."""
    host, _, port = address.rpartition(":")
    if not host or not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"bad box address {address!r}: want HOST:PORT with a port 1-65535")
    return host, int(port)


def connect(host: str, port: int, tls: TlsFiles | None, timeout: float = 5.0) -> socket.socket:
    sock = tune(socket.create_connection((host, port), timeout=timeout))
    if tls is not None:
        sock = client_context(tls).wrap_socket(sock)
    sock.settimeout(None)
    return sock


def connect_native(host: str, port: int, tls: TlsFiles | None, timeout: float = 5.0):
    """:func:`connect` onto the native stream (framing and TLS in C): a NativeConnection."""
    sock = tune(socket.create_connection((host, port), timeout=timeout))
    return native.tcp(sock, tls, server=False, handshake_timeout=timeout)


def accept_native(sock: socket.socket, tls: TlsFiles | None, handshake_timeout: float):
    """The box's side of an accepted connection on the native stream."""
    return native.tcp(tune(sock), tls, server=True, handshake_timeout=handshake_timeout)


def peer_certificate(conn: object) -> bytes | None:
    """The certificate (DER) the other end of ``conn`` presented; None on a plaintext link.
    ``conn``: a Connection over an ssl.SSLSocket, or a native stream's NativeConnection."""
    if getattr(conn, "native", False):
        return conn.stream.peer_certificate()  # type: ignore[attr-defined]
    sock = getattr(conn, "sock", conn)
    sock = getattr(sock, "sock", sock)  # a LinkStream wraps the socket
    return sock.getpeercert(binary_form=True) if isinstance(sock, ssl.SSLSocket) else None


def ca_private_dir(directory: Path) -> Path:
    """Where :func:`make_certs` keeps the CA's key: beside the TLS dir, never in it, since
    the TLS dir is what boxes and hosts are given (whoever has the CA key can mint a
    certificate any box or manager accepts)."""
    d = Path(directory).resolve()
    return d.parent / f"{d.name}.ca-private"


def make_certs(directory: Path, roles: list[str], days: int = 365) -> list[Path]:
    """A lab CA plus one key and certificate per role, with openssl; idempotent per file.

    ``directory`` gets ``ca.pem`` and ``ROLE.pem``/``ROLE.key``; the CA key (and serial)
    go to :func:`ca_private_dir` (0700). A CA key an older version left in ``directory``
    is moved there."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    private = ca_private_dir(d)
    private.mkdir(mode=0o700, exist_ok=True)
    private.chmod(0o700)
    ca_key = private / "ca.key"
    for old in ("ca.key", "ca.srl"):
        if (d / old).exists():
            (d / old).replace(private / old)

    def run(*args: str) -> None:
        proc = subprocess.run(["openssl", *args], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SetupError(f"openssl {args[0]} failed: {proc.stderr.strip()[-400:]}",
                             hint="apt-get install openssl")

    made = []
    if not (d / "ca.pem").exists():
        run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(ca_key), "-out", str(d / "ca.pem"), "-days", str(days),
            "-subj", "/CN=dxpu lab CA")
        made.append(d / "ca.pem")
    ca_key.chmod(0o600)
    for role in roles:
        if (d / f"{role}.pem").exists():
            continue
        if not ca_key.exists():
            raise SetupError(f"{d} has a CA certificate but its key is not in {private}",
                             hint=f"put the CA's ca.key into {private}, or make certificates in a new directory")
        run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(d / f"{role}.key"), "-out", str(d / f"{role}.csr"), "-subj", f"/CN={role}")
        run("x509", "-req", "-in", str(d / f"{role}.csr"), "-CA", str(d / "ca.pem"), "-CAkey",
            str(ca_key), "-CAserial", str(private / "ca.srl"), "-CAcreateserial", "-out", str(d / f"{role}.pem"),
            "-days", str(days))
        (d / f"{role}.csr").unlink()
        (d / f"{role}.key").chmod(0o600)
        made.append(d / f"{role}.pem")
    return made
