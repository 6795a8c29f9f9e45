"""The rules for deliveries a consumer holds when its link ends (core/settlement.py),
row by row, and `Queue.settle_late` applying them."""

from __future__ import annotations

import pytest

from amqpbroker.core.queues import Queue
from amqpbroker.core.settlement import (
    LateAction,
    LinkEnding,
    Outcome,
    Place,
    counts_as_failed,
    late_outcome,
)
from tests.core.helpers import RecordingConsumer, bodies, make_message


@pytest.mark.parametrize("ending, counted", [
    (LinkEnding.DETACHED, False),
    (LinkEnding.SESSION_ENDED, False),
    (LinkEnding.CONNECTION_CLOSED, False),
    (LinkEnding.BROKER_ENDED, False),
    (LinkEnding.CONNECTION_LOST, True),
])
def test_only_a_lost_connection_counts_as_a_failed_attempt(ending, counted):
    assert counts_as_failed(ending) is counted


W, A, G = Place.WAITING, Place.ACQUIRED, Place.GONE


@pytest.mark.parametrize("outcome, failed, place, action", [
    # released: it went back released at the ending already
    (Outcome.RELEASED, False, W, LateAction.NOTHING),
    (Outcome.RELEASED, False, A, LateAction.NOTHING),
    # modified: a failed attempt counts once, wherever the entry is now
    (Outcome.MODIFIED, True, W, LateAction.COUNT),
    (Outcome.MODIFIED, True, A, LateAction.COUNT),
    (Outcome.MODIFIED, False, W, LateAction.NOTHING),
    # accepted / rejected take it out only while it still waits in the queue
    (Outcome.ACCEPTED, False, W, LateAction.CONSUME),
    (Outcome.ACCEPTED, False, A, LateAction.NOTHING),
    (Outcome.REJECTED, False, W, LateAction.DEAD_LETTER),
    (Outcome.REJECTED, False, A, LateAction.NOTHING),
    # gone since (consumed elsewhere, expired, purged): nothing at all
    (Outcome.MODIFIED, True, G, LateAction.NOTHING),
    (Outcome.ACCEPTED, False, G, LateAction.NOTHING),
    (Outcome.REJECTED, False, G, LateAction.NOTHING),
])
def test_late_outcome_table(outcome, failed, place, action):
    assert late_outcome(outcome, failed, place) is action


def _ended_with(n: int, **queue_kw):
    """A queue whose only consumer held `n` entries when its link ended normally."""
    q = Queue("q", **queue_kw)
    for i in range(n):
        q.enqueue(make_message(i))
    c = RecordingConsumer(credit=n)
    q.add_consumer(c)
    held = list(c.delivered)
    q.remove_consumer(c, held, failed=False)
    return q, held


def test_late_released_changes_nothing():
    q, held = _ended_with(2)
    assert q.settle_late(held[0], Outcome.RELEASED) is LateAction.NOTHING
    c = RecordingConsumer(credit=5)
    q.add_consumer(c)
    assert bodies(c.delivered) == [0, 1]
    assert [e.delivery_count for e in c.delivered] == [0, 0]


def test_late_modified_failed_counts_once_and_can_dead_letter():
    dead = []
    q, held = _ended_with(2, max_delivery_attempts=2, dead_letter=lambda e, why: dead.append(e.seq))
    assert q.settle_late(held[0], Outcome.MODIFIED, delivery_failed=True) is LateAction.COUNT
    assert held[0].delivery_count == 1 and q.ready_count == 2
    assert q.settle_late(held[0], Outcome.MODIFIED, delivery_failed=True) is LateAction.COUNT
    assert dead == [held[0].seq] and q.ready_count == 1


def test_late_modified_failed_counts_on_an_entry_another_consumer_holds():
    q, held = _ended_with(1)
    other = RecordingConsumer(credit=1)
    q.add_consumer(other)
    assert other.delivered == held
    assert q.settle_late(held[0], Outcome.MODIFIED, delivery_failed=True) is LateAction.COUNT
    assert held[0].delivery_count == 1 and held[0].consumer is other


def test_late_accepted_consumes_a_waiting_entry():
    q, held = _ended_with(3)
    assert q.settle_late(held[1], Outcome.ACCEPTED) is LateAction.CONSUME
    assert q.depth == 2 and q.acked_total == 1
    c = RecordingConsumer(credit=5)
    q.add_consumer(c)
    assert bodies(c.delivered) == [0, 2]


def test_late_accepted_leaves_an_entry_another_consumer_holds():
    q, held = _ended_with(1)
    other = RecordingConsumer(credit=1)
    q.add_consumer(other)
    assert q.settle_late(held[0], Outcome.ACCEPTED) is LateAction.NOTHING
    assert q.acquired == 1 and held[0].consumer is other


def test_late_rejected_dead_letters_a_waiting_entry():
    dead = []
    q, held = _ended_with(2, dead_letter=lambda e, why: dead.append((e.seq, why)))
    assert q.settle_late(held[0], Outcome.REJECTED) is LateAction.DEAD_LETTER
    assert dead == [(held[0].seq, "rejected")] and q.depth == 1


def test_late_outcome_for_an_entry_gone_since_does_nothing():
    q, held = _ended_with(1)
    c = RecordingConsumer(credit=1)
    q.add_consumer(c)
    q.settle(held[0], Outcome.ACCEPTED)
    assert q.settle_late(held[0], Outcome.REJECTED) is LateAction.NOTHING
    assert q.settle_late(held[0], Outcome.MODIFIED, delivery_failed=True) is LateAction.NOTHING
    assert held[0].delivery_count == 0 and q.acked_total == 1


def test_late_outcome_on_a_deleted_queue_does_nothing():
    q, held = _ended_with(1)
    q.purge()
    q.deleted = True
    assert q.settle_late(held[0], Outcome.MODIFIED, delivery_failed=True) is LateAction.NOTHING
