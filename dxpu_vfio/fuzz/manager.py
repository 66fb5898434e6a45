"""Fuzzing the manager API (:mod:`dxpu_vfio.pool.service`): ``dxpu manager serve`` on a
temporary database, reached over its UNIX socket with its token, as the CLI reaches it.

A unit is one HTTP request on a fresh connection: a known route or an unknown or mangled
path, any method, the token right, wrong or missing, Content-Length right, wrong, huge or
garbage, and a JSON body with fields of the wrong type, missing or unknown fields, huge or
deeply nested values, or no JSON at all. Values that would reach outside the test are kept
inside it: VM names never name a real socket, box addresses are loopback ports nobody
listens on.
"""

from __future__ import annotations

import json
import random
import socket
import time
from pathlib import Path
from urllib.parse import quote

from dxpu_vfio.fuzz.child import ChildTarget
from dxpu_vfio.fuzz.mutate import json_value, mutate_bytes, mutate_json, nested, text
from dxpu_vfio.fuzz.peer import Hang
from dxpu_vfio.pool.service import ManagerProcess

ROUTES = (("GET", "/v1/health"), ("GET", "/v1/ls"), ("GET", "/v1/status"), ("GET", "/metrics"),
          ("GET", "/v1/screenshot"), ("POST", "/v1/attach"), ("POST", "/v1/detach"), ("POST", "/v1/boxes"),
          ("POST", "/v1/boxes/remove"), ("POST", "/v1/reconcile"))


def exchange(socket_path: Path, request: bytes, deadline: float, what: str = "the request") -> bytes:
    """Send one request to the manager API on a fresh connection, end our side, read the
    answer (b"": the service closed); :class:`Hang` if it does not answer by ``deadline``."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            sock.connect(str(socket_path))
            sock.sendall(request)
            sock.shutdown(socket.SHUT_WR)
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
            return data
        except TimeoutError:
            raise Hang(f"{what} was not answered within the bound") from None
        except OSError:
            return b""  # reset: the service refused the request before reading it all


def api_call(process: ManagerProcess, token: str, method: str, path: str, body: dict | None,
         deadline: float) -> bytes:
    """A well-formed API request (the targets that fuzz what the manager reads elsewhere)."""
    data = json.dumps(body).encode() if body is not None else b""
    request = (f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
               f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data
    return exchange(process.paths.socket, request, deadline, f"{method} {path}")


def api_probe(process: ManagerProcess, token: str, paths: tuple[str, ...], deadline: float) -> None:
    """Each ``GET`` answered (an error answer too) by ``deadline``."""
    for path in paths:
        answer = api_call(process, token, "GET", path, None, deadline)
        if not answer.startswith(b"HTTP/1."):
            raise Hang(f"GET {path} answered {answer[:80]!r}")


class ManagerTarget(ChildTarget):
    name = "manager"

    def __init__(self) -> None:
        super().__init__()
        self.process: ManagerProcess | None = None
        self.token = ""

    def start(self, workdir: Path) -> None:
        self.workdir = workdir
        self.process = ManagerProcess(workdir / "pool.db", heartbeat=0.5).start()
        self.log_path = self.process.paths.log
        self.token = self.process.paths.token.read_text().strip()
        safe = ("fz-vm", f"qmp:{workdir}/none.qmp", "libvirt:fz-vm", "fz:vm", "")
        self.values = {"vm": safe, "class": ("nvme", "testdev", "display", "gpu"), "count": (0, 1, 2, -1, 2**31),
                       "box": ("box1", "fz"), "device": ("box1/td0", "td0", "x/y"), "policy": ("pack", "spread", "x"),
                       "all": (True, False), "name": ("box1", "fz"), "address": ("127.0.0.1:1", "127.0.0.1:99999",
                       "127.0.0.1:-1", "127.0.0.1:0", "localhost:1", "[::1]:1", "127.0.0.1", ":1", "1"),
                       "tls_dir": (str(workdir), "", "nonexistent")}

    def _exchange(self, request: bytes, deadline: float) -> bytes:
        assert self.process is not None
        return exchange(self.process.paths.socket, request, deadline, "the manager API")

    def probe(self, deadline: float) -> None:
        answer = self._exchange(f"GET /v1/health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {self.token}\r\n"
                                "Connection: close\r\n\r\n".encode(), deadline)
        if not answer.startswith(b"HTTP/1.0 200") and not answer.startswith(b"HTTP/1.1 200"):
            raise Hang(f"GET /v1/health answered {answer[:80]!r}")

    def send(self, index: int, rng: random.Random) -> list[bytes]:
        request = self._request(rng)
        self._exchange(request, time.monotonic() + 5.0)
        return [request]

    # --- requests ----------------------------------------------------------------------
    def _body(self, rng: random.Random, path: str) -> bytes:
        fields = {"/v1/attach": ("vm", "class", "count", "box", "device", "policy"),
                  "/v1/detach": ("vm", "device", "all"), "/v1/boxes": ("name", "address", "tls_dir"),
                  "/v1/boxes/remove": ("name",)}.get(path, ("vm",))
        doc = {name: rng.choice(self.values[name]) for name in fields if rng.random() < 0.8}
        roll = rng.randrange(6)
        if roll == 0:
            return json.dumps(doc).encode()
        if roll == 1:
            return nested(rng)
        if roll == 2:
            return json.dumps(json_value(rng)).encode()
        return mutate_json(rng, doc, self.values)

    def _query(self, rng: random.Random) -> str:
        if rng.random() < 0.3:
            return ""
        name = rng.choice(("vm", "device", "x", "vm", ""))
        value = rng.choice(self.values["vm"] + self.values["device"]) if rng.random() < 0.7 else text(rng)[:200]
        return "?" + "&".join(f"{quote(name)}={quote(value)}" for _ in range(rng.choice((1, 1, 2, 50))))

    def _request(self, rng: random.Random) -> bytes:
        method, path = rng.choice(ROUTES)
        roll = rng.randrange(10)
        if roll == 0:
            method = rng.choice(("PUT", "DELETE", "HEAD", "OPTIONS", "PATCH", "get", "POST " * 3, "\0", "G" * 300))
        elif roll == 1:
            path = rng.choice(("/", "/v1", "/v1/", "/v2/health", "/v1/health/..", "//v1/ls", "/v1/ls%00",
                               "/v1/boxes/remove/x", "*", "http://x/v1/health", "/" + "a" * 70000,
                               "/v1/" + quote(text(rng))))
        query = self._query(rng) if method == "GET" else ""
        version = rng.choice(("HTTP/1.1",) * 8 + ("HTTP/1.0", "HTTP/9.9", "", "HTTP/1.1 x"))
        body = self._body(rng, path) if method.startswith("POST") else b""
        headers = ["Host: x"]
        token = rng.random()
        if token < 0.85:
            headers.append(f"Authorization: Bearer {self.token}")
        elif token < 0.93:
            headers.append(f"Authorization: Bearer {self.token[:-1]}x")
        length = rng.random()
        if body or method.startswith("POST"):
            if length < 0.8:
                headers.append(f"Content-Length: {len(body)}")
            elif length < 0.95:
                headers.append(f"Content-Length: {rng.choice(('-1', '0', 'x', '1e3', str(len(body) + 10), '99999999999', str(len(body) - 1), ' 5'))}")
        if rng.random() < 0.05:
            headers += [f"X-{i}: {'v' * 100}" for i in range(rng.choice((10, 150)))]
        if rng.random() < 0.05:
            headers.append("Transfer-Encoding: chunked")
        head = f"{method} {path}{query} {version}".strip() + "\r\n" + "\r\n".join(headers) + "\r\n\r\n"
        raw = head.encode("utf-8", "surrogatepass") + body
        if rng.random() < 0.05:
            raw = mutate_bytes(rng, raw, 1 << 17)
        return raw
