#!/usr/bin/env python3
"""Durable point-to-point throughput: amqpbroker's store against RabbitMQ's.

In one run, interleaved (the machine is shared and noisy: compare ratios):

  amqpbroker  non-durable   p2p, messages not durable (in-memory path)
  amqpbroker  durable       p2p, durable messages: Accepted only after the group commit
  RabbitMQ    durable       p2p, persistent messages in a durable queue (publisher
                            confirms: Accepted after its message store fsync)
  RabbitMQ    non-durable   (reference; --no-rabbitmq-nondurable to skip)
  amqpbroker before         with --baseline-src DIR: the same two amqpbroker runs with
                            the code of that tree (the code before a change)

Each run: bench/build/loadgen, 1 sender -> 1 receiver on a fresh queue, N x 256 B,
unsettled sends with a window of 1000 (the sender waits for Accepted), receiver
credit 1000.  For RabbitMQ the links carry terminus durability "configuration"
(`loadgen --terminus-durable`), so `/queue/NAME` is declared durable; a check at the
end lists the queue with rabbitmqctl to show it (durable, persistent messages).

    .venv/bin/python bench/durable.py                       # 100k x 256 B, once
    .venv/bin/python bench/durable.py --repeat 3 --json bench/out/durable.json

Prints msgs/s per configuration (median over repeats) and the ratios
amqpbroker-durable / RabbitMQ-durable and amqpbroker-durable / amqpbroker-non-durable.
A benchmark: it asserts nothing.  Brokers and loadgen runs are cleaned up as in run.py.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run as harness  # noqa: E402  (bench/run.py: brokers, loadgen runner, cleanup)

CONFIGS = [  # (label, broker, durable)
    ("amqpbroker non-durable", "amqpbroker", False),
    ("amqpbroker durable", "amqpbroker", True),
    ("RabbitMQ durable", "rabbitmq", True),
    ("RabbitMQ non-durable", "rabbitmq", False),
]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=180.0, help="bound of each loadgen run, seconds")
    ap.add_argument("--warmup", type=int, default=5000, help="unreported warm-up messages per broker")
    ap.add_argument("--no-rabbitmq", action="store_true", help="amqpbroker only")
    ap.add_argument("--no-rabbitmq-nondurable", action="store_true")
    ap.add_argument("--rabbitmq-port", type=int, default=5674)
    ap.add_argument("--amqpbroker-bin", default=str(harness.AMQPBROKER))
    ap.add_argument("--baseline-src", help="a source tree holding amqpbroker/ (the code before a change)")
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--keep-tmp", action="store_true")
    return ap.parse_args(argv)


def harness_args(a) -> argparse.Namespace:
    brokers = "amqpbroker" if a.no_rabbitmq else "amqpbroker,rabbitmq"
    h = harness.parse_args(["--brokers", brokers, "--scenarios", "p2p", "--messages", str(a.messages),
                            "--size", str(a.size), "--timeout", str(a.timeout),
                            "--rabbitmq-port", str(a.rabbitmq_port), "--amqpbroker-bin", a.amqpbroker_bin]
                           + (["--keep-tmp"] if a.keep_tmp else []))
    h.baseline_src = a.baseline_src
    return h


def rabbit_durability_check(rabbit, hargs) -> str:
    """Send 1000 durable messages (no receiver) the way the benchmark does, then ask
    RabbitMQ how it holds them."""
    name = f"bench-durable-check-{uuid.uuid4().hex[:6]}"
    cmd = [str(harness.LOADGEN), "--url", rabbit.url(), "--address", rabbit.queue_address(name),
           "--messages", "1000", "--size", str(hargs.size), "--senders", "1", "--receivers", "0",
           "--durable", "--terminus-durable", "--timeout", "60"]
    subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=90, start_new_session=True)
    r = rabbit.ctl(["list_queues", "name", "durable", "messages", "messages_persistent"], timeout=60)
    rabbit.after_run([name])
    if r is None:
        return "rabbitmqctl list_queues timed out"
    lines = [ln for ln in r.stdout.decode(errors="replace").splitlines() if name in ln]
    return lines[0] if lines else r.stdout.decode(errors="replace")[-300:]


def main(argv=None) -> int:
    a = parse_args(argv)
    if not harness.LOADGEN.exists():
        print(f"{harness.LOADGEN} missing: run bench/build.sh", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, harness._sigterm)
    hargs = harness_args(a)
    configs = [c for c in CONFIGS if not (c[1] == "rabbitmq" and a.no_rabbitmq)
               and not (c[0] == "RabbitMQ non-durable" and a.no_rabbitmq_nondurable)]
    if a.baseline_src:
        configs[2:2] = [("amqpbroker before non-durable", "baseline", False),
                        ("amqpbroker before durable", "baseline", True)]
    classes = dict(harness.BROKER_CLASSES, baseline=harness.BaselineBroker)
    brokers: dict[str, harness.Broker] = {}
    failed: dict[str, str] = {}
    runs: list[dict] = []
    check = None
    interrupted = False
    try:
        for name in dict.fromkeys(c[1] for c in configs):
            b = classes[name](hargs)
            brokers[name] = b
            harness.log(f"starting {name} ...")
            try:
                b.start()
            except harness.BrokerStartError as e:
                failed[name] = " ".join(str(e).split())[-600:]
                print(f"{name}: failed to start ({failed[name]})", flush=True)
                b.stop()
                continue
            if a.warmup:
                w = argparse.Namespace(**vars(hargs))
                w.messages, w.durable = a.warmup, False
                r = harness.run_loadgen(b, "p2p", -1, w)
                harness.log(f"warm-up {name}: {harness.fmt_rate(r.get('msgs_per_s'))} msgs/s")
        live = [c for c in configs if c[1] not in failed]
        for rep in range(a.repeat):
            order = live[rep % len(live):] + live[:rep % len(live)] if live else []
            for label, name, durable in order:
                b = brokers[name]
                if not b.alive():
                    harness.log(f"{name} died: {b.output_tail()[-300:]}")
                    continue
                ns = argparse.Namespace(**vars(hargs))
                ns.durable = durable
                r = harness.run_loadgen(b, "p2p", rep, ns)
                r["config"] = label
                runs.append(r)
                harness.log(f"rep {rep + 1}/{a.repeat} {label:24s} {harness.fmt_rate(r.get('msgs_per_s'))} msgs/s"
                            f"  p50 {harness.fmt_ms(r.get('p50_ms'))} ms  p99 {harness.fmt_ms(r.get('p99_ms'))} ms"
                            f"  broker CPU {r.get('broker_cpu_pct', 0):.0f}%"
                            f"  accepted {r.get('accepted')} rejected {r.get('rejected')}"
                            + (f"  dup {r['duplicates']}" if r.get("duplicates") else "")
                            + (f"  ERROR {r['error']}" if r.get("error") else ""))
        if "rabbitmq" in brokers and "rabbitmq" not in failed and brokers["rabbitmq"].alive():
            check = rabbit_durability_check(brokers["rabbitmq"], hargs)
    except KeyboardInterrupt:
        interrupted = True
        harness.log("interrupted: cleaning up")
    finally:
        for b in brokers.values():
            try:
                b.stop()
            except BaseException as e:
                harness.log(f"stopping {b.name}: {e!r}")

    med = {}
    print()
    print(f"durable p2p, {a.messages:,} x {a.size} B, window 1000, credit 1000 (median of {a.repeat})")
    print(f"{'configuration':26s} {'msgs/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'broker CPU %':>13} {'loadgen CPU %':>14}")
    for label, name, _ in configs:
        rs = [r for r in runs if r["config"] == label and "msgs_per_s" in r and not r.get("error")]
        m = {k: harness.med([r.get(k) for r in rs]) for k in
             ("msgs_per_s", "p50_ms", "p99_ms", "broker_cpu_pct", "loadgen_cpu_pct")}
        med[label] = m
        if name in failed:
            print(f"{label:26s} {'failed to start':>10}")
            continue
        print(f"{label:26s} {harness.fmt_rate(m['msgs_per_s']):>10} {harness.fmt_ms(m['p50_ms']):>8} "
              f"{harness.fmt_ms(m['p99_ms']):>8} {m['broker_cpu_pct'] or 0:>13.0f} {m['loadgen_cpu_pct'] or 0:>14.0f}")

    def rate(label):
        return (med.get(label) or {}).get("msgs_per_s")

    ad, an, rd, rn = (rate("amqpbroker durable"), rate("amqpbroker non-durable"),
                      rate("RabbitMQ durable"), rate("RabbitMQ non-durable"))
    print(f"amqpbroker durable / RabbitMQ durable:       {harness.fmt_ratio(ad, rd)}")
    print(f"amqpbroker durable / amqpbroker non-durable: {harness.fmt_ratio(ad, an)}")
    bd, bn = rate("amqpbroker before durable"), rate("amqpbroker before non-durable")
    if bd:
        print(f"amqpbroker durable / amqpbroker before durable: {harness.fmt_ratio(ad, bd)}   (target >= 1.0x)")
        print(f"amqpbroker before durable / before non-durable: {harness.fmt_ratio(bd, bn)}")
    if rn:
        print(f"RabbitMQ durable / RabbitMQ non-durable:     {harness.fmt_ratio(rd, rn)}")
    if check:
        print(f"RabbitMQ check (name durable messages messages_persistent): {check}")
    for r in runs:
        if r.get("error"):
            print(f"error in {r['config']} (rep {r['rep'] + 1}): {r['error']}")
    if a.json:
        out = Path(a.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"args": vars(a), "runs": runs, "medians": med, "failed": failed,
                                   "rabbitmq_check": check, "repo_head": harness.repo_revision()},
                                  indent=2, default=str))
        print(f"results written to {out}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
