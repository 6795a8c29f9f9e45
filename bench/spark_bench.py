"""Spark ⇄ amqpbroker throughput: the `amqp` data source (docs/spark.md).

A benchmark, not a test: it prints figures and asserts only that every message
was seen.  It starts its own broker (temporary data dir), fills one durable queue
with --messages messages, then

* reads the whole queue with Spark (batch read, the same read path as a streaming
  micro-batch: sequence-range links, one per partition) with 1, 2 and 4
  partitions: count + sum(length(body)) so that every row is materialised;
* writes --write-messages rows with Spark into an address with duplicate
  detection on (deterministic message-ids), with 1 and 2 partitions.

    .venv/bin/python bench/spark_bench.py                       # 1M messages
    .venv/bin/python bench/spark_bench.py --messages 200000 --json bench/out/spark.json
    .venv/bin/python bench/spark_bench.py --cluster --members 1,2 --messages 200000

`--cluster` starts `serve --workers N` (N = the largest member count) with a
partitioned queue of each member count, fills each with the same messages (groups
spread them over the members) and reads each with Spark, one task per member, each
from the node that holds it (docs/spark.md, "On a cluster"): the read rate for K
members against 1 member (a queue on one node) in the same run.

Needs the `spark` extra (pyspark, pyarrow) and Java 17.  The broker, the Python
workers and the JVM share the machine's cores: on 2 cores more partitions than
cores cannot scale.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proton import Message  # noqa: E402

from amqpbroker.spark.client import BrokerClient, ConnectionOptions  # noqa: E402

CONFIG = """
[[duplicate_detection]]
pattern = "bench-out*"
window = 100000
"""


def start_broker(data: Path) -> tuple[subprocess.Popen, str]:
    cfg = data.parent / "broker.toml"
    cfg.write_text(CONFIG)
    env = dict(os.environ, AMQPBROKER_MANAGEMENT__PORT="0")
    proc = subprocess.Popen([sys.executable, "-m", "amqpbroker.cli", "serve", "--port", "0", "--data-dir",
                             str(data), "--config", str(cfg), "--log-level", "info"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    rx = re.compile(r"amqp listening on ([\d.]+):(\d+)")
    deadline = time.monotonic() + 30
    for line in proc.stderr:
        m = rx.search(line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, f"amqp://{m.group(1)}:{m.group(2)}"
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise SystemExit("broker did not start")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def start_cluster(data: Path, members: list[int]) -> tuple[subprocess.Popen, str]:
    """`serve --workers max(members)` with `bench-p<K>` partitioned over K members."""
    cfg = data.parent / "cluster.toml"
    # One member: a plain queue (on one node), the reference.
    decls = ", ".join(f'{{address = "bench-p{k}", members = {k}}}' for k in members if k > 1)
    cfg.write_text(f"[cluster]\npartitioned = [{decls}]\n")
    env = dict(os.environ, AMQPBROKER_MANAGEMENT__PORT="0")
    proc = subprocess.Popen([sys.executable, "-m", "amqpbroker.cli", "serve", "--port", "0", "--data-dir",
                             str(data), "--config", str(cfg), "--log-level", "info", "--workers", str(max(members))],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    rx = re.compile(r"amqp-node listening on ([\d.]+):(\d+) \(node (\w+)\)")
    nodes: dict[str, str] = {}
    deadline = time.monotonic() + 60
    for line in proc.stderr:
        m = rx.search(line)
        if m:
            nodes[m.group(3)] = f"amqp://{m.group(1)}:{m.group(2)}"
            if len(nodes) == max(members):
                threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
                return proc, nodes["n0"]
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise SystemExit("cluster did not start")


def tree_cpu_seconds(pid: int) -> float:
    """CPU of a process and its children (the workers of a cluster)."""
    total = cpu_seconds(pid)
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    return total + sum(tree_cpu_seconds(int(c)) for c in children)


def cluster_main(args: argparse.Namespace) -> int:
    members = sorted(int(k) for k in args.members.split(","))
    n = args.messages
    tmp = Path(tempfile.mkdtemp(prefix="spark-cluster-bench-"))
    proc, url = start_cluster(tmp / "data", members)
    results: dict = {"messages": n, "body_size": args.body_size, "members": [], "cores": os.cpu_count()}
    try:
        body = b"x" * args.body_size
        for k in members:
            t0 = time.perf_counter()
            with BrokerClient(ConnectionOptions(url=url)) as c:
                c.send(f"bench-p{k}", (Message(body=body, durable=True, group_id=f"g{i % 64}").encode()
                                       for i in range(n)), window=5000)
            print(f"fill bench-p{k} ({k} member(s)): {n} messages in {time.perf_counter() - t0:.1f} s", flush=True)
        os.environ["PYSPARK_PYTHON"] = sys.executable
        os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
        from pyspark.sql import SparkSession
        from pyspark.sql import functions as F

        from amqpbroker.spark import register

        spark = (SparkSession.builder.master(f"local[{max(members)}]").appName("amqp-cluster-bench")
                 .config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1")
                 .config("spark.driver.bindAddress", "127.0.0.1").config("spark.sql.shuffle.partitions", "2")
                 .config("spark.driver.memory", "2g").getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
        register(spark)
        with BrokerClient(ConnectionOptions(url=url)) as c:
            c.send("bench-warm", (Message(body=body, durable=True).encode() for _ in range(1000)))
        # Warm-up: Python workers started, source code loaded.
        spark.read.format("amqp").option("url", url).option("address", "bench-warm").load().count()
        for _ in range(args.repeat):
            for k in members:   # interleaved: each member count once per round
                df = spark.read.format("amqp").option("url", url).option("address", f"bench-p{k}") \
                    .option("credit", str(args.credit)).load()
                t0, c0 = time.perf_counter(), tree_cpu_seconds(proc.pid)
                row = df.agg(F.count("*").alias("n")).collect()[0]
                dt = time.perf_counter() - t0
                assert row.n == n, (row.n, n)
                r = {"members": k, "seconds": dt, "msgs_per_s": n / dt,
                     "brokers_cpu_s": tree_cpu_seconds(proc.pid) - c0}
                results["members"].append(r)
                print(f"read  {k} member(s), {df.rdd.getNumPartitions()} task(s): {n} rows in {dt:.1f} s = "
                      f"{n / dt:,.0f} msg/s (brokers' CPU {r['brokers_cpu_s']:.1f} s)", flush=True)
        best = {k: max(r["msgs_per_s"] for r in results["members"] if r["members"] == k) for k in members}
        for k in members[1:]:
            print(f"{k} members / {members[0]}: {best[k] / best[members[0]]:.2f}x (best of {args.repeat})")
        spark.stop()
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        subprocess.run(["rm", "-rf", str(tmp)])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", action="store_true", help="read partitioned queues of a cluster (--members)")
    ap.add_argument("--members", default="1,2", help="with --cluster: member counts to compare")
    ap.add_argument("--repeat", type=int, default=2, help="with --cluster: rounds (interleaved)")
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--write-messages", type=int, default=None, help="default: --messages / 5")
    ap.add_argument("--body-size", type=int, default=100)
    ap.add_argument("--partitions", default="1,2,4")
    ap.add_argument("--write-partitions", default="1,2")
    ap.add_argument("--credit", type=int, default=2000)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.cluster:
        return cluster_main(args)
    n = args.messages
    w = args.write_messages or max(1, n // 5)
    tmp = Path(tempfile.mkdtemp(prefix="spark-bench-"))
    proc, url = start_broker(tmp / "data")
    results: dict = {"messages": n, "body_size": args.body_size, "read": [], "write": [],
                     "cores": os.cpu_count()}
    try:
        opts = ConnectionOptions(url=url)
        body = b"x" * args.body_size
        t0, c0 = time.perf_counter(), cpu_seconds(proc.pid)
        with BrokerClient(opts) as c:
            c.send("bench-in", (Message(body=body, durable=True, subject=f"k{i % 16}").encode() for i in range(n)),
                   window=5000)
            info = c.queue_info("bench-in")
        dt = time.perf_counter() - t0
        results["fill"] = {"seconds": dt, "msgs_per_s": n / dt, "broker_cpu_s": cpu_seconds(proc.pid) - c0}
        print(f"fill: {n} durable messages of {args.body_size} B in {dt:.1f} s = {n / dt:,.0f} msg/s "
              f"(queue head {int(info['head'])} tail {int(info['tail'])})", flush=True)

        os.environ["PYSPARK_PYTHON"] = sys.executable
        os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
        from pyspark.sql import SparkSession
        from pyspark.sql import functions as F

        from amqpbroker.spark import register

        most = max(int(p) for p in (args.partitions + "," + args.write_partitions).split(","))
        spark = (SparkSession.builder.master(f"local[{most}]").appName("amqp-bench")
                 .config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1")
                 .config("spark.driver.bindAddress", "127.0.0.1").config("spark.sql.shuffle.partitions", "2")
                 .config("spark.driver.memory", "2g").getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
        register(spark)
        def base():   # a fresh DataFrameReader each time (option() mutates it)
            return spark.read.format("amqp").option("url", url).option("address", "bench-in") \
                .option("credit", str(args.credit))

        # Warm-up: Python workers started, source code loaded.
        base().option("endingOffsets", '{"bench-in": 1000}').load().agg(F.count("*")).collect()

        for p in (int(x) for x in args.partitions.split(",")):
            df = base().option("numPartitions", str(p)).load()
            t0, c0 = time.perf_counter(), cpu_seconds(proc.pid)
            row = df.agg(F.count("*").alias("n"), F.sum(F.length("body")).alias("bytes")).collect()[0]
            dt = time.perf_counter() - t0
            assert row.n == n, (row.n, n)
            r = {"partitions": p, "seconds": dt, "msgs_per_s": n / dt, "broker_cpu_s": cpu_seconds(proc.pid) - c0}
            results["read"].append(r)
            print(f"read  {p} partition(s): {n} rows in {dt:.1f} s = {n / dt:,.0f} msg/s "
                  f"(broker CPU {r['broker_cpu_s']:.1f} s)", flush=True)

        for p in (int(x) for x in args.write_partitions.split(",")):
            address = f"bench-out-{p}"
            df = spark.range(0, w, numPartitions=p).select(
                F.format_string("message %d", "id").alias("body"),
                F.format_string("k%d", F.col("id") % 16).alias("subject"))
            t0, c0 = time.perf_counter(), cpu_seconds(proc.pid)
            df.write.format("amqp").option("url", url).option("address", address) \
                .option("batchSize", "2000").mode("append").save()
            dt = time.perf_counter() - t0
            with BrokerClient(opts) as c:
                depth = int(c.queue_info(address)["depth"])
            assert depth == w, (depth, w)
            r = {"partitions": p, "messages": w, "seconds": dt, "msgs_per_s": w / dt,
                 "broker_cpu_s": cpu_seconds(proc.pid) - c0}
            results["write"].append(r)
            print(f"write {p} partition(s): {w} rows in {dt:.1f} s = {w / dt:,.0f} msg/s "
                  f"(durable, duplicate detection on; broker CPU {r['broker_cpu_s']:.1f} s)", flush=True)
        spark.stop()
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        subprocess.run(["rm", "-rf", str(tmp)])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
