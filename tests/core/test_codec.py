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
