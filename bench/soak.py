#!/usr/bin/env python3
"""Crash/restart soak: the crash test of tests/e2e/test_crash.py, many times over.

Each cycle: a producer sends durable messages (unsettled, window 1000) as fast as it
can to one queue -- in `consume` cycles a consumer accepts at the same time -- and
the broker is SIGKILLed once a random number of sends were Accepted; the broker is
restarted on the same store and the queue drained.  Per cycle it prints

    accepted  (sends the producer saw Accepted)
    recovered (distinct messages of this cycle found after the restart)
    lost      (Accepted, not consumed before the crash, not recovered: must be 0)
    dup       (copies beyond the first of one message within the drain: must be 0)
    back      (consumed before the crash and delivered again, marked redelivered)
    unmarked  (delivered again with delivery-count 0: must be 0)

    .venv/bin/python bench/soak.py --cycles 20
    .venv/bin/python bench/soak.py --cycles 50 --mode consume --max-seconds 900 --seed 7

Exit status 0 when every cycle passed, 1 otherwise.  A benchmark-style tool: one
broker process at a time, bounded by --cycles and --max-seconds.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.broker_process import BrokerProcess  # noqa: E402
from tests.e2e.crash_support import assess, drain, produce_until_crash  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--max-seconds", type=float, default=600.0, help="stop starting cycles after this")
    ap.add_argument("--mode", choices=["produce", "consume", "alternate"], default="alternate",
                    help="producer only, producer + consumer, or alternate (default)")
    ap.add_argument("--kill-min", type=int, default=500, help="fewest accepted sends before the kill")
    ap.add_argument("--kill-max", type=int, default=5000, help="most accepted sends before the kill")
    ap.add_argument("--kill-delay-max", type=float, default=0.05,
                    help="the kill comes a random 0..this many seconds after the threshold")
    ap.add_argument("--size", type=int, default=0, help="body bytes (0: the sequence number)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (0: pick one)")
    ap.add_argument("--config", help="TOML text for the broker (e.g. a small queue_memory_budget)")
    ap.add_argument("--keep", action="store_true", help="keep the data directory")
    args = ap.parse_args(argv)

    seed = args.seed or random.randrange(1, 10**6)
    rng = random.Random(seed)
    tmp = Path(tempfile.mkdtemp(prefix="amqpbroker-soak-"))
    broker = BrokerProcess(tmp / "data", config=args.config)
    queue = f"soak-{uuid.uuid4().hex[:8]}"
    body = b"s" * args.size if args.size else None
    print(f"soak: seed {seed}, queue {queue}, data {tmp}", flush=True)
    header = (f"{'cycle':>5} {'mode':8} {'sent':>7} {'accepted':>8} {'consumed':>8} {'recovered':>9} "
              f"{'lost':>4} {'dup':>4} {'back':>5} {'unmarked':>8} {'other':>5} {'restart s':>9} {'total s':>7}")
    print(header, flush=True)
    failures = 0
    totals = dict(accepted=0, recovered=0, lost=0, dup=0, back=0, unmarked=0)
    drained_before: dict[str, int] = {}
    started = time.monotonic()
    done = 0
    try:
        broker.start()
        for cycle in range(args.cycles):
            if time.monotonic() - started > args.max_seconds:
                print(f"soak: --max-seconds reached after {cycle} cycle(s)")
                break
            consume = args.mode == "consume" or (args.mode == "alternate" and cycle % 2 == 1)
            t0 = time.monotonic()
            traffic = produce_until_crash(broker, queue, f"s{cycle}", rng.randint(args.kill_min, args.kill_max),
                                          consume=consume, body=body,
                                          kill_delay=rng.uniform(0, args.kill_delay_max))
            t1 = time.monotonic()
            broker.start()
            restart = time.monotonic() - t1
            got = drain(broker.url, queue)
            a = assess(traffic, got, drained_before)
            drained_before.update(got)
            other = len(a.rejected_present) + len(a.unknown) + a.out_of_order + len(traffic.errors)
            bad = (not a.ok) or bool(traffic.errors) or not traffic.killed
            failures += bad
            done += 1
            for k, v in (("accepted", a.accepted), ("recovered", a.recovered), ("lost", len(a.lost)),
                         ("dup", a.duplicates), ("back", a.came_back_after_taken),
                         ("unmarked", len(a.unmarked_repeats))):
                totals[k] += v
            print(f"{cycle + 1:>5} {'consume' if consume else 'produce':8} {len(traffic.sent):>7} "
                  f"{a.accepted:>8} {a.taken_before_crash:>8} {a.recovered:>9} {len(a.lost):>4} "
                  f"{a.duplicates:>4} {a.came_back_after_taken:>5} {len(a.unmarked_repeats):>8} {other:>5} "
                  f"{restart:>9.2f} {time.monotonic() - t0:>7.1f}"
                  + ("  FAIL: " + (a.problems() or "; ".join(traffic.errors) or "not killed") if bad else ""),
                  flush=True)
    finally:
        broker.stop()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"soak: {done} cycle(s) in {time.monotonic() - started:.0f} s, {failures} failed; totals: "
          + ", ".join(f"{k} {v}" for k, v in totals.items()))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
