"""examples/spark_pipeline.py with the test SparkSession: durable subscription in,
windowed aggregates out, each window exactly once (also across a rerun)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import uuid
from pathlib import Path

import pytest

from amqpbroker.spark.client import BrokerClient, ConnectionOptions

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "spark_pipeline.py"


def load_example():
    spec = importlib.util.spec_from_file_location("spark_pipeline_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pipeline_aggregates_windows_exactly_once(spark, sbroker, tmp_path):
    ex = load_example()
    tag = uuid.uuid4().hex[:6]
    args = argparse.Namespace(
        url=sbroker.url, user=None, password=None, ca_file=None, topic=f"prices-{tag}",
        subscription=f"stats-{tag}", client_id=f"pipeline-{tag}", out=f"out-stats-{tag}",
        window="1 minute", watermark="1 minute", max_records=200, partitions=2,
        checkpoint=str(tmp_path / "ck"), trigger_seconds=0)
    with BrokerClient(ex.connection(args, args.client_id)) as c:
        queue = c.ensure_durable_subscription(args.topic, args.subscription)
    ex.publish_demo_events(args, n=240)
    ex.build_query(spark, args).awaitTermination(180)
    with BrokerClient(ConnectionOptions(url=sbroker.url)) as c:
        results = [json.loads(m.body) for _, m in c.read_range(args.out, 0, None)]
        assert results, "no window closed"
        keys = [(r["window_start"], r["key"]) for r in results]
        assert len(keys) == len(set(keys))                     # one message per window and key
        assert {r["key"] for r in results} <= {"k0", "k1", "k2", "k3"}
        assert sum(r["count"] for r in results) < 240            # the newest windows are still open
        # Consumed events were acknowledged on the subscription queue.
        assert c.queue_info(queue)["reader"].startswith("spark:")
    # A rerun from the checkpoint sends nothing twice.
    ex.build_query(spark, args).awaitTermination(180)
    with BrokerClient(ConnectionOptions(url=sbroker.url)) as c:
        assert len(list(c.read_range(args.out, 0, None))) == len(results)
