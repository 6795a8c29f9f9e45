"""Durability end to end: restarts (clean and SIGKILL) keep every durable entity and
every accepted durable message."""

from __future__ import annotations

import uuid

import pytest
from proton import Message, Timeout
from proton.utils import LinkDetached

from tests.client import connect, terminus_capabilities, terminus_filters
from tests.e2e.jms_links import detach, null_source_attach, shared_consumer, durable_consumer
from tests.e2e.jms_wire import JmsSession, jms_client

pytestmark = pytest.mark.e2e

CONFIG = """
[[exchanges]]
name = "orders"
type = "topic"

[[queues]]
name = "configured"
"""


def uniq(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def send(url, address, bodies, durable=True, **fields):
    conn = connect(url)
    try:
        sender = conn.create_sender(address)
        for body in bodies:
            sender.send(Message(body=body, durable=durable, **fields))
    finally:
        conn.close()


def receive_all(url, address, n, accept=True, timeout=10):
    conn = connect(url)
    try:
        receiver = conn.create_receiver(address, credit=max(n, 1))
        out = []
        for _ in range(n):
            msg = receiver.receive(timeout=timeout)
            out.append(msg)
            if accept:
                receiver.accept()
        return out
    finally:
        conn.close()


@pytest.fixture
def durable_broker(broker_factory):
    return broker_factory()


@pytest.mark.parametrize("crash", [False, True], ids=["clean-restart", "sigkill"])
def test_queue_backlog_survives_restart(durable_broker, crash):
    q = uniq("q")
    send(durable_broker.url, q, range(10))
    send(durable_broker.url, q, ["transient"], durable=False)
    durable_broker.kill() if crash else durable_broker.stop()
    durable_broker.start()
    got = receive_all(durable_broker.url, q, 10)
    assert [m.body for m in got] == list(range(10))
    assert all(m.delivery_count == 0 and m.durable for m in got)
    conn = connect(durable_broker.url)
    receiver = conn.create_receiver(q)
    with pytest.raises(Timeout):   # the non-durable message did not survive (and must not)
        receiver.receive(timeout=0.5)
    conn.close()


def test_delivered_unsettled_comes_back_with_delivery_count(durable_broker):
    q = uniq("q")
    send(durable_broker.url, q, ["a", "b"])
    conn = connect(durable_broker.url)
    receiver = conn.create_receiver(q, credit=2)
    first = receiver.receive(timeout=5)
    receiver.accept()
    receiver.receive(timeout=5)   # "b" delivered, left unsettled
    assert first.body == "a"
    # Sync point: the ack went out before this durable send on the same connection,
    # so once the send is Accepted (after its commit) the ack is on disk too.
    conn.create_sender(uniq("sync")).send(Message(body="sync", durable=True))
    durable_broker.kill()
    durable_broker.start()
    got = receive_all(durable_broker.url, q, 1)
    assert [(m.body, m.delivery_count) for m in got] == [("b", 1)]


def test_sequence_numbers_and_acks_survive(durable_broker):
    q = uniq("q")
    send(durable_broker.url, q, range(6))
    receive_all(durable_broker.url, q, 3)
    durable_broker.stop()
    durable_broker.start()
    assert [m.body for m in receive_all(durable_broker.url, q, 3)] == [3, 4, 5]


def test_configured_and_auto_created_entities_survive(broker_factory):
    b = broker_factory(CONFIG)
    key = uniq("k")
    # A binding made at run time by a durable subscription on a configured exchange.
    conn = connect(b.url, container_id="c1")
    sub = uniq("sub")
    consumer = durable_consumer(conn, f"orders/{key}", sub, selector="n > 1")
    detach(conn, consumer)
    conn.close()
    send(b.url, f"orders/{key}", [1], properties={"n": 1})
    send(b.url, f"orders/{key}", [2], properties={"n": 2})
    b.kill()
    b.start()
    conn = connect(b.url, container_id="c1")
    lookup = null_source_attach(conn, sub)
    src = lookup.link.remote_source
    assert src.address == f"orders/{key}"
    assert "jms-selector" in {str(k) for k in terminus_filters(src)}
    msg = lookup.receive(timeout=5) if lookup.link.credit else None
    conn.close()
    got = receive_sub_again(b, sub, key)
    assert got == [2], "the selector binding and the backlog survived"
    assert msg is None


def receive_sub_again(b, sub, key):
    conn = connect(b.url, container_id="c1")
    consumer = durable_consumer(conn, f"orders/{key}", sub, selector="n > 1")
    out = []
    while True:
        try:
            out.append(consumer.receive(timeout=1).body)
            consumer.accept()
        except Timeout:
            break
    conn.close()
    return out


def test_shared_global_subscription_and_null_source_lookup_survive_sigkill(durable_broker):
    topic, sub = uniq("t"), uniq("g")
    conn = connect(durable_broker.url)
    consumer = shared_consumer(conn, f"amq.topic/{topic}", sub, global_=True, credit=0)
    detach(conn, consumer)
    conn.close()
    send(durable_broker.url, f"amq.topic/{topic}", ["kept"])
    durable_broker.kill()
    durable_broker.start()
    conn = connect(durable_broker.url)
    lookup = null_source_attach(conn, f"{sub}|global")
    assert {"shared", "global", "topic"} <= terminus_capabilities(lookup.link.remote_source)
    detach(conn, lookup)   # closed=false: a lookup, not an unsubscribe
    conn.close()
    conn = connect(durable_broker.url)
    again = shared_consumer(conn, f"amq.topic/{topic}", sub, global_=True)
    assert again.receive(timeout=5).body == "kept"
    again.accept()
    conn.close()


def test_unsubscribed_subscription_stays_gone_after_restart(durable_broker):
    topic, sub = uniq("t"), uniq("d")
    conn = connect(durable_broker.url, container_id="cid-1")
    detach(conn, durable_consumer(conn, f"amq.topic/{topic}", sub))
    lookup = null_source_attach(conn, sub)
    lookup.close()
    conn.close()
    durable_broker.kill()
    durable_broker.start()
    conn = connect(durable_broker.url, container_id="cid-1")
    with pytest.raises(LinkDetached) as refused:
        null_source_attach(conn, sub)
    assert "amqp:not-found" in str(refused.value)
    conn.close()


def test_fan_out_to_durable_subscriptions_survives(durable_broker):
    topic = uniq("t")
    subs = [uniq("s") for _ in range(3)]
    conn = connect(durable_broker.url, container_id="fan")
    for s in subs:
        detach(conn, durable_consumer(conn, f"amq.topic/{topic}", s))
    conn.close()
    send(durable_broker.url, f"amq.topic/{topic}", ["x", "y"])
    durable_broker.kill()
    durable_broker.start()
    conn = connect(durable_broker.url, container_id="fan")
    for s in subs:
        c = durable_consumer(conn, f"amq.topic/{topic}", s)
        assert [c.receive(timeout=5).body for _ in range(2)] == ["x", "y"]
        c.accept()
    conn.close()


def test_paged_backlog_reads_bodies_back_in_order(broker_factory):
    b = broker_factory("[store]\nqueue_memory_budget = 4096\n")
    q = uniq("q")
    send(b.url, q, [f"m{i}-" + "x" * 200 for i in range(100)])
    b.stop()
    b.start()
    got = receive_all(b.url, q, 100)
    assert [m.body.split("-")[0] for m in got] == [f"m{i}" for i in range(100)]
    b.wait_for_log(r"store recovered 2 queue\(s\), 100 message entries")   # and the DLQ


def send_unsettled(url, address, bodies, window=500, timeout=60.0) -> int:
    """Durable sends with up to `window` unsettled (a commit covers many): how many
    were Accepted."""
    from proton.handlers import MessagingHandler
    from proton.reactor import Container

    class Sender(MessagingHandler):
        def __init__(self):
            super().__init__()
            self.next = self.accepted = self.settled = 0

        def on_start(self, event):
            event.container.create_sender(event.container.connect(url, reconnect=False), address)
            self.timer = event.container.schedule(timeout, self)

        def on_timer_task(self, event):
            event.container.stop()

        def on_sendable(self, event):
            self._pump(event.link)

        def _pump(self, link):
            while link.credit > 0 and self.next - self.settled < window and self.next < len(bodies):
                link.send(Message(body=bodies[self.next], durable=True))
                self.next += 1

        def _settled(self, event, accepted):
            self.settled += 1
            self.accepted += accepted
            if self.settled == len(bodies):
                self.timer.cancel()
                event.connection.close()
            else:
                self._pump(event.link)

        def on_accepted(self, event):
            self._settled(event, 1)

        def on_rejected(self, event):
            self._settled(event, 0)

        def on_released(self, event):
            self._settled(event, 0)

    handler = Sender()
    Container(handler).run()
    return handler.accepted


def test_paged_backlog_of_thousands_survives_restart_in_order_exactly_once(broker_factory):
    """A 4 KiB budget and 3,000 messages: nearly all of the backlog lives only in the
    store (the paged region); part of it is consumed before a restart, the rest after."""
    b = broker_factory("[store]\nqueue_memory_budget = 4096\n")
    q = uniq("q")
    n, before = 3000, 700
    assert send_unsettled(b.url, q, [f"m{i}-" + "x" * 200 for i in range(n)]) == n
    first = receive_all(b.url, q, before)
    b.stop()
    b.start()
    b.wait_for_log(rf"store recovered 2 queue\(s\), {n - before} message entries \(0 redelivered\)")   # and the DLQ
    rest = receive_all(b.url, q, n - before, timeout=30)
    assert [m.body.split("-")[0] for m in first + rest] == [f"m{i}" for i in range(n)]
    conn = connect(b.url)
    try:
        with pytest.raises(Timeout):
            conn.create_receiver(q, credit=10).receive(timeout=1)
    finally:
        conn.close()
    b.stop()
    b.start()
    b.wait_for_log(r"store recovered 2 queue\(s\), 0 message entries")   # and the DLQ


def test_sigkill_with_a_paged_backlog_loses_nothing(broker_factory):
    """Killed while the paged region grows (entries pending their commit included):
    every Accepted message comes back once, in order, none marked redelivered."""
    from tests.e2e.crash_support import assess, drain, produce_until_crash

    b = broker_factory("[store]\nqueue_memory_budget = 4096\n")
    q = uniq("crash")
    traffic = produce_until_crash(b, q, "p", 2500, body=b"x" * 200, kill_delay=0.01)
    assert traffic.killed and not traffic.errors, traffic.errors
    b.start()
    a = assess(traffic, drain(b.url, q))
    assert a.ok, a.problems()
    assert a.recovered >= a.accepted >= 2500 and a.redelivered == 0


def _sync(url: str) -> None:
    """A durable send answered Accepted: every store write queued before it (on any
    connection) is committed, since batches commit in order."""
    send(url, uniq("sync"), ["sync"])


def test_messages_given_back_at_a_normal_close_stay_uncounted_across_sigkill(durable_broker):
    q = uniq("q")
    send(durable_broker.url, q, ["a", "b", "c"])
    client = jms_client(durable_broker)
    consumer = JmsSession(client).consumer(q)
    consumer.wait_prefetched(3)     # each one marked delivered in the store
    consumer.close()                # detach → released: not a failed attempt
    client.close()
    _sync(durable_broker.url)
    durable_broker.kill()
    durable_broker.start()
    got = receive_all(durable_broker.url, q, 3)
    assert [(m.body, m.delivery_count) for m in got] == [("a", 0), ("b", 0), ("c", 0)]


def test_messages_of_a_lost_connection_come_back_counted_once_across_sigkill(durable_broker):
    q = uniq("q")
    send(durable_broker.url, q, ["a", "b", "c"])
    client = jms_client(durable_broker)
    JmsSession(client).consumer(q, prefetch=2).wait_prefetched(2)
    client.abandon()                # no close: counted as a failed attempt
    durable_broker.wait_for_log(r"connection closed: .*\(socket closed\)|connection closed: .*transport error")
    _sync(durable_broker.url)
    durable_broker.kill()
    durable_broker.start()
    got = receive_all(durable_broker.url, q, 3)
    assert [(m.body, m.delivery_count) for m in got] == [("a", 1), ("b", 1), ("c", 0)]


def test_a_queue_the_anonymous_relay_creates_is_durable(durable_broker):
    """A persistent message sent through the anonymous relay to an address nothing
    declared yet: the queue it creates keeps it across a SIGKILL."""
    q = uniq("relay-new")
    conn = connect(durable_broker.url)
    try:
        conn.create_sender(None).send(Message(address=q, body="kept", durable=True))
    finally:
        conn.close()
    durable_broker.kill()
    durable_broker.start()
    assert [m.body for m in receive_all(durable_broker.url, q, 1)] == ["kept"]
