"""What the etcd store reads of etcd's answers, checked before any of it is used.

An endpoint may not be etcd (a wrong URL, a proxy's error page) or may be broken; the
store indexes answers deep (``response["header"]["revision"]``, every key-value's key
and revision), so an answer of another shape would surface as a ``KeyError`` or
``TypeError`` somewhere in the middle of an allocation. Checking each answer once, where
it arrives, turns all of those into one error that names the field (a record of the
wrong shape: :class:`~dxpu_vfio.pool.etcd_records.BadRecord`, naming its key), and the
rest of the store may trust what it reads. The JSON gateway writes 64-bit numbers as strings and
leaves out fields that are zero, false or empty: both are accepted.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from typing import Any

from dxpu_vfio.pool.etcd_records import BadRecord, check_record

_NUMBER = re.compile(r"-?[0-9]{1,19}")


class EtcdAnswerError(ValueError):
    """An answer that is not what etcd sends for the call; the message names the field."""


def _number(value: object, where: str) -> None:
    kind = type(value)  # exact: a bool is no number
    if kind is str:
        if value.isascii() and value.isdigit() and len(value) <= 19 or _NUMBER.fullmatch(value):  # type: ignore
            return
    elif kind is int and -2**63 <= value < 2**64:  # type: ignore[operator]
        return
    raise EtcdAnswerError(f"{where}: {_show(value)} is not a number")


def _object(value: object, where: str) -> dict:
    if not isinstance(value, dict):
        raise EtcdAnswerError(f"{where}: {_show(value)} is not an object")
    return value


def _list(value: object, where: str) -> list:
    if not isinstance(value, list):
        raise EtcdAnswerError(f"{where}: {_show(value)} is not a list")
    return value


def _base64(value: object, where: str) -> bytes:
    """Decoded; strict, as etcd's gateway writes it (one pass: it checks and decodes)."""
    try:
        if type(value) is not str:
            raise ValueError
        return binascii.a2b_base64(value, strict_mode=True)
    except (ValueError, binascii.Error):
        raise EtcdAnswerError(f"{where}: {_show(value)} is not base64") from None


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _header(answer: dict, where: str) -> None:
    header = _object(answer.get("header"), f"{where}header")
    _number(header.get("revision"), f"{where}header.revision")


def check_kv(kv: object, where: str, prefix: str | None, *, deleted: bool = False, values: bool = True) -> dict:
    """One key-value: its key base64 of UTF-8, its value base64 of JSON, its revisions
    numbers; with ``prefix``, the record its key names of its kind's shape (a value left
    out is an empty one, unless the read asked for keys only: not ``values``). The key's
    bytes and the value's JSON are left under ``"key_bytes"`` and ``"record"`` (None where
    the answer has no value), so each is decoded once."""
    kv = _object(kv, where)
    kv["key_bytes"] = raw_key = _base64(kv.get("key"), f"{where}.key")
    try:
        key = raw_key.decode()
    except UnicodeDecodeError:
        raise EtcdAnswerError(f"{where}.key: not UTF-8") from None
    for field in ("create_revision", "mod_revision", "version", "lease"):
        if field in kv:
            _number(kv[field], f"{where}.{field}")
    kv["record"] = None
    if "value" in kv:
        raw = _base64(kv["value"], f"{where}.value")
        try:
            kv["record"] = json.loads(raw.decode()) if raw else None
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise BadRecord(key, f"holds {_show(raw[:60])}, not JSON") from None
    if prefix is not None:
        check_record(prefix, key, kv["record"], deleted=deleted or not values)
    return kv


def _range(answer: dict, where: str, prefix: str | None, asked: dict, header: bool = True) -> None:
    """Besides the types: the keys are the ones ``asked`` for (in ``[key, range_end)``,
    ascending: a paged read always moves on), and ``more`` comes with some."""
    if header:
        _header(answer, where)
    kvs = _list(answer.get("kvs", []), f"{where}kvs")
    for i, kv in enumerate(kvs):
        check_kv(kv, f"{where}kvs[{i}]", prefix, values=not asked.get("keys_only"))
    low = base64.b64decode(asked.get("key", ""))
    high = base64.b64decode(asked["range_end"]) if asked.get("range_end") else None  # None: the key alone
    keys = [kv["key_bytes"] for kv in kvs]
    for i, key in enumerate(keys):
        outside = key != low if high is None else key < low or (high != b"\0" and key >= high)  # "\0": no end
        if outside or (i and key <= keys[i - 1]):
            raise EtcdAnswerError(f"{where}kvs[{i}].key: {_show(key)} is not the next key asked for")
    if "more" in answer and not isinstance(answer["more"], bool):
        raise EtcdAnswerError(f"{where}more: {_show(answer['more'])} is not true or false")
    if answer.get("more") and not kvs:
        raise EtcdAnswerError(f"{where}more: true, with no key-values")
    if "count" in answer:
        _number(answer["count"], f"{where}count")


def _txn(answer: dict, prefix: str | None, request: dict) -> None:
    """Besides the types: one response per operation of the branch etcd says it took,
    each of that operation's kind (the store reads them by position)."""
    _header(answer, "")
    if "succeeded" in answer and not isinstance(answer["succeeded"], bool):
        raise EtcdAnswerError(f"succeeded: {_show(answer['succeeded'])} is not true or false")
    responses = _list(answer.get("responses", []), "responses")
    ops = request.get("success" if answer.get("succeeded") else "failure") or []
    if len(responses) != len(ops):
        raise EtcdAnswerError(f"responses: {len(responses)} for {len(ops)} operations")
    for i, (op, response) in enumerate(zip(ops, responses)):
        response = _object(response, f"responses[{i}]")
        wanted = "response_" + next(iter(op)).removeprefix("request_")
        if wanted not in response:
            raise EtcdAnswerError(f"responses[{i}]: no {wanted} (has {_show(sorted(response))})")
        if "request_range" in op:
            _range(_object(response["response_range"], f"responses[{i}].response_range"),
                   f"responses[{i}].response_range.", prefix, op["request_range"], header=False)


def _lease(answer: dict, path: str) -> None:
    if path == "/lease/grant":
        _number(answer.get("ID"), "ID")
    result = _object(answer.get("result", answer), "result") if path == "/lease/keepalive" else answer
    if "TTL" in result:
        _number(result["TTL"], "TTL")


def check(path: str, body: bytes, request: dict, prefix: str | None = None) -> dict:
    """etcd's answer to ``request`` on ``path`` (``/kv/range``, ``/kv/txn``,
    ``/lease/...``), parsed and checked: every field the store reads is there (or may be
    left out) and of its type; with ``prefix``, every record in it is of its kind's shape."""
    try:
        answer: Any = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise EtcdAnswerError(f"not JSON ({str(exc)[:80]}): {_show(body[:60])}") from None
    answer = _object(answer, "the answer")
    if path == "/kv/range":
        _range(answer, "", prefix, request)
    elif path == "/kv/txn":
        _txn(answer, prefix, request)
    elif path.startswith("/lease/"):
        _lease(answer, path)
    return answer


def check_events(events: object, prefix: str | None) -> list[dict]:
    """A watch's events: each an object with a type (PUT when left out) and a key-value
    (a DELETE's has no value)."""
    out = _list(events, "events")
    for i, event in enumerate(out):
        event = _object(event, f"events[{i}]")
        kind = event.get("type", "PUT")
        if kind not in ("PUT", "DELETE"):
            raise EtcdAnswerError(f"events[{i}].type: {_show(kind)} is neither PUT nor DELETE")
        check_kv(event.get("kv"), f"events[{i}].kv", prefix, deleted=kind == "DELETE")
    return out
