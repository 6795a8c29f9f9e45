"""Queue limits and overflow policies, alarms holding producers' credit, and slow
consumers not holding producers back: the real broker, real proton clients
(docs/operations.md "Queue limits and overflow")."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from proton import Delivery, Message, Timeout

from tests.client import connect, receive_all
from tests.e2e.helpers_delivery import uid

pytestmark = pytest.mark.e2e

RESOURCE_LIMIT = "amqp:resource-limit-exceeded"

CONFIG = """
[limits]
link_credit = 20

[policy]
dead_letter_address = "dlq"

[[queue_limits]]
pattern = "blk.#"
max_depth = 50
overflow = "block"

[[queues]]
name = "dlq"

[[queues]]
name = "rej"
max_depth = 3
overflow = "reject"

[[queues]]
name = "drop"
max_depth = 3
overflow = "drop-head"

[[exchanges]]
name = "news"
type = "topic"

[[queues]]
name = "news-full"
max_depth = 3
overflow = "reject"

[[queues]]
name = "news-other"

[[bindings]]
exchange = "news"
queue = "news-full"
key = "#"

[[bindings]]
exchange = "news"
queue = "news-other"
key = "#"

[[exchanges]]
name = "feed"
type = "fanout"

[[queues]]
name = "feed-slow"
max_depth = 30
overflow = "block"

[[queues]]
name = "feed-other"

[[bindings]]
exchange = "feed"
queue = "feed-slow"

[[bindings]]
exchange = "feed"
queue = "feed-other"
"""


@pytest.fixture
def broker(broker_factory):
    return broker_factory(CONFIG)


def api(broker) -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{broker.ports['management']}", timeout=10)


def bodies_of_n(rcv, n: int, timeout: float = 10) -> list:
    out = []
    for _ in range(n):
        out.append(rcv.receive(timeout=timeout).body)
        rcv.accept()
    return out


def send_until_held(snd, limit: int, prefix: str = "m") -> int:
    """Send until a send waits (no credit: the message waits in the client); returns
    how many were settled.  The one that waited goes out when credit comes."""
    sent = 0
    try:
        while sent < limit:
            snd.send(Message(body=f"{prefix}-{sent}"), timeout=0.5)
            sent += 1
    except Timeout:
        pass
    return sent


def test_block_holds_credit_at_max_depth_and_resumes_when_drained(broker):
    q = uid("blk.q")
    consumer_conn, producer_conn = connect(broker.url), connect(broker.url)
    try:
        snd = producer_conn.create_sender(q)
        sent = send_until_held(snd, 1000)
        # Held at 50 held messages, plus at most the credit the producer still had (20).
        assert 50 <= sent <= 70, f"{sent} sent before the producer had to wait"
        with api(broker) as c:
            info = c.get(f"/api/queues/{q}").json()
        assert info["limits"] == {"max_depth": 50, "max_bytes": 0, "overflow": "block"}
        rcv = consumer_conn.create_receiver(q, credit=10)
        got = bodies_of_n(rcv, sent)          # draining wakes the producer: no timer
        sent += 1                             # the one that waited has gone out
        while sent < 200:
            try:
                snd.send(Message(body=f"m-{sent}"), timeout=5)
            except Timeout:
                pytest.fail(f"the producer stayed blocked after the queue drained ({sent} sent)")
            got += bodies_of_n(rcv, 1)
            sent += 1
        got += bodies_of_n(rcv, 1)
        assert got == [f"m-{i}" for i in range(200)], "nothing lost, nothing refused, in order"
    finally:
        producer_conn.close()
        consumer_conn.close()


def test_reject_answers_resource_limit_exceeded_and_loses_nothing(broker):
    conn = connect(broker.url)
    try:
        snd = conn.create_sender("rej")
        for i in range(3):
            assert snd.send(Message(body=f"m{i}"), error_states=[]).remote_state == Delivery.ACCEPTED
        dlv = snd.send(Message(body="extra"), error_states=[])
        assert dlv.remote_state == Delivery.REJECTED
        assert dlv.remote.condition.name == RESOURCE_LIMIT and "queue 'rej' is full" in dlv.remote.condition.description
        # The link stays usable: the next one is rejected the same way.
        assert snd.send(Message(body="extra2"), error_states=[]).remote_state == Delivery.REJECTED
    finally:
        conn.close()
    assert [m.body for m in receive_all(broker.url, "rej")] == ["m0", "m1", "m2"]
    with api(broker) as c:
        info = c.get("/api/queues/rej").json()
        assert info["overflow_rejected_total"] == 2 and info["limits"]["overflow"] == "reject"
        assert 'amqpbroker_queue_overflow_rejected_total{queue="rej"} 2' in c.get("/metrics/per-object").text


def test_drop_head_dead_letters_the_oldest_and_keeps_the_newest(broker):
    conn = connect(broker.url)
    try:
        snd = conn.create_sender("drop")
        for i in range(5):
            assert snd.send(Message(body=f"m{i}"), error_states=[]).remote_state == Delivery.ACCEPTED
    finally:
        conn.close()
    assert [m.body for m in receive_all(broker.url, "drop")] == ["m2", "m3", "m4"]
    assert [m.body for m in receive_all(broker.url, "dlq")] == ["m0", "m1"]
    with api(broker) as c:
        assert c.get("/api/queues/drop").json()["overflow_dropped_total"] == 2


def test_topic_fan_out_with_a_full_reject_subscription_queue(broker):
    conn = connect(broker.url)
    try:
        snd = conn.create_sender("news")
        for i in range(3):
            assert snd.send(Message(body=f"n{i}", subject="a.b"), error_states=[]).remote_state == Delivery.ACCEPTED
        dlv = snd.send(Message(body="n3", subject="a.b"), error_states=[])
        assert dlv.remote_state == Delivery.REJECTED and dlv.remote.condition.name == RESOURCE_LIMIT
    finally:
        conn.close()
    assert [m.body for m in receive_all(broker.url, "news-full")] == ["n0", "n1", "n2"]
    assert [m.body for m in receive_all(broker.url, "news-other")] == ["n0", "n1", "n2"], \
        "a rejected message reaches none of the routed queues"


def test_fan_out_block_holds_the_producer_while_one_bound_queue_is_full(broker):
    producer_conn = connect(broker.url)
    try:
        snd = producer_conn.create_sender("feed")
        sent = send_until_held(snd, 500, prefix="f")
        assert 30 <= sent <= 50, f"{sent} sent before the producer had to wait"
        # The one that waits is in the client, without credit: nothing more came in.
        assert len(receive_all(broker.url, "feed-other")) == sent, "the other queue drains freely"
        assert receive_all(broker.url, "feed-other", timeout=0.5) == [], "still held: feed-slow is full"
        assert len(receive_all(broker.url, "feed-slow")) >= sent
        for i in range(10):   # room again: credit again
            snd.send(Message(body=f"more-{i}"), timeout=5)
    finally:
        producer_conn.close()


def test_alarm_holds_producers_credit_and_consumers_keep_draining(broker):
    q = uid("alarmed")
    conn = connect(broker.url)
    try:
        snd = conn.create_sender(q)
        for i in range(5):
            snd.send(Message(body=f"a{i}"))
        with api(broker) as c:
            assert c.put("/api/alarms", json={"memory_high_watermark_absolute": 1}).json()["blocking"] is True
        sent = 5 + send_until_held(snd, 1000, prefix="b")
        assert sent <= 5 + 20, "no credit beyond what the producer held when the alarm came"
        # Consumers drain during the alarm (the send that waits is still in the client).
        assert len(receive_all(broker.url, q)) == sent
        with api(broker) as c:
            assert c.put("/api/alarms", json={"memory_high_watermark_absolute": 10**18}).json()["blocking"] is False
        for i in range(50):   # topped up when the alarm clears
            snd.send(Message(body=f"c{i}"), timeout=5)
    finally:
        conn.close()
    assert len(receive_all(broker.url, q)) == 1 + 50   # the one that waited, then the rest


def test_a_slow_consumer_does_not_hold_a_durable_producer_back(broker_factory):
    """Default configuration: no implicit flow control by consumer speed.  Judged by
    the consumer's own pace, not a clock: a producer held to the consumer's speed
    would finish after the consumer took about all of it; this one finishes while
    the consumer has taken fewer than half."""
    b = broker_factory()
    q = uid("slow")
    n = 1000
    stop = threading.Event()
    consumed: list[int] = []

    def slow_consumer() -> None:
        conn = connect(b.url)
        try:
            rcv = conn.create_receiver(q, credit=1)
            while not stop.is_set():
                try:
                    rcv.receive(timeout=0.2)
                except Timeout:
                    continue
                rcv.accept()
                consumed.append(1)
                time.sleep(0.1)    # at most 10 messages a second
        finally:
            conn.close()

    thread = threading.Thread(target=slow_consumer, daemon=True)
    thread.start()
    conn = connect(b.url)
    try:
        snd = conn.create_sender(q)
        snd.send(Message(body="first", durable=True))
        time.sleep(0.3)   # the consumer is taking messages
        started = time.monotonic()
        for i in range(n):
            snd.send(Message(body=f"d{i}", durable=True), timeout=10)
        elapsed = time.monotonic() - started
    finally:
        conn.close()
        stop.set()
        thread.join(10)
    assert len(consumed) < n / 2, (f"{n} durable messages took {elapsed:.1f} s, while the slow consumer "
                                   f"took {len(consumed)}: the producer went at the consumer's pace")
    assert len(receive_all(b.url, q, timeout=2.0)) == n + 1 - len(consumed)


def outcomes_of_three(broker, queue: str) -> list:
    """The outcomes of three messages sent to `queue`, one after the other."""
    conn = connect(broker.url)
    try:
        snd = conn.create_sender(queue)
        return [snd.send(Message(body=i), error_states=[]).remote_state for i in range(3)]
    finally:
        conn.close()


def test_limits_declared_through_the_management_api(broker):
    with api(broker) as c:
        r = c.post("/api/queues", json={"name": "api-limited", "max_depth": 2, "overflow": "reject"})
        assert r.status_code == 201, r.text
        assert r.json()["limits"] == {"max_depth": 2, "max_bytes": 0, "overflow": "reject"}
        listed = {q["name"]: q for q in c.get("/api/queues").json()}
        assert listed["api-limited"]["limits"]["overflow"] == "reject" and listed["dlq"]["limits"] is None
    assert outcomes_of_three(broker, "api-limited") == [Delivery.ACCEPTED, Delivery.ACCEPTED, Delivery.REJECTED]


def test_limits_declared_through_the_api_are_kept_across_a_restart(broker):
    """A durable queue's declared limits are in its store record: after a restart the
    queue is still limited (a [[queue_limits]] pattern would not cover it)."""
    with api(broker) as c:
        r = c.post("/api/queues", json={"name": "kept-limited", "max_depth": 2, "max_bytes": 4096,
                                        "overflow": "reject"})
        assert r.status_code == 201, r.text
    broker.restart()
    with api(broker) as c:
        listed = {q["name"]: q for q in c.get("/api/queues").json()}
    assert listed["kept-limited"]["limits"] == {"max_depth": 2, "max_bytes": 4096, "overflow": "reject"}
    assert listed["rej"]["limits"]["max_depth"] == 3          # configured ones as before
    assert outcomes_of_three(broker, "kept-limited") == [Delivery.ACCEPTED, Delivery.ACCEPTED, Delivery.REJECTED]


def test_a_transactional_send_to_a_full_reject_queue_is_refused_when_staged(broker):
    """The commit is all or nothing and would take the queue past its limit, so the
    send is refused when it arrives (as Artemis fails it at send time): rejected with
    amqp:resource-limit-exceeded, not staged; the transaction goes on and commits the
    rest."""
    from tests.e2e.helpers_conn import RawClient
    from tests.e2e.jms_txn import TxnSession

    conn = connect(broker.url)
    try:
        snd = conn.create_sender("rej")
        assert [snd.send(Message(body=i), error_states=[]).remote_state for i in range(3)] == [Delivery.ACCEPTED] * 3
    finally:
        conn.close()
    client = RawClient("127.0.0.1", broker.port, container_id=f"txn-{uid()}").wait_open()
    try:
        s = TxnSession(client)
        full, other = s.sender("rej"), s.sender("news-other")
        txn = s.declare()
        refused = s.send(full, "over", txn)
        staged = s.send(other, "fine", txn)
        assert refused.remote_state == Delivery.REJECTED
        assert refused.remote.condition.name == RESOURCE_LIMIT and "queue 'rej' is full" in \
            refused.remote.condition.description
        assert staged.remote_state == 0x34                     # transactional-state: staged
        assert s.discharge(txn).remote_state == Delivery.ACCEPTED
    finally:
        client.close()
    assert [m.body for m in receive_all(broker.url, "rej", timeout=2.0)] == [0, 1, 2]
    assert [m.body for m in receive_all(broker.url, "news-other", timeout=2.0)] == ["fine"]
