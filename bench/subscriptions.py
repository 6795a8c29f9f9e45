#!/usr/bin/env python3
"""Many durable subscriptions: attach, fan-out, memory, store, restart, first delivery, drain.

For each subscription count (default 1,000 and 10,000) on a fresh broker:

1. attach the durable subscriptions (Qpid JMS shape: link name = subscription name,
   expiry-policy never, capability `topic`) on `amq.topic/bench` from --connections
   client processes, all at once, then detach them with closed=false (kept);
   attach rate = subscriptions / seconds until every attach reply arrived;
2. publish --messages durable --size B messages to `amq.topic/bench` (every one
   matches every subscription), unsettled, --window in flight; publish rate =
   enqueues (messages x subscriptions) / seconds until every message was Accepted;
3. RSS of the broker and its store writer process after the publish, and the
   store's size on disk (data.mdb, blocks allocated);
4. SIGTERM, restart on the same store: restart-to-listening (process start to the
   "amqp listening" line); the consumers re-attach every subscription at once, each
   with a credit of 1, and restart-to-first-delivery is from the process start to
   the moment the last subscription got its first message (a first delivery, not
   the clients' speed at taking a backlog: the clients multiplex 1,000 subscriptions
   a process); peak RSS (broker + writer) is sampled every 0.1 s from the restart to
   that moment, and again during the drain (where it follows the credit the
   consumers grant: every unsettled delivery costs about 1.5 KB, most of it proton's);
5. drain: then every subscription gets --credit (at most --inflight over all) and
   its consumer accepts everything; drain rate = deliveries / seconds (from the
   credit to the last delivery); --drain-seconds bounds it.

Goals (issue: many durable subscriptions): at 10,000 x 1,000, listening within
10 s, first message on every subscription within 30 s, RSS <= 500 MiB throughout.

    .venv/bin/python bench/subscriptions.py                      # 1k and 10k x 1,000
    .venv/bin/python bench/subscriptions.py --subs 1000          # 1k only
    .venv/bin/python bench/subscriptions.py --repo /tmp/old      # another source tree

`--repo` runs the broker from another checkout (a `git worktree` of an older
commit) with this repository's virtualenv: the same run then measures both.  A
benchmark: it prints figures and asserts nothing.  The clients are
python-qpid-proton processes; on a 2-core machine they share the CPU with the
broker, so the rates are lower bounds.  Every process it starts is killed in a
finally block.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from backlog import kill_now  # noqa: E402  (bench/backlog.py: the benches' process-group kill)
PYTHON = REPO / ".venv" / "bin" / "python"
LISTEN_RE = re.compile(r"amqp listening on [\d.]+:(\d+)")
RECOVERED_RE = re.compile(r"store recovered .* in ([\d.]+) s")
MB = 1 << 20
TOPIC = "amq.topic/bench"


def log(msg: str) -> None:
    print(f"[subscriptions {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- client workers


def _durable_source(link) -> None:
    """The source of a Qpid JMS durable subscriber (createDurableConsumer)."""
    from proton import Terminus, symbol
    src = link.source
    src.address = TOPIC
    src.durability = Terminus.DELIVERIES
    src.expiry_policy = Terminus.EXPIRE_NEVER
    src.distribution_mode = Terminus.DIST_MODE_COPY
    src.capabilities.put_array(False, 21)
    src.capabilities.enter()
    src.capabilities.put_symbol(symbol("topic"))
    src.capabilities.exit()


def worker_subscriptions(url: str, container_id: str, names: list[str], mode: str, credit: int,
                         expect: int, limit: float, barrier: str = "", drain: float = 0.0) -> dict:
    """attach: attach every subscription with no credit, then detach (closed=false).
    consume: attach every subscription with a credit of 1 and note its first
    delivery; once every subscription of every worker has had one (the file
    `barrier`/go), grant `credit` and accept everything until `expect` per
    subscription (or `limit` seconds)."""
    from proton.handlers import MessagingHandler
    from proton.reactor import Container

    class Poll:
        def __init__(self, owner):
            self.owner = owner

        def on_timer_task(self, event):
            self.owner.poll(event.container)

    class Subs(MessagingHandler):
        def __init__(self):
            super().__init__(prefetch=0, auto_accept=True)
            self.opened = 0
            self.detached = 0
            self.first: dict[str, float] = {}
            self.got: dict[str, int] = {}
            self.received = 0
            self.drained = 0
            self.last = 0.0
            self.out: dict = {}
            self.done = False
            self.draining = False

        def on_start(self, event):
            self.out["started"] = time.time()
            self.conn = event.container.connect(url, reconnect=False, container_id=container_id)
            self.links = []
            for name in names:
                rcv = event.container.create_receiver(self.conn, TOPIC, name=name)
                _durable_source(rcv)   # before the attach goes out (at the end of this event)
                self.links.append(rcv)
            event.container.schedule(limit, self)
            if mode == "consume":
                event.container.schedule(0.05, Poll(self))

        def on_link_opened(self, event):
            self.opened += 1
            if mode == "consume":
                event.link.flow(1)
            if self.opened == len(names):
                self.out["attached"] = time.time()
                if mode == "attach":
                    for rcv in self.links:
                        rcv.detach()

        def on_link_remote_detach(self, event):   # the broker's detach (closed=false)
            self.detached += 1
            if mode == "attach" and self.detached == len(names):
                self.out["detached"] = time.time()
                self._finish()

        def poll(self, container):
            if self.done or self.draining:
                return
            if os.path.exists(os.path.join(barrier, "go")):
                self.draining = True
                self.out["go"] = time.time()
                if drain:
                    container.schedule(drain, self)
                for rcv in self.links:
                    rcv.flow(max(0, credit - rcv.credit))
            else:
                container.schedule(0.05, Poll(self))

        def on_message(self, event):
            now = time.time()
            link = event.link
            name = link.name
            if name not in self.first:
                self.first[name] = now
                if len(self.first) == len(names):
                    self.out["first_all"] = now
                    with open(os.path.join(barrier, f"first-{container_id}"), "w"):
                        pass
            n = self.got[name] = self.got.get(name, 0) + 1
            self.received += 1
            self.last = now
            if self.draining:
                self.drained += 1
                if link.credit < credit // 2:
                    link.flow(credit - link.credit)
            if n == expect and len(self.first) == len(names) and all(
                    v >= expect for v in self.got.values()):
                self._finish()

        def on_timer_task(self, event):
            self.out["timed_out"] = True
            self._finish()

        def _finish(self):
            if self.done:
                return
            self.done = True
            self.conn.close()

        def on_connection_closed(self, event):
            event.container.stop()

        def on_transport_error(self, event):
            self.out["error"] = str(event.transport.condition)
            event.container.stop()

    h = Subs()
    Container(h).run()
    out = dict(h.out)
    if h.first:
        out["first_max"] = max(h.first.values())
        out["first_min"] = min(h.first.values())
    out.update(subscriptions_with_first=len(h.first), received=h.received, drained=h.drained, last=h.last,
               opened=h.opened)
    return out


def worker_publish(url: str, n: int, size: int, window: int) -> dict:
    from proton import Message
    from proton.handlers import MessagingHandler
    from proton.reactor import Container

    class Pub(MessagingHandler):
        def __init__(self):
            super().__init__()
            self.sent = self.settled = self.accepted = 0
            self.body = b"x" * size
            self.t0 = 0.0

        def on_start(self, event):
            conn = event.container.connect(url, reconnect=False)
            event.container.create_sender(conn, TOPIC)

        def on_sendable(self, event):
            s = event.sender
            if not self.t0:
                self.t0 = time.time()
            while s.credit and self.sent < n and self.sent - self.settled < window:
                s.send(Message(body=self.body, durable=True))
                self.sent += 1

        def on_settled(self, event):
            self.settled += 1
            if event.delivery.remote_state == event.delivery.ACCEPTED:
                self.accepted += 1
            if self.settled >= n:
                self.t1 = time.time()
                event.connection.close()
            else:
                self.on_sendable(event)

    h = Pub()
    Container(h).run()
    return {"sent": h.sent, "accepted": h.accepted, "start": h.t0, "end": getattr(h, "t1", time.time())}


def worker_main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    if spec["kind"] == "publish":
        out = worker_publish(spec["url"], spec["n"], spec["size"], spec["window"])
    else:
        out = worker_subscriptions(spec["url"], spec["container_id"], spec["names"], spec["mode"],
                                   spec["credit"], spec["expect"], spec["limit"], spec.get("barrier", ""),
                                   spec.get("drain", 0.0))
    print(json.dumps(out), flush=True)
    return 0


SPAWNED: list[subprocess.Popen] = []   # client processes, killed at the end whatever happens


def spawn(spec: dict) -> subprocess.Popen:
    proc = subprocess.Popen([str(PYTHON), str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    SPAWNED.append(proc)
    return proc


def collect(procs: list[subprocess.Popen], timeout: float) -> list[dict]:
    out = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_now(p)
            stdout, stderr = p.communicate()
        line = next((ln for ln in reversed(stdout.splitlines()) if ln.startswith("{")), None)
        out.append(json.loads(line) if line else {"error": stderr.strip()[-400:]})
    return out


# ---------------------------------------------------------------------- broker process


def rss(pid: int) -> int:
    """VmRSS of the broker and its children (the store writer), bytes."""
    pids = [pid]
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                pids += [int(c) for c in f.read().split()]
    except FileNotFoundError:
        return 0
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except FileNotFoundError:
            pass
    return total


class Broker:
    def __init__(self, repo: Path, data: Path, log_path: Path):
        self.repo, self.data, self.log_path = repo, data, log_path
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.peak = 0
        self._sampling = False

    def start(self, timeout: float = 600) -> float:
        """Start; seconds from the process start to the 'amqp listening' line."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", AMQPBROKER_MANAGEMENT__PORT="0", PYTHONPATH=str(self.repo))
        cmd = [str(PYTHON), "-m", "amqpbroker.cli", "serve", "--host", "127.0.0.1", "--port", "0",
               "--data-dir", str(self.data), "--log-level", "info"]
        self.port = 0
        self.lines = []
        self.started = time.time()
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=str(self.repo), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                                     start_new_session=True)
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()
        threading.Thread(target=self._sample, args=(self.proc,), daemon=True).start()
        with self.cond:
            while not self.port:
                if self.proc.poll() is not None:
                    raise RuntimeError("broker exited:\n" + "".join(self.lines[-15:]))
                if time.monotonic() - t0 > timeout:
                    raise RuntimeError("broker did not start in time:\n" + "".join(self.lines[-15:]))
                self.cond.wait(0.1)
        return self.listen_at - t0

    def _read(self, proc: subprocess.Popen) -> None:
        with open(self.log_path, "a") as f:
            for line in proc.stderr:
                now = time.monotonic()
                f.write(line)
                with self.cond:
                    self.lines.append(line)
                    m = LISTEN_RE.search(line)
                    if m and not self.port:
                        self.port = int(m.group(1))
                        self.listen_at = now
                    self.cond.notify_all()

    def _sample(self, proc: subprocess.Popen) -> None:
        while proc.poll() is None:
            self.peak = max(self.peak, rss(proc.pid))
            time.sleep(0.1)

    def stop(self, timeout: float = 300) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_now(self.proc)

    def kill(self) -> None:
        kill_now(self.proc)

    def recovered(self) -> str:
        for line in self.lines:
            m = RECOVERED_RE.search(line)
            if m:
                return m.group(1)
        return "?"


def store_bytes(data: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in (data / "store").glob("*.mdb"))


# ---------------------------------------------------------------------- one run


def run(n_subs: int, a: argparse.Namespace, tmp: Path) -> dict:
    data = tmp / f"data-{n_subs}"
    broker = Broker(a.repo.resolve(), data, tmp / f"broker-{n_subs}.log")
    conns = max(1, min(a.connections, n_subs))
    groups = [[f"sub{c:02d}-{i:05d}" for i in range(c, n_subs, conns)] for c in range(conns)]
    result: dict = {"subscriptions": n_subs, "messages": a.messages}
    try:
        broker.start()
        url = f"amqp://127.0.0.1:{broker.port}"
        log(f"{n_subs:,} subscriptions: attaching from {conns} connection(s)")
        procs = [spawn({"kind": "subs", "url": url, "container_id": f"bench-client-{c}", "names": names,
                        "mode": "attach", "credit": 0, "expect": 0, "limit": a.timeout})
                 for c, names in enumerate(groups)]
        outs = collect(procs, a.timeout + 30)
        bad = [o for o in outs if "attached" not in o]
        if bad:
            raise RuntimeError(f"attach failed: {bad[:2]}")
        attach_s = max(o["attached"] for o in outs) - min(o["started"] for o in outs)
        result["attach_per_s"] = n_subs / attach_s
        log(f"attached in {attach_s:.1f} s; publishing {a.messages:,} x {a.size} B durable")
        pub = collect([spawn({"kind": "publish", "url": url, "n": a.messages, "size": a.size,
                              "window": a.window})], a.timeout)[0]
        if pub.get("accepted") != a.messages:
            raise RuntimeError(f"publish failed: {pub}")
        publish_s = pub["end"] - pub["start"]
        result["publish_enqueues_per_s"] = a.messages * n_subs / publish_s
        result["publish_s"] = publish_s
        time.sleep(a.settle)
        result["rss_after_publish_mib"] = rss(broker.proc.pid) / MB
        result["peak_rss_before_mib"] = broker.peak / MB
        result["store_mib"] = store_bytes(data) / MB
        log(f"published in {publish_s:.1f} s; RSS {result['rss_after_publish_mib']:.0f} MiB, "
            f"store {result['store_mib']:.0f} MiB; restarting")
        broker.stop()
        broker.peak = 0
        result["restart_to_listening_s"] = broker.start(a.timeout)
        result["recovery_s"] = broker.recovered()
        url = f"amqp://127.0.0.1:{broker.port}"
        credit = max(1, min(a.credit, a.inflight // n_subs))
        barrier = tmp / f"barrier-{n_subs}"
        barrier.mkdir(exist_ok=True)
        procs = [spawn({"kind": "subs", "url": url, "container_id": f"bench-client-{c}", "names": names,
                        "mode": "consume", "credit": credit, "expect": a.messages, "barrier": str(barrier),
                        "limit": a.first_timeout + a.timeout, "drain": a.drain_seconds})
                 for c, names in enumerate(groups)]
        deadline = time.monotonic() + a.first_timeout
        while time.monotonic() < deadline and len(list(barrier.glob("first-*"))) < len(groups):
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.05)
        result["peak_rss_first_mib"] = broker.peak / MB
        broker.peak = 0
        (barrier / "go").touch()   # every subscription has had its first message: drain
        outs = collect(procs, a.first_timeout + a.timeout + 60)
        errs = [o for o in outs if "error" in o]
        if errs:
            raise RuntimeError(f"consumers failed: {errs[:2]}")
        if all("attached" in o for o in outs):
            result["restart_to_attached_s"] = max(o["attached"] for o in outs) - broker.started
        with_first = sum(o.get("subscriptions_with_first", 0) for o in outs)
        result["subscriptions_served"] = with_first
        if with_first == n_subs:
            result["restart_to_first_delivery_s"] = max(o["first_max"] for o in outs) - broker.started
        received = sum(o["drained"] for o in outs)
        first = min(o["go"] for o in outs if "go" in o)
        last = max(o["last"] for o in outs)
        result["drained"] = received
        result["drain_per_s"] = received / (last - first) if last > first else 0.0
        result["peak_rss_drain_mib"] = broker.peak / MB
        result["inflight"] = credit * n_subs
        log(f"drained {received:,} in {last - first:.1f} s; peak RSS {result['peak_rss_first_mib']:.0f} MiB to the "
            f"first deliveries, {result['peak_rss_drain_mib']:.0f} MiB while draining")
    except Exception as exc:   # a failed run is reported, the next one still runs
        result["error"] = str(exc)[:500]
        log(f"{n_subs:,}: {exc}")
    finally:
        broker.kill()
        if not a.keep_tmp:
            shutil.rmtree(data, ignore_errors=True)
    return result


ROWS = [
    ("attach rate (subscriptions/s)", "attach_per_s", "{:,.0f}"),
    ("publish rate (enqueues/s)", "publish_enqueues_per_s", "{:,.0f}"),
    ("RSS after publish (MiB)", "rss_after_publish_mib", "{:,.0f}"),
    ("peak RSS while attaching and publishing (MiB)", "peak_rss_before_mib", "{:,.0f}"),
    ("store size (MiB)", "store_mib", "{:,.1f}"),
    ("restart to listening (s)", "restart_to_listening_s", "{:.2f}"),
    ("  of which store recovery (s)", "recovery_s", "{}"),
    ("restart to every subscription re-attached (s)", "restart_to_attached_s", "{:.2f}"),
    ("restart to first delivery, all subscriptions (s)", "restart_to_first_delivery_s", "{:.2f}"),
    ("peak RSS from restart to first delivery on all (MiB)", "peak_rss_first_mib", "{:,.0f}"),
    ("peak RSS while draining (MiB)", "peak_rss_drain_mib", "{:,.0f}"),
    ("  with deliveries in flight (credit granted)", "inflight", "{:,}"),
    ("drain rate (deliveries/s)", "drain_per_s", "{:,.0f}"),
    ("deliveries drained", "drained", "{:,}"),
]


def table(results: list[dict]) -> str:
    head = "| figure | " + " | ".join(f"{r['subscriptions']:,} x {r['messages']:,}" for r in results) + " |"
    lines = [head, "|---|" + "---|" * len(results)]
    for label, key, fmt in ROWS:
        cells = []
        for r in results:
            v = r.get(key)
            cells.append(fmt.format(v) if v is not None else ("error" if "error" in r else "-"))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for r in results:
        if "error" in r:
            lines.append(f"\n{r['subscriptions']:,}: error: {r['error']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--subs", default="1000,10000", help="subscription counts, comma separated")
    ap.add_argument("--messages", type=int, default=1000)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--connections", type=int, default=10, help="client connections (processes)")
    ap.add_argument("--window", type=int, default=1000, help="unsettled publishes in flight")
    ap.add_argument("--credit", type=int, default=100, help="credit per subscription when draining")
    ap.add_argument("--inflight", type=int, default=100_000,
                    help="credit over all subscriptions at most (credit = min(--credit, this / subs))")
    ap.add_argument("--drain-seconds", type=float, default=0.0, help="bound the drain (0: drain everything)")
    ap.add_argument("--first-timeout", type=float, default=300.0,
                    help="seconds the first delivery on every subscription may take before the drain starts anyway")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds idle before the RSS reading")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--repo", type=Path, default=REPO, help="source tree to run the broker from")
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--keep-tmp", action="store_true")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # a SIGTERM still runs the clean-up below
    tmp = Path(tempfile.mkdtemp(prefix="subscriptions-"))
    results = []
    try:
        for n in [int(x) for x in a.subs.split(",") if x]:
            results.append(run(n, a, tmp))
    finally:
        for proc in SPAWNED:
            kill_now(proc)
        if not a.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            log(f"kept {tmp}")
    print(f"durable subscriptions on {TOPIC}, {a.messages:,} x {a.size} B durable messages each "
          f"(broker from {a.repo.resolve()}):")
    print(table(results))
    print("goals at 10,000 x 1,000: listening <= 10 s, first delivery on every subscription <= 30 s, "
          "RSS <= 500 MiB throughout")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
