"""Fuzzing the etcd store's client (:mod:`dxpu_vfio.pool.etcd_store`, :mod:`~dxpu_vfio.pool.etcd_client`,
:mod:`dxpu_vfio.pool.etcd_http`, :mod:`dxpu_vfio.pool.etcd_watch`) as a wrong or broken
etcd endpoint reaches it: ``dxpu manager serve --store etcd`` whose endpoint is the
fuzzer, a man in the middle in front of a real etcd member.

The fuzzer forwards every request to etcd and, while a unit's plan says so, changes the
answer: its JSON (fields dropped, of another type, numbers as text, huge), a record's
value (not base64, not JSON, JSON that is not an object), its framing (a Content-Length
or chunk size that lies or is not a number, a head that never ends, an answer cut short),
its status (503, 404, 200 with an HTML page), or hangs up; a watch stream gets junk lines
or is cut. A unit is such a plan for the next one to three answers, then an API request
that makes the manager read or write the pool (list, status, register or remove a box,
attach, detach, reconcile), or asks the host agent beside it for an attach or a detach.

The agent (``dxpu agent serve --store etcd``, a second child, on the same relay) keeps its
host lease alive, watches its lease records and answers their requests, so the relay
changes what it reads too: keepalives, watch streams, full reads. The VM it is asked to
plug is not there, so every attach it takes ends in an answered error.

The probe is ``GET /v1/health`` and ``GET /v1/ls``, which must answer (an error answer is
fine: etcd may be unavailable for a moment) within the bound, and a look at the agent
(taken before every unit too).
What the manager or the agent logs with a traceback is a finding: a broken answer must
become a :class:`~dxpu_vfio.errors.StoreError` that says what etcd sent. An agent may
stop when etcd says its host lease is gone (a changed answer can say so) or cannot
register; it then said why in its log, and a new one starts under a new host name.

The plan is drawn from the unit's seed, but which of the manager's calls it meets
depends on timing (heartbeats, watches): a replay reproduces the same answers, not
always on the same calls.
"""

from __future__ import annotations

import base64
import json
import random
import socket
import threading
import time
from pathlib import Path
from urllib.parse import quote

from dxpu_vfio.fuzz.child import ChildTarget, log_since
from dxpu_vfio.fuzz.listener import Listener
from dxpu_vfio.fuzz.mutate import json_value, mutate_bytes, mutate_json
from dxpu_vfio.fuzz.manager import api_call, api_probe
from dxpu_vfio.fuzz.peer import Violation
from dxpu_vfio.pool.etcd_cluster import EtcdCluster
from dxpu_vfio.pool.etcd_store import EtcdStore
from dxpu_vfio.pool.service import AgentProcess, ManagerProcess

MAX_READ = 8 << 20  # what the fuzzer reads of one request or answer
AGENT_TTL = 4.0  # the agent's host lease: short, so a stopped agent's host soon reads as dead
AGENT_RESYNC = 2.0  # its full reads: a request whose watch event a plan broke is still answered soon
KINDS = ("json", "json", "value", "value", "framing", "framing", "status", "close", "watch")


class _Plan:
    """How the next ``count`` answers are changed (shared with the relay threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.kind = ""
        self.rng = random.Random(0)
        self.changed = 0  # answers changed over the run
        self.sent: list[bytes] = []  # what the changed answers were, since the last unit began

    def set(self, count: int, kind: str, seed: int) -> list[bytes]:
        """A new plan; what the last one sent."""
        with self.lock:
            self.count, self.kind, self.rng = count, kind, random.Random(seed)
            sent, self.sent = self.sent, []
        return sent

    def record(self, data: bytes) -> None:
        with self.lock:
            self.sent.append(data[:1 << 16])

    def take(self, watch: bool) -> tuple[str, random.Random] | None:
        """The change for this answer, if the plan has one left for its kind."""
        with self.lock:
            if self.count <= 0 or (self.kind == "watch") != watch:
                return None
            self.count -= 1
            self.changed += 1
            return self.kind, self.rng


def _read_head(sock: socket.socket, buf: bytearray) -> bytes | None:
    """Up to the blank line (None: the peer closed first)."""
    while (end := buf.find(b"\r\n\r\n")) < 0:
        data = sock.recv(65536)
        if not data or len(buf) > MAX_READ:
            return None
        buf += data
    head = bytes(buf[:end + 4])
    del buf[:end + 4]
    return head


def _fields(head: bytes) -> dict[str, str]:
    out = {}
    for line in head.decode("latin-1").split("\r\n")[1:]:
        name, _, value = line.partition(":")
        out[name.strip().lower()] = value.strip()
    return out


def _read_exact(sock: socket.socket, buf: bytearray, n: int) -> bytes | None:
    while len(buf) < n:
        data = sock.recv(65536)
        if not data:
            return None
        buf += data
    out = bytes(buf[:n])
    del buf[:n]
    return out


def _read_line(sock: socket.socket, buf: bytearray) -> bytes | None:
    while (end := buf.find(b"\r\n")) < 0:
        data = sock.recv(65536)
        if not data:
            return None
        buf += data
    line = bytes(buf[:end])
    del buf[:end + 2]
    return line


def _answer(status: int, body: bytes, reason: str = "OK") -> bytes:
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def _mutate_record(rng: random.Random, answer: object) -> None:
    """Change one record's value (base64 of JSON) wherever a key-value is in the answer."""
    found: list[dict] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if "key" in node and "value" in node:
                found.append(node)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(answer)
    if not found:
        return
    kv = rng.choice(found)
    roll = rng.randrange(6)
    if roll == 0:
        kv["value"] = "not base64!"
    elif roll == 1:
        kv["value"] = base64.b64encode(rng.randbytes(rng.choice((1, 8, 64)))).decode()  # not UTF-8 JSON
    elif roll == 2:
        kv["value"] = base64.b64encode(json.dumps(json_value(rng)).encode()).decode()  # JSON, any shape
    elif roll == 3:
        kv["key"] = rng.choice(("", "not base64!", base64.b64encode(b"\xff\xfe").decode()))
    elif roll == 4:
        kv[rng.choice(("mod_revision", "create_revision", "lease", "version"))] = \
            rng.choice(("x", "-1", -1, None, [], "99999999999999999999999"))
    else:
        try:
            record = json.loads(base64.b64decode(kv["value"]))
        except ValueError:
            return
        if isinstance(record, dict):
            kv["value"] = base64.b64encode(mutate_json(rng, record, {})).decode()


def _nodes(doc: object) -> list[dict]:
    """Every object in a JSON document, the root first."""
    out: list[dict] = []
    stack = [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            out.append(node)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return out


def _mutate_answer(rng: random.Random, doc: object) -> bytes:
    """The answer with one object somewhere in it changed (a field of another type, a
    number as text or text as a number, dropped, added), or its text broken."""
    nodes = _nodes(doc)
    if not nodes or rng.random() < 0.15:
        return mutate_json(rng, nodes[0] if nodes else {}, {})
    node = rng.choice(nodes)
    roll = rng.randrange(4)
    if roll == 0 and node:
        del node[rng.choice(list(node))]
    elif roll == 1 and node:
        key = rng.choice(list(node))
        value = node[key]
        node[key] = str(value) if isinstance(value, (int, bool)) else \
            int(value) if isinstance(value, str) and value.isdigit() else json_value(rng)
    elif roll == 2 and node:
        node[rng.choice(list(node))] = rng.choice((None, [], {}, "", "x", -1, 2 ** 70, "99999999999999999999999"))
    else:
        node[rng.choice(("header", "kvs", "more", "count", "succeeded", "responses", "ID", "TTL", "result", "x"))] = \
            json_value(rng)
    return json.dumps(doc).encode()


class Relay:
    """The man in the middle: a listener whose every connection is relayed to etcd, one
    thread per client connection, answers changed as the plan says."""

    def __init__(self, upstream: tuple[str, int], plan: _Plan) -> None:
        self.upstream, self.plan = upstream, plan
        sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.listener = Listener(sock, self._serve, "etcd-relay")

    def _serve(self, client: socket.socket) -> None:
        up = None
        try:
            up = self.listener.track(socket.create_connection(self.upstream, timeout=30))
            cbuf, ubuf = bytearray(), bytearray()
            while not self.listener.closing:
                head = _read_head(client, cbuf)
                if head is None:
                    return
                length = int(_fields(head).get("content-length", "0") or 0)
                body = _read_exact(client, cbuf, length)
                if body is None:
                    return
                up.sendall(head + body)
                watch = head.startswith(b"POST /v3/watch")
                if watch:
                    self._stream(client, up, ubuf)
                    return
                answer = self._whole(up, ubuf)
                if answer is None:
                    return
                change = self.plan.take(watch=False)
                out = answer[2] if change is None else self._change(answer, *change)
                if change is not None:
                    self.plan.record(out or b"(hung up)")
                if out is None:  # hang up
                    return
                client.sendall(out)
        finally:
            if up is not None:
                self.listener.forget(up)
                up.close()

    def _whole(self, up: socket.socket, buf: bytearray) -> tuple[int, bytes, bytes] | None:
        """etcd's answer: (status, body, the answer re-framed with a length); None if etcd
        closed the connection before the whole answer came."""
        head = _read_head(up, buf)
        if head is None:
            return None
        fields = _fields(head)
        status = int(head.split(None, 2)[1])
        if "content-length" in fields:
            body = _read_exact(up, buf, int(fields["content-length"]))
        else:  # chunked
            parts = []
            while (line := _read_line(up, buf)) and (size := int(line.split(b";")[0], 16)):
                if (chunk := _read_exact(up, buf, size + 2)) is None:
                    return None
                parts.append(chunk[:-2])
            _read_line(up, buf)
            body = b"".join(parts)
        if body is None:
            return None
        return status, body, _answer(status, body)

    def _change(self, answer: tuple[int, bytes, bytes], kind: str, rng: random.Random) -> bytes | None:
        status, body, whole = answer
        if kind == "close":
            return None if rng.random() < 0.5 else whole[:rng.randrange(len(whole))]
        if kind == "status":
            return rng.choice((_answer(503, b'{"error":"etcdserver: no leader"}', "Service Unavailable"),
                               _answer(404, b"404 page not found\n", "Not Found"),
                               _answer(200, b"<html><body>proxy</body></html>"),
                               _answer(rng.choice((100, 204, 302, 999)), body)))
        if kind == "framing":
            roll = rng.randrange(6)
            if roll == 0:
                return whole.replace(b"Content-Length: ", b"Content-Length: " + rng.choice((b"9", b"-", b"x")), 1)
            if roll == 1:
                return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + \
                    rng.choice((b"-1", b"zz", b"fffffffffffffffffff", b"")) + b"\r\n" + body + b"\r\n0\r\n\r\n"
            if roll == 2:
                return b"HTTP/1.1 200 OK\r\nX: " + b"x" * (100 << 10)  # a head that never ends
            if roll == 3:
                return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (len(body) + 100) + body
            if roll == 4:
                return b"HTTP/1.1 OK\r\n\r\n" + body
            return mutate_bytes(rng, whole, 1 << 16)
        try:
            doc = json.loads(body)
        except ValueError:
            return whole
        if kind == "value":
            _mutate_record(rng, doc)
            return _answer(status, json.dumps(doc).encode())
        return _answer(status, _mutate_answer(rng, doc))

    def _stream(self, client: socket.socket, up: socket.socket, buf: bytearray) -> None:
        """A watch: etcd's chunks go on as they come; a plan for watches puts a junk line
        in or cuts the stream."""
        head = _read_head(up, buf)
        if head is None:
            return
        client.sendall(head + bytes(buf))
        buf.clear()
        while not self.listener.closing:
            data = up.recv(65536)
            if not data:
                return
            change = self.plan.take(watch=True)
            if change is not None:
                rng = change[1]
                roll = rng.randrange(4)
                if roll == 0:
                    return  # cut
                junk = rng.choice((b"{", b"[]", b"null", b'{"result":[]}', b'{"result":{"events":[{"kv":1}]}}',
                                   b'{"result":{"events":[{"type":"PUT","kv":{"key":"!!"}}]}}',
                                   b'{"result":{"compact_revision":"x"}}', json.dumps(json_value(rng)).encode()))
                line = junk + b"\n"
                out = b"%x\r\n%s\r\n" % (len(line), line) if roll == 1 else mutate_bytes(rng, data, 4096)
                self.plan.record(out)
                client.sendall(out)
            client.sendall(data)

    def close(self) -> None:
        self.listener.close()


class EtcdAnswersTarget(ChildTarget):
    """A manager on the etcd store, its endpoint the fuzzer's relay to a real member."""

    name = "etcd"

    def __init__(self) -> None:
        super().__init__()
        self.process: ManagerProcess | None = None
        self.cluster: EtcdCluster | None = None
        self.relay: Relay | None = None
        self.plan = _Plan()
        self.token = ""
        self.starts = 0
        self.workdir: Path | None = None
        self.vm = ""
        self.agent: AgentProcess | None = None
        self.agents = 0  # agents started over the run; each serves host fzagent<n>
        self.agent_log_pos = 0
        self.agent_exits: list[str] = []  # why agents stopped since the last unit (told in its messages)

    def start(self, workdir: Path) -> None:
        self.workdir = workdir
        self.vm = f"qmp:{workdir}/no-such-vm.qmp"  # a VM that is not there: allocation runs, the plug fails
        self.starts += 1
        self.cluster = EtcdCluster(workdir / f"etcd{self.starts}", members=1).start()
        self._seed_pool(workdir)
        member = self.cluster.members[0]
        self.relay = Relay(("127.0.0.1", member.client_port), self.plan)
        self.plan.set(0, "", 0)
        self.process = ManagerProcess(workdir / f"pool-{time.monotonic_ns()}.db", heartbeat=0.5,
                                      etcd_endpoints=[self.relay.url]).start()
        self.log_path = self.process.paths.log
        self.token = self.process.paths.token.read_text().strip()
        self._start_agent()

    def _start_agent(self) -> None:
        assert self.workdir is not None and self.relay is not None
        self.agents += 1
        log_path = self.workdir / "agent.log"
        self.agent_log_pos = log_path.stat().st_size if log_path.exists() else 0
        self.agent = AgentProcess(f"fzagent{self.agents}", log_path, db=self.workdir / "agent" / "pool.db",
                                  ttl=AGENT_TTL, resync=AGENT_RESYNC, etcd_endpoints=[self.relay.url]).start()

    def _look_at_agent(self) -> None:
        """A traceback in the agent's log is a :class:`Violation`; an agent that stopped
        without one said why, and a new one takes its place."""
        if self.agent is None:
            return
        alive = self.agent.alive()
        text, self.agent_log_pos = log_since(self.agent.log_path, self.agent_log_pos)
        if "Traceback" in text:
            at = text.index("Traceback")
            raise Violation(f"the host agent {self.agent.host} logged a traceback:\n{text[max(0, at - 300):at + 3000]}")
        if not alive:
            last = text.strip().splitlines()[-1:] or ["it logged nothing more"]
            self.agent_exits.append(f"agent {self.agent.host} stopped (exit status {self.agent.process.returncode}): "
                                    f"{last[0]}")
            self.agent.stop()
            self._start_agent()

    def _seed_pool(self, workdir: Path) -> None:
        """Two boxes that announce themselves (up while their etcd lease lives, no probe
        needed), written straight to etcd: so attaching reaches allocation, claims and
        leases, whose answers the relay then changes."""
        assert self.cluster is not None
        store = EtcdStore(self.cluster.endpoints, path=workdir / "seed.db")
        try:
            lease = store.grant_lease(3600)
            for name in ("box1", "box2"):
                devices = [{"id": f"d{i}", "class": cls, "vendor": "1b36", "model": "10f0", "capacity": 1 << 20,
                            "lease": f"t{i}"} for i, cls in enumerate(("testdev", "nvme", "testdev"))]
                store.announce_box(name, "127.0.0.1:1", None, devices, None, "g1", lease)
        finally:
            store.close()

    def stop(self) -> None:
        super().stop()
        if self.agent is not None:
            self.agent.stop()
            self.agent = None
        if self.relay is not None:
            self.relay.close()
            self.relay = None
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None

    # --- the manager's API ------------------------------------------------------------
    def _exchange(self, method: str, path: str, body: dict | None, deadline: float) -> bytes:
        assert self.process is not None
        return api_call(self.process, self.token, method, path, body, deadline)

    def probe(self, deadline: float) -> None:
        assert self.process is not None
        api_probe(self.process, self.token, ("/v1/health", "/v1/ls"), deadline)
        self._look_at_agent()

    def send(self, index: int, rng: random.Random) -> list[bytes]:
        """The unit's request and the answers the relay changed while it ran (the
        messages of this target: what the store had to parse)."""
        if index % 50 == 49 and self.workdir is not None:
            self._seed_pool(self.workdir)  # the boxes the units removed come back
        self._look_at_agent()  # a unit may ask the agent: the one it names must be serving
        kind, count = rng.choice(KINDS), rng.choice((1, 1, 2, 3))
        self.plan.set(count, kind, rng.getrandbits(32))
        method, path, body = self._request(rng)
        # the store retries an endpoint for 5 s, and a call may read several times; the
        # manager waits 35 s for an agent's answer
        asks_agent = path in ("/v1/attach", "/v1/detach") and "host" in (body or {})
        self._exchange(method, path, body, time.monotonic() + (45.0 if asks_agent else 20.0))
        changed = self.plan.set(0, "", 0)
        exits, self.agent_exits = self.agent_exits, []
        return [f"{kind} x{count}, then {method} {path} {json.dumps(body)}".encode()] + \
            [e.encode() for e in exits] + changed

    def _request(self, rng: random.Random) -> tuple[str, str, dict | None]:
        box = rng.choice(("box1", "box2", "fz"))
        roll = rng.randrange(14)
        if roll >= 12:  # the agent's turn: its host's VM, plugged or unplugged by it
            assert self.agent is not None
            if roll == 12:
                return "POST", "/v1/attach", {"vm": self.vm, "class": rng.choice(("testdev", "nvme")),
                                              "count": rng.choice((1, 2)), "host": self.agent.host}
            return "POST", "/v1/detach", {"vm": self.vm, "all": True, "host": self.agent.host}
        if roll == 9:  # the plan reads boxes, devices and claims as an allocation would
            return "POST", "/v1/attach", {"vm": self.vm, "class": rng.choice(("testdev", "nvme", None)),
                                          "count": rng.choice((1, 2, 5)), "dry_run": True,
                                          "policy": rng.choice(("pack", "spread"))}
        if roll == 10:
            return "GET", "/v1/hosts", None
        if roll == 11:
            return "POST", rng.choice(("/v1/hosts/fence", "/v1/hosts/unfence")), {"host": rng.choice(("fz-host", "h1"))}
        if roll == 0:
            return "GET", "/v1/ls", None
        if roll == 1:
            return "GET", f"/v1/status?vm={quote(self.vm)}", None
        if roll == 2:
            return "GET", "/metrics", None
        if roll in (3, 4):
            return "POST", "/v1/boxes", {"name": box, "address": f"127.0.0.1:{rng.choice((1, 9))}"}
        if roll == 5:  # box2 comes back at the next seeding
            return "POST", "/v1/boxes/remove", {"name": rng.choice(("box2", "fz"))}
        if roll == 6:
            return "POST", "/v1/attach", {"vm": self.vm, "class": rng.choice(("testdev", "nvme")),
                                          "count": rng.choice((1, 2)), "policy": rng.choice(("pack", "spread"))}
        if roll == 7:
            return "POST", "/v1/detach", {"vm": self.vm, "all": True}
        return "POST", "/v1/reconcile", {}
