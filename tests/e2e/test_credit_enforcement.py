"""Link credit is a promise the peer may break (AMQP 1.0 §2.6.7): a transfer beyond
the credit the broker granted ends the link with `amqp:link:transfer-limit-exceeded`
(a link error, §2.8.16) and is never queued, whatever the queue's limits or the
alarms say.  The hostile peer is a real proton sender whose engine is lied to about
its credit (tests/e2e/wire_peers.py), so the transfers on the wire are exactly those
of a client that ignores credit."""

from __future__ import annotations

import pytest
from proton import Delivery, Message

from tests.e2e.flow_support import api, broker_without_errors, depth
from tests.e2e.helpers_conn import REMOTE_CLOSED
from tests.e2e.helpers_delivery import uid
from tests.e2e.wire_peers import CreditLiar, DeliveryCountRewinder

pytestmark = pytest.mark.e2e

TRANSFER_LIMIT = "amqp:link:transfer-limit-exceeded"
CREDIT = 20

CONFIG = f"""
[limits]
link_credit = {CREDIT}

[[queue_limits]]
pattern = "blk.#"
max_depth = 100
overflow = "block"
"""


@pytest.fixture
def broker(broker_factory):
    yield from broker_without_errors(broker_factory, CONFIG)


def flood(client: CreditLiar, snd, n: int, prefix: str = "m") -> list[Delivery]:
    """Send `n` transfers as fast as the (lied-to) engine lets them go."""
    out = []
    for i in range(n):
        dlv = snd.delivery(f"{prefix}{i}")
        snd.send(Message(body=f"{prefix}-{i}").encode())
        snd.advance()
        out.append(dlv)
        if i % 100 == 99:
            client.pump(0)
    client.pump(0)
    return out


def open_liar(broker, address: str):
    client = CreditLiar("127.0.0.1", broker.port, container_id=f"liar-{uid()}").wait_open()
    ssn = client.session()
    snd = client.sender(ssn, address, f"liar-{uid()}")
    client.wait(lambda: client.flows_seen > 0, what="the broker's first flow")
    return client, ssn, snd


def test_transfers_beyond_credit_end_the_link_and_are_not_queued(broker):
    """2,000 transfers on a link granted 20 at a time into a `max_depth = 100` block
    queue: the link is ended with transfer-limit-exceeded at the first transfer beyond
    the credit; what was within the credit is accepted, the rest is never queued."""
    q = uid("blk.q")
    client, ssn, snd = open_liar(broker, q)
    try:
        sent = flood(client, snd, 2000)
        client.wait(lambda: snd.state & REMOTE_CLOSED, 15, "the broker ending the link")
        assert snd.remote_condition is not None and snd.remote_condition.name == TRANSFER_LIMIT, \
            snd.remote_condition
        client.pump_for(0.2)
        accepted = [d for d in sent if d.remote_state == Delivery.ACCEPTED]
        assert 0 < len(accepted) <= 100
        assert depth(broker, q) == len(accepted), "only what was within the credit is queued"
        assert accepted == sent[:len(accepted)], "the accepted ones are the first, in order"
        # A link error: the session and the connection go on.
        other = client.sender(ssn, q + ".other", f"honest-{uid()}")
        client.wait(lambda: other.credit > 0, what="credit on a new link of the same session")
        dlv = other.delivery("ok")
        other.send(Message(body="fine").encode())
        other.advance()
        client.wait(lambda: dlv.remote_state, what="outcome of an honest transfer")
        assert dlv.remote_state == Delivery.ACCEPTED
    finally:
        client.close()
    assert f"{TRANSFER_LIMIT}" in broker.log_text()


def test_a_peer_ignoring_credit_during_a_memory_alarm_gets_nothing_queued_beyond_its_credit(broker):
    """While a memory alarm holds producers, a peer that keeps sending anyway gets exactly
    the credit it held when the alarm came, and its link is ended."""
    q = uid("plain")
    client, ssn, snd = open_liar(broker, q)
    try:
        granted = client.granted[0]
        assert granted == CREDIT
        with api(broker) as c:
            assert c.put("/api/alarms", json={"memory_high_watermark_absolute": 1}).json()["blocking"] is True
        sent = flood(client, snd, 500)
        client.wait(lambda: snd.state & REMOTE_CLOSED, 15, "the broker ending the link")
        assert snd.remote_condition.name == TRANSFER_LIMIT
        client.pump_for(0.2)
        accepted = [d for d in sent if d.remote_state == Delivery.ACCEPTED]
        assert len(accepted) == granted, "exactly the credit held when the alarm came"
        assert depth(broker, q) == granted
    finally:
        client.close()
        with api(broker) as c:
            c.put("/api/alarms", json={"memory_high_watermark_absolute": 10**18})


def test_a_peer_ignoring_credit_on_an_unlimited_queue_is_stopped_too(broker):
    """Credit is enforced everywhere, not only where a limit or an alarm applies."""
    q = uid("plain")
    client, ssn, snd = open_liar(broker, q)
    try:
        sent = flood(client, snd, 3000)
        client.wait(lambda: snd.state & REMOTE_CLOSED, 15, "the broker ending the link")
        assert snd.remote_condition.name == TRANSFER_LIMIT
        client.pump_for(0.2)
        accepted = sum(1 for d in sent if d.remote_state == Delivery.ACCEPTED)
        assert accepted < 3000 and depth(broker, q) == accepted
    finally:
        client.close()


def test_a_large_transfer_beyond_credit_is_refused_at_its_first_frame(broker):
    """A message of many frames (8 MiB in 64 KiB frames) beyond the credit (during an
    alarm: no top-up after the first grant) ends the link like a small one, and nothing
    of it is queued.  (The broker checks each frame of a partial delivery, so it need
    not wait for the rest; from outside that cannot be told apart on loopback.)"""
    q = uid("plain")
    client, ssn, snd = open_liar(broker, q)
    with api(broker) as c:   # no more credit than the first grant from now on
        assert c.put("/api/alarms", json={"memory_high_watermark_absolute": 1}).json()["blocking"] is True
    try:
        within = flood(client, snd, CREDIT)
        big = snd.delivery(b"big")
        snd.send(Message(body=b"x" * (8 << 20)).encode())   # frames of at most max_frame_size
        snd.advance()
        client.wait(lambda: snd.state & REMOTE_CLOSED, 30, "the broker ending the link")
        assert snd.remote_condition.name == TRANSFER_LIMIT
        client.pump_for(0.2)
        assert all(d.remote_state == Delivery.ACCEPTED for d in within) and not big.remote_state
        assert depth(broker, q) == CREDIT
    finally:
        client.close()
        with api(broker) as c:
            c.put("/api/alarms", json={"memory_high_watermark_absolute": 10**18})


def test_a_sender_moving_its_delivery_count_back_is_stopped(broker):
    """A sender's own flow whose delivery-count is 1,000 behind what it sent: proton
    added the (unsigned) difference to the link's credit, and the broker, trusting
    proton's count, took 212 more transfers into a `max_depth = 100` block queue
    without ending the link.  Only the sender moves its delivery-count, and only
    forward (AMQP 1.0 §2.6.7): the link is ended, nothing beyond the credit queued."""
    q = uid("blk.q")
    client = DeliveryCountRewinder("127.0.0.1", broker.port, container_id=f"rewinder-{uid()}").wait_open()
    try:
        snd = client.sender(client.session(), q, f"rewinder-{uid()}")
        client.wait(lambda: client.flows_seen > 0, what="the broker's first flow")
        granted = client.granted[0]
        sent = flood(client, snd, granted)                  # exactly the credit granted
        client.wait(lambda: all(d.remote_state for d in sent), what="their outcomes")
        client.rewind(transfers_sent=granted, back=1000)
        sent += flood(client, snd, 500, prefix="more")
        client.wait(lambda: snd.state & REMOTE_CLOSED, 15, "the broker ending the link")
        assert snd.remote_condition is not None and snd.remote_condition.name == TRANSFER_LIMIT, \
            snd.remote_condition
        client.pump_for(0.2)
        accepted = [d for d in sent if d.remote_state == Delivery.ACCEPTED]
        assert len(accepted) <= 100 and depth(broker, q) == len(accepted)
    finally:
        client.close()
