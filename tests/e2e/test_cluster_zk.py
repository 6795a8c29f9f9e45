"""End to end: a `[cluster]` of three broker processes and a real ZooKeeper
(tests/cluster_process.py ZkCluster; Debian's zookeeper as in the HA tests).  Node a
owns no slot; b and c share them.  The JMS wire tests also run against such a
cluster (their modules' `zookeeper` parameter); these are about membership: the
status, a node killed and back, a second process of one node's name, ZooKeeper paused.
"""

from __future__ import annotations

import io
import json
import re
import time
import uuid

import pytest
from proton import Message
from proton.utils import LinkDetached

from amqpbroker.cluster.cli import main as cluster_cli
from amqpbroker.core.placement import slot_of, static_map
from tests.broker_process import BrokerProcess
from tests.client import connect
from tests.cluster_process import ZkCluster
from tests.e2e.helpers_delivery import drain_bodies, receiver, sender

pytestmark = pytest.mark.e2e

OWNERS = static_map(["a", "b", "c"], {"a": 0}).owners


def owned_by(node: str) -> str:
    while True:
        name = f"q-{uuid.uuid4().hex[:8]}"
        if OWNERS[slot_of(name)] == node:
            return name


def eventually(check, timeout: float = 30.0, what: str = "condition"):
    """Poll `check` until it returns a true value (deadlines generous: a busy machine
    only makes these tests slower, never wrong)."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception as exc:   # noqa: BLE001 - retried until the deadline
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}" + (f": {last}" if last else ""))


def refused_unavailable(url: str, address: str) -> bool:
    conn = connect(url)
    try:
        receiver(conn, address, credit=1)
        return False
    except LinkDetached as exc:
        return "amqpbroker:resource-unavailable" in str(exc)
    finally:
        conn.close()


def attach_works(url: str, address: str) -> bool:
    conn = connect(url)
    try:
        receiver(conn, address, credit=0)
        return True
    except LinkDetached:
        return False
    finally:
        conn.close()


@pytest.fixture
def zk_cluster(tmp_path):
    cl = ZkCluster(tmp_path).start()
    yield cl
    cl.stop()


def test_status_through_the_api_and_the_cli(zk_cluster):
    port = zk_cluster.members["a"].ports["management"]
    out = io.StringIO()
    assert cluster_cli(["status", "--url", f"http://127.0.0.1:{port}", "--json"], out=out) == 0
    view = json.loads(out.getvalue())
    assert view["enabled"] and view["node"] == "a" and view["serving"]
    nodes = {n["node"]: n for n in view["nodes"]}
    assert {n: (v["live"], v["slots"]) for n, v in nodes.items()} == {"a": (True, 0), "b": (True, 128),
                                                                      "c": (True, 128)}
    assert view["zookeeper"]["session"] == "CONNECTED"
    text = io.StringIO()
    assert cluster_cli(["status", "--url", f"http://127.0.0.1:{port}"], out=text) == 0
    assert "node a (serving)" in text.getvalue() and "(this node)" in text.getvalue()
    import urllib.request
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    figures = dict(re.findall(r"^(amqpbroker_cluster_\w+) (\S+)$", metrics, re.M))
    assert float(figures["amqpbroker_cluster_zookeeper_connected"]) == 1
    assert float(figures["amqpbroker_cluster_zookeeper_lost"]) == 0
    assert float(figures["amqpbroker_cluster_slots_owned"]) == 0   # a owns nothing


def test_a_killed_node_is_unavailable_until_it_is_back_and_loses_nothing(zk_cluster):
    cl = zk_cluster
    q = owned_by("b")
    conn = connect(cl.url)
    try:
        snd = sender(conn, q)
        for i in range(20):
            snd.send(Message(body=i, durable=True))   # Accepted once b committed
    finally:
        conn.close()
    cl.members["b"].kill()
    eventually(lambda: refused_unavailable(cl.url, q), what="b's queue refused unavailable")
    cl.wait_for_log(r"cluster: node b is gone")
    assert attach_works(cl.url, owned_by("c")), "c's slots are served meanwhile"
    cl.members["b"].start(timeout=40)
    eventually(lambda: attach_works(cl.url, q), what="b's queue served again")
    conn = connect(cl.url)
    try:
        assert drain_bodies(conn, receiver(conn, q, credit=50), timeout=1.0) == list(range(20))
    finally:
        conn.close()


def test_a_second_process_of_one_nodes_name_waits_until_the_first_is_gone(zk_cluster, tmp_path):
    cl = zk_cluster
    # One stopped (SIGTERM) while it waits: a clean stop, status 0.  (Its handler came
    # only once the node was live: the SIGTERM killed it, status -15.)
    waiting = BrokerProcess(tmp_path / "c-waiting", config=cl.member_config("c"))
    try:
        waiting.start(timeout=40)
        waiting.wait_for_log(r"node c is live elsewhere .*waiting", timeout=20)
        assert waiting.stop() == 0, waiting.log_text()[-2000:]
        assert "node c shutting down" in waiting.log_text()
    finally:
        waiting.stop()
    twin = BrokerProcess(tmp_path / "c-twin", config=cl.member_config("c"))
    try:
        twin.start(timeout=40)
        twin.wait_for_log(r"node c is live elsewhere .*waiting", timeout=20)
        q = owned_by("c")
        assert refused_unavailable(twin.url, q), "the waiting process serves nothing"
        assert attach_works(cl.url, q), "the first one still serves c's slots"
        cl.members["c"].stop()   # a clean stop deletes its live node at once
        twin.wait_for_log(r"cluster: node c is live \(", timeout=30)
        eventually(lambda: attach_works(twin.url, q), what="the second process serving c's slots")
    finally:
        twin.stop()


def test_zookeeper_paused_nodes_serve_nothing_new_then_serve_again(zk_cluster):
    cl = zk_cluster
    q = owned_by("b")
    b_url = cl.node_url("b")
    assert attach_works(b_url, q)
    cl.zk.pause()
    try:
        eventually(lambda: refused_unavailable(b_url, q), what="b refusing while ZooKeeper is away")
        cl.members["b"].wait_for_log(r"serves nothing new until it holds its live node again")
    finally:
        cl.zk.resume()
    eventually(lambda: attach_works(b_url, q), what="b serving again once ZooKeeper is back")
    eventually(lambda: attach_works(cl.url, q), what="b reached through a again")


class OneNodeOtherwise(ZkCluster):
    """Node c configured with a partitioned destination the others do not have: it
    would place `px` (and its members) where they do not."""

    def member_config(self, node: str) -> str:
        extra = 'partitioned = [{address = "px", members = 2}]\n' if node == "c" else ""
        return super().member_config(node) + extra


def test_nodes_whose_cluster_options_differ_never_forward_to_each_other(tmp_path):
    """The handshake carries the map's id (core/placement.map_id: epoch, owners, pinned
    exchanges, partitioned destinations): node c refuses a (the options differ), so a
    link for c's address is refused unavailable at a, while b, configured as a is,
    serves its own."""
    cl = OneNodeOtherwise(tmp_path).start()
    try:
        assert attach_works(cl.url, owned_by("b"))
        assert refused_unavailable(cl.url, owned_by("c"))
        line = cl.members["c"].wait_for_log("inter-node connection refused: the other node places addresses "
                                            "under another slot map", timeout=10)
        assert "partitioned" in line
    finally:
        cl.stop()
