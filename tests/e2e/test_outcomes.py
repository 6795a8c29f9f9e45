"""End-to-end: delivery outcomes (AMQP 1.0 §3.4), redelivery, dead-lettering.

A real broker process; python-qpid-proton clients.  Outcomes are set on the raw
proton deliveries (`helpers_delivery.settle`) so that modified's delivery-failed /
undeliverable-here flags are under the test's control.
"""

from __future__ import annotations

import re

import pytest
from proton import Delivery, Message, symbol

from tests.broker_process import BrokerProcess
from tests.e2e.helpers_delivery import (
    barrier,
    connection,
    dead_letters,
    drain_bodies,
    fetch,
    fetch_body,
    nothing_arrives,
    receiver,
    send,
    send_bodies,
    sender,
    settle,
    uid,
    wait_settled,
)

pytestmark = pytest.mark.e2e

DLQ_CONFIG = """
[policy]
dead_letter_address = "DLQ"
max_delivery_attempts = 3
"""


@pytest.fixture(scope="module")
def dlq_broker(tmp_path_factory):
    proc = BrokerProcess(tmp_path_factory.mktemp("dlq") / "data", config=DLQ_CONFIG).start()
    yield proc
    proc.stop()


# --------------------------------------------------------------------------- accepted / released / modified


def test_accepted_removes_the_message(broker):
    q = uid("accept")
    with connection(broker) as conn:
        send_bodies(conn, q, ["taken", "left"])
        rcv = receiver(conn, q, credit=None)
        rcv.link.flow(2)
        m1, d1 = fetch(conn, rcv)
        m2, d2 = fetch(conn, rcv)
        settle(d1, Delivery.ACCEPTED)       # d2 stays unsettled
        barrier(conn)
        rcv.close()                         # the unsettled one goes back
        again = receiver(conn, q, credit=10)
        assert drain_bodies(conn, again) == ["left"]


def test_released_is_redelivered_with_unchanged_delivery_count(broker):
    q = uid("release")
    with connection(broker) as conn:
        send_bodies(conn, q, ["m"])
        rcv = receiver(conn, q, credit=10)
        for _ in range(3):
            msg, dlv = fetch(conn, rcv)
            assert msg.body == "m"
            assert msg.delivery_count == 0
            settle(dlv, Delivery.RELEASED)
        msg, dlv = fetch(conn, rcv)
        assert msg.delivery_count == 0
        settle(dlv, Delivery.ACCEPTED)
        assert nothing_arrives(conn, rcv)


def test_modified_delivery_failed_increments_delivery_count(broker):
    q = uid("modified")
    with connection(broker) as conn:
        send_bodies(conn, q, ["m"])
        rcv = receiver(conn, q, credit=10)
        for expected in (0, 1, 2):
            msg, dlv = fetch(conn, rcv)
            assert (msg.body, msg.delivery_count) == ("m", expected)
            settle(dlv, Delivery.MODIFIED, failed=True)
        msg, dlv = fetch(conn, rcv)
        assert msg.delivery_count == 3
        # modified without delivery-failed: back again, count unchanged.
        settle(dlv, Delivery.MODIFIED, failed=False)
        msg, dlv = fetch(conn, rcv)
        assert msg.delivery_count == 3
        settle(dlv, Delivery.ACCEPTED)


def test_modified_undeliverable_here_goes_to_another_consumer(broker):
    q = uid("undeliverable")
    with connection(broker) as conn:
        first = receiver(conn, q, credit=10)
        other = receiver(conn, q, credit=None)   # no credit yet: `first` gets the message
        send_bodies(conn, q, ["m"])
        msg, dlv = fetch(conn, first)
        assert msg.body == "m"
        settle(dlv, Delivery.MODIFIED, undeliverable=True)
        # `first` still has credit but must never see it again.
        assert nothing_arrives(conn, first)
        other.link.flow(1)
        msg, dlv = fetch(conn, other)
        assert msg.body == "m"
        settle(dlv, Delivery.ACCEPTED)
        # Other messages still reach `first`.
        send_bodies(conn, q, ["n"])
        assert fetch_body(conn, first) == "n"


def test_modified_undeliverable_here_waits_for_another_consumer(broker):
    q = uid("undeliverable-wait")
    with connection(broker) as conn:
        first = receiver(conn, q, credit=10)
        send_bodies(conn, q, ["m"])
        msg, dlv = fetch(conn, first)
        settle(dlv, Delivery.MODIFIED, undeliverable=True)
        assert nothing_arrives(conn, first)
    with connection(broker) as conn:   # a consumer on a new connection gets it
        assert drain_bodies(conn, receiver(conn, q, credit=10)) == ["m"]


# --------------------------------------------------------------------------- rejected


def test_rejected_without_dead_letter_address_is_dropped(broker_factory):
    broker = broker_factory('[policy]\ndead_letter_address = ""\n')   # dead-lettering turned off
    q = uid("reject-drop")
    with connection(broker) as conn:
        send_bodies(conn, q, ["bad", "good"])
        rcv = receiver(conn, q, credit=None)
        rcv.link.flow(1)
        msg, dlv = fetch(conn, rcv)
        assert msg.body == "bad"
        settle(dlv, Delivery.REJECTED)
        barrier(conn)   # the disposition is sent only while this connection is pumped
        broker.wait_for_log(rf"queue {re.escape(q)}: dropped message seq=\d+ \(rejected; no dead-letter address\)")
        rcv.link.flow(5)
        assert drain_bodies(conn, rcv) == ["good"]


def test_rejected_goes_to_dead_letter_address(dlq_broker):
    q = uid("reject-dlq")
    with connection(dlq_broker) as conn:
        send_bodies(conn, q, ["bad", "good"])
        rcv = receiver(conn, q, credit=None)
        rcv.link.flow(1)
        msg, dlv = fetch(conn, rcv)
        settle(dlv, Delivery.REJECTED)
        rcv.link.flow(5)
        assert drain_bodies(conn, rcv) == ["good"]
    dlq_broker.wait_for_log(rf"queue {re.escape(q)}: message seq=\d+ dead-lettered to DLQ \(rejected\)")
    assert dead_letters(dlq_broker) == [("bad", 0)]


def test_max_delivery_attempts_sends_to_dead_letter_address(dlq_broker):
    q = uid("attempts")
    with connection(dlq_broker) as conn:
        send_bodies(conn, q, ["poison", "fine"])
        # Attempt 1: modified delivery-failed.
        rcv = receiver(conn, q, credit=None)
        rcv.link.flow(1)
        msg, dlv = fetch(conn, rcv)
        assert (msg.body, msg.delivery_count) == ("poison", 0)
        settle(dlv, Delivery.MODIFIED, failed=True)
        # proton sends a flow ahead of a disposition in the same batch; let the
        # broker take the outcome first so the new credit goes to "poison" again.
        barrier(conn)
        # The link ends with the delivery unsettled: not a failed attempt.
        rcv.link.flow(1)
        msg, dlv = fetch(conn, rcv)
        assert (msg.body, msg.delivery_count) == ("poison", 1)
        rcv.close()
        # Attempts 2 and 3: modified delivery-failed → delivery-count 3 → dead letter.
        rcv = receiver(conn, q, credit=None)
        for count in (1, 2):
            rcv.link.flow(1)
            msg, dlv = fetch(conn, rcv)
            assert (msg.body, msg.delivery_count) == ("poison", count)
            settle(dlv, Delivery.MODIFIED, failed=True)
            barrier(conn)
        rcv.link.flow(5)
        assert drain_bodies(conn, rcv) == ["fine"]
    assert dead_letters(dlq_broker) == [("poison", 3)]


def test_released_does_not_count_as_a_failed_attempt(dlq_broker):
    q = uid("release-no-count")
    with connection(dlq_broker) as conn:
        send_bodies(conn, q, ["m"])
        rcv = receiver(conn, q, credit=10)
        for _ in range(5):   # more than max_delivery_attempts
            msg, dlv = fetch(conn, rcv)
            settle(dlv, Delivery.RELEASED)
        msg, dlv = fetch(conn, rcv)
        assert (msg.body, msg.delivery_count) == ("m", 0)
        settle(dlv, Delivery.ACCEPTED)
        barrier(conn)
    assert dead_letters(dlq_broker) == []


# --------------------------------------------------------------------------- link / connection end


def _take_unsettled(conn, q, n):
    rcv = receiver(conn, q, credit=None)
    rcv.link.flow(n)
    got = [fetch(conn, rcv) for _ in range(n)]
    return rcv, got


def test_unsettled_return_in_order_uncounted_when_link_ends(broker):
    q = uid("link-end")
    bodies = [str(i) for i in range(6)]
    with connection(broker) as conn:
        send_bodies(conn, q, bodies)
        rcv, got = _take_unsettled(conn, q, 6)
        assert [m.body for m, _ in got] == bodies
        settle(got[1][1], Delivery.ACCEPTED)
        settle(got[4][1], Delivery.ACCEPTED)
        rcv.close()
        again = receiver(conn, q, credit=None)
        again.link.flow(10)
        back = [fetch(conn, again) for _ in range(4)]
        assert [(m.body, m.delivery_count) for m, _ in back] == [("0", 0), ("2", 0), ("3", 0), ("5", 0)]
        assert nothing_arrives(conn, again)


def test_unsettled_return_in_order_when_connection_ends(broker):
    q = uid("conn-end")
    with connection(broker) as conn:
        send_bodies(conn, q, ["a", "b", "c", "d"])
        _, got = _take_unsettled(conn, q, 3)          # "d" is never delivered
        settle(got[1][1], Delivery.ACCEPTED)          # "b" is consumed
        barrier(conn)
    with connection(broker) as conn:
        rcv = receiver(conn, q, credit=10)
        back = [fetch(conn, rcv) for _ in range(3)]
        assert [(m.body, m.delivery_count) for m, _ in back] == [("a", 0), ("c", 0), ("d", 0)]


def test_unsettled_returned_messages_go_before_newer_ones(broker):
    q = uid("order")
    with connection(broker) as conn:
        send_bodies(conn, q, ["old-1", "old-2"])
        rcv, got = _take_unsettled(conn, q, 2)
        send_bodies(conn, q, ["new-1"])
        rcv.close()
        again = receiver(conn, q, credit=10)
        assert drain_bodies(conn, again) == ["old-1", "old-2", "new-1"]


def test_unsettled_on_one_consumer_do_not_block_another(broker):
    q = uid("held")
    with connection(broker) as conn:
        send_bodies(conn, q, ["1", "2", "3"])
        holder, got = _take_unsettled(conn, q, 1)
        other = receiver(conn, q, credit=10)
        assert drain_bodies(conn, other) == ["2", "3"]
        assert got[0][0].body == "1"
        send(conn, q, Message(body="4"))
        assert drain_bodies(conn, other) == ["4"]


def test_redelivery_keeps_every_section_and_adds_a_header_when_there_was_none(broker):
    q = uid("sections")
    with connection(broker) as conn:
        snd = sender(conn, q)
        # A bare message with no header section: just an amqp-value "raw".
        raw = snd.link.delivery(b"raw-1")
        snd.link.stream(b"\x00\x53\x77\xa1\x03raw")
        snd.link.advance()
        wait_settled(conn, raw)
        assert raw.remote_state == Delivery.ACCEPTED
        full = Message(body={"k": [1, 2]}, subject="subj", id="mid-1", correlation_id="cid-1",
                       properties={"color": "red", "n": 7},
                       annotations={symbol("x-opt-custom"): "ann"}, priority=2, durable=True)
        snd.send(full)
        rcv = receiver(conn, q, credit=None)
        rcv.link.flow(2)
        m1, d1 = fetch(conn, rcv)
        m2, d2 = fetch(conn, rcv)
        assert (m1.body, m2.body) == ("raw", {"k": [1, 2]})   # priority 4 (no header) before 2
        settle(d2, Delivery.MODIFIED, failed=True)
        settle(d1, Delivery.MODIFIED, failed=True)
        barrier(conn)
        rcv.close()
        again = receiver(conn, q, credit=10)
        r1, e1 = fetch(conn, again)
        r2, e2 = fetch(conn, again)
        settle(e1, Delivery.ACCEPTED)
        settle(e2, Delivery.ACCEPTED)
    assert (r1.body, r1.delivery_count) == ("raw", 1)
    assert r2.delivery_count == 1
    assert r2.body == {"k": [1, 2]}
    assert (r2.subject, r2.id, r2.correlation_id) == ("subj", "mid-1", "cid-1")
    assert r2.properties == {"color": "red", "n": 7}
    assert r2.annotations == {symbol("x-opt-custom"): "ann"}
    assert (r2.priority, r2.durable) == (2, True)
