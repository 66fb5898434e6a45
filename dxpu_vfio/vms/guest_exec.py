"""Running commands in a guest and getting output and exit code back.

Two channels, one interface (:class:`GuestChannel`):

* :class:`SerialChannel` for the ``tiny`` image: a busybox script on the guest's
  second serial port (``vm_images/tiny/dxpu-serial-agent``), lines framed as
  ``<id> OUT|ERR <base64>`` and ``<id> RC <code>``.
* :class:`AgentChannel` for the ``full`` image: qemu-guest-agent's ``guest-exec``.

Both wait with a timeout and check that QEMU is still alive while they wait, so a
guest that panics (QEMU exits, ``-no-reboot``) is reported at once, never a hang.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from dxpu_vfio.errors import GuestCommandFailed, GuestCommandTimeout, VmError


@dataclass(frozen=True)
class CommandResult:
    """What a guest command did."""

    rc: int
    stdout: str
    stderr: str
    polls: int = 0  # guest-exec-status calls it took to see the end (the agent's channel; 0 on the serial one)

    def __str__(self) -> str:
        return f"exit {self.rc}; stdout {self.stdout[-400:]!r}; stderr {self.stderr[-400:]!r}"


GUEST_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
POLL_FIRST, POLL_MAX = 0.01, 0.25  # s between guest-exec-status polls: first, and at most
SERIAL_MAX_LINE = 1 << 20  # the serial agent's lines are base64's 76 characters and a tag
# qemu-guest-agent sends a command's whole output in one guest-exec-status line: up to
# 16 MiB of stdout and of stderr (its GUEST_EXEC_MAX_OUTPUT), base64, 43 MiB in all
AGENT_MAX_LINE = 48 << 20
MAX_OUTPUT = 64 << 20  # the serial channel's base64 output lines of one command, together


class GuestDied(VmError):
    """QEMU exited while we were waiting for the guest (the VM turns it into a better error)."""


class ChannelBlocked(VmError):
    """The guest channel takes no more bytes now (its agent not reading yet): not an answer."""


class GuestProtocolError(VmError):
    """The guest answered with bytes that are not its channel's protocol: a broken or
    hostile guest agent. Says what it sent; the channel stays usable (a later request
    skips what is left of the bad answer)."""


def _shown(data: bytes | str) -> str:
    return repr(data[:80]) + ("..." if len(data) > 80 else "")


class GuestChannel(Protocol):
    def open(self, timeout: float) -> None: ...
    def ping(self, timeout: float) -> bool: ...
    def run(self, script: str, timeout: float) -> CommandResult: ...
    def request_poweroff(self) -> None: ...
    def close(self) -> None: ...


def wait_ready(channel: "GuestChannel", deadline: float) -> bool:
    """Open ``channel`` and ping until the guest answers (True) or ``deadline`` passes.

    :class:`GuestDied` propagates: the caller knows best why its guest is gone.
    """
    channel.open(max(1.0, deadline - time.monotonic()))
    while time.monotonic() < deadline:
        if channel.ping(min(3.0, max(0.5, deadline - time.monotonic()))):
            return True
    return False


def run_checked(channel: "GuestChannel", script: str, timeout: float, check: bool,
                died: Callable[[str], VmError], logs: list[Path]) -> CommandResult:
    """Run ``script``; a dead guest raises ``died(when)``, a failure (if ``check``)
    :class:`GuestCommandFailed` naming ``logs``."""
    try:
        result = channel.run(script, timeout)
    except GuestDied as exc:
        raise died(f"while running {script!r}") from exc
    if check and result.rc != 0:
        raise GuestCommandFailed(script, result, logs=logs)
    return result


class _LineSocket:
    """A UNIX stream socket read line by line, each wait bounded and checking liveness,
    each line at most ``max_line`` bytes (the guest decides how long it is)."""

    def __init__(self, path: Path, alive: Callable[[], bool], max_line: int) -> None:
        self.path = path
        self.alive = alive
        self.max_line = max_line
        self.sock: socket.socket | None = None
        self.buffer = bytearray()
        self._scanned = 0  # the buffer holds no newline before this
        self._skipping = False  # inside a line that was too long: dropped up to its newline

    def clear(self) -> None:
        """Forget what was received and not yet read (stale answers)."""
        self.buffer.clear()
        self._scanned = 0

    def connect(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(str(self.path))
                sock.settimeout(0.2)
                self.sock = sock
                return
            except OSError as exc:
                sock.close()
                if not self.alive():
                    raise GuestDied("QEMU exited before its guest channel opened") from exc
                if time.monotonic() > deadline:
                    raise VmError(f"cannot connect to guest channel {self.path}: {exc}") from exc
                time.sleep(0.05)

    def send(self, data: bytes) -> None:
        assert self.sock is not None
        try:
            self.sock.sendall(data)
        except socket.timeout as exc:  # QEMU does not drain it: no agent reads yet (a slow boot), or QEMU died
            if not self.alive():
                raise GuestDied(f"QEMU exited while writing to guest channel {self.path}") from exc
            raise ChannelBlocked(f"guest channel {self.path} does not drain") from exc
        except OSError as exc:
            raise GuestDied(f"guest channel {self.path} closed: {exc}") from exc

    def readline(self, deadline: float) -> bytes | None:
        """One line without its newline, or None when the deadline passes;
        :class:`GuestProtocolError` for a line past ``max_line``: what came of it is
        dropped, and later reads drop the rest of it up to its newline."""
        assert self.sock is not None
        while True:
            end = self.buffer.find(b"\n", self._scanned)
            if end >= 0 and self._skipping:  # the end of a line too long
                del self.buffer[:end + 1]
                self._scanned, self._skipping = 0, False
                continue
            if end >= 0:
                break
            self._scanned = len(self.buffer)
            if self._skipping:
                self.clear()
            elif self._scanned > self.max_line:
                self.clear()
                self._skipping = True
                raise GuestProtocolError(f"the guest sent a line of more than {self.max_line} bytes on {self.path}")
            if time.monotonic() > deadline:
                return None
            try:
                chunk = self.sock.recv(65536)
            except socket.timeout:
                if not self.alive():
                    raise GuestDied("QEMU exited while waiting for the guest")
                continue
            except OSError as exc:
                raise GuestDied(f"guest channel {self.path} failed: {exc}") from exc
            if not chunk:
                raise GuestDied(f"guest channel {self.path} closed by QEMU")
            self.buffer += chunk
        line = bytes(self.buffer[:end])
        del self.buffer[:end + 1]
        self._scanned = 0
        if len(line) > self.max_line:
            raise GuestProtocolError(f"the guest sent a line of {len(line)} bytes on {self.path}, "
                                     f"more than {self.max_line}")
        return line.rstrip(b"\r")

    def close(self) -> None:
        if self.sock:
            self.sock.close()
            self.sock = None


class SerialChannel:
    """Commands over the tiny guest's ttyS1 (see ``vm_images/tiny/dxpu-serial-agent``)."""

    def __init__(self, path: Path, alive: Callable[[], bool], *, max_line: int = SERIAL_MAX_LINE,
                 max_output: int = MAX_OUTPUT) -> None:
        self._io = _LineSocket(path, alive, max_line)
        self.max_output = max_output
        self._ids = itertools.count(1)

    def open(self, timeout: float) -> None:
        self._io.connect(timeout)

    def _request(self, script: str, deadline: float) -> CommandResult | None:
        tag = f"DXPU{next(self._ids)}"
        payload = base64.b64encode(script.encode()).decode()
        self._io.send(f"\n{tag} {payload}\n".encode())
        out: list[str] = []
        err: list[str] = []
        size = 0
        while (line := self._io.readline(deadline)) is not None:
            parts = line.decode(errors="replace").split(" ", 2)
            if parts[0] != tag:
                continue  # an earlier request's late answer, or noise
            if len(parts) < 3 or parts[1] not in ("OUT", "ERR", "RC"):
                raise GuestProtocolError(f"the guest's serial agent answered {tag} with {_shown(line)}, "
                                         "not OUT, ERR or RC and its data")
            kind, data = parts[1], parts[2]
            if kind == "RC":
                if not re.fullmatch(r"-?[0-9]{1,12}", data):
                    raise GuestProtocolError(f"the guest's serial agent ended {tag} with exit code {_shown(data)}, "
                                             "not a number")
                return CommandResult(int(data), _b64_text(out, tag, "stdout"), _b64_text(err, tag, "stderr"))
            size += len(data)
            if size > self.max_output:
                raise GuestProtocolError(f"the guest's serial agent sent more than {self.max_output} bytes of "
                                         f"output for {tag}")
            (out if kind == "OUT" else err).append(data)
        return None

    def ping(self, timeout: float) -> bool:
        try:
            return self._request("echo pong", time.monotonic() + timeout) is not None
        except GuestProtocolError:  # not an answer: the caller pings again
            return False

    def request_poweroff(self) -> None:
        """Ask the guest to power off; it will not answer, QEMU just exits."""
        self._io.send(f"\nDXPU0 {base64.b64encode(b'poweroff -f').decode()}\n".encode())

    def run(self, script: str, timeout: float) -> CommandResult:
        result = self._request(script, time.monotonic() + timeout)
        if result is None:
            raise GuestCommandTimeout(f"guest command did not finish within {timeout:.0f} s: {script!r}")
        return result

    def close(self) -> None:
        self._io.close()


def _b64_text(lines: list[str], tag: str, what: str) -> str:
    return _b64_decode("".join(lines), f"the {what} of {tag}")


def _b64_decode(data: object, what: str) -> str:
    """Base64 from the guest as text; :class:`GuestProtocolError` if it is not base64."""
    try:
        if not isinstance(data, str):
            raise ValueError(f"a {type(data).__name__}")
        return base64.b64decode(data, validate=True).decode(errors="replace")
    except (ValueError, binascii.Error) as exc:
        raise GuestProtocolError(f"the guest sent {what} as {_shown(str(data))}, not base64 ({exc})") from None


def _number(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise GuestProtocolError(f"the guest agent sent {what} {_shown(json.dumps(value))}, not an integer")
    return value


def _exited(status: dict) -> bool:
    exited = status.get("exited")
    if not isinstance(exited, bool):
        raise GuestProtocolError(f"the guest agent sent guest-exec-status's exited as "
                                 f"{_shown(json.dumps(exited))}, not true or false")
    return exited


class AgentChannel:
    """Commands through qemu-guest-agent (``guest-exec`` + ``guest-exec-status``)."""

    def __init__(self, path: Path, alive: Callable[[], bool], *, max_line: int = AGENT_MAX_LINE) -> None:
        self._io = _LineSocket(path, alive, max_line)
        self._ids = itertools.count(1000)

    def open(self, timeout: float) -> None:
        self._io.connect(timeout)

    def _call(self, command: str, arguments: dict | None, deadline: float) -> dict | None:
        """The agent's ``return`` object for ``command``; None if it does not answer by
        ``deadline``."""
        msg: dict = {"execute": command}
        if arguments:
            msg["arguments"] = arguments
        self._io.send(json.dumps(msg).encode() + b"\n")
        while (line := self._io.readline(deadline)) is not None:
            line = line.strip(b"\xff").strip()
            if not line:
                continue
            try:
                reply = json.loads(line)
            except (ValueError, RecursionError):
                raise GuestProtocolError(f"the guest agent answered {command} with {_shown(line)}, not JSON") from None
            if not isinstance(reply, dict):
                raise GuestProtocolError(f"the guest agent answered {command} with {_shown(line)}, not an object")
            if "error" in reply:
                raise VmError(f"guest agent {command} failed: {_shown(json.dumps(reply['error']))}")
            if "return" in reply:
                if not isinstance(reply["return"], dict):
                    raise GuestProtocolError(f"the guest agent answered {command} with {_shown(line)}: "
                                             "its return is not an object")
                return reply["return"]
        return None

    def _sync(self, deadline: float) -> bool:
        """guest-sync-delimited: flushes stale replies, proves the agent is there."""
        token = next(self._ids)
        self._io.clear()
        try:  # the 0xff resets the agent's parser after a request cut short by a blocked send
            self._io.send(b"\xff" + json.dumps({"execute": "guest-sync-delimited",
                                                "arguments": {"id": token}}).encode() + b"\n")
        except ChannelBlocked:  # a booting guest's agent is not reading yet: no answer this time
            time.sleep(max(0.0, min(1.0, deadline - time.monotonic())))
            return False
        while (line := self._io.readline(deadline)) is not None:
            line = line.split(b"\xff")[-1].strip()
            if line:
                try:
                    reply = json.loads(line)
                except (ValueError, RecursionError):
                    continue  # what is left of a stale or broken answer: the sync skips it
                if isinstance(reply, dict) and reply.get("return") == token:
                    return True
        return False

    def ping(self, timeout: float) -> bool:
        return self._sync(time.monotonic() + timeout)

    def request_poweroff(self) -> None:
        """guest-shutdown: systemd powers off; the agent sends no reply on success."""
        self._io.send(json.dumps({"execute": "guest-shutdown", "arguments": {"mode": "powerdown"}}).encode() + b"\n")

    def spawn(self, script: str, timeout: float = 10) -> int:
        """Start a script in the guest and return its pid without waiting for it."""
        deadline = time.monotonic() + timeout
        if not self._sync(deadline):
            raise GuestCommandTimeout("guest agent does not answer guest-sync")
        started = self._call("guest-exec", {"path": "/bin/sh", "arg": ["-c", script],
                                            "env": [GUEST_PATH], "capture-output": True}, deadline)
        if started is None:
            raise GuestCommandTimeout(f"guest-exec not acknowledged: {script!r}")
        return _number(started.get("pid"), "guest-exec's pid")

    def wait(self, pid: int, timeout: float) -> CommandResult:
        """Wait for a spawned script; :class:`GuestCommandTimeout` if it runs on.

        Polls ``guest-exec-status`` at growing intervals (POLL_FIRST to POLL_MAX): each poll
        costs the TCG guest about 20 ms of CPU (the agent answers and logs it through
        journald), so polling every 50 ms took 40-50 % of a vCPU for as long as a command
        ran, from the very workload a benchmark measures (docs/benchmarks.md, "NVMe")."""
        deadline = time.monotonic() + timeout
        interval = POLL_FIRST
        polls = 0
        while time.monotonic() < deadline:
            status = self._call("guest-exec-status", {"pid": pid}, deadline)
            polls += 1
            if status is not None and _exited(status):
                if "exitcode" in status:
                    rc = _number(status["exitcode"], "guest-exec-status's exitcode")
                else:
                    rc = -_number(status.get("signal", 1), "guest-exec-status's signal") or -1
                return CommandResult(rc, _b64_decode(status.get("out-data", ""), f"the stdout of guest pid {pid}"),
                                     _b64_decode(status.get("err-data", ""), f"the stderr of guest pid {pid}"), polls)
            time.sleep(max(0.0, min(interval, deadline - time.monotonic())))
            interval = min(POLL_MAX, interval * 1.5)
        raise GuestCommandTimeout(f"guest process {pid} did not finish within {timeout:.0f} s")

    def run(self, script: str, timeout: float) -> CommandResult:
        deadline = time.monotonic() + timeout
        pid = self.spawn(script, min(timeout, 10))
        try:
            return self.wait(pid, max(0.1, deadline - time.monotonic()))
        except GuestCommandTimeout as exc:
            raise GuestCommandTimeout(f"guest command did not finish within {timeout:.0f} s: {script!r}") from exc

    def close(self) -> None:
        self._io.close()
