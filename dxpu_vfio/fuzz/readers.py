"""Fuzzing a pure reader of what a peer printed or answered (a function from text to a
checked value): each unit takes one reader and a sample of its peer's output as it is
when all is well, and changes it: a JSON value anywhere in it replaced by another of any
type or removed, JSON nested past the stack, a number turned into ``nan``, ``inf``,
``1e999``, a negative, thousands of digits, another script's digits or a word; lines
dropped, repeated, cut short, joined or given CRs; bytes flipped (decoded with invalid
UTF-8 replaced, as the channels decode output); the whole repeated to :data:`BIG`.

The reader must return a value that keeps its contract (:attr:`Reader.keeps`) or raise
its refusal (:attr:`Reader.refusal`, an error that says what the peer sent); anything
else it raises, a value that breaks the contract, or a reading slower than
:data:`SLOW_S` is a finding. The probe gives every reader its sample unchanged and
checks the value, so a reader that refuses everything is a finding too. The readers run
in the fuzzer's process (they are a library), so the memory the runner watches is the
fuzzer's. Targets: ``guest-output`` (:mod:`dxpu_vfio.fuzz.guest_output`),
``fault-replies`` (:mod:`dxpu_vfio.fuzz.fault_replies`) and ``manager-answers``
(:mod:`dxpu_vfio.fuzz.manager_answers`).
"""

from __future__ import annotations

import json
import random
import re
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dxpu_vfio.fuzz.mutate import json_value, mutate_bytes, nested
from dxpu_vfio.fuzz.peer import Hang, Violation
from dxpu_vfio.fuzz.runner import InProcessTarget

SLOW_S = 2.0  # one reading of at most a few hundred KiB: a reader slower than this is quadratic somewhere
BIG = 256 << 10  # how far a unit repeats an output
NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?(?:e-?[0-9]+)?")
BAD_NUMBERS = ("nan", "NaN", "inf", "-inf", "Infinity", "1e999", "-1e999", "-1", "-0", "0", "", "1_0", "0x10",
               "\u0661\u0662", "\u00b2", "1" * 5000, "9" * 30, "1e-400", "true", "null", '"5"', "[1]", "{}", "1.5")
KINDS = ("value", "value", "value", "number", "number", "lines", "bytes", "nested", "big")
REFUSED = object()  # a Reader's expected value where its sample must be refused (an error answer)


@dataclass(frozen=True)
class Reader:
    """One reader: its sample, how to call it, what its value must keep, the error it
    refuses with, and the value the pristine sample reads as (or :data:`REFUSED`)."""

    name: str
    sample: str
    read: Callable[[str], object]
    keeps: Callable[[object], str | None]  # what the value breaks, or None
    expected: object
    refusal: type[Exception]


def _mutate_value(rng: random.Random, doc: object) -> object:
    """``doc`` (parsed JSON) with one value somewhere in it replaced by any JSON value, an
    edge number or nothing (removed from its object or list)."""
    if not isinstance(doc, (dict, list)) or not doc or rng.random() < 0.2:
        return rng.choice((json_value(rng), rng.choice((float("nan"), float("inf"), -1, -1.5, 0, 10**30, True,
                                                        "12", None, [], {}))))
    keys = list(doc) if isinstance(doc, dict) else list(range(len(doc)))
    key = rng.choice(keys)
    copy = dict(doc) if isinstance(doc, dict) else list(doc)
    if rng.random() < 0.15:
        del copy[key]  # type: ignore[arg-type]
    else:
        copy[key] = _mutate_value(rng, copy[key])  # type: ignore[index]
    return copy


def _json_spans(text: str) -> list[tuple[int, int, object]]:
    """Where in ``text`` a line carries a JSON object from its first ``{``: (start, end, value)."""
    spans, pos = [], 0
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\n")
        brace = body.find("{")
        if brace >= 0:
            try:
                spans.append((pos + brace, pos + len(body), json.loads(body[brace:])))
            except ValueError:
                pass
        pos += len(line)
    return spans


def mutate(rng: random.Random, kind: str, sample: str) -> str:
    """``sample`` changed the way ``kind`` says (:data:`KINDS`)."""
    spans = _json_spans(sample)
    if kind in ("value", "nested") and spans:
        start, end, doc = rng.choice(spans)
        if kind == "nested":
            body = nested(rng).decode()
        else:  # (NaN and Infinity come out as JSON's extensions, which Python's reader takes)
            body = json.dumps(_mutate_value(rng, doc))
        return sample[:start] + body + sample[end:]
    numbers = list(NUMBER.finditer(sample))
    if kind in ("value", "number", "nested") and numbers:
        match = rng.choice(numbers)
        return sample[:match.start()] + rng.choice(BAD_NUMBERS) + sample[match.end():]
    if kind == "big":
        return sample * max(1, BIG // max(len(sample), 1))
    if kind == "lines":
        lines = sample.splitlines(keepends=True) or [""]
        i = rng.randrange(len(lines))
        roll = rng.randrange(6)
        if roll == 0:
            del lines[i]
        elif roll == 1:
            lines.insert(i, lines[i])
        elif roll == 2:
            lines[i] = lines[i][:rng.randint(0, len(lines[i]))]  # cut short (a guest that died mid-line)
        elif roll == 3:
            lines[i] = lines[i].rstrip("\n")  # joined with the next
        elif roll == 4:
            lines.insert(i, rng.choice(("\n", "=\n", "==\n", "{\n", " \n", "\x00\n", "\r\n", "workload=\n",
                                        "cpu\n", "intr\n", "key=value=more\n", "\ufffd\n")))
        else:
            lines = [line.replace("\n", "\r\n") for line in lines]
        return "".join(lines)
    return mutate_bytes(rng, sample.encode(), 1 << 16).decode(errors="replace")


class ReaderTarget(InProcessTarget):
    """``readers``, in this process, under the target name ``name``."""

    def __init__(self, name: str, readers: tuple[Reader, ...]) -> None:
        self.name, self.readers = name, readers
        self.started = False

    def start(self, workdir: Path) -> None:
        self.started = True

    def stop(self) -> None:
        self.started = False

    def alive(self) -> bool:
        return self.started

    @staticmethod
    def _read(reader: Reader, text: str) -> object:
        """What ``reader`` made of ``text``: its value or the refusal it raised;
        :class:`Violation` for anything else, :class:`Hang` if it took past :data:`SLOW_S`."""
        started = time.monotonic()
        try:
            value = reader.read(text)
        except reader.refusal as exc:
            value = exc
            try:  # a refusal is printed to the user: one that cannot be is no refusal
                str(exc)
            except Exception as broken:  # noqa: BLE001 - what the fuzzer looks for
                raise Violation(f"the {reader.name} reader's {type(exc).__name__} cannot be printed "
                                f"({type(broken).__name__}: {broken!s:.200}), from {text[:300]!r}") from None
        except Exception as exc:  # noqa: BLE001 - what the fuzzer looks for
            raise Violation(f"the {reader.name} reader raised {type(exc).__name__}: {exc!s:.300} on "
                            f"{text[:300]!r}\n" + "".join(traceback.format_exception(exc))[-3000:]) from None
        took = time.monotonic() - started
        if took > SLOW_S:
            raise Hang(f"the {reader.name} reader took {took:.1f} s on {len(text)} characters")
        if not isinstance(value, reader.refusal):
            try:
                broken = reader.keeps(value)
            except Exception as exc:  # noqa: BLE001 - a value of a shape the check did not foresee
                broken = f"of another shape ({type(exc).__name__}: {exc!s:.100}): {str(value)[:200]}"
            if broken:
                raise Violation(f"the {reader.name} reader returned a value that is {broken}, from {text[:300]!r}")
        return value

    def send(self, index: int, rng: random.Random) -> list[bytes]:
        reader, kind = rng.choice(self.readers), rng.choice(KINDS)
        text = mutate(rng, kind, reader.sample)
        value = self._read(reader, text)
        outcome = f"refused: {value!s:.120}" if isinstance(value, reader.refusal) else "read"
        return [f"{reader.name}: {kind} -> {outcome:.200}".encode(), text.encode()[:1 << 16]]

    def probe(self, deadline: float) -> None:
        for reader in self.readers:
            value = self._read(reader, reader.sample)
            if reader.expected is REFUSED and isinstance(value, reader.refusal):
                continue
            if value != reader.expected:
                raise Violation(f"the {reader.name} reader read its sample as {str(value)[:400]}, not "
                                f"{str(reader.expected)[:400]}")
