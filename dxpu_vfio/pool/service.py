"""``dxpu manager serve``: the pool manager as a long-running service, and its client.

The API is JSON over HTTP on a UNIX socket next to the database (``pool.sock``), mode
0600. Every request must carry the bearer token the service wrote to ``pool.token``
(mode 0600) *and* come from root or the service's own user (SO_PEERCRED): reading the
token already needs those rights, checking both keeps a leaked token useless to others.
``GET /metrics`` serves Prometheus text on the same socket and, with ``--metrics``,
on a TCP address without the token (read-only counters, nothing to change). Both
listeners bound connections, time and body size (:mod:`dxpu_vfio.pool.bounds`); request
fields are checked by type (:mod:`dxpu_vfio.pool.fields`), a wrong one answers 400.

One service per database: it holds ``pool.lock`` (flock) while it runs. At start it
reconciles the store with the VMs; then it probes every box each ``--heartbeat`` s.
With ``--store etcd`` the pool's state lives in etcd (``--etcd-endpoints``) and the
database path only names where this host's socket, token, lock and logs live.
"""

from __future__ import annotations

import fcntl
import http.client
import json
import logging
import os
import secrets
import signal
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from dxpu_vfio.errors import DxpuError
from dxpu_vfio.pool import bounds
from dxpu_vfio.pool.bounds import BoundedServer, DeadlineHandler
from dxpu_vfio.pool.etcd_store import EtcdStore
from dxpu_vfio.pool.fields import BadField, count, field
from dxpu_vfio.pool.manager import Manager
from dxpu_vfio.pool.storage import STORES, PoolStore, StoreError
from dxpu_vfio.pool.store import Store, default_path
from dxpu_vfio.procs import ChildProcess, terminate

log = logging.getLogger("dxpu.manager")


def open_store(kind: str = "sqlite", *, db: Path | str | None = None, endpoints: list[str] | None = None,
               tls_dir: str | None = None) -> PoolStore:
    """The store the manager was told to use (``--store``); SQLite unless asked otherwise.
    ``db`` is the SQLite file, or for etcd the local path the logs live beside."""
    if kind == "sqlite":
        return Store(db)
    if kind == "etcd":
        if not endpoints:
            raise StoreError("the etcd store needs endpoints",
                             hint="pass --etcd-endpoints http://HOST:2379,... (or set DXPU_ETCD_ENDPOINTS)")
        return EtcdStore(endpoints, path=db, tls_dir=tls_dir)
    raise StoreError(f"unknown store {kind!r}; use one of {', '.join(STORES)}")

class ManagerError(DxpuError):
    """The manager refused or failed a request; carries its message and hint."""

    def __init__(self, message: str, *, kind: str = "ManagerError", status: int = 0, **kw) -> None:
        self.kind = kind
        self.status = status
        super().__init__(message, **kw)


class ManagerUnavailable(ManagerError):
    """No manager serves this pool database."""


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def manager_answer(request: str, status: int, kind: str, data: bytes, log: Path) -> object:
    """What the manager answered ``request`` (``"POST /v1/attach"``), as the client hands
    it on: a PNG's bytes, a text, or a JSON object or list (200); a ManagerError with the
    manager's message, kind, hint and logs where its error answer has them as strings
    (any other status). Anything else, from a manager of another version or something
    else on its socket, is a ManagerError that quotes it, never a decoder's exception in
    the CLI. Fuzzed: ``scripts/fuzz.py --target manager-answers``."""
    def odd(problem: str) -> ManagerError:
        return ManagerError(f"the manager answered {request} with {problem}: {data[:200]!r}", status=status,
                            logs=[log], hint="a manager of another version: restart it (dxpu manager serve)")

    if status == 200:
        if kind == "image/png":
            if not data.startswith(PNG_SIGNATURE):  # a caller writes these bytes to a .png file
                raise odd("no PNG")
            return data
        if kind.startswith("text/"):
            try:
                return data.decode()
            except UnicodeDecodeError:
                raise odd("text that is not UTF-8") from None
        try:
            value = json.loads(data)
        except (ValueError, RecursionError):  # (invalid UTF-8 is a ValueError too)
            raise odd("no JSON") from None
        if not isinstance(value, (dict, list)):
            raise odd("JSON that is neither an object nor a list")
        return value
    try:
        err = json.loads(data)
    except (ValueError, RecursionError):
        err = None
    if not isinstance(err, dict):
        err = {"message": data.decode(errors="replace")}

    def text(key: str) -> str | None:
        value = err.get(key)
        return value if isinstance(value, str) and value else None

    logs = err.get("logs")
    raise ManagerError(text("message") or f"HTTP {status}", kind=text("error") or "ManagerError", status=status,
                       hint=text("hint"), logs=[p for p in logs if isinstance(p, str)] if isinstance(logs, list) else None)


@dataclass(frozen=True)
class ManagerPaths:
    """Everything of one pool lives beside its database."""

    db: Path

    @classmethod
    def for_db(cls, db: Path | str | None) -> "ManagerPaths":
        return cls(Path(db or default_path()).resolve())

    @property
    def socket(self) -> Path:
        return self.db.with_suffix(".sock")

    @property
    def token(self) -> Path:
        return self.db.with_suffix(".token")

    @property
    def lock(self) -> Path:
        return self.db.with_suffix(".lock")

    @property
    def log(self) -> Path:
        return self.db.with_suffix(".log")


# --- server ----------------------------------------------------------------------
class _UnixHttpServer(BoundedServer, socketserver.UnixStreamServer):
    max_connections = bounds.API_CONNECTIONS


class _MetricsHttpServer(BoundedServer, HTTPServer):
    max_connections = bounds.METRICS_CONNECTIONS


class _Api(DeadlineHandler, BaseHTTPRequestHandler):
    manager: Manager
    token: str | None  # None: the metrics-only TCP listener
    server_version = "dxpu-manager/1"

    def log_message(self, fmt: str, *args: object) -> None:
        log.info("api: " + fmt, *args)

    def address_string(self) -> str:
        return "unix" if self.token is not None else super().address_string()

    def _send(self, status: int, body: object, content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else body.encode() if isinstance(body, str) else \
            json.dumps(body, default=str).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        if self.token is None:
            return False
        creds = self.request.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        supplied = self.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        return uid in (0, os.getuid()) and secrets.compare_digest(supplied, self.token)

    def _refuse_unauthorized(self) -> None:
        self._send(401 if self.token is not None else 404,
                   {"error": "Unauthorized", "message": "no valid token for the manager API",
                    "hint": "run dxpu as root or as the manager's user (it reads the token file)"})

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.request_read()
        url = urlparse(self.path)
        if url.path == "/metrics" and self.token is None:
            return self._send(200, self.manager.metrics(), "text/plain; version=0.0.4")
        if not self._authorized():
            return self._refuse_unauthorized()
        self._handle("GET", url.path, {k: v[-1] for k, v in parse_qs(url.query).items()})

    def do_POST(self) -> None:  # noqa: N802
        if not self._authorized():  # before the body: an unauthorized peer never makes us read one
            self.close_connection = True
            return self._refuse_unauthorized()
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= bounds.MAX_BODY:
            self.close_connection = True
            return self._send(413 if length > 0 else 400,
                              {"error": "BadRequest", "message": f"request body of {self.headers.get('Content-Length')}"
                                                                 f" bytes; the API takes 0 to {bounds.MAX_BODY}"})
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
        except (ValueError, RecursionError) as exc:
            return self._send(400, {"error": "BadRequest", "message": f"malformed request body: {exc}"})
        self.request_read()
        self._handle("POST", urlparse(self.path).path, body)

    def _handle(self, method: str, path: str, args: dict) -> None:
        m = self.manager

        def s(name: str, required: bool = False, default: str | None = None) -> str | None:
            return field(args, name, str, required=required, default=default)

        routes = {
            ("GET", "/v1/health"): lambda: {"pid": os.getpid(), "db": str(m.store.path), "store": m.store.kind,
                                             "schema": m.store.schema_version},
            ("GET", "/v1/ls"): m.listing,
            ("GET", "/v1/status"): lambda: m.status(s("vm", True)),
            ("GET", "/metrics"): lambda: m.metrics(),
            ("GET", "/v1/screenshot"): lambda: m.screenshot(s("device", True)),
            ("POST", "/v1/attach"): lambda: m.attach(s("vm", True), device_class=s("class"), count=count(args),
                                                      box=s("box"), device=s("device"),
                                                      policy=s("policy", default="pack"), host=s("host"),
                                                      dry_run=field(args, "dry_run", bool, default=False)),
            ("POST", "/v1/detach"): lambda: m.detach(s("vm", True), s("device"),
                                                      all_devices=field(args, "all", bool, default=False),
                                                      host=s("host"),
                                                      dry_run=field(args, "dry_run", bool, default=False)),
            ("POST", "/v1/boxes"): lambda: m.register_box(s("name"), s("address", True), s("tls_dir")),
            ("POST", "/v1/boxes/remove"): lambda: (m.store.remove_box(s("name", True)) or {"removed": args["name"]}),
            ("POST", "/v1/reconcile"): lambda: m.reconcile(dry_run=field(args, "dry_run", bool, default=False)),
            ("GET", "/v1/hosts"): m.hosts,
            ("POST", "/v1/hosts/fence"): lambda: m.fence_host(s("host", True)),
            ("POST", "/v1/hosts/unfence"): lambda: m.unfence_host(s("host", True)),
        }
        route = routes.get((method, path))
        if route is None:
            return self._send(404, {"error": "NotFound", "message": f"no API {method} {path}"})
        try:
            result = route()
        except BadField as exc:
            return self._send(400, {"error": "BadRequest", "message": str(exc)})
        except (DxpuError, ValueError) as exc:
            return self._send(409 if isinstance(exc, DxpuError) else 400,
                              {"error": type(exc).__name__, "message": getattr(exc, "message", str(exc)),
                               "hint": getattr(exc, "hint", None),
                               "logs": [str(p) for p in getattr(exc, "logs", [])]})
        except Exception as exc:  # noqa: BLE001 - reported, and the service stays up
            log.exception("API %s %s failed", method, path)
            return self._send(500, {"error": type(exc).__name__, "message": str(exc)})
        if path == "/metrics":
            return self._send(200, result, "text/plain; version=0.0.4")
        if isinstance(result, bytes):
            return self._send(200, result, "image/png")
        self._send(200, result)


def serve(db: Path | None = None, *, heartbeat: float = 1.0, dead_after: float = 3.0,
          metrics_address: str | None = None, ready: threading.Event | None = None,
          stop: threading.Event | None = None, store: str = "sqlite", etcd_endpoints: list[str] | None = None,
          etcd_tls_dir: str | None = None, host: str | None = None) -> None:
    """Run the manager until SIGTERM/SIGINT (or ``stop``), on the SQLite file ``db`` or,
    with ``store="etcd"``, on the pool in etcd."""
    paths = ManagerPaths.for_db(db)
    paths.db.parent.mkdir(parents=True, exist_ok=True)
    lock = open(paths.lock, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ManagerError(f"another manager already serves {paths.db} (pid in {paths.lock})",
                           hint="use that one, or stop it first") from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    try:
        pool_store = open_store(store, db=paths.db, endpoints=etcd_endpoints, tls_dir=etcd_tls_dir)
    except BaseException:
        lock.close()
        raise
    manager = Manager(pool_store, dead_after=dead_after, host=host)
    for action in manager.reconcile():
        log.warning("reconcile: %s", action)
    token = secrets.token_urlsafe(32)
    paths.token.unlink(missing_ok=True)
    paths.socket.unlink(missing_ok=True)
    api = type("Api", (_Api,), {"manager": manager, "token": token})
    old_umask = os.umask(0o177)
    try:
        unix = _UnixHttpServer(str(paths.socket), api)
    finally:
        os.umask(old_umask)
    fd = os.open(paths.token, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:  # last: clients wait for the token, the socket is already bound
        f.write(token)
    servers: list[socketserver.BaseServer] = [unix]
    if metrics_address:
        host, _, port = metrics_address.rpartition(":")
        servers.append(_MetricsHttpServer((host or "127.0.0.1", int(port)),
                                          type("Metrics", (_Api,), {"manager": manager, "token": None})))
    stop = stop or threading.Event()
    for server in servers:
        threading.Thread(target=server.serve_forever, name="manager-api", daemon=True).start()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
    log.warning("manager serving %s on %s%s", paths.db if store == "sqlite" else
                f"etcd {','.join(pool_store.endpoints)} ({paths.db.parent})", paths.socket,
                f" (metrics on http://{metrics_address}/metrics)" if metrics_address else "")
    if ready is not None:
        ready.set()
    try:
        while not stop.wait(heartbeat):
            try:
                manager.heartbeat()
            except StoreError as exc:  # the store cannot answer now (etcd away): said, not a bug
                log.warning("heartbeat: %s", exc)
            except Exception:  # noqa: BLE001 - a bad heartbeat round must not end the service
                log.exception("heartbeat failed")
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
        paths.socket.unlink(missing_ok=True)
        paths.token.unlink(missing_ok=True)
        pool_store.close()
        lock.close()


# --- client ----------------------------------------------------------------------
class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = str(path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.unix_path)


class ManagerClient:
    """What the CLI uses: one method per API call, errors as :class:`ManagerError`."""

    def __init__(self, db: Path | str | None = None, timeout: float = 180.0) -> None:
        self.paths = ManagerPaths.for_db(db)
        self.timeout = timeout

    def _token(self) -> str:
        try:
            return self.paths.token.read_text().strip()
        except FileNotFoundError:
            raise ManagerUnavailable(f"no pool manager serves {self.paths.db}",
                                     hint=f"start one: dxpu manager serve --db {self.paths.db}") from None
        except PermissionError:
            raise ManagerError(f"cannot read the manager token {self.paths.token}",
                               hint="run as root or as the manager's user") from None

    def request(self, method: str, path: str, body: dict | None = None) -> object:
        conn = _UnixConnection(self.paths.socket, self.timeout)
        headers = {"Authorization": f"Bearer {self._token()}", "Content-Type": "application/json"}
        try:
            conn.request(method, path, json.dumps(body or {}) if method == "POST" else None, headers)
            response = conn.getresponse()
            data = response.read()
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            raise ManagerUnavailable(f"the pool manager for {self.paths.db} is not running ({exc})",
                                     hint=f"start it: dxpu manager serve --db {self.paths.db}") from exc
        except (OSError, http.client.HTTPException) as exc:
            raise ManagerError(f"manager API {method} {path} failed: {exc}",
                               logs=[self.paths.log]) from exc
        finally:
            conn.close()
        return manager_answer(f"{method} {path}", response.status, response.getheader("Content-Type", ""), data,
                              self.paths.log)

    def get(self, path: str, **query: str) -> object:
        from urllib.parse import urlencode
        return self.request("GET", path + (f"?{urlencode(query)}" if query else ""))

    def post(self, path: str, **body: object) -> object:
        return self.request("POST", path, {k: v for k, v in body.items() if v is not None})

    def screenshot(self, device: str) -> bytes:
        """A pooled display's scanout as PNG (the manager asks the device's box): bytes
        that are a PNG, or a ManagerError quoting what came instead (a manager of another
        version), never something a caller would write to a .png file."""
        answer = self.get("/v1/screenshot", device=device)  # image/png: checked by manager_answer
        if not isinstance(answer, bytes):
            raise ManagerError(f"the manager answered the screenshot of {device} with no PNG: {str(answer)[:200]}",
                               hint="a manager of another version: restart it (dxpu manager serve)",
                               logs=[self.paths.log])
        return answer


class ManagerProcess(ChildProcess):
    """``dxpu manager serve`` as a child (tests, demo): started, waited for, ended by pid."""

    def __init__(self, db: Path, *, netns: str | None = None, heartbeat: float = 0.5, dead_after: float = 2.0,
                 metrics_address: str | None = None, env: dict[str, str] | None = None,
                 etcd_endpoints: list[str] | None = None) -> None:
        self.paths = ManagerPaths.for_db(db)
        self.netns = netns
        self.env = {**os.environ, **(env or {})}
        self.args = ["--heartbeat", str(heartbeat), "--dead-after", str(dead_after)]
        if etcd_endpoints:
            self.args += ["--store", "etcd", "--etcd-endpoints", ",".join(etcd_endpoints)]
        if metrics_address:
            self.args += ["--metrics", metrics_address]
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> "ManagerProcess":
        argv = [sys.executable, "-m", "dxpu_vfio.cli", "manager", "serve", "--db", str(self.paths.db), *self.args]
        if self.netns:
            argv = ["ip", "netns", "exec", self.netns, *argv]
        self.paths.token.unlink(missing_ok=True)
        self.paths.db.parent.mkdir(parents=True, exist_ok=True)
        with open(self.paths.log, "ab") as out:
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True, env=self.env)
        deadline = time.monotonic() + timeout
        while not (self.paths.token.exists() and self.paths.socket.exists()):
            if not self.alive() or time.monotonic() > deadline:
                self.stop()
                raise ManagerError("the pool manager did not start", logs=[self.paths.log])
            time.sleep(0.05)
        return self

    def kill(self) -> None:
        """SIGKILL: what a crash looks like (nothing cleaned up)."""
        if self.alive():
            self.process.kill()
            self.process.wait(10)

    def stop(self, timeout: float = 10.0) -> None:
        terminate(self.process, timeout)


class AgentProcess(ChildProcess):
    """``dxpu agent serve`` as a child (the fuzzer, tests): started without waiting (it
    registers its host in the store when it can), its output appended to ``log_path``,
    ended by pid. With ``netns`` it runs in that network namespace, as an admin runs it
    on a lab host (``ip netns exec`` execs the agent: the pid is the agent's)."""

    def __init__(self, host: str, log_path: Path, *, db: Path, ttl: float = 10.0, resync: float = 30.0,
                 etcd_endpoints: list[str] | None = None, log_level: str = "WARNING",
                 netns: str | None = None) -> None:
        self.host, self.log_path = host, log_path
        self.prefix = ["ip", "netns", "exec", netns] if netns else []
        self.args = ["--host", host, "--db", str(db), "--ttl", str(ttl), "--resync", str(resync),
                     "--log-level", log_level]
        if etcd_endpoints:
            self.args += ["--store", "etcd", "--etcd-endpoints", ",".join(etcd_endpoints)]
        self.process: subprocess.Popen | None = None

    def start(self) -> "AgentProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen([*self.prefix, sys.executable, "-m", "dxpu_vfio.cli", "agent", "serve",
                                             *self.args],
                                            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        terminate(self.process, timeout)
