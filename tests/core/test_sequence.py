"""Sequence-range reads, the x-opt-sequence annotation, reader claims and
Queue.remove_below (core/sequence.py, core/queues.py)."""

from __future__ import annotations

import pytest
from proton import Message as PnMessage, symbol, ulong

from amqpbroker.core.message import Message
from amqpbroker.core.queues import Queue
from amqpbroker.core.sequence import (
    AckRefused,
    RangeError,
    ReaderClaim,
    SeqRange,
    add_annotations,
    decide_ack,
    parse_range,
    with_sequence,
)
from tests.core.helpers import NoStore, RecordingConsumer, make_message

SEQ = symbol("x-opt-sequence")


@pytest.mark.parametrize("value, expected", [
    ([ulong(0), ulong(10)], SeqRange(0, 10)),
    ([ulong(5), None], SeqRange(5, None)),
    ([5], SeqRange(5, None)),
    ((ulong(3), ulong(3)), SeqRange(3, 3)),
])
def test_parse_range(value, expected):
    assert parse_range(value) == expected


@pytest.mark.parametrize("value", [None, [], [ulong(5), ulong(4)], ["a", "b"], [-1, 4], [True, 4], [1, 2, 3]])
def test_parse_range_rejects(value):
    with pytest.raises(RangeError):
        parse_range(value)


def test_bound_caps_at_the_committed_tail():
    assert SeqRange(3, None).bound(10) == SeqRange(3, 11)
    assert SeqRange(3, 8).bound(10) == SeqRange(3, 8)
    assert SeqRange(3, 80).bound(10) == SeqRange(3, 11)
    assert SeqRange(30, None).bound(10) == SeqRange(30, 30)      # beyond the tail: empty
    assert SeqRange(30, None).bound(10).empty
    assert SeqRange(3, 8).as_filter_value() == [3, 8]


def _decode(raw: bytes) -> PnMessage:
    m = PnMessage()
    m.decode(raw)
    return m


def test_annotation_added_when_the_message_has_none():
    src = PnMessage(body="hello", durable=True, subject="s", properties={"a": 1})
    raw = src.encode()
    out = _decode(with_sequence(raw, 42))
    assert out.annotations == {SEQ: 42} and isinstance(out.annotations[SEQ], ulong)
    assert (out.body, out.durable, out.subject, out.properties) == ("hello", True, "s", {"a": 1})
    Message(with_sequence(raw, 42))   # the broker's own scan accepts it


def test_annotation_spliced_into_an_existing_map_keeping_the_producer_bytes():
    src = PnMessage(body=b"\x01\x02", annotations={symbol("x-opt-a"): "b", symbol("x-opt-n"): 7},
                    instructions={symbol("x-da"): 1}, priority=7, ttl=10)
    raw = src.encode()
    out_raw = with_sequence(raw, 3)
    out = _decode(out_raw)
    assert out.annotations == {symbol("x-opt-a"): "b", symbol("x-opt-n"): 7, SEQ: 3}
    assert out.instructions == {symbol("x-da"): 1}
    assert (out.body, out.priority) == (b"\x01\x02", 7)
    # Everything before and after the annotations section is byte-identical.
    tail = bytes(raw[raw.index(b"\x00Ss"):])
    head = bytes(raw[:raw.index(b"\x00Sr")])
    assert bytes(out_raw).endswith(tail) and bytes(out_raw).startswith(head)
    assert len(out_raw) == len(raw) + len(b"\xa3\x0ex-opt-sequenceS\x03")


def test_large_annotation_map_is_widened():
    ann = {symbol(f"x-opt-{i}"): "v" * 10 for i in range(20)}   # > 255 bytes: wide map
    raw = PnMessage(body="b", annotations=ann).encode()
    out = _decode(with_sequence(raw, 2**40))
    assert out.annotations[SEQ] == 2**40 and len(out.annotations) == 21
    small = {symbol("x-opt-k"): "v" * 230}                        # becomes > 255 bytes when extended
    out = _decode(with_sequence(PnMessage(body="b", annotations=small).encode(), 2**40))
    assert out.annotations[SEQ] == 2**40 and out.annotations[symbol("x-opt-k")] == "v" * 230


def test_existing_sequence_annotation_is_replaced_not_duplicated():
    raw = PnMessage(body="b", annotations={SEQ: ulong(1), symbol("x-other"): 2}).encode()
    out = _decode(with_sequence(raw, 9))
    assert out.annotations == {SEQ: 9, symbol("x-other"): 2}


def test_add_annotations_without_header():
    raw = PnMessage(body=None).encode()
    out = _decode(add_annotations(raw, {symbol("k"): "v"}))
    assert out.annotations == {symbol("k"): "v"}


# ---------------------------------------------------------------------- claims


def test_first_ack_claims_and_others_are_locked_out():
    c = decide_ack(None, "q", 7, "r1", 10)
    assert c == ReaderClaim("q", 7, "r1", 10)
    with pytest.raises(AckRefused) as err:
        decide_ack(c, "q", 7, "r2", 12)
    assert err.value.condition == "amqp:resource-locked"
    assert decide_ack(c, "q", 7, "r1", 4).below == 10       # never goes back
    assert decide_ack(c, "q", 7, "r1", 40).below == 40


def test_release_and_stale_claims():
    c = ReaderClaim("q", 7, "r1", 10)
    assert decide_ack(c, "q", 7, "r1", 0, release=True) is None
    with pytest.raises(AckRefused):
        decide_ack(c, "q", 7, "r2", 0, release=True)
    # The queue was deleted and created again (new store id): the old claim is void.
    assert decide_ack(c, "q", 8, "r2", 3) == ReaderClaim("q", 8, "r2", 3)
    assert ReaderClaim.from_json(c.to_json()) == c


def test_ack_needs_a_reader_and_non_negative_bound():
    with pytest.raises(AckRefused):
        decide_ack(None, "q", 1, "", 3)
    with pytest.raises(AckRefused):
        decide_ack(None, "q", 1, "r", -1)


# ---------------------------------------------------------------------- Queue.remove_below


def test_remove_below_takes_ready_and_scheduled_entries_but_not_acquired_ones():
    now = [1000.0]
    q = Queue("q", clock=lambda: now[0])
    removed = []

    class Recording(NoStore):
        def entry_removed(self, queue, entry):
            removed.append(entry)

    q.hooks = Recording()
    for i in range(6):
        q.enqueue(make_message(f"m{i}", priority=9 if i == 2 else 4))
    q.enqueue(make_message("later", annotations={symbol("x-opt-delivery-time"): int(5000 * 1000)}))  # seq 7
    c = RecordingConsumer(credit=1)
    q.add_consumer(c)
    held = c.delivered[0]
    assert held.seq == 3                                     # priority 9 went first
    assert q.remove_below(8) == 6                            # 1, 2, 4, 5, 6 ready + 7 scheduled
    assert sorted(e.seq for e in removed) == [1, 2, 4, 5, 6, 7]
    assert q.depth == 1 and q.acquired == 1 and q.next_wakeup() is None
    assert q.remove_below(8) == 0
    q.enqueue(make_message("new"))                           # seq 8 stays
    assert q.remove_below(8) == 0 and q.ready_count == 1
    assert q.acked_total == 6 and q.bytes == held.size + q.entries()[0].size
