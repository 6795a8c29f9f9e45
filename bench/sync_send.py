#!/usr/bin/env python3
"""Synchronous durable sends (the Qpid JMS default) against the disk's fsync time.

Qpid JMS sends a persistent message and waits for its outcome before the next
(`send()` is synchronous unless `jms.forceAsyncSend`): one producer, one message
in flight, so every message costs a whole store commit and nothing can be grouped.
In one run:

1. the disk: --fsyncs x (4 KiB pwrite + fsync) of a file in the broker's data dir,
   the median fsync time (and the same with fdatasync);
2. the broker: loadgen, 1 sender, `--window 1` (one unsettled delivery: the next
   message goes once the last one is Accepted), --messages durable 256 B to a queue
   with no consumer, --reps times (interleaved with the baseline's runs, with
   --baseline-src: the code before a change, in the same run);
3. the broker's own commit latency over the same runs, from its /metrics
   (amqpbroker_store_commit_seconds: the writer process's commit: the LMDB
   transaction, without a sync, and the journal's append and fdatasync; before the
   journal, LMDB's two syncs).

Prints the median rate, one commit's time and the round trip per message, each
against the fsync time:

    rate / (1 / fsync)          target >= 0.5: a send costs one fsync plus the round trip
    commit time / fsync         one fdatasync per commit (store/journal.py)
    round trip - commit         what the hand-over to the writer process and back,
                                the settlement and the client's next send cost

    .venv/bin/python bench/sync_send.py [--messages 3000] [--reps 3] [--baseline-src DIR]

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

GOAL = 0.5


def sync_time(directory: Path, n: int, sync=os.fsync) -> float:
    """Median seconds of one `sync` after a 4 KiB write, in `directory`."""
    path = directory / "fsync-probe"
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
    times = []
    try:
        for i in range(n):
            os.pwrite(fd, b"x" * 4096, (i % 16) * 4096)
            t = time.perf_counter()
            sync(fd)
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


class Subject:
    """One broker under test and what its runs measured."""

    def __init__(self, label: str, broker: Broker):
        self.label = label
        self.broker = broker
        self.rates: list[float] = []
        self.commit_s = self.commits = 0.0

    def run(self, rep: int, a) -> None:
        url = f"amqp://127.0.0.1:{self.broker.port}"
        s0, c0 = commit_totals(self.mport)
        r = loadgen(url, ["--address", f"sync{rep}", "--messages", str(a.messages), "--size", "256",
                          "--senders", "1", "--receivers", "0", "--window", "1", "--durable"], a.timeout)
        s1, c1 = commit_totals(self.mport)
        self.commit_s += s1 - s0
        self.commits += c1 - c0
        rate = r.get("msgs_per_s") if r.get("accepted") == a.messages else None
        log(f"rep {rep}: {self.label}: {rate or 0:,.0f} msgs/s  {'' if rate else r}")
        if rate:
            self.rates.append(rate)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=3000, help="per run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--fsyncs", type=int, default=500)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--baseline-src", help="a source tree holding amqpbroker/ (the code before a change)")
    a = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="sync-send-"))
    subjects = [Subject("amqpbroker", Broker(tmp / "data", tmp / "broker.log", None))]
    if a.baseline_src:
        subjects.append(Subject("amqpbroker before", Broker(tmp / "data-before", tmp / "before.log", None,
                                                            src=Path(a.baseline_src))))
    try:
        for s in subjects:
            s.broker.start()
            s.mport = management_port(s.broker)
        fsync = sync_time(tmp / "data", a.fsyncs)
        fdatasync = sync_time(tmp / "data", a.fsyncs, os.fdatasync)
        log(f"in the data dir: fsync {fsync * 1e6:,.0f} us, fdatasync {fdatasync * 1e6:,.0f} us "
            f"(medians of {a.fsyncs})")
        for rep in range(a.reps):
            for s in subjects[rep % len(subjects):] + subjects[:rep % len(subjects)]:
                s.run(rep, a)
    finally:
        for s in subjects:
            s.broker.stop()
            s.broker.kill()
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"synchronous durable sends, 1 producer, window 1, 256 B, median of {a.reps} x {a.messages:,}:")
    print(f"  fsync (4 KiB write + fsync) in the data dir   {fsync * 1e6:>8,.0f} us   1 / fsync = {1 / fsync:,.0f}/s"
          f"   (fdatasync {fdatasync * 1e6:,.0f} us)")
    for s in subjects:
        if not s.rates or not s.commits:
            print(f"  {s.label}: no measurement")
            continue
        rate = statistics.median(s.rates)
        commit = s.commit_s / s.commits
        trip = 1 / rate
        print(f"  {s.label}:")
        print(f"    sync send rate                             {rate:>8,.0f} msgs/s   {[round(x) for x in s.rates]}")
        print(f"    rate / (1 / fsync)                         {rate * fsync:>8.2f}      (target >= {GOAL}: "
              f"{'met' if rate * fsync >= GOAL else 'NOT met'})")
        print(f"    one commit (writer process)                {commit * 1e6:>8,.0f} us   = {commit / fsync:.1f} x fsync")
        print(f"    one round trip per message                 {trip * 1e6:>8,.0f} us   = {trip / fsync:.1f} x fsync; "
              f"beyond the commit: {(trip - commit) * 1e6:,.0f} us (hand-over to the writer and back, "
              f"settlement, the client's next send)")
    if len(subjects) == 2 and subjects[0].rates and subjects[1].rates:
        print(f"  rate after / before the change: "
              f"{statistics.median(subjects[0].rates) / statistics.median(subjects[1].rates):.2f}x")
    print("(a shared machine's disk: compare within the run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
