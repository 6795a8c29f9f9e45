"""JMS 2.0 subscriptions end to end, with links shaped exactly like Qpid JMS's.

Each test names the decision-table row or rule it proves (docs/shared-subscriptions.md).
"""

from __future__ import annotations

import threading
import uuid

import pytest
from proton import Message, Timeout
from proton.utils import LinkDetached

from tests.cluster_process import CLUSTER_KINDS, broker_or_cluster
from tests.client import connect, is_null_terminus, terminus_capabilities, terminus_filters
from tests.e2e.jms_links import (
    close,
    detach,
    drain_bodies,
    durable_consumer,
    null_source_attach,
    shared_consumer,
    topic_consumer,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=CLUSTER_KINDS)
def broker(request, tmp_path_factory):
    """One broker, and a cluster whose client node owns nothing (every link forwarded)."""
    yield from broker_or_cluster(request.param, tmp_path_factory)


def uniq(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def publish(url: str, topic: str, bodies, container_id=None, **fields) -> None:
    conn = connect(url, container_id=container_id)
    try:
        sender = conn.create_sender(f"amq.topic/{topic}")
        for body in bodies:
            sender.send(Message(body=body, **fields))
    finally:
        conn.close()


def receive_n(receiver, n: int, timeout: float = 10) -> list:
    out = []
    for _ in range(n):
        msg = receiver.receive(timeout=timeout)
        out.append(msg.body)
        receiver.accept()
    return out


# ------------------------------------------------------------------ shared durable


def test_row_source_shared_local_durable_splits_and_survives_consumer_detach(broker):
    topic, sub = uniq("t"), uniq("sub")
    conn = connect(broker.url, container_id=uniq("client"))
    a = shared_consumer(conn, f"amq.topic/{topic}", sub, 1, credit=1000)
    b = shared_consumer(conn, f"amq.topic/{topic}", sub, 2, credit=1000)
    caps = terminus_capabilities(a.link.remote_source)
    assert {"topic", "shared"} <= caps and "global" not in caps
    publish(broker.url, topic, range(20))
    got_a = drain_bodies(a)
    got_b = drain_bodies(b)
    assert sorted(got_a + got_b) == list(range(20))
    assert got_a and got_b, "a shared subscription spreads messages over its consumers"
    # Durable: both consumers detach (closed=false), the subscription keeps a backlog.
    assert detach(conn, a) is None and detach(conn, b) is None
    publish(broker.url, topic, ["while-away"])
    again = shared_consumer(conn, f"amq.topic/{topic}", sub, 1)
    assert receive_n(again, 1) == ["while-away"]
    conn.close()


def test_row_source_shared_global_durable_two_containers_share(broker):
    topic, sub = uniq("t"), uniq("gsub")
    c1, c2 = connect(broker.url), connect(broker.url)   # no clientID: generated container-ids
    a = shared_consumer(c1, f"amq.topic/{topic}", sub, global_=True, credit=1000)
    b = shared_consumer(c2, f"amq.topic/{topic}", sub, global_=True, credit=1000)
    assert {"topic", "shared", "global"} <= terminus_capabilities(b.link.remote_source)
    publish(broker.url, topic, range(40))
    got_a, got_b = drain_bodies(a), drain_bodies(b)
    assert sorted(got_a + got_b) == list(range(40))
    assert len(got_a) == 20 and len(got_b) == 20, "same link name from two containers: no stealing, even split"
    c1.close()
    c2.close()


def test_unsubscribe_global_durable_from_another_connection(broker):
    topic, sub = uniq("t"), uniq("gsub")
    c1 = connect(broker.url)
    consumer = shared_consumer(c1, f"amq.topic/{topic}", sub, global_=True, selector="n > 1")
    assert detach(c1, consumer) is None
    c1.close()
    c2 = connect(broker.url)
    lookup = null_source_attach(c2, f"{sub}|global")
    src = lookup.link.remote_source
    assert src.address == f"amq.topic/{topic}"
    assert {"topic", "shared", "global"} <= terminus_capabilities(src)
    assert "jms-selector" in {str(k) for k in terminus_filters(src)}
    assert close(c2, lookup) is None             # closed=true: subscription deleted
    with pytest.raises(LinkDetached) as refused:
        null_source_attach(c2, f"{sub}|global")
    assert "amqp:not-found" in str(refused.value)
    c2.close()


def test_unsubscribe_while_other_consumers_attached_is_resource_locked(broker):
    topic, sub = uniq("t"), uniq("gsub")
    c1, c2 = connect(broker.url), connect(broker.url)
    active = shared_consumer(c1, f"amq.topic/{topic}", sub, global_=True)
    lookup = null_source_attach(c2, f"{sub}|global")
    cond = close(c2, lookup)
    assert cond is not None and cond.name == "amqp:resource-locked"
    publish(broker.url, topic, ["still-here"])
    assert receive_n(active, 1) == ["still-here"], "subscription kept"
    c1.close()
    c2.close()


def test_row_null_source_not_found(broker):
    conn = connect(broker.url, container_id=uniq("client"))
    with pytest.raises(LinkDetached) as refused:
        null_source_attach(conn, uniq("nosuch"))
    assert "amqp:not-found" in str(refused.value)
    conn.close()


def test_unsubscribe_with_client_id_deletes_and_drops_backlog(broker):
    topic, sub, cid = uniq("t"), uniq("sub"), uniq("client")
    conn = connect(broker.url, container_id=cid)
    consumer = shared_consumer(conn, f"amq.topic/{topic}", sub, credit=0)
    assert detach(conn, consumer) is None
    publish(broker.url, topic, ["old"])
    lookup = null_source_attach(conn, sub)
    assert not is_null_terminus(lookup.link.remote_source)
    assert close(conn, lookup) is None
    fresh = shared_consumer(conn, f"amq.topic/{topic}", sub)
    publish(broker.url, topic, ["new"])
    assert receive_n(fresh, 1) == ["new"], "the recreated subscription has no old backlog"
    conn.close()


# ------------------------------------------------------------------ shared non-durable


def test_row_source_shared_local_nondurable_deleted_with_last_consumer(broker):
    topic, sub = uniq("t"), uniq("vsub")
    conn = connect(broker.url, container_id=uniq("client"))
    a = shared_consumer(conn, f"amq.topic/{topic}", sub, 1, durable=False, credit=0)
    b = shared_consumer(conn, f"amq.topic/{topic}", sub, 2, durable=False, credit=0)
    publish(broker.url, topic, ["x"])
    assert close(conn, a) is None
    assert close(conn, b) is None
    c = shared_consumer(conn, f"amq.topic/{topic}", sub, 3, durable=False)
    publish(broker.url, topic, ["y"])
    assert receive_n(c, 1) == ["y"], "'x' was dropped with the subscription"
    conn.close()


def test_row_source_shared_global_nondurable_across_containers(broker):
    topic, sub = uniq("t"), uniq("gv")
    c1, c2 = connect(broker.url), connect(broker.url)
    a = shared_consumer(c1, f"amq.topic/{topic}", sub, global_=True, durable=False, credit=1000)
    b = shared_consumer(c2, f"amq.topic/{topic}", sub, global_=True, durable=False, credit=1000)
    publish(broker.url, topic, range(10))
    got = drain_bodies(a) + drain_bodies(b)
    assert sorted(got) == list(range(10))
    c1.close()
    c2.close()


# ------------------------------------------------------------------ unshared


def test_row_source_unshared_local_durable_resubscribe_gets_backlog(broker):
    topic, sub, cid = uniq("t"), uniq("dsub"), uniq("client")
    conn = connect(broker.url, container_id=cid)
    consumer = durable_consumer(conn, f"amq.topic/{topic}", sub)
    assert terminus_capabilities(consumer.link.remote_source) >= {"topic"}
    assert detach(conn, consumer) is None
    publish(broker.url, topic, ["m1", "m2"])
    conn.close()
    conn = connect(broker.url, container_id=cid)
    again = durable_consumer(conn, f"amq.topic/{topic}", sub)
    assert receive_n(again, 2) == ["m1", "m2"]
    conn.close()


def test_rule_second_consumer_on_unshared_durable_is_resource_locked(broker):
    topic, sub = uniq("t"), uniq("dsub")
    c1, c2 = connect(broker.url), connect(broker.url)
    durable_consumer(c1, f"amq.topic/{topic}", sub, global_=True)
    with pytest.raises(LinkDetached) as refused:
        durable_consumer(c2, f"amq.topic/{topic}", sub, global_=True)
    assert "amqp:resource-locked" in str(refused.value)
    c1.close()
    c2.close()


def test_rule_shared_and_unshared_of_same_name_lock_each_other(broker):
    topic, sub, cid = uniq("t"), uniq("sub"), uniq("client")
    conn = connect(broker.url, container_id=cid)
    shared = shared_consumer(conn, f"amq.topic/{topic}", sub)
    detach(conn, shared)
    with pytest.raises(LinkDetached) as refused:
        durable_consumer(conn, f"amq.topic/{topic}", sub)
    assert "amqp:resource-locked" in str(refused.value)
    conn.close()


def test_row_source_unshared_nondurable_topic_consumer_private_queue(broker):
    topic = uniq("t")
    conn = connect(broker.url)
    a = topic_consumer(conn, f"amq.topic/{topic}")
    b = topic_consumer(conn, f"amq.topic/{topic}")
    publish(broker.url, topic, ["both"])
    assert receive_n(a, 1) == ["both"] and receive_n(b, 1) == ["both"]
    conn.close()


# ------------------------------------------------------------------ bindings change


def test_rule_changed_selector_without_consumers_recreates_and_logs_dropped_backlog(broker):
    topic, sub, cid = uniq("t"), uniq("dsub"), uniq("client")
    conn = connect(broker.url, container_id=cid)
    detach(conn, durable_consumer(conn, f"amq.topic/{topic}", sub, selector="n = 1"))
    publish(broker.url, topic, ["kept?"], properties={"n": 1})
    again = durable_consumer(conn, f"amq.topic/{topic}", sub, selector="n = 2")
    broker.wait_for_log(rf"subscription {sub}: .*recreated, backlog of 1 message")
    publish(broker.url, topic, ["one"], properties={"n": 1})
    publish(broker.url, topic, ["two"], properties={"n": 2})
    assert receive_n(again, 1) == ["two"]
    conn.close()


def test_rule_changed_topic_with_active_consumer_is_resource_locked(broker):
    sub = uniq("sub")
    conn = connect(broker.url, container_id=uniq("client"))
    shared_consumer(conn, f"amq.topic/{uniq('t')}", sub, 1)
    with pytest.raises(LinkDetached) as refused:
        shared_consumer(conn, f"amq.topic/{uniq('other')}", sub, 2)
    assert "amqp:resource-locked" in str(refused.value)
    conn.close()


# ------------------------------------------------------------------ selectors and no-local


def test_selector_on_shared_subscription_filters(broker):
    topic, sub = uniq("t"), uniq("sel")
    conn = connect(broker.url, container_id=uniq("client"))
    consumer = shared_consumer(conn, f"amq.topic/{topic}", sub, selector="color = 'red' AND size > 2")
    assert "jms-selector" in {str(k) for k in terminus_filters(consumer.link.remote_source)}
    publish(broker.url, topic, ["a"], properties={"color": "red", "size": 3})
    publish(broker.url, topic, ["b"], properties={"color": "blue", "size": 3})
    publish(broker.url, topic, ["c"], properties={"color": "red", "size": 1})
    publish(broker.url, topic, ["d"], properties={"color": "red", "size": 9})
    assert receive_n(consumer, 2) == ["a", "d"]
    conn.close()


def test_invalid_selector_refused_with_invalid_field(broker):
    conn = connect(broker.url, container_id=uniq("client"))
    with pytest.raises(LinkDetached) as refused:
        shared_consumer(conn, f"amq.topic/{uniq('t')}", uniq("bad"), selector="color = ")
    assert "amqp:invalid-field" in str(refused.value)
    assert "Invalid JMS Selector" in str(refused.value)
    conn.close()


def test_no_local_skips_own_connection(broker):
    topic, cid = uniq("t"), uniq("client")
    conn = connect(broker.url, container_id=cid)
    consumer = durable_consumer(conn, f"amq.topic/{topic}", uniq("nl"), no_local=True)
    own = conn.create_sender(f"amq.topic/{topic}")
    own.send(Message(body="mine"))
    publish(broker.url, topic, ["theirs"])
    assert receive_n(consumer, 1) == ["theirs"]
    with pytest.raises(Timeout):   # nothing else is coming: a short wait is the check
        consumer.receive(timeout=0.5)
    conn.close()


# ------------------------------------------------------------------ links


def test_link_stolen_by_same_container_on_another_connection(broker):
    """AMQP 1.0 §2.6.1: (container-id, link name, role) names a link; attaching it
    again elsewhere takes it over.  Two connections share a container-id here
    (no sole-connection-for-container), as after a client failover."""
    topic, sub, cid = uniq("t"), uniq("dsub"), uniq("client")
    old_conn, new_conn = connect(broker.url, container_id=cid), connect(broker.url, container_id=cid)
    first = durable_consumer(old_conn, f"amq.topic/{topic}", sub)
    second = durable_consumer(new_conn, f"amq.topic/{topic}", sub)
    old_conn.wait(lambda: first.link.remote_condition is not None, timeout=5, msg="steal")
    assert first.link.remote_condition.name == "amqp:link:stolen"
    publish(broker.url, topic, ["to-second"])
    assert receive_n(second, 1) == ["to-second"]
    new_conn.close()


def test_fifty_concurrent_consumers_create_one_subscription(broker):
    topic, sub = uniq("t"), uniq("race")
    conns, receivers, errors = [], [], []
    lock = threading.Lock()

    def attach():
        try:
            c = connect(broker.url)
            r = shared_consumer(c, f"amq.topic/{topic}", sub, global_=True, credit=1000)
            with lock:
                conns.append(c)
                receivers.append(r)
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=attach) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and len(receivers) == 50
    publish(broker.url, topic, range(100))
    total = []
    for r in receivers:
        total += drain_bodies(r, timeout=0.3)
    assert sorted(total) == list(range(100)), "one subscription: every message exactly once"
    for c in conns:
        c.close()


def test_distribution_skew_within_ten_percent(broker):
    topic, sub = uniq("t"), uniq("fair")
    conn = connect(broker.url, container_id=uniq("client"))
    consumers = [shared_consumer(conn, f"amq.topic/{topic}", sub, i + 1, credit=2000) for i in range(4)]
    publish(broker.url, topic, range(2000))
    counts = [len(drain_bodies(c)) for c in consumers]
    assert sum(counts) == 2000
    assert max(abs(c - 500) for c in counts) <= 50, counts
    conn.close()


def test_released_message_goes_to_another_consumer(broker):
    topic, sub = uniq("t"), uniq("rel")
    conn = connect(broker.url, container_id=uniq("client"))
    a = shared_consumer(conn, f"amq.topic/{topic}", sub, 1, credit=1)
    publish(broker.url, topic, ["only"])
    msg = a.receive(timeout=30)   # (generous: through a non-owner node of a cluster on a busy machine)
    b = shared_consumer(conn, f"amq.topic/{topic}", sub, 2, credit=5)
    a.release(delivered=False)
    assert msg.body == "only"
    assert b.receive(timeout=30).body == "only"
    conn.close()
