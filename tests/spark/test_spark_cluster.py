"""The `amqp` data source against a cluster (`serve --workers 3`, node n0 owning no
slot: the configured URL is always a node that holds nothing read or written) and a
local SparkSession: a partitioned queue read as one stream per member, each from its
owner, exactly once, with offsets, replays and acknowledgements per member; a query
killed mid-batch and restarted from its checkpoint; a durable subscription of a
partitioned topic read on both members' nodes; writes spread over members with
duplicate detection per member; a plain queue read from its owner."""

from __future__ import annotations

import json
import os
import uuid

import pytest
from proton import Message
from pyspark.errors import StreamingQueryException
from pyspark.sql import functions as F

from amqpbroker.core.placement import partition_members, static_map
from amqpbroker.spark.client import BrokerClient, ConnectionOptions
from tests.client import receive_all
from tests.cluster_process import ClusterProcess
from tests.e2e.test_cluster import owned_by

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]

CONFIG = """
[[duplicate_detection]]
pattern = "pout*"
window = 100000

[cluster]
partitioned = [{address = "plog", members = 2}, {address = "pcrash", members = 2},
               {address = "pout", members = 2}, {address = "ptopic", members = 2, topic = true}]
"""
SLOTS = static_map(["n0", "n1", "n2"], {"n0": 0, "n1": 1, "n2": 1})


def members(key: str) -> dict[str, str]:
    """member queue → its node (core/placement.py, as the cluster places them)."""
    from dataclasses import replace
    slots = replace(SLOTS, partitioned={key: 2})
    return dict(partition_members(key, 2, slots))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    proc = ClusterProcess(tmp_path_factory.mktemp("spark-cluster") / "data", config=CONFIG).start()
    yield proc
    proc.stop()


def fill(url: str, address: str, n: int, start: int = 0, groups: int = 6) -> None:
    """Durable messages with JMSXGroupIDs: the groups spread them over the members."""
    with BrokerClient(ConnectionOptions(url=url)) as c:
        c.send(address, (Message(body=f"m{i}", durable=True, group_id=f"g{i % groups}", id=f"in-{i}")
                         for i in range(start, start + n)))


def member_info(cluster, queue: str, node: str) -> dict:
    with BrokerClient(ConnectionOptions(url=cluster.node_url(node))) as c:
        return c.queue_info(queue)


def stream(spark, url, address, **options):
    reader = spark.readStream.format("amqp").option("url", url).option("address", address)
    for k, v in options.items():
        reader = reader.option(k, str(v))
    return reader.load()


def test_a_partitioned_queue_is_read_per_member_from_its_owner_exactly_once(spark, cluster):
    fill(cluster.url, "plog", 120)
    name = "m" + uuid.uuid4().hex[:8]
    query = (stream(spark, cluster.url, "plog", maxRecordsPerBatch=25)
             .writeStream.format("memory").queryName(name).trigger(availableNow=True).start())
    query.awaitTermination(300)
    assert query.exception() is None
    rows = spark.sql(f"select * from {name}").collect()
    assert sorted(r.body_text for r in rows) == sorted(f"m{i}" for i in range(120)), "each exactly once"
    where = members("plog")
    keys = {f"{q}@{n}" for q, n in where.items()}
    assert {r.queue for r in rows} == keys, "both members, named with their nodes"
    for key in keys:   # each member is a log of its own: its sequence numbers, in order
        seqs = sorted(r.sequence for r in rows if r.queue == key)
        assert seqs == list(range(1, len(seqs) + 1))
    batches = [p for p in query.recentProgress if p["numInputRows"]]
    assert all(p["numInputRows"] <= 25 for p in batches) and len(batches) >= 5
    end = batches[-1]["sources"][0]["endOffset"]
    end = json.loads(end) if isinstance(end, str) else end
    assert set(end) == keys
    # commit(end) acknowledged on each member's own node (its queue-info says so).
    acked = [member_info(cluster, q, n) for q, n in where.items()]
    assert all(i["reader"] == "spark:plog" and i["acked-below"] > 1 for i in acked)


def test_a_query_killed_mid_batch_restarts_from_its_checkpoint_exactly_once_per_member(spark, cluster, tmp_path):
    fill(cluster.url, "pcrash", 60)
    marker = str(tmp_path / "crashed")
    out, checkpoint = str(tmp_path / "out"), str(tmp_path / "checkpoint")
    victim = sorted(members("pcrash").items())[1]    # the second member's seq 12 crashes once
    victim_key = f"{victim[0]}@{victim[1]}"

    @F.udf("long")
    def crash_once(key, seq):
        if key == victim_key and seq == 12 and not os.path.exists(marker):
            open(marker, "w").close()
            raise RuntimeError("simulated executor crash mid-batch")
        return seq

    def start():
        return (stream(spark, cluster.url, "pcrash", maxRecordsPerBatch=8)
                .select(crash_once("queue", "sequence").alias("sequence"), "queue", "body_text")
                .writeStream.format("parquet").option("path", out)
                .option("checkpointLocation", checkpoint).trigger(availableNow=True).start())

    first = start()
    with pytest.raises(StreamingQueryException):
        first.awaitTermination(300)
    assert os.path.exists(marker)
    fill(cluster.url, "pcrash", 10, start=60)     # more arrive while the query is down
    second = start()
    second.awaitTermination(300)
    assert second.exception() is None
    rows = spark.read.parquet(out).collect()
    assert sorted(r.body_text for r in rows) == sorted(f"m{i}" for i in range(70)), "every message exactly once"
    for key in {r.queue for r in rows}:
        seqs = sorted(r.sequence for r in rows if r.queue == key)
        assert seqs == list(range(1, len(seqs) + 1)), f"{key}: each sequence once"


def test_a_durable_subscription_of_a_partitioned_topic_is_read_on_both_members(spark, cluster):
    cid, sub = "spark-" + uuid.uuid4().hex[:6], "s" + uuid.uuid4().hex[:6]
    with BrokerClient(ConnectionOptions(url=cluster.url, container_id=cid)) as c:
        queue = c.ensure_durable_subscription("amq.topic/ptopic", sub)   # fan-in: made on each member
    fill(cluster.url, "amq.topic/ptopic", 40)
    df = (spark.read.format("amqp").option("url", cluster.url).option("subscription", sub)
          .option("clientId", cid).load())
    rows = df.collect()
    assert sorted(r.body_text for r in rows) == sorted(f"m{i}" for i in range(40))
    nodes = sorted(members("amq.topic/ptopic").values())
    assert {r.queue for r in rows} == {f"{queue}@{n}" for n in nodes}


def test_writes_spread_over_members_and_a_replay_is_dropped_on_each(spark, cluster):
    df = spark.createDataFrame([(f"r{i}",) for i in range(20)], "body string").repartition(2)
    writer = (df.write.format("amqp").option("url", cluster.url).option("address", "pout")
              .option("writeId", "job-" + uuid.uuid4().hex[:6]).mode("append"))
    writer.save()
    writer.save()            # the same job again: the same ids to the same members
    got = {}
    for index, (queue, node) in enumerate(sorted(members("pout").items())):
        got[queue] = receive_all(cluster.node_url(node), queue, credit=500, timeout=2.0)
        # Task p wrote to member p mod 2: ids are writeId:0:<p>:<row>.
        assert {int(m.id.split(":")[2]) % 2 for m in got[queue]} <= {index}
    assert all(got.values()), "both members written"
    bodies = sorted(m.body for ms in got.values() for m in ms)
    assert bodies == sorted(f"r{i}" for i in range(20)), "every row once: the replay dropped on its member"


def test_a_plain_queue_is_read_from_its_owner(spark, cluster):
    q = owned_by("n2", "plain")
    fill(cluster.url, q, 15)
    rows = spark.read.format("amqp").option("url", cluster.url).option("address", q).load().collect()
    assert sorted(r.sequence for r in rows) == list(range(1, 16))
    assert {r.queue for r in rows} == {f"{q}@n2"}
