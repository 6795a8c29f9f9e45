#!/usr/bin/env python3
"""Before/after: amqpbroker from another source tree (the baseline: e.g. `git archive`
of the commit before a change, unpacked anywhere) against this tree, in one run, runs
interleaved (the machine is shared and noisy: compare the ratios, not the figures).

  baseline   non-durable   p2p, messages not durable
  this tree  non-durable
  baseline   durable       p2p, durable messages (Accepted after the group commit)
  this tree  durable

Each run: bench/build/loadgen, 1 sender -> 1 receiver on a fresh queue, N x 256 B,
unsettled sends with a window of 1000, receiver credit 1000 (as bench/run.py p2p).
Both brokers run with this tree's Python environment; the baseline's package comes
first on its PYTHONPATH.

    git archive HEAD~1 | (mkdir -p /tmp/base && tar -x -C /tmp/base)
    .venv/bin/python bench/ab.py --baseline /tmp/base --repeat 3

Prints msgs/s per configuration (median over repeats, the broker order alternating)
and the ratios this tree / baseline.  A benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import stat
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run as harness  # noqa: E402  (bench/run.py: brokers, loadgen runner, cleanup)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="a source tree holding the baseline's amqpbroker/ package")
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=180.0, help="bound of each loadgen run, seconds")
    ap.add_argument("--warmup", type=int, default=5000, help="unreported warm-up messages per broker")
    return ap.parse_args(argv)


def baseline_launcher(tree: Path, tmp: Path) -> Path:
    """An executable that runs the baseline tree's CLI with this environment's Python."""
    exe = tmp / "amqpbroker-baseline"
    exe.write_text(f'#!/bin/sh\nPYTHONPATH={tree}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} '
                   f'-m amqpbroker.cli "$@"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def main(argv=None) -> int:
    a = parse_args(argv)
    tree = Path(a.baseline).resolve()
    if not (tree / "amqpbroker" / "cli.py").exists():
        print(f"{tree}: no amqpbroker/cli.py", file=sys.stderr)
        return 2
    if not harness.LOADGEN.exists():
        print(f"{harness.LOADGEN} missing: run bench/build.sh", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, harness._sigterm)
    tmp = Path(tempfile.mkdtemp(prefix="bench-ab-"))
    bins = {"baseline": str(baseline_launcher(tree, tmp)), "this tree": str(harness.AMQPBROKER)}
    brokers: dict[str, harness.Broker] = {}
    runs: list[tuple[str, bool, float | None, float | None]] = []   # (label, durable, msgs/s, broker CPU µs/msg)
    try:
        for label, exe in bins.items():
            hargs = harness.parse_args(["--brokers", "amqpbroker", "--scenarios", "p2p", "--messages",
                                        str(a.messages), "--size", str(a.size), "--timeout", str(a.timeout),
                                        "--amqpbroker-bin", exe])
            b = harness.AmqpBroker(hargs)
            brokers[label] = b
            harness.log(f"starting {label} ({exe}) ...")
            b.start()
            if a.warmup:
                w = argparse.Namespace(**vars(hargs))
                w.messages, w.durable = a.warmup, False
                harness.run_loadgen(b, "p2p", -1, w)
        labels = list(bins)
        for rep in range(a.repeat):
            for durable in (False, True):
                order = labels if (rep + durable) % 2 == 0 else labels[::-1]
                for label in order:
                    b = brokers[label]
                    ns = argparse.Namespace(**vars(b.args))
                    ns.durable = durable
                    r = harness.run_loadgen(b, "p2p", rep, ns)
                    rate = None if r.get("error") else r.get("msgs_per_s")
                    cpu = None if r.get("error") else r.get("broker_cpu_us_per_msg")
                    runs.append((label, durable, rate, cpu))
                    harness.log(f"rep {rep + 1}/{a.repeat} {label:10s} {'durable' if durable else 'non-durable':12s} "
                                f"{harness.fmt_rate(rate)} msgs/s  broker CPU {r.get('broker_cpu_pct', 0):.0f}%"
                                f" {cpu or 0:.1f} µs/msg"
                                + (f"  ERROR {r['error']}" if r.get("error") else ""))
    except KeyboardInterrupt:
        harness.log("interrupted: cleaning up")
    finally:
        for b in brokers.values():
            b.stop()
    print()
    print(f"p2p, {a.messages:,} x {a.size} B, window 1000, credit 1000 (median of {a.repeat}; baseline {tree})")
    medians, cpus = {}, {}
    for durable in (False, True):
        for label in bins:
            medians[label, durable] = harness.med([r for lb, d, r, _ in runs if lb == label and d == durable])
            cpus[label, durable] = harness.med([c for lb, d, _, c in runs if lb == label and d == durable])
            print(f"{label:10s} {'durable' if durable else 'non-durable':12s} "
                  f"{harness.fmt_rate(medians[label, durable]):>10} msgs/s  {cpus[label, durable] or 0:6.1f} µs broker CPU/msg")
    for durable in (False, True):
        kind = "durable" if durable else "non-durable"
        print(f"this tree / baseline, {kind:12s} rate {harness.fmt_ratio(medians['this tree', durable], medians['baseline', durable])}"
              f"  CPU per message {harness.fmt_ratio(cpus['this tree', durable], cpus['baseline', durable])}"
              " (below 1× is cheaper)")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
