"""Run one target: send generated messages, and every ``check_every`` of them check that
the process lives (else a crash), answers a known-good request within ``hang_timeout``
(else a hang), did nothing the target's probe finds it must never do (a violation), logged
no traceback, and that its anonymous memory did not grow past
``rss_limit_mb`` over the run. Every finding gets a reproducer file: the seed, the index
range of the messages since the last good check (plus some before, for the session's
state), their bytes, the log excerpt, and the command that replays them."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from dxpu_vfio.fuzz.child import log_since
from dxpu_vfio.fuzz.peer import Hang, Violation

HISTORY = 64  # units kept before a finding (their bytes go into the reproducer)
COUNTERS = {"crash": "crashes", "hang": "hangs", "traceback": "tracebacks", "drop": "drops",
            "violation": "violations"}  # Result fields


class Target(Protocol):
    name: str
    log_path: Path

    def start(self, workdir: Path) -> None:
        """Start the server (a child process) and connect to it."""

    def stop(self) -> None:
        """End the server by pid and close everything the target opened."""

    def pid(self) -> int | None: ...

    def alive(self) -> bool: ...

    def send(self, index: int, rng: random.Random) -> list[bytes]:
        """Generate unit ``index`` from ``rng`` and send it; the wire messages it sent.
        Raises :class:`Hang` if the target stops reading or never lets a session start."""

    def probe(self, deadline: float) -> None:
        """A known-good request, answered by ``deadline`` (else :class:`Hang`)."""

    def take_drops(self) -> list[str]:
        """Sessions the target ended since the last call although the framing was intact."""


class InProcessTarget:
    """The base of a target that is a library run in the fuzzer's own process (the guest
    command channels, the pure readers): it has no server log, as what goes wrong is raised
    where the fuzzer calls it; the memory the runner watches is the fuzzer's; no session
    of it can be dropped."""

    log_path = Path("/nonexistent")

    def pid(self) -> int | None:
        return os.getpid()

    def take_drops(self) -> list[str]:
        return []


@dataclass
class Finding:
    kind: str  # crash, hang, traceback, violation, rss, drop
    index: int  # the last unit sent before it was seen
    detail: str
    reproducer: str | None = None


@dataclass
class Result:
    target: str
    seed: int
    units: int = 0
    messages: int = 0
    seconds: float = 0.0
    crashes: int = 0
    hangs: int = 0
    tracebacks: int = 0
    drops: int = 0
    violations: int = 0
    rss_start_kb: int = 0
    rss_end_kb: int = 0
    rss_max_kb: int = 0
    restarts: int = 0
    findings: list[Finding] = field(default_factory=list)
    dropped: list[Finding] = field(default_factory=list)  # sessions ended with their framing intact

    @property
    def rss_growth_kb(self) -> int:
        return max(0, self.rss_end_kb - self.rss_start_kb)

    @property
    def rate(self) -> float:
        return self.messages / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "rss_growth_kb": self.rss_growth_kb, "rate": round(self.rate, 1)}


# loaded by every Python child (PYTHONPATH): SIGQUIT dumps every thread's stack into its log,
# so a hang comes with where each thread waits; fatal signals dump too (PYTHONFAULTHANDLER)
SITECUSTOMIZE = "import faulthandler, signal\nfaulthandler.register(signal.SIGQUIT, all_threads=True)\n"


def rss_anon_kb(pid: int | None) -> int:
    """The process's anonymous resident memory (what a leak grows; shared mappings of the
    client's memfds are not counted), 0 if it is gone."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    except (OSError, TypeError):
        pass
    return 0


class Run:
    def __init__(self, target: Target, *, seed: int, start: int = 0, stop: int | None = None,
                 count: int | None = None, seconds: float | None = None, check_every: int = 8,
                 hang_timeout: float = 5.0, rss_limit_mb: float = 64.0, out: Path = Path("build/fuzz"),
                 progress: float = 0.0, fail_on_drops: bool = False) -> None:
        self.target = target
        self.seed = seed
        self.start, self.stop = start, stop
        self.count, self.seconds = count, seconds
        self.check_every = max(1, check_every)
        self.hang_timeout = hang_timeout
        self.rss_limit_kb = int(rss_limit_mb * 1024)
        self.out = out
        self.progress = progress  # seconds between progress lines (0: none)
        # a session the target ended although its framing was intact is reported; it fails
        # the run only on request (a loaded machine can make a peer look silent)
        self.fail_on_drops = fail_on_drops
        self.result = Result(target.name, seed)
        self._history: deque[tuple[int, list[bytes]]] = deque(maxlen=HISTORY)
        self._log_pos = 0
        self._workdir: Path | None = None
        self.interrupted = False

    def _done(self, index: int, started: float) -> bool:
        r = self.result
        return (self.stop is not None and index >= self.stop) or \
            (self.count is not None and r.messages >= self.count) or \
            (self.seconds is not None and time.monotonic() - started >= self.seconds)

    def execute(self) -> Result:
        r = self.result
        self._workdir = Path(tempfile.mkdtemp(prefix=f"dxpu-fuzz-{self.target.name}-"))
        site = self._workdir / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        saved_env = {k: os.environ.get(k) for k in ("PYTHONPATH", "PYTHONFAULTHANDLER")}
        os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (saved_env["PYTHONPATH"], str(site)) if x)
        os.environ["PYTHONFAULTHANDLER"] = "1"
        started = time.monotonic()
        warm_until = started + min(3.0, (self.seconds or 30) / 10)
        try:
            self.target.start(self._workdir)
            index = self._next = self.start
            try:
                index = self._loop(index, started, warm_until)
            except KeyboardInterrupt:  # SIGINT, or SIGTERM (scripts/fuzz.py): report what was done
                self.interrupted = True
                index = self._next
            self._check(index - 1)
            if not r.rss_start_kb:
                r.rss_start_kb = r.rss_max_kb
            r.rss_end_kb = rss_anon_kb(self.target.pid())
            if r.rss_end_kb - r.rss_start_kb > self.rss_limit_kb:
                self._finding("rss", index - 1, f"anonymous memory grew from {r.rss_start_kb} to "
                                                 f"{r.rss_end_kb} KiB over the run")
        finally:
            r.seconds = round(time.monotonic() - started, 3)
            self.target.stop()
            self._scan_log(self.start)  # anything logged on the way out
            if r.findings and self.target.log_path.exists():
                self.out.mkdir(parents=True, exist_ok=True)
                shutil.copy(self.target.log_path, self.out / f"{r.target}-seed{self.seed}.log")
            shutil.rmtree(self._workdir, ignore_errors=True)
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        return r

    def _loop(self, index: int, started: float, warm_until: float) -> int:
        """Send units until done; the index after the last one sent."""
        r = self.result
        last_progress = started
        while not self._done(index, started):
            rng = random.Random(f"{self.seed}:{index}")
            try:
                sent = self.target.send(index, rng)
            except Violation as exc:  # a unit that looks (a display's screenshot) saw it
                self._history.append((index, []))
                self._scan_log(index)
                self._finding("violation", index, str(exc))
                self._restart()
                index += 1
                self._next = index
                continue
            except Hang as exc:
                self._history.append((index, []))
                if self.target.alive():
                    self._finding("hang", index, f"while sending: {exc}\n{self._stacks()}")
                else:
                    self._scan_log(index)
                    self._finding("crash", index, f"the {r.target} process (pid {self.target.pid()}) died")
                self._restart()
                index += 1
                self._next = index
                continue
            self._history.append((index, sent))
            drops = self.target.take_drops()
            if drops and not self.target.alive():
                self._check(index)  # not a session it ended: the process died
            else:
                for detail in drops:
                    self._finding("drop", index, detail)
            r.messages += len(sent)
            r.units += 1
            index += 1
            self._next = index
            if r.units % self.check_every == 0:
                self._check(index - 1)
                if not r.rss_start_kb and time.monotonic() > warm_until:
                    r.rss_start_kb = rss_anon_kb(self.target.pid())
            if self.progress and time.monotonic() - last_progress > self.progress:
                last_progress = time.monotonic()
                print(f"fuzz {r.target}: {r.messages} messages in {last_progress - started:.0f} s "
                      f"({r.messages / (last_progress - started):.0f}/s), {len(r.findings)} findings", flush=True)
        return index

    def _check(self, index: int) -> None:
        r = self.result
        if self.target.alive():
            try:
                self.target.probe(time.monotonic() + self.hang_timeout)
            except Violation as exc:
                self._scan_log(index)
                self._finding("violation", index, str(exc))
                self._restart()
                return
            except Hang as exc:
                if self.target.alive():
                    self._scan_log(index)
                    self._finding("hang", index, f"{exc}\n{self._stacks()}")
                    self._restart()
                    return
        if not self.target.alive():
            self._scan_log(index)
            self._finding("crash", index, f"the {r.target} process (pid {self.target.pid()}) died")
            self._restart()
            return
        self._scan_log(index)
        r.rss_max_kb = max(r.rss_max_kb, rss_anon_kb(self.target.pid()))

    def _stacks(self) -> str:
        """Where the hung process's threads wait (faulthandler, in its log)."""
        try:
            os.kill(self.target.pid(), signal.SIGQUIT)
        except (OSError, TypeError):
            return ""
        time.sleep(0.5)
        text, self._log_pos = log_since(self.target.log_path, self._log_pos)
        return text[-6000:]

    def _scan_log(self, index: int) -> None:
        text, self._log_pos = log_since(self.target.log_path, self._log_pos)
        if "Traceback" in text:
            at = text.index("Traceback")
            self._finding("traceback", index, text[max(0, at - 300):at + 3000])

    def _restart(self) -> None:
        self.result.restarts += 1
        self.target.stop()
        self._scan_log(-1)
        self.target.start(self._workdir)  # its log is appended to: the scan goes on where it was

    def _finding(self, kind: str, index: int, detail: str) -> None:
        r = self.result
        if kind in COUNTERS:
            setattr(r, COUNTERS[kind], getattr(r, COUNTERS[kind]) + 1)
        finding = Finding(kind, index, detail[:8000])
        finding.reproducer = str(self._save(finding))
        failing = kind != "drop" or self.fail_on_drops
        (r.findings if failing else r.dropped).append(finding)
        print(f"fuzz {r.target}: {kind} after message unit {index}: {detail.splitlines()[0] if detail else ''}"
              f" (reproducer {finding.reproducer})" + ("" if failing else "; reported, not failing"), flush=True)

    def _save(self, finding: Finding) -> Path:
        units = list(self._history)
        first = units[0][0] if units else finding.index
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"{self.result.target}-{finding.kind}-seed{self.seed}-{finding.index}.json"
        path.write_text(json.dumps({
            "target": self.result.target, "kind": finding.kind, "seed": self.seed, "index": finding.index,
            "detail": finding.detail,
            "replay": f"scripts/fuzz.py --target {self.result.target} --seed {self.seed} --start {first} "
                      f"--stop {finding.index + 1} --check-every 1",
            "units": [{"index": i, "messages": [m.hex() for m in msgs]} for i, msgs in units],
        }, indent=1))
        return path
