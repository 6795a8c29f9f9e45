"""store/upgrade.py: per-entry durable subscription queues become topic log records and
cursors (the plan, one test per rule), and a store of that layout, written with the
store's own calls, restarts with every message (tests/e2e/test_store_upgrade.py does
it with a store the old broker wrote)."""

from __future__ import annotations

from amqpbroker.store.base import EntryRecord
from amqpbroker.store.upgrade import DIRECT_ROUTE, EVERY_ROUTE, plan
from tests.store.log_rig import LogRig, drain, names
from tests.core.helpers import make_message


def e(seq: int, mid: int, count: int = 0, delivered: bool = False) -> EntryRecord:
    return EntryRecord(seq, mid, count, delivered, 4, 100)


def planned(entries: dict[int, list[EntryRecord]], marks: dict[int, int] | None = None, first: int = 1):
    return plan(list(entries), lambda q: iter(entries[q]), marks or {}, first)


def test_messages_held_by_every_queue_become_one_record_each_with_no_exceptions():
    p = planned({1: [e(1, 10), e(2, 11)], 2: [e(5, 10), e(6, 11)], 3: [e(1, 10), e(2, 11)]})
    assert [(pos, route, rec.msg_id, plus, minus) for pos, route, rec, plus, minus in p.records] == [
        (1, EVERY_ROUTE, 10, (), ()), (2, EVERY_ROUTE, 11, (), ())]
    assert {q: (c.joined, c.floor) for q, c in p.cursors.items()} == {1: (1, 1), 2: (1, 1), 3: (1, 1)}
    assert p.last == 2


def test_a_queue_holding_part_of_them_is_in_minus_of_the_others_after_its_first():
    p = planned({1: [e(1, 10), e(2, 11), e(3, 12)], 2: [e(1, 11)], 3: [e(1, 10), e(2, 12)]})
    minus = {rec.msg_id: m for _, _, rec, _, m in p.records}
    assert minus == {10: (), 11: (3,), 12: (2,)}
    assert p.cursors[2].joined == 2                          # nothing before its first message


def test_a_queue_not_in_message_id_order_gets_records_of_its_own():
    p = planned({1: [e(1, 10), e(2, 11)], 2: [e(1, 11), e(2, 10)]})
    own = [(pos, route, rec.msg_id, plus) for pos, route, rec, plus, _ in p.records if route == DIRECT_ROUTE]
    assert own == [(3, DIRECT_ROUTE, 11, (2,)), (4, DIRECT_ROUTE, 10, (2,))]
    assert p.cursors[2].joined == 3
    assert [m for _, route, _, _, m in p.records if route == EVERY_ROUTE] == [(), ()]


def test_an_empty_queue_owes_nothing_of_the_upgrade():
    p = planned({1: [e(1, 10)], 2: []})
    assert p.records[0][4] == () and p.cursors[2].joined == 2


def test_delivered_entries_and_those_under_the_watermark_are_counted_once_more():
    p = planned({1: [e(1, 10), e(2, 11, delivered=True), e(3, 12)], 2: [e(1, 10), e(2, 11), e(3, 12)]},
                marks={1: 1})
    counts = {rec.msg_id: rec.delivery_count for _, _, rec, _, _ in p.records}
    assert counts == {10: 1, 11: 1, 12: 0}                   # the first holder's count is the base
    assert p.cursors[2].states == {1: (0, False), 2: (0, False)}
    assert p.cursors[1].states == {}


def test_positions_continue_after_the_log():
    p = planned({1: [e(1, 10)]}, first=100)
    assert p.records[0][0] == 100 and p.cursors[1].joined == 100 and p.last == 100


# ---------------------------------------------------------------------- a store of the old layout


def test_a_store_of_per_entry_subscription_queues_restarts_with_every_message(tmp_path, loop):
    r = LogRig(tmp_path / "store", loop)
    a, b = r.subscribe("a"), r.subscribe("b")
    r.close()
    # Rewrite the two subscriptions as the broker before the topic log stored them:
    # no cursors, an entry per message in each queue.
    from amqpbroker.store.lmdb_store import LmdbStore
    store = LmdbStore(tmp_path / "store")
    store.open(loop)
    for q in (a, b):
        store.writes().put_live("cursors", q.store_id.to_bytes(4, "big"), None)
    msgs = [make_message(f"m{i:02d}", durable=True) for i in range(4)]
    for i, m in enumerate(msgs):
        mid = store.new_msg_id()
        store.put_message(mid, m.raw)
        store.put_entry(a.store_id, EntryRecord(i + 1, mid, 0, False, 4, m.size))
        if i % 2:
            store.put_entry(b.store_id, EntryRecord(i + 1, mid, 0, i == 3, 4, m.size))
    fut = loop.create_future()
    store.after_commit(lambda err: fut.set_result(err))
    assert loop.run_until_complete(fut) is None
    store.close()
    r2 = LogRig(tmp_path / "store", loop)
    assert r2.entries_of(r2.queue("a")) == 0 and r2.entries_of(r2.queue("b")) == 0
    assert len(r2.log_records()) == 4 and r2.messages() == 4
    got_b = drain(r2.queue("b"))
    assert names(got_b) == ["m01", "m03"] and [x.delivery_count for x in got_b] == [0, 1]
    assert names(drain(r2.queue("a"))) == ["m00", "m01", "m02", "m03"]
    r2.close()
    r3 = LogRig(tmp_path / "store", loop)
    assert r3.log_records() == [] and r3.messages() == 0
    r3.close()
