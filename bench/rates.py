#!/usr/bin/env python3
"""Latency at moderate rates, measured with the independent tool (a benchmark: it
prints figures and asserts nothing).

Starts amqpbroker and the Qpid Proton C example broker (and, with --baseline-src,
amqpbroker from another source tree: the code before a change, in the same run),
warms each up with 20,000 messages, then for every rate runs, interleaved across
the brokers and repeated:

* amqp-bench (bench/amqp-bench: Proton C, written without the broker's code):
  10,000 × 256 B through a fresh queue at the rate; its p50 / p99 / max;
* loadgen (the project's tool) the same way with --burst 512: the first 512
  messages at once, as amqp-bench's first batch and a client starting with a
  backlog do, then paced.

It prints the medians per rate and broker, the worst max, the broker's CPU per
message (the broker process and its children, over the run) and the goals: p99
≤ 1 ms and max ≤ 3 ms at every rate; at 1,000 msgs/s, CPU per message at most
1.25× the baseline's (the code before the change) and against the C example
broker.  Latency on a busy machine is noisy: read the ratios to the C example
broker of the same run.

    .venv/bin/python bench/rates.py                                  # 200, 1000, 5000 msgs/s, 3 repeats
    .venv/bin/python bench/rates.py --baseline-src /tmp/before       # + the code before, same run
    .venv/bin/python bench/rates.py --rates 1000 --repeat 1 --messages 2000 --warmup 2000   # quick look
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import (AMQPBROKER, BUILD, LOADGEN, AmqpBroker, BaselineBroker, Broker,  # noqa: E402
                 BrokerStartError, CBroker, kill_group, log)

AMQP_BENCH = BUILD / "amqp-bench"
GOAL_P99_MS, GOAL_MAX_MS, GOAL_CPU_RATIO = 1.0, 3.0, 1.25


def run_tool(cmd: list[str], timeout: float) -> tuple[dict, str]:
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc, grace=1)
        out, err = proc.communicate()
        return {}, f"killed after {timeout:.0f} s"
    line = next((ln for ln in reversed(out.splitlines()) if ln.startswith("{")), None)
    if line is None:
        return {}, f"no result (exit {proc.returncode}): {err.strip()[-300:]}"
    try:
        return json.loads(line), ""
    except json.JSONDecodeError:
        return {}, f"bad output: {line[:200]}"


def amqp_bench(broker: Broker, address: str, rate: float, messages: int, timeout: float) -> dict:
    cmd = [str(AMQP_BENCH), "--url", broker.url(), "--address", address, "--messages", str(messages),
           "--time-limit", str(timeout)]
    if rate:
        cmd += ["--rate", str(rate)]
    res, error = run_tool(cmd, timeout + 30)
    lat = res.get("latency_ms") or {}
    out = {"p50": lat.get("p50"), "p99": lat.get("p99"), "max": lat.get("max"),
           "msgs_per_s": res.get("msgs_per_s"), "client_cpu_pct": res.get("client_cpu_pct")}
    if error or not res.get("ok", False):
        out["error"] = error or "; ".join(res.get("errors") or []) or "not ok"
    return out


def loadgen(broker: Broker, address: str, rate: float, messages: int, burst: int, timeout: float) -> dict:
    cmd = [str(LOADGEN), "--url", broker.url(), "--address", address, "--messages", str(messages),
           "--rate", str(rate), "--burst", str(burst), "--timeout", str(timeout)]
    res, error = run_tool(cmd, timeout + 30)
    out = {"p50": res.get("p50_ms"), "p99": res.get("p99_ms"), "max": res.get("max_ms"),
           "msgs_per_s": res.get("msgs_per_s")}
    if error or res.get("error") or res.get("timeout"):
        out["error"] = error or res.get("error") or "timeout"
    return out


def measured(broker: Broker, run) -> dict:
    cpu0 = broker.cpu_seconds()
    res = run()
    res["broker_cpu_s"] = broker.cpu_seconds() - cpu0
    if not broker.alive():
        res["error"] = f"broker died: {broker.output_tail()[-300:]}"
    return res


def med(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def fmt(v: float | None, spec: str = ".3f") -> str:
    return "—" if v is None else format(v, spec)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="200,1000,5000", help="msgs/s, comma separated")
    ap.add_argument("--messages", type=int, default=10_000, help="messages per run (default 10000)")
    ap.add_argument("--warmup", type=int, default=20_000, help="unpaced warm-up messages per broker")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved repeats (medians shown)")
    ap.add_argument("--burst", type=int, default=512, help="loadgen --burst (amqp-bench's first batch)")
    ap.add_argument("--no-loadgen", action="store_true", help="amqp-bench only")
    ap.add_argument("--baseline-src", help="a source tree holding amqpbroker/ (the code before a change)")
    ap.add_argument("--amqpbroker-bin", default=str(AMQPBROKER))
    ap.add_argument("--timeout", type=float, default=120.0, help="bound of each tool run, seconds")
    ap.add_argument("--start-timeout", type=float, default=30.0)
    ap.add_argument("--json", metavar="OUT", help="also write every run as JSON")
    args = ap.parse_args(argv)
    args.rate_list = [float(r) for r in args.rates.split(",") if r.strip()]
    args.keep_tmp = False
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    for tool in (AMQP_BENCH, LOADGEN):
        if not tool.exists():
            print(f"{tool} missing: run bench/build.sh", file=sys.stderr)
            return 2
    brokers: list[Broker] = [AmqpBroker(args)]
    if args.baseline_src:
        brokers.append(BaselineBroker(args))
    brokers.append(CBroker(args))
    runs: list[dict] = []
    try:
        live = []
        for b in brokers:
            try:
                b.start()
                live.append(b)
                log(f"{b.name} listening on {b.url()}")
            except BrokerStartError as exc:
                print(f"{b.name}: failed to start ({exc})", flush=True)
        for b in live:
            if args.warmup:
                w = amqp_bench(b, f"warm-{uuid.uuid4().hex[:6]}", 0, args.warmup, args.timeout)
                log(f"warm-up {b.name}: {fmt(w.get('msgs_per_s'), ',.0f')} msgs/s {w.get('error', '')}")
        for rep in range(args.repeat):
            order = live[rep % len(live):] + live[:rep % len(live)]
            for rate in args.rate_list:
                for b in order:
                    tools = [("amqp-bench", lambda a: amqp_bench(b, a, rate, args.messages, args.timeout))]
                    if not args.no_loadgen:
                        tools.append(("loadgen", lambda a: loadgen(b, a, rate, args.messages, args.burst,
                                                                   args.timeout)))
                    for tool, fn in tools:
                        address = f"rates-{uuid.uuid4().hex[:8]}"
                        r = measured(b, lambda: fn(address))
                        r.update(broker=b.name, tool=tool, rate=rate, rep=rep)
                        runs.append(r)
                        log(f"rep {rep + 1} {rate:6.0f}/s {b.name:10s} {tool:10s} p50 {fmt(r['p50'])} "
                            f"p99 {fmt(r['p99'])} max {fmt(r['max'])} ms  broker CPU "
                            f"{r['broker_cpu_s'] / args.messages * 1e6:.0f} µs/msg {r.get('error', '')}")
    except KeyboardInterrupt:
        log("interrupted")
    finally:
        for b in brokers:
            b.stop()
    report(args, [b.name for b in brokers], runs)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "runs": runs},
                                              indent=2, default=str))
    return 0


LABEL = {"amqpbroker": "amqpbroker", "baseline": "amqpbroker before", "cbroker": "C example"}


def report(args: argparse.Namespace, names: list[str], runs: list[dict]) -> None:
    print()
    print(f"{args.messages:,} × 256 B through a fresh queue per run, after a {args.warmup:,}-message warm-up; "
          f"medians of {args.repeat} interleaved run(s), max also as the worst run")
    print(f"{'rate':>6} {'tool':10} {'broker':18} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
          f"{'worst max':>9} {'CPU µs/msg':>10} {'p99 vs C':>8}  goal p99≤{GOAL_P99_MS:g}, max≤{GOAL_MAX_MS:g}")
    summary: dict = {}
    for rate in args.rate_list:
        for tool in ("amqp-bench", "loadgen"):
            for name in names:
                rs = [r for r in runs if r["rate"] == rate and r["tool"] == tool and r["broker"] == name]
                if not rs:
                    continue
                ok = [r for r in rs if not r.get("error")]
                s = {k: med([r[k] for r in ok]) for k in ("p50", "p99", "max")}
                s["worst"] = max((r["max"] for r in ok if r["max"] is not None), default=None)
                s["cpu"] = med([r["broker_cpu_s"] / args.messages * 1e6 for r in ok])
                s["errors"] = len(rs) - len(ok)
                summary[rate, tool, name] = s
        for tool in ("amqp-bench", "loadgen"):
            ref = summary.get((rate, tool, "cbroker"))
            for name in names:
                s = summary.get((rate, tool, name))
                if s is None:
                    continue
                vs_c = (f"{s['p99'] / ref['p99']:.2f}×" if ref and ref["p99"] and s["p99"] and name != "cbroker"
                        else "")
                goal = ""
                if name != "cbroker" and s["p99"] is not None:
                    met = s["p99"] <= GOAL_P99_MS and s["max"] <= GOAL_MAX_MS
                    goal = "met" if met else "NOT met"
                err = f"  ({s['errors']} run(s) failed)" if s["errors"] else ""
                print(f"{rate:6.0f} {tool:10} {LABEL[name]:18} {fmt(s['p50']):>8} {fmt(s['p99']):>8} "
                      f"{fmt(s['max']):>8} {fmt(s['worst']):>9} {fmt(s['cpu'], '.0f'):>10} {vs_c:>8}  {goal}{err}")
    print()
    for rate in args.rate_list:
        mine = summary.get((rate, "amqp-bench", "amqpbroker"))
        if not mine or mine["cpu"] is None:
            continue
        parts = []
        for other in ("baseline", "cbroker"):
            o = summary.get((rate, "amqp-bench", other))
            if o and o["cpu"]:
                parts.append(f"{mine['cpu'] / o['cpu']:.2f}× {LABEL[other]} ({o['cpu']:.0f} µs)")
        line = f"broker CPU per message at {rate:,.0f} msgs/s (amqp-bench runs): {mine['cpu']:.0f} µs = " + \
               ", ".join(parts)
        base = summary.get((rate, "amqp-bench", "baseline"))
        if base and base["cpu"] and rate == 1000:
            ratio = mine["cpu"] / base["cpu"]
            line += f"; goal ≤ {GOAL_CPU_RATIO}× before: {'met' if ratio <= GOAL_CPU_RATIO else 'NOT met'}"
        print(line)
    print("(latency and CPU figures of a busy machine are indicative; compare within the run)")


if __name__ == "__main__":
    sys.exit(main())
