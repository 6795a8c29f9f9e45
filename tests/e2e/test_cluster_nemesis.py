"""A nemesis on a seeded schedule against `serve --workers 3` (n0 owns nothing; n1 and
n2 own the queues), and a checker of every acknowledged message.

Producers send durable messages through n0 (every link forwarded) and through n1 (to
a queue of n2: forwarded too); each message is resent until it is Accepted, so the
producers are at-least-once.  Meanwhile the nemesis, one fault per so many
acknowledged messages (by count, not by time: a slow machine only makes it longer),
kills a node with SIGKILL (the supervisor starts it again on its store) or stops it
(SIGSTOP) for a moment.  At the end every queue is read to the bottom through its
owner: every message a producer was told Accepted must be there (duplicates are
allowed: a message stored whose Accepted was lost with a node is sent again).
"""

from __future__ import annotations

import random
import uuid

import pytest

from amqpbroker.core.placement import slot_of
from tests.client import connect
from tests.cluster_process import ClusterProcess
from tests.e2e.helpers_delivery import drain_bodies, receiver
from tests.e2e.retrying_clients import AcceptedProducer, kill_or_pause, stop_all, wait_for_more_acks

pytestmark = pytest.mark.e2e

SEED = 28
FAULTS = 6
PER_FAULT = 60            # acknowledged messages between two faults


@pytest.fixture
def cluster(tmp_path):
    proc = ClusterProcess(tmp_path / "data")
    yield proc
    proc.stop()   # whatever happened to the test


def test_nothing_acknowledged_is_lost_under_kills_and_pauses(cluster):
    cl = cluster.start()
    owners = cl.owners
    queues = {}
    for node in ("n1", "n2"):
        while True:
            q = f"nem-{uuid.uuid4().hex[:8]}"
            if owners[slot_of(q)] == node:
                queues[node] = q
                break
    producers = [AcceptedProducer("via-n0-to-n1", lambda: cl.node_url("n0"), queues["n1"]),
                 AcceptedProducer("via-n0-to-n2", lambda: cl.node_url("n0"), queues["n2"]),
                 AcceptedProducer("via-n1-to-n2", lambda: cl.node_url("n1"), queues["n2"])]
    rng = random.Random(SEED)
    done_faults = []
    try:
        for p in producers:
            p.start()
        for fault in range(FAULTS):
            wait_for_more_acks(producers, PER_FAULT)
            done_faults.append(kill_or_pause(cl, rng.choice(["n0", "n1", "n2"]), rng))
        wait_for_more_acks(producers, PER_FAULT)   # and some more after the last
    finally:
        stop_all(producers)
    found: dict[str, list[int]] = {p.name_: [] for p in producers}
    for node, q in queues.items():
        conn = connect(cl.node_url(node))
        try:
            for name, n in drain_bodies(conn, receiver(conn, q, credit=1000), timeout=2.0):
                found[name].append(n)
        finally:
            conn.close()
    lost = {p.name_: sorted(set(p.acked) - set(found[p.name_])) for p in producers}
    assert all(not v for v in lost.values()), f"lost after {done_faults}: {lost}"
    assert all(p.acked for p in producers), "every producer got through"
    assert len(done_faults) == FAULTS
    duplicates = sum(len(v) - len(set(v)) for v in found.values())
    print(f"faults {done_faults}; acknowledged {sum(len(p.acked) for p in producers)}; "
          f"duplicates {duplicates}; producer reconnects {[p.failures for p in producers]}")
