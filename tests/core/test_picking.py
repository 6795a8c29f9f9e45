"""Which entry a consumer gets next (core/picking.py): the single-consumer run, and
that it keeps every rule of the general round."""

from __future__ import annotations

from amqpbroker.core.queues import DISPATCH_SLICE, Outcome, Queue
from tests.core.helpers import Clock, RecordingConsumer, bodies, make_message, queue_of


class CountingConsumer(RecordingConsumer):
    """Counts how often the queue asks for credit."""

    def __init__(self, credit=0):
        super().__init__(credit=credit)
        self.asked = 0

    def credit(self):
        self.asked += 1
        return super().credit()


def test_the_only_consumer_takes_a_run_in_order_reading_credit_once_per_run():
    q = queue_of(50)
    c = CountingConsumer(credit=20)
    q.add_consumer(c)
    assert bodies(c.delivered) == list(range(20))
    assert c.asked <= 2, f"credit read {c.asked} times for one run of 20"
    c.grant(100, q)
    assert bodies(c.delivered) == list(range(50)) and q.ready_count == 0


def test_a_run_takes_higher_priorities_first_then_fifo():
    q = Queue("q")
    for i, p in enumerate([0, 4, 9, 4, 9, 0]):
        q.enqueue(make_message(f"m{i}", priority=p))
    c = RecordingConsumer(credit=4)
    q.add_consumer(c)
    assert bodies(c.delivered) == ["m2", "m4", "m1", "m3"]
    c.grant(10, q)
    assert bodies(c.delivered)[4:] == ["m0", "m5"]


def test_expired_entries_in_a_run_use_no_credit():
    clock = Clock()
    q = Queue("q", clock=clock)
    for body, ttl in [("old", 1.0), ("keep", None), ("old2", 1.0), ("keep2", None)]:
        q.enqueue(make_message(body, arrival=clock.t, **({"ttl": ttl} if ttl else {})))
    clock.t += 5
    c = RecordingConsumer(credit=2)
    q.add_consumer(c)
    assert bodies(c.delivered) == ["keep", "keep2"]
    assert q.expired_total == 2 and q.depth == 2


def test_an_entry_the_only_consumer_refused_waits_while_later_ones_go_to_it():
    q = queue_of(3)
    c = RecordingConsumer(credit=1)
    q.add_consumer(c)
    first = c.delivered[0]
    q.settle(first, Outcome.MODIFIED, undeliverable_here=True)   # AMQP 1.0 §3.4.5
    c.grant(5, q)
    assert bodies(c.delivered) == [0, 1, 2]
    other = RecordingConsumer(credit=5)
    q.add_consumer(other)
    assert bodies(other.delivered) == [0]


def test_a_run_stops_at_the_dispatch_slice_and_goes_on_next_turn():
    turns = []
    q = Queue("q")
    q.defer = turns.append
    c = CountingConsumer(credit=0)
    q.add_consumer(c)
    for i in range(DISPATCH_SLICE + 5):
        q.enqueue(make_message(i))
    c.grant(10**6, q)
    assert len(c.delivered) == DISPATCH_SLICE and len(turns) == 1
    turns.pop(0)()
    assert bodies(c.delivered) == list(range(DISPATCH_SLICE + 5))


def test_several_consumers_still_split_one_entry_each_per_round():
    q = queue_of(8)
    a, b = RecordingConsumer(credit=0), RecordingConsumer(credit=0)
    q.add_consumer(a)
    q.add_consumer(b)
    a._credit = b._credit = 10
    q.dispatch()
    assert bodies(a.delivered) == [0, 2, 4, 6] and bodies(b.delivered) == [1, 3, 5, 7]
