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
import time

import pytest

from tests.client import connect
from tests.cluster_process import ClusterProcess
from tests.e2e.helpers_delivery import drain_bodies, receiver, uid
from tests.e2e.jms_links import shared_consumer
from tests.e2e.retrying_clients import (AcceptedProducer, AcceptingConsumer, acknowledged, kill_or_pause,
                                        stop_all, wait_for_more_acks)
from tests.e2e.test_cluster_jms import members
from tests.e2e.test_cluster_zk import eventually

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


def run_nemesis(cl: ClusterProcess, rng: random.Random, producers: list[AcceptedProducer]) -> list[str]:
    done = []
    for _ in range(FAULTS):
        wait_for_more_acks(producers, PER_FAULT)
        done.append(kill_or_pause(cl, rng.choice(NODES), rng))
    wait_for_more_acks(producers, PER_FAULT)   # and some more after the last
    return done


def settle_down(consumers: list[AcceptingConsumer], quiet: float = 3.0) -> None:
    """Until no consumer has received anything for `quiet` seconds (at most a minute)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and time.monotonic() - max(c.last for c in consumers) < quiet:
        time.sleep(0.2)


def remaining(cl: ClusterProcess, sub: str) -> list[tuple]:
    """What is still stored, read through each destination's one name at a member's
    node (fan-in from both members); tried again while a node is still starting."""
    for _ in range(30):
        conn = None
        try:
            conn = connect(cl.node_url("n1"), timeout=5)
            found: list[tuple] = []
            for rcv in (receiver(conn, QUEUE, credit=2000),
                        shared_consumer(conn, TOPIC, sub, global_=True, credit=2000)):
                found += [tuple(b) for b in drain_bodies(conn, rcv, timeout=2.0)]
                assert rcv.link.remote_condition is None, rcv.link.remote_condition   # read to the end, not cut
            return found
        except Exception:   # noqa: BLE001 - a node is still starting: again
            time.sleep(0.5)
        finally:
            if conn is not None:
                conn.close()
    raise AssertionError("the destinations could not be read to the end after the nemesis")


def anywhere(cl: ClusterProcess, seed: int):
    """A client's choice of node at each connection, from its own seeded generator."""
    pick = random.Random(seed)
    return lambda: cl.node_url(pick.choice(NODES))


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + SCHEDULES))
def test_nothing_acknowledged_to_a_partitioned_destination_is_lost_under_kills_and_pauses(tmp_path, seed):
    cl = ClusterProcess(tmp_path / "data", config=CONFIG).start()
    try:
        assert {node for _, node in members(cl, QUEUE)} == {"n1", "n2"}
        sub = uid("nsub")
        rng = random.Random(seed)
        consumers = [AcceptingConsumer(f"q-consumer-{k}", anywhere(cl, seed * 100 + k),
                                       lambda c: receiver(c, QUEUE, credit=20)) for k in range(3)]
        consumers += [AcceptingConsumer(f"t-consumer-{k}", anywhere(cl, seed * 100 + 10 + k),
                                        lambda c: shared_consumer(c, TOPIC, sub, global_=True, credit=20))
                      for k in range(3)]
        for c in consumers:
            c.start()
        _wait_subscribed(cl, sub)
        producers = [AcceptedProducer(f"q-producer-{k}", anywhere(cl, seed * 100 + 20 + k), QUEUE) for k in range(3)]
        producers += [AcceptedProducer(f"t-producer-{k}", anywhere(cl, seed * 100 + 30 + k), f"amq.topic/{TOPIC}")
                      for k in range(2)]
        try:
            for p in producers:
                p.start()
            faults = run_nemesis(cl, rng, producers)
        finally:
            stop_all(producers)
        settle_down(consumers)
        stop_all(consumers)
        left = remaining(cl, sub)
        seen: dict[str, set[int]] = {p.name_: set() for p in producers}
        for name, n in [b for c in consumers for b in c.got] + left:
            seen[name].add(n)
        lost = {p.name_: sorted(set(p.acked) - seen[p.name_])[:10] for p in producers}
        summary = (f"seed {seed}: faults {faults}; acknowledged {acknowledged(producers)}; received "
                   f"{sum(len(c.got) for c in consumers)} + {len(left)} left; "
                   f"reconnects {[c.failures for c in producers + consumers]}")
        print(summary)
        assert not any(lost.values()), f"lost: {lost}\n{summary}"
        assert all(p.acked for p in producers), f"every producer got through: {summary}"
        assert len(faults) == FAULTS
    finally:
        cl.stop()


def _wait_subscribed(cl: ClusterProcess, sub: str) -> None:
    """The topic's producers start once the subscription exists on both members: a
    message published before it would rightly go to nobody."""
    eventually(lambda: (cl.get("n1", "/api/queues") + cl.get("n2", "/api/queues")).count(sub) >= 2, 30,
               f"subscription {sub} on both members")
