"""End to end: a machine added to a `[cluster]` of machines (`amqpbroker cluster remap`,
cluster/remap.py; the start gate, cluster/zkgate.py), with a real ZooKeeper and real
broker processes.

How it could fail, and the test for each:
* a remap while nodes serve under the old map (they would place addresses apart): refused,
  naming the live nodes; a dry run writes nothing;
* a client served before every node has moved out what it no longer owns (a topic's
  new owner taking publishes while the subscription is on its way would lose them):
  attaches are refused `amqpbroker:resource-unavailable` naming the gate until the last
  node is ready;
* a subscription or a queue left behind, or a message lost or reordered on the way:
  every subscription and queue is drained through a node that owns neither, in order;
* kill -9 of the node that is moving a big backlog, in the middle (by count: once the
  new owner holds part of it): it starts again, moves the rest, and nothing is lost
  (at least once: a message accepted there but not yet removed here comes twice).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
from proton import Message, Timeout
from proton.utils import LinkDetached

from amqpbroker.core.placement import slot_of, spread
from amqpbroker.core.remap import plan_remap
from tests.broker_process import BrokerProcess
from tests.client import connect
from tests.e2e.helpers_delivery import drain_bodies, receiver, sender
from tests.e2e.jms_links import durable_consumer

pytestmark = pytest.mark.e2e

SECRET = "remap-test-secret-0123456789"
OLD = spread(["a", "b"], {"a": 1, "b": 1}, 256)
NEW = plan_remap({"nodes": ["a", "b"], "weights": {"a": 1, "b": 1}, "owners": list(OLD)}, ["a", "b", "c"],
                 {}).owners


def moving(prefix: str, key, old: str, new: str) -> str:
    """A name whose owning key's slot goes from `old` to `new` under the remap."""
    return next(name for name in (f"{prefix}-{i}" for i in range(10000))
                if OLD[slot_of(key(name))] == old and NEW[slot_of(key(name))] == new)


def topic_key(name: str) -> str:
    return f"amq.topic/{name}"


def same(name: str) -> str:
    return name


class Nodes:
    """ZooKeeper and the nodes of one cluster, each a BrokerProcess with its config."""

    def __init__(self, base, zk):
        self.base, self.zk = base, zk
        self.name = f"remap{os.getpid()}{int(time.monotonic() * 1000) % 100000}"
        self.procs: dict[str, BrokerProcess] = {}
        self.extra = ""   # more [cluster] keys, the same on every node

    def config(self, node: str, nodes: list[str]) -> str:
        listed = ", ".join(f'"{n}"' for n in nodes)
        return (f'[cluster]\nzookeeper = "{self.zk.hosts}"\nzookeeper_session_timeout = 4.0\n'
                f'name = "{self.name}"\nnode_id = "{node}"\nnodes = [{listed}]\nlisten_port = 0\n'
                f'secret = "{SECRET}"\n' + self.extra)

    def start(self, node: str, nodes: list[str], wait_serving: bool = True) -> BrokerProcess:
        proc = self.procs.get(node)
        if proc is None:
            proc = self.procs[node] = BrokerProcess(self.base / node)
        proc.config_text = self.config(node, nodes)
        proc.start(timeout=60)
        proc.wait_for_log(rf"cluster: node {node} is live", timeout=30)
        return proc

    def remap(self, nodes: list[str], *extra: str) -> subprocess.CompletedProcess:
        path = self.base / "remap.toml"
        path.write_text(self.config(nodes[0], nodes))
        return subprocess.run([sys.executable, "-m", "amqpbroker.cli", "cluster", "remap", "--config", str(path),
                               *extra], capture_output=True, text=True, timeout=120)

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.stop()


@pytest.fixture
def nodes(tmp_path, zookeeper):
    n = Nodes(tmp_path, zookeeper)
    yield n
    n.stop()


def publish(url: str, address: str, bodies) -> None:
    conn = connect(url)
    snd = sender(conn, address)
    for body in bodies:
        snd.send(Message(body=body, durable=True))
    conn.close()


def subscribe(url: str, topic: str, sub: str) -> None:
    """Make durable subscription `sub` (client-id `app-<sub>`) and leave it detached."""
    conn = connect(url, container_id=f"app-{sub}")
    durable_consumer(conn, topic, sub).detach()
    conn.close()


def drain_subscription(url: str, topic: str, sub: str) -> list:
    conn = connect(url, container_id=f"app-{sub}")
    rcv = durable_consumer(conn, topic, sub)
    got = drain_bodies(conn, rcv, timeout=2.0)
    rcv.detach()
    conn.close()
    return got


def drain_queue(url: str, queue: str) -> list:
    conn = connect(url)
    got = drain_bodies(conn, receiver(conn, queue, credit=200), timeout=2.0)
    conn.close()
    return got


def api(proc: BrokerProcess, path: str):
    with urllib.request.urlopen(f"http://127.0.0.1:{proc.ports['management']}{path}", timeout=10) as resp:
        return json.loads(resp.read())


def wait_serving(procs, epoch: int, timeout: float = 90.0) -> None:
    """Each node serves under the map of `epoch` (through its gate, or started after it opened)."""
    for proc in procs:
        proc.wait_for_log(rf"cluster: node \w+ of .* \(slot map epoch {epoch}\)", timeout=timeout)


def test_adding_a_machine_moves_its_share_behind_the_gate_and_loses_nothing(nodes):
    t_from_a, t_from_b = moving("ta", topic_key, "a", "c"), moving("tb", topic_key, "b", "c")
    t_stays = moving("ts", topic_key, "a", "a")
    q_moves, q_stays = moving("qm", same, "b", "c"), moving("qs", same, "b", "b")
    a, b = nodes.start("a", ["a", "b"]), nodes.start("b", ["a", "b"])
    for topic in (t_from_a, t_from_b, t_stays):
        subscribe(a.url, topic, f"sub-{topic}")
        publish(a.url, f"amq.topic/{topic}", range(20))
    publish(a.url, q_moves, range(30))
    publish(a.url, q_stays, range(10))

    refused = nodes.remap(["a", "b", "c"])
    assert refused.returncode == 1, refused.stderr
    assert "refused: stop every node first" in refused.stderr and "live now: a, b" in refused.stderr

    a.stop()
    b.stop()
    dry = nodes.remap(["a", "b", "c"], "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "slot map epoch 0 -> 1: 85 of 256 slots change owner" in dry.stdout
    assert "(dry run: nothing written)" in dry.stdout
    done = nodes.remap(["a", "b", "c"])
    assert done.returncode == 0, done.stderr
    assert "slot map epoch 0 -> 1" in done.stdout and "written: slot map epoch 1" in done.stdout
    again = nodes.remap(["a", "b", "c"])
    assert again.returncode == 1 and "these nodes and weights already" in again.stderr

    a, b = nodes.start("a", ["a", "b", "c"]), nodes.start("b", ["a", "b", "c"])
    a.wait_for_log(rf"durable subscription 'sub-{t_from_a}' .* waits for node c to be live", timeout=60)
    conn = connect(a.url)
    with pytest.raises(LinkDetached) as held:
        receiver(conn, q_stays, credit=1)
    conn.close()
    assert held.value.condition == "amqpbroker:resource-unavailable"
    assert "serves no client until every node has taken its place in the new slot map" in str(held.value)
    status = subprocess.run([sys.executable, "-m", "amqpbroker.cli", "cluster", "status", "--url",
                             f"http://127.0.0.1:{a.ports['management']}"], capture_output=True, text=True, timeout=60)
    assert "clients wait: node a serves no client until every node" in status.stdout, status.stdout + status.stderr

    c = nodes.start("c", ["a", "b", "c"])
    wait_serving((a, b, c), 1)
    for topic in (t_from_a, t_from_b, t_stays):   # published after the gate: at the topic's new owner
        publish(b.url, f"amq.topic/{topic}", range(20, 25))
    for topic in (t_from_a, t_from_b, t_stays):
        assert drain_subscription(a.url, topic, f"sub-{topic}") == list(range(25)), topic
    assert drain_queue(a.url, q_moves) == list(range(30))
    assert drain_queue(c.url, q_stays) == list(range(10))
    assert "durable subscription 'sub-%s' moved to node c" % t_from_a in a.log_text()
    assert "durable subscription 'sub-%s' moved to node c" % t_from_b in b.log_text()
    view = api(c, "/api/cluster")
    assert view["epoch"] == 1 and view["serving"] is True
    assert {n["node"]: n["slots"] for n in view["nodes"]} == {"a": 86, "b": 85, "c": 85}
    with pytest.raises(RuntimeError) as not_in_map:   # a machine started before its remap
        nodes.start("d", ["a", "b", "c", "d"])
    assert ("cannot start node d: node 'd' is not in the cluster's slot map (nodes ['a', 'b', 'c']): "
            "`amqpbroker cluster remap` makes a map with it") in str(not_in_map.value)
    for proc in (a, b, c):
        assert "Traceback" not in proc.log_text()


def read_ids(rcv, ids: list[str], quiet: float = 3.0) -> list[str]:
    """Accept and append each message's id to `ids` until nothing comes for `quiet` s."""
    while True:
        try:
            msg = rcv.receive(timeout=quiet)
        except Timeout:
            return ids
        ids.append(msg.id)
        rcv.accept()


def subscription_ids(url: str, topic: str, sub: str) -> list[str]:
    """The message ids subscription `sub` holds, in the order it gives them (accepted)."""
    conn = connect(url, container_id=f"app-{sub}")
    try:
        return read_ids(durable_consumer(conn, topic, sub, credit=500), [])
    finally:
        conn.close()


def test_a_node_killed_in_the_middle_of_its_moves_moves_the_rest_when_it_is_back(nodes):
    from tests.e2e.crash_support import send_durable
    topic = moving("tk", topic_key, "a", "c")
    count = 20000
    a, b = nodes.start("a", ["a", "b"]), nodes.start("b", ["a", "b"])
    subscribe(b.url, topic, "sub-big")
    sent = send_durable(a, f"amq.topic/{topic}", count, "big", window=500, body=b"m" * 64)
    assert len(sent.accepted) == count
    a.stop()
    b.stop()
    assert nodes.remap(["a", "b", "c"]).returncode == 0

    c = nodes.start("c", ["a", "b", "c"])
    b = nodes.start("b", ["a", "b", "c"])
    a = nodes.start("a", ["a", "b", "c"])
    moved_part = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:   # by count: once c holds part of the backlog
        subs = [s for s in api(c, "/api/subscriptions") if s["name"] == "sub-big"]
        if subs and subs[0]["pending"] >= 1000:
            moved_part = subs[0]["pending"]
            break
        time.sleep(0.02)
    assert moved_part is not None, "c never held part of the moved backlog"
    a.kill()
    assert moved_part < count, "the move ended before the kill: the test did not cut it"
    a = nodes.start("a", ["a", "b", "c"])
    wait_serving((a, b, c), 1, timeout=120)
    assert a.log_text().count("durable subscription 'sub-big' moved to node c") == 1
    assert_backlog_kept(sent, subscription_ids(b.url, topic, "sub-big"))


def assert_backlog_kept(sent, got: list[str]) -> None:
    """A moved backlog read back: every accepted message, at least once (a move's
    window at most twice), the first copies in the order they were sent."""
    lost = sent.accepted - set(got)
    assert not lost, f"{len(lost)} accepted messages lost, e.g. {sorted(lost)[:5]}"
    assert len(got) - len(sent.accepted) <= 256, "more came twice than a move has in flight"   # at least once
    firsts = list(dict.fromkeys(got))
    assert [sent.sent[i] for i in firsts] == sorted(sent.sent[i] for i in firsts), "the backlog came out of order"


def members_moving(prefix: str, key) -> str:
    """A name whose 2 members are not on the same nodes under the remap as before."""
    from amqpbroker.core.placement import SlotMap, partition_members

    def members(owners, name):
        return partition_members(key(name), 2, SlotMap(tuple(owners), partitioned={key(name): 2}))
    return next(name for name in (f"{prefix}-{i}" for i in range(10000))
                if "c" in dict(members(NEW, name)).values() and members(OLD, name) != members(NEW, name))


def test_partitioned_destinations_keep_every_message_when_their_members_move(nodes):
    """A queue and a topic partitioned over 2 members, with a durable subscription
    through the topic's one name (a copy on each member): adding c moves members (the
    member copies of the subscription behind the gate, the member queues by shovels),
    and everything is read back through the one names."""
    queue, topic = members_moving("orders", same), members_moving("prices", topic_key)
    nodes.extra = (f'partitioned = [{{ address = "{queue}", members = 2 }}, '
                   f'{{ address = "{topic}", members = 2, topic = true }}]\n')
    a, b = nodes.start("a", ["a", "b"]), nodes.start("b", ["a", "b"])
    subscribe(a.url, topic, f"sub-{topic}")
    publish(a.url, f"amq.topic/{topic}", range(40))
    publish(b.url, queue, range(40))
    a.stop()
    b.stop()
    done = nodes.remap(["a", "b", "c"])
    assert done.returncode == 0, done.stderr
    procs = [nodes.start(n, ["a", "b", "c"]) for n in ("c", "a", "b")]
    wait_serving(procs, 1)
    assert sorted(drain_subscription(procs[0].url, topic, f"sub-{topic}")) == list(range(40))
    assert f"durable subscription 'sub-{topic}' moved to node c" in "".join(p.log_text() for p in procs)
    conn = connect(procs[1].url)
    rcv = receiver(conn, queue, credit=100)
    got = drain_bodies(conn, rcv, timeout=3.0)
    conn.close()
    assert sorted(got) == list(range(40))
    for proc in procs:
        assert "Traceback" not in proc.log_text()


def with_backlog(nodes, queue: str, topic: str, sub: str) -> None:
    """a and b under the map [a, b]: 30 messages in `queue`, durable subscription `sub`
    on `topic` with 20; then both stopped."""
    a, b = nodes.start("a", ["a", "b"]), nodes.start("b", ["a", "b"])
    subscribe(a.url, topic, sub)
    publish(a.url, f"amq.topic/{topic}", range(20))
    publish(a.url, queue, range(30))
    a.stop()
    b.stop()


def queue_depth(proc: BrokerProcess, name: str) -> int:
    return sum(q["depth"] for q in api(proc, f"/api/queues?name={name}&limit=10") if q["name"] == name)


def test_a_machine_leaves_the_map_only_once_it_reported_being_empty(nodes):
    """Removing b: weight 0 (a remap), b run until its queues and subscriptions have
    gone to a, then a remap without it.  Leaving it out earlier is refused with the
    reason: its report is from the map before (it never moved anything out), it was
    killed (no report), or it stopped holding messages."""
    queue, topic = moving("qr", same, "b", "b"), moving("tr", topic_key, "b", "b")
    with_backlog(nodes, queue, topic, "sub-leaving")
    nodes.extra = "weights = { b = 0 }\n"
    emptied = nodes.remap(["a", "b"])
    assert emptied.returncode == 0, emptied.stderr
    assert "b -> a: 128 slots" in emptied.stdout and "owned: a 256, b 0" in emptied.stdout
    nodes.extra = ""

    early = nodes.remap(["a"])
    assert early.returncode == 1
    assert "node b last stopped under slot map epoch 0, not the current 1" in early.stderr, early.stderr
    nodes.extra = "weights = { b = 0 }\n"
    b = nodes.start("b", ["a", "b"])
    b.kill()
    nodes.extra = ""
    deadline = time.monotonic() + 60
    killed = nodes.remap(["a"])
    while "live now: b" in killed.stderr and time.monotonic() < deadline:   # until its session expires
        time.sleep(0.5)
        killed = nodes.remap(["a"])
    assert killed.returncode == 1 and "node b has not reported what it holds" in killed.stderr, killed.stderr
    nodes.extra = "weights = { b = 0 }\n"
    b = nodes.start("b", ["a", "b"])
    b.wait_for_log(r"durable subscription 'sub-leaving' .* waits for node a to be live", timeout=60)
    b.stop()
    nodes.extra = ""
    holding = nodes.remap(["a"])
    assert holding.returncode == 1, holding.stderr
    assert (f"node b held 50 message(s) and 1 durable subscription(s) when it stopped (queues not empty: "
            f"{queue})") in holding.stderr, holding.stderr
    forced = nodes.remap(["a"], "--dry-run", "--force")
    assert forced.returncode == 0 and "leaving: b (--force: not checked to be empty)" in forced.stdout

    nodes.extra = "weights = { b = 0 }\n"
    a, b = nodes.start("a", ["a", "b"]), nodes.start("b", ["a", "b"])
    wait_serving((a, b), 1)
    deadline = time.monotonic() + 60
    while queue_depth(b, queue) and time.monotonic() < deadline:   # b shovels its queue to a
        time.sleep(0.1)
    assert queue_depth(b, queue) == 0
    b.stop()
    assert "node b stops holding 0 message(s) and 0 durable subscription(s) (slot map epoch 1)" in b.log_text()
    deadline = time.monotonic() + 60   # a sees b gone, and reads its report
    while time.monotonic() < deadline:
        seen = {n["node"]: n for n in api(a, "/api/cluster")["nodes"]}["b"]
        if seen["last_stop"] is not None:
            break
        time.sleep(0.1)
    assert not seen["live"] and seen["last_stop"] == {"epoch": 1, "messages": 0, "subscriptions": 0, "queues": []}
    status = subprocess.run([sys.executable, "-m", "amqpbroker.cli", "cluster", "status", "--url",
                             f"http://127.0.0.1:{a.ports['management']}"], capture_output=True, text=True, timeout=60)
    assert "(stopped under epoch 1 holding 0 message(s), 0 durable subscription(s))" in status.stdout, status.stdout
    a.stop()
    nodes.extra = ""
    left = nodes.remap(["a"])
    assert left.returncode == 0, left.stderr
    assert "leaving: b" in left.stdout and "--force" not in left.stdout
    a = nodes.start("a", ["a"])
    wait_serving((a,), 2)
    assert drain_subscription(a.url, topic, "sub-leaving") == list(range(20))
    assert drain_queue(a.url, queue) == list(range(30))
    for proc in (a, b):
        assert "Traceback" not in proc.log_text()


def served_znodes(nodes) -> set[str]:
    """The nodes of the cluster that have a `served` record (cluster/membership.py)."""
    from kazoo.client import KazooClient
    client = KazooClient(hosts=nodes.zk.hosts, timeout=10)
    client.start(10)
    try:
        path = f"/amqpbroker-cluster/{nodes.name}/served"
        return set(client.get_children(path)) if client.exists(path) else set()
    finally:
        client.stop()
        client.close()


def test_a_machine_added_that_never_served_leaves_the_map_at_once(nodes):
    """A machine added by mistake (a name never started): the nodes wait at the new
    map's gate for it.  Since it never went live, nothing was ever placed there: the
    remap without it needs no weight 0 first, no report and no --force, and what was
    on its way to it stays with the others."""
    queue, topic = moving("qn", same, "b", "c"), moving("tn", topic_key, "a", "c")
    with_backlog(nodes, queue, topic, "sub-unserved")
    assert nodes.remap(["a", "b", "c"]).returncode == 0
    a, b = nodes.start("a", ["a", "b", "c"]), nodes.start("b", ["a", "b", "c"])
    a.wait_for_log(r"durable subscription 'sub-unserved' .* waits for node c to be live", timeout=60)
    a.stop()
    b.stop()
    assert served_znodes(nodes) == {"a", "b"}

    left = nodes.remap(["a", "b"])
    assert left.returncode == 0, left.stderr
    assert "leaving: c (never served: it holds nothing)" in left.stdout and "--force" not in left.stdout
    refused = nodes.remap(["a"], "--dry-run")   # b served: leaving it out needs weight 0 and its report
    assert refused.returncode == 1 and "node(s) b still own slots" in refused.stderr, refused.stderr
    a, b = nodes.start("a", ["a", "b"]), nodes.start("b", ["a", "b"])
    wait_serving((a, b), 2)
    assert drain_subscription(b.url, topic, "sub-unserved") == list(range(20))
    assert drain_queue(a.url, queue) == list(range(30))
    for proc in (a, b):
        assert "Traceback" not in proc.log_text()
