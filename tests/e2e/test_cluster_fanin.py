"""End to end: a consumer of a partitioned destination through its one name, attached
at a node that owns one of its members (cluster/fanin.py, `serve --workers 3`; n0
owns no slot, n1 and n2 own the members):

* its own member is served in this process (no inter-node connection to itself),
  the other member through its node, every message once;
* local first, never starved: with a busy own member, the other member's messages
  still come before the own member's backlog is done;
* drain takes every member; an outcome goes back to the member the message came from;
* a durable subscription through the one name, detached then unsubscribed at that
  node, is gone from both members;
* a client that lowers its credit below what is on its way (an overdraft) is sent
  nothing more, by a fan-in at either kind of node and by a forwarded consumer,
  instead of the node failing to pass a credit of about 2^32 on.

Attacked: a member that is never given credit (starvation), delivery tags of two
members clashing on the client's link, outcomes routed to the wrong member, an
unsubscribe answered before the own member's deletion.
"""

from __future__ import annotations

import time

import pytest
from proton import Delivery, Endpoint, Message

from amqpbroker.cluster.partitioned import UNAVAILABLE
from tests.client import connect, is_null_terminus
from tests.cluster_process import ClusterProcess
from tests.e2e.helpers_conn import RawClient
from tests.e2e.helpers_delivery import drain_bodies, fetch, receiver, sender, settle, uid
from tests.e2e.jms_links import close, detach, durable_consumer, null_source_attach
from tests.e2e.test_cluster import owned_by
from tests.e2e.test_cluster_jms import forwarding_at, member_bodies, members
from tests.e2e.test_cluster_zk import eventually
from tests.e2e.test_credit_overdraft import overdraft_run

pytestmark = pytest.mark.e2e

CONFIG = """
[cluster]
handoff = false
partitioned = [{address = "forders", members = 2}, {address = "fprices", members = 2, topic = true}]
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    proc = ClusterProcess(tmp_path_factory.mktemp("cluster-fanin") / "data", config=CONFIG).start()
    yield proc
    proc.stop()


def fill(cluster, address: str, bodies: list, node: str | None = None) -> None:
    """Durable messages to `address`, through n0 or `node` (a producer at a member's
    node writes to its own member)."""
    conn = connect(cluster.node_url(node) if node else cluster.url)
    try:
        snd = sender(conn, address)
        for b in bodies:
            snd.send(Message(body=b, durable=True))   # each Accepted once committed
        snd.close()
    finally:
        conn.close()


def own_and_other(cluster, address: str) -> tuple[str, str, str]:
    """(the node that owns the first member, its member, the other member)."""
    (first, node), (second, _) = members(cluster, address)
    assert node != "n0"
    return node, first, second


def test_the_own_member_is_served_in_process_and_the_other_through_its_node(cluster):
    node, own, other = own_and_other(cluster, "forders")
    fill(cluster, own, [["own", i] for i in range(40)])
    fill(cluster, other, [["other", i] for i in range(40)])
    before = forwarding_at(cluster, node)
    conn = connect(cluster.node_url(node))
    try:
        rcv = receiver(conn, "forders", credit=50)
        got = drain_bodies(conn, rcv, timeout=1.0)
        during = forwarding_at(cluster, node)
    finally:
        conn.close()
    assert sorted(map(tuple, got)) == sorted([("own", i) for i in range(40)] + [("other", i) for i in range(40)])
    for who in ("own", "other"):
        assert [i for w, i in got if w == who] == list(range(40)), f"the {who} member's order holds"
    assert during["connections"] - before["connections"] == 1, \
        f"one inter-node connection (to the other member's node), none to itself: {before} -> {during}"
    assert member_bodies(cluster, own) == [] and member_bodies(cluster, other) == []


def test_a_busy_own_member_never_starves_the_other(cluster):
    """Credit goes to the own member first, but each other member keeps a share of
    every grant: its messages come while the own member still has a backlog."""
    node, own, other = own_and_other(cluster, "forders")
    fill(cluster, own, [["own", i] for i in range(400)])
    fill(cluster, other, [["other", i] for i in range(20)])
    conn = connect(cluster.node_url(node))
    try:
        got = drain_bodies(conn, receiver(conn, "forders", credit=20), timeout=1.0)
    finally:
        conn.close()
    assert len(got) == 420 and {tuple(b) for b in got} == \
        {("own", i) for i in range(400)} | {("other", i) for i in range(20)}
    first_other = next(n for n, (w, _) in enumerate(got) if w == "other")
    last_other = max(n for n, (w, _) in enumerate(got) if w == "other")
    assert first_other < 100 and last_other < 400, \
        f"the other member served alongside the busy own one (positions {first_other}..{last_other} of 420)"


def test_drain_takes_every_member_and_is_answered_once(cluster):
    node, own, other = own_and_other(cluster, "forders")
    fill(cluster, own, ["own-1", "own-2"])
    fill(cluster, other, ["other-1", "other-2"])
    client = RawClient("127.0.0.1", cluster.nodes()[node], container_id=uid("drainer")).wait_open()
    try:
        ssn = client.session()
        rcv = client.receiver(ssn, "forders", uid("rcv"))
        assert rcv.state & Endpoint.REMOTE_ACTIVE and rcv.remote_source.address == "forders"
        rcv.drain(10)
        client.wait(lambda: rcv.queued == 4 and not rcv.draining(), what="the drain's answer, with all four")
        bodies = []
        for _ in range(4):
            dlv = rcv.current
            msg = Message()
            msg.decode(rcv.recv(dlv.pending))
            bodies.append(msg.body)
            rcv.advance()
            dlv.update(Delivery.ACCEPTED)
            dlv.settle()
        assert sorted(bodies) == ["other-1", "other-2", "own-1", "own-2"]
        client.wait(lambda: rcv.credit == 0, what="the rest of the credit used up by the drain")
        rcv.drain(5)
        client.wait(lambda: not rcv.draining() and rcv.credit == 0, what="the second drain's answer")
        assert rcv.queued == 0
    finally:
        client.close()
    assert member_bodies(cluster, own) == [] and member_bodies(cluster, other) == []


def test_each_outcome_goes_back_to_the_member_its_message_came_from(cluster):
    node, own, other = own_and_other(cluster, "forders")
    fill(cluster, own, ["own-released", "own-accepted"])
    fill(cluster, other, ["other-released", "other-accepted"])
    conn = connect(cluster.node_url(node))
    try:
        rcv = receiver(conn, "forders", credit=10)
        seen: set[str] = set()
        while len(seen) < 4:   # a released message may come again first (the link still has credit)
            msg, dlv = fetch(conn, rcv)
            seen.add(msg.body)
            settle(dlv, Delivery.RELEASED if msg.body.endswith("released") else Delivery.ACCEPTED)
        rcv.close()
    finally:
        conn.close()
    assert member_bodies(cluster, own) == ["own-released"]
    assert member_bodies(cluster, other) == ["other-released"]


def test_a_durable_subscription_through_the_one_name_at_a_members_node_unsubscribes_everywhere(cluster):
    (first, node), (second, _) = members(cluster, "fprices")
    cid, sub = uid("client"), uid("fsub")
    conn = connect(cluster.node_url(node), container_id=cid)
    try:
        rcv = durable_consumer(conn, "amq.topic/fprices", sub, credit=0)
        assert rcv.link.remote_source.address == "amq.topic/fprices", "the reply names the client's address"
        detach(conn, rcv)   # kept on both members
        pub = connect(cluster.url)
        try:
            for link in range(4):   # sticky members spread: both get some
                snd = pub.create_sender("amq.topic/fprices", name=uid("pub"))
                for i in range(10):
                    snd.send(Message(body=link * 100 + i, durable=True))
                snd.close()
        finally:
            pub.close()
        again = durable_consumer(conn, "amq.topic/fprices", sub, credit=100)
        got = drain_bodies(conn, again, timeout=1.0)
        assert sorted(got) == sorted(link * 100 + i for link in range(4) for i in range(10)), "every message once"
        detach(conn, again)
        lookup = null_source_attach(conn, sub)
        assert not is_null_terminus(lookup.link.remote_source), "found"
        assert close(conn, lookup) is None, "deleted"
    finally:
        conn.close()
    conn = connect(cluster.node_url(node), container_id=cid)
    try:
        from proton.utils import LinkDetached
        with pytest.raises(LinkDetached) as gone:
            null_source_attach(conn, sub)
        assert "amqp:not-found" in str(gone.value), "no member keeps a copy"
    finally:
        conn.close()


@pytest.mark.parametrize("where", ["fan-in at a member's node", "fan-in at a node with no member",
                                   "forwarded consumer"])
def test_a_client_that_lowers_its_credit_is_sent_nothing_more_and_its_connection_stays(cluster, where):
    if where == "forwarded consumer":
        address, node = owned_by("n1"), "n0"
        fill(cluster, address, list(range(6)))
    else:
        address = "forders"
        node, own, other = own_and_other(cluster, address)
        if where == "fan-in at a node with no member":
            node = "n0"
        fill(cluster, own, list(range(3)))
        fill(cluster, other, list(range(3, 6)))
    while_overdrawn, after = overdraft_run(cluster.nodes()[node], address, 6)
    assert while_overdrawn == 2, f"{while_overdrawn} transfers while the node had no credit (2 were granted)"
    assert after == 6
    assert "Traceback" not in cluster.log_text()


def test_the_own_member_served_in_process_needs_its_own_consume_grant(tmp_path):
    """In-process, the own member is checked as its node checks a forwarded consumer:
    a grant on the one name and on the other member only is refused at the attach,
    naming the own member (the other member's node let its part attach)."""
    from amqpbroker.core.placement import partition_members, static_map
    slots = static_map(["n0", "n1", "n2"], {"n0": 0, "n1": 1, "n2": 1})
    (own, node), (other, _) = partition_members("gorders", 2, slots)
    config = ('[cluster]\npartitioned = [{address = "gorders", members = 2}]\n'
              '[anonymous]\npermissions = ["send", "consume"]\npattern = "gorders"\n'
              f'[[acl]]\nuser = "anonymous"\npermissions = ["consume"]\npattern = "{other}"\n')
    cl = ClusterProcess(tmp_path / "data", config=config).start()
    try:
        conn = connect(cl.node_url(node))
        try:
            from proton.utils import LinkDetached
            with pytest.raises(LinkDetached) as refused:
                receiver(conn, "gorders")
        finally:
            conn.close()
    finally:
        cl.stop()
    assert "amqp:unauthorized-access" in str(refused.value) and own in str(refused.value), str(refused.value)


def test_consumers_at_both_members_nodes_read_their_own_member_and_cross_only_when_they_must(cluster):
    """Each member's queue offers another node's consumer (the standby one) only
    what its own node's consumers cannot take: with a consumer through the one name
    at each member's node, every message is read at its member's node; once the
    consumer there is gone, the other node's consumer takes that member's messages."""
    (first, n_first), (second, n_second) = members(cluster, "forders")
    nodes = cluster.nodes()
    at_first = connect(f"amqp://127.0.0.1:{nodes[n_first]}")
    at_second = connect(f"amqp://127.0.0.1:{nodes[n_second]}")
    try:
        r_first = receiver(at_first, "forders", credit=500)
        r_second = receiver(at_second, "forders", credit=500)
        fill(cluster, first, [["first", i] for i in range(100)])
        fill(cluster, second, [["second", i] for i in range(100)])
        got_first = drain_bodies(at_first, r_first, timeout=1.0)
        got_second = drain_bodies(at_second, r_second, timeout=1.0)
        assert got_first == [["first", i] for i in range(100)], f"{len(got_first)} at {n_first}"
        assert got_second == [["second", i] for i in range(100)], f"{len(got_second)} at {n_second}"
        r_first.close()
        fill(cluster, first, [["alone", i] for i in range(20)])
        assert drain_bodies(at_second, r_second, timeout=1.0) == [["alone", i] for i in range(20)], \
            "with nobody at its own node, a member is read by the other node's consumer"
    finally:
        at_first.close()
        at_second.close()


def test_kill_of_the_other_members_node_ends_a_local_first_consumer_clearly_and_loses_nothing(tmp_path):
    """kill -9 of the node of the member that is *not* the consumer's own, while the
    consumer reads through the one name: its link is detached with the cluster's
    resource-unavailable condition (as any consumer of a node that died: its client
    attaches again), never silently or
    with a traceback; what it Accepted of its own member is never delivered again, and
    once the node is back every message is there to be received."""
    cl = ClusterProcess(tmp_path / "data", config=CONFIG).start()
    try:
        node, own, other = own_and_other(cl, "forders")
        other_node = members(cl, "forders")[1][1]
        fill(cl, own, [["own", i] for i in range(60)])
        fill(cl, other, [["other", i] for i in range(60)])
        conn = connect(cl.node_url(node))
        got = []
        try:
            rcv = receiver(conn, "forders", credit=10)
            while len(got) < 20:
                msg, dlv = fetch(conn, rcv, 5.0)
                settle(dlv, Delivery.ACCEPTED)
                got.append(tuple(msg.body))
            mark = len(cl.lines)
            cl.kill_node(other_node)
            # Detached, not closed (its subscription, if durable, stays): AMQP 1.0 §2.6.4.
            conn.wait(lambda: rcv.link.remote_condition is not None, timeout=15,
                      msg="the link to end once a member's node is gone")
            assert rcv.link.remote_condition.name == UNAVAILABLE, rcv.link.remote_condition
            cl.wait_nodes(after=mark)
        finally:
            conn.close()
        rest = []
        for _ in range(50):   # the other node may still be recovering: its attach is refused meanwhile
            again = connect(cl.node_url(node))
            try:
                rest = [tuple(b) for b in drain_bodies(again, receiver(again, "forders", credit=200), timeout=1.5)]
                break
            except Exception:   # noqa: BLE001
                time.sleep(0.2)
            finally:
                again.close()
        everything = {("own", i) for i in range(60)} | {("other", i) for i in range(60)}
        assert everything <= set(got) | set(rest), f"lost: {sorted(everything - set(got) - set(rest))[:10]}"
        again_own = {b for b in got if b[0] == "own"} & set(rest)
        assert not again_own, f"Accepted from the own member, delivered again: {sorted(again_own)[:5]}"
        assert "Traceback" not in cl.log_text()
    finally:
        cl.stop()


def carol_cluster(tmp_path):
    """Three nodes (n0 owns nothing) and a partitioned topic `rprices`, whose one
    name carol may consume and, of its members, only the one she is `allowed`:
    (cluster, the allowed member's node, the other member's node)."""
    from amqpbroker.core.placement import partition_members, static_map

    slots = static_map(["n0", "n1", "n2"], {"n0": 0, "n1": 1, "n2": 1})
    (allowed, allowed_node), (_, refused_node) = partition_members("rprices", 2, slots)
    assert refused_node != allowed_node
    config = ('[cluster]\nhandoff = false\npartitioned = [{address = "rprices", members = 2, topic = true}]\n'
              '[users.carol]\npassword = "carol-secret-1"\n'
              '[management]\nallow_anonymous = true\n'
              '[anonymous]\npermissions = ["all"]\n'
              '[[acl]]\nuser = "carol"\npermissions = ["consume"]\npattern = "rprices"\n'
              f'[[acl]]\nuser = "carol"\npermissions = ["consume"]\npattern = "amq.topic/{allowed}"\n')
    return ClusterProcess(tmp_path / "data", config=config).start(), allowed_node, refused_node


def carol_refused(cluster, node: str, sub: str) -> None:
    """Carol's attach of the shared durable subscription `sub` at `node`: refused by
    the member's node she may not consume from."""
    from proton.utils import LinkDetached

    from tests.e2e.jms_links import shared_consumer

    carol = connect(cluster.node_url(node), user="carol", password="carol-secret-1", allowed_mechs="PLAIN")
    try:
        with pytest.raises(LinkDetached) as refused:
            shared_consumer(carol, "rprices", sub, global_=True, credit=0)
    finally:
        carol.close()
    assert "amqp:unauthorized-access" in str(refused.value), str(refused.value)


def test_a_refused_attach_of_a_durable_subscription_never_deletes_its_copies(tmp_path):
    """A shared durable subscription on a partitioned topic, with a backlog on both
    members.  A consumer allowed on one member only attaches through the one name at
    each node (no member, the allowed member's, the other's): a member's node refuses
    it, and the fan-in ends the links the other members had accepted.  It must *detach*
    them (closed=false), never close them: a close of a durable subscription's link is
    an unsubscribe (AMQP 1.0 §2.6.6), and it deleted the copies, backlog and all, after
    which every message published was Accepted and went nowhere (found by
    tests/e2e/test_cluster_partitioned_nemesis.py: an attach refused while a member's
    node was down)."""
    from tests.e2e.jms_links import shared_consumer

    cl, allowed_node, refused_node = carol_cluster(tmp_path)
    try:
        sub = uid("rsub")
        conn = connect(cl.node_url("n0"))
        shared_consumer(conn, "rprices", sub, global_=True, credit=0)
        conn.close()   # detached: the subscription stays on both members
        for k, node in enumerate(("n1", "n2")):   # each member's node: its own member
            fill(cl, "amq.topic/rprices", [k * 100 + i for i in range(10)], node=node)
        assert [depth_of(cl, node, sub) for node in ("n1", "n2")] == [10, 10], "a backlog on both members"
        for node in ("n0", allowed_node, refused_node):
            carol_refused(cl, node, sub)
            depths = [depth_of(cl, n, sub) for n in ("n1", "n2")]
            assert depths == [10, 10], f"after the refused attach at {node}: {depths} (None: copy deleted)"
        conn = connect(cl.node_url("n0"))
        try:
            got = drain_bodies(conn, shared_consumer(conn, "rprices", sub, global_=True, credit=100), timeout=1.0)
        finally:
            conn.close()
        assert sorted(got) == sorted(k * 100 + i for k in range(2) for i in range(10)), "every message once"
    finally:
        cl.stop()


def test_a_refused_attach_leaves_no_copy_it_created(tmp_path):
    """The same refusal of a subscription that does not exist yet: the member that
    accepted it created its copy, which nobody would ever read and which would keep
    every message of its member for ever (a disk filled by a subscription the client
    was told does not exist).  At each node (no member: both members asked at once,
    the refusal may come before the other's answer; the refused member's node: the
    allowed member accepted first, then its own refused; the allowed member's node:
    the other refused first, nothing created) no copy is left.  A later attach that
    is allowed makes a new subscription: it gets what is published after it only."""
    from tests.e2e.jms_links import shared_consumer

    cl, allowed_node, refused_node = carol_cluster(tmp_path)
    try:
        for node in ("n0", refused_node, allowed_node):
            sub = uid("nsub")
            carol_refused(cl, node, sub)
            eventually(lambda: all(depth_of(cl, n, sub) is None for n in ("n1", "n2")), timeout=10,
                       what=f"no copy of '{sub}' left after the refused attach at {node}")
        for k, node in enumerate(("n1", "n2")):
            fill(cl, "amq.topic/rprices", [k * 100 + i for i in range(5)], node=node)
        conn = connect(cl.node_url("n0"))
        try:
            rcv = shared_consumer(conn, "rprices", sub, global_=True, credit=100)
            fill(cl, "amq.topic/rprices", ["after"])
            got = drain_bodies(conn, rcv, timeout=1.0)
        finally:
            conn.close()
        assert got == ["after"], f"the new subscription holds only what came after it: {got}"
    finally:
        cl.stop()


def depth_of(cluster, node: str, sub: str) -> int | None:
    """The depth of the subscription's copy at `node` (None: no copy there)."""
    import json
    found = [q["depth"] for q in json.loads(cluster.get(node, "/api/queues")) if sub in q["name"]]
    return found[0] if found else None
