"""FlowGate (server/flow.py): who holds a producer's credit and who wakes it, with
fake producers and the real core model (no sockets)."""

from __future__ import annotations

from amqpbroker.core.addresses import AddressKind, Resolution
from amqpbroker.core.alarms import Alarms
from amqpbroker.core.broker import Broker
from amqpbroker.core.limits import Overflow, QueueLimits
from amqpbroker.core.queues import Outcome
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
    def __init__(self, gate, target, handler=None):
        self.gate = gate
        self.target = target
        self.held = None
        self.released = False
        self.impl = object()
        self.handler = handler or Handler()
        self.handler.endpoints[self.impl] = self
        self.topped = 0

    def top_up(self):
        if self.gate.may_grant(self):
            self.topped += 1


def setup(limits=None):
    loop, broker = Loop(), Broker()
    alarms = Alarms(disk_enabled=False)
    gate = FlowGate(loop, broker, alarms)
    q = broker.declare_queue("q", limits=limits)
    return loop, broker, alarms, gate, q


def test_nothing_holds_a_producer_by_default():
    _, _, _, gate, _ = setup()
    p = FakeProducer(gate, Resolution(AddressKind.QUEUE, "q"))
    assert gate.may_grant(p) and p.held is None


def test_alarm_holds_every_producer_and_its_clearing_tops_them_up():
    loop, _, alarms, gate, _ = setup()
    p = FakeProducer(gate, Resolution(AddressKind.QUEUE, "q"))
    relay = FakeProducer(gate, None)
    alarms.configure(memory_high_watermark_absolute=1)
    alarms.feed(rss=10 << 20, physical_memory=1 << 30)
    assert alarms.blocking
    assert not gate.may_grant(p) and not gate.may_grant(relay) and p.held is ALARM and gate.held == 2
    alarms.configure(memory_high_watermark_absolute=1 << 40)
    assert not alarms.blocking and loop.soon, "woken at the next loop turn, not inside the callback"
    loop.run()
    assert p.topped == 1 and relay.topped == 1 and gate.held == 0


def test_full_block_queue_holds_until_a_message_leaves():
    loop, broker, _, gate, q = setup(QueueLimits(max_depth=2, overflow=Overflow.BLOCK))
    p = FakeProducer(gate, Resolution(AddressKind.QUEUE, "q"))
    for i in range(2):
        broker.publish(make_message(i), p.target)
    assert not gate.may_grant(p) and p.held is q
    c = RecordingConsumer(credit=1)
    q.add_consumer(c)
    assert not loop.soon, "delivered but not settled: still held"
    q.settle(c.delivered[0], Outcome.ACCEPTED)
    loop.run()
    assert p.topped == 1 and p.held is None


def test_exchange_producer_held_by_any_full_block_queue_bound():
    loop, broker, _, gate, q = setup(QueueLimits(max_depth=1, overflow=Overflow.BLOCK))
    broker.declare_exchange("ex", "topic")
    broker.bind("ex", "a.*", q)
    other = broker.declare_queue("other")
    broker.bind("ex", "#", other)
    p = FakeProducer(gate, Resolution(AddressKind.EXCHANGE, "ex"))
    keyed_elsewhere = FakeProducer(gate, Resolution(AddressKind.EXCHANGE, "ex", "b.c"))
    broker.publish(make_message("m", subject="a.b"), p.target)
    assert not gate.may_grant(p), "a full bound queue holds a producer without a fixed key"
    assert gate.may_grant(keyed_elsewhere), "its key does not route to the full queue"
    q.purge()
    loop.run()
    assert p.topped == 1


def test_an_ended_producer_is_forgotten_and_never_woken():
    loop, broker, _, gate, q = setup(QueueLimits(max_depth=1, overflow=Overflow.BLOCK))
    p = FakeProducer(gate, Resolution(AddressKind.QUEUE, "q"))
    gone = FakeProducer(gate, Resolution(AddressKind.QUEUE, "q"))
    broker.publish(make_message("m"), p.target)
    assert not gate.may_grant(p) and not gate.may_grant(gone)
    gate.forget(gone)
    del p.handler.endpoints[p.impl]     # its link ended (and may be freed) without forget
    q.purge()
    loop.run()
    assert p.topped == 0 and gone.topped == 0 and gate.held == 0
