"""Crash safety of deliveries from a deep durable backlog (store/marks.py: delivered
marks by range, the queue's delivery watermark): a consumer takes messages stored by
earlier batches without settling them, the broker is SIGKILLed, and after the
restart every message the consumer saw comes back marked redelivered
(delivery-count >= 1), nothing is lost, and the false redeliveries stay bounded
(JMS 2.0 §3.4.7 allows them; AMQP 1.0 §3.2.1 forbids the opposite).
"""

from __future__ import annotations

import uuid

import pytest

from amqpbroker.store.marks import LOOKAHEAD
from tests.client import connect
from tests.e2e.crash_support import drain, send_durable

pytestmark = pytest.mark.e2e

PAGED = "[store]\nqueue_memory_budget = 262144\n"   # most of the backlog only in the store


def uniq(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def receive_unsettled(url: str, address: str, n: int, credit: int = 500):
    """Receive n messages and settle none; the connection is left open (the broker
    is killed under it).  ([(id, delivery-count)] as the consumer saw them, conn)."""
    conn = connect(url)
    receiver = conn.create_receiver(address, credit=credit)
    return [(m.id, m.delivery_count) for m in (receiver.receive(timeout=10) for _ in range(n))], conn


@pytest.mark.parametrize("taken", [1, 2500, 9000])
def test_messages_seen_from_a_deep_backlog_come_back_redelivered_after_a_crash(broker_factory, taken):
    b = broker_factory(PAGED)
    q = uniq("deep-crash")
    backlog = 12_000
    traffic = send_durable(b, q, backlog, "m", window=500, body=b"D" * 256)
    assert len(traffic.accepted) == backlog
    seen, conn = receive_unsettled(b.url, q, taken)
    assert all(count == 0 for _, count in seen)
    b.kill()   # the consumer's connection dies with it
    b.start()
    got = drain(b.url, q)
    counts = dict(got)
    assert len(got) == len(counts) == backlog, "lost or duplicated messages"
    assert set(counts) == set(traffic.accepted)
    del conn
    unmarked = [mid for mid, _ in seen if counts[mid] < 1]
    assert not unmarked, f"{len(unmarked)} message(s) seen before the crash came back as first deliveries"
    # Over-marking is allowed but bounded: the watermark runs at most LOOKAHEAD
    # ahead of the deliveries (plus the consumer's prefetch).
    redelivered = sum(1 for c in counts.values() if c >= 1)
    assert redelivered <= taken + LOOKAHEAD + 500, redelivered


def test_a_crash_after_a_drain_marks_no_later_message(broker_factory):
    """The watermark never runs past the queue's tail: messages sent after the
    backlog was drained are first deliveries after a crash."""
    b = broker_factory(PAGED)
    q = uniq("drained")
    send_durable(b, q, 3000, "a", window=500, body=b"D" * 256)
    assert len(drain(b.url, q)) == 3000
    later = send_durable(b, q, 2000, "b", window=500, body=b"D" * 256)
    b.kill()
    b.start()
    got = drain(b.url, q)
    assert {mid for mid, _ in got} == set(later.accepted)
    assert all(count == 0 for _, count in got), "messages never delivered came back redelivered"


def test_a_clean_restart_drops_the_watermark(broker_factory):
    """A clean stop with nothing acquired leaves no watermark: no false redeliveries."""
    b = broker_factory(PAGED)
    q = uniq("clean")
    send_durable(b, q, 5000, "c", window=500, body=b"D" * 256)
    conn = connect(b.url)
    receiver = conn.create_receiver(q, credit=100)
    for _ in range(100):
        receiver.receive(timeout=10)
        receiver.accept()
    conn.close()
    b.stop()
    b.start()
    got = drain(b.url, q)
    assert len(got) == 4900
    assert all(count == 0 for _, count in got)
