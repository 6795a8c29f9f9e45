"""End to end: per-message routing and JMS rules across the nodes of
`serve --workers 3` (tests/cluster_process.py; node n0 owns no slot): the anonymous
relay, no-local, transactions on one node and across nodes, client-ids held
cluster-wide, partitioned destinations and placement redirects."""

from __future__ import annotations

import json
import re
import time

import pytest
from proton import Delivery, Endpoint, Message
from proton.utils import LinkDetached, SendException

from amqpbroker.cluster.partitioned import member_of
from amqpbroker.core.placement import static_map
from tests.client import connect
from tests.cluster_process import ClusterProcess
from tests.e2e.helpers_conn import RawClient
from tests.e2e.helpers_delivery import drain_bodies, receiver, send_bodies, sender, uid
from tests.e2e.jms_links import drain_bodies as take_all
from tests.e2e.jms_links import shared_consumer
from tests.e2e.test_cluster import LIMITS as CONFIG, owned_by   # connections handed off (the default)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    proc = ClusterProcess(tmp_path_factory.mktemp("cluster-jms") / "data", config=CONFIG).start()
    yield proc
    proc.stop()


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
handoff = false   # each client stays at the node it connects to (tests/e2e/test_cluster_handoff.py deals them)
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


@pytest.mark.parametrize("name", ["porders.p2", "amq.topic/pprices.p5"])
def test_a_member_name_the_destination_does_not_have_takes_no_producer_naming_the_destination(partitioned, name):
    """Such a queue is a member dropped from the configuration: the shovel moves what it
    holds into member 0, so a message sent to it would never reach a consumer of that
    name.  Before, a send to `porders.p2` was Accepted and turned up in `porders.p0`.
    A consumer may still attach (it reads what is left), as the anonymous relay's
    messages to the name are refused too."""
    base = name.rpartition(".p")[0]
    refused = f"amqp:not-found.*'{re.escape(name)}' is not a member of partitioned '{re.escape(base)}' \\(2 members\\)"
    for node in ("n0", "n1", "n2"):
        conn = connect(partitioned.node_url(node))
        try:
            with pytest.raises(LinkDetached, match=refused):
                sender(conn, name)
            receiver(conn, name).close()
            relay = sender(conn, None)
            with pytest.raises(SendException):
                relay.send(Message(address=name, body="to a dropped member"))
        finally:
            conn.close()
    assert not [b for b in member_bodies(partitioned, "porders.p0") if b == "to a dropped member"]


def test_a_name_that_only_looks_like_a_member_is_an_ordinary_queue(partitioned):
    """`porders.p²`: `²` passed str.isdigit and failed int(); the node closed the
    client's connection with amqp:internal-error and logged a traceback."""
    name = "porders.p\u00b2"
    conn = connect(partitioned.node_url("n0"))
    try:
        send_bodies(conn, name, ["superscript"])
        assert drain_bodies(conn, receiver(conn, name), timeout=1.0) == ["superscript"]
    finally:
        conn.close()
    assert "Traceback" not in partitioned.log_text()


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


def members(cluster, address: str) -> list[tuple[str, str]]:
    """(member address, node) of each member of `address`, in member order."""
    view = json.loads(cluster.get("n1", "/api/cluster"))
    found = [[(m["address"], m["node"]) for m in p["members"]] for p in view["partitioned"]
             if p["address"].rsplit("/", 1)[-1] == address]   # a topic's key: its exchange/name
    assert len(found) == 1, view["partitioned"]
    return found[0]


def porders_members(cluster) -> tuple[tuple[str, str], tuple[str, str], str]:
    """`porders`'s member on a node that owns one (n1 or n2; n0 owns nothing), the other
    member, each as (address, node), and a group that belongs to the other member."""
    found = members(cluster, "porders")
    here = next(i for i, (_, node) in enumerate(found) if node != "n0")
    group = next(g for g in (f"g{i}" for i in range(100)) if member_of(g, here, 2) == 1 - here)
    return found[here], found[1 - here], group


def forwarding_at(cluster, node: str) -> dict:
    return json.loads(cluster.get(node, "/api/cluster"))["forwarded"]


def test_a_producer_at_a_members_node_is_served_in_process_and_a_group_goes_to_its_member(partitioned):
    """A producer attached at a node that owns a member: its messages without a group go
    to that member in this process (no inter-node connection, no forwarded link), in
    order; a message whose group belongs to the other member goes to that member's node."""
    (own, node), (other, other_node), group = porders_members(partitioned)
    before = forwarding_at(partitioned, node)
    conn = connect(partitioned.node_url(node))
    try:
        snd = sender(conn, "porders")
        for i in range(30):
            snd.send(Message(body=["own", i], durable=True))   # each Accepted (after the commit)
        during = forwarding_at(partitioned, node)
        for i in range(5):
            snd.send(Message(body=["group", i], group_id=group, durable=True))
        after = forwarding_at(partitioned, node)
    finally:
        conn.close()
    assert during["connections"] == 0 and during["links_total"] == before["links_total"], \
        f"served in-process, not through an inter-node connection: {before} -> {during}"
    assert after["connections"] == 1, f"the group's member reached on node {other_node}: {after}"
    assert member_bodies(partitioned, own) == [["own", i] for i in range(30)]
    assert member_bodies(partitioned, other) == [["group", i] for i in range(5)]


def test_transactions_through_a_producer_at_a_members_node_commit_there_and_never_span_nodes(partitioned):
    """The in-process producer's transactional sends are staged on the node's own member
    and committed there; one that also sends a group of the other member's node spans
    two nodes and is rolled back whole (cluster/txn.py, as for the anonymous relay)."""
    (own, node), (other, _), group = porders_members(partitioned)
    client, s = txn_client(partitioned.nodes()[node])
    try:
        snd = s.sender("porders")
        txn = s.declare()
        assert all(s.send(snd, i, txn).remote_state == 0x34 for i in range(3))
        assert s.discharge(txn).remote_state == Delivery.ACCEPTED
        spanning = s.declare()
        assert s.send(snd, "local", spanning).remote_state == 0x34
        s.send(snd, "remote", spanning, group_id=group)   # refused now or at the commit
        outcome = s.discharge(spanning)
        assert outcome.remote_state == Delivery.REJECTED
        assert outcome.remote.condition.name == "amqp:transaction:rollback"
    finally:
        client.close()
    assert member_bodies(partitioned, own) == [0, 1, 2], "committed on the own member; the spanning one left nothing"
    assert member_bodies(partitioned, other) == []


def test_a_producer_served_at_its_members_node_needs_the_members_permission_too(tmp_path):
    """In-process, the member is checked as its own node checks a forwarded producer:
    a grant on the one name alone is refused at the attach, naming the member."""
    config = PARTITIONED + '[anonymous]\npermissions = ["send", "consume"]\npattern = "porders"\n'
    cl = ClusterProcess(tmp_path / "data", config=config).start()
    try:
        conn = connect(cl.node_url("n1"))   # n1 and n2 own the two members
        try:
            with pytest.raises(LinkDetached) as refused:
                conn.create_sender("porders", name=uid("snd"))
        finally:
            conn.close()
    finally:
        cl.stop()
    assert "amqp:unauthorized-access" in str(refused.value) and "porders.p" in str(refused.value)


def test_one_shared_subscription_on_a_partitioned_topic_across_nodes_gets_each_message_once(partitioned):
    """One shared subscription, a consumer at each of three nodes (two own a member of
    the topic, one owns none) and a producer at each node.  A producer at a member's node
    publishes to that member; the one at the third node to a member of its choice
    (cluster/partitioned.py), so both members get messages.  Every message reaches exactly
    one consumer; a consumer at a member's node reads its own member first (the other
    member sees it as a standby, cluster/fanin.py), so it takes nothing the producer at
    the other member's node published while its own consumers had credit; the consumer
    at the third node reads both members."""
    nodes = partitioned.nodes()
    member_nodes = {node for _, node in members(partitioned, "pprices")}
    assert len(member_nodes) == 2, member_nodes
    sub = uid("psub")
    order = ("n0", "n1", "n2")
    conns = [connect(f"amqp://127.0.0.1:{nodes[n]}") for n in order]
    try:
        consumers = [shared_consumer(c, "pprices", sub, global_=True, credit=500) for c in conns]
        for k, node in enumerate(order):   # one producer link at each node
            pub = connect(f"amqp://127.0.0.1:{nodes[node]}")
            snd = pub.create_sender("amq.topic/pprices", name=uid("pub"))
            for i in range(100):
                snd.send(Message(body=k * 1000 + i))
            pub.close()
        got = [take_all(r, timeout=1.5) for r in consumers]
    finally:
        for c in conns:
            c.close()
    everything = sorted(b for g in got for b in g)
    assert everything == sorted(k * 1000 + i for k in range(3) for i in range(100)), "exactly once"
    assert all(got), f"every consumer took a share: {[len(g) for g in got]}"
    for k, node in enumerate(order):
        other = next((order.index(m) for m in member_nodes if m != node), None)
        if node in member_nodes:
            assert not [b for b in got[k] if b // 1000 == other], \
                f"the consumer at {node} took the other member's messages: {[len(g) for g in got]}"


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
