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

    .venv/bin/python bench/sync_send.py [--messages 3000] [--reps 3] [--baseline-src DIR] [--trace]

With --trace, one more run of this tree with AMQPBROKER_LOOP_TRACE (the broker's
loop trace and its writer process's, amqpbroker/looptrace.py) of each tree (the
baseline's too when its writer process traces): where one send's round trip
goes, stage by stage (medians over the run's messages; the tracer itself adds a
little to each stage):

    client     the broker's write of the last outcome → the client's next send
    to broker  the send → the broker's socket read that brought it
    route      read → the store batch handed over (decode, route, the loop turn)
    hand-over  sealed, pickled, written to the writer's pipe
    wake       → the writer process has it (select, wake-up)
    commit     the writer's commit of the group, in parts:
      read       readv and unpickle the batch frames
      append     the journal record encoded, written (pwrite), its write-back started
      lmdb       the LMDB transaction (no sync), while the device writes the record
                 (before that change: the transaction first, then the record)
      fdatasync  the journal's fdatasync (after the later of the two): what is left
                 of the record's write, the device's cache flush
    reply      the commit result written back
    result     → the broker read it (wake-up, unpickle)
    settle     callbacks, the outcome settled, the loop turn, the socket write

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

# (name, from, to): rows of the broker's trace and its writer's
STAGES = (("client", "write-", "stamp"), ("to broker", "stamp", "in"), ("route", "in", "handoff"),
          ("hand-over", "handoff", "piped"), ("wake", "piped", "w-wake"), ("commit", "w-wake", "w-sync"),
          ("reply", "w-sync", "w-result"), ("result", "w-result", "commit"), ("settle", "commit", "write"))
PATH = ("handoff", "piped", "w-wake", "w-read", "w-first", "w-second", "w-sync", "w-result", "commit", "write")
GOAL = 0.5
PARTS = (("read", "w-wake", "w-read"), ("append", "w-write-from", "w-write"), ("lmdb", "w-txn-from", "w-txn"),
         ("fdatasync", "w-second", "w-sync"))


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


def read_trace(path: Path) -> tuple[dict[str, list[int]], dict[int, int]]:
    """Row times by kind, and the loadgen send time (ns, CLOCK_MONOTONIC) of each
    stamped message by its read's time."""
    times: dict[str, list[int]] = {}
    sent: dict[int, int] = {}
    last_in = None
    with open(path) as f:
        for line in f:
            if line.startswith("#"):
                continue
            t, kind, conn, n = line.split("\t")
            t = int(t)
            if kind == "stamp":
                if conn == "0" and last_in is not None:   # loadgen's clock: CLOCK_MONOTONIC
                    sent[last_in] = int(n)
                continue
            if kind == "in":
                last_in = t
            times.setdefault(kind, []).append(t)
    return times, sent


def breakdown(trace: Path, skip: int = 100) -> dict[str, list[float]] | None:
    """Microseconds of each stage (STAGES, PARTS) per message, from the broker's trace
    and its writer's: one message in flight, so each row of PATH is the first of its
    kind after the one before, all before the next message's read."""
    import bisect
    times, sent = read_trace(trace)
    wtimes, _ = read_trace(Path(str(trace) + ".writer"))
    times.update(wtimes)
    reads = sorted(sent)
    out: dict[str, list[float]] = {name: [] for name, _, _ in STAGES + PARTS}
    out["round trip"] = []

    def first(kind: str, after: int, before: int) -> int | None:
        rows = times.get(kind, [])
        j = bisect.bisect_left(rows, after)
        return rows[j] if j < len(rows) and rows[j] < before else None

    prev_write = None
    for i, t_in in enumerate(reads[:-1]):
        t_next = reads[i + 1]
        at = {"stamp": sent[t_in], "in": t_in, "write-": prev_write}
        prev_write = None
        t = t_in
        for kind in PATH:
            if kind == "w-first":   # the journal write and the LMDB transaction, in either order
                w, x = first("w-write", t, t_next), first("w-txn", t, t_next)
                if w is None or x is None:
                    break
                at["w-write"], at["w-txn"] = w, x
                at["w-first"], at["w-second"] = min(w, x), max(w, x)
                at["w-write-from"] = t if w < x else x
                at["w-txn-from"] = t if x < w else w
                t = at["w-second"]
                continue
            if kind == "w-second":
                continue
            t = at[kind] = first(kind, t, t_next)
            if t is None:
                break
        else:
            prev_write = at["write"]
            if i >= skip:
                for name, a, b in STAGES + PARTS:
                    if at[a] is not None:
                        out[name].append((at[b] - at[a]) / 1e3)
                out["round trip"].append((sent[t_next] - sent[t_in]) / 1e3)
    return out if out["round trip"] else None


def traced_run(tmp: Path, a, label: str, src: str | None = None) -> dict[str, list[float]] | None:
    trace = tmp / f"loop-{len(label)}.trace"
    os.environ["AMQPBROKER_LOOP_TRACE"] = str(trace)
    broker = Broker(tmp / f"data-traced-{len(label)}", tmp / "traced.log", None, src=Path(src) if src else None)
    try:
        broker.start()
    finally:
        del os.environ["AMQPBROKER_LOOP_TRACE"]
    try:
        r = loadgen(f"amqp://127.0.0.1:{broker.port}", ["--address", "traced", "--messages", str(a.messages),
                    "--size", "256", "--senders", "1", "--receivers", "0", "--window", "1", "--durable"],
                    a.timeout)
        log(f"traced run: {label}: {r.get('msgs_per_s', 0):,.0f} msgs/s")
    finally:
        broker.stop()
        broker.kill()
    if not Path(str(trace) + ".writer").exists():
        log(f"traced run: {label}: no writer trace (that tree's writer process does not trace)")
        return None
    return breakdown(trace)


def print_breakdown(label: str, stages: dict[str, list[float]] | None) -> None:
    if not stages:
        print(f"  {label}, traced run: no complete message timeline in the trace")
        return
    total = statistics.median(stages["round trip"])
    print(f"  {label}: where one send goes (traced run, medians of {len(stages['round trip']):,} messages):")
    for name, _, _ in STAGES:
        rows = [(name, "    ")] + ([(p, "      ") for p, _, _ in PARTS] if name == "commit" else [])
        for part, indent in rows:
            v = stages[part]
            if v:
                m = statistics.median(v)
                p90 = statistics.quantiles(v, n=10)[-1] if len(v) > 1 else m
                print(f"{indent}{part:<14}{m:>8,.0f} us  {m / total:>4.0%}   (p90 {p90:,.0f} us)")
    print(f"    {'sum':<14}{sum(statistics.median(stages[n]) for n, _, _ in STAGES if stages[n]):>8,.0f} us"
          f"   round trip (send to next send) {total:,.0f} us")


def run_options(doc: str) -> argparse.ArgumentParser:
    """The options of a run of one-producer window-1 sends (this bench and sync_floor.py)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=3000, help="per run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--fsyncs", type=int, default=500)
    ap.add_argument("--timeout", type=float, default=300)
    return ap


def main(argv=None) -> int:
    ap = run_options(__doc__)
    ap.add_argument("--baseline-src", help="a source tree holding amqpbroker/ (the code before a change)")
    ap.add_argument("--trace", action="store_true", help="one more run, traced: where a send's time goes")
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
    if a.trace:
        for s in subjects:
            s.stages = traced_run(tmp, a, s.label, a.baseline_src if s.label.endswith("before") else None)
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
    for s in subjects if a.trace else []:
        print_breakdown(s.label, s.stages)
    print("(a shared machine's disk: compare within the run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
