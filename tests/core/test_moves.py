"""core/moves.py and core/waiting.py on the pure model (no store): replay of a
dead-letter queue to each message's origin, the general move, selectors, limits,
and what is never moved (acquired, unroutable)."""

from __future__ import annotations

import pytest
from proton import Message as PnMessage

from amqpbroker.core.broker import Broker, BrokerPolicy
from amqpbroker.core.deadletters import DLQ_ADDRESS, DLQ_KEYS, DLQ_QUEUE, DLQ_REASON
from amqpbroker.core.limits import Overflow, QueueLimits
from amqpbroker.core.moves import Move, MoveRefused, compile_filter
from amqpbroker.core.queues import Outcome
from tests.core.helpers import RecordingConsumer, bodies, make_message


def run(move: Move) -> dict:
    steps = 0
    while not move.step():
        steps += 1
        assert steps < 10_000
    return move.report.view()


def dead_lettered(n: int = 3, *, source: str = "orders", **fields) -> Broker:
    """A broker whose DLQ holds `n` messages rejected from `source`."""
    b = Broker(BrokerPolicy(dead_letter_address="DLQ"))
    b.declare_queue("DLQ")
    q = b.declare_queue(source)
    for i in range(n):
        b.publish(make_message(f"m{i}", properties={"i": i}, **fields), b.resolve(source))
    c = RecordingConsumer(credit=n)
    q.add_consumer(c)
    for e in list(c.delivered):
        q.settle(e, Outcome.REJECTED)
    q.remove_consumer(c, [], failed=False)
    return b


def annotations(entry) -> dict:
    m = PnMessage()
    m.decode(entry.payload())
    return m.annotations or {}


def test_dead_lettering_records_origin_and_reason():
    b = dead_lettered(2)
    dlq = b.queues["DLQ"].entries()
    assert len(dlq) == 2
    ann = annotations(dlq[0])
    assert ann[DLQ_QUEUE] == "orders" and ann[DLQ_ADDRESS] == "orders" and ann[DLQ_REASON] == "rejected"


def test_replay_sends_every_message_back_without_the_annotations():
    b = dead_lettered(3)
    report = run(Move(b, b.queues["DLQ"], to=None, replay=True))
    assert report["moved"] == 3 and report["destinations"] == {"orders": 3}
    assert b.queues["DLQ"].depth == 0
    back = b.queues["orders"].entries()
    assert bodies(back) == ["m0", "m1", "m2"]
    assert all(not (set(annotations(e)) & set(DLQ_KEYS)) for e in back)
    assert all(e.delivery_count == 0 for e in back)


def test_replay_with_selector_and_limit():
    b = dead_lettered(5)
    sel = compile_filter("i >= 2", 4096)
    report = run(Move(b, b.queues["DLQ"], to=None, replay=True, selector=sel, limit=2))
    assert report["moved"] == 2
    assert bodies(b.queues["orders"].entries()) == ["m2", "m3"]
    assert bodies(b.queues["DLQ"].entries()) == ["m0", "m1", "m4"]


def test_move_to_another_queue_keeps_annotations_and_count():
    b = dead_lettered(2)
    b.declare_queue("parking")
    report = run(Move(b, b.queues["DLQ"], to="parking", replay=False))
    assert report["moved"] == 2
    moved = b.queues["parking"].entries()
    assert annotations(moved[0])[DLQ_QUEUE] == "orders"


def test_message_without_origin_is_left_in_place():
    b = dead_lettered(1)
    b.publish(make_message("stray"), b.resolve("DLQ"))
    report = run(Move(b, b.queues["DLQ"], to=None, replay=True))
    assert report["moved"] == 1 and report["skip_reasons"] == {"no dead-letter origin": 1}
    assert bodies(b.queues["DLQ"].entries()) == ["stray"]


def test_acquired_messages_do_not_move():
    b = Broker()
    q = b.declare_queue("a")
    b.declare_queue("z")
    for i in range(3):
        b.publish(make_message(f"m{i}"), b.resolve("a"))
    c = RecordingConsumer(credit=1)
    q.add_consumer(c)
    report = run(Move(b, q, to="z", replay=False))
    assert report["moved"] == 2 and q.acquired == 1 and q.depth == 1
    assert bodies(c.delivered) == ["m0"]


def test_unroutable_copy_leaves_the_message():
    b = Broker()
    q = b.declare_queue("a")
    b.declare_exchange("ex", "direct")
    b.publish(make_message("m"), b.resolve("a"))
    report = run(Move(b, q, to="ex/nokey", replay=False))
    assert report["moved"] == 0 and report["skipped"] == 1 and q.depth == 1


def test_full_reject_destination_stops_the_move():
    b = Broker()
    q = b.declare_queue("a")
    b.declare_queue("z", limits=QueueLimits(max_depth=1, overflow=Overflow.REJECT))
    for i in range(3):
        b.publish(make_message(f"m{i}"), b.resolve("a"))
    report = run(Move(b, q, to="z", replay=False))
    assert report["moved"] == 1 and "full" in report["stopped"] and q.depth == 2


@pytest.mark.parametrize("to", ["nowhere", "a"])
def test_bad_destinations_are_refused(to):
    b = Broker()
    q = b.declare_queue("a")
    with pytest.raises(MoveRefused):
        Move(b, q, to=to, replay=False)


def test_bad_selector():
    with pytest.raises(ValueError, match="bad selector"):
        compile_filter("i >>> 2", 4096)
    assert compile_filter("  ", 4096) is None


def test_waiting_after_lists_ready_and_scheduled_in_sequence_order():
    clock = [1000.0]
    b = Broker(clock=lambda: clock[0])
    q = b.declare_queue("a")
    b.publish(make_message("now1"), b.resolve("a"))
    b.publish(make_message("later", annotations={"x-opt-delivery-time": 2_000_000}), b.resolve("a"))
    b.publish(make_message("now2"), b.resolve("a"))
    states = [(e.seq, s) for e, s in q.waiting_after(0, 10, scheduled=True)]
    assert states == [(1, "ready"), (2, "scheduled"), (3, "ready")]
    assert [e.seq for e, _ in q.waiting_after(1, 1)] == [3]
