"""Random AMQP values and hostile encodings, for the mutators.

`encode` extends `amqpbroker.core.codec.encode` with `Raw` (bytes spliced in as an
already encoded value), so that a random value can hold things no encoder would
produce: maps with list keys, arrays of any element type, lying size or count
fields, nesting thousands deep.
"""

from __future__ import annotations

import math
import random
import struct
import uuid
from dataclasses import dataclass

from proton import (
    Described,
    byte,
    char,
    decimal32,
    decimal64,
    decimal128,
    float32,
    int32,
    short,
    symbol,
    timestamp,
    ubyte,
    uint,
    ulong,
    ushort,
)

from amqpbroker.core import codec


@dataclass(frozen=True)
class Raw:
    """Bytes that stand for one encoded value, as they are."""

    raw: bytes


def encode(value: object) -> bytes:
    if isinstance(value, Raw):
        return value.raw
    if isinstance(value, Described):
        return b"\x00" + encode(value.descriptor) + encode(value.value)
    if isinstance(value, (list, tuple)):
        return compound(0xC0, [encode(v) for v in value])
    if isinstance(value, dict):
        return compound(0xC1, [encode(x) for kv in value.items() for x in kv])
    return codec.encode(value)


def compound(small: int, items: list[bytes]) -> bytes:
    """A list (0xC0) or map (0xC1) of encoded items: the one-byte form when it fits."""
    body = b"".join(items)
    if len(body) + 1 < 256 and len(items) < 256:
        return bytes((small, len(body) + 1, len(items))) + body
    return bytes((small + 0x10,)) + struct.pack(">II", len(body) + 4, len(items)) + body


def raw_map(pairs: list[tuple[bytes, bytes]]) -> Raw:
    """A map from already encoded keys and values (any keys: lists, maps, nulls)."""
    return Raw(compound(0xC1, [x for kv in pairs for x in kv]))


# --------------------------------------------------------------------------- random values

_TEXT = "aZ09 _-.:/é€𝄞\u0000\u200b'\"%"


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(_TEXT) for _ in range(n))


def _float(rng: random.Random) -> float:
    return rng.choice([0.0, -0.0, 1.5, -1e308, 1e-320, math.inf, -math.inf, math.nan, rng.uniform(-1e9, 1e9)])


SCALARS = {
    "null": lambda r: None,
    "bool": lambda r: r.random() < 0.5,
    "ubyte": lambda r: ubyte(r.randrange(256)),
    "ushort": lambda r: ushort(r.randrange(1 << 16)),
    "uint": lambda r: uint(r.choice([0, 1, 255, 256, 2**31, 2**32 - 1, r.randrange(1 << 32)])),
    "ulong": lambda r: ulong(r.choice([0, 1, 255, 2**63, 2**64 - 1, r.randrange(1 << 64)])),
    "byte": lambda r: byte(r.randrange(-128, 128)),
    "short": lambda r: short(r.randrange(-(1 << 15), 1 << 15)),
    "int": lambda r: int32(r.randrange(-(1 << 31), 1 << 31)),
    "long": lambda r: r.choice([0, -1, 2**63 - 1, -(2**63), r.randrange(-(1 << 63), 1 << 63)]),
    "float": lambda r: float32(r.choice([0.0, 1.5, 3.4e38, math.inf, -math.inf, math.nan])),
    "double": _float,
    "char": lambda r: char(r.choice("a\u0000é𝄞\U0010ffff")),
    "timestamp": lambda r: timestamp(r.choice([0, -1, 2**63 - 1, -(2**63), 1700000000000])),
    "uuid": lambda r: uuid.UUID(int=r.randrange(1 << 128)),
    "decimal32": lambda r: decimal32(r.randrange(1 << 32)),
    "decimal64": lambda r: decimal64(r.randrange(1 << 64)),
    "decimal128": lambda r: decimal128(bytes(r.randrange(256) for _ in range(16))),
    "binary": lambda r: bytes(r.randrange(256) for _ in range(r.choice([0, 1, 7, 300]))),
    "string": lambda r: _text(r, r.choice([0, 1, 12, 300])),
    "symbol": lambda r: symbol(r.choice(["", "amqp:accepted:list", "x-opt-jms-dest", "jms-selector",
                                         "a" * 300, "queue", "topic"])),
}


def random_scalar(rng: random.Random) -> object:
    return SCALARS[rng.choice(sorted(SCALARS))](rng)


def random_value(rng: random.Random, depth: int = 0) -> object:
    """Any AMQP value: scalars, lists, maps (keys of any type, lists included),
    arrays, described values; at most a few levels deep."""
    roll = rng.random()
    if depth >= 3 or roll < 0.55:
        return random_scalar(rng)
    n = rng.choice([0, 1, 2, 5])
    if roll < 0.7:
        return [random_value(rng, depth + 1) for _ in range(n)]
    if roll < 0.8:
        return raw_map([(encode(random_value(rng, depth + 1)), encode(random_value(rng, depth + 1)))
                        for _ in range(n)])
    if roll < 0.9:
        return Described(rng.choice([ulong(rng.randrange(0x10, 0x80)), symbol("amqp:x"),
                                     random_scalar(rng)]), random_value(rng, depth + 1))
    return random_array(rng)


def random_array(rng: random.Random) -> Raw:
    """An array of one element type (AMQP 1.0 §1.6.24), maybe described."""
    kind = rng.choice(["null", "bool", "ubyte", "uint", "long", "double", "string", "symbol", "uuid"])
    items = [encode(SCALARS[kind](rng)) for _ in range(rng.choice([0, 1, 3, 40]))]
    # One constructor for all elements, each element without it: keep the items
    # encoded with the first one's constructor (a type may have narrower forms).
    code = items[0][0] if items else encode(SCALARS[kind](rng))[0]
    same = [i[1:] for i in items if i[0] == code]
    count = len(same)
    body = bytes((code,)) + b"".join(same)
    descriptor = b"\x00\x53\x77" if rng.random() < 0.2 else b""
    return Raw(b"\xf0" + struct.pack(">II", len(descriptor + body) + 4, count) + descriptor + body)


def different_value(rng: random.Random, old: object) -> object:
    """A random value whose encoding starts with another constructor than `old`'s."""
    try:
        old_code = encode(old)[:1]
    except (TypeError, ValueError, struct.error):
        old_code = b""
    for _ in range(20):
        new = random_value(rng)
        if encode(new)[:1] != old_code:
            return new
    return Raw(b"\xa1\x03abc")


# --------------------------------------------------------------------------- hostile shapes


def deep(kind: str, depth: int) -> Raw:
    """A value nested `depth` deep: lists, maps, described values or arrays of arrays."""
    inner = b"\x40"
    for _ in range(depth):
        if kind == "list":
            inner = b"\xd0" + struct.pack(">II", len(inner) + 4, 1) + inner
        elif kind == "map":
            inner = b"\xd1" + struct.pack(">II", len(inner) + 5, 2) + b"\x40" + inner
        elif kind == "array":
            # an array of one array: the inner array's first byte is the element
            # constructor, the rest its one element
            if inner == b"\x40":
                inner = b"\xf0" + struct.pack(">II", 5, 1) + b"\x40"
            inner = b"\xf0" + struct.pack(">II", len(inner) + 4, 1) + inner
        else:   # described
            inner = b"\x00\x53\x77" + inner
    return Raw(inner)


DEEP_KINDS = ("list", "map", "described", "array")


def random_depth(rng: random.Random) -> int:
    """10 .. 5000, log-uniform: the shallow end is where limits are."""
    return int(10 * (500 ** rng.random()))


# Few bytes that declare many elements or many bytes (amplification, AMQP 1.0 §1.6).
LIES = {
    "list32 2^32-1 elements": b"\xd0" + struct.pack(">II", 4, 2**32 - 1),
    "list32 10^8 nulls": b"\xd0" + struct.pack(">II", 8, 10**8) + b"\x40\x40\x40\x40",
    "map32 2^31 elements": b"\xd1" + struct.pack(">II", 6, 2**31) + b"\x40\x40",
    "array32 10^8 nulls": b"\xf0" + struct.pack(">II", 5, 10**8) + b"\x40",
    "array32 2^32-1 trues": b"\xf0" + struct.pack(">II", 5, 2**32 - 1) + b"\x41",
    "array32 2^32-1 ints in 4 bytes": b"\xf0" + struct.pack(">II", 9, 2**32 - 1) + b"\x71\x00\x00\x00\x01",
    "array8 255 empty lists": b"\xe0\x02\xff\x45",
    "array of 10^6 described nulls": b"\xf0" + struct.pack(">II", 8, 10**6) + b"\x00\x53\x01\x40",
    "binary32 2^31 bytes": b"\xb0" + struct.pack(">I", 2**31) + b"abc",
    "string32 2^32-1 bytes": b"\xb1" + struct.pack(">I", 2**32 - 1) + b"abc",
    "symbol32 10^9 bytes": b"\xb3" + struct.pack(">I", 10**9) + b"x",
    "list32 size 2^32-1": b"\xd0" + struct.pack(">II", 2**32 - 1, 1) + b"\x40",
    "list8 count 255 size 1": b"\xc0\x01\xff",
    "map odd count": b"\xc1\x02\x01\x40",
}


__all__ = ["DEEP_KINDS", "LIES", "Raw", "deep", "different_value", "encode", "random_array",
           "random_depth", "random_scalar", "random_value", "raw_map"]
