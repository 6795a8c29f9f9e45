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

import os
import random
import signal
import threading
import time
import uuid

import pytest
from proton import Message

from amqpbroker.core.placement import slot_of
from tests.client import connect
from tests.cluster_process import ClusterProcess
from tests.e2e.helpers_delivery import drain_bodies, receiver, sender

pytestmark = pytest.mark.e2e

SEED = 28
FAULTS = 6
PER_FAULT = 60            # acknowledged messages between two faults


class Producer(threading.Thread):
    """Sends (name, n) for n = 0, 1, ... to `queue` through `url`, each until Accepted."""

    def __init__(self, name: str, url_of, queue: str):
        super().__init__(daemon=True)
        self.name_ = name
        self.url_of = url_of
        self.queue = queue
        self.acked: list[int] = []
        self.stop = threading.Event()
        self.errors = 0

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            conn = None
            try:
                conn = connect(self.url_of(), timeout=5)
                snd = sender(conn, self.queue)
                while not self.stop.is_set():
                    snd.send(Message(body=[self.name_, n], durable=True), timeout=10)
                    self.acked.append(n)
                    n += 1
            except Exception:   # noqa: BLE001 - a node went: connect again, send n again
                self.errors += 1
                time.sleep(0.2)
            finally:
                if conn is not None:
                    try:
                        conn.close()
                    except Exception:   # noqa: BLE001
                        pass


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
    producers = [Producer("via-n0-to-n1", lambda: cl.node_url("n0"), queues["n1"]),
                 Producer("via-n0-to-n2", lambda: cl.node_url("n0"), queues["n2"]),
                 Producer("via-n1-to-n2", lambda: cl.node_url("n1"), queues["n2"])]
    rng = random.Random(SEED)
    done_faults = []
    try:
        for p in producers:
            p.start()
        for fault in range(FAULTS):
            target = sum(len(p.acked) for p in producers) + PER_FAULT
            deadline = time.monotonic() + 120
            while sum(len(p.acked) for p in producers) < target and time.monotonic() < deadline:
                time.sleep(0.05)
            node = rng.choice(["n0", "n1", "n2"])
            if rng.random() < 0.5:
                mark = len(cl.lines)
                cl.kill_node(node)
                cl.wait_nodes(after=mark, timeout=60)      # started again on its store
                done_faults.append(f"kill {node}")
            else:
                pid = cl.worker_pid(node)
                os.kill(pid, signal.SIGSTOP)
                time.sleep(rng.uniform(0.3, 1.5))        # the pause itself is the fault
                os.kill(pid, signal.SIGCONT)
                done_faults.append(f"pause {node}")
        target = sum(len(p.acked) for p in producers) + PER_FAULT   # and some more after the last
        deadline = time.monotonic() + 120
        while sum(len(p.acked) for p in producers) < target and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for p in producers:
            p.stop.set()
        for p in producers:
            p.join(30)
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
          f"duplicates {duplicates}; producer reconnects {[p.errors for p in producers]}")
