"""Durable subscriptions stored in the topic log (store/topiclog.py), through the
durability layer on a real LmdbStore: a message fanned out to N subscriptions is
one record; settling moves cursors; restarts bring back every backlog, paged, with
its delivery counts; selectors, purge, unsubscribe, moves and the broker-wide
memory budget behave as for any durable queue."""

from __future__ import annotations

import pytest

from amqpbroker.core import queues
from amqpbroker.core.budget import ENTRY_COST
from amqpbroker.core.queues import Outcome
from amqpbroker.core.waiting import PAGED
from tests.core.helpers import RecordingConsumer, make_message
from tests.store.log_rig import LogRig, drain, names


@pytest.fixture
def rig(tmp_path, loop):
    rigs: list[LogRig] = []

    def make(**kw):
        r = LogRig(tmp_path / "store", loop, **kw)
        rigs.append(r)
        return r

    yield make
    for r in rigs:
        if r.store.env is not None:
            r.store.close()


# ---------------------------------------------------------------------- storage


def test_a_fan_out_to_many_subscriptions_is_one_record_and_one_body(rig):
    r = rig()
    subs = [r.subscribe(f"s{i}") for i in range(50)]
    r.publish("news.eu", 3)
    r.commit()
    assert len(r.log_records()) == 3 and r.messages() == 3
    assert all(r.entries_of(q) == 0 for q in subs)        # no per-queue entries
    assert all(q.depth == 3 and q.in_log for q in subs)
    assert [names(drain(q)) for q in subs[:2]] == [["m00", "m01", "m02"]] * 2


def test_records_and_bodies_go_when_every_subscription_settled(rig):
    r = rig()
    a, b = r.subscribe("a"), r.subscribe("b")
    r.publish("news.eu", 4)
    r.commit()
    drain(a)
    r.commit()
    assert len(r.log_records()) == 4 and r.messages() == 4   # b still owes them
    drain(b)
    r.commit()
    assert r.log_records() == [] and r.messages() == 0
    assert a.depth == b.depth == 0


def test_subscriptions_get_only_what_their_binding_and_selector_take(rig):
    r = rig()
    everything = r.subscribe("all", "news.#")
    eu = r.subscribe("eu", "news.eu")
    low = r.subscribe("low", "news.#", selector="n < 2")
    r.publish("news.eu", 2)
    r.publish("news.us", 2, start=2)
    r.publish("news.eu", 2, start=4)
    r.commit()
    assert len(r.log_records()) == 6
    assert names(drain(everything)) == [f"m{i:02d}" for i in range(6)]
    assert names(drain(eu)) == ["m00", "m01", "m04", "m05"]
    assert names(drain(low)) == ["m00", "m01"]


def test_a_message_to_no_subscription_is_not_in_the_log(rig):
    r = rig()
    r.subscribe("eu", "news.eu")
    r.publish("news.us", 2)
    r.commit()
    assert r.log_records() == [] and r.messages() == 0


def test_non_persistent_messages_reach_subscriptions_and_are_not_stored(rig):
    r = rig()
    q = r.subscribe("a")
    r.publish("news.eu", 2, durable=False)
    r.commit()
    assert r.log_records() == [] and q.depth == 2
    assert names(drain(q)) == ["m00", "m01"]


# ---------------------------------------------------------------------- restart


def test_restart_brings_every_backlog_back_paged_and_in_order(rig):
    r = rig()
    a, b, c = r.subscribe("a"), r.subscribe("b"), r.subscribe("c", "news.eu")
    r.publish("news.eu", 5)
    r.publish("news.us", 5, start=5)
    drain(a, 3)
    r.close()
    r2 = rig()
    a2, b2, c2 = r2.queue("a"), r2.queue("b"), r2.queue("c")
    assert (a2.depth, b2.depth, c2.depth) == (7, 10, 5)
    assert a2.paged_count == 7 and len(a2._ready) == 0      # nothing loaded until a consumer asks
    assert a2.bytes == a2.paged_bytes
    assert r2.dm.recovered_messages == 22
    assert names(drain(a2)) == [f"m{i:02d}" for i in range(3, 10)]
    assert names(drain(c2)) == [f"m{i:02d}" for i in range(5)]
    r2.publish("news.eu", 1, start=10)                        # new messages after the restart
    assert names(drain(b2)) == [f"m{i:02d}" for i in range(11)]
    r2.close()
    r3 = rig()
    assert r3.queue("a").depth == 1 and r3.queue("b").depth == 0 and r3.queue("c").depth == 1
    assert len(r3.log_records()) == 1


def test_delivered_and_unsettled_comes_back_redelivered_after_a_crash(rig):
    r = rig()
    q = r.subscribe("a")
    r.publish("news.eu", 4)
    r.commit()
    c = RecordingConsumer(credit=2)
    q.add_consumer(c)                                         # m00, m01 handed out, not settled
    assert names(c.delivered) == ["m00", "m01"]
    r.crash()
    r2 = rig()
    got = drain(r2.queue("a"))
    assert names(got) == ["m00", "m01", "m02", "m03"]
    assert [e.delivery_count for e in got][:2] == [1, 1]      # (the watermark may cover the rest too)
    assert r2.dm.redelivered >= 2


def test_a_failed_attempt_is_counted_across_a_restart(rig):
    r = rig()
    q = r.subscribe("a")
    r.publish("news.eu", 3)
    r.commit()
    c = RecordingConsumer(credit=1)
    q.add_consumer(c)
    q.settle(c.delivered[0], Outcome.MODIFIED, delivery_failed=True)
    q.remove_consumer(c, [], failed=False)
    r.close()
    r2 = rig()
    got = drain(r2.queue("a"))
    assert names(got) == ["m00", "m01", "m02"]
    assert [e.delivery_count for e in got] == [1, 0, 0]


def test_a_clean_stop_leaves_nothing_counted_as_redelivered(rig):
    r = rig()
    q = r.subscribe("a")
    r.publish("news.eu", 3)
    drain(q, 1)
    r.close()
    r2 = rig()
    assert r2.dm.redelivered == 0
    assert [e.delivery_count for e in drain(r2.queue("a"))] == [0, 0]


def test_settling_out_of_order_survives_a_restart(rig):
    r = rig()
    q = r.subscribe("a")
    r.publish("news.eu", 6)
    c = RecordingConsumer(credit=6)
    q.add_consumer(c)
    for e in c.delivered[2:5]:                              # m02..m04 acknowledged, the head not
        q.settle(e, Outcome.ACCEPTED)
    r.crash()
    r2 = rig()
    assert names(drain(r2.queue("a"))) == ["m00", "m01", "m05"]


# ---------------------------------------------------------------------- administration


def test_purge_and_unsubscribe_release_only_their_own_positions(rig):
    r = rig()
    a, b, c = r.subscribe("a"), r.subscribe("b"), r.subscribe("c")
    r.publish("news.eu", 5)
    r.commit()
    assert a.purge() == 5 and a.depth == 0
    r.unsubscribe(b)
    r.commit()
    assert len(r.log_records()) == 5                        # c still owes them
    assert r.cursor_record(b) is None
    assert names(drain(c)) == [f"m{i:02d}" for i in range(5)]
    r.commit()
    assert r.log_records() == [] and r.messages() == 0


def test_remove_below_reaches_into_a_paged_subscription(rig, monkeypatch):
    monkeypatch.setattr(queues, "PAGE_IN_BATCH", 4)
    r = rig(queue_budget=1)                                   # every message paged
    q = r.subscribe("a")
    r.publish("news.eu", 10)
    r.commit()
    assert q.paged_count == 10 and len(q._ready) == 0
    first = r.dm.topic.log.owed_after(q.store_id, 0, 10)
    assert q.remove_below(first[4]) == 4
    assert names(drain(q)) == [f"m{i:02d}" for i in range(4, 10)]


def test_a_paged_message_moved_away_is_settled_in_the_same_batch(rig):
    r = rig(queue_budget=1)
    q = r.subscribe("a")
    r.publish("news.eu", 3)
    r.commit()
    waiting = q.waiting_after(0, 10)
    assert [state for _, state in waiting] == [PAGED] * 3
    entry, state = waiting[1]
    assert q.take_waiting(entry, state)
    r.close()
    r2 = rig()
    assert names(drain(r2.queue("a"))) == ["m00", "m02"]


def test_a_subscription_made_after_a_message_does_not_owe_it(rig):
    r = rig()
    a = r.subscribe("a")
    r.publish("news.eu", 1)
    b = r.subscribe("b")
    r.publish("news.eu", 1, start=1)
    r.close()
    r2 = rig()
    assert names(drain(r2.queue("a"))) == ["m00", "m01"]
    assert names(drain(r2.queue("b"))) == ["m01"]


def test_a_direct_send_to_a_subscription_queue_is_its_alone(rig):
    from amqpbroker.core.addresses import AddressKind, Resolution
    from tests.core.helpers import make_message
    r = rig()
    a, b = r.subscribe("a"), r.subscribe("b")
    r.broker.publish(make_message("direct", durable=True), Resolution(AddressKind.QUEUE, a.name))
    r.close()
    r2 = rig()
    assert names(drain(r2.queue("a"))) == ["direct"] and r2.queue("b").depth == 0


# ---------------------------------------------------------------------- memory


def test_past_the_broker_budget_a_fan_out_costs_no_entry_per_subscription(rig):
    size = make_message("m00", durable=True, subject="news.eu", properties={"n": 0}).size
    each = ENTRY_COST + size
    r = rig(budget=20 * each)
    subs = [r.subscribe(f"s{i}") for i in range(10)]
    r.publish("news.eu", 20)
    r.commit()
    held = sum(len(q._ready) for q in subs)
    assert 20 <= held <= 21                                  # what the budget held, then counts only
    assert all(q.depth == 20 for q in subs)
    assert r.broker.budget.used <= r.broker.budget.limit + each
    assert names(drain(subs[3])) == [f"m{i:02d}" for i in range(20)]
    for q in subs:
        drain(q)
    assert r.broker.budget.used == 0


def test_page_in_is_bounded_by_the_broker_budget(rig, monkeypatch):
    r = rig(budget=1)                                         # used up at once
    subs = [r.subscribe(f"s{i}") for i in range(5)]
    r.publish("news.eu", 100)
    r.commit()
    for q in subs:
        q.add_consumer(RecordingConsumer(credit=0))          # consumers attached, no credit yet
    assert all(len(q._ready) == 0 for q in subs)             # nothing read for them yet
    for q in subs:
        q.add_consumer(RecordingConsumer(credit=1))
    assert all(len(q._ready) == 16 - 1 for q in subs)        # core/budget.py MIN_PAGE_IN each, one taken


# ---------------------------------------------------------------------- failures and outcomes


def test_a_fan_out_whose_batch_fails_leaves_every_subscription(rig):
    from amqpbroker.store.base import StoreFault
    from amqpbroker.store.faults import Faults
    r = rig(queue_budget=1)                                   # one paged (counts only), one below
    paged = r.subscribe("paged")
    live = r.subscribe("live")
    c = RecordingConsumer(credit=0)
    live.add_consumer(c)
    r.publish("news.eu", 2)
    r.commit()
    r.store._faults = r.store._outbox.faults = Faults.parse("seal:MemoryError@0*1")
    r.publish("news.eu", 3, start=2)
    assert isinstance(r.commit(), StoreFault)
    assert paged.depth == 2 and live.depth == 2               # the three lost ones are gone
    assert len(r.log_records()) == 2
    assert r.commit() is None                                 # the store resumed
    r.publish("news.eu", 1, start=5)
    assert names(drain(paged)) == ["m00", "m01", "m05"]
    live.remove_consumer(c, [], failed=False)
    assert names(drain(live)) == ["m00", "m01", "m05"]


def test_dead_lettered_after_max_attempts_moves_the_message_and_settles_the_position(rig):
    from amqpbroker.core.broker import BrokerPolicy
    r = rig(policy=BrokerPolicy(max_delivery_attempts=2, dead_letter_address="dlq"))
    dlq = r.broker.declare_queue("dlq", durable=True)
    q = r.subscribe("a")
    r.publish("news.eu", 2)
    for _ in range(2):
        c = RecordingConsumer(credit=1)
        q.add_consumer(c)
        q.settle(c.delivered[0], Outcome.MODIFIED, delivery_failed=True)
        q.remove_consumer(c, [], failed=False)
    assert q.depth == 1 and dlq.depth == 1
    r.close()
    r2 = rig(policy=BrokerPolicy(max_delivery_attempts=2, dead_letter_address="dlq"))
    assert names(drain(r2.queue("a"))) == ["m01"]
    assert names(drain(r2.broker.queues["dlq"])) == ["m00"]


def test_paged_messages_expire_when_paged_in(rig):
    r = rig(queue_budget=1)
    q = r.subscribe("a")
    r.publish("news.eu", 2, ttl=0.01)
    r.publish("news.eu", 1, start=2)
    r.close()
    r2 = rig()
    q2 = r2.queue("a")
    now = [10**12]
    q2.clock = lambda: now[0]
    assert q2.depth == 3
    assert names(drain(q2)) == ["m02"]
    assert q2.expired_total == 2
    r2.close()
    assert rig().queue("a").depth == 0


def test_a_delivery_far_from_the_head_is_marked_in_the_cursor(rig):
    from amqpbroker.store.marks import LOOKAHEAD
    r = rig()
    q = r.subscribe("a")
    n = LOOKAHEAD + 10
    r.publish("news.eu", n)
    r.publish("news.eu", 1, start=n, priority=9)              # jumps the queue: far from the head
    r.commit()
    c = RecordingConsumer(credit=1)
    q.add_consumer(c)
    assert names(c.delivered) == [f"m{n}"]
    assert r.dm.entry_marks == 1                              # no watermark over the whole backlog
    r.crash()
    r2 = rig()
    got = drain(r2.queue("a"))
    counts = {name: e.delivery_count for name, e in zip(names(got), got)}
    assert counts[f"m{n}"] == 1 and counts["m00"] == 0 and len(got) == n + 1


def test_browsing_a_subscription_shows_its_paged_messages(rig):
    r = rig(queue_budget=1)
    q = r.subscribe("a")
    r.publish("news.eu", 3)
    r.commit()
    assert [q.peek_body(e).size > 0 for e, _ in q.waiting_after(0, 10)] == [True] * 3
    assert q.depth == 3


def test_unbinding_a_subscription_ends_its_rule_but_keeps_what_it_owes(rig):
    r = rig()
    q = r.subscribe("a")
    r.publish("news.eu", 2)
    binding = r.broker.bindings_of(q)[0]
    r.broker.unbind(binding)
    r.publish("news.eu", 1, start=2)                          # not routed to it any more
    r.close()
    r2 = rig()
    assert names(drain(r2.queue("a"))) == ["m00", "m01"]


def test_the_budget_is_given_back_when_everything_is_drained(rig):
    r = rig(budget=1 << 20)
    subs = [r.subscribe(f"s{i}") for i in range(3)]
    p2p = r.broker.declare_queue("p2p", durable=True)
    r.broker.bind("amq.topic", "news.#", p2p)
    r.publish("news.eu", 50)
    assert r.broker.budget.used > 0
    for q in subs + [p2p]:
        drain(q)
    assert r.broker.budget.used == 0


def test_moving_a_subscriptions_backlog_elsewhere_is_exact_across_a_restart(rig):
    from amqpbroker.core.moves import Move, compile_filter
    r = rig(queue_budget=1)                                   # the backlog lives in the log only
    q, other = r.subscribe("a"), r.subscribe("b")
    r.broker.declare_queue("dst", durable=True)
    r.publish("news.eu", 6)
    r.commit()
    move = Move(r.broker, q, to="dst", replay=False, selector=compile_filter("n >= 3", 4096))
    while not move.step():
        pass
    assert move.report.moved == 3 and q.depth == 3
    r.close()
    r2 = rig()
    assert names(drain(r2.queue("a"))) == ["m00", "m01", "m02"]
    assert names(drain(r2.broker.queues["dst"])) == ["m03", "m04", "m05"]
    assert names(drain(r2.queue("b"))) == [f"m{i:02d}" for i in range(6)]   # other subscriptions untouched


def test_a_store_with_a_topic_log_walks_clean(rig):
    from amqpbroker.store.verify import walk
    r = rig()
    a, b = r.subscribe("a"), r.subscribe("b", selector="n < 1")
    r.publish("news.eu", 3)
    drain(a, 1)
    r.close()
    report = walk(r.store.path, full=True)
    assert report.ok, report.problems
    assert report.counts["cursors"] == 2 and report.counts["routes"] == 1 and report.counts["entries"] == 3
    assert not [n for n in report.notes if "no queue record" in n or "not one this broker uses" in n]
