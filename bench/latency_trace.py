#!/usr/bin/env python3
"""Where a slow message's time went: the broker's loop timeline around it (a
benchmark tool: it prints, it asserts nothing).

Starts amqpbroker with AMQPBROKER_LOOP_TRACE (amqpbroker/looptrace.py), warms it
up, runs amqp-bench at a moderate rate through a fresh queue, stops the broker
(the trace is written at exit) and reads the trace: every message of the run is
found in the socket read that brought it and in the write that delivered it, by
the stamp amqp-bench puts in its body (sequence number, send time).  Prints

* per message, send → read (the client and the kernel), read → write (the broker);
* what the slow ones (send → write above --slow ms) have in common: how many
  transfers the read that brought them carried, how many deliveries the broker
  handled between their read and their write, and the loop events in that span
  (garbage collections, timers, store hand-offs and commits);
* the loop timeline around the slowest one: reads (bytes, stamped messages),
  pumps (deliveries handled), flushes and writes, timers, gc, store hand-offs.

    .venv/bin/python bench/latency_trace.py                               # this tree
    .venv/bin/python bench/latency_trace.py --baseline-src /tmp/before    # the code before a change
    .venv/bin/python bench/latency_trace.py --trace-out /tmp/loop.trace   # keep the raw trace

Times are CLOCK_MONOTONIC in the broker; amqp-bench stamps CLOCK_REALTIME, lined up
with the offset the trace's header records.  The tracer costs a little per read and
write, so absolute figures are a bit above an untraced run's.
"""
from __future__ import annotations

import argparse
import bisect
import os
import subprocess
import sys
import tempfile
import uuid
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rates import AMQP_BENCH, amqp_bench  # noqa: E402
from run import AMQPBROKER, AmqpBroker, BaselineBroker, BrokerStartError, log  # noqa: E402


class TracedBroker(AmqpBroker):
    def __init__(self, args, trace: Path, base=AmqpBroker):
        super().__init__(args)
        self.trace = trace
        self.base = base

    def _spawn(self, cmd, env=None, cwd=None):
        env = dict(env or os.environ, AMQPBROKER_LOOP_TRACE=str(self.trace))
        super()._spawn(cmd, env=env, cwd=cwd)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()          # a clean stop: the trace is written at exit
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        super().stop()


class TracedBaseline(TracedBroker, BaselineBroker):
    pass


def load(path: Path) -> tuple[list[tuple[int, str, int, int]], int]:
    rows, offset = [], 0
    with open(path) as f:
        for line in f:
            if line.startswith("#"):
                parts = line.split()
                offset = int(parts[2]) - int(parts[4])    # realtime - monotonic
                continue
            t, kind, conn, n = line.rstrip("\n").split("\t")
            rows.append((int(t), kind, int(conn), int(n)))
    return rows, offset


def messages(rows, offset: int, first_row: int, count: int) -> dict[int, dict]:
    """seq → {send, read (row index), write (row index)} for the run's messages."""
    out: dict[int, dict] = {}
    last = None
    for i in range(first_row, len(rows)):
        t, kind, conn, n = rows[i]
        if kind == "in" and n < count and n not in out:
            out[n] = {"read": i, "conn_in": conn}
            last = n
        elif kind == "stamp" and last is not None and "send" not in out[last]:
            out[last]["send"] = n - offset if conn == 1 else n
        elif kind == "out" and n in out and "write" not in out[n]:
            out[n]["write"] = i
            out[n]["conn_out"] = conn
    return {s: m for s, m in out.items() if "write" in m and "send" in m}


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * (len(v) - 1)))]


def describe(rows, msgs: dict, slow_ms: float) -> None:
    times = [r[0] for r in rows]
    t = lambda i: rows[i][0]  # noqa: E731
    e2e = {s: (t(m["write"]) - m["send"]) / 1e6 for s, m in msgs.items()}
    inb = {s: (t(m["write"]) - t(m["read"])) / 1e6 for s, m in msgs.items()}
    arr = {s: (t(m["read"]) - m["send"]) / 1e6 for s, m in msgs.items()}
    print(f"{len(msgs):,} messages followed through the broker")
    for name, d in (("send → broker read ", arr), ("broker read → write", inb), ("send → broker write", e2e)):
        vals = list(d.values())
        print(f"  {name}: p50 {pct(vals, .5):.3f}  p99 {pct(vals, .99):.3f}  max {max(vals):.3f} ms")
    reads = [i for i, r in enumerate(rows) if r[1] == "read"]
    per_read = Counter(reads[bisect.bisect_right(reads, m["read"]) - 1] for m in msgs.values())
    bursts = sorted(i for i, k in per_read.items() if k > 16)
    for i in bursts[:5]:
        group = [s for s, m in msgs.items() if reads[bisect.bisect_right(reads, m["read"]) - 1] == i]
        lat = [e2e[s] for s in group]
        first_write = min(msgs[s]["write"] for s in group)
        handled = sum(1 for r in rows[i:first_write] if r[1] == "dlv" and r[2] == rows[i][2])
        print(f"  a read of {rows[i][3]:,} B brought {len(group)} of the run's messages at once "
              f"(sequence {min(group)}-{max(group)}): send → write {min(lat):.3f} to {max(lat):.3f} ms; "
              f"the first of them was written after the broker had handled {handled} transfers of that read")
    slow = sorted((s for s in msgs if e2e[s] > slow_ms), key=lambda s: -e2e[s])
    print(f"\n{len(slow)} message(s) slower than {slow_ms} ms send → write "
          f"({100 * len(slow) / max(1, len(msgs)):.2f} %); what each waited for:")
    if not slow:
        return
    kinds = Counter()
    for s in slow:
        m = msgs[s]
        lo = bisect.bisect_left(times, m["send"])
        span = Counter(r[1] for r in rows[lo:m["write"]])
        events = [k for k in ("gc", "timer", "wakeup", "handoff", "commit") if span[k]]
        if span["dlv"] > 16:
            kinds["behind other deliveries the loop handled first (> 16 between its send and its write)"] += 1
        elif events:
            kinds["loop events in between: " + ", ".join(events)] += 1
        elif not any(r[1] in ("pump", "dlv", "flush") for r in rows[lo:m["read"]]):
            kinds["the loop was idle until its read: the client, the kernel or the scheduler held it"] += 1
        else:
            kinds["other"] += 1
    for what, n in kinds.most_common():
        print(f"  {n:6d}  {what}")
    worst = msgs[slow[0]]
    print(f"\nthe slowest, message {slow[0]}: sent {e2e[slow[0]]:.3f} ms before it was written "
          f"({arr[slow[0]]:.3f} ms to the broker's read, {inb[slow[0]]:.3f} ms in the broker); "
          f"the loop from its send to its write:")
    timeline(rows, worst, bisect.bisect_left(times, worst["send"]))


def timeline(rows, m: dict, start: int) -> None:
    """Rows from the message's send to its write, compressed: stamped ins/outs and
    deliveries counted into the row they follow, runs of pumps folded."""
    t0 = m["send"]
    names: dict[int, str] = {}
    pending = Counter()
    folded = 0
    print(f"{'ms since send':>13}  event")
    for i in range(max(0, start - 3), min(len(rows), m["write"] + 2)):
        t, kind, conn, n = rows[i]
        if kind in ("in", "out", "dlv", "stamp"):
            pending[kind] += 1
            continue
        who = names.setdefault(conn, f"conn{len(names) + 1}") if kind in ("read", "pump", "write", "timer") else ""
        if kind == "pump" and rows[i - 1][1] == "dlv" and i + 1 < len(rows) and rows[i + 1][1] == "dlv" \
                and i not in (m["read"], m["write"]):
            folded += 1
            continue
        extra = ", ".join(f"{v} {k}" for k, v in pending.items() if k != "stamp")
        if folded:
            extra = f"{folded} more pumps, " + extra
        pending.clear()
        folded = 0
        what = {"read": f"read {n:,} B", "write": f"write {n:,} B", "pump": "pump",
                "flush": "flush start" if n >= 0 else "flush end", "gc": f"gc gen {n}" if n >= 0 else "gc end",
                "handoff": f"store hand-off of batch {n}", "commit": f"store commit up to batch {n}",
                "timer": "transport timer", "wakeup": "delayed-delivery timer"}.get(kind, kind)
        mark = "   <- its read" if i == m["read"] else ("   <- its write" if i == m["write"] else "")
        print(f"{(t - t0) / 1e6:13.3f}  {what} {who}{(' (' + extra + ' before)') if extra else ''}{mark}")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--messages", type=int, default=10_000)
    ap.add_argument("--warmup", type=int, default=20_000)
    ap.add_argument("--slow", type=float, default=1.0, help="ms send → write that counts as slow")
    ap.add_argument("--baseline-src", help="trace amqpbroker from this source tree instead")
    ap.add_argument("--trace-out", help="keep the raw trace here")
    ap.add_argument("--amqpbroker-bin", default=str(AMQPBROKER))
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--start-timeout", type=float, default=30.0)
    args = ap.parse_args(argv)
    args.keep_tmp = False
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not AMQP_BENCH.exists():
        print(f"{AMQP_BENCH} missing: run bench/build.sh", file=sys.stderr)
        return 2
    trace = Path(args.trace_out or Path(tempfile.mkdtemp(prefix="bench-trace-")) / "loop.trace")
    broker = TracedBaseline(args, trace) if args.baseline_src else TracedBroker(args, trace)
    try:
        broker.start()
        if args.warmup:
            amqp_bench(broker, f"warm-{uuid.uuid4().hex[:6]}", 0, args.warmup, args.timeout)
        res = amqp_bench(broker, f"trace-{uuid.uuid4().hex[:6]}", args.rate, args.messages, args.timeout)
        log(f"amqp-bench at {args.rate:.0f} msgs/s: p50 {res['p50']} p99 {res['p99']} max {res['max']} ms "
            f"{res.get('error', '')}")
    except BrokerStartError as exc:
        print(f"broker failed to start: {exc}", file=sys.stderr)
        return 1
    finally:
        broker.stop()
    if not trace.exists():
        print(f"no trace written at {trace} (does this broker have amqpbroker/looptrace.py?)", file=sys.stderr)
        return 1
    rows, offset = load(trace)
    # the run's messages: after the last sequence number 0 read (the warm-up came first)
    first = max(i for i, r in enumerate(rows) if r[1] == "in" and r[3] == 0)
    msgs = messages(rows, offset, first, args.messages)
    print(f"\namqp-bench (independent tool) at {args.rate:.0f} msgs/s: p50 {res['p50']}  p99 {res['p99']}  "
          f"max {res['max']} ms (receive time at the client)")
    describe(rows, msgs, args.slow)
    return 0


if __name__ == "__main__":
    sys.exit(main())
