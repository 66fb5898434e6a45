"""Values that break decoders: integers at the edges of their field, mutated bytes and
mutated JSON. Every function draws from the ``random.Random`` it is given, nothing else,
so a message is a function of its seed."""

from __future__ import annotations

import json
import random
import string

EDGES = (0, 1, 2, 3, 4, 7, 8, 9, 15, 16, 17, 31, 32, 63, 64, 0x7F, 0x80, 0xFF, 0x100, 0xFFF, 0x1000, 0x1001,
         0x3FFF, 0x4000, 0x7FFF, 0x8000, 0xFFFF, 0x10000, 0xFFFFF, 1 << 20, (1 << 20) + 1, (1 << 20) + 4096,
         (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 32) + 1, 1 << 48, (1 << 63) - 4096, (1 << 63) - 1,
         1 << 63, (1 << 64) - 4096, (1 << 64) - 2, (1 << 64) - 1)


def edge(rng: random.Random, bits: int = 64, near: tuple[int, ...] = ()) -> int:
    """An integer of ``bits`` bits: an edge value, one next to a value of interest
    (``near``: a region size, a register offset), or any."""
    mask = (1 << bits) - 1
    roll = rng.random()
    if near and roll < 0.4:
        return (rng.choice(near) + rng.choice((-8, -4, -2, -1, 0, 0, 0, 1, 2, 4, 8))) & mask
    if roll < 0.8:
        return rng.choice(EDGES) & mask
    return rng.getrandbits(bits)


def small(rng: random.Random, top: int) -> int:
    """Mostly small counts: 0..top, with the ends more likely."""
    return rng.choice((0, 1, top, top + 1, rng.randint(0, top)))


def mutate_bytes(rng: random.Random, data: bytes, max_len: int = 4096) -> bytes:
    """A few random edits: bit flips, byte replacements, inserts, deletes, truncation."""
    out = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 3, 8))):
        op = rng.randrange(6)
        pos = rng.randint(0, len(out))
        if op == 0 and out and pos < len(out):
            out[pos] ^= 1 << rng.randrange(8)
        elif op == 1 and out and pos < len(out):
            out[pos] = rng.choice((0, 0xFF, 0x7F, 0x80, rng.randrange(256)))
        elif op == 2:
            out[pos:pos] = rng.randbytes(rng.choice((1, 2, 4, 8, 64)))
        elif op == 3 and out:
            del out[pos:pos + rng.choice((1, 2, 4, 16))]
        elif op == 4:
            del out[pos:]
        else:
            out[pos:pos] = bytes([rng.randrange(256)]) * rng.choice((16, 256, 4096))
    return bytes(out[:max_len])


def text(rng: random.Random, *, alphabet: str = string.ascii_letters + string.digits + "-_.:") -> str:
    """A string that a field check must survive: empty, long, NUL, non-ASCII, plain."""
    roll = rng.randrange(8)
    if roll == 0:
        return ""
    if roll == 1:
        return rng.choice(alphabet) * rng.choice((4097, 65536))
    if roll == 2:
        return "x\0y"
    if roll == 3:
        return "".join(chr(rng.choice((0xE9, 0x2603, 0x1F600, 0xD7FF, 0xFFFD))) for _ in range(rng.randint(1, 8)))
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24)))


def json_value(rng: random.Random, depth: int = 0, strings: tuple[str, ...] = ()) -> object:
    """Any JSON value; containers only a few levels deep (deep nesting is :func:`nested`)."""
    kinds = 9 if depth < 3 else 7
    roll = rng.randrange(kinds)
    if roll == 0:
        return None
    if roll == 1:
        return rng.random() < 0.5
    if roll == 2:
        return rng.choice((0, -1, 1, 2**31, 2**63, 2**64, -(2**63), 10**30, rng.randint(-100, 100)))
    if roll == 3:
        return rng.choice((0.5, -0.0, 1e308, 1e-308))
    if roll in (4, 5):
        return rng.choice(strings) if strings and rng.random() < 0.5 else text(rng)
    if roll == 6:
        return rng.choice(strings) if strings else ""
    if roll == 7:
        return [json_value(rng, depth + 1, strings) for _ in range(rng.randint(0, 4))]
    return {text(rng): json_value(rng, depth + 1, strings) for _ in range(rng.randint(0, 4))}


def nested(rng: random.Random) -> bytes:
    """JSON nested far deeper than a recursive decoder's stack (or a little less)."""
    depth = rng.choice((50, 999, 1000, 5000, 100_000))
    open_, close = rng.choice(((b"[", b"]"), (b'{"a":', b"}")))
    return open_ * depth + b"1" + close * depth


def mutate_json(rng: random.Random, obj: dict, fields: dict[str, tuple] | None = None) -> bytes:
    """``obj`` as JSON with something wrong: a field of the wrong type, missing, unknown,
    huge, deeply nested, or the text itself broken (truncated, flipped, not UTF-8)."""
    roll = rng.randrange(10)
    doc = dict(obj)
    if roll <= 3 and doc:  # a field gets another value, often of another type
        key = rng.choice(list(doc))
        doc[key] = rng.choice((fields or {}).get(key, ())) if fields and fields.get(key) and rng.random() < 0.3 \
            else json_value(rng)
    elif roll == 4 and doc:
        del doc[rng.choice(list(doc))]
    elif roll == 5:
        doc[text(rng)] = json_value(rng)
    elif roll == 6:
        return nested(rng) if rng.random() < 0.5 else json.dumps({**doc, rng.choice(list(doc) or ["x"]): None}).encode()[:-1] + b"," + nested(rng) + b"}"
    elif roll == 7:
        return rng.choice((b"", b"null", b"[]", b"1", b'"s"', b"{", b"\xff\xfe", b"{\"a\":\"\xc3\"}", b"NaN"))
    raw = json.dumps(doc).encode()
    if roll >= 8:
        raw = mutate_bytes(rng, raw, 1 << 16)
    return raw
