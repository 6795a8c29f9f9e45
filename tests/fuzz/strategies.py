"""Hypothesis strategies for AMQP values and hostile bytes, shared by the codec,
message and selector property tests (tests/core/test_*_fuzz.py)."""

from __future__ import annotations

import math
import signal
import struct
import time
from contextlib import contextmanager

from hypothesis import strategies as st
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

# --------------------------------------------------------------------------- AMQP values

ascii_text = st.text(st.characters(min_codepoint=0, max_codepoint=127), max_size=20)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(0, 2**8 - 1).map(ubyte),
    st.integers(0, 2**16 - 1).map(ushort),
    st.integers(0, 2**32 - 1).map(uint),
    st.integers(0, 2**64 - 1).map(ulong),
    st.integers(-(2**7), 2**7 - 1).map(byte),
    st.integers(-(2**15), 2**15 - 1).map(short),
    st.integers(-(2**31), 2**31 - 1).map(int32),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(width=32).map(float32),
    st.floats(),
    st.characters(min_codepoint=0, max_codepoint=0x10FFFF).map(char),
    st.integers(-(2**63), 2**63 - 1).map(timestamp),
    st.uuids(),
    st.integers(0, 2**32 - 1).map(decimal32),
    st.integers(0, 2**64 - 1).map(decimal64),
    st.binary(min_size=16, max_size=16).map(decimal128),
    st.binary(max_size=300),
    st.text(max_size=300),
    ascii_text.map(symbol),
)
hashable_scalars = scalars.filter(lambda v: not (isinstance(v, float) and math.isnan(v)))

amqp_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=6),
        st.dictionaries(hashable_scalars, children, max_size=5),
        st.builds(Described, st.one_of(st.integers(0, 2**64 - 1).map(ulong), ascii_text.map(symbol)), children),
    ),
    max_leaves=25,
)


def same(a: object, b: object) -> bool:
    """Equal as AMQP values: by encoding (NaN is then equal to itself) and type."""
    return type(a) is type(b) and codec.encode(a) == codec.encode(b)


# --------------------------------------------------------------------------- hostile bytes

# Constructors with the size and count fields that follow them (AMQP 1.0 §1.6).
_CONSTRUCTORS = [0x00, 0x40, 0x41, 0x42, 0x43, 0x44, 0x45, 0x50, 0x51, 0x52, 0x53, 0x54, 0x55, 0x56,
                 0x60, 0x61, 0x70, 0x71, 0x72, 0x73, 0x74, 0x80, 0x81, 0x82, 0x83, 0x84, 0x94, 0x98,
                 0xA0, 0xA1, 0xA3, 0xB0, 0xB1, 0xB3, 0xC0, 0xC1, 0xD0, 0xD1, 0xE0, 0xF0]
_SIZES = [0, 1, 2, 4, 5, 8, 0x7F, 0xFF, 0xFFFF, 10**8, 2**31, 2**32 - 1]


@st.composite
def constructor_soup(draw) -> bytes:
    """Bytes made of constructors and plausible (or absurd) size and count fields:
    much likelier than random bytes to reach the deep paths of a decoder."""
    out = bytearray()
    for _ in range(draw(st.integers(1, 12))):
        code = draw(st.sampled_from(_CONSTRUCTORS))
        out.append(code)
        if code >> 4 in (0xB, 0xD, 0xF):
            out += struct.pack(">I", draw(st.sampled_from(_SIZES)) & 0xFFFFFFFF)
            if code >> 4 in (0xD, 0xF):
                out += struct.pack(">I", draw(st.sampled_from(_SIZES)) & 0xFFFFFFFF)
        elif code >> 4 in (0xA, 0xC, 0xE):
            out.append(draw(st.sampled_from(_SIZES)) & 0xFF)
            if code >> 4 in (0xC, 0xE):
                out.append(draw(st.integers(0, 255)))
        out += draw(st.binary(max_size=4))
    return bytes(out)


@st.composite
def mutated_encoding(draw) -> bytes:
    """A valid encoding with a few bytes flipped, inserted, deleted or cut off."""
    raw = bytearray(codec.encode(draw(amqp_values)))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        at = draw(st.integers(0, len(raw)))
        if op == "flip" and at < len(raw):
            raw[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            raw[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif op == "delete":
            del raw[at:at + draw(st.integers(1, 4))]
        else:
            del raw[at:]
    return bytes(raw)


@st.composite
def deep_encoding(draw) -> bytes:
    """Lists, maps, arrays and described values nested 1..3000 deep."""
    depth = draw(st.integers(1, 3000))
    kind = draw(st.sampled_from(["list", "map", "described", "array"]))
    inner = b"\x40"
    for _ in range(depth):
        if kind == "list":
            inner = b"\xd0" + struct.pack(">II", len(inner) + 4, 1) + inner
        elif kind == "map":
            inner = b"\xd1" + struct.pack(">II", len(inner) + 5, 2) + b"\x40" + inner
        elif kind == "array":
            inner = b"\xf0" + struct.pack(">II", len(inner) + 4, 1) + (inner if inner[0] == 0xF0 else b"\x45")
        else:
            inner = b"\x00\x53\x77" + inner
    return inner


hostile_bytes = st.one_of(st.binary(max_size=64), constructor_soup(), mutated_encoding(), deep_encoding())


def section(code: int, value: bytes) -> bytes:
    return b"\x00\x53" + bytes((code,)) + value


@st.composite
def hostile_messages(draw) -> bytes:
    """Messages: sections (well-formed or not) in any order, or plain hostile bytes."""
    if draw(st.booleans()):
        return draw(hostile_bytes)
    parts = []
    for _ in range(draw(st.integers(0, 5))):
        code = draw(st.sampled_from([0x70, 0x71, 0x72, 0x73, 0x74, 0x75, 0x76, 0x77, 0x78, 0x6F, 0x79]))
        value = draw(st.one_of(amqp_values.map(codec.encode), hostile_bytes))
        parts.append(section(code, value))
    return b"".join(parts)


# --------------------------------------------------------------------------- time bound


class TookTooLong(Exception):
    pass


@contextmanager
def time_limit(seconds: float):
    """Fail (TookTooLong) if the block runs longer than `seconds`: a decoder that
    loops forever must fail the example, not hang the suite.  SIGALRM: main thread."""
    def alarm(signum, frame):
        raise TookTooLong(f"more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    started = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    if time.monotonic() - started > seconds:
        raise TookTooLong(f"more than {seconds} s")


__all__ = ["TookTooLong", "amqp_values", "constructor_soup", "deep_encoding", "hostile_bytes",
           "hostile_messages", "mutated_encoding", "same", "scalars", "section", "time_limit"]
