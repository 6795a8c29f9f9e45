"""End to end: `serve --workers 3` as real processes (tests/cluster_process.py); node n0
owns no slot, so everything a client of n0 does is forwarded (cluster/forward.py;
`[cluster] handoff = false`, so that connections stay on n0: test_cluster_handoff.py
has the connections handed to their first link's owner).

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
from proton import Delivery, Endpoint, Message
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

NO_HANDOFF = """
[cluster]
handoff = false
"""

LIMITS = """
[[queue_limits]]
pattern = "full.#"
max_depth = 2
overflow = "reject"
"""
CONFIG = NO_HANDOFF + LIMITS
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
    proc = ClusterProcess(tmp_path / "data", config=NO_HANDOFF)   # clients stay on the node they reach
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
        snd.close()
        rcv = receiver(conn, q, credit=0)
        mark = len(cl.lines)
        cl.kill_node("n1")
        # Closed (the node in front cannot resume it), with the reason: a blocking
        # client sees the end instead of a link that is silently never served again.
        with pytest.raises(LinkDetached) as ended:
            conn.wait(lambda: False, timeout=120, msg="the forwarded link was never ended")
        assert ended.value.link.name == rcv.link.name
        assert ended.value.condition == "amqpbroker:resource-unavailable"
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


def test_an_owner_paused_then_continued_answers_what_waited_and_loses_nothing(own_cluster):
    """SIGSTOP is not a crash: a send through n0 waits for the stopped owner, and is
    answered (Accepted: stored) once it runs again; nothing before or after is lost."""
    import os
    import signal
    cl = own_cluster.start()
    q = owned_by("n1")
    conn = connect(cl.url)
    try:
        snd = sender(conn, q)
        for i in range(20):
            snd.send(Message(body=i, durable=True))
        pid = cl.worker_pid("n1")
        os.kill(pid, signal.SIGSTOP)
        done = threading.Event()
        try:
            t = threading.Thread(target=lambda: (snd.send(Message(body=20, durable=True)), done.set()),
                                 daemon=True)
            t.start()
            assert not done.wait(1.0), "no Accepted while the owner is stopped"
        finally:
            os.kill(pid, signal.SIGCONT)
        t.join(20)
        assert done.is_set(), "answered once the owner runs again"
        for i in range(21, 30):
            snd.send(Message(body=i, durable=True))
        assert drain_bodies(conn, receiver(conn, q, credit=100), timeout=1.0) == list(range(30))
    finally:
        conn.close()
