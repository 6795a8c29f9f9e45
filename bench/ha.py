#!/usr/bin/env python3
"""The HA pair (docs/ha.md): what synchronous replication costs, and how long a failover takes.

1. Durable p2p (bench/build/loadgen: 1 sender -> 1 receiver, N x 256 B durable,
   window 1000, credit 1000) against
     alone       one broker without [ha] (no ZooKeeper, no replication)
     replicated  the live broker of a pair whose backup is in sync (every Accepted
                 waits for both stores' commits)
   interleaved --repeat times; prints msgs/s and the ratio replicated / alone
   (target >= 0.6).
2. Failover: kill -9 of the live broker, then the time until the backup's AMQP
   listener accepts a TCP connection (goal <= 5 s with a 2 s ZooKeeper session
   timeout), --failovers times, alternating which broker dies.

ZooKeeper and the brokers are started as the HA tests do (tests/e2e/ha_harness.py:
the Debian zookeeper package).  A benchmark: it asserts nothing.

    .venv/bin/python bench/ha.py --messages 50000 --repeat 3 --failovers 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tests.e2e.ha_harness import HaBroker, ZooKeeper, free_port, pair_config  # noqa: E402

sys.path.insert(0, str(HERE))
from run import rabbitmq_durable_rate  # noqa: E402  (bench/run.py: RabbitMQ through its runner)

LOADGEN = HERE / "build" / "loadgen"


def loadgen(url: str, messages: int, size: int, timeout: float) -> dict:
    cmd = [str(LOADGEN), "--url", url, "--address", f"bench-ha-{uuid.uuid4().hex[:8]}", "--messages",
           str(messages), "--size", str(size), "--senders", "1", "--receivers", "1", "--window", "1000",
           "--credit", "1000", "--timeout", str(timeout), "--durable"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 30)
    line = next((ln for ln in reversed(done.stdout.splitlines()) if ln.startswith("{")), None)
    if line is None:
        return {"error": f"loadgen exit {done.returncode}: {done.stderr[-300:]}"}
    return json.loads(line)


class PlainBroker(HaBroker):
    """A broker without [ha]: started as a pair's broker is, but ready once it listens."""

    def start(self) -> "PlainBroker":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cfg = self.data_dir.parent / f"{self.name}.toml"
        cfg.write_text(self.config)
        env = dict(os.environ, AMQPBROKER_MANAGEMENT__PORT="0")
        self.proc = subprocess.Popen([sys.executable, "-m", "amqpbroker.cli", "serve", "--config", str(cfg),
                                      "--data-dir", str(self.data_dir), "--log-level", "warning"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()
        wait_listening(self)
        return self


def alone_broker(root: Path) -> HaBroker:
    port = free_port()
    return PlainBroker("alone", root / "alone", f"port = {port}\n", port).start()


def wait_listening(broker: HaBroker, timeout: float = 30.0) -> float:
    start = time.monotonic()
    while not broker.is_listening():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"{broker.name} did not start listening in {timeout} s")
        time.sleep(0.02)
    return time.monotonic() - start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=50_000)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--failovers", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--no-rabbitmq", action="store_true", help="skip RabbitMQ durable p2p")
    a = ap.parse_args(argv)
    if not LOADGEN.exists():
        print(f"{LOADGEN} missing: run bench/setup.sh and bench/build.sh", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="bench-ha-"))
    zk = ZooKeeper(root / "zk").start()
    cluster = uuid.uuid4().hex[:8]
    pair = []
    for name, role in (("a", "primary"), ("b", "backup")):
        port = free_port()
        pair.append(HaBroker(name, root / name, pair_config(zk, cluster, role, port), port))
    alone = None
    rates: dict[str, list[float]] = {"alone": [], "replicated": []}
    failovers: list[float] = []
    try:
        alone = alone_broker(root)
        pair[0].start().wait_live()
        pair[1].start().wait_for_log("in sync with the live broker", 60)
        for rep in range(a.repeat):
            for label, url in (("alone", alone.url), ("replicated", pair[0].url))[:: 1 if rep % 2 == 0 else -1]:
                r = loadgen(url, a.messages, a.size, a.timeout)
                if "msgs_per_s" in r and not r.get("error"):
                    rates[label].append(r["msgs_per_s"])
                print(f"rep {rep + 1} {label:11s} {r.get('msgs_per_s', 0):>10,.0f} msgs/s"
                      f"  accepted {r.get('accepted')}  {r.get('error', '')}", flush=True)
        alone.stop()
        live, backup = pair
        for cycle in range(a.failovers):
            live.kill()
            failovers.append(wait_listening(backup))
            print(f"failover {cycle + 1}: {live.name} killed, {backup.name} accepting after "
                  f"{failovers[-1]:.2f} s", flush=True)
            live.start().wait_for_log("in sync with the live broker", 60)
            live, backup = backup, live
    finally:
        for b in pair + ([alone] if alone else []):
            b.kill()
        zk.stop()
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) if v else None for k, v in rates.items()}
    rabbit = None if a.no_rabbitmq else rabbitmq_durable_rate(a.messages, a.size, a.repeat)
    print()
    print(f"durable p2p, {a.messages:,} x {a.size} B, window 1000 (median of {a.repeat})")
    for k, v in med.items():
        print(f"  {k:11s} {v or 0:>10,.0f} msgs/s")
    if med["alone"] and med["replicated"]:
        print(f"  replicated / alone: {med['replicated'] / med['alone']:.2f} (target >= 0.6)")
    if rabbit and med["replicated"]:
        print(f"  RabbitMQ durable p2p {rabbit:>10,.0f} msgs/s: replicated / RabbitMQ "
              f"{med['replicated'] / rabbit:.2f} (target >= 1.5)")
    elif not a.no_rabbitmq:
        print("  RabbitMQ: not installed (bench/setup.sh) or did not start")
    if failovers:
        print(f"failover (kill -9 to the backup's listener accepting), ZooKeeper session timeout 2 s: "
              f"median {statistics.median(failovers):.2f} s, max {max(failovers):.2f} s (goal <= 5 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
