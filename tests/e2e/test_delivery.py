"""End-to-end: credit, drain, dispatch, settlement modes, expiry, priority,
scheduled delivery, large and bad messages.

A real broker process; python-qpid-proton clients.  Receivers created with
`credit=None` get exactly the credit the test grants with `link.flow(n)` /
`link.drain(n)`; `credit=N` is proton's prefetch window, topped up as messages
arrive.  Outcome tests live in test_outcomes.py.
"""

from __future__ import annotations

import hashlib
import time

import pytest
from proton import Delivery, Link, Message, Timeout, symbol
from proton.reactor import AtMostOnce

from tests.client import SourceOptions
from tests.e2e.helpers_delivery import (
    QUIET,
    WAIT,
    annotated,
    connection,
    drain_bodies,
    expect_refused,
    fetch,
    fetch_body,
    let_time_pass,
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


def wait_count(conn, rcv, n, timeout=WAIT):
    conn.wait(lambda: rcv.fetcher.has_message >= n, timeout=timeout,
              msg=f"waiting for {n} messages on {rcv.link.name}")


def no_more_than(conn, rcv, n, timeout=QUIET) -> bool:
    """True when the receiver does not get past n messages within a short window."""
    try:
        conn.wait(lambda: rcv.fetcher.has_message > n, timeout=timeout)
    except Timeout:
        return True
    return False


def bodies_of(rcv) -> list:
    out = []
    while rcv.fetcher.incoming:
        msg, dlv = rcv.fetcher.incoming.popleft()
        settle(dlv, Delivery.ACCEPTED)
        out.append(msg.body)
    return out


# --------------------------------------------------------------------------- credit


def test_receiver_gets_at_most_its_credit(broker):
    q = uid("credit")
    with connection(broker) as conn:
        send_bodies(conn, q, [str(i) for i in range(10)])
        rcv = receiver(conn, q, credit=None)
        assert nothing_arrives(conn, rcv), "delivered without credit"
        rcv.link.flow(3)
        wait_count(conn, rcv, 3)
        assert no_more_than(conn, rcv, 3), "more messages than credit"
        assert rcv.link.credit == 0
        rcv.link.flow(4)
        wait_count(conn, rcv, 7)
        assert no_more_than(conn, rcv, 7)
        assert bodies_of(rcv) == [str(i) for i in range(7)]


def test_credit_granted_before_messages_exist_is_used_when_they_arrive(broker):
    q = uid("credit-later")
    with connection(broker) as conn:
        rcv = receiver(conn, q, credit=None)
        rcv.link.flow(2)
        send_bodies(conn, q, ["a", "b", "c"])
        wait_count(conn, rcv, 2)
        assert no_more_than(conn, rcv, 2)
        assert bodies_of(rcv) == ["a", "b"]


# --------------------------------------------------------------------------- drain


def test_drain_with_nothing_available_returns_credit_promptly(broker):
    q = uid("drain-empty")
    with connection(broker) as conn:
        rcv = receiver(conn, q, credit=None)
        started = time.monotonic()
        rcv.link.drain(5)
        assert rcv.link.credit == 5
        # Only the broker's flow (delivery-count advanced, credit 0) brings the
        # credit back to 0 without deliveries.
        conn.wait(lambda: rcv.link.credit == 0, timeout=WAIT, msg="drain not answered")
        assert time.monotonic() - started < 3.0
        assert not rcv.fetcher.has_message
        # The credit really is gone: a message sent now stays on the queue …
        send_bodies(conn, q, ["later"])
        assert nothing_arrives(conn, rcv)
        # … until new credit is granted.
        rcv.link.drain_mode = False
        rcv.link.flow(1)
        assert fetch_body(conn, rcv) == "later"


def test_drain_with_messages_available_delivers_them_then_zero_credit(broker):
    q = uid("drain-some")
    with connection(broker) as conn:
        send_bodies(conn, q, ["1", "2", "3"])
        rcv = receiver(conn, q, credit=None)
        rcv.link.drain(10)
        conn.wait(lambda: rcv.link.credit == 0 and rcv.fetcher.has_message == 3, timeout=WAIT,
                  msg="drain with 3 queued messages not completed")
        assert bodies_of(rcv) == ["1", "2", "3"]
        send_bodies(conn, q, ["4"])
        assert nothing_arrives(conn, rcv), "delivered after the drain used up the credit"


def test_drain_with_exactly_enough_messages(broker):
    q = uid("drain-exact")
    with connection(broker) as conn:
        send_bodies(conn, q, ["1", "2", "3", "4"])
        rcv = receiver(conn, q, credit=None)
        rcv.link.drain(2)
        conn.wait(lambda: rcv.link.credit == 0 and rcv.fetcher.has_message == 2, timeout=WAIT)
        assert no_more_than(conn, rcv, 2)
        assert bodies_of(rcv) == ["1", "2"]


# --------------------------------------------------------------------------- dispatch


def test_round_robin_among_consumers_with_credit(broker):
    q = uid("rr")
    total, consumers = 400, 4
    with connection(broker) as rconn, connection(broker) as sconn:
        # Windows of 150 (proton tops them up): every consumer always has credit,
        # so a broker that favoured one consumer would hand it far more than 100.
        rcvs = [receiver(rconn, q, credit=150) for _ in range(consumers)]
        snd = sender(sconn, q)
        dlvs = [snd.link.send(Message(body=i)) for i in range(total)]
        sconn.wait(lambda: all(d.remote_state for d in dlvs), timeout=60, msg="sending 400")
        assert {d.remote_state for d in dlvs} == {Delivery.ACCEPTED}
        rconn.wait(lambda: sum(r.fetcher.has_message for r in rcvs) >= total, timeout=60,
                   msg="receiving 400")
        counts = [r.fetcher.has_message for r in rcvs]
        got = sorted(b for r in rcvs for b in bodies_of(r))
    assert got == list(range(total))
    share = total // consumers
    for c in counts:
        assert share * 0.9 <= c <= share * 1.1, counts


def test_consumer_without_credit_is_skipped(broker):
    q = uid("skip")
    with connection(broker) as conn:
        starved = receiver(conn, q, credit=None)
        fed = receiver(conn, q, credit=5)
        send_bodies(conn, q, [str(i) for i in range(20)])
        # All 20 reach the consumer with credit, in order: dispatch does not stall
        # on (or give anything to) the one without.
        wait_count(conn, fed, 5)
        got = []
        while len(got) < 20:
            got.append(fetch_body(conn, fed))
        assert got == [str(i) for i in range(20)]
        assert not starved.fetcher.has_message
        fed.close()
        send_bodies(conn, q, ["x", "y"])
        assert nothing_arrives(conn, starved)
        starved.link.flow(2)
        wait_count(conn, starved, 2)
        assert bodies_of(starved) == ["x", "y"]


# --------------------------------------------------------------------------- settle modes


def test_presettled_consumer_gets_settled_deliveries_and_messages_are_gone(broker):
    q = uid("presettled")
    with connection(broker) as conn:
        send_bodies(conn, q, ["a", "b"])
        rcv = receiver(conn, q, credit=10, options=AtMostOnce())
        assert rcv.link.remote_snd_settle_mode == Link.SND_SETTLED
        m1, d1 = fetch(conn, rcv)
        m2, d2 = fetch(conn, rcv)
        assert [m1.body, m2.body] == ["a", "b"]
        assert d1.settled and d2.settled   # settled by the broker on transfer
    # We never settled them, and the connection is gone: nothing comes back.
    with connection(broker) as conn:
        assert drain_bodies(conn, receiver(conn, q, credit=10)) == []


def test_unsettled_consumer_gets_unsettled_deliveries_that_come_back(broker):
    q = uid("unsettled")
    with connection(broker) as conn:
        send_bodies(conn, q, ["a"])
        rcv = receiver(conn, q, credit=10)
        assert rcv.link.remote_snd_settle_mode != Link.SND_SETTLED
        msg, dlv = fetch(conn, rcv)
        assert msg.body == "a" and not dlv.settled
    with connection(broker) as conn:
        assert drain_bodies(conn, receiver(conn, q, credit=10)) == ["a"]


def test_presettled_producer(broker):
    q = uid("presettled-in")
    with connection(broker) as conn:
        rcv = receiver(conn, q, credit=10)
        snd = sender(conn, q, options=AtMostOnce())
        assert snd.link.remote_snd_settle_mode == Link.SND_SETTLED
        for b in ("x", "y", "z"):
            snd.send(Message(body=b))
        assert [fetch_body(conn, rcv) for _ in range(3)] == ["x", "y", "z"]


# --------------------------------------------------------------------------- expiry


def test_ttl_expires_messages_not_yet_delivered(broker):
    q = uid("ttl")
    with connection(broker) as conn:
        send(conn, q,
             Message(body="short", ttl=0.3),
             Message(body="no-ttl"),
             Message(body="long", ttl=60))
        let_time_pass(0.8)   # the short TTL runs out
        rcv = receiver(conn, q, credit=10)
        got = drain_bodies(conn, rcv)
        assert got == ["no-ttl", "long"]


def test_ttl_expires_while_consumer_has_no_credit(broker):
    q = uid("ttl-nocredit")
    with connection(broker) as conn:
        rcv = receiver(conn, q, credit=None)
        send(conn, q, Message(body="short", ttl=0.3), Message(body="kept"))
        let_time_pass(0.8)   # the short TTL runs out
        rcv.link.flow(5)
        assert drain_bodies(conn, rcv) == ["kept"]


def test_absolute_expiry_time(broker):
    q = uid("abs-expiry")
    now = time.time()
    with connection(broker) as conn:
        send(conn, q,
             Message(body="past", expiry_time=now - 5, creation_time=now - 10),
             Message(body="soon", expiry_time=now + 0.4, creation_time=now),
             Message(body="future", expiry_time=now + 3600, creation_time=now))
        let_time_pass(now + 0.9 - time.time())   # "soon" expires
        rcv = receiver(conn, q, credit=10)
        assert drain_bodies(conn, rcv) == ["future"]


# --------------------------------------------------------------------------- priority


def test_priority_higher_first_fifo_within_priority(broker):
    q = uid("prio")
    prios = [1, 9, 4, 9, 0, None, 4, 1, 7, 9]
    msgs = []
    for i, p in enumerate(prios):
        m = Message(body=f"{i}")
        if p is not None:
            m.priority = p
        msgs.append(m)
    with connection(broker) as conn:
        send(conn, q, *msgs)
        rcv = receiver(conn, q, credit=20)
        got = [int(b) for b in drain_bodies(conn, rcv)]
    effective = [4 if p is None else p for p in prios]
    expected = sorted(range(len(prios)), key=lambda i: (-effective[i], i))
    assert got == expected


def test_priority_applies_to_waiting_messages_only(broker):
    """A consumer with credit gets each message as it arrives; priority orders the backlog."""
    q = uid("prio-backlog")
    with connection(broker) as conn:
        rcv = receiver(conn, q, credit=None)
        low, high = Message(body="low", priority=0), Message(body="high", priority=9)
        send(conn, q, low, high)
        rcv.link.flow(2)
        wait_count(conn, rcv, 2)
        assert bodies_of(rcv) == ["high", "low"]


# --------------------------------------------------------------------------- scheduled delivery

DELAY = 1.5


def _scheduled_test(conn, q, make_delayed):
    """make_delayed(now_epoch) builds the scheduled message just before it is sent."""
    rcv = receiver(conn, q, credit=10)
    sent = time.monotonic()
    send(conn, q, make_delayed(time.time()), Message(body="now"))
    # The undelayed message sent after it is not held back.
    assert fetch_body(conn, rcv, timeout=WAIT) == "now"
    # Nothing before the delivery time (a receive window ending well before it).
    window = DELAY - 0.5 - (time.monotonic() - sent)
    if window > 0:
        assert nothing_arrives(conn, rcv, timeout=window), "scheduled message delivered early"
    assert fetch_body(conn, rcv, timeout=WAIT) == "delayed"
    assert time.monotonic() - sent >= DELAY - 0.1


def test_delivery_delay_annotation(broker):
    with connection(broker) as conn:
        assert symbol("DELAYED_DELIVERY") in (conn.conn.remote_offered_capabilities or [])
        _scheduled_test(conn, uid("delay"), lambda now: annotated(
            "delayed", {"x-opt-delivery-delay": int(DELAY * 1000)}))


def test_delivery_time_annotation(broker):
    with connection(broker) as conn:
        _scheduled_test(conn, uid("deliver-at"), lambda now: annotated(
            "delayed", {"x-opt-delivery-time": int((now + DELAY) * 1000)}))


def test_delivery_time_in_the_past_is_immediate(broker):
    q = uid("deliver-past")
    with connection(broker) as conn:
        rcv = receiver(conn, q, credit=10)
        send(conn, q, annotated("past", {"x-opt-delivery-time": int((time.time() - 60) * 1000)}))
        assert fetch_body(conn, rcv, timeout=1.0) == "past"


# --------------------------------------------------------------------------- large messages

BIG = bytes(range(256)) * (8 * 1024)   # 2 MiB


def _round_trip_big(broker):
    q = uid("big")
    with connection(broker) as conn:
        rcv = receiver(conn, q, credit=2)
        send(conn, q, Message(body=BIG))
        msg, dlv = fetch(conn, rcv, timeout=60)
        settle(dlv, Delivery.ACCEPTED)
        assert len(msg.body) == len(BIG)
        assert hashlib.sha256(msg.body).digest() == hashlib.sha256(BIG).digest()
        return conn.conn.transport.remote_max_frame_size


def test_two_mib_message_arrives_intact(broker):
    _round_trip_big(broker)


def test_two_mib_message_with_small_frames(broker_factory):
    small = broker_factory("[limits]\nmax_frame_size = 4096\n")
    assert _round_trip_big(small) == 4096


# --------------------------------------------------------------------------- limits and bad input


def test_message_larger_than_max_message_size_detaches_link(broker_factory):
    b = broker_factory("[limits]\nmax_message_size = 65536\n")
    q = uid("limit")
    with connection(b) as conn:
        snd = sender(conn, q)
        ok_before = snd.link.send(Message(body=b"a" * 1000))
        wait_settled(conn, ok_before)
        assert ok_before.remote_state == Delivery.ACCEPTED
        exc = expect_refused(snd.send, Message(body=b"x" * 100_000))
        assert exc.condition == "amqp:link:message-size-exceeded"
        b.wait_for_log(r"message larger than 65536 bytes refused")
        # Same connection, new link: the broker keeps serving, and a message just
        # under the limit passes.
        send(conn, q, Message(body=b"y" * 60_000))
        rcv = receiver(conn, q, credit=10)
        got = drain_bodies(conn, rcv)
    assert [len(x) for x in got] == [1000, 60_000]
    with connection(b) as conn:
        send_bodies(conn, q, ["alive"])
        assert drain_bodies(conn, receiver(conn, q, credit=10)) == ["alive"]


@pytest.mark.parametrize("payload", [
    b"garbage",
    b"\x00\x53\x75\xa0\x10abc",              # data section claiming 16 bytes, holding 3
    b"\x00\x53\x70\x45" + b"\x00\x53\x99\x40",  # header, then an unknown section code
], ids=["not-sections", "truncated", "unknown-section"])
def test_malformed_payload_rejected_with_decode_error(broker, payload):
    q = uid("bad")
    with connection(broker) as conn:
        snd = sender(conn, q)
        dlv = snd.link.delivery(b"bad-1")
        snd.link.stream(payload)
        snd.link.advance()
        wait_settled(conn, dlv)
        assert dlv.remote_state == Delivery.REJECTED
        assert dlv.remote.condition is not None
        assert dlv.remote.condition.name == "amqp:decode-error"
        # The same link still works, and only the good message is on the queue.
        good = snd.link.send(Message(body="good"))
        wait_settled(conn, good)
        assert good.remote_state == Delivery.ACCEPTED
        rcv = receiver(conn, q, credit=10)
        assert drain_bodies(conn, rcv) == ["good"]
    with connection(broker) as conn:   # and the broker serves new connections
        q2 = uid("after-bad")
        send_bodies(conn, q2, ["ok"])
        assert drain_bodies(conn, receiver(conn, q2, credit=5)) == ["ok"]


def test_bad_application_properties_do_not_poison_a_queue_with_a_selector_consumer(broker):
    """Sections past the header are decoded lazily; a bad application-properties
    section met while evaluating a consumer's selector must not break dispatch."""
    q = uid("bad-props")
    with connection(broker) as conn:
        picky = receiver(conn, q, credit=10, options=SourceOptions(selector="color = 'red'"))
        with connection(broker) as pconn:
            snd = sender(pconn, q)
            bad = snd.link.delivery(b"bad-props")
            # application-properties: a map8 whose entries start with an invalid constructor
            snd.link.stream(b"\x00\x53\x74\xc1\x03\x02\xff\xff" + b"\x00\x53\x77\xa1\x03abc")
            snd.link.advance()
            wait_settled(pconn, bad)
            assert bad.remote_state in (Delivery.ACCEPTED, Delivery.REJECTED)
            good = snd.link.send(Message(body="red", properties={"color": "red"}))
            wait_settled(pconn, good)
            assert good.remote_state == Delivery.ACCEPTED
        # The selector consumer's connection survives and gets the good message.
        assert drain_bodies(conn, picky) == ["red"]
    with connection(broker) as conn:
        rest = drain_bodies(conn, receiver(conn, q, credit=10))
    # Accepted → passed through as sent; rejected → not on the queue.
    assert rest == (["abc"] if bad.remote_state == Delivery.ACCEPTED else [])
