"""End to end: `serve --workers 3` as real processes (tests/cluster_process.py); node n0
owns no slot, so everything a client of n0 does is forwarded (cluster/forward.py).

The JMS wire tests (test_consumer_close, test_shared_subscriptions, test_jms_features)
also run against such a cluster; these are what they do not cover: outcomes and
refusals made by the owner, drain, pre-settled transfers, temporary queues across
nodes, one shared subscription consumed on three nodes, and nodes killed.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from proton import Delivery, Endpoint, Message, Terminus
from proton.reactor import AtMostOnce
from proton.utils import LinkDetached, SendException

from amqpbroker.core.placement import slot_of, static_map
from tests.client import connect
from tests.cluster_process import ClusterProcess
from tests.e2e.helpers_conn import RawClient
from tests.e2e.helpers_delivery import (
    drain_bodies,
    expect_refused,
    fetch,
    nothing_arrives,
    receiver,
    sender,
    settle,
    uid,
)
from tests.e2e.jms_links import drain_bodies as take_all
from tests.e2e.jms_links import shared_consumer

pytestmark = pytest.mark.e2e

CONFIG = """
[[queue_limits]]
pattern = "full.#"
max_depth = 2
overflow = "reject"
"""
# --worker-weights 0,1,1: n1 holds slots 0-127, n2 slots 128-255.
OWNERS = static_map(["n0", "n1", "n2"], {"n0": 0, "n1": 1, "n2": 1}).owners


def owned_by(node: str, prefix: str = "q", topic: bool = False) -> str:
    """A fresh name whose owner is `node` (a topic's key is amq.topic/<name>)."""
    while True:
        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        if OWNERS[slot_of(f"amq.topic/{name}" if topic else name)] == node:
            return name


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    proc = ClusterProcess(tmp_path_factory.mktemp("cluster") / "data", config=CONFIG).start()
    yield proc
    proc.stop()


# ------------------------------------------------------------------ the owner answers


def test_a_rejection_by_the_owner_reaches_the_client_with_its_error(cluster):
    q = f"full.{uuid.uuid4().hex[:8]}"
    conn = connect(cluster.url)
    try:
        snd = sender(conn, q)
        snd.send(Message(body=1))
        snd.send(Message(body=2))
        with pytest.raises(SendException) as refused:
            snd.send(Message(body=3))
        assert refused.value.state == Delivery.REJECTED
        dlv = snd.link.unsettled if hasattr(snd.link, "unsettled") else None
        assert dlv is None or not dlv
    finally:
        conn.close()
    assert "full." in cluster.wait_for_log(r"\[n[12]\] .*message on link .* rejected: amqp:resource-limit-exceeded")


def test_a_refused_attach_is_the_owners_refusal(cluster):
    # A temporary address that no longer exists: the owner (n1, named in it) refuses.
    gone = "amqpbroker.temp-queue.n1.0123456789abcdef"
    conn = connect(cluster.url)
    try:
        refused = expect_refused(receiver, conn, gone)
        assert "amqp:not-found" in str(refused)
        assert receiver(conn, owned_by("n2"), credit=1).link.state & Endpoint.REMOTE_ACTIVE
    finally:
        conn.close()


def test_a_link_to_an_unknown_node_is_refused_unavailable(cluster):
    conn = connect(cluster.url)
    try:
        refused = expect_refused(receiver, conn, "amqpbroker.temp-queue.n7.0123456789abcdef")
        assert "amqpbroker:resource-unavailable" in str(refused) and "n7" in str(refused)
    finally:
        conn.close()


def test_the_owner_sees_the_clients_container_and_user(cluster):
    cid = uid("client")
    conn = connect(cluster.url, container_id=cid)
    try:
        receiver(conn, owned_by("n2"), credit=1)
        cluster.wait_for_log(rf"\[n2\] .*connection open: .*container={cid} user=anonymous")
    finally:
        conn.close()
    # The client's close closes its connection on the owner (normally: not "lost").
    cluster.wait_for_log(rf"\[n2\] .*connection closed: .*container={cid} \(closed by peer\)")


# ------------------------------------------------------------------ credit, drain, settlement


def test_drain_is_answered_once_the_owner_has_drained(cluster):
    q = owned_by("n1")
    conn = connect(cluster.url)
    try:
        snd = sender(conn, q)
        for i in range(3):
            snd.send(Message(body=i))
    finally:
        conn.close()
    client = RawClient("127.0.0.1", cluster.port, container_id=uid("drainer")).wait_open()
    try:
        ssn = client.session()
        rcv = ssn.receiver(uid("rcv"))
        rcv.source.address = q
        rcv.open()
        client.wait(lambda: rcv.state & Endpoint.REMOTE_ACTIVE, what="attach")
        rcv.drain(10)
        client.wait(lambda: rcv.queued == 3 and not rcv.draining(), what="the drain's answer")
        for _ in range(3):
            rcv.recv(rcv.current.pending)
            rcv.advance()
        # Answered: the unused 7 are gone (delivery-count advanced, credit 0).
        client.wait(lambda: rcv.credit == 0, what="credit used up by the drain")
        # Nothing left: a second drain is answered at once, with nothing.
        rcv.drain(5)
        client.wait(lambda: not rcv.draining() and rcv.credit == 0, what="the second drain's answer")
        assert rcv.queued == 0
    finally:
        client.close()


def test_pre_settled_both_ways(cluster):
    q = owned_by("n2")
    conn = connect(cluster.url)
    try:
        snd = conn.create_sender(q, name=uid("snd"), options=AtMostOnce())
        for i in range(5):
            snd.send(Message(body=i))
        rcv = conn.create_receiver(q, name=uid("rcv"), credit=10, options=AtMostOnce())
        got = [rcv.receive(timeout=10).body for _ in range(5)]
        assert got == list(range(5))
    finally:
        conn.close()


def test_released_by_the_client_goes_back_at_the_owner(cluster):
    q = owned_by("n1")
    conn = connect(cluster.url)
    try:
        sender(conn, q).send(Message(body="again"))
        rcv = receiver(conn, q, credit=1)
        _, dlv = fetch(conn, rcv)
        settle(dlv, Delivery.MODIFIED, failed=True)
        msg, dlv = fetch(conn, rcv)
        assert msg.body == "again" and msg.delivery_count == 1
        settle(dlv, Delivery.ACCEPTED)
        assert nothing_arrives(conn, rcv)
    finally:
        conn.close()


# ------------------------------------------------------------------ temporary queues, subscriptions


def test_temporary_queue_lives_on_the_creating_node_and_takes_replies_from_any(cluster):
    nodes = cluster.nodes()
    requester = connect(f"amqp://127.0.0.1:{nodes['n1']}")
    try:
        reply = requester.create_receiver(None, dynamic=True, credit=10)
        address = reply.link.remote_source.address
        assert ".n1." in address   # core/placement.py temp_address
        for node in ("n0", "n2"):
            responder = connect(f"amqp://127.0.0.1:{nodes[node]}")
            try:
                responder.create_sender(address).send(Message(body=f"from {node}"))
            finally:
                responder.close()
        assert sorted(reply.receive(timeout=10).body for _ in range(2)) == ["from n0", "from n2"]
        for _ in range(2):
            reply.accept()
    finally:
        requester.close()


def test_shared_durable_subscription_consumed_on_three_nodes_gets_each_message_once(cluster):
    topic, sub = owned_by("n2", "t", topic=True), uid("sub")
    nodes = cluster.nodes()
    conns = [connect(f"amqp://127.0.0.1:{nodes[n]}") for n in ("n0", "n1", "n2")]
    try:
        consumers = [shared_consumer(c, f"amq.topic/{topic}", sub, global_=True, credit=1000) for c in conns]
        pub = connect(f"amqp://127.0.0.1:{nodes['n1']}")
        snd = pub.create_sender(f"amq.topic/{topic}")
        for i in range(600):
            snd.send(Message(body=i))
        pub.close()
        got = [take_all(r, timeout=1.0) for r in consumers]
    finally:
        for c in conns:
            c.close()
    assert sorted(b for g in got for b in g) == list(range(600)), "every message exactly once"
    for share in got:
        assert abs(len(share) - 200) <= 20, f"split within 10 %: {[len(g) for g in got]}"


# ------------------------------------------------------------------ nodes killed


@pytest.fixture
def own_cluster(tmp_path):
    proc = ClusterProcess(tmp_path / "data")
    yield proc
    proc.stop()


def test_owner_killed_its_addresses_are_unavailable_until_it_is_back(own_cluster):
    cl = own_cluster.start()
    q = owned_by("n1")
    conn = connect(cl.url)
    try:
        snd = sender(conn, q)
        for i in range(10):
            snd.send(Message(body=i, durable=True))   # each Accepted after n1's commit
        rcv = receiver(conn, q, credit=0)
        mark = len(cl.lines)
        cl.kill_node("n1")
        # Detached (closed=false: a durable subscription would stay), with the reason.
        conn.wait(lambda: rcv.link.remote_condition is not None, timeout=10, msg="the forwarded link ends")
        assert rcv.link.remote_condition.name == "amqpbroker:resource-unavailable"
        refused = expect_refused(receiver, conn, q)
        assert "amqpbroker:resource-unavailable" in str(refused)
        cl.wait_nodes(after=mark)       # the supervisor starts n1 again on its store
        again = None
        for _ in range(50):
            try:
                again = receiver(conn, q, credit=20)
                break
            except LinkDetached:
                time.sleep(0.2)     # n1 is starting: its listener may not accept yet
        assert again is not None
        got = []
        for _ in range(10):
            msg, dlv = fetch(conn, again)
            settle(dlv, Delivery.ACCEPTED)
            got.append(msg.body)
        assert got == list(range(10))
    finally:
        conn.close()


def test_kill_of_a_node_that_owns_nothing_loses_nothing_accepted(own_cluster):
    cl = own_cluster.start()
    q = owned_by("n2")
    accepted: list[int] = []
    stop = threading.Event()

    def produce() -> None:
        conn = connect(cl.url)   # n0: every send forwarded to n2
        snd = sender(conn, q)
        i = 0
        try:
            while not stop.is_set():
                snd.send(Message(body=i, durable=True))   # returns once Accepted
                accepted.append(i)
                i += 1
        except Exception:
            pass   # n0 went away under us

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while len(accepted) < 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    cl.kill_node("n0")
    t.join(15)
    stop.set()
    assert len(accepted) >= 200
    conn = connect(cl.node_url("n2"))
    try:
        rcv = receiver(conn, q, credit=500)
        got = drain_bodies(conn, rcv, timeout=2.0)
    finally:
        conn.close()
    missing = set(accepted) - set(got)
    assert not missing, f"{len(missing)} accepted messages lost"


# ------------------------------------------------------------------ per message: the anonymous relay


def test_anonymous_relay_sends_each_message_to_the_owner_of_its_to_in_order(cluster):
    q1, q2 = owned_by("n1"), owned_by("n2")
    conn = connect(cluster.url)
    try:
        relay = conn.create_sender(None, name=uid("relay"))
        for i in range(20):
            relay.send(Message(address=q1 if i % 2 else q2, body=i, durable=True))   # each Accepted
        got = {}
        for q in (q1, q2):
            rcv = receiver(conn, q, credit=20)
            got[q] = drain_bodies(conn, rcv)
    finally:
        conn.close()
    assert got[q1] == list(range(1, 20, 2)) and got[q2] == list(range(0, 20, 2))


def test_relay_outcomes_keep_the_producers_order_across_owners(cluster):
    """Unsettled sends to two owners and one refused: the dispositions come back in
    the order the messages went (Qpid JMS completes async sends in that order)."""
    q1, q2 = owned_by("n1"), owned_by("n2")
    client = RawClient("127.0.0.1", cluster.port, container_id=uid("async")).wait_open()
    try:
        ssn = client.session()
        snd = client.sender(ssn, None, uid("relay"))
        client.wait(lambda: snd.credit > 0, what="credit")
        order = []
        targets = [q1, q2, "amqpbroker.temp-queue.n7.00", q1, q2]
        dlvs = []
        for i, to in enumerate(targets):
            dlv = snd.delivery(f"d{i}")
            snd.stream(Message(address=to, body=i).encode())
            snd.advance()
            dlvs.append(dlv)

        def settled_in_order() -> bool:
            for i, d in enumerate(dlvs):
                if d.remote_state and i not in order:
                    order.append(i)
            return len(order) == len(dlvs)

        client.wait(settled_in_order, what="every outcome")
        assert order == [0, 1, 2, 3, 4]
        states = [d.remote_state for d in dlvs]
        assert states == [Delivery.ACCEPTED, Delivery.ACCEPTED, Delivery.REJECTED, Delivery.ACCEPTED,
                          Delivery.ACCEPTED]
        assert dlvs[2].remote.condition.name == "amqpbroker:resource-unavailable"
    finally:
        client.close()


def test_no_local_holds_across_nodes(cluster):
    """The publisher's container-id reaches the topic's node with its messages (its
    connection there carries it), wherever the publisher is connected."""
    topic = owned_by("n2", "t", topic=True)
    nodes = cluster.nodes()
    cid = uid("app")
    sub_conn = connect(f"amqp://127.0.0.1:{nodes['n0']}", container_id=cid)
    other = connect(f"amqp://127.0.0.1:{nodes['n1']}")
    try:
        from tests.e2e.jms_links import topic_consumer
        rcv = topic_consumer(sub_conn, topic, no_local=True)
        sub_conn.create_sender(f"amq.topic/{topic}", name=uid("own")).send(Message(body="mine"))
        other.create_sender(f"amq.topic/{topic}", name=uid("other")).send(Message(body="theirs"))
        assert take_all(rcv, timeout=1.0) == ["theirs"]
    finally:
        sub_conn.close()
        other.close()


# ------------------------------------------------------------------ transactions


def txn_client(port: int):
    from tests.e2e.jms_txn import TxnSession
    client = RawClient("127.0.0.1", port, container_id=uid("txn")).wait_open()
    return client, TxnSession(client)


def test_a_transaction_on_one_other_node_commits_there(cluster):
    q = owned_by("n2")
    client, s = txn_client(cluster.port)
    try:
        snd = s.sender(q)
        txn = s.declare()
        assert all(s.send(snd, i, txn).remote_state == 0x34 for i in range(3))
        assert s.discharge(txn).remote_state == Delivery.ACCEPTED
    finally:
        client.close()
    conn = connect(cluster.url)
    try:
        assert drain_bodies(conn, receiver(conn, q, credit=10)) == [0, 1, 2]
    finally:
        conn.close()


def test_a_transaction_spanning_two_nodes_is_refused_naming_both_addresses(cluster):
    q1, q2 = owned_by("n1"), owned_by("n2")
    client, s = txn_client(cluster.port)
    try:
        a, b = s.sender(q1), s.sender(q2)
        txn = s.declare()
        assert s.send(a, "one", txn).remote_state == 0x34
        spanning = s.send(b, "two", txn)
        assert spanning.remote_state == Delivery.REJECTED
        cond = spanning.remote.condition
        assert cond.name == "amqp:transaction:rollback" and q1 in cond.description and q2 in cond.description
        outcome = s.discharge(txn)
        assert outcome.remote_state == Delivery.REJECTED
        assert outcome.remote.condition.name == "amqp:transaction:rollback"
        assert q1 in outcome.remote.condition.description and q2 in outcome.remote.condition.description
        # The session goes on: the next transaction may use either node.
        txn2 = s.declare()
        assert s.send(b, "three", txn2).remote_state == 0x34
        assert s.discharge(txn2).remote_state == Delivery.ACCEPTED
    finally:
        client.close()
    conn = connect(cluster.url)
    try:
        assert drain_bodies(conn, receiver(conn, q1, credit=10)) == [], "the refused transaction left nothing"
        assert drain_bodies(conn, receiver(conn, q2, credit=10)) == ["three"]
    finally:
        conn.close()


def test_a_transaction_with_work_here_and_on_another_node_is_refused_at_commit(cluster):
    here, there = owned_by("n1"), owned_by("n2")
    client, s = txn_client(cluster.nodes()["n1"])   # connected to n1: `here` is local
    try:
        a, b = s.sender(there), s.sender(here)
        txn = s.declare()
        assert s.send(a, "remote", txn).remote_state == 0x34
        assert s.send(b, "local", txn).remote_state == 0x34   # staged here, before anyone can tell
        outcome = s.discharge(txn)
        assert outcome.remote_state == Delivery.REJECTED
        desc = outcome.remote.condition.description
        assert here in desc and there in desc
    finally:
        client.close()
    conn = connect(cluster.url)
    try:
        for q in (here, there):
            assert drain_bodies(conn, receiver(conn, q, credit=10)) == []
    finally:
        conn.close()


# ------------------------------------------------------------------ client-ids


def test_sole_connection_for_container_holds_across_nodes(cluster):
    """Qpid JMS desires sole-connection-for-container: a second connection with the
    same client-id is refused (InvalidClientIDException's shape) whichever node it
    reaches, and the client-id is free again once the first one closes."""
    from amqpbroker.core.placement import client_home
    slots = static_map(["n0", "n1", "n2"], {"n0": 0, "n1": 1, "n2": 1})
    nodes = cluster.nodes()
    for home in ("n1", "n2"):
        cid = next(c for c in (uid("app") for _ in range(1000)) if client_home(c, slots) == home)
        first = RawClient("127.0.0.1", nodes["n0"], container_id=cid,
                          desired_capabilities=["sole-connection-for-container"]).wait_open()
        try:
            for node in ("n0", "n1", "n2"):
                second = RawClient("127.0.0.1", nodes[node], container_id=cid,
                                   desired_capabilities=["sole-connection-for-container"])
                second.wait(lambda: second.conn.state & Endpoint.REMOTE_CLOSED, what="refusal")
                props = second.conn.remote_properties or {}
                assert props.get("amqp:connection-establishment-failed") is True, node
                assert second.conn.remote_condition.name == "amqp:invalid-field"
                second.close()
        finally:
            first.close()
        # Free again once the first is gone (its claim on the home node went with it).
        again = None
        for _ in range(50):
            again = RawClient("127.0.0.1", nodes["n0"], container_id=cid,
                              desired_capabilities=["sole-connection-for-container"])
            again.wait(lambda: again.conn.state & (Endpoint.REMOTE_ACTIVE | Endpoint.REMOTE_CLOSED), what="open")
            if not again.conn.state & Endpoint.REMOTE_CLOSED:
                break
            again.close()
            time.sleep(0.1)   # the home node may not have seen the first claim's close yet
        assert again.conn.state & Endpoint.REMOTE_ACTIVE and not again.conn.state & Endpoint.REMOTE_CLOSED
        again.close()


def test_a_claimed_connections_pipelined_frames_wait_for_the_grant(cluster):
    """Begin and attach sent right after the open (before the grant arrives) are
    handled once it has."""
    from amqpbroker.core.placement import client_home
    slots = static_map(["n0", "n1", "n2"], {"n0": 0, "n1": 1, "n2": 1})
    cid = next(c for c in (uid("app") for _ in range(1000)) if client_home(c, slots) == "n2")
    q = owned_by("n1")
    client = RawClient("127.0.0.1", cluster.port, container_id=cid,
                       desired_capabilities=["sole-connection-for-container"])
    try:
        ssn = client.conn.session()
        ssn.open()
        rcv = ssn.receiver(uid("rcv"))
        rcv.source.address = q
        rcv.open()
        client.wait(lambda: rcv.state & Endpoint.REMOTE_ACTIVE, what="attach answered after the grant")
        assert client.conn.state & Endpoint.REMOTE_ACTIVE
    finally:
        client.close()


# ------------------------------------------------------------------ partitioned destinations

PARTITIONED = """
[cluster]
partitioned = [{address = "porders", members = 2}, {address = "pprices", members = 2, topic = true}]
"""


@pytest.fixture(scope="module")
def partitioned(tmp_path_factory):
    proc = ClusterProcess(tmp_path_factory.mktemp("partitioned") / "data", config=PARTITIONED).start()
    yield proc
    proc.stop()


def member_bodies(cluster, address: str) -> list:
    conn = connect(cluster.url)
    try:
        return drain_bodies(conn, receiver(conn, address, credit=500), timeout=1.0)
    finally:
        conn.close()


def test_partitioned_queue_keeps_each_group_on_one_member_in_order(partitioned):
    conn = connect(partitioned.url)
    try:
        snd = sender(conn, "porders")
        for i in range(120):
            snd.send(Message(body=[f"g{i % 6}", i], group_id=f"g{i % 6}", durable=True))
    finally:
        conn.close()
    members = {m: member_bodies(partitioned, m) for m in ("porders.p0", "porders.p1")}
    assert sorted(i for got in members.values() for _, i in got) == list(range(120))
    for got in members.values():
        groups = {g for g, _ in got}
        for g in groups:
            seq = [i for gg, i in got if gg == g]
            assert seq == sorted(seq) and len(seq) == 20, f"group {g} whole and in order on one member"
    assert all(members.values()), "groups spread over both members"


def test_a_producer_without_groups_sticks_to_one_member_and_a_consumer_reads_all(partitioned):
    conn = connect(partitioned.url)
    try:
        for link in range(6):
            snd = sender(conn, "porders")
            for i in range(10):
                snd.send(Message(body=[link, i]))
            snd.close()
        got = drain_bodies(conn, receiver(conn, "porders", credit=100), timeout=1.0)   # fan-in
    finally:
        conn.close()
    assert sorted(tuple(b) for b in got) == [(link, i) for link in range(6) for i in range(10)]
    for link in range(6):
        assert [i for lk, i in got if lk == link] == list(range(10)), "each producer's order holds"


def test_one_shared_subscription_on_a_partitioned_topic_across_nodes_gets_each_message_once(partitioned):
    nodes = partitioned.nodes()
    sub = uid("psub")
    conns = [connect(f"amqp://127.0.0.1:{nodes[n]}") for n in ("n0", "n1", "n2")]
    try:
        consumers = [shared_consumer(c, "pprices", sub, global_=True, credit=500) for c in conns]
        pub = connect(partitioned.url)
        for link in range(4):   # four producer links: sticky members spread
            snd = pub.create_sender("amq.topic/pprices", name=uid("pub"))
            for i in range(100):
                snd.send(Message(body=link * 1000 + i))
        pub.close()
        got = [take_all(r, timeout=1.5) for r in consumers]
    finally:
        for c in conns:
            c.close()
    everything = sorted(b for g in got for b in g)
    assert everything == sorted(link * 1000 + i for link in range(4) for i in range(100)), "exactly once"
    assert all(got), f"every consumer took a share: {[len(g) for g in got]}"


# ------------------------------------------------------------------ placement redirects


def test_redirect_sends_an_open_to_its_client_ids_home_node(tmp_path):
    from amqpbroker.core.placement import client_home
    cl = ClusterProcess(tmp_path / "data", config="[cluster]\nredirect = true\n").start()
    try:
        slots = static_map(["n0", "n1", "n2"], {"n0": 0, "n1": 1, "n2": 1})
        cid = next(c for c in (uid("app") for _ in range(1000)) if client_home(c, slots) == "n2")
        nodes = cl.nodes()
        client = RawClient("127.0.0.1", nodes["n0"], container_id=cid)
        client.wait(lambda: client.conn.state & Endpoint.REMOTE_CLOSED, what="redirect")
        cond = client.conn.remote_condition
        assert cond.name == "amqp:connection:redirect"
        assert cond.info["network-host"] == "127.0.0.1" and cond.info["port"] == nodes["n2"]
        client.close()
        home = RawClient("127.0.0.1", nodes["n2"], container_id=cid).wait_open()
        assert not home.conn.state & Endpoint.REMOTE_CLOSED
        home.close()
    finally:
        cl.stop()
