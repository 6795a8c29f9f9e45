"""No self-feeding loops (core/moves.py, dead-letter routing in core/broker.py,
core/history.py): a move, a replay or a dead-lettering ends, with a bounded number
of copies, whatever the topology; the three findings, then what decides.

Each run is bounded by a count of steps or publishes (never by time): past the
bound the operation is a loop and the test fails."""

from __future__ import annotations

import logging

import pytest
from proton import Message as PnMessage

from amqpbroker.core.broker import Broker, BrokerPolicy
from amqpbroker.core.limits import Overflow, QueueLimits
from amqpbroker.core.moves import Move
from amqpbroker.core.queues import Outcome
from tests.core.helpers import RecordingConsumer, bodies, make_message

MAX_STEPS = 10_000


class Loop(AssertionError):
    pass


def guard(b: Broker, limit: int = 20_000) -> list[int]:
    """Count the broker's publishes; past `limit` it is a loop (raised, not waited for)."""
    calls = [0]
    publish = b.publish

    def counted(*a, **kw):
        calls[0] += 1
        if calls[0] > limit:
            raise Loop(f"more than {limit} publishes: a loop")
        return publish(*a, **kw)
    b.publish = counted
    return calls


def run(move: Move) -> dict:
    steps = 0
    while not move.step():
        steps += 1
        if steps > MAX_STEPS:
            raise Loop(f"the move did not end in {MAX_STEPS} steps: {move.report.view()}")
    return move.report.view()


def total(b: Broker) -> int:
    return sum(q.depth for q in b.queues.values())


def reject(q, n: int) -> None:
    c = RecordingConsumer(credit=n)
    q.add_consumer(c)
    for e in list(c.delivered):
        q.settle(e, Outcome.REJECTED)
    q.remove_consumer(c, [], failed=False)


# ---------------------------------------------------------------------- the findings


def test_a_move_into_an_exchange_bound_back_to_the_source_ends():
    """Finding 1: 20 messages became 640,000 copies (the move picked up what it put
    back into its own source).  The move is bounded by the source as it was when it
    started, and a copy never goes back into the queue it is leaving."""
    b = Broker()
    src = b.declare_queue("src")
    other = b.declare_queue("other")
    b.declare_exchange("fan", "fanout")
    b.bind("fan", "", src)
    b.bind("fan", "", other)
    for i in range(20):
        b.publish(make_message(f"m{i}"), b.resolve("src"))
    guard(b)
    report = run(Move(b, src, to="fan", replay=False))
    assert report["moved"] == 20
    assert other.depth == 20 and src.depth == 0, (src.depth, other.depth)
    assert bodies(other.entries()) == [f"m{i}" for i in range(20)]


def test_a_move_whose_only_destination_is_the_source_moves_nothing():
    b = Broker()
    src = b.declare_queue("src")
    b.declare_exchange("back", "fanout")
    b.bind("back", "", src)
    for i in range(5):
        b.publish(make_message(f"m{i}"), b.resolve("src"))
    report = run(Move(b, src, to="back", replay=False))
    assert report["moved"] == 0 and src.depth == 5
    assert report["skip_reasons"] == {"routed back into queue src only": 5}


def test_replaying_into_a_full_drop_head_queue_whose_dead_letters_come_back_ends():
    """Finding 2: a replay of DLQ into a full drop-head queue whose dead-letter address
    is that DLQ churned for ever (each replayed message pushed one out, back into
    DLQ, where the replay found it again)."""
    b = Broker(BrokerPolicy(dead_letter_address="DLQ"))
    dlq = b.declare_queue("DLQ")
    q = b.declare_queue("q")
    for i in range(30):
        b.publish(make_message(f"m{i}"), b.resolve("q"))
    reject(q, 30)
    assert dlq.depth == 30
    q.set_limits(QueueLimits(max_depth=5, overflow=Overflow.DROP_HEAD), None)
    for i in range(5):
        b.publish(make_message(f"fill{i}"), b.resolve("q"))
    calls = guard(b)
    report = run(Move(b, dlq, to=None, replay=True))
    assert report["moved"] == 30
    assert q.depth == 5 and total(b) == 35          # nothing duplicated, nothing lost
    assert calls[0] <= 2 * 35


def test_a_drop_head_dlq_fed_through_a_fanout_that_is_the_dead_letter_address(caplog):
    """Finding 3: one message froze the event loop for good (each head the full DLQ
    dropped was dead-lettered back into it), 1.2 million log lines.  A message that
    dies in a queue the dead-letter address routes to is dropped, not dead-lettered
    again; the lines about it are rate-limited."""
    b = Broker(BrokerPolicy(dead_letter_address="dlx"))
    b.declare_exchange("dlx", "fanout")
    dlq = b.declare_queue("DLQ", limits=QueueLimits(max_depth=3, overflow=Overflow.DROP_HEAD))
    b.bind("dlx", "", dlq)
    q = b.declare_queue("q")
    for i in range(10):
        b.publish(make_message(f"m{i}"), b.resolve("q"))
    calls = guard(b)
    with caplog.at_level(logging.DEBUG, logger="amqpbroker.broker"):
        reject(q, 10)
    assert dlq.depth == 3 and bodies(dlq.entries()) == ["m7", "m8", "m9"]
    assert calls[0] <= 20
    assert b.dead_letters_dropped_total == 7
    assert len([r for r in caplog.records if "dead-letter" in r.getMessage()]) <= 12


def test_a_queue_the_dead_letter_address_routes_to_never_dead_letters():
    """The dead-letter address is an exchange that also routes to a working queue:
    that queue is a dead-letter queue too, so what dies there is dropped (counted),
    never sent round again; what dies elsewhere reaches both."""
    b = Broker(BrokerPolicy(dead_letter_address="dlx"))
    b.declare_exchange("dlx", "fanout")
    q = b.declare_queue("q")
    parked = b.declare_queue("parked")
    r = b.declare_queue("r")
    b.bind("dlx", "", q)
    b.bind("dlx", "", parked)
    assert b.dead_letter_queues() == ["parked", "q"]
    b.publish(make_message("from-q"), b.resolve("q"))
    b.publish(make_message("from-r"), b.resolve("r"))
    guard(b)
    reject(q, 1)
    assert q.depth == 0 and parked.depth == 0 and b.dead_letters_dropped_total == 1
    reject(r, 1)
    assert bodies(q.entries()) == ["from-r"] and bodies(parked.entries()) == ["from-r"]


def test_two_drop_head_dead_letter_queues_do_not_feed_each_other():
    b = Broker(BrokerPolicy(dead_letter_address="dlx"))
    b.declare_exchange("dlx", "fanout")
    d1 = b.declare_queue("d1", limits=QueueLimits(max_depth=2, overflow=Overflow.DROP_HEAD))
    d2 = b.declare_queue("d2", limits=QueueLimits(max_depth=3, overflow=Overflow.DROP_HEAD))
    b.bind("dlx", "", d1)
    b.bind("dlx", "", d2)
    q = b.declare_queue("q")
    for i in range(50):
        b.publish(make_message(f"m{i}"), b.resolve("q"))
    calls = guard(b)
    reject(q, 50)
    assert d1.depth == 2 and d2.depth == 3
    assert calls[0] <= 100


# ---------------------------------------------------------------------- what is kept


def history_of(entry) -> list:
    m = PnMessage()
    m.decode(entry.payload())
    return list((m.annotations or {}).get("x-opt-amqpbroker-history") or [])


def test_a_moved_message_carries_where_it_was_moved_from():
    b = Broker()
    a = b.declare_queue("a")
    z = b.declare_queue("z")
    b.publish(make_message("m"), b.resolve("a"))
    run(Move(b, a, to="z", replay=False, op="move-7"))
    (record,) = history_of(z.entries()[0])
    assert record["queue"] == "a" and record["reason"] == "moved" and record["op"] == "move-7"
    assert record["count"] == 1


def test_a_move_only_examines_what_was_there_when_it_started():
    b = Broker()
    a = b.declare_queue("a")
    b.declare_queue("z")
    for i in range(600):
        b.publish(make_message(f"m{i}"), b.resolve("a"))
    move = Move(b, a, to="z", replay=False)
    move.step()
    for i in range(600, 700):     # arrive while it runs
        b.publish(make_message(f"m{i}"), b.resolve("a"))
    report = run(move)
    assert report["moved"] == 600 and report["examined"] == 600 and a.depth == 100
    assert report["total"] == 600


def test_a_move_can_be_cancelled_between_slices():
    b = Broker()
    a = b.declare_queue("a")
    b.declare_queue("z")
    for i in range(1000):
        b.publish(make_message(f"m{i}"), b.resolve("a"))
    move = Move(b, a, to="z", replay=False)
    move.step()
    move.cancel("cancelled by test")
    assert move.step() is True
    report = move.report.view()
    assert report["stopped"] == "cancelled by test" and 0 < report["moved"] < 1000
    assert a.depth + b.queues["z"].depth == 1000


@pytest.mark.parametrize("n", [1, 3])
def test_dead_lettered_copies_count_their_deaths_per_queue_and_reason(n):
    b = Broker(BrokerPolicy(dead_letter_address="DLQ"))
    dlq = b.declare_queue("DLQ")
    q = b.declare_queue("q")
    b.publish(make_message("m"), b.resolve("q"))
    for _ in range(n):           # rejected, replayed, rejected again ...
        reject(q, 1)
        run(Move(b, dlq, to=None, replay=True))
    reject(q, 1)
    (died,) = [r for r in history_of(dlq.entries()[0]) if r["reason"] == "rejected"]
    assert died["queue"] == "q" and died["count"] == n + 1
