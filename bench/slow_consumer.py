#!/usr/bin/env python3
"""A slow consumer must not slow a producer down (default configuration).

1. start amqpbroker with its defaults (no queue limits: no implicit flow control);
2. baseline (after a warm-up of N/5): one producer (bench/build/loadgen --receivers 0 --durable, window 1000)
   sends N durable 256 B messages to a queue nobody consumes: its rate;
3. the same to another queue while one consumer takes messages at --consumer-rate
   (50 msgs/s: a python-qpid-proton receiver with credit 10, each accepted): the
   producer's rate; both alternate for --rounds (3): the median of the rounds'
   ratios is the figure (target >= 0.9), the ratio of the medians is shown too;
4. broker RSS (broker + store writer, /proc) sampled every 0.2 s throughout: the
   maximum after the first round (N with no consumer + N with the slow one held;
   target < 300 MB) and over all rounds (every round's messages stay queued);
5. the consumer stops; a receiver drains the rest: the loadgen sequence numbers the
   slow consumer took and the drain received must be exactly 0 .. N-1 (nothing lost,
   nothing twice).

    .venv/bin/python bench/slow_consumer.py                     # 50,000 x 256 B
    .venv/bin/python bench/slow_consumer.py --messages 10000    # quicker look

A benchmark: it prints figures and asserts nothing.  Every process it starts is
killed in a finally block.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import statistics
import threading
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from backlog import LOADGEN, MB, Broker, loadgen, proc_status  # noqa: E402


def log(msg: str) -> None:
    print(f"[slow_consumer {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class RssSampler(threading.Thread):
    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid = pid
        self.max = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.max = max(self.max, proc_status(self.pid)["VmRSS"])
            except (FileNotFoundError, KeyError, ProcessLookupError):
                pass
            self.stop.wait(0.2)


class SlowConsumer(threading.Thread):
    """Takes about `rate` messages a second from `address`, accepting each."""

    def __init__(self, url: str, address: str, rate: float):
        super().__init__(daemon=True)
        self.url, self.address, self.interval = url, address, 1.0 / rate
        self.taken = 0
        self.seq_list: list[int] = []
        self.stop = threading.Event()
        self.attached = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        from proton import Timeout
        from proton.utils import BlockingConnection
        try:
            conn = BlockingConnection(self.url, timeout=30)
            try:
                rcv = conn.create_receiver(self.address, credit=10)
                self.attached.set()
                next_at = time.monotonic()
                while not self.stop.is_set():
                    try:
                        msg = rcv.receive(timeout=0.5)
                    except Timeout:
                        continue
                    rcv.accept()
                    self.taken += 1
                    self.seq_list.append(seq_of(msg))
                    next_at += self.interval
                    delay = next_at - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
            finally:
                conn.close()
        except BaseException as exc:   # reported by the main thread
            self.error = exc
            self.attached.set()


MAGIC = b"LGBENCH1"   # bench/loadgen.c: magic, send time (ns), sequence number


def seq_of(msg) -> int:
    body = msg.body
    raw = bytes(body) if not isinstance(body, str) else body.encode()
    at = raw.rfind(MAGIC)
    return int.from_bytes(raw[at + 16:at + 24], "little") if at >= 0 else -1


def drain(url: str, address: str, timeout: float = 5.0) -> tuple[list[int], float]:
    """Every message left (each accepted): their sequence numbers, and the rate."""
    from proton import Timeout
    from proton.utils import BlockingConnection
    conn = BlockingConnection(url, timeout=30)
    seqs: list[int] = []
    start = last = time.monotonic()
    try:
        rcv = conn.create_receiver(address, credit=1000)
        while True:
            try:
                msg = rcv.receive(timeout=timeout)
            except Timeout:
                break
            rcv.accept()
            seqs.append(seq_of(msg))
            last = time.monotonic()
    finally:
        conn.close()
    return seqs, len(seqs) / max(last - start, 1e-9)


def produce(url: str, address: str, n: int, size: int) -> dict:
    return loadgen(url, ["--address", address, "--messages", str(n), "--size", str(size),
                         "--senders", "1", "--receivers", "0", "--durable"], timeout=600)


def rate_of(result: dict) -> float:
    return float(result.get("sent_per_s") or result.get("msgs_per_s") or 0.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=50_000)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--consumer-rate", type=float, default=50.0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not LOADGEN.exists():
        log(f"{LOADGEN} is missing: run bench/build.sh")
        return 2
    with tempfile.TemporaryDirectory(prefix="slow-consumer-") as tmp:
        broker = Broker(Path(tmp) / "data", Path(tmp) / "broker.log", None)
        sampler = consumer = None
        try:
            broker.start()
            url = f"amqp://127.0.0.1:{broker.port}"
            sampler = RssSampler(broker.proc.pid)
            sampler.start()
            n = args.messages
            # Warm-up (LMDB map growth, first commits), purged after: not in either rate.
            produce(url, "bench.warm", n // 5, args.size)
            drain(url, "bench.warm", timeout=1.0)
            consumer = SlowConsumer(url, "bench.slow", args.consumer_rate)
            consumer.start()
            consumer.attached.wait(30)
            if consumer.error is not None:
                raise RuntimeError(f"slow consumer failed: {consumer.error!r}")
            time.sleep(1.0)   # the consumer is taking messages
            # Runs take about a second each on a shared machine: alternate the two cases
            # and take the median of each, so that a noisy second does not decide.
            alone_rates, slow_rates = [], []
            rss_first_round = 0
            for r in range(args.rounds):
                log(f"round {r + 1}: {n:,} durable x {args.size} B with no consumer, then to the queue "
                    f"a consumer takes {args.consumer_rate:g} msgs/s from")
                if r % 2 == 0:   # alternate which goes first: the store's writer may still be busy
                    base = produce(url, f"bench.alone{r}", n, args.size)
                    slow = produce(url, "bench.slow", n, args.size)
                else:
                    slow = produce(url, "bench.slow", n, args.size)
                    base = produce(url, f"bench.alone{r}", n, args.size)
                if r == 0:
                    rss_first_round = sampler.max   # the case of the brief: 50,000 + 50,000 held
                for res in (base, slow):
                    if res.get("accepted") != n:
                        log(f"  not all accepted: {json.dumps(res)[:300]}")
                alone_rates.append(rate_of(base))
                slow_rates.append(rate_of(slow))
                log(f"  alone {rate_of(base):,.0f} msgs/s, with the slow consumer {rate_of(slow):,.0f} msgs/s")
            consumer.stop.set()
            consumer.join(30)
            taken = consumer.taken
            total = n * args.rounds

            log(f"draining the rest ({total - taken:,})")
            drained, drain_rate = drain(url, "bench.slow")
            sampler.stop.set()
            sampler.join(5)
            # Each round numbers its messages 0 .. n-1: every number must be seen `rounds` times.
            counts = Counter(drained)
            counts.update(consumer.seq_list)
            wrong = {seq: c for seq, c in counts.items() if c != args.rounds or not 0 <= seq < n}
            missing = sum(max(0, args.rounds - counts.get(seq, 0)) for seq in range(n))
            alone, with_slow = statistics.median(alone_rates), statistics.median(slow_rates)
            report = {
                "messages": n, "rounds": args.rounds, "size": args.size, "consumer_rate": args.consumer_rate,
                "producer_alone_msgs_per_s": [round(x) for x in alone_rates],
                "producer_with_slow_consumer_msgs_per_s": [round(x) for x in slow_rates],
                "ratio_per_round": [round(w / a, 3) if a else None for a, w in zip(alone_rates, slow_rates)],
                "ratio_median_of_rounds": round(statistics.median(
                    w / a for a, w in zip(alone_rates, slow_rates) if a), 3) if any(alone_rates) else None,
                "ratio_of_medians": round(with_slow / alone, 3) if alone else None, "ratio_target": 0.9,
                "slow_consumer_took": taken, "drained": len(drained),
                "lost": missing, "wrong_counts": len(wrong),
                "broker_rss_max_mb_first_round": round(rss_first_round / MB, 1),
                "broker_rss_max_mb_all_rounds": round(sampler.max / MB, 1), "rss_target_mb": 300,
                "held_at_the_end": n * args.rounds * 2 - taken,
                "drain_msgs_per_s": round(drain_rate, 1),
            }
            print(json.dumps(report, indent=2))
            return 0
        finally:
            if consumer is not None:
                consumer.stop.set()
            if sampler is not None:
                sampler.stop.set()
            broker.kill()


if __name__ == "__main__":
    sys.exit(main())
