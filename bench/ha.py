#!/usr/bin/env python3
"""The HA pair (docs/ha.md): what synchronous replication costs, how long a failover
takes with the shipped defaults, and how long a backup takes to rejoin.

1. Durable p2p (bench/build/loadgen: 1 sender -> 1 receiver, N x 256 B durable,
   window 1000, credit 1000) against
     alone       one broker without [ha] (no ZooKeeper, no replication)
     replicated  the live broker of a pair whose backup is in sync (every Accepted
                 waits for both stores' commits)
   interleaved --repeat times; prints msgs/s and the ratio replicated / alone
   (target >= 0.6).  Skipped without loadgen (bench/build.sh) or with --no-throughput.
2. Failover with the defaults ([ha] zookeeper_session_timeout 3 s, backup_timeout
   2 s): kill -9 of the live broker, then the time until the backup's AMQP listener
   accepts a TCP connection, and until a client that tries both addresses is told
   Accepted for a durable send; --failovers times, alternating which broker dies;
   median and max (goal: median <= 5 s).
3. Rejoin after --away seconds (10) under load (a producer at --rate durable
   msgs/s, a consumer taking them), over a store preloaded with --preload
   messages: the backup killed and restarted after --away s, and its
   replication link cut for --away s (relay); the time from its return to "in sync",
   with the window of recent batches (incremental: only the batches it lacks) and
   without it ([ha] catch_up_window = 0: a copy of the store), in the same run.

ZooKeeper and the brokers are started as the HA tests do (tests/e2e/ha_harness.py:
the Debian zookeeper package, tickTime 200 ms; --zk-tick 500 as docs/ha.md's
deployment).  A benchmark: it asserts nothing;
figures from a busy shared machine are indicative, the ratios are the point.

    .venv/bin/python bench/ha.py --messages 50000 --repeat 3 --failovers 5
"""

from __future__ import annotations

import argparse
import json
import os
import re
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

from proton import Message  # noqa: E402
from proton.utils import BlockingConnection  # noqa: E402

from tests.e2e.crash_support import send_durable  # noqa: E402
from tests.e2e.ha_harness import HaBroker, ZooKeeper, free_port, pair_config  # noqa: E402
from tests.faults.clients import ClientSet, FailoverConsumer, FailoverProducer, Ledger  # noqa: E402
from tests.faults.relay import RESET, Relay  # noqa: E402

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

    def start(self, wait: bool = True) -> "PlainBroker":
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


def wait_listening(broker: HaBroker, timeout: float = 60.0) -> float:
    start = time.monotonic()
    while not broker.is_listening():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"{broker.name} did not start listening in {timeout} s")
        time.sleep(0.01)
    return time.monotonic() - start


def first_accepted(urls: list[str], started: float, timeout: float = 60.0) -> float:
    """Seconds from `started` until a durable send to either address is Accepted."""
    while time.monotonic() - started < timeout:
        for url in urls:
            try:
                conn = BlockingConnection(url, timeout=2)
            except Exception:
                continue
            try:
                conn.create_sender("bench-failover").send(Message(body="probe", durable=True), timeout=5)
                return time.monotonic() - started
            except Exception:
                pass
            finally:
                try:
                    conn.close()
                except Exception:
                    pass
        time.sleep(0.02)
    raise TimeoutError("no durable send was Accepted after the failover")


def make_pair(zk: ZooKeeper, root: Path, tag: str, **extra) -> list[HaBroker]:
    cluster = uuid.uuid4().hex[:8]
    pair = []
    for name, role in (("a", "primary"), ("b", "backup")):
        port = free_port()
        pair.append(HaBroker(f"{tag}-{name}", root / f"{tag}-{name}", pair_config(zk, cluster, role, port,
                                                                                  defaults=True, **extra), port))
    return pair


def start_pair(pair: list[HaBroker]) -> None:
    pair[0].start().wait_live(60)
    pair[1].start().wait_for_log("in sync with the live broker", 120)


# ---------------------------------------------------------------------------- 1. throughput

def throughput(zk: ZooKeeper, root: Path, a) -> dict[str, list[float]]:
    rates: dict[str, list[float]] = {"alone": [], "replicated": []}
    port = free_port()
    alone = PlainBroker("alone", root / "alone", f"port = {port}\n", port).start()
    pair = make_pair(zk, root, "tp")
    try:
        start_pair(pair)
        for rep in range(a.repeat):
            for label, url in (("alone", alone.url), ("replicated", pair[0].url))[:: 1 if rep % 2 == 0 else -1]:
                r = loadgen(url, a.messages, a.size, a.timeout)
                if "msgs_per_s" in r and not r.get("error"):
                    rates[label].append(r["msgs_per_s"])
                print(f"rep {rep + 1} {label:11s} {r.get('msgs_per_s', 0):>10,.0f} msgs/s"
                      f"  accepted {r.get('accepted')}  {r.get('error', '')}", flush=True)
    finally:
        for b in pair + [alone]:
            b.kill()
    return rates


# ---------------------------------------------------------------------------- 2. failover

def failovers(zk: ZooKeeper, root: Path, count: int) -> list[tuple[float, float]]:
    pair = make_pair(zk, root, "fo")
    out = []
    try:
        start_pair(pair)
        live, backup = pair
        send_durable(live, "bench-failover", 200, "warm")
        for cycle in range(count):
            live.kill()
            started = time.monotonic()
            listening = wait_listening(backup)
            accepted = first_accepted([live.url, backup.url], started)
            out.append((listening, accepted))
            print(f"failover {cycle + 1}: {live.name} killed, {backup.name} listening after {listening:.2f} s, "
                  f"first durable send Accepted after {accepted:.2f} s", flush=True)
            live.start().wait_for_log("in sync with the live broker", 120)
            live, backup = backup, live
    finally:
        for b in pair:
            b.kill()
    return out


# ---------------------------------------------------------------------------- 3. rejoin

def rejoin(zk: ZooKeeper, root: Path, a, window: bool, how: str) -> dict:
    tag = f"rj-{'win' if window else 'copy'}-{how}"
    relay_holder: dict[str, HaBroker] = {}
    relay = Relay(lambda: relay_target(relay_holder["live"]), tag).start()
    extra = {} if window else {"catch_up_window": 0}
    pair = make_pair(zk, root, tag, advertised_replication=relay.address, **extra)
    relay_holder["live"] = pair[0]
    ledger = Ledger()
    clients = None
    try:
        start_pair(pair)
        live, backup = pair
        for start in range(0, a.preload, 20_000):   # (send_durable gives each call 60 s)
            send_durable(live, "bench-preload", min(20_000, a.preload - start), f"preload{start}", window=500,
                         body=b"p" * 256)
        clients = ClientSet([FailoverProducer("load", [live.url], "bench-rejoin", ledger, rate=a.rate, window=500),
                             FailoverConsumer("take", [live.url], "bench-rejoin", ledger)]).start()
        time.sleep(2)
        mark = len(backup.lines)
        if how == "restart":
            backup.kill()
            time.sleep(a.away)
            returned = time.monotonic()
            backup.start(wait=False)
            mark = 0       # (a new process: its log starts again)
        else:
            relay.cut(RESET)
            time.sleep(a.away)
            returned = time.monotonic()
            relay.heal()
        backup.wait_for_log("in sync with the live broker", 300, after=mark)
        seconds = time.monotonic() - returned
        text = "".join(backup.lines[mark:])
        kind = "batches only" if "sends only what this store lacks" in text else "store copy"
        m = re.findall(r"caught up in ([\d.]+) s", text)
        size = (live.data_dir / "store" / "data.mdb").stat().st_size
        attached = logged_at(text, "attaching to the live broker")
        in_sync = logged_at(text, "in sync with the live broker")
        return {"seconds": seconds, "kind": kind, "caught_up": float(m[-1]) if m else None,
                "from_attach": round(in_sync - attached, 3) if attached and in_sync else None,
                "accepted": ledger.accepted_count(), "store_bytes": size}
    finally:
        if clients is not None:
            clients.stop(10)
        for b in pair:
            b.kill()
        relay.stop()


def logged_at(text: str, what: str) -> float | None:
    """The time of the last log line saying `what` (asctime, milliseconds)."""
    import datetime
    for line in reversed(text.splitlines()):
        if what in line:
            stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            return stamp.timestamp()
    return None


def relay_target(broker: HaBroker) -> tuple[str, int] | None:
    for line in reversed(broker.lines):
        m = re.search(r"ha: replication listening on ([\d.]+):(\d+)", line)
        if m:
            return m.group(1), int(m.group(2))
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=50_000)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--failovers", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--away", type=float, default=10.0, help="seconds the backup is away (rejoin)")
    ap.add_argument("--rate", type=float, default=500.0, help="durable msgs/s during the rejoin")
    ap.add_argument("--preload", type=int, default=200_000, help="messages in the store before the rejoin")
    ap.add_argument("--no-throughput", action="store_true")
    ap.add_argument("--no-rejoin", action="store_true")
    ap.add_argument("--no-rabbitmq", action="store_true", help="skip RabbitMQ durable p2p")
    ap.add_argument("--zk-tick", type=int, default=200,
                    help="ZooKeeper tickTime in ms (docs/ha.md's deployment and compose use 500)")
    a = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-ha-"))
    zk = ZooKeeper(root / "zk", tick_time_ms=a.zk_tick).start()
    print(f"ZooKeeper tickTime {a.zk_tick} ms", flush=True)
    rates: dict[str, list[float]] = {}
    fo: list[tuple[float, float]] = []
    rejoins: dict[tuple[str, bool], dict] = {}
    try:
        if not a.no_throughput:
            if LOADGEN.exists():
                rates = throughput(zk, root, a)
            else:
                print(f"{LOADGEN} missing (bench/setup.sh, bench/build.sh): throughput skipped", file=sys.stderr)
        if a.failovers:
            fo = failovers(zk, root, a.failovers)
        if not a.no_rejoin:
            for how in ("restart", "link"):
                for window in (True, False):
                    r = rejoins[(how, window)] = rejoin(zk, root, a, window, how)
                    print(f"rejoin ({how}, {'window' if window else 'no window'}): in sync {r['seconds']:.2f} s "
                          f"after its return, {r['from_attach']} s after it attached ({r['kind']}, caught up in "
                          f"{r['caught_up']} s; store {r['store_bytes'] / 1e6:.1f} MB)", flush=True)
    finally:
        zk.stop()
        shutil.rmtree(root, ignore_errors=True)
    print()
    if rates:
        med = {k: statistics.median(v) if v else None for k, v in rates.items()}
        print(f"durable p2p, {a.messages:,} x {a.size} B, window 1000 (median of {a.repeat})")
        for k, v in med.items():
            print(f"  {k:11s} {v or 0:>10,.0f} msgs/s")
        if med["alone"] and med["replicated"]:
            print(f"  replicated / alone: {med['replicated'] / med['alone']:.2f} (target >= 0.6)")
        rabbit = None if a.no_rabbitmq else rabbitmq_durable_rate(a.messages, a.size, a.repeat)
        if rabbit and med["replicated"]:
            print(f"  RabbitMQ durable p2p {rabbit:>10,.0f} msgs/s: replicated / RabbitMQ "
                  f"{med['replicated'] / rabbit:.2f} (target >= 1.5)")
    if fo:
        listening = [x for x, _ in fo]
        accepted = [y for _, y in fo]
        print(f"failover with the defaults (session timeout 3 s), {len(fo)} kills: listening median "
              f"{statistics.median(listening):.2f} s (max {max(listening):.2f}); first Accepted durable send median "
              f"{statistics.median(accepted):.2f} s (max {max(accepted):.2f}) (goal: median <= 5 s)")
    for how in ("restart", "link"):
        win, copy = rejoins.get((how, True)), rejoins.get((how, False))
        if win and copy:
            print(f"rejoin after {a.away:.0f} s away ({'backup restarted' if how == 'restart' else 'link cut'}) at "
                  f"{a.rate:.0f} msgs/s over {a.preload:,} stored ({win['store_bytes'] / 1e6:.0f} MB): in sync after "
                  f"its return: window {win['seconds']:.2f} s ({win['kind']}), full copy {copy['seconds']:.2f} s "
                  f"({copy['kind']}); after it attached: window {win['from_attach']} s, copy {copy['from_attach']} s; "
                  f"the catch-up itself (plan to in sync): window {win['caught_up']} s, copy {copy['caught_up']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
