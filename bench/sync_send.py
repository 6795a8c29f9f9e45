#!/usr/bin/env python3
"""Synchronous durable sends (the Qpid JMS default) against the disk's fsync time.

Qpid JMS sends a persistent message and waits for its outcome before the next
(`send()` is synchronous unless `jms.forceAsyncSend`): one producer, one message
in flight, so every message costs a whole store commit and nothing can be grouped.
In one broker run:

1. the disk: --fsyncs x (4 KiB pwrite + fsync) of a file in the broker's data dir,
   the median fsync time;
2. the broker: loadgen, 1 sender, `--window 1` (one unsettled delivery: the next
   message goes once the last one is Accepted), --messages durable 256 B to a queue
   with no consumer, --reps times;
3. the broker's own commit latency over the same runs, from its /metrics
   (amqpbroker_store_commit_seconds: the writer process's LMDB commit, from the
   start of the transaction to the end of its syncs).

Prints the median rate, one commit's time and the round trip per message, each
against the fsync time:

    rate / (1 / fsync)          the issue's target: >= 0.8
    commit time / fsync         LMDB syncs twice per commit (data pages, then the
                                meta page: it cannot be durable with fewer)
    round trip - commit         what the hand-over to the writer process and back,
                                the settlement and the client's next send cost

    .venv/bin/python bench/sync_send.py [--messages 3000] [--reps 3]

A benchmark: it prints figures and asserts nothing.  Every process it starts is
killed in a finally block.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from backlog import Broker, loadgen, log  # bench/backlog.py: one broker, loadgen runs


def fsync_time(directory: Path, n: int) -> float:
    """Median seconds of one fsync after a 4 KiB write, in `directory`."""
    path = directory / "fsync-probe"
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
    times = []
    try:
        for i in range(n):
            os.pwrite(fd, b"x" * 4096, (i % 16) * 4096)
            t = time.perf_counter()
            os.fsync(fd)
            times.append(time.perf_counter() - t)
    finally:
        os.close(fd)
        path.unlink()
    return statistics.median(times)


def commit_totals(port: int) -> tuple[float, float]:
    """(sum of commit seconds, commits) from the broker's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()

    def value(name: str) -> float:
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0
    return value("amqpbroker_store_commit_seconds_sum"), value("amqpbroker_store_commit_seconds_count")


def management_port(broker: Broker) -> int:
    text = "".join(line for _, line in broker.lines)
    m = re.search(r"(?:management|http).*?127\.0\.0\.1:(\d+)", text)
    if not m:
        raise RuntimeError("no management port in the broker's log")
    return int(m.group(1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=3000, help="per run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--fsyncs", type=int, default=500)
    ap.add_argument("--timeout", type=float, default=300)
    a = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="sync-send-"))
    broker = Broker(tmp / "data", tmp / "broker.log", None)
    rates: list[float] = []
    try:
        broker.start()
        url = f"amqp://127.0.0.1:{broker.port}"
        mport = management_port(broker)
        fsync = fsync_time(tmp / "data", a.fsyncs)
        log(f"fsync in the data dir: {fsync * 1e6:,.0f} us (median of {a.fsyncs})")
        s0, c0 = commit_totals(mport)
        for rep in range(a.reps):
            r = loadgen(url, ["--address", f"sync{rep}", "--messages", str(a.messages), "--size", "256",
                              "--senders", "1", "--receivers", "0", "--window", "1", "--durable"], a.timeout)
            rate = r.get("msgs_per_s") if r.get("accepted") == a.messages else None
            log(f"rep {rep}: {rate or 0:,.0f} msgs/s  {'' if rate else r}")
            if rate:
                rates.append(rate)
        s1, c1 = commit_totals(mport)
    finally:
        broker.stop()
        broker.kill()
    shutil.rmtree(tmp, ignore_errors=True)
    if not rates or c1 <= c0:
        print("no measurement")
        return 1
    rate = statistics.median(rates)
    commit = (s1 - s0) / (c1 - c0)
    trip = 1 / rate
    print(f"synchronous durable sends, 1 producer, window 1, 256 B, median of {len(rates)} x {a.messages:,}:")
    print(f"  fsync (4 KiB write + fsync) in the data dir   {fsync * 1e6:>8,.0f} us   1 / fsync = {1 / fsync:,.0f}/s")
    print(f"  sync send rate                               {rate:>8,.0f} msgs/s   {[round(x) for x in rates]}")
    print(f"  rate / (1 / fsync)                           {rate * fsync:>8.2f}      (issue target >= 0.8)")
    print(f"  one commit (writer process, LMDB)            {commit * 1e6:>8,.0f} us   = {commit / fsync:.1f} x fsync "
          f"(LMDB syncs data pages, then the meta page)")
    print(f"  one round trip per message                   {trip * 1e6:>8,.0f} us   = {trip / fsync:.1f} x fsync; "
          f"beyond the commit: {(trip - commit) * 1e6:,.0f} us (hand-over to the writer and back, settlement, "
          f"the client's next send)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
