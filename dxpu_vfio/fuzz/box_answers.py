"""Fuzzing what the pool manager reads from GPU boxes (:mod:`dxpu_vfio.pool.boxes`): the
fuzzer is a box a manager registered (plaintext, on loopback), and answers its INVENTORY
(registration and every heartbeat), SCREENSHOT, GRANT and REVOKE requests right or,
while a unit's plan says so, wrong.

Wrong is: the inventory's JSON mutated or at its limits (1025 devices, an id twice, a
capacity below 0, at 2^63 or a bool, strings of 257 characters, no box name); a
screenshot whose pieces disagree on the total, offer more than 64 MiB, end early, run
past the total or are shorter than their 8-byte header; a GRANT or REVOKE answer's JSON
mutated; an error reply of any errno; a frame that breaks the framing; a hang-up. A unit
is such a plan, then one thing the manager does with the box: register it, list the
pool, fetch a screenshot, remove and register it again, wait for a heartbeat, fence a
host that holds leases of the box's devices (the fuzzer allocates them in the manager's
database), which revokes each at the box, or attach one of its devices to a VM.

The VM is a real QEMU, paused before its guest runs (``-S``) and without a root port: the
manager asks the box for a token (GRANT) and, whatever the answer, cannot plug the
device, so every attach is rolled back (a token it got is revoked at the box). No GRANT
reaches a box without a running VM, and a plug that finished would need the box to
serve the device, which this one does not.

The probe is ``GET /v1/health``. A traceback in the manager's log is a finding: whatever
a box sends must become a :class:`~dxpu_vfio.pool.boxes.BoxUnreachable` that says what
it sent. So is a fence that leaves the host a lease, or answers without saying what
became of each lease's token, and an attach that does not answer with an error, leaves
the VM a lease, or leaves a lease it asked a token for unrevoked at the box.
"""

from __future__ import annotations

import errno
import json
import random
import socket
import struct
import threading
import time
from pathlib import Path
from urllib.parse import quote

from dxpu_vfio.fuzz.child import ChildTarget
from dxpu_vfio.fuzz.listener import Listener
from dxpu_vfio.fuzz.mutate import edge, mutate_json
from dxpu_vfio.fuzz.manager import api_call, api_probe
from dxpu_vfio.fuzz.peer import Violation
from dxpu_vfio.link.protocol import LinkCommand as L
from dxpu_vfio.pool.boxes import MAX_DEVICES, MAX_FIELD, MAX_SCREENSHOT
from dxpu_vfio.pool.service import ManagerProcess
from dxpu_vfio.pool.storage import NoFreeDevice
from dxpu_vfio.pool.store import Store
from dxpu_vfio.vfio_user import protocol as vp
from dxpu_vfio.vfio_user.connection import Connection, ConnectionClosed
from dxpu_vfio.vmm.naming import target_key
from dxpu_vfio.vms.runner import Vm, VmConfig

BOX = "fzbox"
HOST = "fzhost"  # the host the fence action allocates leases to, then fences
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 40  # what the fuzzer's display shows (10 KiB)
KINDS = ("inventory", "inventory", "limits", "screenshot", "screenshot", "grant", "grant", "revoke", "error", "framing",
         "close")
TOKEN = "fz" + "0123456789abcdef" * 3  # what the fuzzer's box grants when it answers right


def _device(i: int, cls: str = "display") -> dict:
    return {"id": f"fb{i}" if cls == "display" else f"td{i}", "class": cls, "vendor": "1234", "model": "1111",
            "capacity": 16 << 20}


INVENTORY = {"box": BOX, "devices": [_device(0), _device(1, "testdev")]}


class FakeBox:
    """A listener answering one request per connection, as a box does for a manager;
    ``plan`` (kind, rng, answers left) says how the next answers go wrong."""

    def __init__(self) -> None:
        sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{sock.getsockname()[1]}"
        self.lock = threading.Lock()
        self.kind, self.rng, self.left = "", random.Random(0), 0
        self.sent: list[bytes] = []
        self.asked: dict[int, list[str]] = {L.GRANT: [], L.REVOKE: []}  # the leases GRANT and REVOKE named
        self.listener = Listener(sock, self._serve, "fake-box")

    def plan(self, kind: str, seed: int, count: int) -> list[bytes]:
        """A new plan; what the last one sent."""
        with self.lock:
            self.kind, self.rng, self.left = kind, random.Random(seed), count
            sent, self.sent = self.sent, []
        return sent

    def _serve(self, sock: socket.socket) -> None:
        sock.settimeout(5.0)
        conn = Connection(sock)
        try:
            while True:  # a screenshot is several requests on one link
                msg = conn.receive()
                with self.lock:
                    change = (self.kind, self.rng) if self.left > 0 else None
                    self.left -= change is not None
                    if msg.header.command in self.asked:  # the manager's own requests: well-formed
                        self.asked[msg.header.command].append(json.loads(bytes(msg.payload))["lease"])
                out = self._answer(msg.header, bytes(msg.payload), change)
                if change is not None:
                    with self.lock:
                        self.sent.append((out or b"(hung up)")[:1 << 16])
                if out is None:
                    return
                conn.send(out)
        except (ConnectionClosed, vp.ProtocolError, OSError):
            return
        finally:
            conn.close()

    def _answer(self, hdr: vp.Header, payload: bytes, change: tuple[str, random.Random] | None) -> bytes | None:
        kind, rng = change if change is not None else ("", random.Random(0))
        if kind == "close":
            return None
        if kind == "error":
            return vp.error_reply(hdr.msg_id, hdr.command, rng.choice((errno.ENODEV, errno.EINVAL, 0, 1, 255,
                                                                       edge(rng, 32))))
        if kind == "framing":
            roll = rng.randrange(3)
            if roll == 0:
                return vp.HEADER.pack(hdr.msg_id, hdr.command, rng.choice((0, 15, vp.MAX_MESSAGE + 1, 0xFFFFFFFF)),
                                      vp.TYPE_REPLY, 0)
            if roll == 1:
                return vp.message(hdr.msg_id, hdr.command, b"{}", reply=True)[:rng.randint(1, 17)]
            return rng.randbytes(rng.randint(1, 64))
        if hdr.command == L.INVENTORY:
            return vp.message(hdr.msg_id, hdr.command, self._inventory(kind, rng), reply=True)
        if hdr.command == L.SCREENSHOT:
            try:
                offset = int(json.loads(payload).get("offset", 0))
            except (ValueError, AttributeError, TypeError):
                offset = 0
            return vp.message(hdr.msg_id, hdr.command, self._piece(kind, rng, offset), reply=True)
        if hdr.command == L.GRANT:
            answer = (mutate_json(rng, {"token": TOKEN}, {"token": (None, "", "short", "x" * 31, 7, [], {})})
                      if kind == "grant" else json.dumps({"token": TOKEN}).encode())
            return vp.message(hdr.msg_id, hdr.command, answer, reply=True)
        if hdr.command == L.REVOKE:
            answer = (mutate_json(rng, {"revoked": True}, {"revoked": (False, None, 1, "yes", [], {})})
                      if kind == "revoke" else json.dumps({"revoked": True}).encode())
            return vp.message(hdr.msg_id, hdr.command, answer, reply=True)
        return vp.error_reply(hdr.msg_id, hdr.command, errno.ENOTSUP)

    @staticmethod
    def _inventory(kind: str, rng: random.Random) -> bytes:
        if kind == "inventory":
            return mutate_json(rng, INVENTORY, {"box": (BOX, "", "x" * 300, None), "devices": ([], [1], None, {})})
        if kind != "limits":
            return json.dumps(INVENTORY).encode()
        devices = [dict(d) for d in INVENTORY["devices"]]
        roll = rng.randrange(6)
        if roll == 0:
            devices = [_device(i, "testdev") for i in range(MAX_DEVICES + rng.choice((0, 1)))]
        elif roll == 1:
            devices.append(dict(devices[0]))  # an id twice
        elif roll == 2:
            devices[0]["capacity"] = rng.choice((-1, 1 << 63, (1 << 63) - 1, True, 1.5, "16"))
        elif roll == 3:
            devices[0][rng.choice(("id", "class", "vendor", "model"))] = rng.choice(("", "x" * (MAX_FIELD + 1),
                                                                                    "x" * MAX_FIELD, 7, None))
        elif roll == 4:
            devices[0] = rng.choice((None, [], "fb0", {}))
        return json.dumps({"box": BOX if roll != 5 else rng.choice(("", None, "b" * (MAX_FIELD + 1))),
                           "devices": devices}).encode()

    @staticmethod
    def _piece(kind: str, rng: random.Random, offset: int) -> bytes:
        total, piece = len(PNG), PNG[offset:offset + 4096]
        if kind == "screenshot":
            roll = rng.randrange(6)
            if roll == 0:
                total += rng.choice((1, -1, 4096))  # the pieces disagree on the total
            elif roll == 1:
                total = rng.choice((MAX_SCREENSHOT + 1, 1 << 63, (1 << 64) - 1))
            elif roll == 2:
                piece = b""  # ended early
            elif roll == 3:
                piece += b"x" * rng.choice((1, 4096))  # past the total
            elif roll == 4:
                return rng.randbytes(rng.randrange(8))  # shorter than its header
            else:
                total = 0
        return struct.pack("<Q", total % (1 << 64)) + piece

    def close(self) -> None:
        self.listener.close()


class BoxAnswersTarget(ChildTarget):
    """A manager (SQLite) with the fuzzer's box registered, and a paused VM to attach to."""

    name = "box-answers"

    def __init__(self) -> None:
        super().__init__()
        self.process: ManagerProcess | None = None
        self.store: Store | None = None  # the manager's database, where the fence action allocates
        self.box: FakeBox | None = None
        self.vm: Vm | None = None
        self.starts = 0
        self.token = ""

    def start(self, workdir: Path) -> None:
        self.box = FakeBox()
        self.starts += 1
        self.vm = Vm(VmConfig(name=f"fzgrant{self.starts}", memory_mib=128, cpus=1, root_ports=0,
                              extra_args=["-S"])).start()
        db = workdir / f"pool-{time.monotonic_ns()}.db"
        self.process = ManagerProcess(db, heartbeat=0.5).start()
        self.store = Store(db)
        self.log_path = self.process.paths.log
        self.token = self.process.paths.token.read_text().strip()
        self._exchange("POST", "/v1/boxes", {"name": BOX, "address": self.box.address}, time.monotonic() + 10)

    def stop(self) -> None:
        super().stop()
        if self.store is not None:
            self.store.close()
            self.store = None
        if self.box is not None:
            self.box.close()
            self.box = None
        if self.vm is not None:
            self.vm.__exit__(None)  # ended by pid, its directory removed
            self.vm = None

    def _exchange(self, method: str, path: str, body: dict | None, deadline: float) -> bytes:
        assert self.process is not None
        return api_call(self.process, self.token, method, path, body, deadline)

    def probe(self, deadline: float) -> None:
        assert self.process is not None
        api_probe(self.process, self.token, ("/v1/health",), deadline)

    def send(self, index: int, rng: random.Random) -> list[bytes]:
        """The unit's action and the answers the box changed while it ran."""
        assert self.box is not None
        kind, count = rng.choice(KINDS), rng.choice((1, 1, 2))
        self.box.plan(kind, rng.getrandbits(32), count)
        roll = 5 if kind == "grant" else rng.randrange(7)  # only an attach asks for a token
        deadline = time.monotonic() + 20.0  # a screenshot's exchange may take its pieces' round trips
        if roll == 0:
            action = f"register {self.box.address}"
            self._exchange("POST", "/v1/boxes", {"name": BOX, "address": self.box.address}, deadline)
        elif roll == 1:
            action = "screenshot"
            self._exchange("GET", f"/v1/screenshot?device={quote(BOX + '/fb0')}", None, deadline)
        elif roll == 2:
            action = "ls"
            self._exchange("GET", "/v1/ls", None, deadline)
        elif roll == 3:
            action = "remove, register"
            self._exchange("POST", "/v1/boxes/remove", {"name": BOX}, deadline)
            self._exchange("POST", "/v1/boxes", {"name": BOX, "address": self.box.address}, deadline)
        elif roll == 4:
            action = "a heartbeat"
            time.sleep(0.6)
        elif roll == 5:
            action = self._attach(rng, deadline)
        else:
            action = self._fence(rng, deadline)
        changed = self.box.plan("", 0, 0)
        return [f"{kind} x{count}, then {action}".encode()] + changed

    def _attach(self, rng: random.Random, deadline: float) -> str:
        """``POST /v1/attach`` of one of the box's devices to the paused VM. The manager
        asks the box for a token first (GRANT); with or without one the plug cannot
        finish (no root port), so the answer must be an error, the VM left no lease, and
        every lease the box was asked a token for revoked at the box (a box may have
        granted one although its answer broke on the way)."""
        assert self.vm is not None and self.store is not None and self.box is not None
        vm = f"qmp:{self.vm.admin_qmp_path}"
        with self.box.lock:
            for asked in self.box.asked.values():
                asked.clear()
        answer = self._exchange("POST", "/v1/attach", {"vm": vm, "class": rng.choice(("display", "testdev"))},
                                deadline)
        with self.box.lock:
            unrevoked = sorted(set(self.box.asked[L.GRANT]) - set(self.box.asked[L.REVOKE]))
        if unrevoked:  # the box may have granted though its answer broke: the rollback must revoke
            raise Violation(f"an attach asked the box for tokens of leases {unrevoked} and its rollback did not "
                            f"revoke them; it was answered {answer[:300]!r}")
        head, _, body = answer.partition(b"\r\n\r\n")
        try:
            message = str(json.loads(body).get("message"))
        except (ValueError, AttributeError):
            raise Violation(f"an attach was answered {answer[:300]!r}") from None
        left = [lease.id for lease in self.store.leases(target_key(vm))]
        if head.split(b" ", 2)[1:2] == [b"200"] or left:
            raise Violation(f"an attach that could not plug was answered {answer[:300]!r}; leases left: {left}")
        return f"attach ({message[:120]})"

    def _fence(self, rng: random.Random, deadline: float) -> str:
        """Leases of the box's devices for :data:`HOST`, then ``POST /v1/hosts/fence``:
        the manager revokes each at the box. Its answer must name every lease with what
        became of its token, and the host must hold none after; then it is unfenced."""
        assert self.store is not None
        try:
            leases = self.store.allocate("fzvm", device_class=rng.choice(("display", "testdev")), host=HOST)
        except NoFreeDevice:  # the box's registration failed in an earlier unit, or a lease is left
            return "fence (no device free)"
        answer = self._exchange("POST", "/v1/hosts/fence", {"host": HOST}, deadline)
        try:
            body = json.loads(answer.partition(b"\r\n\r\n")[2])
            told = {row["lease"]: row["token"] for row in body["leases"]}
        except (ValueError, KeyError, TypeError) as exc:
            raise Violation(f"the fence of {HOST} was answered {answer[:300]!r} ({exc})") from None
        missing = [lease.id for lease in leases if not isinstance(told.get(lease.id), str)]
        left = [lease.id for lease in self.store.leases() if lease.host == HOST]
        self._exchange("POST", "/v1/hosts/unfence", {"host": HOST}, deadline)
        if missing or left:
            raise Violation(f"fencing {HOST}: leases {missing} not reported, {left} still held ({told})")
        return f"fence ({', '.join(sorted(set(told.values())))})"
