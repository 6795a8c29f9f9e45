"""End to end: a client connection handed, socket and all, to the worker that owns its
first link's address (cluster/handoff.py), against `serve --workers 3` (n0 owns no
slot: every first link of a client of n0 is another node's).

How it could fail, and the test for each: a client that waited for the Open's answer
gets the answers twice or not at all (it must see exactly one Open, one Begin, one
Attach answer and go on); a pipelining client (Open, Begin, Attach in one write) gets
nothing; the owner sees another user than the one that authenticated (SASL is done by
the first node); later links to a third node break; a connection that must stay
(a client-id held elsewhere, a heartbeat already sent, TLS) is moved anyway; a lost
hand-off socket loses the client."""

from __future__ import annotations

import json

import pytest
from proton import Delivery, Endpoint, Message

from amqpbroker.cluster.router import NODE_LISTENER
from tests.client import connect
from tests.cluster_process import ClusterProcess
from tests.e2e.helpers_conn import REMOTE_ACTIVE, RawClient
from tests.e2e.helpers_delivery import drain_bodies, receiver, sender, uid
from tests.e2e.test_cluster import owned_by
from tests.e2e.test_cluster_jms import members

pytestmark = pytest.mark.e2e

CONFIG = """
[users.alice]
password = "alice-secret-1"

[cluster]
partitioned = [{address = "horders", members = 2}]
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    proc = ClusterProcess(tmp_path_factory.mktemp("cluster-handoff") / "data", config=CONFIG).start()
    yield proc
    proc.stop()


def handoff(cluster, node: str) -> dict:
    return json.loads(cluster.get(node, "/api/cluster"))["handoff"]


def connections(cluster, node: str) -> list[dict]:
    return json.loads(cluster.get(node, "/api/connections"))


def test_a_client_that_waits_for_open_is_handed_to_its_first_links_owner(cluster):
    q = owned_by("n1")
    before = handoff(cluster, "n0")["handed_total"], handoff(cluster, "n1")["adopted_total"]
    cid = uid("waiting")
    conn = connect(cluster.url, container_id=cid)   # BlockingConnection: waits for the Open's answer
    try:
        snd = sender(conn, q)
        for i in range(10):
            snd.send(Message(body=i, durable=True))    # each Accepted by n1 after its commit
        assert drain_bodies(conn, receiver(conn, q, credit=20)) == list(range(10))
        assert [c["container_id"] for c in connections(cluster, "n1")].count(cid) == 1
        assert cid not in [c["container_id"] for c in connections(cluster, "n0")]
    finally:
        conn.close()
    after = handoff(cluster, "n0")["handed_total"], handoff(cluster, "n1")["adopted_total"]
    assert after == (before[0] + 1, before[1] + 1)
    from tests.e2e.test_cluster_ops import metric
    assert metric(cluster.get("n0", "/metrics"), "amqpbroker_cluster_connections_handed_off_total") == after[0]
    assert metric(cluster.get("n1", "/metrics"), "amqpbroker_cluster_connections_adopted_total") == after[1]


@pytest.mark.parametrize("sasl", ["ANONYMOUS", None])
def test_a_pipelining_client_is_answered_by_the_owner_alone(cluster, sasl):
    """Open, Begin and Attach in one write (after SASL, or without it, as the C load
    tool): the first node answers nothing."""
    q = owned_by("n2")
    before = handoff(cluster, "n0")["handed_total"]
    client = RawClient("127.0.0.1", cluster.port, container_id=uid("pipelined"), open=False, sasl_mechs=sasl)
    try:
        client.conn.open()
        ssn = client.conn.session()
        ssn.open()
        snd = ssn.sender(uid("snd"))
        snd.target.address = q
        snd.open()
        client.wait(lambda: snd.state & REMOTE_ACTIVE and snd.credit > 0, what="attach and credit")
        dlv = snd.delivery("t1")
        snd.stream(Message(body="x", durable=True).encode())
        snd.advance()
        client.wait(lambda: dlv.remote_state, what="the owner's outcome")
        assert dlv.remote_state == Delivery.ACCEPTED
        opens = [e for e in client.events if e == "PN_CONNECTION_REMOTE_OPEN"]
        begins = [e for e in client.events if e == "PN_SESSION_REMOTE_OPEN"]
        assert len(opens) == 1 and len(begins) == 1
    finally:
        client.close()
    assert handoff(cluster, "n0")["handed_total"] == before + 1


def test_a_client_that_waits_for_open_and_begin_sees_each_answer_once(cluster):
    """Qpid JMS's order: Open, wait; Begin, wait; Attach."""
    q = owned_by("n1")
    client = RawClient("127.0.0.1", cluster.port, container_id=uid("jms-order")).wait_open()
    before = handoff(cluster, "n0")["handed_total"]
    try:
        ssn = client.session()
        rcv = client.receiver(ssn, q, uid("rcv"))
        assert rcv.state & REMOTE_ACTIVE and rcv.remote_source.address == q
        assert handoff(cluster, "n0")["handed_total"] == before + 1
        rcv.flow(5)
        client.pump_for(0.3)
        assert client.events.count("PN_CONNECTION_REMOTE_OPEN") == 1
        assert client.events.count("PN_SESSION_REMOTE_OPEN") == 1
        assert client.events.count("PN_LINK_REMOTE_OPEN") == 1
        assert not client.conn.state & Endpoint.REMOTE_CLOSED
    finally:
        client.close()


def test_the_owner_sees_the_user_that_authenticated_at_the_first_node(cluster):
    q = owned_by("n2")
    cid = uid("alice")
    conn = connect(cluster.url, container_id=cid, user="alice", password="alice-secret-1",
                   allowed_mechs="PLAIN")
    try:
        sender(conn, q).send(Message(body="from alice"))
        mine = [c for c in connections(cluster, "n2") if c["container_id"] == cid]
        assert [c["user"] for c in mine] == ["alice"]
    finally:
        conn.close()


def test_later_links_of_a_handed_off_connection_to_a_third_node_are_forwarded(cluster):
    first, other = owned_by("n1"), owned_by("n2")
    conn = connect(cluster.url, container_id=uid("two-owners"))
    try:
        sender(conn, first).send(Message(body="a"))      # handed to n1
        sender(conn, other).send(Message(body="b"))      # forwarded by n1 to n2
        assert drain_bodies(conn, receiver(conn, other, credit=5)) == ["b"]
        assert drain_bodies(conn, receiver(conn, first, credit=5)) == ["a"]
    finally:
        conn.close()


def test_a_client_id_held_at_another_node_stays_and_is_forwarded(cluster):
    from amqpbroker.core.placement import client_home, static_map
    slots = static_map(["n0", "n1", "n2"], {"n0": 0, "n1": 1, "n2": 1})
    cid = next(c for c in (uid("app") for _ in range(1000)) if client_home(c, slots) == "n2")
    q = owned_by("n1")
    before = handoff(cluster, "n0")["handed_total"]
    conn = connect(cluster.url, container_id=cid, desired_capabilities=["sole-connection-for-container"])
    try:
        sender(conn, q).send(Message(body="held"))
        assert drain_bodies(conn, receiver(conn, q, credit=5)) == ["held"]
        assert cid in [c["container_id"] for c in connections(cluster, "n0")], "still on n0"
    finally:
        conn.close()
    assert handoff(cluster, "n0")["handed_total"] == before


def test_a_connection_that_was_sent_a_heartbeat_stays(cluster):
    """A heartbeat written before the first attach is not produced by a replay: such a
    connection is forwarded, never handed off."""
    q = owned_by("n1")
    before = handoff(cluster, "n0")["handed_total"]
    client = RawClient("127.0.0.1", cluster.port, container_id=uid("idle"), idle_timeout=0.4).wait_open()
    try:
        client.pump_for(1.0)   # the broker sends empty frames at half the client's idle timeout
        ssn = client.session()
        snd = client.sender(ssn, q, uid("snd"))
        assert snd.state & REMOTE_ACTIVE
    finally:
        client.close()
    assert handoff(cluster, "n0")["handed_total"] == before


def test_a_connection_whose_first_link_is_local_stays(cluster):
    q = owned_by("n1")
    before = handoff(cluster, "n1")["handed_total"]
    conn = connect(cluster.node_url("n1"))
    try:
        sender(conn, q).send(Message(body="local"))
    finally:
        conn.close()
    assert handoff(cluster, "n1")["handed_total"] == before


def test_many_connections_on_the_shared_port_each_served_by_its_owner(cluster):
    """Connections land on any node (SO_REUSEPORT): each is served whole by its queue's
    owner, or stays where it is its own."""
    queues = [owned_by("n1"), owned_by("n2")]
    url = f"amqp://127.0.0.1:{cluster.shared_port}"
    for i in range(12):
        q = queues[i % 2]
        conn = connect(url, container_id=uid("shared"))
        try:
            sender(conn, q).send(Message(body=i, durable=True))
        finally:
            conn.close()
    got = []
    for q in queues:
        conn = connect(url)
        try:
            got += drain_bodies(conn, receiver(conn, q, credit=20))
        finally:
            conn.close()
    assert sorted(got) == list(range(12))


def where_served(cluster, cids: list[str]) -> list[str]:
    """The node each container-id's client connection is served at (a node's links to
    another member carry the client's container-id too, on its inter-node listener)."""
    at = {c["container_id"]: node for node in ("n0", "n1", "n2") for c in connections(cluster, node)
          if c["listener"] != NODE_LISTENER}
    return [at.get(cid, "?") for cid in cids]


def test_connections_of_a_partitioned_queue_are_dealt_over_its_members_nodes(cluster):
    """A partitioned queue (members at n1 and n2; n0 owns nothing).  Four consumer and
    four producer connections that all land on n0 are dealt over the members' nodes in turn (consumers and
    producers counted apart, core/handoff.py spread_owner); three consumers that land on
    n1 stay, go to n2, stay.  Then every producer writes to its node's own member and
    every consumer reads its own member first: each message once, each consumer a share."""
    a, b = [node for _, node in members(cluster, "horders")]
    assert {a, b} == {"n1", "n2"}
    before = handoff(cluster, "n0")["handed_total"], handoff(cluster, "n1")["handed_total"]
    held, consumers, consumer_ids = [], [], []
    try:
        for url in [cluster.node_url("n0")] * 4 + [cluster.node_url("n1")] * 3:
            cid = uid("hcons")
            conn = connect(url, container_id=cid)
            held.append(conn)
            consumers.append(receiver(conn, "horders", credit=200))
            consumer_ids.append(cid)
        served = where_served(cluster, consumer_ids)
        assert served == [a, b, a, b, "n1", "n2", "n1"], served
        producer_ids, producers = [], []
        for k in range(4):
            cid = uid("hprod")
            conn = connect(cluster.node_url("n0"), container_id=cid)
            held.append(conn)
            producers.append(sender(conn, "horders"))
            producer_ids.append(cid)
        assert where_served(cluster, producer_ids) == [a, b, a, b]
        for k, snd in enumerate(producers):
            for i in range(50):
                snd.send(Message(body=k * 1000 + i, durable=True))
        got = [drain_bodies(c, r, timeout=1.0) for c, r in zip(held, consumers)]   # the consumers' own
    finally:
        for conn in held:
            conn.close()
    assert sorted(b for g in got for b in g) == sorted(k * 1000 + i for k in range(4) for i in range(50))
    assert all(got), f"every consumer took a share: {[len(g) for g in got]}"
    after = handoff(cluster, "n0")["handed_total"], handoff(cluster, "n1")["handed_total"]
    assert after == (before[0] + 8, before[1] + 1)


def test_with_handoff_off_the_connection_stays_and_its_links_are_forwarded(tmp_path_factory):
    proc = ClusterProcess(tmp_path_factory.mktemp("cluster-no-handoff") / "data",
                          config="[cluster]\nhandoff = false\n").start()
    try:
        assert json.loads(proc.get("n0", "/api/cluster"))["handoff"] is None
        q = owned_by("n1")
        cid = uid("stays")
        conn = connect(proc.url, container_id=cid)
        try:
            sender(conn, q).send(Message(body="fwd", durable=True))
            assert drain_bodies(conn, receiver(conn, q, credit=5)) == ["fwd"]
            assert cid in [c["container_id"] for c in json.loads(proc.get("n0", "/api/connections"))]
            assert json.loads(proc.get("n0", "/api/cluster"))["forwarded"]["links_total"] >= 2
        finally:
            conn.close()
    finally:
        proc.stop()


def test_kill_of_the_owner_of_a_handed_off_connection_loses_nothing_accepted(tmp_path):
    """The owner holds the client's socket itself: kill -9 of it ends the connection
    (the client's failover reconnects), and every message it accepted is there once the
    node is back."""
    import time

    from proton import ConnectionException
    from proton.utils import LinkDetached

    proc = ClusterProcess(tmp_path / "data").start()
    try:
        q = owned_by("n1")
        conn = connect(proc.url, container_id=uid("killed-owner"))
        accepted = []
        try:
            snd = sender(conn, q)
            for i in range(20):
                snd.send(Message(body=i, durable=True))   # returns once Accepted (after n1's commit)
                accepted.append(i)
            assert handoff(proc, "n0")["handed_total"] == 1
            mark = len(proc.lines)
            proc.kill_node("n1")
            with pytest.raises(Exception):   # the connection ends with its owner (whatever the client calls it)
                for i in range(20, 10_000):
                    snd.send(Message(body=i, durable=True), timeout=10)
                    accepted.append(i)
        finally:
            try:
                conn.close()
            except Exception:   # noqa: BLE001 - already gone with its owner
                pass
        proc.wait_nodes(after=mark)
        got = None
        for _ in range(50):
            again = connect(proc.url)
            try:
                got = drain_bodies(again, receiver(again, q, credit=len(accepted) + 100))
                break
            except (ConnectionException, LinkDetached):
                time.sleep(0.2)   # n1 is starting
            finally:
                again.close()
        assert got is not None
        assert set(accepted) <= set(got), f"lost: {sorted(set(accepted) - set(got))[:10]}"
        assert len(got) == len(set(got))
    finally:
        proc.stop()


def test_a_partitioned_consumer_dealt_to_a_paused_members_node_is_served_once_it_wakes(tmp_path):
    """SIGSTOP of the node whose turn a consumer connection is: the socket waits in the
    hand-off queue of the stopped node and is adopted when it wakes (SIGCONT): the
    consumer is served there, reads its own member's messages, and the connection that
    stayed reads its own."""
    import os
    import signal
    import threading

    cl = ClusterProcess(tmp_path / "data", config='[cluster]\npartitioned = [{address = "porders2", members = 2}]\n')
    cl.start()
    try:
        a, b = [node for _, node in members(cl, "porders2")]
        first = connect(cl.node_url(a), container_id=uid("first"))
        kept = receiver(first, "porders2", credit=50)           # a's first: stays at a
        dealt_id, dealt = uid("dealt"), {}
        os.kill(cl.worker_pid(b), signal.SIGSTOP)
        try:
            def attach() -> None:
                conn = connect(cl.node_url(a), container_id=dealt_id)
                dealt["conn"], dealt["rcv"] = conn, receiver(conn, "porders2", credit=50)   # a's second: b's turn
            thread = threading.Thread(target=attach)
            thread.start()
            thread.join(1.5)
            assert "rcv" not in dealt, "answered while the node it was dealt to is stopped"
        finally:
            os.kill(cl.worker_pid(b), signal.SIGCONT)
        thread.join(15)
        assert "rcv" in dealt, "the dealt consumer was never answered after SIGCONT"
        try:
            assert where_served(cl, [dealt_id]) == [b]
            for node, tag in ((a, "at-a"), (b, "at-b")):
                pub = connect(cl.node_url(node))   # each node's first producer: its own member
                try:
                    snd = sender(pub, "porders2")
                    for i in range(10):
                        snd.send(Message(body=[tag, i], durable=True))
                finally:
                    pub.close()
            assert drain_bodies(first, kept) == [["at-a", i] for i in range(10)]
            assert drain_bodies(dealt["conn"], dealt["rcv"]) == [["at-b", i] for i in range(10)]
        finally:
            dealt["conn"].close()
            first.close()
        assert "Traceback" not in cl.log_text()
    finally:
        cl.stop()
