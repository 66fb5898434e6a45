"""Fuzzing the host half of the guest command channels (:mod:`dxpu_vfio.vms.guest_exec`)
as a broken or hostile guest reaches it: the fuzzer is the guest end of both, the tiny
image's serial agent (lines ``<id> OUT|ERR <base64>``, ``<id> RC <code>``) and
qemu-guest-agent (``guest-sync-delimited``, ``guest-exec``, ``guest-exec-status``), on
UNIX sockets as QEMU's chardevs offer them.

Each unit runs one command on one channel while the guest end answers it right or, as
the unit's plan says, wrong: an exit code that is not a number, output that is not
base64, a kind of line the protocol has not, another command's tag, bytes mutated,
invalid UTF-8 and NULs, a line past the channel's limit or more output than it takes, a
reply's JSON mutated or of another shape (a list, a string, nested past the stack),
fields of another type (pid, exitcode, signal, exited, out-data), an error object of any
shape, silence, a hang-up mid-answer.

Every call must end in a :class:`~dxpu_vfio.vms.guest_exec.CommandResult` or a
:class:`~dxpu_vfio.errors.VmError` that says what the guest sent, within its timeout;
anything else it raises is a violation, and so is a call that runs past its timeout. A
channel the guest hung up on is opened again for the next unit. The probe runs a command
on both channels with the guest answering right, so a channel that junk left out of step
is a finding too. The channels run in the fuzzer's own process (they are a library: the
VM runner's), so the memory the runner watches is the fuzzer's.
"""

from __future__ import annotations

import base64
import json
import random
import socket
import threading
import time
import traceback
from pathlib import Path

from dxpu_vfio.errors import VmError
from dxpu_vfio.fuzz.listener import Listener
from dxpu_vfio.fuzz.mutate import json_value, mutate_bytes, mutate_json, nested
from dxpu_vfio.fuzz.peer import Hang, Violation
from dxpu_vfio.fuzz.runner import InProcessTarget
from dxpu_vfio.vms import guest_exec
from dxpu_vfio.vms.guest_exec import AgentChannel, CommandResult, SerialChannel

TIMEOUT = 0.5  # a unit's command: the guest end answers at once, or (silence) never
# the channels' limits, small here so that a unit past them costs little time and memory
# (the checks do not depend on the sizes; tests/test_guest_exec.py runs the real ones)
MAX_LINE, MAX_OUTPUT = 64 << 10, 1 << 20
SERIAL_KINDS = ("rc", "b64", "kind", "tag", "bytes", "long", "flood", "silence", "close")
AGENT_KINDS = ("json", "json", "shape", "fields", "fields", "error", "bytes", "long", "silence", "close")


def _expected(script: str) -> str:
    return f"ran {script}\n"


class _Plan:
    """How the guest end answers the unit's command (read by its connection threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.kind, self.rng = "", random.Random(0)
        self.sent: list[bytes] = []

    def set(self, kind: str, seed: int) -> list[bytes]:
        with self.lock:
            self.kind, self.rng = kind, random.Random(seed)
            sent, self.sent = self.sent, []
        return sent

    def take(self) -> tuple[str, random.Random]:
        with self.lock:
            return self.kind, self.rng

    def record(self, data: bytes) -> None:
        with self.lock:
            self.sent.append(data[:1 << 16])


class FakeGuest:
    """A listener on ``path`` whose connections answer as a guest's agent would; ``agent``
    picks the protocol."""

    def __init__(self, path: Path, agent: bool, plan: _Plan) -> None:
        self.path, self.agent, self.plan = path, agent, plan
        path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        sock.listen()
        self.partial = b""  # what goes before a hang-up
        self.script = ""  # the agent's last guest-exec: what guest-exec-status reports it ran
        self.listener = Listener(sock, self._serve, "fake-guest")

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        while data := conn.recv(65536):
            buf += data
            while b"\n" in buf:
                line, _, buf = buf.partition(b"\n")
                out = self._answer_agent(line) if self.agent else self._answer_serial(line)
                if out is None:  # hang up, maybe part way through an answer
                    conn.sendall(self.partial)
                    conn.shutdown(socket.SHUT_RDWR)
                    return
                conn.sendall(out)

    # --- the serial agent (vm_images/tiny/dxpu-serial-agent) -----------------------
    def _answer_serial(self, line: bytes) -> bytes | None:
        tag, _, payload = line.strip().partition(b" ")
        if not tag.startswith(b"DXPU"):
            return b""
        script = base64.b64decode(payload).decode()
        out = base64.encodebytes(_expected(script).encode()).decode().splitlines()
        right = [f"{tag.decode()} OUT {chunk}".encode() for chunk in out] + [f"{tag.decode()} RC 0".encode()]
        kind, rng = self.plan.take()
        if tag == b"DXPU0" or not kind:  # poweroff, or no plan: right
            return b"\n".join(right) + b"\n"
        lines = self._wrong_serial(kind, rng, tag, right)
        if lines is None:
            self.partial = b"\n".join(right)[:rng.randrange(sum(map(len, right)) + 1)]
            self.plan.record(self.partial + b"(hung up)")
            return None
        answer = b"\n".join(lines) + (b"\n" if lines else b"")
        self.plan.record(answer)
        return answer

    def _wrong_serial(self, kind: str, rng: random.Random, tag: bytes, right: list[bytes]) -> list[bytes] | None:
        if kind == "rc":
            code = rng.choice((b"x", b"", b"1.5", b"-1", b"99999999999999999999999", b" 0", b"0 extra", b"\x00",
                               b"\xff\xfe", b"0x10", b"1e3", b"--5", "\u00b2".encode(), b"-"))
            return right[:-1] + [tag + b" RC " + code]
        if kind == "b64":
            bad = rng.choice((b"@@@@", b"abc", b"====", b"YQ", b"\xc3\x28", b"a" * 4097, b"Y=Q="))
            return [tag + b" OUT " + bad] + right[rng.randrange(len(right)):]
        if kind == "kind":
            return [tag + b" " + rng.choice((b"FOO x", b"OUT", b"RC", b"out YQ==", b"RCX 0", b""))] + right
        if kind == "tag":  # another command's lines first: noise to skip
            other = b"DXPU" + str(rng.randrange(10 ** 6)).encode()
            return [line.replace(tag, other, 1) for line in right] + right
        if kind == "bytes":
            return [mutate_bytes(rng, line, 256).replace(b"\n", b"") for line in right]
        if kind == "long":  # past the line limit, then the rest of the line and the right answer
            over = MAX_LINE + rng.choice((1, 4096))
            return [tag + b" OUT " + b"A" * over] + right
        if kind == "flood":  # more output than a command may give
            data = b"QUFB" * 4000
            return [tag + b" OUT " + data] * (MAX_OUTPUT // len(data) + 2) + right[-1:]
        if kind == "silence":
            return []
        return None  # close

    # --- qemu-guest-agent ---------------------------------------------------------
    def _answer_agent(self, line: bytes) -> bytes | None:
        try:
            request = json.loads(line.strip(b"\xff").strip())
        except ValueError:
            return b""
        command, args = request.get("execute"), request.get("arguments") or {}
        if command == "guest-sync-delimited":
            right = {"return": args.get("id")}
        elif command == "guest-exec":
            right = {"return": {"pid": 4242}}
            self.script = args.get("arg", ["", "", ""])[-1]
        elif command == "guest-exec-status":
            out = base64.b64encode(_expected(self.script).encode()).decode()
            right = {"return": {"exited": True, "exitcode": 0, "out-data": out}}
        else:
            return b""
        prefix = b"\xff" if command == "guest-sync-delimited" else b""
        kind, rng = self.plan.take()
        if not kind or command == "guest-sync-delimited" and rng.random() < 0.8:
            return prefix + json.dumps(right).encode() + b"\n"
        answer = self._wrong_agent(kind, rng, right)
        if answer is None:
            whole = json.dumps(right).encode()
            self.partial = whole[:rng.randrange(len(whole) + 1)]
            self.plan.record(self.partial + b"(hung up)")
            return None
        self.plan.record(answer)
        return prefix + answer

    def _wrong_agent(self, kind: str, rng: random.Random, right: dict) -> bytes | None:
        if kind == "json":
            return mutate_json(rng, right, {"return": (None, [], "x", 7, {}, True)}) + b"\n"
        if kind == "shape":
            return rng.choice((b"[]", b'"x"', b"7", b"null", b"true", nested(rng), b"{", b'{"return"')) + b"\n"
        if kind == "fields":
            ret = right["return"]
            if isinstance(ret, dict):
                ret = dict(ret)
                key = rng.choice(sorted(ret) + ["signal", "exitcode", "err-data", "out-truncated"])
                ret[key] = rng.choice((None, "x", -1, 2 ** 70, 1.5, True, [], {}, "@@@@", "YQ", json_value(rng)))
                if rng.random() < 0.3:
                    ret.pop(rng.choice(sorted(ret)), None)
            else:
                ret = json_value(rng)
            return json.dumps({"return": ret}).encode() + b"\n"
        if kind == "error":
            return json.dumps({"error": rng.choice(({"class": "GenericError", "desc": "no"}, "x", None, [], 7,
                                                    json_value(rng)))}).encode() + b"\n"
        if kind == "bytes":
            return mutate_bytes(rng, json.dumps(right).encode(), 512).replace(b"\n", b"") + b"\n"
        if kind == "long":
            return b'{"return": "' + b"A" * (MAX_LINE + rng.choice((1, 4096))) + b'"}\n'
        if kind == "silence":
            return b""
        return None  # close

    def close(self) -> None:
        self.listener.close()
        self.path.unlink(missing_ok=True)


class GuestChannelTarget(InProcessTarget):
    """Both channels, each connected to its fake guest, in this process."""

    name = "guest-channel"

    def __init__(self) -> None:
        self.plan = _Plan()
        self.guests: dict[str, FakeGuest] = {}
        self.channels: dict[str, SerialChannel | AgentChannel] = {}

    def start(self, workdir: Path) -> None:
        for name, agent in (("serial", False), ("agent", True)):
            self.guests[name] = FakeGuest(workdir / f"{name}.sock", agent, self.plan)

    def stop(self) -> None:
        for channel in self.channels.values():
            channel.close()
        self.channels.clear()
        for guest in self.guests.values():
            guest.close()
        self.guests.clear()

    def alive(self) -> bool:
        return bool(self.guests)

    def _channel(self, name: str) -> SerialChannel | AgentChannel:
        if name not in self.channels:
            path = self.guests[name].path
            channel = AgentChannel(path, alive=lambda: True, max_line=MAX_LINE) if name == "agent" else \
                SerialChannel(path, alive=lambda: True, max_line=MAX_LINE, max_output=MAX_OUTPUT)
            channel.open(2.0)
            self.channels[name] = channel
        return self.channels[name]

    def _run(self, name: str, script: str, timeout: float) -> CommandResult | VmError:
        """The command's result or the VmError it raised; :class:`Violation` for anything
        else, :class:`Hang` past the timeout."""
        outcome: list[object] = []

        def call() -> None:
            try:
                outcome.append(self._channel(name).run(script, timeout))
            except VmError as exc:
                outcome.append(exc)
            except BaseException as exc:  # noqa: BLE001 - what the fuzzer looks for
                outcome.append(Violation(f"the {name} channel raised {type(exc).__name__}: {exc!s:.300}\n"
                                         + "".join(traceback.format_exception(exc))[-3000:]))
        worker = threading.Thread(target=call, name=f"run-{name}", daemon=True)
        started = time.monotonic()
        worker.start()
        worker.join(timeout + 5.0)
        if worker.is_alive():
            raise Hang(f"the {name} channel's command ran {time.monotonic() - started:.1f} s, past its "
                       f"{timeout} s timeout")
        if isinstance(outcome[0], Violation):
            raise outcome[0]
        if isinstance(outcome[0], guest_exec.GuestDied) and name in self.channels:  # hung up on: a new one next
            self.channels.pop(name).close()
        return outcome[0]  # type: ignore[return-value]

    def send(self, index: int, rng: random.Random) -> list[bytes]:
        name = rng.choice(("serial", "agent"))
        kind = rng.choice(SERIAL_KINDS if name == "serial" else AGENT_KINDS)
        self.plan.set(kind, rng.getrandbits(32))
        script = f"echo unit {index}"
        outcome = self._run(name, script, TIMEOUT)
        sent = self.plan.set("", 0)
        return [f"{name}: {kind}, then {script!r} -> {outcome!s:.200}".encode()] + sent

    def probe(self, deadline: float) -> None:
        self.plan.set("", 0)
        for name in ("serial", "agent"):
            script = f"echo probe {name}"
            outcome = self._run(name, script, max(0.5, deadline - time.monotonic()))
            if isinstance(outcome, guest_exec.GuestDied):  # hung up on in the last unit: once more, new
                outcome = self._run(name, script, max(0.5, deadline - time.monotonic()))
            if not isinstance(outcome, CommandResult) or (outcome.rc, outcome.stdout) != (0, _expected(script)):
                raise Violation(f"the {name} channel, with the guest answering right, gave {outcome!s:.300}")
