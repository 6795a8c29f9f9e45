"""The frame-stream checks of core/wire.py, fed bytes as a socket would deliver them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st
from proton import Data, Described, uint, ulong

from amqpbroker.core.wire import DECODE_ERROR, FRAMING_ERROR, HANDLE_IN_USE, NOT_ALLOWED, FrameGuard

HEADER = b"AMQP\x00\x01\x00\x00"


def frame(code: int, fields: list, channel: int = 0) -> bytes:
    data = Data()
    data.put_object(Described(ulong(code), fields))
    body = data.encode()
    return (8 + len(body)).to_bytes(4, "big") + b"\x02\x00" + channel.to_bytes(2, "big") + body


def raw_frame(body: bytes, channel: int = 0) -> bytes:
    return (8 + len(body)).to_bytes(4, "big") + b"\x02\x00" + channel.to_bytes(2, "big") + body


OPEN = frame(0x10, ["c"])
BEGIN = frame(0x11, [None, uint(0), uint(100), uint(100)])


def attach(handle: int, channel: int = 0) -> bytes:
    return frame(0x12, [f"l{handle}", uint(handle), True], channel)


def detach(handle: int, channel: int = 0) -> bytes:
    return frame(0x16, [uint(handle), True], channel)


def transfer(handle: int, payload: bytes, channel: int = 0) -> bytes:
    head = frame(0x14, [uint(handle), uint(0), b"t"], channel)
    size = len(head) + len(payload)
    return size.to_bytes(4, "big") + head[4:] + payload


def feed_all(chunks: list[bytes]):
    guard = FrameGuard()
    for chunk in chunks:
        problem = guard.feed(chunk)
        if problem is not None:
            return problem
    return None


def byte_by_byte(data: bytes):
    return feed_all([data[i:i + 1] for i in range(len(data))])


CONVERSATION_OK = HEADER + OPEN + BEGIN + attach(0) + attach(1) + detach(0) + attach(0) + \
    frame(0x17, []) + BEGIN + attach(0) + b"\x00\x00\x00\x08\x02\x00\x00\x00"   # + a heartbeat


@pytest.mark.parametrize("split", [None, 1, 3, 7, 64])
def test_a_well_behaved_conversation_passes_however_it_is_split(split):
    if split is None:
        assert FrameGuard().feed(CONVERSATION_OK) is None
    else:
        chunks = [CONVERSATION_OK[i:i + split] for i in range(0, len(CONVERSATION_OK), split)]
        assert feed_all(chunks) is None


@pytest.mark.parametrize("stream, condition, words", [
    (HEADER + OPEN + OPEN, NOT_ALLOWED, "open received twice"),
    (HEADER + OPEN + BEGIN + BEGIN, NOT_ALLOWED, "channel 0, which already carries"),
    (HEADER + OPEN + BEGIN + attach(3) + attach(3), HANDLE_IN_USE, "handle 3"),
    (HEADER + OPEN + BEGIN + frame(0x11, [None, uint(0), uint(1), uint(1)], channel=2) + attach(1, 2)
     + attach(1, 2), HANDLE_IN_USE, "channel 2"),
    (HEADER + BEGIN, NOT_ALLOWED, "before open"),
    (HEADER + (5000).to_bytes(4, "big") + b"\x00\x00\x00\x00", FRAMING_ERROR, "data offset 0"),
    (HEADER + OPEN + (4).to_bytes(4, "big") + b"\x02\x00\x00\x00", FRAMING_ERROR, "size 4"),
    (HEADER + OPEN + BEGIN + b"\x00\x00\x00\x0a\x02\x00\x00\x00\x00\x53", DECODE_ERROR, "no performative"),
    # the body cut after the descriptor, followed by another frame in the same chunk
    (HEADER + OPEN + b"\x00\x00\x00\x0a\x02\x00\x00\x00\x00\x53" + BEGIN, DECODE_ERROR, "no performative"),
    # a detach whose handle is a list, an attach whose fields are a map keyed by a list
    (HEADER + OPEN + BEGIN + frame(0x16, [[1], True]), None, ""),
    (HEADER + OPEN + BEGIN + raw_frame(b"\x00\x53\x12\xc0\x05\x01\xc1\x03\x02\x45\x40"),
     DECODE_ERROR, "unsupported type"),
    # 14 bytes declaring three million ulong 0s as a field (proton would build them all)
    (HEADER + OPEN + BEGIN + raw_frame(b"\x00\x53\x12\xc0\x0b\x01\xf0" + (5).to_bytes(4, "big")
                                       + (3_000_000).to_bytes(4, "big") + b"\x44"), DECODE_ERROR, "elements"),
])
def test_violations_are_named(stream, condition, words):
    for problem in (FrameGuard().feed(stream), byte_by_byte(stream)):
        if condition is None:        # nothing the guard names: the engine answers it
            assert problem is None
        else:
            assert problem is not None and problem[0] == condition and words in problem[1], problem


def test_a_large_transfer_is_skipped_not_collected():
    guard = FrameGuard()
    body = b"\x00\x53\x77\xb0" + (10 << 20).to_bytes(4, "big")
    big = transfer(0, body + b"x" * (10 << 20))
    stream = HEADER + OPEN + BEGIN + attach(0) + big + attach(0)
    problem = guard.feed(stream)
    assert problem is not None and problem[0] == HANDLE_IN_USE   # still in step after 10 MiB
    assert len(guard._buf) < 1024


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.integers(1, 50))
def test_arbitrary_bytes_never_raise(noise, split):
    stream = HEADER + OPEN + noise
    chunks = [stream[i:i + split] for i in range(0, len(stream), split)]
    result = feed_all(chunks)
    assert result is None or result[0] in (NOT_ALLOWED, HANDLE_IN_USE, FRAMING_ERROR, DECODE_ERROR)


@pytest.mark.parametrize("split", [None, 5])
def test_the_offending_frame_is_located_in_the_chunk(split):
    good = HEADER + OPEN + BEGIN
    stream = good + BEGIN + attach(0)
    guard = FrameGuard()
    if split is None:
        assert guard.feed(stream) is not None
        assert guard.violation_at == len(good)
    else:
        fed = 0
        for i in range(0, len(stream), split):
            chunk = stream[i:i + split]
            if guard.feed(chunk) is not None:
                start = max(len(good) - i, 0)     # 0: it began in an earlier chunk
                assert guard.violation_at == start
                break
            fed += len(chunk)
        else:
            raise AssertionError("no violation found")


def test_text_that_does_not_decode_is_left_to_the_field_reader():
    """Invalid UTF-8 in an attach's address: the link is refused by whoever reads the
    field (server/peer_fields.py), not the connection closed by the guard."""
    bad = frame(0x12, ["l0", uint(0), True, None, None, Described(ulong(0x28), ["AAAA"])])
    bad = bad.replace(b"AAAA", b"\xff\xfe\xfd\xfc")
    assert FrameGuard().feed(HEADER + OPEN + BEGIN + bad + attach(1)) is None
