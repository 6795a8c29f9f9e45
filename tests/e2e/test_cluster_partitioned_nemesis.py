"""A partitioned queue and a partitioned topic's shared durable subscription under a
nemesis on a seeded schedule, against `serve --workers 3` (n0 owns nothing; each
destination has a member at n1 and one at n2), and a checker of every acknowledged
message.

What is attacked (cluster/partitioned.py, cluster/fanin.py, cluster/router.py's
dealing of connections): producers write through the destination's one name, each
connection to a node drawn from the seed, so the connections are dealt over the
members' nodes (core/handoff.py spread_owner) or forwarded; consumers read through the
one name too (fan-in from both members; a consumer at a member's node is a standby
on the other member).  One fault per so many acknowledged messages (by count, not by
time): kill -9 of a node (the supervisor starts it again on its store) or SIGSTOP
for a moment.  A member's node going away detaches the other nodes' fan-in links
(`amqpbroker:resource-unavailable`); a client that sees it attaches again, as Qpid
JMS does.

Checked at the end: every message a producer was told Accepted reached a consumer or
is still stored (read through the one name after the nemesis); duplicates are
allowed (an Accepted lost with a node makes the producer send again; an unsettled
delivery lost with a node is delivered again).  PARTITIONED_SCHEDULES seeds (3) from
PARTITIONED_FIRST_SEED (3: seeds 1 and 2 kill no member's node).

Found: a shared durable subscription's attach refused while a member's node was
down *closed* the links the other members had accepted, an unsubscribe: the copies
were deleted, backlog and all, and every later publish was Accepted into nothing
(cluster/partitioned.py `member_detached` now detaches them)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Callable

import pytest
from proton import Delivery, Message, Timeout

from tests.client import connect
from tests.cluster_process import ClusterProcess
from tests.e2e.helpers_delivery import receiver, sender, uid
from tests.e2e.jms_links import shared_consumer
from tests.e2e.test_cluster_jms import members

pytestmark = pytest.mark.e2e

SCHEDULES = int(os.environ.get("PARTITIONED_SCHEDULES", "3"))
FIRST_SEED = int(os.environ.get("PARTITIONED_FIRST_SEED", "3"))
FAULTS = 6
PER_FAULT = 80            # acknowledged messages between two faults
NODES = ("n0", "n1", "n2")
QUEUE, TOPIC = "nemq", "nemt"
CONFIG = f"""
[cluster]
partitioned = [{{address = "{QUEUE}", members = 2}}, {{address = "{TOPIC}", members = 2, topic = true}}]
"""


class Client(threading.Thread):
    """Connects to a node drawn from its own seeded generator, does `work` until stopped
    or until the connection or link fails, then connects again."""

    def __init__(self, name: str, cluster: ClusterProcess, seed: int):
        super().__init__(daemon=True)
        self.name_ = name
        self.cluster = cluster
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            conn = None
            try:
                conn = connect(self.cluster.node_url(self.rng.choice(NODES)), container_id=uid(self.name_),
                               timeout=5)
                self.work(conn)
            except Exception as exc:   # noqa: BLE001 - a node went: connect again
                self.errors.append(type(exc).__name__)
                time.sleep(0.2)
            finally:
                if conn is not None:
                    try:
                        conn.close()
                    except Exception:   # noqa: BLE001 - already gone with its node
                        pass

    def work(self, conn) -> None:
        raise NotImplementedError


class Producer(Client):
    """Sends [name, n] for n = 0, 1, ... durable, each again until it is Accepted."""

    def __init__(self, name: str, cluster: ClusterProcess, seed: int, address: str):
        super().__init__(name, cluster, seed)
        self.address = address
        self.acked: list[int] = []
        self.next = 0

    def work(self, conn) -> None:
        snd = sender(conn, self.address)
        while not self.stop.is_set():
            dlv = snd.send(Message(body=[self.name_, self.next], durable=True), timeout=10)
            if dlv.remote_state != Delivery.ACCEPTED:
                raise RuntimeError(f"outcome {dlv.remote_state}")
            self.acked.append(self.next)
            self.next += 1


class Consumer(Client):
    """Receives and accepts through `attach(conn)`; a detach the blocking client does
    not raise for (a fan-in member's node went: the link is detached, not closed) is
    seen on its remote condition, and the consumer attaches again."""

    def __init__(self, name: str, cluster: ClusterProcess, seed: int, attach: Callable):
        super().__init__(name, cluster, seed)
        self.attach = attach
        self.got: list[tuple] = []
        self.last = time.monotonic()

    def work(self, conn) -> None:
        rcv = self.attach(conn)
        while not self.stop.is_set():
            try:
                msg = rcv.receive(timeout=0.5)
            except Timeout:
                if rcv.link.remote_condition is not None:
                    raise RuntimeError(f"detached: {rcv.link.remote_condition.name}") from None
                continue
            self.got.append(tuple(msg.body))
            self.last = time.monotonic()
            rcv.accept()


def acknowledged(producers: list[Producer]) -> int:
    return sum(len(p.acked) for p in producers)


def wait_for_acks(producers: list[Producer], target: int) -> None:
    deadline = time.monotonic() + 120
    while acknowledged(producers) < target and time.monotonic() < deadline:
        time.sleep(0.05)


def run_nemesis(cl: ClusterProcess, rng: random.Random, producers: list[Producer]) -> list[str]:
    done = []
    for _ in range(FAULTS):
        wait_for_acks(producers, acknowledged(producers) + PER_FAULT)
        node = rng.choice(NODES)
        if rng.random() < 0.5:
            mark = len(cl.lines)
            cl.kill_node(node)
            cl.wait_nodes(after=mark, timeout=60)      # started again on its store
            done.append(f"kill {node}")
        else:
            pid = cl.worker_pid(node)
            os.kill(pid, signal.SIGSTOP)
            time.sleep(rng.uniform(0.3, 1.5))        # the pause itself is the fault
            os.kill(pid, signal.SIGCONT)
            done.append(f"pause {node}")
    wait_for_acks(producers, acknowledged(producers) + PER_FAULT)   # and some more after the last
    return done


def settle_down(consumers: list[Consumer], quiet: float = 3.0) -> None:
    """Until no consumer has received anything for `quiet` seconds (at most a minute)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and time.monotonic() - max(c.last for c in consumers) < quiet:
        time.sleep(0.2)


def remaining(cl: ClusterProcess, sub: str) -> list[tuple]:
    """What is still stored, read through each destination's one name at a member's
    node (fan-in from both members); tried again while a node is still starting."""
    for attempt in range(30):
        conn = None
        found: list[tuple] = []
        try:
            conn = connect(cl.node_url("n1"), timeout=5)
            for rcv in (receiver(conn, QUEUE, credit=2000), shared_consumer(conn, TOPIC, sub, global_=True,
                                                                              credit=2000)):
                while True:
                    try:
                        msg = rcv.receive(timeout=2.0)
                    except Timeout:
                        break
                    found.append(tuple(msg.body))
                    rcv.accept()
                assert rcv.link.remote_condition is None, rcv.link.remote_condition
            return found
        except Exception:   # noqa: BLE001 - a node is still starting: again
            time.sleep(0.5)
        finally:
            if conn is not None:
                conn.close()
    raise AssertionError("the destinations could not be read to the end after the nemesis")


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + SCHEDULES))
def test_nothing_acknowledged_to_a_partitioned_destination_is_lost_under_kills_and_pauses(tmp_path, seed):
    cl = ClusterProcess(tmp_path / "data", config=CONFIG).start()
    try:
        assert {node for _, node in members(cl, QUEUE)} == {"n1", "n2"}
        sub = uid("nsub")
        rng = random.Random(seed)
        consumers = [Consumer(f"q-consumer-{k}", cl, seed * 100 + k, lambda c: receiver(c, QUEUE, credit=20))
                     for k in range(3)]
        consumers += [Consumer(f"t-consumer-{k}", cl, seed * 100 + 10 + k,
                               lambda c: shared_consumer(c, TOPIC, sub, global_=True, credit=20))
                      for k in range(3)]
        for c in consumers:
            c.start()
        _wait_subscribed(cl, sub)
        producers = [Producer(f"q-producer-{k}", cl, seed * 100 + 20 + k, QUEUE) for k in range(3)]
        producers += [Producer(f"t-producer-{k}", cl, seed * 100 + 30 + k, f"amq.topic/{TOPIC}") for k in range(2)]
        try:
            for p in producers:
                p.start()
            faults = run_nemesis(cl, rng, producers)
        finally:
            for p in producers:
                p.stop.set()
            for p in producers:
                p.join(30)
        settle_down(consumers)
        for c in consumers:
            c.stop.set()
        for c in consumers:
            c.join(30)
        left = remaining(cl, sub)
        seen: dict[str, set[int]] = {p.name_: set() for p in producers}
        for name, n in [b for c in consumers for b in c.got] + left:
            seen[name].add(n)
        lost = {p.name_: sorted(set(p.acked) - seen[p.name_])[:10] for p in producers}
        summary = (f"seed {seed}: faults {faults}; acknowledged {acknowledged(producers)}; received "
                   f"{sum(len(c.got) for c in consumers)} + {len(left)} left; "
                   f"reconnects {[len(c.errors) for c in producers + consumers]}")
        print(summary)
        assert not any(lost.values()), f"lost: {lost}\n{summary}"
        assert all(p.acked for p in producers), f"every producer got through: {summary}"
        assert len(faults) == FAULTS
    finally:
        cl.stop()


def _wait_subscribed(cl: ClusterProcess, sub: str) -> None:
    """The topic's producers start once the subscription exists on both members: a
    message published before it would rightly go to nobody."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = cl.get("n1", "/api/queues") + cl.get("n2", "/api/queues")
        if text.count(sub) >= 2:
            return
        time.sleep(0.2)
    raise AssertionError(f"subscription {sub} not on both members")
