"""core/deadletters.py: origin annotations and the message-annotations rewrite
(AMQP 1.0 §3.2.3), checked against proton's own decoding of the result."""

from __future__ import annotations

import pytest
from proton import Message as PnMessage, symbol, timestamp

from amqpbroker.core.deadletters import (
    DLQ_ADDRESS, DLQ_KEYS, DLQ_QUEUE, DLQ_REASON, DLQ_TIME, AnnotationError, dead_letter_annotations,
    origin, reason_code, return_address, rewrite_annotations)
from amqpbroker.core.message import Message


def encoded(**fields) -> bytes:
    return PnMessage(**fields).encode()


def decoded(raw: bytes) -> PnMessage:
    m = PnMessage()
    m.decode(raw)
    return m


def sections(raw: bytes) -> dict:
    """Section code → its bytes, as the broker scans them."""
    msg = Message(raw)
    return {code: raw[start:end] for code, (start, end) in msg._spans.items()}


def test_added_to_a_message_without_annotations_keeps_the_other_sections_bytes():
    raw = encoded(body="hello", durable=True, subject="s", properties={"k": 1}, id="m-1")
    out = rewrite_annotations(raw, dead_letter_annotations("orders", "orders", "rejected", 1234))
    before, after = sections(raw), sections(out)
    for code in (0x70, 0x73, 0x74, 0x77):
        assert after[code] == before[code]
    m = decoded(out)
    assert m.annotations == {DLQ_QUEUE: "orders", DLQ_ADDRESS: "orders", DLQ_REASON: "rejected",
                             DLQ_TIME: timestamp(1234)}
    assert m.body == "hello" and m.properties == {"k": 1} and m.id == "m-1"


def test_existing_annotations_keep_their_bytes_and_ours_are_replaced():
    raw = encoded(body=b"x", annotations={symbol("x-opt-jms-dest"): 0, symbol("x-opt-a"): [1, 2]})
    once = rewrite_annotations(raw, dead_letter_annotations("q1", "q1", "rejected", 1))
    twice = rewrite_annotations(once, dead_letter_annotations("q2", "t/k", "delivery attempts reached 3", 2))
    ann = decoded(twice).annotations
    assert ann[DLQ_QUEUE] == "q2" and ann[DLQ_ADDRESS] == "t/k" and ann[DLQ_REASON] == "max-delivery-attempts"
    assert ann[symbol("x-opt-jms-dest")] == 0 and ann[symbol("x-opt-a")] == [1, 2]
    assert len(ann) == 6


def test_dropping_our_annotations_restores_the_original_bytes():
    raw = encoded(body="b", annotations={symbol("x-opt-jms-dest"): 0}, subject="s")
    marked = rewrite_annotations(raw, dead_letter_annotations("q", "q", "rejected", 5))
    assert rewrite_annotations(marked, drop=DLQ_KEYS) == raw
    plain = encoded(body="b")
    assert rewrite_annotations(rewrite_annotations(plain, {DLQ_QUEUE: "q"}), drop=DLQ_KEYS) == plain


def test_large_annotation_maps_use_map32():
    big = {symbol(f"x-opt-k{i}"): "v" * 20 for i in range(20)}
    out = rewrite_annotations(encoded(body="b"), big)
    assert decoded(out).annotations == big


def test_unwalkable_annotations_raise():
    raw = encoded(body="b", annotations={symbol("x-opt-a"): 1})
    start, _ = Message(raw)._spans[0x72]
    broken = raw[:start] + b"\x71" + raw[start + 1:]   # not a map constructor
    with pytest.raises(AnnotationError):
        rewrite_annotations(broken, {DLQ_QUEUE: "q"})


@pytest.mark.parametrize("text,code", [("rejected", "rejected"), ("delivery attempts reached 5", "max-delivery-attempts"),
                                       ("queue full (overflow drop-head)", "overflow"), ("expired", "expired")])
def test_reason_codes(text, code):
    assert reason_code(text) == code


def test_return_address_of_a_subscription_queue_is_its_topic():
    assert return_address("orders", [("amq.topic", "x")]) == "orders"
    sub = "qpidsub_/app_/s_/durable"
    assert return_address(sub, [("amq.topic", "orders.eu")]) == "amq.topic/orders.eu"
    assert return_address(sub, [("amq.topic", "orders.*")]) == "amq.topic"
    assert return_address(sub, []) == sub


def test_origin_reads_the_annotations():
    assert origin({DLQ_QUEUE: "q", DLQ_ADDRESS: "a"}) == ("q", "a")
    assert origin({}) == (None, None)
