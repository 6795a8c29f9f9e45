"""The source's cluster discovery (amqpbroker/spark/cluster.py) without brokers: node
URLs, a stream per member of a partitioned queue, a subscription's queue found on
the nodes that hold it, the sink's member per task, a single broker unchanged."""

from __future__ import annotations

import pytest

from amqpbroker.spark.client import BrokerError, ConnectionLost, ConnectionOptions
from amqpbroker.spark.cluster import Stream, Streams, discover, node_url, write_target

pytestmark = pytest.mark.spark

NODES = [{"node": "n0", "live": True, "amqp": "0.0.0.0:5701"},
         {"node": "n1", "live": True, "amqp": "10.0.0.2:5702"},
         {"node": "n2", "live": False, "amqp": "10.0.0.3:5703"}]


class FakeBrokers:
    """A factory of clients: what each node (by URL) holds."""

    def __init__(self, cluster: bool = True, holds: dict | None = None, members: dict | None = None):
        self.cluster = cluster
        self.holds = holds or {}          # url → queues there
        self.members = members or {}      # address → members ([queue, node]) or None
        self.asked: list[str] = []

    def __call__(self, conn: ConnectionOptions) -> "FakeBrokers.Client":
        return FakeBrokers.Client(self, conn.url)

    class Client:
        def __init__(self, brokers, url):
            self.brokers, self.url = brokers, url

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def cluster_info(self, address=None):
            if not self.brokers.cluster:
                return None
            info = {"node": "n0", "nodes": NODES}
            if address:
                members = self.brokers.members.get(address, [[address, "n1"]])
                if members is not None:
                    info["members"] = members
            return info

        def queue_info(self, queue):
            self.brokers.asked.append(f"{queue}@{self.url}")
            if self.url not in self.brokers.holds:
                raise ConnectionLost("away")
            if queue not in self.brokers.holds[self.url]:
                raise BrokerError("amqp:not-found", "no such queue")
            return {"head": 1, "tail": 1}


def test_node_url_keeps_scheme_and_credentials_and_replaces_an_unspecified_host():
    assert node_url("amqps://u:p@broker.example:5671", "10.0.0.2:5702") == "amqps://u:p@10.0.0.2:5702"
    assert node_url("amqp://broker.example:5672", "0.0.0.0:5701") == "amqp://broker.example:5701"
    assert node_url("127.0.0.1:5672", "::1:5703") == "amqp://[::1]:5703"


def test_a_single_broker_keeps_queue_names_as_keys():
    streams = discover(ConnectionOptions(url="amqp://h:1"), ["a", "b"], FakeBrokers(cluster=False))
    assert streams is None
    s = Streams(ConnectionOptions(url="amqp://h:1"), ["a", "b"], FakeBrokers(cluster=False))
    assert s.get() == {"a": Stream("a", None), "b": Stream("b", None)} and s.cluster is False


def test_a_partitioned_queue_is_a_stream_per_member_read_on_its_node():
    brokers = FakeBrokers(members={"orders": [["orders.p0", "n1"], ["orders.p1", "n0"]]})
    streams = discover(ConnectionOptions(url="amqp://u@h:5672"), ["orders"], brokers)
    assert streams == {"orders.p0@n1": Stream("orders.p0", "amqp://u@10.0.0.2:5702"),
                       "orders.p1@n0": Stream("orders.p1", "amqp://u@h:5701")}


def test_a_subscription_queue_is_read_where_it_is_held_on_live_nodes():
    sub = "qpidsub_/_global__/s_/durable"
    brokers = FakeBrokers(members={sub: None},
                          holds={"amqp://h:5701": [sub], "amqp://10.0.0.2:5702": []})
    streams = discover(ConnectionOptions(url="amqp://h:5672"), [sub], brokers)
    assert streams == {f"{sub}@n0": Stream(sub, "amqp://h:5701")}
    assert not any("5703" in a for a in brokers.asked), "a node that is not live is not asked"


def test_streams_keep_a_known_stream_and_refuse_an_unknown_key():
    brokers = FakeBrokers(members={"orders": [["orders.p0", "n1"]]})
    s = Streams(ConnectionOptions(url="amqp://h:5672"), ["orders"], brokers)
    assert s.locate("orders.p0@n1") == Stream("orders.p0", "amqp://10.0.0.2:5702")
    brokers.members["orders"] = [["orders.p0", "n0"]]        # (a map change: the old stream stays known)
    s.expire()
    assert set(s.get()) == {"orders.p0@n1", "orders.p0@n0"}
    with pytest.raises(LookupError):
        s.locate("orders.p9@n7")


def test_the_sink_writes_task_p_to_member_p_mod_k_on_its_owner():
    brokers = FakeBrokers(members={"out": [["out.p0", "n0"], ["out.p1", "n1"]]})
    conn = ConnectionOptions(url="amqp://h:5672")
    import amqpbroker.spark.cluster as cluster
    original = cluster.BrokerClient
    cluster.BrokerClient = brokers
    try:
        assert [(a, c.url) for a, c in (write_target(conn, "out", p) for p in range(3))] == [
            ("out.p0", "amqp://h:5701"), ("out.p1", "amqp://10.0.0.2:5702"), ("out.p0", "amqp://h:5701")]
        brokers.cluster = False
        assert write_target(conn, "out", 5) == ("out", conn)
    finally:
        cluster.BrokerClient = original
