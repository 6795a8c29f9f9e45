"""core/topiclog.py: who owes which log record, one test per rule; and
core/logrecovery.py: the index rebuilt from what the store holds equals the one
kept while running (a seeded random workload)."""

from __future__ import annotations

import random

import pytest

from amqpbroker.core.cursors import Cursor
from amqpbroker.core.exchanges import Binding, Exchange, ExchangeType, binding_matches
from amqpbroker.core.logrecovery import rebuild
from amqpbroker.core.topiclog import DIRECT, EVERY, Member, TopicLog

TOPIC = ExchangeType.TOPIC


def member(log: TopicLog, qid: int, key: str | None = "#", exchange: str = "amq.topic",
           kind: ExchangeType = TOPIC) -> Member:
    m = Member(qid, Cursor(joined=log.positions.last + 1),
               exchange if key is not None else None, kind if key is not None else None, key)
    log.join(m)
    return m


def publish(log: TopicLog, key: str, routed: list[int], exchange: str = "amq.topic"):
    pos = next(log.positions)
    rid, _ = log.route(("exchange", exchange, key))
    plus, minus = log.append(pos, rid, routed)
    return pos, plus, minus


# ---------------------------------------------------------------------- recording


def test_unfiltered_members_are_recorded_by_their_rule_alone():
    log = TopicLog()
    for q in range(1, 1001):
        member(log, q, "prices.#")
    pos, plus, minus = publish(log, "prices.eur", list(range(1, 1001)))
    assert plus == () and minus == ()
    assert log.exceptions == {}                  # O(1) whatever the number of members
    assert log.owing_at(pos) == 1000
    assert all(log.owes(q, pos) for q in (1, 500, 1000))


def test_a_filtered_member_is_named_in_plus_only_where_it_accepted():
    log = TopicLog()
    member(log, 1, "prices.#")
    member(log, 2, None)                         # a selector: no rule
    a, plus_a, _ = publish(log, "prices.eur", [1, 2])
    b, plus_b, _ = publish(log, "prices.eur", [1])
    assert plus_a == (2,) and plus_b == ()
    assert log.owes(2, a) and not log.owes(2, b)


def test_a_rule_member_the_exchange_did_not_route_to_is_named_in_minus():
    log = TopicLog()
    member(log, 1, "#")
    member(log, 2, "#")
    pos, plus, minus = publish(log, "k", [1])
    assert minus == (2,) and not log.owes(2, pos) and log.owes(1, pos)


def test_a_member_does_not_owe_what_came_before_it_joined():
    log = TopicLog()
    member(log, 1, "#")
    before, _, _ = publish(log, "k", [1])
    member(log, 2, "#")
    after, _, _ = publish(log, "k", [1, 2])
    assert not log.owes(2, before) and log.owes(2, after)


def test_direct_records_reach_their_plus_only():
    log = TopicLog()
    member(log, 1, "#")
    member(log, 2, "#")
    pos = next(log.positions)
    rid, _ = log.route(DIRECT)
    assert log.append(pos, rid, [2]) == ((2,), ())
    assert log.owes(2, pos) and not log.owes(1, pos)


def test_every_route_takes_each_member_that_covers_the_position():
    log = TopicLog()
    member(log, 1, None)
    member(log, 2, "x")
    pos = next(log.positions)
    rid, _ = log.route(EVERY)
    log.put(pos, rid, 2)
    assert log.owes(1, pos) and log.owes(2, pos)
    member(log, 3, "#")
    assert not log.owes(3, pos)


def test_routes_are_interned():
    log = TopicLog()
    a, new_a = log.route(("exchange", "amq.topic", "k"))
    b, new_b = log.route(("exchange", "amq.topic", "k"))
    assert a == b and new_a and not new_b


@pytest.mark.parametrize("kind, binding_key, routing_key, taken", [
    (ExchangeType.TOPIC, "a.*", "a.b", True),
    (ExchangeType.TOPIC, "a.*", "a.b.c", False),
    (ExchangeType.TOPIC, "#", "", True),
    (ExchangeType.DIRECT, "k", "k", True),
    (ExchangeType.DIRECT, "k", "j", False),
    (ExchangeType.FANOUT, "whatever", "other", True),
])
def test_binding_matches_agrees_with_exchange_route(kind, binding_key, routing_key, taken):
    ex = Exchange("x", kind)
    ex.bind(Binding("x", binding_key, object()))
    assert bool(ex.route(routing_key)) is taken
    assert binding_matches(kind, binding_key, routing_key) is taken


# ---------------------------------------------------------------------- settling


def test_the_record_is_free_when_its_last_member_settles_it():
    log = TopicLog()
    member(log, 1, "#")
    member(log, 2, "#")
    pos, _, _ = publish(log, "k", [1, 2])
    assert log.settle(1, pos) is False
    assert log.settle(1, pos) is False            # twice: no change
    assert log.settle(2, pos) is True
    assert log.route_at(pos) == 0 and log.records == 0


def test_settling_what_a_member_does_not_owe_changes_nothing():
    log = TopicLog()
    member(log, 1, "#")
    member(log, 2, None)
    pos, _, _ = publish(log, "k", [1])
    assert log.settle(2, pos) is False and log.owing_at(pos) == 1


def test_owed_after_skips_settled_and_foreign_positions():
    log = TopicLog()
    member(log, 1, "a")
    member(log, 2, "b")
    ps = [publish(log, k, [1] if k == "a" else [2])[0] for k in "ababa"]
    log.settle(1, ps[2])
    assert log.owed_after(1, 0, 10) == [ps[0], ps[4]]
    assert log.owed_after(1, ps[0], 10) == [ps[4]]
    assert log.owed_after(1, 0, 1) == [ps[0]]
    assert log.owed_after(1, 0, 10, below=ps[4]) == [ps[0]]


def test_the_head_of_the_index_is_cut_in_runs():
    log = TopicLog()
    member(log, 1, "#")
    ps = [publish(log, "k", [1])[0] for _ in range(3000)]
    for p in ps[:2000]:
        log.settle(1, p)
    assert log.start > ps[0] and log.start <= ps[2000]
    assert log.owed_after(1, 0, 5) == ps[2000:2005]


def test_a_member_leaving_releases_what_it_owed():
    log = TopicLog()
    member(log, 1, "#")
    member(log, 2, "#")
    a, _, _ = publish(log, "k", [1, 2])
    b, _, _ = publish(log, "k", [1, 2])
    log.settle(1, a)
    assert log.leave(1) == []
    assert log.leave(2) == [a, b]
    assert log.records == 0


def test_unbinding_ends_the_rule_for_later_positions():
    log = TopicLog()
    member(log, 1, "#")
    before, _, _ = publish(log, "k", [1])
    log.unbind(1)
    assert log.rule_count(log.route(("exchange", "amq.topic", "k"))[0]) == 0
    after, plus, minus = publish(log, "k", [1])    # still routed by another binding: plus
    assert plus == (1,) and log.owes(1, before) and log.owes(1, after)


def test_rule_counts_follow_joins_and_leaves():
    log = TopicLog()
    member(log, 1, "#")
    rid = log.route(("exchange", "amq.topic", "k"))[0]
    assert log.rule_count(rid) == 1
    member(log, 2, "k")
    member(log, 3, "other")
    assert log.rule_count(rid) == 2
    log.leave(2)
    assert log.rule_count(rid) == 1


def test_a_lost_record_is_owed_by_nobody():
    log = TopicLog()
    member(log, 1, "#")
    pos, _, _ = publish(log, "k", [1])
    log.lost(pos)
    assert not log.owes(1, pos) and log.records == 0


def test_unused_routes_are_freed():
    log = TopicLog()
    member(log, 1, "#")
    pos, _, _ = publish(log, "once", [1])
    rid = log.route_at(pos)
    log.settle(1, pos)
    assert log.freed_routes == [rid] and rid not in log.routes


# ---------------------------------------------------------------------- recovery


def snapshot(log: TopicLog):
    """What the store holds: the rows of live records, routes, cursors."""
    rows = []
    for i, rid in enumerate(log.route_of):
        if rid:
            pos = log.start + i
            plus, minus = log.exceptions.get(pos, (frozenset(), frozenset()))
            rows.append((pos, rid, 10 + pos % 7, plus, minus))
    return rows


def copy_members(src: TopicLog, dst: TopicLog) -> None:
    for qid, m in src.members.items():
        c = Cursor(m.cursor.joined, m.cursor.floor, m.cursor.left)
        c.ranges = [list(r) for r in m.cursor.ranges]
        dst.join(Member(qid, c, m.exchange, m.kind, m.binding_key))


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_rebuilt_index_equals_the_running_one(seed):
    rng = random.Random(seed)
    log = TopicLog()
    keys = ["a", "b", "c"]
    for q in range(1, 9):
        member(log, q, rng.choice(["#", "a", "b", None]))
    held: dict[int, list[int]] = {q: [] for q in log.members}
    for step in range(600):
        action = rng.random()
        if action < 0.5:
            key = rng.choice(keys)
            routed = [q for q, m in log.members.items()
                      if (m.binding_key in ("#", key) and m.cursor.left is None) or
                      (m.exchange is None and rng.random() < 0.5)]
            if routed:
                pos, _, _ = publish(log, key, routed)
                for q in routed:
                    held[q].append(pos)
        elif action < 0.9:
            q = rng.choice(list(log.members))
            if held[q]:
                pos = held[q].pop(rng.randrange(len(held[q])) if rng.random() < 0.3 else 0)
                log.settle(q, pos)
        elif action < 0.93 and len(log.members) > 3:
            q = rng.choice(list(log.members))
            log.leave(q)
            del held[q]
        elif action < 0.96:
            q = max(held) + 1
            member(log, q, rng.choice(["#", "c", None]))
            held[q] = []
    sizes = {row[0]: row[2] for row in snapshot(log)}
    again = TopicLog(last_position=log.positions.last)
    for rid, route in log.routes.items():
        again.add_route(rid, route)
    copy_members(log, again)
    rebuilt = rebuild(again, snapshot(log))
    assert rebuilt.orphans == []
    for q, positions in held.items():
        count, size = rebuilt.backlog[q]
        assert count == len(positions), q
        assert size == sum(sizes[p] for p in positions), q
        assert again.owed_after(q, 0, 10**6) == sorted(positions)
    for row in snapshot(log):
        assert again.owing_at(row[0]) == log.owing_at(row[0])


def test_rebuild_finds_records_nobody_owes():
    log = TopicLog()
    member(log, 1, "#")
    pos, _, _ = publish(log, "k", [1])
    rows = snapshot(log)
    again = TopicLog(last_position=log.positions.last)
    for rid, route in log.routes.items():
        again.add_route(rid, route)
    out = rebuild(again, rows)                     # the member is gone (no cursor)
    assert out.orphans == [pos] and again.records == 0


def test_rebuild_counts_what_comes_back_redelivered():
    log = TopicLog()
    member(log, 1, "#")
    ps = [publish(log, "k", [1])[0] for _ in range(10)]
    again = TopicLog(last_position=log.positions.last)
    for rid, route in log.routes.items():
        again.add_route(rid, route)
    copy_members(log, again)
    out = rebuild(again, snapshot(log), marks={1: ps[3]})
    assert out.redelivered == 4 and out.backlog[1][0] == 10
