"""End to end: JMS subscription names across the nodes of `serve --workers 3`
(tests/cluster_process.py; node n0 owns no slot, so a client of n0 reaches every
subscription through another node), behaving as on one broker:

* unsubscribing a durable subscription of a partitioned topic deletes it on every
  member (it exists on each);
* a shared non-durable subscription in use under one topic cannot be attached under
  another topic held by another node (JMS 2.0 §6.11, the single broker's
  `amqp:resource-locked`), and is free again once its last consumer has gone;
* a producer on an exchange without a key: each message is routed by its subject
  (the single broker's rule), to the node that owns that key.
"""

from __future__ import annotations

import pytest
from proton import Delivery, Endpoint, Message, symbol
from proton.utils import LinkDetached

from tests.client import connect, is_null_terminus
from tests.cluster_process import ClusterProcess
from tests.e2e.helpers_delivery import drain_bodies, receiver, sender, uid
from tests.e2e.jms_links import close, detach, durable_consumer, null_source_attach, shared_consumer
from tests.e2e.jms_links import drain_bodies as take_all
from tests.e2e.test_cluster import owned_by

pytestmark = pytest.mark.e2e

CONFIG = """
[[exchanges]]
name = "routes"
type = "direct"

[cluster]
partitioned = [{address = "sprices", members = 2, topic = true}]
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    proc = ClusterProcess(tmp_path_factory.mktemp("cluster-subs") / "data", config=CONFIG).start()
    yield proc
    proc.stop()


def publish_spread(url: str, topic: str, links: int = 4, per_link: int = 10) -> list[int]:
    """Messages on `links` producer links (each link sticks to one member, so both
    members get some); returns the bodies sent."""
    conn = connect(url)
    bodies = []
    try:
        for link in range(links):
            snd = conn.create_sender(f"amq.topic/{topic}", name=uid("pub"))
            for i in range(per_link):
                snd.send(Message(body=link * 1000 + i, durable=True))
                bodies.append(link * 1000 + i)
            snd.close()
    finally:
        conn.close()
    return bodies


# ------------------------------------------------------------------ unsubscribe on a partitioned topic


def test_unsubscribe_of_a_partitioned_durable_subscription_deletes_it_on_every_member(cluster):
    cid, sub = uid("client"), uid("psub")
    conn = connect(cluster.url, container_id=cid)
    try:
        detach(conn, durable_consumer(conn, "amq.topic/sprices", sub, credit=0))   # kept on both members
        publish_spread(cluster.url, "sprices")
        lookup = null_source_attach(conn, sub)
        assert not is_null_terminus(lookup.link.remote_source), "found"
        assert close(conn, lookup) is None, "deleted"
        with pytest.raises(LinkDetached) as gone:
            null_source_attach(conn, sub)
        assert "amqp:not-found" in str(gone.value), "no member keeps a copy"
    finally:
        conn.close()
    # Subscribed again (a new connection: the refused link's name is still the
    # client's there): a new subscription, none of the old backlog on any member.
    conn = connect(cluster.url, container_id=cid)
    try:
        fresh = durable_consumer(conn, "amq.topic/sprices", sub, credit=100)
        assert take_all(fresh, timeout=1.0) == []
    finally:
        conn.close()


def test_unsubscribe_of_a_partitioned_subscription_in_use_is_locked_and_deletes_nothing(cluster):
    sub = uid("gsub")
    user = connect(cluster.url)
    admin = connect(cluster.url)
    try:
        active = shared_consumer(user, "amq.topic/sprices", sub, global_=True, credit=500)
        sent = publish_spread(cluster.url, "sprices")
        lookup = null_source_attach(admin, f"{sub}|global")
        assert not is_null_terminus(lookup.link.remote_source)
        cond = close(admin, lookup)
        assert cond is not None and cond.name == "amqp:resource-locked"
        assert sorted(take_all(active, timeout=1.0)) == sorted(sent), "every member's copy still there"
    finally:
        user.close()
        admin.close()


def test_unsubscribe_of_an_unknown_name_is_not_found_after_asking_every_node(cluster):
    conn = connect(cluster.url, container_id=uid("client"))
    try:
        with pytest.raises(LinkDetached) as refused:
            null_source_attach(conn, uid("nosuch"))
        assert "amqp:not-found" in str(refused.value)
    finally:
        conn.close()


# ------------------------------------------------------------------ shared non-durable under two topics


@pytest.mark.parametrize("global_", [False, True])
def test_a_shared_non_durable_subscription_in_use_cannot_move_to_a_topic_of_another_node(cluster, global_):
    """JMS 2.0 §6.11 (createSharedConsumer): the same name and client-id with another
    topic while a consumer is active is an error, as on one broker."""
    t1, t2 = owned_by("n1", "t", topic=True), owned_by("n2", "t", topic=True)
    sub = uid("vsub")
    first_conn = connect(cluster.url, container_id=None if global_ else uid("client"))
    second_conn = first_conn if not global_ else connect(cluster.node_url("n2"))
    try:
        first = shared_consumer(first_conn, f"amq.topic/{t1}", sub, 1, durable=False, global_=global_)
        with pytest.raises(LinkDetached) as refused:
            shared_consumer(second_conn, f"amq.topic/{t2}", sub, 2, durable=False, global_=global_)
        assert "amqp:resource-locked" in str(refused.value)
        # Publishing to t2 reaches no subscription of that name: none was made there.
        publish_spread(cluster.url, t2, links=1, per_link=2)
        publish_spread(cluster.url, t1, links=1, per_link=2)
        assert take_all(first, timeout=1.0) == [0, 1]
        # The last consumer gone, the subscription is gone: the name is free for t2.
        assert close(first_conn, first) is None
        moved = shared_consumer(second_conn, f"amq.topic/{t2}", sub, 3, durable=False, global_=global_)
        publish_spread(cluster.url, t2, links=1, per_link=3)
        assert take_all(moved, timeout=1.0) == [0, 1, 2]
    finally:
        first_conn.close()
        if second_conn is not first_conn:
            second_conn.close()


def test_a_shared_non_durable_subscription_of_the_same_topic_is_shared_across_nodes(cluster):
    """The check looks for the name elsewhere: consumers of one topic on any node share."""
    t = owned_by("n2", "t", topic=True)
    sub = uid("vsub")
    conns = [connect(cluster.node_url(n)) for n in ("n0", "n1", "n2")]
    try:
        consumers = [shared_consumer(c, f"amq.topic/{t}", sub, i + 1, durable=False, global_=True, credit=100)
                     for i, c in enumerate(conns)]
        sent = publish_spread(cluster.url, t, links=1, per_link=30)
        got = [take_all(r, timeout=1.0) for r in consumers]
        assert sorted(b for g in got for b in g) == sent
    finally:
        for c in conns:
            c.close()


def test_subscriptions_attached_at_their_topics_node_are_served_there_not_forwarded(cluster):
    """A durable or shared subscription attached at the node that owns its topic is
    checked with the other nodes first (cluster/guard.py), then attached in-process as
    alone: no forwarded link (a consumer forwarded to its own node paid for forwarding
    on every message), and it gets every message."""
    import json

    def forwarded_total() -> int:
        return json.loads(cluster.get("n2", "/api/cluster"))["forwarded"]["links_total"]

    t = owned_by("n2", "t", topic=True)
    conn = connect(cluster.node_url("n2"), container_id=uid("client"))
    try:
        before = forwarded_total()
        durable = durable_consumer(conn, f"amq.topic/{t}", uid("dsub"))
        shared = [shared_consumer(conn, f"amq.topic/{t}", uid("ssub"), 1, durable=d) for d in (True, False)]
        assert forwarded_total() == before
        sent = publish_spread(cluster.node_url("n2"), t, links=1, per_link=5)
        assert take_all(durable, timeout=1.0) == sent
        for r in shared:
            assert take_all(r, timeout=1.0) == sent
        assert forwarded_total() == before
    finally:
        conn.close()


# ------------------------------------------------------------------ a producer on an exchange without a key


def test_a_producer_on_an_exchange_without_a_key_routes_each_message_by_subject(cluster):
    k1 = next(k for k in (uid("k") for _ in range(1000)) if owned_by_key(f"routes/{k}") == "n1")
    k2 = next(k for k in (uid("k") for _ in range(1000)) if owned_by_key(f"routes/{k}") == "n2")
    conn = connect(cluster.url)
    try:
        r1 = receiver(conn, f"routes/{k1}", credit=50)
        r2 = receiver(conn, f"routes/{k2}", credit=50)
        snd = sender(conn, "routes")
        for i in range(20):
            snd.send(Message(subject=k1 if i % 2 else k2, body=i, durable=True))   # each Accepted
        unrouted = snd.send(Message(subject=uid("nobody"), body="x"))
        assert unrouted.remote_state == Delivery.ACCEPTED   # as alone: no binding, dropped, accepted
        assert drain_bodies(conn, r1) == list(range(1, 20, 2))
        assert drain_bodies(conn, r2) == list(range(0, 20, 2))
    finally:
        conn.close()


def owned_by_key(key: str) -> str:
    from amqpbroker.core.placement import slot_of
    from tests.e2e.test_cluster import OWNERS
    return OWNERS[slot_of(key)]


# ------------------------------------------------------------------ link properties


def test_a_forwarded_link_with_link_properties_is_attached_at_the_owner(cluster):
    """The client's link properties travel with the forwarded attach (the owner sees
    the link as the client made it)."""
    from tests.e2e.helpers_conn import RawClient
    q = owned_by("n1")
    client = RawClient("127.0.0.1", cluster.port, container_id=uid("props")).wait_open()
    try:
        ssn = client.session()
        rcv = ssn.receiver(uid("rcv"))
        rcv.source.address = q
        rcv.properties = {symbol("app-tag"): "x"}
        rcv.open()
        client.wait(lambda: rcv.state & Endpoint.REMOTE_ACTIVE, what="attach answered")
        assert not is_null_terminus(rcv.remote_source) and rcv.remote_source.address == q
    finally:
        client.close()
