"""Local etcd members we start ourselves: for tests, benchmarks and the lab.

Each member listens on 127.0.0.1 ports chosen free at start (2379/2380 may belong to
someone else); a lab's members run in its host namespace and take clients on every
address there (``netns``, ``listen_all``: its boxes reach them over their links), keeps its data dir under the directory it is given (a fresh one costs
~62 MB: the WAL is preallocated), runs with ``ETCD_*`` scrubbed from its environment
(etcd reads every flag from such variables) and is ended by pid. Debian 12 ships etcd
3.4, which has no ``--unsafe-no-fsync``; members fsync as in production.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from dxpu_vfio.errors import DxpuError
from dxpu_vfio.procs import ChildProcess, terminate, wait_until


class EtcdClusterError(DxpuError):
    """An etcd member we started did not come up."""


def free_port() -> int:
    """A 127.0.0.1 TCP port nobody listens on now (the kernel picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def etcd_binary() -> str:
    path = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if not path:
        raise EtcdClusterError("etcd is not installed", hint="run scripts/setup.sh (Debian: apt install etcd-server)")
    return path


def make_etcd_certs(directory: Path, days: int = 30) -> Path:
    """A CA, a member certificate (etcd.pem: 127.0.0.1/localhost, extendedKeyUsage
    serverAuth *and* clientAuth -- with only serverAuth every /v3 call answers 503 under
    --client-cert-auth) and a client one (host.pem), with openssl; the CA key is deleted
    once they are made (``directory`` is what hosts get). Returns ``directory``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        proc = subprocess.run(["openssl", *args], capture_output=True, text=True)
        if proc.returncode != 0:
            raise EtcdClusterError(f"openssl {args[0]} failed: {proc.stderr.strip()[-400:]}",
                                   hint="apt-get install openssl")

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"), "-days", str(days),
            "-subj", "/CN=dxpu etcd CA")
    for role, ext in (("etcd", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth"),
                      ("host", "extendedKeyUsage=clientAuth")):
        (d / f"{role}.ext").write_text(ext + "\n")
        openssl("req", *ec, "-keyout", str(d / f"{role}.key"), "-out", str(d / f"{role}.csr"), "-subj", f"/CN={role}")
        openssl("x509", "-req", "-in", str(d / f"{role}.csr"), "-CA", str(d / "ca.pem"), "-CAkey", str(d / "ca.key"),
                "-CAcreateserial", "-out", str(d / f"{role}.pem"), "-days", str(days), "-extfile", str(d / f"{role}.ext"))
        (d / f"{role}.csr").unlink()
        (d / f"{role}.key").chmod(0o600)
    for name in ("ca.key", "ca.srl"):  # every certificate is made: the CA key must not stay in a dir handed out
        (d / name).unlink(missing_ok=True)
    return d


@dataclass
class EtcdMember(ChildProcess):
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    scheme: str = "http"
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"


class EtcdCluster:
    """``members`` etcd processes forming one cluster under ``directory``."""

    def __init__(self, directory: Path, members: int = 1, *, heartbeat_ms: int = 50, election_ms: int = 500,
                 tls_dir: Path | None = None, netns: str | None = None, listen_all: bool = False) -> None:
        """``tls_dir`` (from :func:`make_etcd_certs`): clients speak https and must present
        a certificate of its CA (``--client-cert-auth``); peers stay on plain 127.0.0.1.
        ``netns``: the members run in that network namespace (and are asked there);
        ``listen_all``: they take clients on every address of it, not only 127.0.0.1."""
        self.directory = Path(directory)
        self.netns, self.listen_all = netns, listen_all
        self.token = f"dxpu-{uuid.uuid4().hex[:12]}"
        self.tls_dir = tls_dir
        self.timing = ["--heartbeat-interval", str(heartbeat_ms), "--election-timeout", str(election_ms)]
        self.members = [EtcdMember(f"m{i}", free_port(), free_port(), self.directory / f"m{i}.etcd",
                                   self.directory / f"m{i}.log", "https" if tls_dir else "http")
                        for i in range(members)]

    @property
    def endpoints(self) -> list[str]:
        return [m.client_url for m in self.members]

    def _argv(self, member: EtcdMember, state: str) -> list[str]:
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        listen = f"{member.scheme}://0.0.0.0:{member.client_port}" if self.listen_all else member.client_url
        inside = ["ip", "netns", "exec", self.netns] if self.netns else []  # exec'd: the pid is etcd's
        return [*inside, etcd_binary(), "--name", member.name, "--data-dir", str(member.data_dir),
                "--listen-client-urls", listen, "--advertise-client-urls", member.client_url,
                "--listen-peer-urls", member.peer_url, "--initial-advertise-peer-urls", member.peer_url,
                "--initial-cluster", initial, "--initial-cluster-state", state,
                "--initial-cluster-token", self.token, *self.timing, *self._tls_args()]

    def _tls_args(self) -> list[str]:
        if not self.tls_dir:
            return []
        d = Path(self.tls_dir)
        return ["--cert-file", str(d / "etcd.pem"), "--key-file", str(d / "etcd.key"),
                "--trusted-ca-file", str(d / "ca.pem"), "--client-cert-auth"]

    def start_member(self, member: EtcdMember, state: str = "new") -> None:
        """Start one member (again, after a kill: its data dir is kept)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
        with open(member.log_path, "ab") as log:
            member.process = subprocess.Popen(self._argv(member, state), stdin=subprocess.DEVNULL, stdout=log,
                                              stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def start(self, timeout: float = 30.0) -> "EtcdCluster":
        for member in self.members:
            self.start_member(member)
        try:
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout: float = 30.0, members: list[EtcdMember] | None = None) -> None:
        """Every running member (or those named) answers a linearizable read: the cluster has a leader."""
        from dxpu_vfio.pool.etcd_client import EtcdClient  # the client needs requests; the cluster does not
        waiting = members or [m for m in self.members if m.alive()]
        for member in waiting:
            client = EtcdClient([member.client_url], timeout=1.0, retry_for=0.0,
                                tls_dir=str(self.tls_dir) if self.tls_dir else None)
            try:
                if not wait_until(lambda: member.alive() and self._ask(client.healthy), timeout, interval=0.1):
                    tail = member.log_path.read_text(errors="replace")[-2000:] if member.log_path.exists() else ""
                    raise EtcdClusterError(f"etcd member {member.name} ({member.client_url}) is not healthy "
                                           f"after {timeout:.0f} s", hint=f"its log: {member.log_path}\n{tail}",
                                           logs=[member.log_path])
            finally:
                client.close()

    def _ask(self, call):
        """``call`` (a client request) made where the members are: in their namespace."""
        if self.netns is None:
            return call()
        from dxpu_vfio.namespaces import in_netns
        return in_netns(self.netns, call)

    def leader(self) -> int:
        """Index of the member that leads now (asked of the first running member that answers)."""
        from dxpu_vfio.pool.etcd_client import EtcdClient
        for member in (m for m in self.members if m.alive()):
            client = EtcdClient([member.client_url], timeout=1.0, retry_for=0.0,
                                tls_dir=str(self.tls_dir) if self.tls_dir else None)
            try:
                status = self._ask(lambda: client.call("/maintenance/status", {}))
            except DxpuError:
                continue
            finally:
                client.close()
            if status.get("leader") == status["header"]["member_id"]:
                return self.members.index(member)
        raise EtcdClusterError("no running etcd member says it leads", hint=f"logs in {self.directory}")

    def kill(self, index: int) -> EtcdMember:
        """SIGKILL one member (a crash); its data dir stays for :meth:`restart`."""
        member = self.members[index]
        if member.alive():
            member.process.kill()
            member.process.wait(10)
        return member

    def restart(self, index: int, timeout: float = 30.0) -> None:
        member = self.members[index]
        self.start_member(member, state="existing")
        self.wait_healthy(timeout, [member])

    def stop(self, remove: bool = True) -> None:
        """End every member by pid (SIGTERM, then SIGKILL) and remove the data dirs."""
        for member in self.members:
            terminate(member.process, timeout=5.0)
        if remove:
            for member in self.members:
                shutil.rmtree(member.data_dir, ignore_errors=True)

    def __enter__(self) -> "EtcdCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

