"""The ``manager-answers`` fuzz target: the pool manager's client
(:func:`dxpu_vfio.pool.service.manager_answer`, what ``dxpu`` commands, the demo and the
agent read from the manager's API) as a manager of another version, or something else
on its socket, answers, with the generic reader fuzzing of :mod:`dxpu_vfio.fuzz.readers`.

A sample is one HTTP answer written as ``<status> <content type>`` on its first line and
the body after it: attaches, a listing, an error with its hint and logs, the metrics
text, a screenshot's PNG header (a byte per character). A 200 must come back as a JSON object or list, a text
or the PNG's bytes; anything else is a
:class:`~dxpu_vfio.pool.service.ManagerError` (an error answer with its message, kind,
hint and logs only where they are strings).
"""

from __future__ import annotations

import json
from pathlib import Path

from dxpu_vfio.fuzz.readers import REFUSED, Reader, ReaderTarget
from dxpu_vfio.pool.service import PNG_SIGNATURE, ManagerError, manager_answer

LOG = Path("/run/dxpu/pool/manager.log")
LEASE = {"lease": "l-7f3a", "vm": "qmp:/run/vm1.qmp", "device": "box1/td0", "class": "testdev", "port": "rp1",
         "host": "h1", "fence": 3, "token": "revoked"}
ANSWERS = {
    "attach": ("200 application/json", [LEASE]),
    "ls": ("200 application/json", {"devices": [{"id": "box1/td0", "class": "testdev", "available": False}],
                                    "boxes": [{"name": "box1", "state": "up"}]}),
    "error": ("409 application/json", {"error": "NoFreeDevice", "message": "no free testdev in the pool",
                                       "hint": "dxpu ls shows what is free", "logs": [str(LOG)]}),
    "metrics": ("200 text/plain; version=0.0.4", "dxpu_pool_devices{class=\"testdev\"} 4\n"),
    "screenshot": ("200 image/png", PNG_SIGNATURE.decode("latin-1") + "IHDR"),
}


def _read(text: str) -> object:
    """One answer from its text form; a first line the fuzzer broke reads as status 599."""
    head, _, body = text.partition("\n")
    word, _, kind = head.partition(" ")
    status = int(word) if word.isascii() and word.isdigit() and len(word) == 3 else 599
    return manager_answer("POST /v1/attach", status, kind, _body(kind, body), LOG)


def _body(kind: str, body: str) -> bytes:
    """The body's bytes: a PNG's a byte per character (U+0089 is its first byte) where the
    text still allows it, anything else as UTF-8."""
    if kind == "image/png":
        try:
            return body.encode("latin-1")
        except UnicodeEncodeError:  # a character the mutations made past U+00FF
            pass
    return body.encode("utf-8", "surrogateescape")


def _keeps(kind: str, value: object) -> str | None:
    wanted = bytes if kind == "image/png" else str if kind.startswith("text/") else (dict, list)
    return None if isinstance(value, wanted) else f"a {type(value).__name__} for {kind!r}"


def _sample(head: str, body: object) -> str:
    return f"{head}\n{body if isinstance(body, str) else json.dumps(body)}"


def _expected(head: str, body: object) -> object:
    return _body("image/png", body) if head.endswith("image/png") else body


READERS = tuple(
    Reader(f"manager-{name}", _sample(head, body), _read,
           lambda value, kind=head.partition(" ")[2]: _keeps(kind, value), _expected(head, body), ManagerError)
    for name, (head, body) in ANSWERS.items() if not head.startswith("4"))
ERROR = Reader("manager-error", _sample(*ANSWERS["error"]), _read,  # (bytes flipped may make its status a 200)
               lambda value: _keeps("application/json", value), REFUSED, ManagerError)


def target() -> ReaderTarget:
    return ReaderTarget("manager-answers", READERS + (ERROR,))
