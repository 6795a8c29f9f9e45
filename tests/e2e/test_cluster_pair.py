"""End to end: a `[cluster]` node that is an HA pair (docs/cluster.md "A node as an HA
pair"), with a real ZooKeeper and real broker processes.

Node a is a pair (a primary and a backup sharing node id a); node b is a plain node.
A client of b reaches a's queues through b (forwarded links).  Only the live broker of
the pair is a member of the cluster; when it is killed (SIGKILL), the backup takes
over, registers node a with its own addresses, and b's forwarded links reach it: every
message a producer saw Accepted is there afterwards (copies of a message sent again
after an outcome was lost are counted, never an Accepted one missing).

No duration is asserted: every wait is for an event, with generous deadlines.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter

import pytest
from proton import Message, Timeout
from proton.utils import LinkDetached

from tests.client import connect
from tests.e2e.paired_cluster import owned_by, running
from tests.e2e.test_cluster_zk import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


@pytest.fixture
def paired(tmp_path):
    with running(tmp_path) as cl:
        yield cl


def test_only_the_live_broker_of_a_pair_serves_the_node(paired):
    primary, backup = paired.pair["primary"], paired.pair["backup"]
    info = paired.live_znode("a")
    assert info is not None and info["amqp"].endswith(f":{primary.amqp_port}"), info
    # The backup is in sync and running, yet it holds no cluster session nor znode,
    # and no AMQP listener.
    assert "cluster: node a is live (" not in backup.log_text()
    assert "node a is live elsewhere" not in backup.log_text()
    assert not backup.is_listening()
    # b reaches a's queue through the primary.
    q = owned_by("a")
    conn = connect(paired.b.url)
    try:
        conn.create_sender(q, name="s").send(Message(body="one", durable=True))
        rcv = conn.create_receiver(q, name="r", credit=1)
        assert rcv.receive(timeout=30).body == "one"
        rcv.accept()
    finally:
        conn.close()
    assert paired.live_znode("a")["amqp"].endswith(f":{primary.amqp_port}")


def close_quietly(conn) -> None:
    """Close a client connection that may already be broken."""
    if conn is None:
        return
    try:
        conn.close()
    except Exception:   # noqa: BLE001 - broken already: nothing to close
        pass


class ResendingProducer(threading.Thread):
    """Durable messages 0..n-1 to `address` through `url`, one at a time, each waited
    for: on any failure (link refused or detached, connection lost) the connection is
    made again and the same message sent again (it may have arrived: a copy)."""

    def __init__(self, url: str, address: str, n: int, deadline: float):
        super().__init__(daemon=True, name="resending-producer")
        self.url, self.address, self.n, self.deadline = url, address, n, deadline
        self.accepted: list[int] = []
        self.resent = 0
        self.failures: Counter = Counter()
        self.progress = threading.Condition()
        self.error: str | None = None

    def run(self) -> None:
        conn = snd = None
        i = 0
        end = time.monotonic() + self.deadline
        while i < self.n:
            if time.monotonic() > end:
                self.error = f"gave up at message {i}: {self.failures}"
                break
            try:
                if snd is None:
                    conn = connect(self.url)
                    snd = conn.create_sender(self.address, name=f"p-{uuid.uuid4().hex[:6]}")
                snd.send(Message(id=f"m{i}", body=i, durable=True), timeout=30)
            except Exception as exc:   # noqa: BLE001 - in doubt: send it again
                self.failures[type(exc).__name__] += 1
                self.resent += 1
                close_quietly(conn)
                conn = snd = None
                time.sleep(0.3)
                continue
            with self.progress:
                self.accepted.append(i)
                self.progress.notify_all()
            i += 1
        close_quietly(conn)

    def wait_accepted(self, count: int, timeout: float) -> None:
        with self.progress:
            if not self.progress.wait_for(lambda: len(self.accepted) >= count or not self.is_alive(), timeout):
                raise AssertionError(f"only {len(self.accepted)} accepted")


def drain_all(url: str, address: str, expected: int) -> list[int]:
    """Receive (and accept) until every expected body came and then nothing more for a while."""
    bodies: list[int] = []
    conn = connect(url)
    try:
        rcv = conn.create_receiver(address, name=f"d-{uuid.uuid4().hex[:6]}", credit=200)
        while True:
            try:
                msg = rcv.receive(timeout=10 if len(set(bodies)) >= expected else 60)
            except Timeout:
                break
            bodies.append(msg.body)
            rcv.accept()
    finally:
        conn.close()
    return bodies


def test_kill_of_the_owning_pairs_live_broker_loses_nothing_accepted(paired):
    primary, backup = paired.pair["primary"], paired.pair["backup"]
    q = owned_by("a")
    total, kill_at = 300, 100
    producer = ResendingProducer(paired.b.url, q, total, deadline=300)
    producer.start()
    producer.wait_accepted(kill_at, 120)
    primary.kill()   # SIGKILL while the producer goes on sending through b
    backup.wait_for_log(r"ha: node \S+ is live", 60)
    backup.wait_for_log(r"cluster: node a is live \(", 60)
    eventually(lambda: (paired.live_znode("a") or {}).get("amqp", "").endswith(f":{backup.amqp_port}"),
               what="node a's live znode naming the backup")
    producer.join(320)
    assert not producer.is_alive() and producer.error is None, producer.error
    assert producer.accepted == list(range(total))
    assert producer.resent >= 1, "the kill was seen by the producer (a send in doubt, or refused)"
    bodies = drain_all(paired.b.url, q, total)
    counts = Counter(bodies)
    lost = sorted(set(producer.accepted) - set(counts))
    unknown = sorted(set(counts) - set(range(total)))
    duplicates = sum(c - 1 for c in counts.values())
    print(f"accepted {len(producer.accepted)}, sent again {producer.resent} ({dict(producer.failures)}), "
          f"received {len(bodies)}, copies {duplicates}")
    assert not lost, f"Accepted, then lost: {lost[:20]} ({len(lost)})"
    assert not unknown
    # Copies come only from messages sent again after an outcome was lost.
    assert duplicates <= producer.resent, (duplicates, producer.resent)
    # The killed broker, started again, is the pair's backup: it does not take the node back.
    primary.start().wait_for_log("in sync with the live broker", 90)
    assert "cluster: node a is live" not in primary.log_text()
    assert not primary.is_listening()
    assert paired.live_znode("a")["amqp"].endswith(f":{backup.amqp_port}")


def test_a_clean_stop_of_the_live_broker_hands_the_node_to_the_backup(paired):
    primary, backup = paired.pair["primary"], paired.pair["backup"]
    q = owned_by("a")
    conn = connect(paired.b.url)
    try:
        snd = conn.create_sender(q, name="s")
        for i in range(20):
            snd.send(Message(body=i, durable=True))   # Accepted: committed on a's live broker and its backup
    finally:
        conn.close()
    assert primary.stop() == 0
    backup.wait_for_log(r"cluster: node a is live \(", 60)
    eventually(lambda: (paired.live_znode("a") or {}).get("amqp", "").endswith(f":{backup.amqp_port}"),
               what="node a's live znode naming the backup")
    assert sorted(drain_all(paired.b.url, q, 20)) == list(range(20))


class ReattachingConsumer(threading.Thread):
    """Receives (and accepts) from `address` through `url` until every one of
    `expected` bodies came, attaching again after any failure."""

    def __init__(self, url: str, address: str, expected: int, deadline: float):
        super().__init__(daemon=True, name="reattaching-consumer")
        self.url, self.address, self.expected, self.deadline = url, address, expected, deadline
        self.bodies: list[int] = []
        self.failures: Counter = Counter()
        self.conditions: list[str] = []

    def run(self) -> None:
        end = time.monotonic() + self.deadline
        conn = rcv = None
        while len(set(self.bodies)) < self.expected and time.monotonic() < end:
            try:
                if rcv is None:
                    conn = connect(self.url)
                    rcv = conn.create_receiver(self.address, name=f"c-{uuid.uuid4().hex[:6]}", credit=20)
                msg = rcv.receive(timeout=1)
                self.bodies.append(msg.body)
                rcv.accept()
            except Timeout:
                continue
            except LinkDetached as exc:
                # A forwarded link whose owner went is closed with its reason.
                self.failures["detached"] += 1
                self.conditions.append(exc.condition)
                close_quietly(conn)
                conn = rcv = None
                time.sleep(0.3)
            except Exception as exc:   # noqa: BLE001 - attach again
                self.failures[type(exc).__name__] += 1
                close_quietly(conn)
                conn = rcv = None
                time.sleep(0.3)
        close_quietly(conn)


def traffic_through_b(paired, q: str, total: int, threshold: int) -> tuple:
    """A consumer and a producer of `q` on node b, started; returns once `threshold`
    messages were Accepted."""
    consumer = ReattachingConsumer(paired.b.url, q, total, deadline=300)
    producer = ResendingProducer(paired.b.url, q, total, deadline=300)
    consumer.start()
    producer.start()
    producer.wait_accepted(threshold, 120)
    return producer, consumer


def check_nothing_lost(paired, q: str, total: int, producer, consumer) -> None:
    """Every message Accepted was received at least once; nothing else was."""
    producer.join(320)
    consumer.join(320)
    assert producer.error is None and producer.accepted == list(range(total)), producer.error
    rest = drain_all(paired.b.url, q, 0)   # what came back after a lost acknowledgement
    counts = Counter(consumer.bodies + rest)
    print(f"sent again {producer.resent}, consumer reattached {sum(consumer.failures.values())}, "
          f"received {len(consumer.bodies)} + {len(rest)} after, copies {sum(c - 1 for c in counts.values())}")
    lost = sorted(set(producer.accepted) - set(counts))
    assert not lost, f"Accepted, then lost: {lost[:20]} ({len(lost)})"
    assert set(counts) <= set(range(total))


def test_a_producer_and_a_consumer_on_another_node_across_the_owners_failover(paired):
    primary, backup = paired.pair["primary"], paired.pair["backup"]
    q = owned_by("a")
    producer, consumer = traffic_through_b(paired, q, 300, 120)
    primary.kill()
    backup.wait_for_log(r"cluster: node a is live \(", 90)
    check_nothing_lost(paired, q, 300, producer, consumer)
    # The consumer's forwarded link ended with the error docs/cluster.md names.
    assert "amqpbroker:resource-unavailable" in consumer.conditions, (consumer.conditions, consumer.failures)


def test_a_paused_live_broker_of_the_owning_pair_comes_back_as_its_backup(paired):
    """SIGSTOP is not a crash: the backup takes the node over while the live broker is
    paused; once resumed, the old live broker fences itself and is demoted (the pair's
    lock is not its own any more), never serving node a beside the new one."""
    import os
    import signal
    primary, backup = paired.pair["primary"], paired.pair["backup"]
    q = owned_by("a")
    producer, consumer = traffic_through_b(paired, q, 300, 100)
    os.kill(primary.proc.pid, signal.SIGSTOP)
    try:
        backup.wait_for_log(r"cluster: node a is live \(", 90)
    finally:
        os.kill(primary.proc.pid, signal.SIGCONT)
    primary.wait_for_log(r"ha: node \S+ is a backup again", 90)
    check_nothing_lost(paired, q, 300, producer, consumer)
    assert paired.live_znode("a")["amqp"].endswith(f":{backup.amqp_port}")
    assert not primary.is_listening()
