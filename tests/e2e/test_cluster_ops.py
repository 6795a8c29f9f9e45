"""End to end: a node's cluster figures on its /metrics and GET /api/cluster, against
`serve --workers 3` (tests/cluster_process.py; n0 owns no slot, and with `[cluster]
handoff = false` its clients stay there and their links are forwarded).  Each figure is checked moving, not only present: forwarded links and
inter-node connections while a client uses another node's queue, deliveries waiting on
an owner while that owner is paused (SIGSTOP), back to zero once it answers."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import pytest
from proton import Message

from tests.client import connect
from tests.cluster_process import ClusterProcess
from tests.e2e.helpers_delivery import receiver, sender
from tests.e2e.test_cluster import NO_HANDOFF, owned_by

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    proc = ClusterProcess(tmp_path_factory.mktemp("cluster-ops") / "data", config=NO_HANDOFF).start()
    yield proc
    proc.stop()


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def eventually(check, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_slots_and_nodes_on_every_nodes_metrics(cluster):
    owned = {}
    for node in ("n0", "n1", "n2"):
        text = cluster.get(node, "/metrics")
        owned[node] = metric(text, "amqpbroker_cluster_slots_owned")
        assert metric(text, "amqpbroker_cluster_nodes_live") == 3
        assert metric(text, "amqpbroker_cluster_serving") == 1
        assert "amqpbroker_cluster_zookeeper_connected" not in text   # --workers: no ZooKeeper
    assert owned == {"n0": 0, "n1": 128, "n2": 128}


def test_forwarded_links_and_inter_node_connections_while_in_use(cluster):
    q = owned_by("n1")
    before_out = metric(cluster.get("n0", "/metrics"), "amqpbroker_cluster_connections_out")
    before_total = metric(cluster.get("n0", "/metrics"), "amqpbroker_cluster_forwarded_links_total")
    conn = connect(cluster.url)
    try:
        receiver(conn, q, credit=5)
        sender(conn, q)
        edge = cluster.get("n0", "/metrics")
        assert metric(edge, "amqpbroker_cluster_connections_out") == before_out + 1   # one per client and node
        assert metric(edge, "amqpbroker_cluster_forwarded_links") >= 2
        assert metric(edge, "amqpbroker_cluster_forwarded_links_total") == before_total + 2
        assert metric(cluster.get("n1", "/metrics"), "amqpbroker_cluster_connections_in") >= 1
        view = json.loads(cluster.get("n0", "/api/cluster"))
        assert view["enabled"] and view["node"] == "n0" and view["slots_owned"] == 0
        assert {n["node"]: n["connections"] for n in view["nodes"]}["n1"] >= 1
    finally:
        conn.close()
    eventually(lambda: metric(cluster.get("n0", "/metrics"), "amqpbroker_cluster_connections_out") == before_out,
               what="the client's inter-node connection gone with it")


def test_deliveries_waiting_on_a_paused_owner(cluster):
    """Sends through n0 to a queue of n2 while n2 is stopped: they wait on n2 (and the
    gauge says how many); once n2 goes on they are answered and the gauge is 0."""
    q = owned_by("n2")
    conn = connect(cluster.url)
    snd = sender(conn, q)
    snd.send(Message(body="warm"))   # the link is open at the owner before it stops
    pid = cluster.worker_pid("n2")
    os.kill(pid, signal.SIGSTOP)
    done = threading.Event()
    errors: list[BaseException] = []

    def send_some() -> None:
        try:
            for i in range(5):
                snd.send(Message(body=i), timeout=60)
        except BaseException as exc:   # noqa: BLE001 - reported by the test
            errors.append(exc)
        done.set()

    try:
        # BlockingSender.send waits for each outcome: one message waits at a time.
        threading.Thread(target=send_some, daemon=True).start()
        eventually(lambda: metric(cluster.get("n0", "/metrics"), "amqpbroker_cluster_deliveries_waiting") >= 1,
                   what="a send waiting on the stopped owner")
        assert not done.is_set()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert done.wait(60) and not errors
    eventually(lambda: metric(cluster.get("n0", "/metrics"), "amqpbroker_cluster_deliveries_waiting") == 0,
               what="nothing waiting once the owner answered")
    conn.close()


def test_a_single_broker_has_no_cluster_figures(tmp_path):
    from tests.broker_process import BrokerProcess
    import urllib.request
    broker = BrokerProcess(tmp_path / "data").start()
    try:
        port = broker.ports["management"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "amqpbroker_cluster_" not in text
        view = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/cluster", timeout=10).read())
        assert view == {"enabled": False}
    finally:
        broker.stop()
