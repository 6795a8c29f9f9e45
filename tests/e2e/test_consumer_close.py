"""End-to-end: what happens to a consumer's deliveries when it closes, its session
ends, or its connection goes — with Qpid JMS's exact frame orders (tests/e2e/jms_wire.py)
and the rules of core/settlement.py: a normal ending returns them uncounted, a lost
connection counts them, late dispositions are honoured.
"""

from __future__ import annotations

import pytest
from proton import Delivery, Message

from tests.cluster_process import CLUSTER_KINDS, broker_or_cluster
from tests.e2e.helpers_conn import RawClient
from tests.e2e.helpers_delivery import (
    connection,
    dead_letters,
    fetch,
    nothing_arrives,
    receiver,
    send_bodies,
    settle,
    uid,
)
from tests.e2e.jms_wire import JmsSession, dynamic_target_sender, jms_client

pytestmark = pytest.mark.e2e

CONFIG = """
[policy]
dead_letter_address = "DLQ"
max_delivery_attempts = 5

[limits]
max_links_per_connection = 16
"""


@pytest.fixture(scope="module", params=CLUSTER_KINDS)
def jms_broker(request, tmp_path_factory):
    """One broker, and a cluster whose client node owns nothing (every link forwarded)."""
    yield from broker_or_cluster(request.param, tmp_path_factory, CONFIG, "consumer-close")


def bodies_and_counts(broker, queue: str) -> list[tuple]:
    """Consume everything left on a queue: (body, delivery-count) in order."""
    out = []
    with connection(broker) as conn:
        rcv = receiver(conn, queue, credit=100)
        while not nothing_arrives(conn, rcv):
            msg, dlv = fetch(conn, rcv)
            settle(dlv, Delivery.ACCEPTED)
            out.append((msg.body, msg.delivery_count))
    return out


# --------------------------------------------------------------------------- consumer close


def test_receive_one_and_close_twelve_times_delivers_every_message_first_time(jms_broker):
    """Spring's JmsTemplate.receive(): per call a session and a consumer with a prefetch
    of 1000, one message taken, consumer and session closed."""
    q = uid("receive-one")
    with connection(jms_broker) as conn:
        send_bodies(conn, q, [f"m{i}" for i in range(12)])
    client = jms_client(jms_broker)
    got = []
    for _ in range(12):
        session = JmsSession(client)
        consumer = session.consumer(q)
        msg = consumer.receive()
        consumer.acknowledge()
        consumer.close()               # accepted → detach(closed) → detach → released(rest)
        session.ssn.close()
        client.wait(lambda: session.ssn.state & session.ssn.REMOTE_CLOSED, what="end")
        got.append((msg.body, msg.delivery_count))
    client.close()
    assert got == [(f"m{i}", 0) for i in range(12)]
    assert bodies_and_counts(jms_broker, q) == []
    assert dead_letters(jms_broker) == []


def test_prefetched_messages_released_after_the_detach_keep_delivery_count_zero(jms_broker):
    q = uid("prefetch")
    with connection(jms_broker) as conn:
        send_bodies(conn, q, [f"m{i}" for i in range(20)])
    client = jms_client(jms_broker)
    session = JmsSession(client)
    consumer = session.consumer(q)
    consumer.wait_prefetched(20)
    assert consumer.receive().body == "m0"
    consumer.acknowledge()
    consumer.close()
    client.close()
    assert bodies_and_counts(jms_broker, q) == [(f"m{i}", 0) for i in range(1, 20)]


def test_consumer_closed_without_late_dispositions_returns_its_prefetch_uncounted(jms_broker):
    """A client that never settles after its detach (python-qpid-proton, rhea)."""
    q = uid("no-late")
    with connection(jms_broker) as conn:
        send_bodies(conn, q, ["a", "b", "c"])
        rcv = receiver(conn, q, credit=10)
        first, _ = fetch(conn, rcv)
        fetch(conn, rcv)
        rcv.close()
        assert first.body == "a"
        again = receiver(conn, q, credit=10)
        back = [fetch(conn, again) for _ in range(3)]
        assert [(m.body, m.delivery_count) for m, _ in back] == [("a", 0), ("b", 0), ("c", 0)]


def test_late_outcomes_after_the_detach_are_honoured(jms_broker):
    q = uid("late")
    with connection(jms_broker) as conn:
        send_bodies(conn, q, ["accepted", "failed", "rejected", "released"])
    client = jms_client(jms_broker)
    consumer = JmsSession(client).consumer(q)
    consumer.wait_prefetched(4)
    outcomes = [Delivery.ACCEPTED, Delivery.MODIFIED, Delivery.REJECTED, Delivery.RELEASED]
    consumer.link.close()
    client.wait(lambda: consumer.link.state & consumer.link.REMOTE_CLOSED, what="detach")
    for (msg, dlv), outcome in zip(consumer.prefetched, outcomes):
        dlv.local.failed = True
        dlv.update(outcome)
        dlv.settle()
    consumer.prefetched.clear()
    client.close()                     # its frames go out before the close
    assert bodies_and_counts(jms_broker, q) == [("failed", 1), ("released", 0)]
    assert dead_letters(jms_broker) == [("rejected", 0)]


# --------------------------------------------------------------------------- session end


def test_client_ack_session_closed_unacknowledged_counts_once_and_sends_nothing_more(jms_broker):
    """CLIENT_ACKNOWLEDGE, session closed 4 times without acknowledging: modified
    (delivery-failed) → end each time.  One failed attempt each; the fifth delivery
    happens (max_delivery_attempts = 5), and nothing is re-sent on an ending session."""
    q = uid("client-ack")
    with connection(jms_broker) as conn:
        send_bodies(conn, q, ["m"])
    client = jms_client(jms_broker)
    counts = []
    for _ in range(4):
        session = JmsSession(client)
        msg = session.consumer(q).receive()
        counts.append(msg.delivery_count)
        session.close_unacknowledged()
        assert session.bodies_arrived() == [], "re-sent on the session being ended"
    consumer = JmsSession(client).consumer(q)
    fifth = consumer.receive()
    consumer.acknowledge()
    client.pump(0)
    client.close()
    assert counts == [0, 1, 2, 3]
    assert (fifth.body, fifth.delivery_count) == ("m", 4)
    assert dead_letters(jms_broker) == []


def test_session_end_returns_prefetched_messages_uncounted(jms_broker):
    q = uid("session-end")
    with connection(jms_broker) as conn:
        send_bodies(conn, q, ["a", "b", "c"])
    client = jms_client(jms_broker)
    session = JmsSession(client)
    session.consumer(q).wait_prefetched(3)
    session.ssn.close()
    client.wait(lambda: session.ssn.state & session.ssn.REMOTE_CLOSED, what="end")
    client.close()
    assert bodies_and_counts(jms_broker, q) == [("a", 0), ("b", 0), ("c", 0)]


def test_sessions_ended_with_their_consumers_open_give_their_links_back(jms_broker):
    """Session.close() without closing the consumers first: the end detaches them
    (AMQP 1.0 §2.5.5), so they no longer count against max_links_per_connection."""
    q = uid("end-links")
    with connection(jms_broker) as conn:
        send_bodies(conn, q, [f"m{i}" for i in range(40)])
    client = jms_client(jms_broker)
    got = []
    for _ in range(40):                  # well over the limit of 16 links
        session = JmsSession(client)
        consumer = session.consumer(q, prefetch=1)
        got.append(consumer.receive().body)
        consumer.acknowledge()
        session.ssn.close()
        client.wait(lambda: session.ssn.state & session.ssn.REMOTE_CLOSED, what="end")
    client.close()
    assert got == [f"m{i}" for i in range(40)]


# --------------------------------------------------------------------------- connection end


def test_connection_closed_normally_returns_unsettled_uncounted(jms_broker):
    q = uid("conn-close")
    with connection(jms_broker) as conn:
        send_bodies(conn, q, ["a", "b"])
    client = jms_client(jms_broker)
    JmsSession(client).consumer(q).wait_prefetched(2)
    client.close()
    assert bodies_and_counts(jms_broker, q) == [("a", 0), ("b", 0)]


def test_connection_lost_counts_what_it_had_received_as_a_failed_attempt(jms_broker):
    """No close frame (the client's process was killed, or its socket failed): the
    application may have processed them, so they come back redelivered."""
    q = uid("conn-lost")
    with connection(jms_broker) as conn:
        send_bodies(conn, q, ["a", "b", "c"])
    client = jms_client(jms_broker)
    consumer = JmsSession(client).consumer(q, prefetch=2)
    consumer.wait_prefetched(2)
    client.abandon()                   # the socket just goes
    jms_broker.wait_for_log(r"connection closed: .*\(socket closed\)|connection closed: .*transport error")
    assert bodies_and_counts(jms_broker, q) == [("a", 1), ("b", 1), ("c", 0)]


# --------------------------------------------------------------------------- temporary destinations


@pytest.mark.parametrize("capability", ["temporary-queue", "temporary-topic"])
def test_only_the_creating_connection_consumes_a_temporary_destination(jms_broker, capability):
    owner = jms_client(jms_broker)
    address = dynamic_target_sender(owner, owner.session(), capability).remote_target.address
    mine = JmsSession(owner).consumer(address)
    assert mine.link.remote_source.address == address
    other = RawClient("127.0.0.1", jms_broker.port, container_id=uid("other")).wait_open()
    ssn = other.session()
    thief = other.receiver(ssn, address, "thief")
    assert thief.state & thief.REMOTE_CLOSED
    assert thief.remote_source.address is None                      # the refusal shape
    assert thief.remote_condition.name == "amqp:unauthorized-access"
    assert "only by the connection that created it" in thief.remote_condition.description
    jms_broker.wait_for_log(r"attach of link 'thief' refused: amqp:unauthorized-access")
    # Sending to it stays open to everyone: request/reply.
    snd = other.sender(ssn, address, "replier")
    assert snd.state & snd.REMOTE_ACTIVE and not snd.state & snd.REMOTE_CLOSED
    dlv = snd.delivery(b"1")
    snd.send(Message(body="reply").encode())
    snd.advance()
    other.wait(lambda: dlv.remote_state == Delivery.ACCEPTED, what="accepted")
    assert mine.receive().body == "reply"
    other.close()
    owner.close()
