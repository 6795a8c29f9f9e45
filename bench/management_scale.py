#!/usr/bin/env python3
"""The management API at scale: does scraping it stall AMQP traffic?

1. start amqpbroker on a fresh data dir (the management listener on a free port);
2. create N queues (default 50,000): one non-durable message to each name through
   the anonymous relay, so the broker auto-creates them (and each holds a message);
3. a canary AMQP client (python-qpid-proton, in a child process so that the scraper's
   own work does not show up as broker latency) makes request/response round trips
   on its own connection: send, the broker's accept, the delivery back, accept;
4. its round trips are measured idle, then while /metrics, /api/queues (and, where the
   broker has them, /api/queues?sort=depth and /metrics/per-object) are scraped over
   and over; for every scrape its time, size, and the worst round trip that overlapped it.

    .venv/bin/python bench/management_scale.py
    .venv/bin/python bench/management_scale.py --queues 10000 --rounds 3
    git worktree add /tmp/mgmt-old HEAD
    .venv/bin/python bench/management_scale.py --repo old=/tmp/mgmt-old --repo new=.
    git worktree remove --force /tmp/mgmt-old

`--repo LABEL=PATH` (repeatable) runs the broker from another source tree (e.g. a
`git worktree` of an older commit) with this repository's virtualenv; the clients are
this repository's.  A benchmark: it prints figures and asserts nothing.  Every broker
it starts is stopped in a finally block.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from tests.e2e.canary import Canary, CanaryReport  # noqa: E402
from tests.management.scale_support import populate  # noqa: E402

PYTHON = REPO / ".venv" / "bin" / "python"
LISTEN_RE = re.compile(r"(amqp|management) listening on [\d.]+:(\d+)")
SCRAPES = [("/metrics", {}), ("/api/queues", {}), ("/api/queues", {"sort": "depth", "limit": "1000"}),
           ("/metrics/per-object", {})]


def start_broker(repo: Path, data: Path, log_path: Path) -> tuple[subprocess.Popen, dict[str, int]]:
    env = dict(os.environ, PYTHONPATH=str(repo), AMQPBROKER_MANAGEMENT__PORT="0")
    cmd = [str(PYTHON), "-m", "amqpbroker.cli", "serve", "--port", "0", "--data-dir", str(data),
           "--log-level", "info"]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=str(repo), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=log, env=env)
    ports: dict[str, int] = {}
    deadline = time.monotonic() + 60
    while len(ports) < 2:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"broker did not start:\n{log_path.read_text()[-2000:]}")
        for m in LISTEN_RE.finditer(log_path.read_text()):
            ports[m.group(1)] = int(m.group(2))
        time.sleep(0.05)        # polling a log file: a benchmark, not a test
    return proc, ports


def stop_broker(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def worst_during(report: CanaryReport, start: float, end: float) -> float:
    """The longest round trip that overlapped [start, end] (wall clock)."""
    return max((rtt for t0, rtt in report.samples if t0 <= end and t0 + rtt >= start), default=0.0)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def run_one(label: str, repo: Path, queues: int, rounds: int, idle: float, keep: bool) -> dict:
    import httpx

    tmp = Path(tempfile.mkdtemp(prefix=f"mgmt-scale-{label}-"))
    proc, ports = start_broker(repo, tmp / "data", tmp / "broker.log")
    url = f"amqp://127.0.0.1:{ports['amqp']}"
    result: dict = {"label": label, "repo": str(repo), "queues": queues}
    try:
        t0 = time.perf_counter()
        names = [f"scale-{i:06d}" for i in range(queues)]
        for i in range(0, queues, 10_000):
            populate(url, names[i:i + 10_000], timeout=600)
        result["populate_s"] = round(time.perf_counter() - t0, 1)
        print(f"[{label}] {queues} queues created in {result['populate_s']} s", file=sys.stderr)

        with Canary(url) as canary:
            end = time.monotonic() + idle
            while time.monotonic() < end:
                time.sleep(0.1)
        result["idle"] = summary(canary.report)

        scrapes: list[dict] = []
        mgmt = f"http://127.0.0.1:{ports['management']}"
        with httpx.Client(base_url=mgmt, timeout=300) as http, Canary(url) as canary:
            for r in range(rounds):
                for path, params in SCRAPES:
                    start = time.time()
                    t = time.perf_counter()
                    resp = http.get(path, params=params, headers={"Accept-Encoding": "identity"})
                    elapsed = time.perf_counter() - t
                    scrapes.append({"path": path + ("?" + "&".join(f"{k}={v}" for k, v in params.items())
                                                    if params else ""),
                                    "status": resp.status_code, "bytes": len(resp.content),
                                    "seconds": elapsed, "window": (start, time.time())})
                print(f"[{label}] round {r + 1}/{rounds} done", file=sys.stderr)
        report = canary.report
        result["scraping"] = summary(report)
        by_path: dict[str, dict] = {}
        for s in scrapes:
            entry = by_path.setdefault(s["path"], {"status": s["status"], "bytes": s["bytes"], "seconds": [],
                                                   "canary_worst": 0.0})
            entry["seconds"].append(s["seconds"])
            entry["canary_worst"] = max(entry["canary_worst"], worst_during(report, *s["window"]))
        result["scrapes"] = {p: {"status": e["status"], "bytes": e["bytes"],
                                 "median_s": statistics.median(e["seconds"]), "max_s": max(e["seconds"]),
                                 "canary_worst_s": e["canary_worst"]} for p, e in by_path.items()}
    finally:
        stop_broker(proc)
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)
    return result


def summary(report: CanaryReport | None) -> dict:
    if report is None or not report.samples:
        return {"round_trips": 0}
    return {"round_trips": len(report.samples), "p50_s": statistics.median(report.rtts),
            "p99_s": report.quantile(0.99), "max_s": report.worst}


def print_results(results: list[dict]) -> None:
    for res in results:
        print(f"\n== {res['label']} ({res['repo']}): {res['queues']} queues (created in {res['populate_s']} s)")
        for phase in ("idle", "scraping"):
            c = res[phase]
            print(f"  canary {phase:9s}: {c['round_trips']:5d} round trips, p50 {ms(c['p50_s'])} ms, "
                  f"p99 {ms(c['p99_s'])} ms, max {ms(c['max_s'])} ms")
        print(f"  {'scrape':42s} {'status':>6s} {'size':>10s} {'median':>9s} {'max':>9s} {'canary worst':>13s}")
        for path, s in res["scrapes"].items():
            size = f"{s['bytes'] / 1e6:.2f} MB" if s["bytes"] >= 100_000 else f"{s['bytes'] / 1e3:.1f} kB"
            print(f"  {path:42s} {s['status']:6d} {size:>10s} {ms(s['median_s']):>6s} ms {ms(s['max_s']):>6s} ms "
                  f"{ms(s['canary_worst_s']):>10s} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queues", type=int, default=50_000)
    ap.add_argument("--rounds", type=int, default=5, help="scrapes of each endpoint (default 5)")
    ap.add_argument("--idle", type=float, default=3.0, help="seconds of canary without scrapes (default 3)")
    ap.add_argument("--repo", action="append", default=[], metavar="LABEL=PATH",
                    help="a source tree to run the broker from (repeatable; default: this one)")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    ap.add_argument("--keep-tmp", action="store_true")
    args = ap.parse_args()
    trees = [(r.partition("=")[0], Path(r.partition("=")[2] or r).resolve()) if "=" in r
             else (Path(r).name, Path(r).resolve()) for r in args.repo] or [("this", REPO)]
    results = [run_one(label, repo, args.queues, args.rounds, args.idle, args.keep_tmp) for label, repo in trees]
    print_results(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
