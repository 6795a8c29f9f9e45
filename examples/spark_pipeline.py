"""A Spark Structured Streaming pipeline on amqpbroker (docs/spark.md).

Reads a topic through a JMS durable subscription (read as a log, by sequence
number), aggregates a numeric field per key in event-time windows, and writes one
JSON message per closed window to another address — exactly once end to end:

* the source replays a failed micro-batch from the same sequence range;
* the sink's message-ids are `<query id>:<batch>:<partition>:<row>`, and the broker
  drops a replayed batch by duplicate detection (configure it for the output address:
  `[[duplicate_detection]] pattern = "price-stats*"`).

Events: messages on `amq.topic/<topic>` with `subject` = the key and a JSON body
`{"value": <number>}`; event time = the message creation-time.

    .venv/bin/python examples/spark_pipeline.py --url amqp://127.0.0.1:5672 --demo
    .venv/bin/python examples/spark_pipeline.py --url amqps://broker:5671 --user app --password … \\
        --checkpoint s3a://bucket/ck/prices --trigger-seconds 10          # on a cluster: spark-submit

On a cluster: see "Running on a Spark cluster" in docs/spark.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from amqpbroker.spark.client import BrokerClient, ConnectionOptions  # noqa: E402


def build_query(spark, args):
    from pyspark.sql import functions as F

    events = (spark.readStream.format("amqp")
              .option("url", args.url)
              .option("subscription", args.subscription)
              .option("clientId", args.client_id)
              .option("maxRecordsPerBatch", str(args.max_records))
              .option("numPartitions", str(args.partitions))
              .options(**auth_options(args))
              .load())
    parsed = events.select(
        F.col("subject").alias("key"),
        F.coalesce("creation_time", F.current_timestamp()).alias("ts"),
        F.get_json_object("body_text", "$.value").cast("double").alias("value"))
    windows = (parsed.withWatermark("ts", args.watermark)
               .groupBy(F.window("ts", args.window), "key")
               .agg(F.count("*").alias("count"), F.sum("value").alias("total"),
                    F.max("value").alias("max")))
    results = windows.select(
        F.col("key").alias("subject"),
        F.to_json(F.struct(F.col("window.start").cast("string").alias("window_start"),
                           F.col("window.end").cast("string").alias("window_end"),
                           "key", "count", "total", "max")).alias("body"))
    writer = (results.writeStream.format("amqp")
              .option("url", args.url)
              .option("address", args.out)
              .options(**auth_options(args))
              .outputMode("append")               # a window is written once, when it closes
              .option("checkpointLocation", args.checkpoint))
    if args.trigger_seconds:
        writer = writer.trigger(processingTime=f"{args.trigger_seconds} seconds")
    else:
        writer = writer.trigger(availableNow=True)
    return writer.start()


def auth_options(args) -> dict:
    opts = {}
    if args.user:
        opts.update(user=args.user, password=args.password or "")
    if args.ca_file:
        opts.update(tls="true", tlsCaFile=args.ca_file)
    return opts


def connection(args, container_id=None) -> ConnectionOptions:
    return ConnectionOptions(url=args.url, user=args.user, password=args.password,
                             tls_ca_file=args.ca_file, container_id=container_id)


def publish_demo_events(args, n: int = 600) -> None:
    """n events over 10 minutes of event time, keys k0..k3, values 0..99."""
    from proton import Message

    rng = random.Random(7)
    start = time.time() - 600
    with BrokerClient(connection(args)) as c:
        c.send(f"amq.topic/{args.topic}", (
            Message(subject=f"k{i % 4}", body=json.dumps({"value": rng.randint(0, 99)}), durable=True,
                    creation_time=start + i * 600 / n, id=f"event-{i}")
            for i in range(n)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="amqp://127.0.0.1:5672")
    ap.add_argument("--user")
    ap.add_argument("--password")
    ap.add_argument("--ca-file", help="CA for amqps://")
    ap.add_argument("--topic", default="prices")
    ap.add_argument("--subscription", default="price-stats")
    ap.add_argument("--client-id", default="spark-pipeline", help="the JMS clientID owning the subscription")
    ap.add_argument("--out", default="price-stats")
    ap.add_argument("--window", default="1 minute")
    ap.add_argument("--watermark", default="1 minute")
    ap.add_argument("--max-records", type=int, default=10_000)
    ap.add_argument("--partitions", type=int, default=1)
    ap.add_argument("--checkpoint", default=None, help="default: a temporary directory")
    ap.add_argument("--trigger-seconds", type=int, default=0, help="0: Trigger.AvailableNow (one pass)")
    ap.add_argument("--master", default=os.environ.get("SPARK_MASTER", "local[2]"))
    ap.add_argument("--demo", action="store_true", help="publish sample events, run once, print the results")
    args = ap.parse_args()
    args.checkpoint = args.checkpoint or tempfile.mkdtemp(prefix="spark-pipeline-ck-")

    # The durable subscription must exist before events are published (it is the log).
    with BrokerClient(connection(args, args.client_id)) as c:
        queue = c.ensure_durable_subscription(args.topic, args.subscription)
    print(f"reading subscription {args.subscription!r} of {args.client_id!r}: queue {queue}")
    if args.demo:
        publish_demo_events(args)

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from amqpbroker.spark import register

    builder = SparkSession.builder.appName("amqpbroker-pipeline")
    if args.master and "spark.master" not in os.environ.get("PYSPARK_SUBMIT_ARGS", ""):
        builder = builder.master(args.master)
    if args.master.startswith("local"):
        builder = (builder.config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1")
                   .config("spark.driver.bindAddress", "127.0.0.1").config("spark.sql.shuffle.partitions", "2"))
    spark = builder.getOrCreate()
    register(spark)
    query = build_query(spark, args)
    try:
        query.awaitTermination()
    except KeyboardInterrupt:
        query.stop()
    if args.demo:
        with BrokerClient(connection(args)) as c:
            info = c.queue_info(args.out)
            print(f"{int(info['depth'])} window result(s) on {args.out}:")
            for _, msg in c.read_range(args.out, int(info["head"]), None):
                print("  ", msg.body)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
