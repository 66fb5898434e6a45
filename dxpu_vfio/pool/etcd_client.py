"""The etcd client of the pool store (:mod:`dxpu_vfio.pool.etcd_store`): calls to etcd's
JSON gateway with failover over several endpoints, bounded retries while a leader is
elected, every answer checked (:mod:`dxpu_vfio.pool.etcd_answers`), errors that name the
endpoints; and the pieces of a transaction (compares, puts, deletes, ranges).

The client speaks etcd's JSON gateway (plain HTTP(S)): calls over keep-alive
connections of its own, one per thread (:mod:`dxpu_vfio.pool.etcd_http`: a quarter of
the client CPU of a ``requests`` session, half of ``http.client``'s, and on a busy host
the CPU is most of an allocation's latency), watches over
``etcd3gw``'s ``requests`` session, which ignores the environment
(``REQUESTS_CA_BUNDLE`` would override the pool's CA); the calls trust only the pool's CA
too. This module adds failover over several endpoints, bounded retries while a leader is
elected, and errors that name the endpoints.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import ssl
import threading
import time
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import urlparse

import requests
from etcd3gw.client import Etcd3Client

from dxpu_vfio.pool.etcd_answers import EtcdAnswerError, check
from dxpu_vfio.pool.etcd_http import Connection
from dxpu_vfio.pool.storage import StoreError

PREFIX = "/dxpu/v1/"  # every key of the pool lives under it (the layout: dxpu_vfio.pool.etcd_store)


def b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


def unb64(text: str) -> str:
    return base64.b64decode(text).decode()


def prefix_end(prefix: str) -> str:
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return b64(bytes(raw))


def endpoints_from(value: str | Iterable[str] | None) -> list[str]:
    """``--etcd-endpoints`` / ``$DXPU_ETCD_ENDPOINTS``: comma separated URLs (http:// assumed)."""
    if value is None:
        value = os.environ.get("DXPU_ETCD_ENDPOINTS", "")
    items = value.split(",") if isinstance(value, str) else list(value)
    return [e if "://" in e else f"http://{e}" for e in (i.strip() for i in items) if e]


def _why(exc: BaseException) -> str:
    """The short reason in a connection error."""
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timed out"
    if isinstance(exc, socket.gaierror):
        return "unknown host"
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {exc.reason or exc}"
    text = str(exc) or type(exc).__name__
    if "No route to host" in text:
        return "no route to host"
    return " ".join(text.split())[-160:]


class _Retry(Exception):
    """This endpoint cannot answer now (down, no leader, timed out): try another."""


class _Endpoint:
    """One member's JSON gateway over keep-alive HTTP(S) connections, one per thread.

    Not a ``requests`` session: a call costs about a third of the client CPU (measured:
    0.5 against 1.7 ms a transaction), which on a busy host is most of an allocation's
    latency; and not ``http.client`` either, half of whose CPU is its header parsing
    (:mod:`dxpu_vfio.pool.etcd_http`)."""

    def __init__(self, url: str, tls_dir: str | None, timeout: float, prefix: str | None = None) -> None:
        parsed = urlparse(url)
        self.url = url
        self.prefix = prefix  # the pool's: records under it are checked by kind (etcd_records)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or 2379
        self.https = parsed.scheme == "https"
        self.tls_dir = tls_dir
        self.timeout = timeout
        self._context: ssl.SSLContext | None = None
        self._local = threading.local()
        self._opened: list[Connection] = []
        self._opened_lock = threading.Lock()

    def _tls(self) -> ssl.SSLContext:
        """Only the pool's CA (not $REQUESTS_CA_BUNDLE or the system's) and our client certificate."""
        if self._context is None:
            try:
                context = ssl.create_default_context(cafile=str(Path(self.tls_dir) / "ca.pem")) if self.tls_dir \
                    else ssl.create_default_context()
                if self.tls_dir:
                    context.load_cert_chain(str(Path(self.tls_dir) / "host.pem"), str(Path(self.tls_dir) / "host.key"))
            except (OSError, ssl.SSLError) as exc:
                raise StoreError(f"cannot use the TLS files for etcd: {exc}",
                                 hint="--etcd-tls-dir must hold ca.pem, host.pem and host.key") from exc
            self._context = context
        return self._context

    def _connection(self) -> Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = Connection(self.host, self.port, self.timeout, self._tls() if self.https else None)
            self._local.conn = conn
            with self._opened_lock:
                self._opened.append(conn)
        return conn

    def post(self, path: str, request: dict, body: bytes) -> dict:
        """The answer to one POST of ``request`` (``body``: as JSON); :class:`_Retry` if
        the member cannot answer now."""
        for fresh in (False, True):
            conn = self._connection()
            reused = conn.sock is not None
            try:
                status, data = conn.post("/v3" + path, body)
            except OSError as exc:  # the connection is closed: the next call opens another
                if reused and not fresh and not isinstance(exc, (socket.timeout, TimeoutError)):
                    continue  # the member closed an idle connection: once more on a new one
                raise _Retry(_why(exc)) from exc
            if status in (408, 500, 503, 504):  # no leader yet, a member shutting down
                raise _Retry(f"HTTP {status} {data.decode(errors='replace').strip()[:100]}")
            if status != 200:
                raise StoreError(f"etcd refused {path}: {data.decode(errors='replace').strip()[:300]}",
                                 hint="nothing was changed")
            try:
                return check(path, data, request, self.prefix)
            except EtcdAnswerError as exc:  # not etcd, or a broken member: as if it did not answer
                raise _Retry(f"an answer that is not etcd's to {path}: {exc}") from None
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close every thread's connection (a later call opens a new one)."""
        with self._opened_lock:
            for conn in self._opened:
                conn.close()


class EtcdUnavailable(StoreError):
    """No etcd endpoint answered within the retry time; nothing was changed by this call."""


class EtcdClient:
    """etcd's v3 JSON API over one or more endpoints: the first that answers serves,
    and a call fails over to the next on a connection error or while there is no leader.

    A call that timed out may have been applied; every write of the store is safe to
    send twice (the allocation recognises its own claims)."""

    def __init__(self, endpoints: list[str], *, tls_dir: str | None = None, timeout: float = 2.0,
                 retry_for: float = 5.0, prefix: str | None = None) -> None:
        if not endpoints:
            raise StoreError("no etcd endpoints given", hint="pass --etcd-endpoints http://HOST:2379,...")
        self.endpoints = endpoints
        self.retry_for = retry_for
        self._clients = [self._client(url, tls_dir, timeout) for url in endpoints]  # for watches
        self._posts = [_Endpoint(url, tls_dir, timeout, prefix) for url in endpoints]  # calls
        self._current = 0

    @staticmethod
    def _client(url: str, tls_dir: str | None, timeout: float) -> Etcd3Client:
        parsed = urlparse(url)
        session = requests.Session()
        session.trust_env = False  # REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE would replace our CA
        if tls_dir:
            session.verify = str(Path(tls_dir) / "ca.pem")
            session.cert = (str(Path(tls_dir) / "host.pem"), str(Path(tls_dir) / "host.key"))
        return Etcd3Client(host=parsed.hostname or "127.0.0.1", port=parsed.port or 2379,
                           protocol=parsed.scheme or "http", timeout=timeout, api_path="/v3/", session=session)

    def call(self, path: str, body: dict) -> dict:
        deadline = time.monotonic() + self.retry_for
        errors: dict[str, str] = {}
        data = json.dumps(body, separators=(",", ":")).encode()
        while True:
            for step in range(len(self._posts)):
                index = (self._current + step) % len(self._posts)
                try:
                    result = self._posts[index].post(path, body, data)
                except _Retry as exc:
                    errors[self.endpoints[index]] = str(exc)
                    continue
                self._current = index
                return result
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        detail = "; ".join(f"{url}: {why}" for url, why in errors.items())
        raise EtcdUnavailable(
            f"etcd does not answer at {', '.join(self.endpoints)} ({detail})",
            hint=f"check the members: etcdctl --endpoints={','.join(self.endpoints)} endpoint health"
                 + ("" if "timed out" in errors.values() else "; nothing was changed"))

    @property
    def current(self) -> Etcd3Client:
        """The endpoint that answered last."""
        return self._clients[self._current]

    def watch_clients(self) -> list:
        """The endpoints' streaming clients, the one that answered last first (a watch
        tries them in this order: :class:`~dxpu_vfio.pool.etcd_watch.Watch`)."""
        n = len(self._clients)
        return [self._clients[(self._current + step) % n] for step in range(n)]

    def healthy(self) -> bool:
        """One linearizable read succeeds (there is a leader and a quorum)."""
        try:
            self.call("/kv/range", {"key": b64(PREFIX + "schema")})
            return True
        except StoreError:
            return False

    def range(self, key: str, *, prefix: bool = False, revision: int = 0, limit: int = 0,
              start: str | None = None, keys_only: bool = False, serializable: bool = False) -> dict:
        """``serializable``: the answering member's copy, maybe behind the leader (no quorum round)."""
        body: dict[str, Any] = {"key": b64(start or key)}
        if prefix:
            body["range_end"] = prefix_end(key)
        if revision:
            body["revision"] = revision
        if limit:
            body["limit"] = limit
        if keys_only:
            body["keys_only"] = True
        if serializable:
            body["serializable"] = True
        return self.call("/kv/range", body)

    def txn(self, compare: list[dict], success: list[dict], failure: list[dict] | None = None) -> dict:
        return self.call("/kv/txn", {"compare": compare, "success": success, "failure": failure or []})

    def close(self) -> None:
        for client in self._clients:
            client.session.close()
        for endpoint in self._posts:
            endpoint.close()


# --- transaction pieces ------------------------------------------------------------
def c_mod(key: str, revision: int) -> dict:
    """The key was last written at ``revision`` (0: it does not exist)."""
    return {"key": b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": revision}


def c_absent(key: str, prefix: bool = False) -> dict:
    """No such key (with ``prefix``: no key under it)."""
    cmp = {"key": b64(key), "target": "VERSION", "result": "EQUAL", "version": 0}
    if prefix:
        cmp["range_end"] = prefix_end(key)
    return cmp


def c_value(key: str, value: str) -> dict:
    return {"key": b64(key), "target": "VALUE", "result": "EQUAL", "value": b64(json.dumps(value))}


def op_put(key: str, value: object, lease: str | None = None) -> dict:
    put = {"key": b64(key), "value": b64(json.dumps(value, separators=(",", ":")))}
    if lease is not None:
        put["lease"] = lease
    return {"request_put": put}


def op_delete(key: str) -> dict:
    return {"request_delete_range": {"key": b64(key)}}


def op_range(key: str, prefix: bool = False, since: int = 0) -> dict:
    """Read a key or prefix; with ``since``, only keys written at or after that revision."""
    body: dict[str, Any] = {"key": b64(key)}
    if prefix:
        body["range_end"] = prefix_end(key)
    if since:
        body["min_mod_revision"] = since
    return {"request_range": body}


def kvs(response: dict, revision: str = "mod_revision") -> list[tuple[str, Any, int]]:
    """(key, JSON value, mod_revision -- or create_revision) of a range response."""
    return [(kv["key_bytes"].decode(), kv["record"], int(kv.get(revision, 0))) for kv in response.get("kvs", [])]


def ranges(txn_response: dict) -> list[list[tuple[str, Any, int]]]:
    return [kvs(r.get("response_range", {})) for r in txn_response.get("responses", [])]
