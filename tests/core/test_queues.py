"""Queue dispatch, ordering and outcomes without a socket."""

from __future__ import annotations

from proton import Message as PnMessage

from amqpbroker.core.queues import Outcome, Queue
from tests.core.helpers import (
    Clock,
    NoStore,
    RecordingConsumer,
    bodies,
    make_message,
    queue_of,
)


def test_fifo_within_priority_and_higher_priority_first():
    q = Queue("q")
    for i, p in enumerate([4, 4, 9, 0, 9]):
        q.enqueue(make_message(f"m{i}", priority=p))
    c = RecordingConsumer(credit=10)
    q.add_consumer(c)
    assert bodies(c.delivered) == ["m2", "m4", "m0", "m1", "m3"]


def test_no_delivery_without_credit_then_credit_releases_exactly_that_many():
    q = queue_of(5)
    c = RecordingConsumer(credit=0)
    q.add_consumer(c)
    assert c.delivered == []
    c.grant(2, q)
    assert bodies(c.delivered) == [0, 1]
    assert q.ready_count == 3 and q.acquired == 2


def test_round_robin_is_even_and_skips_consumers_without_credit():
    q = Queue("q")
    consumers = [RecordingConsumer(credit=1000) for _ in range(3)]
    starved = RecordingConsumer(credit=0)
    for c in consumers + [starved]:
        q.add_consumer(c)
    for i in range(300):
        q.enqueue(make_message(i))
    assert [len(c.delivered) for c in consumers] == [100, 100, 100]
    assert starved.delivered == []


def standby(credit=0, accept=None):
    c = RecordingConsumer(credit=credit, accept=accept)
    c.standby = True
    return c


def test_a_standby_consumer_gets_an_entry_only_when_no_other_consumer_takes_it():
    """A second choice (ConsumerPort.standby: another node's consumer of a partitioned
    member, cluster/fanin.py): the others first, round robin among them; the standby
    one when they have no credit, or their selector refuses the entry."""
    q = Queue("q")
    first = [RecordingConsumer(credit=0), RecordingConsumer(credit=0)]
    for c in first:
        q.add_consumer(c)
    second = standby(credit=1000)
    q.add_consumer(second)
    for c in first:
        c._credit = 100
    for i in range(150):
        q.enqueue(make_message(i))
    assert [len(c.delivered) for c in first] == [75, 75] and second.delivered == []
    for i in range(150, 260):                    # 50 more fit the first ones, 60 do not
        q.enqueue(make_message(i))
    assert [len(c.delivered) for c in first] == [100, 100]
    assert bodies(second.delivered) == list(range(200, 260)), "what the first choice could not take"
    assert sorted(bodies(first[0].delivered + first[1].delivered + second.delivered)) == list(range(260))


def test_a_standby_consumer_takes_what_a_selector_leaves_and_serves_alone():
    q = Queue("q")
    picky = RecordingConsumer(credit=100, accept=lambda e: bodies([e])[0] % 2 == 0)
    second = standby(credit=100)
    q.add_consumer(picky)
    q.add_consumer(second)
    for i in range(10):
        q.enqueue(make_message(i))
    assert bodies(picky.delivered) == [0, 2, 4, 6, 8] and bodies(second.delivered) == [1, 3, 5, 7, 9]
    q.remove_consumer(picky, [], failed=False)
    for i in range(10, 13):
        q.enqueue(make_message(i))
    assert bodies(second.delivered)[-3:] == [10, 11, 12], "alone, a standby consumer is served as any"
    q.remove_consumer(second, [], failed=False)
    assert q._standby == 0


def test_accept_removes_and_release_returns_unchanged():
    q = Queue("q")
    q.enqueue(make_message("a"))
    c = RecordingConsumer(credit=5)
    q.add_consumer(c)
    entry = c.delivered[0]
    c._credit = 0
    q.settle(entry, Outcome.RELEASED)
    assert entry.delivery_count == 0 and q.ready_count == 1
    c.grant(1, q)
    q.settle(c.delivered[1], Outcome.ACCEPTED)
    assert q.depth == 0 and q.acked_total == 1


def test_modified_delivery_failed_counts_and_rewrites_header():
    q = Queue("q")
    q.enqueue(make_message("a"))
    c = RecordingConsumer(credit=1)
    q.add_consumer(c)
    q.settle(c.delivered[0], Outcome.MODIFIED, delivery_failed=True)
    c.grant(1, q)
    redelivered = c.delivered[1]
    m = PnMessage()
    m.decode(redelivered.payload())
    assert redelivered.delivery_count == 1 and m.delivery_count == 1 and m.body == "a"


def test_undeliverable_here_goes_to_another_consumer_only():
    q = Queue("q")
    a, b = RecordingConsumer(credit=5), RecordingConsumer(credit=0)
    q.add_consumer(a)
    q.add_consumer(b)
    q.enqueue(make_message("x"))
    q.settle(a.delivered[0], Outcome.MODIFIED, undeliverable_here=True)
    assert len(a.delivered) == 1            # not offered to `a` again
    b.grant(1, q)
    assert bodies(b.delivered) == ["x"]


def _two_consumers_holding_four():
    q = queue_of(4)
    a = RecordingConsumer(credit=2)
    b = RecordingConsumer(credit=2)
    q.add_consumer(a)
    q.add_consumer(b)
    return q, a, b   # a took 0 and 1 when it was added, b took 2 and 3


def test_normal_link_end_returns_unsettled_in_original_order_uncounted():
    q, a, b = _two_consumers_holding_four()
    q.remove_consumer(b, list(b.delivered), failed=False)
    q.remove_consumer(a, list(a.delivered), failed=False)
    c = RecordingConsumer(credit=10)
    q.add_consumer(c)
    assert bodies(c.delivered) == [0, 1, 2, 3]
    assert [e.delivery_count for e in c.delivered] == [0, 0, 0, 0]


def test_lost_connection_returns_unsettled_in_original_order_with_count_plus_one():
    q, a, b = _two_consumers_holding_four()
    q.remove_consumer(b, list(b.delivered), failed=True)
    q.remove_consumer(a, list(a.delivered), failed=False)
    c = RecordingConsumer(credit=10)
    q.add_consumer(c)
    assert bodies(c.delivered) == [0, 1, 2, 3]
    assert [e.delivery_count for e in c.delivered] == [0, 0, 1, 1]


def test_lost_connection_can_dead_letter_at_max_attempts():
    dead = []
    q = Queue("q", max_delivery_attempts=1, dead_letter=lambda e, why: dead.append(why))
    q.enqueue(make_message("m"))
    c = RecordingConsumer(credit=1)
    q.add_consumer(c)
    q.remove_consumer(c, list(c.delivered), failed=True)
    assert dead == ["delivery attempts reached 1"] and q.depth == 0


def test_max_delivery_attempts_dead_letters():
    dead = []
    q = Queue("q", max_delivery_attempts=2, dead_letter=lambda e, why: dead.append((e, why)))
    q.enqueue(make_message("poison"))
    c = RecordingConsumer(credit=10)
    q.add_consumer(c)
    q.settle(c.delivered[0], Outcome.MODIFIED, delivery_failed=True)
    q.settle(c.delivered[1], Outcome.MODIFIED, delivery_failed=True)
    assert len(dead) == 1 and "attempts" in dead[0][1]
    assert q.depth == 0


def test_rejected_goes_to_dead_letter():
    dead = []
    q = Queue("q", dead_letter=lambda e, why: dead.append(why))
    q.enqueue(make_message("bad"))
    c = RecordingConsumer(credit=1)
    q.add_consumer(c)
    q.settle(c.delivered[0], Outcome.REJECTED)
    assert dead == ["rejected"] and q.depth == 0


def test_ttl_expired_messages_are_never_delivered():
    clock = Clock()
    q = Queue("q", clock=clock)
    q.enqueue(make_message("old", ttl=1.0, arrival=clock.t))
    q.enqueue(make_message("fresh", arrival=clock.t))
    clock.t += 2
    c = RecordingConsumer(credit=5)
    q.add_consumer(c)
    assert bodies(c.delivered) == ["fresh"] and q.expired_total == 1


def test_delayed_delivery_waits_for_its_time():
    from proton import symbol
    clock = Clock()
    q = Queue("q", clock=clock)
    c = RecordingConsumer(credit=5)
    q.add_consumer(c)
    q.enqueue(make_message("later", arrival=clock.t,
                           annotations={symbol("x-opt-delivery-delay"): 5000}))
    assert c.delivered == [] and q.next_wakeup() == clock.t + 5
    clock.t += 5
    q.promote_due(clock.t)
    assert bodies(c.delivered) == ["later"]


def test_selector_consumer_leaves_non_matching_for_others():
    q = Queue("q")
    picky = RecordingConsumer(credit=5, accept=lambda e: e.msg.application_properties.get("k") == 1)
    q.add_consumer(picky)
    q.enqueue(make_message("no", properties={"k": 2}))
    q.enqueue(make_message("yes", properties={"k": 1}))
    assert bodies(picky.delivered) == ["yes"] and q.ready_count == 1
    other = RecordingConsumer(credit=5)
    q.add_consumer(other)
    assert bodies(other.delivered) == ["no"]


def test_message_groups_stick_to_one_consumer_then_move():
    q = Queue("q")
    a, b = RecordingConsumer(credit=100), RecordingConsumer(credit=100)
    q.add_consumer(a)
    q.add_consumer(b)
    for i in range(6):
        q.enqueue(make_message(i, group_id="g1"))
    assert len(a.delivered) == 6 and b.delivered == []
    for e in list(a.delivered):
        q.settle(e, Outcome.ACCEPTED)
    q.remove_consumer(a, [], failed=False)
    q.enqueue(make_message("after", group_id="g1"))
    assert bodies(b.delivered) == ["after"]


def test_purge_removes_ready_entries():
    q = queue_of(3)
    assert q.purge() == 3 and q.depth == 0 and q.bytes == 0


# ---------------------------------------------------------------------- paged region


class FakePagingStore(NoStore):
    """The durability hooks of a paging queue over dicts (no LMDB): entries are
    written at once, become readable at commit(), whose callbacks then run."""

    def __init__(self, q, budget, low=2, batch=3):
        self.written: dict[int, object] = {}     # seq -> Entry (index and body)
        self.committed: set[int] = set()
        self.callbacks: list[int] = []
        q.memory_budget = budget
        q.page_in_low, q.page_in_batch = low, batch
        q.hooks = self
        self.q = q

    def entry_added(self, queue, entry):
        if entry.msg.durable:
            entry.store_ref = entry.seq
            self.written[entry.seq] = entry

    def commit(self):
        self.committed |= set(self.written)
        callbacks, self.callbacks = self.callbacks, []
        for seq in callbacks:
            self.q.page_committed(seq)

    def entry_removed(self, queue, entry):
        self.written.pop(entry.seq, None)

    def page_out(self, queue, entry):
        self.callbacks.append(entry.seq)

    def load_body(self, entry):
        return self.written[entry.seq].msg

    def read_paged(self, queue, after, limit):
        from amqpbroker.core.queues import Entry
        seqs = sorted(s for s in self.written if s > after and s in self.committed)[:limit]
        return [Entry.paged(s, s, size=self.written[s].size, priority=self.written[s].priority,
                            delivery_count=0, expires_at=None, deliver_at=None, group=None) for s in seqs]

    def drop_paged(self, queue, after, below, skip):
        gone = [s for s in self.written if s > after and s in self.committed and s not in skip
                and (below is None or s < below)]
        return len(gone), sum(self.written.pop(s).size for s in gone)


def test_over_the_budget_durable_entries_leave_memory_but_still_count():
    q = Queue("q", durable=True)
    size = make_message("m0", durable=True).size
    store = FakePagingStore(q, budget=2 * size)
    for i in range(6):
        q.enqueue(make_message(f"m{i}", durable=True))
    q.enqueue(make_message("t", durable=False))            # never paged
    assert len(q._ready) == 3 and q.paged_count == 4 and len(q._pending_page) == 4
    assert q.depth == 7 and q.ready_count == 7
    store.commit()
    assert q._pending_page == {} and q.paged_count == 4 and q.depth == 7
    assert q.page_cursor == 2 and q.mem_bytes == 2 * size + make_message("t").size


def test_page_in_follows_the_sequence_and_takes_pending_entries_as_they_are():
    q = Queue("q", durable=True)
    size = make_message("m0", durable=True).size
    store = FakePagingStore(q, budget=size)
    for i in range(4):
        q.enqueue(make_message(f"m{i}", durable=True))
    store.commit()                                          # m1..m3: store only
    late = [q.enqueue(make_message(f"m{i}", durable=True)) for i in range(4, 7)]   # pending
    c = RecordingConsumer(credit=100)
    q.add_consumer(c)
    assert bodies(c.delivered) == [f"m{i}" for i in range(7)]
    assert c.delivered[4:] == late                          # the very objects, bodies held
    assert q.paged_count == 0 and q._pending_page == {}
    store.commit()                                          # late callbacks: no effect
    assert q.depth == 7 and q.acquired == 7


def test_purge_and_remove_below_reach_the_paged_region():
    q = Queue("q", durable=True)
    size = make_message("m0", durable=True).size
    store = FakePagingStore(q, budget=size)
    for i in range(6):
        q.enqueue(make_message(f"m{i}", durable=True))
    store.commit()
    q.enqueue(make_message("m6", durable=True))            # pending, seq 7
    assert q.remove_below(4) == 3 and q.paged_count == 4 and q.page_cursor == 3
    assert sorted(store.written) == [4, 5, 6, 7]
    assert q.purge() == 4
    assert q.depth == 0 and q.paged_count == 0 and q.bytes == 0 and store.written == {}


def _paged(seq: int):
    from amqpbroker.core.queues import Entry
    return Entry.paged(seq, store_ref=seq, size=10, priority=4, delivery_count=0,
                       expires_at=None, deliver_at=None, group=None)


def test_a_body_that_cannot_be_read_back_is_dropped_and_the_queue_goes_on():
    q = Queue("q")
    good = make_message("good")
    bodies_by_seq = {2: good}

    class Hooks(NoStore):
        def load_body(self, entry):
            if entry.seq not in bodies_by_seq:
                raise RuntimeError(f"stored message {entry.seq} is missing")
            return bodies_by_seq[entry.seq]

    q.hooks = Hooks()
    q.restore(_paged(1))
    q.restore(_paged(2))
    c = RecordingConsumer(credit=5)
    q.add_consumer(c)
    assert bodies(c.delivered) == ["good"]
    assert q.unreadable_total == 1 and q.depth == 1


def test_a_selector_consumer_skips_an_unreadable_body_too():
    q = Queue("q")
    class Garbage(NoStore):
        def load_body(self, entry):
            raise ValueError("garbage")

    q.hooks = Garbage()
    q.restore(_paged(1))
    picky = RecordingConsumer(credit=5, accept=lambda e: True)
    q.add_consumer(picky)
    assert picky.delivered == [] and q.depth == 0 and q.unreadable_total == 1


def test_dispatch_hands_over_a_slice_per_loop_turn_when_it_can_defer():
    from amqpbroker.core.queues import DISPATCH_SLICE
    turns = []
    q = Queue("q")
    q.defer = turns.append                  # the server's loop.call_soon
    for i in range(DISPATCH_SLICE * 3 + 10):
        q.enqueue(make_message(i))
    c = RecordingConsumer(credit=10**6)
    q.add_consumer(c)
    assert len(c.delivered) == DISPATCH_SLICE and len(turns) == 1
    while turns:                            # the next loop turns
        turns.pop(0)()
    assert bodies(c.delivered) == list(range(DISPATCH_SLICE * 3 + 10))
    assert q.ready_count == 0


def test_a_deferred_dispatch_of_a_deleted_queue_does_nothing():
    turns = []
    q = Queue("q")
    q.defer = turns.append
    for i in range(600):
        q.enqueue(make_message(i))
    c = RecordingConsumer(credit=10**6)
    q.add_consumer(c)
    q.purge()
    q.deleted = True
    turns.pop(0)()
    assert len(c.delivered) == 256
