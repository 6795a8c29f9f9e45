import struct
import uuid

import pytest
from hypothesis import given, strategies as st
from proton import Data, Described, symbol, timestamp, ubyte, uint, ulong

from amqpbroker.core import codec


def proton_decode(raw):
    d = Data()
    d.decode(raw)
    value = d.get_object()
    # proton hands binaries out as views into its own buffer: copy while it lives
    return bytes(value) if isinstance(value, memoryview) else value


def proton_encode(value):
    d = Data()
    d.put_object(value)
    return d.encode()


VALUES = [None, True, False, 0, 7, -1, 2**40, -(2**40), 1.5, "", "é" * 300, b"\x00" * 3, b"y" * 300,
          symbol("s"), ulong(0), ulong(9), ulong(2**60), uint(0), uint(70000), ubyte(7),
          timestamp(1700000000000), uuid.UUID(int=5), [1, "a", [2, None]], {symbol("k"): "v", "n": 3},
          Described(ulong(0x77), "body")]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_round_trip_against_proton(value):
    encoded = codec.encode(value)
    assert proton_decode(encoded) == value
    assert codec.decode(proton_encode(value))[0] == value
    assert codec.skip(encoded, 0) == len(encoded)


@given(st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=40) | st.binary(max_size=40),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=20))
def test_decode_matches_proton_for_random_values(value):
    raw = proton_encode(value)
    decoded, end = codec.decode(raw)
    assert decoded == value and end == len(raw) == codec.skip(raw, 0)


def test_truncated_input_raises_decode_error():
    raw = codec.encode("hello world")
    with pytest.raises(codec.DecodeError):
        codec.decode(raw[:-3])


# --------------------------------------------------------------------------- hostile bytes:
# whatever is wrong, decode raises DecodeError and nothing else.

def _deep_list(depth: int) -> bytes:
    inner = b"\x45"
    for _ in range(depth):
        inner = b"\xd0" + struct.pack(">II", len(inner) + 4, 1) + inner
    return inner


def _nested_null_arrays(outer: int, inner: int | None = None) -> bytes:
    """An array of `outer` arrays of nulls, each declaring `inner` elements (by
    default as many as the whole buffer has bytes)."""
    count = 9 * outer + 10 if inner is None else inner
    body = b"\xf0" + (struct.pack(">II", 5, count) + b"\x40") * outer
    return b"\xf0" + struct.pack(">II", 4 + len(body), outer) + body


HOSTILE = {
    "invalid UTF-8 string": b"\xa1\x03\xff\xfe\xfd",
    "non-ASCII symbol": b"\xa3\x02\xc3\xa9",
    "char beyond U+10FFFF": b"\x73\x00\x11\x00\x00",
    "list 3,000 deep": _deep_list(3000),
    "list nested one too deep": _deep_list(codec.MAX_DEPTH + 1),
    "map with more elements than bytes": b"\xc1\x03\x09\x40\x40",
    "10^8 nulls in a 12-byte array": b"\xf0" + struct.pack(">II", 5, 10**8) + b"\x40",
    "2^32-1 trues in an array": b"\xf0" + struct.pack(">II", 5, 2**32 - 1) + b"\x41",
    "array of ints claiming 10^6 elements": b"\xe0\x02\xff\x71",
    "truncated string": b"\xa1\x10abc",
    "truncated decimal128": b"\x94\x00",
    "truncated uuid": b"\x98" + b"\x01" * 15,
    "map keyed by a list": b"\xc1\x03\x02\x45\x40",
    "map keyed by a map": b"\xc1\x05\x02\xc1\x01\x00\x40",
    "map keyed by a described value": b"\xc1\x06\x02\x00\x53\x01\x40\x40",
    "array of 1,200 arrays of 10,810 nulls each": _nested_null_arrays(1200),
    "invalid constructor": b"\x01",
}


@pytest.mark.parametrize("raw", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_bytes_raise_decode_error_only(raw):
    with pytest.raises(codec.DecodeError):
        codec.decode(raw)


def test_nesting_up_to_the_limit_decodes():
    value, end = codec.decode(_deep_list(codec.MAX_DEPTH - 1))
    assert end == len(_deep_list(codec.MAX_DEPTH - 1))
    for _ in range(codec.MAX_DEPTH - 1):
        (value,) = value
    assert value == []


def test_decoding_costs_a_few_values_per_byte_however_arrays_nest():
    """Arrays of arrays of zero-width elements: each inner array may declare only
    as many elements as it has bytes (plus an allowance), so the total stays
    linear in the input."""
    raw = _nested_null_arrays(100, inner=codec.ZERO_WIDTH_ALLOWANCE)
    value, _ = codec.decode(raw)
    assert sum(len(inner) for inner in value) <= 20 * len(raw)


def test_a_few_zero_width_elements_in_an_array_are_fine():
    assert codec.decode(b"\xf0" + struct.pack(">II", 5, 3) + b"\x40")[0] == [None, None, None]


def test_skip_walks_a_long_chain_of_described_values_without_recursion():
    raw = b"\x00" * 5000 + b"\x40" * 5001
    assert codec.skip(raw, 0) == len(raw)
    with pytest.raises(codec.DecodeError):
        codec.skip(b"\x00" * 5000 + b"\x40", 0)


def test_depth_is_restored_after_an_error():
    with pytest.raises(codec.DecodeError):
        codec.decode(_deep_list(3000))
    assert codec._depth == 0
    assert codec.decode(_deep_list(10))[1] == len(_deep_list(10))


def test_a_compound_size_past_the_end_is_refused_before_its_count_is_believed():
    """Found by tests/core/test_codec_fuzz.py: array32 claiming 16 MiB and 16M+1 null
    elements in ten bytes decoded 16M nulls (seconds) instead of refusing."""
    raw = bytes.fromhex("f0010000000100000140")
    with pytest.raises(codec.DecodeError, match="runs past the end"):
        codec.decode(raw, 0)
    for raw in (bytes.fromhex("c0ff0140"), bytes.fromhex("d00000ffff00000001")):   # list8, map32
        with pytest.raises(codec.DecodeError):
            codec.decode(raw, 0)
