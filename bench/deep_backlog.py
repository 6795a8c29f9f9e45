#!/usr/bin/env python3
"""Durable p2p with a deep backlog vs with an empty queue, in one broker run (issue 15).

1. start amqpbroker (defaults: the deep queue is mostly a paged region);
2. fill queue `deep` with --backlog durable messages (loadgen --receivers 0);
3. interleaved, --reps times each: durable p2p (1 sender, 1 receiver, --messages)
   on an empty queue, then on `deep` (the receiver drains the oldest backlog
   messages while the sender adds as many: the backlog stays deep);
4. print both medians and their ratio (target >= 0.8); with RabbitMQ installed
   (bench/setup.sh), also RabbitMQ durable p2p through bench/run.py's runner.

    .venv/bin/python bench/deep_backlog.py                     # 200,000 backlog
    .venv/bin/python bench/deep_backlog.py --reps 5 --messages 50000

A benchmark: it prints figures and asserts nothing.  Every process it starts is
killed in a finally block.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from backlog import Broker, loadgen, log  # bench/backlog.py: one broker, loadgen runs
from run import rabbitmq_durable_rate  # bench/run.py: RabbitMQ through its runner


def p2p(url: str, queue: str, a: argparse.Namespace) -> dict:
    return loadgen(url, ["--address", queue, "--messages", str(a.messages), "--size", str(a.size),
                         "--senders", "1", "--receivers", "1", "--window", str(a.window),
                         "--credit", str(a.credit), "--durable", "--drain-backlog"], a.timeout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backlog", type=int, default=200_000)
    ap.add_argument("--messages", type=int, default=50_000, help="per p2p run")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--window", type=int, default=1000)
    ap.add_argument("--credit", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--no-rabbitmq", action="store_true")
    ap.add_argument("--json", metavar="OUT")
    a = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="deep-backlog-"))
    broker = Broker(tmp / "data", tmp / "broker.log", None)
    empty: list[float] = []
    deep: list[float] = []
    try:
        broker.start()
        url = f"amqp://127.0.0.1:{broker.port}"
        log(f"filling a backlog of {a.backlog:,} x {a.size} B")
        fill = loadgen(url, ["--address", "deep", "--messages", str(a.backlog), "--size", str(a.size),
                             "--senders", "1", "--receivers", "0", "--window", str(a.window), "--durable"],
                       a.timeout)
        if fill.get("sent") != a.backlog:
            raise RuntimeError(f"fill failed: {fill}")
        for rep in range(a.reps):
            for name, queue, out in (("empty", f"empty{rep}", empty), ("deep", "deep", deep)):
                r = p2p(url, queue, a)
                rate = r.get("msgs_per_s") if not r.get("timeout") and "error" not in r else None
                log(f"rep {rep} {name:5}: {rate or 0:>10,.0f} msgs/s  {'' if rate else r}")
                if rate:
                    out.append(rate)
    finally:
        broker.stop()
        broker.kill()
    rabbit = None if a.no_rabbitmq else rabbitmq_durable_rate(a.messages, a.size, a.reps, log)
    me, md = (statistics.median(v) if v else 0.0 for v in (empty, deep))
    print(f"durable p2p, {a.messages:,} x {a.size} B, median of {a.reps}:")
    print(f"  empty queue              {me:>10,.0f} msgs/s   {[round(x) for x in empty]}")
    print(f"  {a.backlog:,} backlog       {md:>10,.0f} msgs/s   {[round(x) for x in deep]}")
    print(f"  deep / empty             {md / me if me else 0:>10.2f}   (target >= 0.8)")
    if rabbit:
        print(f"  RabbitMQ durable p2p     {rabbit:>10,.0f} msgs/s   deep / RabbitMQ {md / rabbit:.2f} (target >= 1.5)")
    else:
        print("  RabbitMQ: not installed (bench/setup.sh) or skipped")
    if a.json:
        Path(a.json).write_text(json.dumps({"empty": empty, "deep": deep, "rabbitmq": rabbit}))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
