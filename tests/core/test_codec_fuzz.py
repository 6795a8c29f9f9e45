"""Property tests of the codec and the message parser on arbitrary input
(docs/architecture.md, "Hostile input"): decoding raises DecodeError and nothing
else, never hangs, `skip` agrees with `decode`; values survive encode → decode,
with python-qpid-proton's Data as the oracle; `Message(bytes)` raises only
MalformedMessage, and so does what the connection handler reads at the edge.

Known bugs (tests/fuzz/test_regressions.py, xfail strict) are recognised by
`known_codec_bug` so that this file stays green while they exist; when one is
fixed its regression test flips, and its line here should go.
"""

from __future__ import annotations

import math

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from proton import Data, Described

from amqpbroker.core import codec
from amqpbroker.core.message import MalformedMessage, Message
from tests.fuzz.strategies import (
    amqp_values,
    hostile_bytes,
    hostile_messages,
    same,
    time_limit,
)

fuzz = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LIMIT = 2.0      # seconds per example: a decoder that loops forever fails, it does not hang


def known_codec_bug(exc: BaseException | None = None, raw: bytes = b"", end: int | None = None) -> bool:
    """The codec bugs already reported, each with its regression test."""
    # test_regressions.py::test_codec_map_with_an_unhashable_key_raises_decode_error
    if isinstance(exc, TypeError) and "unhashable type" in str(exc):
        return True
    # test_regressions.py::test_codec_truncated_decimal128_raises_decode_error
    return end is not None and end > len(raw) and b"\x94" in raw


def decode_only(raw: bytes, off: int = 0):
    """decode(), which may raise DecodeError; any other exception fails (unless known)."""
    try:
        return codec.decode(raw, off)
    except codec.DecodeError:
        raise
    except Exception as exc:
        if known_codec_bug(exc, raw):
            raise codec.DecodeError("known bug") from exc
        raise AssertionError(f"decode raised {exc!r} for {raw[:80].hex()}") from exc


@fuzz
@given(raw=hostile_bytes)
@example(raw=b"\xc1\x03\x02\x45\x40")              # a map whose key is a list
@example(raw=b"\x94\x00")                           # decimal128 with one of its 16 bytes
@example(raw=b"\x00" * 5000 + b"\x40" * 5001)       # a described chain 5,000 deep
def test_decode_raises_only_decode_error_and_skip_agrees(raw):
    with time_limit(LIMIT):
        try:
            _, end = decode_only(raw)
        except codec.DecodeError:
            end = None
        try:
            skipped = codec.skip(raw, 0)
        except codec.DecodeError:
            skipped = None
        except Exception as exc:
            raise AssertionError(f"skip raised {exc!r} for {raw[:80].hex()}") from exc
    if end is None or known_codec_bug(raw=raw, end=end):
        return
    assert end <= len(raw)
    # decode may refuse what skip steps over (bad UTF-8, depth), never the reverse
    assert skipped == end, f"skip {skipped} != decode {end} for {raw[:80].hex()}"


@fuzz
@given(raw=hostile_bytes, off=st.integers(0, 70))
def test_decode_at_any_offset_raises_only_decode_error(raw, off):
    with time_limit(LIMIT):
        try:
            _, end = decode_only(raw, off)
        except codec.DecodeError:
            return
    assert off < end <= len(raw) or known_codec_bug(raw=raw, end=end)


def proton_encode(value) -> bytes:
    d = Data()
    d.put_object(value)
    return d.encode()


def proton_decode(raw: bytes):
    d = Data()
    d.decode(raw)
    d.rewind()
    d.next()
    return copied(d.get_object())       # while `d` lives: binaries are views into it


def copied(value):
    if isinstance(value, memoryview):
        return bytes(value)
    if isinstance(value, list):
        return [copied(v) for v in value]
    if isinstance(value, dict):
        return {copied(k): copied(v) for k, v in value.items()}
    if isinstance(value, Described):
        return Described(copied(value.descriptor), copied(value.value))
    return value


def proton_cannot(value) -> bool:
    """Values python-qpid-proton's Data.get_object gets wrong, so it is no oracle
    for them: a map keyed by a binary (its binaries are unhashable memoryviews),
    and a described value whose value is described (the siblings after it are
    lost: [D(0, D(0, null)), null] comes back as [D(0, D(0, null))])."""
    if isinstance(value, dict):
        return any(isinstance(k, bytes) or proton_cannot(k) or proton_cannot(v) for k, v in value.items())
    if isinstance(value, list):
        return any(proton_cannot(v) for v in value)
    if isinstance(value, Described):
        return isinstance(value.value, Described) or proton_cannot(value.value)
    return False


@settings(max_examples=300, deadline=None)
@given(value=amqp_values)
def test_encode_decode_round_trip(value):
    raw = codec.encode(value)
    decoded, end = codec.decode(raw)
    assert end == len(raw) == codec.skip(raw, 0)
    assert same(decoded, value)
    if not _has_nan(value):
        assert decoded == value


@settings(max_examples=300, deadline=None)
@given(value=amqp_values)
def test_proton_is_the_oracle(value):
    """What proton encodes we decode to the same value; what we encode proton
    decodes to the same value."""
    ours = codec.encode(value)
    theirs = proton_encode(value)
    decoded, end = codec.decode(theirs)
    assert end == len(theirs)
    assert same(decoded, value)
    if not proton_cannot(value):
        assert same(proton_decode(ours), value)


def _has_nan(value) -> bool:
    if isinstance(value, float):
        return math.isnan(value)
    if isinstance(value, list):
        return any(_has_nan(v) for v in value)
    if isinstance(value, dict):
        return any(_has_nan(k) or _has_nan(v) for k, v in value.items())
    if isinstance(value, Described):
        return _has_nan(value.descriptor) or _has_nan(value.value)
    return False


# --------------------------------------------------------------------------- messages


@fuzz
@given(raw=hostile_messages())
# message-annotations {[]: null, x-opt-delivery-delay: 5}: a list key, and the scheduling
# annotation that makes routing_times() decode the map
@example(raw=b"\x00\x53\x72\xc1\x1b\x04\x45\x40\xa3\x14x-opt-delivery-delay\x55\x05\x00\x53\x77\x40")
def test_message_raises_only_malformed_message(raw):
    """`Message(raw)` and what the connection handler reads right after it
    (routing_times: expiry, delivery time, group) raise MalformedMessage only:
    anything else is an internal error on the producer's connection."""
    with time_limit(LIMIT):
        try:
            msg = Message(raw)
            msg.routing_times()
        except MalformedMessage:
            return
        except Exception as exc:
            if known_codec_bug(exc):      # reached through Message: the same root cause
                return
            raise AssertionError(f"{exc!r} for message {raw[:80].hex()}") from exc
    # what a queue and a consumer read later is there
    assert msg.size == len(raw)
    assert 0 <= msg.priority
