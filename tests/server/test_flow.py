"""FlowGate (server/flow.py): how much credit a producer gets, who holds it and who wakes
it, with fake producers (credit counted as proton would) and the real core model."""

from __future__ import annotations

from amqpbroker.core.addresses import AddressKind, Resolution
from amqpbroker.core.alarms import Alarms
from amqpbroker.core.broker import Broker
from amqpbroker.core.credit import top_up_below
from amqpbroker.core.limits import Overflow, QueueLimits
from amqpbroker.core.queues import Outcome
from amqpbroker.core.transactions import TransactionRegistry
from amqpbroker.server.flow import ALARM, FlowGate
from tests.core.helpers import RecordingConsumer, make_message


class Loop:
    def __init__(self):
        self.soon = []

    def call_soon(self, fn, *args):
        self.soon.append((fn, args))

    def run(self):
        soon, self.soon = self.soon, []
        for fn, args in soon:
            fn(*args)


class Handler:
    ended = False

    def __init__(self):
        self.endpoints = {}


class FakeProducer:
    """A producer link as the gate sees it: credit granted minus taken."""

    def __init__(self, gate, target, window=20, handler=None):
        self.gate = gate
        self.target = target
        self.window = window
        self.low = top_up_below(window)
        self.credit = 0
        self.last_size = 0
        self.feeds = ()
        self.held = None
        self.released = False
        self.impl = object()
        self.handler = handler or Handler()
        self.handler.endpoints[self.impl] = self

    def outstanding(self):
        return max(0, self.credit)

    def top_up(self):
        if self.credit < self.low:
            self.credit += self.gate.grant(self, self.credit)

    def send(self, broker, n=1, **fields):
        """Use credit: each message is taken into the broker."""
        for _ in range(n):
            assert self.credit > 0, "sent without credit"
            msg = make_message("m", **fields)
            broker.publish(msg, self.target)
            self.credit -= 1
            self.last_size = msg.size
            self.top_up()


def setup(limits=None, window=20):
    loop, broker = Loop(), Broker()
    alarms = Alarms(disk_enabled=False)
    txns = TransactionRegistry()
    gate = FlowGate(loop, broker, alarms, txns)
    q = broker.declare_queue("q", limits=limits)
    return loop, broker, alarms, gate, q


def to_q():
    return Resolution(AddressKind.QUEUE, "q")


def consume(q, n):
    c = RecordingConsumer(credit=n)
    q.add_consumer(c)
    for entry in list(c.delivered):
        q.settle(entry, Outcome.ACCEPTED)
    q.remove_consumer(c, [], failed=False)


def test_nothing_holds_a_producer_by_default():
    _, broker, _, gate, _ = setup()
    p = FakeProducer(gate, to_q())
    p.top_up()
    assert p.credit == 20 and p.held is None and p.feeds == ()
    p.send(broker, 10)
    assert p.credit == 10, "not before half is used"
    p.send(broker, 1)
    assert p.credit == 20, "topped up to its window once more than half was used"


def test_alarm_holds_every_producer_and_its_clearing_tops_them_up():
    loop, broker, alarms, gate, _ = setup()
    p = FakeProducer(gate, to_q())
    relay = FakeProducer(gate, None)
    busy = FakeProducer(gate, to_q())
    busy.top_up()
    alarms.configure(memory_high_watermark_absolute=1)
    alarms.feed(rss=10 << 20, physical_memory=1 << 30)
    assert alarms.blocking
    for producer in (p, relay, busy):
        producer.top_up()
    assert (p.held, relay.held) == (ALARM, ALARM) and p.credit == 0 and gate.held == 2
    busy.send(broker, 11)
    assert busy.credit == 9 and busy.held is None, "it keeps what it held, gets no more"
    busy.send(broker, 9)
    assert busy.held is ALARM and gate.held == 3
    alarms.configure(memory_high_watermark_absolute=1 << 40)
    assert not alarms.blocking and loop.soon, "woken at the next loop turn, not inside the callback"
    loop.run()
    assert (p.credit, relay.credit, busy.credit) == (20, 20, 20) and gate.held == 0


def test_a_block_queue_grants_its_room_not_a_window_and_holds_at_the_limit():
    loop, broker, _, gate, q = setup(QueueLimits(max_depth=5, overflow=Overflow.BLOCK))
    p = FakeProducer(gate, to_q())
    p.top_up()
    assert p.credit == 3 and p.feeds == (q,), "half the room (rounded up), not its window"
    p.send(broker, 5)        # topped up as it goes: exactly the room, then nothing
    assert q.depth == 5 and p.credit == 0 and p.held is q and gate.held == 1
    c = RecordingConsumer(credit=1)
    q.add_consumer(c)
    assert not loop.soon, "delivered but not settled: still held"
    q.settle(c.delivered[0], Outcome.ACCEPTED)
    loop.run()
    assert p.held is None and p.credit == 1, "exactly the room that came"


def test_producers_share_the_room_and_together_never_exceed_it():
    loop, broker, _, gate, q = setup(QueueLimits(max_depth=10, overflow=Overflow.BLOCK))
    producers = [FakeProducer(gate, to_q()) for _ in range(3)]
    for p in producers:
        p.top_up()
    assert [p.credit for p in producers] == [5, 4, 1], "the first to ask leaves room for the next"
    for p in producers:
        p.send(broker, p.credit)
    assert q.depth == 10 and all(p.held is q for p in producers) and gate.held == 3
    consume(q, 8)
    loop.run()
    assert sorted(p.credit for p in producers) == [2, 2, 2], "woken together: an even share each"
    for p in producers:
        p.send(broker, p.credit)
    assert q.depth <= 10


def test_credit_counts_what_transactions_staged():
    loop, broker, _, gate, q = setup(QueueLimits(max_depth=5, overflow=Overflow.BLOCK))
    txn = gate.transactions.declare("c")
    for i in range(3):
        gate.transactions.stage(txn, make_message(i), to_q(), broker)
    p = FakeProducer(gate, to_q())
    p.top_up()
    assert p.credit == 1, "half of the 2 left (rounded up)"
    p.send(broker, 2)
    assert p.held is q and q.depth == 2, "the staged three hold the rest of the room"
    gate.transactions.rollback(gate.transactions.take(txn.txn_id))
    loop.run()
    assert p.credit == 2, "the room the rollback gave back, half at a time"


def test_exchange_producer_fed_block_queues_are_those_it_reaches():
    loop, broker, _, gate, q = setup(QueueLimits(max_depth=1, overflow=Overflow.BLOCK))
    broker.declare_exchange("ex", "topic")
    broker.bind("ex", "a.*", q)
    other = broker.declare_queue("other")
    broker.bind("ex", "#", other)
    p = FakeProducer(gate, Resolution(AddressKind.EXCHANGE, "ex"))
    keyed_elsewhere = FakeProducer(gate, Resolution(AddressKind.EXCHANGE, "ex", "b.c"))
    p.top_up()
    keyed_elsewhere.top_up()
    assert p.credit == 1 and p.feeds == (q,), "a bound block queue paces a producer without a fixed key"
    assert keyed_elsewhere.credit == 20 and keyed_elsewhere.feeds == ()
    p.send(broker, 1, subject="a.b")
    assert p.held is q
    q.purge()
    loop.run()
    assert p.credit == 1


def test_an_ended_producer_is_forgotten_never_woken_and_its_credit_is_room_again():
    loop, broker, _, gate, q = setup(QueueLimits(max_depth=1, overflow=Overflow.BLOCK))
    hoarder, waiter = FakeProducer(gate, to_q()), FakeProducer(gate, to_q())
    hoarder.top_up()
    waiter.top_up()
    assert (hoarder.credit, waiter.credit) == (1, 0) and waiter.held is q
    gate.forget(hoarder)           # its link ended holding credit it never used
    assert q not in gate.feeders or hoarder not in gate.feeders[q]
    loop.run()
    assert waiter.credit == 1
    gone = FakeProducer(gate, to_q())
    gone.top_up()
    assert gone.held is q
    del gone.handler.endpoints[gone.impl]    # its link ended (and may be freed) without forget
    consume(q, 0)
    q.notify_room()
    loop.run()
    assert gone.credit == 0 and gone.held is None


def test_a_relay_transfer_waits_for_a_block_queue_without_room_left():
    _, broker, _, gate, q = setup(QueueLimits(max_depth=3, overflow=Overflow.BLOCK))
    msg = make_message("r")
    assert gate.relay_wait(msg, to_q()) is None
    p1, p2 = FakeProducer(gate, to_q()), FakeProducer(gate, to_q())
    p1.top_up()
    assert gate.relay_wait(msg, to_q()) is None, "room left beyond what p1 holds"
    p2.top_up()                           # together they hold the room as credit
    assert (p1.credit, p2.credit) == (2, 1)
    assert gate.relay_wait(msg, to_q()) is q, "room promised to producers is not room"
    p1.send(broker, 2)
    p2.send(broker, 1)
    assert q.depth == 3 and gate.relay_wait(msg, to_q()) is q
    assert gate.relay_wait(msg, Resolution(AddressKind.QUEUE, "elsewhere")) is None
