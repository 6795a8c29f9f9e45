"""End to end: `serve --workers N` started again with another N on the same data dir.

A queue whose slot moved is shovelled to its new owner (tests/cluster/test_misplaced.py),
and a durable subscription whose topic moved goes to the topic's new node (to every
member when the topic became partitioned), backlog and all, before any node serves a
client (cluster/moves.py), also when a kill -9 cuts the move.  The store of a node that
fewer workers no longer run is emptied into the others.  A single broker's store under
`--workers` (and the workers' under a single broker: store/layout.py) is refused at
start, with the reason, and nothing is lost.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from proton import Delivery, Message, Timeout

from amqpbroker.core.placement import slot_of, static_map
from tests.broker_process import BrokerProcess
from tests.client import connect
from tests.cluster_process import ClusterProcess
from tests.e2e.helpers_delivery import drain_bodies, fetch, receiver, sender, settle, uid
from tests.e2e.jms_links import durable_consumer

pytestmark = pytest.mark.e2e


def owner(topic_key: str, workers: int) -> str:
    return static_map([f"n{i}" for i in range(workers)]).owners[slot_of(topic_key)]


def serve(data_dir, workers: int | None, timeout: float = 60.0, config=None) -> tuple[int, str]:
    """`serve --workers N` (None: `serve` alone) run to its exit: (status, stderr).  A
    broker that starts instead (the behaviour this file guards against) is stopped
    after `timeout`."""
    cmd = [sys.executable, "-m", "amqpbroker.cli", "serve", "--port", "0", "--data-dir", str(data_dir)]
    if workers is not None:
        cmd += ["--workers", str(workers)]
    if config is not None:
        cmd += ["--config", str(config)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, AMQPBROKER_MANAGEMENT__PORT="0"), start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"serve (--workers {workers}) started on a data dir it must refuse:\n{err[-3000:]}")
    return proc.returncode, err


def put_one(proc, address: str, body) -> None:
    """Start `proc` (a broker or a cluster), send one durable message, stop it."""
    proc.start()
    try:
        conn = connect(proc.url)
        sender(conn, address).send(Message(body=body, durable=True))
        conn.close()
    finally:
        proc.stop()


def take_all(proc, address: str) -> list:
    """Start `proc`, receive what `address` holds, stop it."""
    proc.start()
    try:
        conn = connect(proc.url)
        got = drain_bodies(conn, receiver(conn, address, credit=10), timeout=2.0)
        conn.close()
    finally:
        proc.stop()
    return got


def moving_topic(before: int, after: int) -> str:
    return next(t for t in (f"moved-{i}" for i in range(1000))
                if owner(f"amq.topic/{t}", before) != owner(f"amq.topic/{t}", after))


def publish(url: str, topic: str, bodies, keep: bool = True) -> None:
    pub = connect(url)
    snd = sender(pub, f"amq.topic/{topic}")
    for i in bodies:
        snd.send(Message(body=i, durable=True, properties={"keep": keep}))
    pub.close()


def test_a_durable_subscription_whose_topic_moves_goes_with_it_backlog_selector_and_all(tmp_path):
    """2 -> 3 workers -> 2 workers' placement: each start moves the subscription to its topic's new node
    before any client is served (cluster/moves.py), with its backlog in order and its
    selector; messages published after each start reach it there."""
    topic = moving_topic(2, 3)
    data = tmp_path / "data"
    cl = ClusterProcess(data, workers=2, weights=None).start()
    try:
        conn = connect(cl.url, container_id="app-moved")
        durable_consumer(conn, topic, "sub-moved", selector="keep = true").detach()   # kept while away
        conn.close()
        publish(cl.url, topic, range(10))
        publish(cl.url, topic, range(100, 103), keep=False)   # never the subscription's
    finally:
        cl.stop()

    cl = ClusterProcess(data, workers=3, weights=None).start()
    try:
        log_text = cl.log_text()
        assert "durable subscription 'sub-moved' moved to node" in log_text, log_text[-3000:]
        publish(cl.url, topic, range(10, 15))
        publish(cl.url, topic, range(103, 105), keep=False)
        conn = connect(cl.url, container_id="app-moved")
        rcv = durable_consumer(conn, topic, "sub-moved", selector="keep = true")
        got = drain_bodies(conn, rcv, timeout=2.0)
        rcv.detach()
        conn.close()
        publish(cl.url, topic, range(15, 20))   # waits for it at its topic's node
    finally:
        cl.stop()
    assert got == list(range(15)), "the backlog whole and in order, then what came after the move"

    # And back: weights 1,1,0 place every topic as 2 workers do (n2 owns nothing).
    assert static_map(["n0", "n1", "n2"], {"n0": 1, "n1": 1, "n2": 0}).owners == static_map(["n0", "n1"]).owners
    cl = ClusterProcess(data, workers=3, weights="1,1,0").start()
    try:
        conn = connect(cl.url, container_id="app-moved")
        got = drain_bodies(conn, durable_consumer(conn, topic, "sub-moved", selector="keep = true"), timeout=2.0)
        conn.close()
    finally:
        cl.stop()
    assert got == list(range(15, 20))


def make_backlog(data, topic: str, name: str, count: int) -> None:
    """`--workers 2`: durable subscription `name` on `topic` with `count` 32 KB messages."""
    pad = b"x" * 32_000
    cl = ClusterProcess(data, workers=2, weights=None).start()
    try:
        conn = connect(cl.url, container_id="app-cut")
        durable_consumer(conn, topic, name).detach()
        conn.close()
        pub = connect(cl.url)
        snd = sender(pub, f"amq.topic/{topic}")
        for i in range(count):
            snd.send(Message(body=b"%06d" % i + pad, durable=True))
        pub.close()
    finally:
        cl.stop()


def numbers_received(url: str, topic: str, name: str) -> list[int]:
    conn = connect(url, container_id="app-cut")
    rcv = durable_consumer(conn, topic, name, credit=200)
    seen = []
    while True:   # each body's number read at once (a body's view does not outlive the next)
        try:
            msg, dlv = fetch(conn, rcv, 3.0)
        except Timeout:
            break
        seen.append(int(bytes(msg.body[:6])))
        settle(dlv, Delivery.ACCEPTED)
    conn.close()
    return seen


def check_whole(seen: list[int], count: int) -> None:
    assert set(seen) == set(range(count)), f"{count - len(set(seen))} message(s) lost"
    assert len(seen) - count <= 256, "copies beyond the shovel's window"


# Cut by count, not by the clock: once 40 % of the backlog is accepted there.
FORTY_PERCENT = r"durable subscription '{}': [4-9]00 of 2000 message\(s\) moved"


def test_a_move_cut_by_kill_9_goes_on_at_the_next_start_and_loses_nothing(tmp_path):
    """The whole cluster killed (-9) once the topic's new node has taken the
    subscription and part of its backlog: the next start finds it on both nodes and
    moves the rest (at least once: what was accepted there and not yet removed here
    comes twice, never more than a shovel's window)."""
    topic, data, count = moving_topic(2, 3), tmp_path / "data", 2000
    make_backlog(data, topic, "sub-cut", count)
    cl = ClusterProcess(data, workers=3, weights=None).start(wait=False)
    cl.wait_for_log(FORTY_PERCENT.format("sub-cut"), timeout=60)
    os.killpg(cl.proc.pid, signal.SIGKILL)
    cl.proc.wait()

    cl = ClusterProcess(data, workers=3, weights=None).start()
    try:
        log_text = cl.log_text()
        seen = numbers_received(cl.url, topic, "sub-cut")
    finally:
        cl.stop()
    check_whole(seen, count)
    assert "'sub-cut' (topic amq.topic/" in log_text and "here already (an earlier move)" in log_text
    left = re.search(r"moving durable subscription 'sub-cut' \(topic [^,]+, (\d+) message", log_text)
    assert left and 0 < int(left.group(1)) < count, "the second start moved what the first one had not"
    assert seen == sorted(seen) or len(seen) > count, "in order, unless a copy came again"


def move_under_way(tmp_path, victim: str, name: str) -> tuple[ClusterProcess, str, str, int]:
    """`--workers 2` made subscription `name` with a 2,000-message backlog; `--workers 3`
    has moved 40 % of it to the topic's new node: (the cluster, the topic, the node
    `victim` names: "old" the one it leaves, "owner" the one it goes to, the count)."""
    topic, data, count = moving_topic(2, 3), tmp_path / "data", 2000
    node = {"old": owner(f"amq.topic/{topic}", 2), "owner": owner(f"amq.topic/{topic}", 3)}[victim]
    make_backlog(data, topic, name, count)
    cl = ClusterProcess(data, workers=3, weights=None).start(wait=False)
    try:
        cl.wait_for_log(FORTY_PERCENT.format(name), timeout=60)
    except BaseException:
        cl.stop()
        raise
    return cl, topic, node, count


@pytest.mark.parametrize("victim", ["old", "owner"])
def test_a_node_killed_in_the_middle_of_a_move_is_started_again_and_the_gate_waits_for_it(tmp_path, victim):
    """kill -9 of the node the subscription leaves (or of the one it goes to) while
    its backlog moves: the supervisor starts it again, the gate stays shut until the
    move is done, and the client finds every message."""
    cl, topic, node, count = move_under_way(tmp_path, victim, "sub-kill")
    try:
        cl.kill_node(node)
        cl.wait_nodes(timeout=120)
        log_text = cl.log_text()
        assert f"worker {node} exited" in log_text
        assert log_text.index("durable subscription 'sub-kill' moved to node") < log_text.index("every worker is ready")
        seen = numbers_received(cl.url, topic, "sub-kill")
    finally:
        cl.stop()
    check_whole(seen, count)


# A pause shorter than the inter-node idle timeout (cluster/peer.py IDLE_TIMEOUT,
# 16 s) goes unnoticed; a longer one of the owner makes the old node (the side of the
# connection that keeps that timeout) drop the link, and the owner wakes up still
# believing in it.  The old node paused as long may or may not drop it when it wakes
# (its timer or the owner's heartbeats, whichever it handles first): either way the
# move must end.
PAUSES = [("owner", 2.0), ("owner", 25.0), ("old", 20.0)]


@pytest.mark.parametrize("victim,seconds", PAUSES, ids=[f"{v}-{s:.0f}s" for v, s in PAUSES])
def test_a_node_paused_in_the_middle_of_a_move_wakes_up_and_the_move_loses_nothing(tmp_path, victim, seconds):
    """SIGSTOP of the node the subscription leaves (or of the one it goes to) once
    40 % of its backlog is there, SIGCONT after `seconds`: a pause is not a crash,
    the process wakes with its old links.  The move ends, the gate opens only after
    it, and the client finds every message in order (a copy only where a link was
    dropped, never more than a shovel's window)."""
    cl, topic, node, count = move_under_way(tmp_path, victim, "sub-pause")
    try:
        pid = cl.worker_pid(node)
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)   # the fault's length, not a bound on the broker
            assert "every worker is ready" not in cl.log_text(), "the gate opened while a move was stopped"
        finally:
            os.kill(pid, signal.SIGCONT)
        cl.wait_nodes(timeout=180)
        log_text = cl.log_text()
        assert log_text.index("durable subscription 'sub-pause' moved to node") < log_text.index("every worker is ready")
        assert f"worker {node} exited" not in log_text, "a pause is not a crash: nothing restarts it"
        seen = numbers_received(cl.url, topic, "sub-pause")
    finally:
        cl.stop()
    check_whole(seen, count)
    if seconds < 16:
        assert seen == list(range(count)), "a pause the idle timeout does not see costs no copy"
    elif victim == "owner":
        assert "shovel of queue 'qpidsub_/" in log_text, "a pause beyond the idle timeout drops the link"


def test_a_disk_full_in_the_middle_of_a_move_stops_it_and_it_goes_on_once_commits_pass(tmp_path):
    """Every worker's store fails two commits with a full disk (LMDB DiskError, by count:
    store/faults.py) while the backlog moves: a message the topic's node could not
    commit is refused there and stays here; what was in flight behind it is answered
    first (accepted there: removed here), then the move starts again and ends.  Nothing
    is lost and nothing comes twice; the refused messages come after the ones accepted
    behind them (docs/cluster.md)."""
    topic, data, count = moving_topic(2, 3), tmp_path / "data", 2000
    make_backlog(data, topic, "sub-full", count)
    cl = ClusterProcess(data, workers=3, weights=None, env={"AMQPBROKER_STORE_FAULTS": "commit:DiskError@4*2"})
    cl.start(timeout=180)
    try:
        log_text = cl.log_text()
        seen = numbers_received(cl.url, topic, "sub-full")
    finally:
        cl.stop()
    assert "disk full" in log_text, "the injected fault happened"
    assert re.search(r"shovel of queue 'qpidsub_/[^']*' to node n\d stopped \(\d+ moved\): node n\d did not accept",
                     log_text), "the refusal stopped the move, and it started again"
    assert log_text.index("durable subscription 'sub-full' moved to node") < log_text.index("every worker is ready")
    check_whole(seen, count)
    assert len(seen) == count, "what the owner accepted after a refusal is not sent again"


@pytest.mark.parametrize("spec", ["commit:DiskError@1*1", "commit:DiskError@2*1"])
def test_a_move_that_met_a_full_disk_is_whole_after_a_restart(tmp_path, spec):
    """A commit that fails at the topic's node early in a move (by count: the moved
    subscription's own record, or the first messages) and a restart: every message
    is there.  Before, when the failed commit held the subscription's record, the
    node kept the subscription in memory only, took the whole backlog into it and the
    old node deleted its copy: the restart found log records nobody owed and dropped
    all of them (store/batch.py removals_only now writes a failed batch's entity
    records)."""
    topic, data, count = moving_topic(2, 3), tmp_path / "data", 300
    make_backlog(data, topic, "sub-full", count)
    cl = ClusterProcess(data, workers=3, weights=None, env={"AMQPBROKER_STORE_FAULTS": spec})
    cl.start(timeout=180)
    try:
        assert "disk full" in cl.log_text(), "the injected fault happened"
    finally:
        cl.stop()
    cl = ClusterProcess(data, workers=3, weights=None).start()
    try:
        seen = numbers_received(cl.url, topic, "sub-full")
    finally:
        cl.stop()
    check_whole(seen, count)


def test_a_subscription_whose_topic_becomes_partitioned_goes_to_every_member(tmp_path):
    """The topic spread over 2 members: a copy of the subscription on each member's
    node, its backlog with one of them; through the partitioned name the client gets
    the backlog and what comes after, from every member."""
    topic = moving_topic(2, 3)
    data = tmp_path / "data"
    cl = ClusterProcess(data, workers=2, weights=None).start()
    try:
        conn = connect(cl.url, container_id="app-part")
        durable_consumer(conn, topic, "sub-part", selector="keep = true").detach()
        conn.close()
        publish(cl.url, topic, range(5))
        publish(cl.url, topic, range(100, 102), keep=False)
    finally:
        cl.stop()
    config = f'[cluster]\npartitioned = [{{ address = "{topic}", members = 2, topic = true }}]\n'
    cl = ClusterProcess(data, workers=2, weights=None, config=config).start()
    try:
        log_text = cl.log_text()
        assert log_text.count(f"durable subscription 'sub-part' (topic amq.topic/{topic}.p") >= 1, log_text[-3000:]
        for i in range(4):   # producers stick to a member each: more than one, so both get some
            publish(cl.url, topic, range(5 + 5 * i, 10 + 5 * i))
        publish(cl.url, topic, range(102, 104), keep=False)
        conn = connect(cl.url, container_id="app-part")
        got = drain_bodies(conn, durable_consumer(conn, topic, "sub-part", selector="keep = true"), timeout=2.0)
        conn.close()
        members = [cl.get(n, "/api/queues") for n in ("n0", "n1")]
    finally:
        cl.stop()
    assert [x for x in got if x < 5] == list(range(5)), "the backlog in its order (on one member)"
    assert sorted(got) == list(range(25)), "every message once, from both members"
    assert all("sub-part" in text for text in members), "a copy on each member's node"


def test_fewer_workers_empty_the_stores_they_no_longer_run_into_the_others(tmp_path):
    """3 -> 2 workers: node-2 runs once more as a node that owns nothing and serves no
    client; its subscription moves to its topic's node, its queue's messages to their
    owner, and its directory is set aside once it holds nothing."""
    queue = next(q for q in (uid("q") for _ in range(1000)) if owner(q, 3) == "n2")
    topic = next(t for t in (f"t{i}" for i in range(1000)) if owner(f"amq.topic/{t}", 3) == "n2")
    data = tmp_path / "data"
    cl = ClusterProcess(data, workers=3, weights=None).start()
    try:
        conn = connect(cl.url, container_id="app-drain")
        durable_consumer(conn, topic, "sub-drain").detach()
        conn.close()
        publish(cl.url, topic, range(5))
        conn = connect(cl.url)
        sender(conn, queue).send(Message(body="kept", durable=True))
        conn.close()
    finally:
        cl.stop()

    cl = ClusterProcess(data, workers=2, weights=None).start()
    try:
        cl.wait_for_log(r"node-2 holds nothing more", timeout=30)
        conn = connect(cl.url, container_id="app-drain")
        got = drain_bodies(conn, durable_consumer(conn, topic, "sub-drain"), timeout=2.0)
        assert drain_bodies(conn, receiver(conn, queue, credit=10), timeout=2.0) == ["kept"]
        conn.close()
    finally:
        cl.stop()
    assert got == list(range(5))
    assert not (data / "node-2").exists() and len(list(data.glob("node-2.drained-*"))) == 1
    assert take_all(ClusterProcess(data, workers=2, weights=None), queue) == []   # started again: as 2


def test_a_single_brokers_store_and_the_workers_stores_are_never_hidden_by_the_other_mode(tmp_path):
    alone, workers = tmp_path / "alone", tmp_path / "workers"
    put_one(BrokerProcess(alone), "kept-alone", "alone")
    status, err = serve(alone, 2)
    assert status == 2 and "single broker's store" in err and "node-0" in err, err[-3000:]

    cl = ClusterProcess(workers, workers=2, weights=None).start()
    cl.stop()
    status, err = serve(workers, None)
    assert status == 2 and "node-0, node-1" in err and "--workers 2" in err, err[-3000:]

    assert take_all(BrokerProcess(alone), "kept-alone") == ["alone"]   # the mode it was made in: all there


def test_a_zookeeper_node_never_moves_a_subscription_and_refuses_to_start_instead(tmp_path):
    """`[cluster]` with ZooKeeper: its map is fixed, but its partitioned destinations
    are configured; a node whose subscription's topic became partitioned refuses to
    start (exit 3) rather than serve beside it, and starts again as before."""
    from tests.cluster_process import ZkCluster
    cl = ZkCluster(tmp_path).start()
    try:
        static = static_map(["a", "b", "c"], {"a": 0})
        topic = next(t for t in (f"zk-{i}" for i in range(1000))
                     if static.owners[slot_of(f"amq.topic/{t}")] == "b")
        conn = connect(cl.node_url("b"), container_id="app-zk")
        durable_consumer(conn, topic, "sub-zk").detach()
        conn.close()
        publish(cl.node_url("b"), topic, range(3))
        cl.members["b"].stop()
        config = tmp_path / "b-partitioned.toml"
        config.write_text(cl.member_config("b") +
                          f'partitioned = [{{ address = "{topic}", members = 2, topic = true }}]\n')
        status, err = serve(tmp_path / "b", None, config=config)
        assert status == 3, err[-3000:]
        assert "'sub-zk'" in err and "members" in err, err[-3000:]
        cl.members["b"].start(timeout=40)   # its previous configuration: everything there
        cl.members["b"].wait_for_log(r"cluster: node b is live", timeout=30)
        conn = connect(cl.node_url("b"), container_id="app-zk")
        got = drain_bodies(conn, durable_consumer(conn, topic, "sub-zk"), timeout=2.0)
        conn.close()
    finally:
        cl.stop()
    assert got == [0, 1, 2]


def test_fewer_members_put_what_a_dropped_member_holds_into_member_0(tmp_path):
    """A partitioned topic and queue over 3 members, then 2: the dropped member's copy
    of a durable subscription goes into member 0's copy, and its queue's messages into
    member 0's queue; through the partitioned names every message comes once."""
    topic, queue = "fewer-t", "fewer-q"

    def config(members: int) -> str:
        return (f'[cluster]\npartitioned = [{{ address = "{topic}", members = {members}, topic = true }}, '
                f'{{ address = "{queue}", members = {members} }}]\n')

    data = tmp_path / "data"
    cl = ClusterProcess(data, workers=3, weights=None, config=config(3)).start()
    try:
        conn = connect(cl.url, container_id="app-fewer")
        durable_consumer(conn, topic, "sub-fewer").detach()   # a copy on each member
        conn.close()
        for m in range(3):   # named directly, so that each member surely holds some
            publish(cl.url, f"{topic}.p{m}", range(5 * m, 5 * m + 5))
            conn = connect(cl.url)
            snd = sender(conn, f"{queue}.p{m}")
            for i in range(5 * m, 5 * m + 5):
                snd.send(Message(body=i, durable=True))
            conn.close()
    finally:
        cl.stop()

    cl = ClusterProcess(data, workers=3, weights=None, config=config(2)).start()
    try:
        conn = connect(cl.url, container_id="app-fewer")
        got = drain_bodies(conn, durable_consumer(conn, topic, "sub-fewer"), timeout=2.0)
        queued = drain_bodies(conn, receiver(conn, queue, credit=50), timeout=2.0)
        conn.close()
        log_text = cl.log_text()
    finally:
        cl.stop()
    assert sorted(got) == list(range(15)), got
    assert sorted(queued) == list(range(15)), queued
    assert f"durable subscription 'sub-fewer' (topic amq.topic/{topic}.p0) here already" in log_text
