"""Queue limits and overflow policies (core/limits.py), row by row, then as a Queue
and the Broker apply them (fan-out included)."""

from __future__ import annotations

import pytest

from amqpbroker.core.addresses import AddressKind, Resolution
from amqpbroker.core.broker import Broker, BrokerPolicy, QueueFull
from amqpbroker.core.limits import (Admission, LimitRule, Overflow, QueueLimits, admit, fits, fits_batch, full,
                                    limits_for, may_grant)
from amqpbroker.core.queues import Outcome
from tests.core.helpers import RecordingConsumer, bodies, make_message

BLOCK = QueueLimits(max_depth=3, overflow=Overflow.BLOCK)
REJECT = QueueLimits(max_depth=3, overflow=Overflow.REJECT)
DROP = QueueLimits(max_depth=3, overflow=Overflow.DROP_HEAD)
BYTES_REJECT = QueueLimits(max_bytes=100, overflow=Overflow.REJECT)
BYTES_DROP = QueueLimits(max_bytes=100, overflow=Overflow.DROP_HEAD)


@pytest.mark.parametrize("limits, depth, size, incoming, expected", [
    (None, 10**9, 10**12, 10, Admission.ACCEPT),                  # no limits: always
    (QueueLimits(), 10**9, 10**12, 10, Admission.ACCEPT),         # zeros: no limit
    (REJECT, 2, 0, 10, Admission.ACCEPT),                          # the last one that fits
    (REJECT, 3, 0, 10, Admission.REJECT),                          # full
    (DROP, 3, 0, 10, Admission.DROP_HEAD),
    (BLOCK, 3, 0, 10, Admission.ACCEPT),     # the producer had credit for it: taken (held at credit)
    (BLOCK, 50, 0, 10, Admission.ACCEPT),
    (BYTES_REJECT, 5, 90, 10, Admission.ACCEPT),                   # exactly max_bytes
    (BYTES_REJECT, 5, 90, 11, Admission.REJECT),
    (BYTES_DROP, 5, 90, 11, Admission.DROP_HEAD),
    (BYTES_DROP, 0, 0, 101, Admission.REJECT),                     # larger than the limit itself
    (QueueLimits(3, 100, Overflow.REJECT), 1, 95, 10, Admission.REJECT),   # either limit
])
def test_admit(limits, depth, size, incoming, expected):
    assert admit(limits, depth, size, incoming) is expected


@pytest.mark.parametrize("limits, depth, size, grant", [
    (None, 10**9, 0, True),
    (BLOCK, 2, 0, True),
    (BLOCK, 3, 0, False),                   # at the limit: no more credit
    (BLOCK, 4, 0, False),                   # beyond (credit already granted came in)
    (REJECT, 10, 0, True),                  # reject and drop-head never hold credit
    (DROP, 10, 0, True),
    (QueueLimits(max_bytes=100), 0, 100, False),
    (QueueLimits(max_bytes=100), 0, 99, True),
])
def test_may_grant(limits, depth, size, grant):
    assert may_grant(limits, depth, size) is grant


def test_full_and_fits():
    assert not full(QueueLimits(), 10**9, 10**12)
    assert full(BLOCK, 3, 0) and not full(BLOCK, 2, 0)
    assert fits(BYTES_REJECT, 0, 0, 100) and not fits(BYTES_REJECT, 0, 1, 100)


def test_limits_for_declared_first_then_first_matching_pattern():
    rules = [LimitRule("orders.*", REJECT), LimitRule("orders.#", DROP), LimitRule("#", BLOCK)]
    assert limits_for("orders.eu", rules) is REJECT
    assert limits_for("orders.eu.big", rules) is DROP
    assert limits_for("other", rules) is BLOCK
    assert limits_for("orders.eu", rules, declared=DROP) is DROP
    assert limits_for("orders.eu", rules, declared=QueueLimits()) is None   # declared without limits
    assert limits_for("x", []) is None
    assert limits_for("x", [LimitRule("#", QueueLimits())]) is None


# ---------------------------------------------------------------------- a queue


def _broker(*rules: LimitRule, dead_letter: str | None = None) -> Broker:
    return Broker(BrokerPolicy(queue_limits=tuple(rules), dead_letter_address=dead_letter))


def _send(b: Broker, name: str, n: int, start: int = 0, kind=AddressKind.QUEUE, key=None) -> None:
    for i in range(start, start + n):
        b.publish(make_message(f"m{i}"), Resolution(kind, name, key))


def test_reject_keeps_what_is_queued_and_counts():
    b = _broker(LimitRule("q", REJECT))
    q = b.declare_queue("q")
    _send(b, "q", 3)
    with pytest.raises(QueueFull, match="queue 'q' is full"):
        _send(b, "q", 1, start=3)
    assert bodies(q.entries()) == ["m0", "m1", "m2"] and q.overflow_rejected_total == 1


def test_drop_head_drops_the_oldest_ready_without_dead_letter_address():
    b = _broker(LimitRule("q", DROP))
    q = b.declare_queue("q")
    _send(b, "q", 5)
    assert bodies(q.entries()) == ["m2", "m3", "m4"]
    assert q.overflow_dropped_total == 2 and q.dead_lettered_total == 0 and q.depth == 3


def test_drop_head_dead_letters_when_an_address_is_configured():
    b = _broker(LimitRule("q", DROP), dead_letter="dlq")
    q, dlq = b.declare_queue("q"), b.declare_queue("dlq")
    _send(b, "q", 5)
    assert bodies(q.entries()) == ["m2", "m3", "m4"]
    assert bodies(dlq.entries()) == ["m0", "m1"]


def test_drop_head_never_drops_delivered_messages():
    b = _broker(LimitRule("q", DROP))
    q = b.declare_queue("q")
    c = RecordingConsumer(credit=3)
    q.add_consumer(c)
    _send(b, "q", 4)        # three delivered (held by the consumer): nothing ready to drop for m3
    assert q.depth == 4 and q.overflow_dropped_total == 0 and bodies(q.entries()) == ["m3"]
    _send(b, "q", 2, start=4)   # each drops the one ready head before it
    assert bodies(q.entries()) == ["m5"] and q.overflow_dropped_total == 2 and q.depth == 4


def test_drop_head_by_bytes():
    size = make_message("m0").size
    b = _broker(LimitRule("q", QueueLimits(max_bytes=3 * size, overflow=Overflow.DROP_HEAD)))
    q = b.declare_queue("q")
    _send(b, "q", 5)
    assert bodies(q.entries()) == ["m2", "m3", "m4"] and q.bytes == 3 * size


def test_block_wakes_once_when_room_comes_not_before():
    b = _broker(LimitRule("q", BLOCK))
    q = b.declare_queue("q")
    _send(b, "q", 4)                       # credit already given: all taken
    assert q.depth == 4 and not q.may_grant()
    woken = []
    q.wait_for_room(woken.append)
    c = RecordingConsumer(credit=2)
    q.add_consumer(c)
    q.settle(c.delivered[0], Outcome.ACCEPTED)
    assert woken == [], "still at the limit (3 held)"
    q.settle(c.delivered[1], Outcome.ACCEPTED)
    assert woken == [q] and q.may_grant()
    c.grant(1, q)
    q.settle(c.delivered[2], Outcome.ACCEPTED)
    assert woken == [q], "called once per wait"


def test_block_wakes_on_purge_and_delete():
    b = _broker(LimitRule("#", BLOCK))
    q = b.declare_queue("q")
    _send(b, "q", 3)
    woken = []
    q.wait_for_room(woken.append)
    q.purge()
    assert woken == [q]
    _send(b, "q", 3)
    q.wait_for_room(woken.append)
    b.delete_queue("q")
    assert woken == [q, q]


def test_wait_for_room_is_not_called_at_once_and_notify_room_wakes():
    """The caller decided there is no room for it (room may be promised to other
    producers): no call at the wait, one at the next event that may give room."""
    b = _broker(LimitRule("q", BLOCK))
    q = b.declare_queue("q")
    woken = []
    q.wait_for_room(woken.append)
    assert woken == []
    q.notify_room()
    assert woken == [q]
    q.notify_room()
    assert woken == [q], "called once per wait"


def test_fits_batch_is_fits_one_after_the_other():
    for limits in (REJECT, BYTES_REJECT, QueueLimits(3, 100, Overflow.REJECT)):
        for depth, size, count, each in [(0, 0, 3, 10), (0, 0, 4, 10), (2, 70, 1, 30), (2, 70, 1, 31),
                                         (0, 0, 0, 0), (3, 0, 1, 1)]:
            one_by_one = all(fits(limits, depth + i, size + i * each, each) for i in range(count))
            assert fits_batch(limits, depth, size, count, count * each) is one_by_one, (limits, depth, count)


# ---------------------------------------------------------------------- fan-out


def _fanout(*limits: QueueLimits | None) -> tuple[Broker, list]:
    b = Broker()
    b.declare_exchange("ex", "fanout")
    queues = []
    for i, lim in enumerate(limits):
        q = b.declare_queue(f"s{i}", limits=lim)
        b.bind("ex", "", q)
        queues.append(q)
    return b, queues


def test_fan_out_reject_rejects_for_every_queue():
    b, (full_q, other) = _fanout(QueueLimits(max_depth=2, overflow=Overflow.REJECT), None)
    _send(b, "ex", 2, kind=AddressKind.EXCHANGE)
    with pytest.raises(QueueFull):
        _send(b, "ex", 1, start=2, kind=AddressKind.EXCHANGE)
    assert full_q.depth == 2 and other.depth == 2, "a rejected message reaches no queue"


def test_fan_out_drop_head_only_that_queue_drops():
    b, (small, big) = _fanout(QueueLimits(max_depth=2, overflow=Overflow.DROP_HEAD), None)
    _send(b, "ex", 4, kind=AddressKind.EXCHANGE)
    assert bodies(small.entries()) == ["m2", "m3"]
    assert bodies(big.entries()) == ["m0", "m1", "m2", "m3"]


def test_fan_out_block_takes_and_refuses_credit():
    b, (blocked, other) = _fanout(QueueLimits(max_depth=2, overflow=Overflow.BLOCK), None)
    _send(b, "ex", 3, kind=AddressKind.EXCHANGE)
    assert blocked.depth == 3 and other.depth == 3 and not blocked.may_grant() and other.may_grant()


