"""Queue limits hold for every way a message gets in (docs/operations.md, "Queue
limits and overflow"):

* `overflow = "block"`: producers are granted credit in proportion to the room the
  queue has left, shared between the producers that feed it, so the queue stops at
  its limit instead of a whole credit window (link_credit, 1,000) beyond it;
* an anonymous-relay producer whose message meets a full `block` queue waits: the
  message is held unsettled until the queue has room, and the producer gets no more
  credit meanwhile;
* transactions: staged sends count against the room when they arrive, and a commit
  that would take a `reject` queue over its limit fails with
  `amqp:resource-limit-exceeded`, nothing of the transaction applied.

Producers are shaped like Qpid JMS's (tests/e2e/jms_producers.py)."""

from __future__ import annotations

import pytest
from proton import Delivery, Message

from tests.client import connect, receive_all
from tests.e2e.flow_support import broker_without_errors, depth, held
from tests.e2e.helpers_conn import REMOTE_CLOSED, RawClient
from tests.e2e.helpers_delivery import uid
from tests.e2e.jms_producers import JmsProducer
from tests.e2e.jms_txn import TxnSession

pytestmark = pytest.mark.e2e

RESOURCE_LIMIT = "amqp:resource-limit-exceeded"
TXN_STATE = 0x34

CONFIG = """
[[queue_limits]]
pattern = "blk100.#"
max_depth = 100
overflow = "block"

[[queue_limits]]
pattern = "blk10.#"
max_depth = 10
overflow = "block"

[[queue_limits]]
pattern = "blk5.#"
max_depth = 5
overflow = "block"

[[queue_limits]]
pattern = "rej5.#"
max_depth = 5
overflow = "reject"
"""


@pytest.fixture
def broker(broker_factory):
    yield from broker_without_errors(broker_factory, CONFIG)


def jms_client(broker) -> RawClient:
    return RawClient("127.0.0.1", broker.port, container_id=f"ID:{uid()}:1").wait_open()


def relay_held(broker, client: RawClient, ssn, q: str, n: int) -> tuple[JmsProducer, list]:
    """A relay producer on `ssn` that sends `n` to `q` (max_depth 10): the first ten
    taken, the rest waiting for room, the producer held."""
    relay = JmsProducer(client, ssn, None)
    client.wait(lambda: relay.link.credit > 0, what="relay credit")
    sent = [relay.send_async(f"r{i}", to=q) for i in range(n)]
    client.wait(lambda: sum(1 for d in sent if d.remote_state) >= 10, 15, "the first ten outcomes")
    wait_held(broker, [client], [], 1)
    return relay, sent


def wait_held(broker, clients: list[RawClient], links: list, n: int) -> None:
    """Until `n` producers are held by the broker and none of `links` has credit left."""
    def done() -> bool:
        for client in clients:
            client.pump(0)
        return all(link.credit == 0 for link in links) and held(broker) >= n
    clients[0].wait(done, 15, f"{n} producers held with no credit")


# ---------------------------------------------------------------------- block: credit from room


def test_block_stops_a_jms_producer_at_max_depth_not_a_credit_window_later(broker):
    """A persistent synchronous producer (Qpid JMS's default send) to a `max_depth = 100`
    block queue: it is stopped at 100 (it used to be stopped after link_credit = 1,000
    sends), and goes on when the queue is drained, never taking it over 100."""
    q = uid("blk100.q")
    client = jms_client(broker)
    try:
        producer = JmsProducer(client, client.session(), q)
        sent = 0

        def send_while_credit(limit: int) -> int:
            n = 0
            while n < limit:
                client.wait(lambda: producer.link.credit > 0 or held(broker) >= 1, 15, "credit or hold")
                if producer.link.credit == 0:
                    return n
                assert producer.send_sync(f"m{sent + n}").remote_state == Delivery.ACCEPTED
                n += 1
            return n

        sent = send_while_credit(2000)
        assert sent == 100, f"the producer was stopped after {sent} sends into a max_depth 100 queue"
        assert depth(broker, q) == 100
        conn = connect(broker.url)
        try:
            rcv = conn.create_receiver(q, credit=30)
            for _ in range(30):
                rcv.receive(timeout=10)
                rcv.accept()
        finally:
            conn.close()
        more = send_while_credit(2000)
        assert more == 30, f"{more} sends after 30 left the queue"
        assert depth(broker, q) == 100
    finally:
        client.close()


def test_block_shares_the_room_between_several_producers(broker):
    """Four producers (four connections) sending asynchronously as fast as their credit
    lets them, into one `max_depth = 100` block queue: together they stop at 100; when
    it is drained each of them gets credit again."""
    q = uid("blk100.q")
    clients = [jms_client(broker) for _ in range(4)]
    try:
        producers = [JmsProducer(c, c.session(), q) for c in clients]
        deliveries: list[list[Delivery]] = [[] for _ in producers]
        for _ in range(3000):   # rounds: each producer sends one if it has credit
            progressed = False
            for i, (client, producer) in enumerate(zip(clients, producers)):
                client.pump(0)
                if producer.link.credit > 0:
                    deliveries[i].append(producer.send_async(f"p{i}-{len(deliveries[i])}"))
                    progressed = True
            if not progressed and held(broker) >= 4:
                break
        wait_held(broker, clients, [p.link for p in producers], 4)
        for client, dlvs in zip(clients, deliveries):
            client.wait(lambda: all(d.remote_state for d in dlvs), 15, "outcomes")
        total = sum(len(d) for d in deliveries)
        assert total <= 100, f"{total} messages taken into a max_depth 100 block queue"
        assert total == 100 == depth(broker, q), "and not held before it was full"
        assert all(d.remote_state == Delivery.ACCEPTED for dlvs in deliveries for d in dlvs)
        assert len(receive_all(broker.url, q, timeout=2.0)) == 100
        for client, producer in zip(clients, producers):
            client.wait(lambda: producer.link.credit > 0, 15, "credit again once drained")
    finally:
        for client in clients:
            client.close()


# ---------------------------------------------------------------------- anonymous relay


def test_a_relay_producer_is_held_by_a_full_block_queue(broker):
    """An anonymous-relay producer (null target, `to` in each message) streaming into a
    `max_depth = 10` block queue: 10 are taken; the next waits unsettled at the broker
    and the producer gets no more credit, so the queue stays at 10.  Drained, every
    message goes in, in order, and is accepted."""
    q = uid("blk10.q")
    client = jms_client(broker)
    try:
        relay = JmsProducer(client, client.session(), None)
        client.wait(lambda: relay.link.credit > 0, what="relay credit")
        sent = []
        while len(sent) < 3000 and relay.link.credit > 0:
            sent.append(relay.send_async(f"r{len(sent)}", to=q))
            if len(sent) % 50 == 0:
                client.pump(0)
        wait_held(broker, [client], [relay.link], 1)
        client.wait(lambda: sum(1 for d in sent if d.remote_state) >= 10, 15, "the first ten outcomes")
        client.pump_for(0.2)
        assert depth(broker, q) == 10, f"{depth(broker, q)} messages in a max_depth 10 block queue"
        outcomes = [d.remote_state for d in sent]
        assert outcomes[:10] == [Delivery.ACCEPTED] * 10 and not any(outcomes[10:]), \
            "the ones beyond the room wait, unsettled"
        conn = connect(broker.url)
        try:
            rcv = conn.create_receiver(q, credit=10)
            bodies = []
            for _ in range(len(sent)):
                bodies.append(rcv.receive(timeout=15).body)
                rcv.accept()
        finally:
            conn.close()
        assert bodies == [f"r{i}" for i in range(len(sent))]
        client.wait(lambda: all(d.remote_state for d in sent), 15, "every outcome")
        assert all(d.remote_state == Delivery.ACCEPTED for d in sent)
    finally:
        client.close()


# ---------------------------------------------------------------------- transactions


def test_a_transaction_cannot_stage_more_than_a_reject_queue_holds(broker):
    """50 transactional sends into a `max_depth = 5` reject queue: what is staged counts
    against the limit, so the sends beyond 5 are refused as they arrive and the commit
    leaves the queue at its limit (it used to commit all 50)."""
    q = uid("rej5.q")
    client = RawClient("127.0.0.1", broker.port, container_id=f"txn-{uid()}").wait_open()
    try:
        s = TxnSession(client)
        snd = s.sender(q)
        txn = s.declare()
        outcomes = [s.send(snd, i, txn) for i in range(50)]
        staged = [d for d in outcomes if d.remote_state == TXN_STATE]
        refused = [d for d in outcomes if d.remote_state == Delivery.REJECTED]
        assert len(staged) == 5 and len(refused) == 45
        assert all(d.remote.condition.name == RESOURCE_LIMIT for d in refused)
        assert s.discharge(txn).remote_state == Delivery.ACCEPTED
    finally:
        client.close()
    assert depth(broker, q) == 5


def test_a_commit_that_would_exceed_a_reject_limit_fails_and_applies_nothing(broker):
    """Three staged sends fit when staged; meanwhile plain sends fill the queue to 3 of
    5; the commit would make 6: the discharge is rejected with
    amqp:resource-limit-exceeded and nothing of the transaction is applied: no staged
    send is queued, and its acknowledgement is undone (the message comes back)."""
    q, src = uid("rej5.q"), uid("src")
    conn = connect(broker.url)
    try:
        conn.create_sender(src).send(Message(body="to-ack"))
    finally:
        conn.close()
    client = RawClient("127.0.0.1", broker.port, container_id=f"txn-{uid()}").wait_open()
    try:
        s = TxnSession(client)
        snd, rcv = s.sender(q), s.receiver(src)
        txn = s.declare()
        dlv, msg = s.receive(rcv)
        assert msg.body == "to-ack"
        s.ack(dlv, txn)
        assert [s.send(snd, f"t{i}", txn).remote_state for i in range(3)] == [TXN_STATE] * 3
        plain = connect(broker.url)
        try:
            psnd = plain.create_sender(q)
            assert [psnd.send(Message(body=f"p{i}"), error_states=[]).remote_state
                    for i in range(3)] == [Delivery.ACCEPTED] * 3
        finally:
            plain.close()
        outcome = s.discharge(txn)
        assert outcome.remote_state == Delivery.REJECTED
        assert outcome.remote.condition.name == RESOURCE_LIMIT, outcome.remote.condition
        rcv.close()
        client.pump(0)
    finally:
        client.close()
    assert sorted(m.body for m in receive_all(broker.url, q, timeout=2.0)) == ["p0", "p1", "p2"]
    back = receive_all(broker.url, src, timeout=2.0)
    assert [m.body for m in back] == ["to-ack"], "the acknowledgement was not applied"


def test_transactional_sends_count_against_a_block_queue(broker):
    """A transacted producer to a `max_depth = 5` block queue: its staged sends take the
    room as they arrive, so it is held after 5 (it used to stage a whole credit window
    and commit it); a rollback gives the room back."""
    q = uid("blk5.q")
    client = RawClient("127.0.0.1", broker.port, container_id=f"txn-{uid()}").wait_open()
    try:
        s = TxnSession(client)
        snd = s.sender(q)

        def stage_until_held(txn: bytes) -> int:
            n = 0
            while n < 50:
                client.wait(lambda: snd.credit > 0 or held(broker) >= 1, 15, "credit or hold")
                if snd.credit == 0:
                    return n
                assert s.send(snd, n, txn).remote_state == TXN_STATE
                n += 1
            return n

        txn = s.declare()
        assert stage_until_held(txn) == 5
        assert s.discharge(txn, fail=True).remote_state == Delivery.ACCEPTED   # rollback
        client.wait(lambda: snd.credit > 0, 15, "credit back after the rollback")
        txn = s.declare()
        assert stage_until_held(txn) == 5
        assert s.discharge(txn).remote_state == Delivery.ACCEPTED
    finally:
        client.close()
    assert depth(broker, q) == 5


def test_relay_transfers_waiting_for_room_are_released_when_their_link_goes(broker):
    """A relay producer detached while its transfers wait for room: they are answered
    `released` (not taken), never queued, and the session's other links are answered
    as before (nothing waits behind them any more)."""
    q = uid("blk10.q")
    client = jms_client(broker)
    try:
        ssn = client.session()
        relay, sent = relay_held(broker, client, ssn, q, 15)
        relay.link.close()
        client.wait(lambda: all(d.remote_state for d in sent), 15, "answers for the waiting five")
        assert [d.remote_state for d in sent[10:]] == [Delivery.RELEASED] * 5
        other = JmsProducer(client, ssn, uid("other"))
        assert other.send_sync("after").remote_state == Delivery.ACCEPTED
    finally:
        client.close()
    assert depth(broker, q) == 10 and held(broker) == 0


def test_ending_the_session_or_connection_of_waiting_relay_transfers_loses_nothing_queued(broker):
    """Relay transfers waiting for room when their session ends, and others when their
    connection closes: nothing of them is queued, nothing is answered on what ended,
    and the broker goes on (the same connection opens a new session and sends)."""
    q = uid("blk10.q")
    client = jms_client(broker)
    try:
        for _ in range(2):
            ssn = client.session()
            relay_held(broker, client, ssn, q, 12)
            ssn.close()
            client.wait(lambda: ssn.state & REMOTE_CLOSED, what="end")
            assert depth(broker, q) == 10
            assert held(broker) == 0
            conn = connect(broker.url)
            try:
                receive_all_n(conn, q, 10)   # room again for the next round
            finally:
                conn.close()
        other = JmsProducer(client, client.session(), uid("other"))
        assert other.send_sync("still served").remote_state == Delivery.ACCEPTED
        relay_held(broker, client, client.session(), q, 12)
    finally:
        client.close()
    assert depth(broker, q) == 10
    assert held(broker) == 0


def receive_all_n(conn, q: str, n: int) -> None:
    rcv = conn.create_receiver(q, credit=n)
    for _ in range(n):
        rcv.receive(timeout=10)
        rcv.accept()
    rcv.close()
