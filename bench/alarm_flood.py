#!/usr/bin/env python3
"""A memory alarm under a flood: does the producer get blocked, and does it resume?

1. start amqpbroker with `[alarms] memory_high_watermark_absolute = --watermark`
   (default 256 MiB) and `check_interval = 0.5`;
2. flood: one producer (python-qpid-proton, its own process) sends non-durable
   --size B messages to one queue as fast as its credit lets it, for --seconds
   (default 60), with no consumer;
3. drain: a consumer (its own process) attaches and takes everything, for at most
   --drain-seconds (default 60), while the producer keeps trying to send;
4. every second a line: the broker's RSS (/proc/PID/status VmRSS), the watermark,
   the alarm state (GET /api/alarms), the queue depth, what the producer sent and
   had settled in that second and the credit it holds, what the consumer took.

At the end it says, from what it measured:
  * whether the alarm was raised, and at what RSS;
  * whether the producer was BLOCKED: its sends stopped while the alarm was raised,
    with no credit left, while its process and connection stayed up and no
    message was rejected (not errored, not killed) -- or that it kept sending;
  * whether the alarm cleared as the consumer drained, and the producer RESUMED.

    .venv/bin/python bench/alarm_flood.py                             # 60 s flood, 256 MiB
    .venv/bin/python bench/alarm_flood.py --seconds 10 --drain-seconds 20 --watermark 200MiB

A benchmark: it prints figures and asserts nothing.  Every process it starts is
killed in a finally block.  Do not run it while others run tests on the machine.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backlog import kill_now  # noqa: E402  (bench/backlog.py)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PYTHON = REPO / ".venv" / "bin" / "python"
LISTEN_RE = re.compile(r"(amqp|management) listening on [\d.]+:(\d+)")
MiB = 1 << 20


def log(msg: str) -> None:
    print(f"[alarm_flood {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- clients (child processes)

def run_producer(url: str, address: str, size: int, seconds: float) -> None:
    """Send as fast as credit allows; a JSON line every 0.5 s on stdout."""
    from proton import Message
    from proton.handlers import MessagingHandler
    from proton.reactor import Container

    class Producer(MessagingHandler):
        def __init__(self) -> None:
            super().__init__(auto_settle=True)
            self.sent = self.accepted = self.rejected = self.released = 0
            self.error: str | None = None
            self.message = Message(body=b"x" * size, durable=False)
            self.t0 = time.monotonic()
            self.sender = None

        def on_start(self, event):
            conn = event.container.connect(url, reconnect=False)
            self.sender = event.container.create_sender(conn, address)
            event.container.schedule(0.5, self)

        def on_sendable(self, event):
            snd = event.sender
            while snd.credit > 0 and time.monotonic() - self.t0 < seconds:
                snd.send(self.message)
                self.sent += 1

        def on_accepted(self, event):
            self.accepted += 1

        def on_rejected(self, event):
            self.rejected += 1

        def on_released(self, event):
            self.released += 1

        def _failed(self, what, endpoint):
            cond = endpoint.remote_condition
            self.error = f"{what}: {cond.name if cond else ''} {cond.description if cond else ''}".strip()

        def on_link_error(self, event):
            self._failed("link closed", event.link)

        def on_connection_error(self, event):
            self._failed("connection closed", event.connection)

        def on_transport_error(self, event):
            self._failed("transport error", event.transport)

        def on_disconnected(self, event):
            self.error = self.error or "disconnected"

        def on_timer_task(self, event):
            snd = self.sender
            print(json.dumps({"t": time.monotonic() - self.t0, "sent": self.sent, "accepted": self.accepted,
                              "rejected": self.rejected, "released": self.released, "error": self.error,
                              "credit": snd.credit if snd is not None else 0}), flush=True)
            if time.monotonic() - self.t0 >= seconds or self.error:
                event.container.stop()
            else:
                event.container.schedule(0.5, self)

    Container(Producer()).run()


def run_consumer(url: str, address: str, seconds: float) -> None:
    from proton.handlers import MessagingHandler
    from proton.reactor import Container

    class Consumer(MessagingHandler):
        def __init__(self) -> None:
            super().__init__(prefetch=1000, auto_accept=True)
            self.received = 0
            self.t0 = time.monotonic()

        def on_start(self, event):
            event.container.create_receiver(event.container.connect(url, reconnect=False), address)
            event.container.schedule(0.5, self)

        def on_message(self, event):
            self.received += 1

        def on_timer_task(self, event):
            print(json.dumps({"t": time.monotonic() - self.t0, "received": self.received}), flush=True)
            if time.monotonic() - self.t0 >= seconds:
                event.container.stop()
            else:
                event.container.schedule(0.5, self)

    Container(Consumer()).run()


class Child:
    """A client process whose last JSON line is kept."""

    def __init__(self, args: list[str]):
        self.proc = subprocess.Popen([str(PYTHON), __file__, *args], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True, cwd=str(REPO))
        self.last: dict = {}
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.last = json.loads(line)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        kill_now(self.proc)


# ---------------------------------------------------------------------- the broker

class Broker:
    def __init__(self, tmp: Path, config: str):
        (tmp / "broker.toml").write_text(config)
        self.log_path = tmp / "broker.log"
        self.cmd = [str(PYTHON), "-m", "amqpbroker.cli", "serve", "--host", "127.0.0.1", "--port", "0",
                    "--data-dir", str(tmp / "data"), "--config", str(tmp / "broker.toml"), "--log-level", "info"]
        self.ports: dict[str, int] = {}
        self.lines: list[str] = []
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", AMQPBROKER_MANAGEMENT__PORT="0")
        self.proc = subprocess.Popen(self.cmd, cwd=str(REPO), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while "amqp" not in self.ports:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("broker did not start:\n" + "".join(self.lines[-15:]))
            time.sleep(0.05)

    def _read(self) -> None:
        with open(self.log_path, "a") as f:
            for line in self.proc.stderr:
                f.write(line)
                self.lines.append(line)
                m = LISTEN_RE.search(line)
                if m:
                    self.ports[m.group(1)] = int(m.group(2))

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def alarm_lines(self) -> list[str]:
        return [ln.rstrip() for ln in self.lines if "alarm raised" in ln or "alarm cleared" in ln]

    def kill(self) -> None:
        kill_now(self.proc)


# ---------------------------------------------------------------------- the run

def sample(broker: Broker, http, queue: str, producer: Child, consumer: Child | None, t0: float) -> dict:
    row = {"t": time.monotonic() - t0, "rss": broker.rss(), "producer": dict(producer.last),
           "phase": "flood" if consumer is None else "drain",
           "producer_alive": producer.alive(), "consumer": dict(consumer.last) if consumer else None}
    try:
        row["alarms"] = http.get("/api/alarms").json()
        q = http.get(f"/api/queues/{queue}")
        row["depth"] = q.json()["depth"] if q.status_code == 200 else 0
    except Exception as exc:   # noqa: BLE001 -- a slow answer is a figure too
        row["alarms"], row["depth"] = None, None
        row["http_error"] = repr(exc)
    return row


def fmt(row: dict, prev: dict | None, phase: str) -> str:
    p, pp = row["producer"], (prev or {}).get("producer", {})
    sent = p.get("sent", 0) - pp.get("sent", 0)
    acc = p.get("accepted", 0) - pp.get("accepted", 0)
    al = row.get("alarms") or {}
    limit = (al.get("memory") or {}).get("limit")
    state = ",".join(al.get("reasons", [])) or "-" if al else "?"
    cons = ""
    if row["consumer"] is not None:
        c, cp = row["consumer"], (prev or {}).get("consumer") or {}
        cons = f"  consumer +{c.get('received', 0) - cp.get('received', 0):>7,}"
    depth = row.get("depth")
    depth_text = f"{depth:,}" if depth is not None else "?"
    return (f"{phase:5} t={row['t']:6.1f}s  RSS {row['rss'] / MiB:7,.1f} MiB / watermark "
            f"{(limit or 0) / MiB:6,.1f} MiB  alarm {state:12} depth {depth_text:>9}  "
            f"producer +{sent:>7,} sent +{acc:>7,} accepted, credit {p.get('credit', '?'):>5}{cons}")


def verdict(rows: list[dict]) -> list[str]:
    out = []
    raised = [r for r in rows if r.get("alarms") and "memory" in r["alarms"]["reasons"]]
    if not raised:
        peak = max((r["rss"] for r in rows), default=0)
        return [f"the memory alarm was never raised (peak RSS {peak / MiB:,.1f} MiB): raise --seconds or "
                f"lower --watermark"]
    first = raised[0]
    limit = first['alarms']['memory']['limit']
    out.append(f"memory alarm raised at t={first['t']:.1f}s, RSS {first['rss'] / MiB:,.1f} MiB "
               f"(watermark {limit / MiB:,.1f} MiB)")
    peak = max(rows, key=lambda r: r["rss"])
    out.append(f"peak RSS {peak['rss'] / MiB:,.1f} MiB at t={peak['t']:.1f}s ({peak['phase']}): "
               f"{'UNDER' if peak['rss'] <= limit else 'OVER'} the watermark ({peak['rss'] / limit:.3f} x)")
    # Blocked: consecutive samples under the alarm with nothing sent, no credit, producer up, no
    # rejection -- in the flood only (once a consumer drains, the alarm may clear and credit
    # flow again; there is no other flow control by consumer speed).
    stalled = 0
    blocked_at = None
    for prev, row in zip(rows, rows[1:]):
        under = row.get("alarms") and "memory" in row["alarms"]["reasons"] and row["phase"] == "flood"
        p, pp = row["producer"], prev["producer"]
        if under and p.get("sent") == pp.get("sent") and p.get("credit", 1) == 0 and row["producer_alive"] \
                and not p.get("error"):
            stalled += 1
            if stalled >= 2 and blocked_at is None:
                blocked_at = row["t"]
        else:
            stalled = 0
    last = rows[-1]["producer"]
    errors = f"rejected {last.get('rejected', 0)}, released {last.get('released', 0)}, error {last.get('error')}"
    if blocked_at is not None:
        out.append(f"producer BLOCKED from t={blocked_at:.1f}s: no sends, no credit, process and connection up "
                   f"({errors})")
    else:
        sent_under = sum(max(0, r["producer"].get("sent", 0) - p["producer"].get("sent", 0))
                         for p, r in zip(rows, rows[1:])
                         if r.get("alarms") and r["alarms"]["blocking"] and r["phase"] == "flood")
        out.append(f"producer NOT blocked: it sent {sent_under:,} messages in the flood while the alarm was "
                   f"raised ({errors}); the credit wiring (Alarms.subscribe -> producer credit) is not in place, "
                   f"or the flood ended first")
    cleared = [r for r in rows if r is not first and r["t"] > first["t"] and r.get("alarms")
               and not r["alarms"]["blocking"]]
    if not cleared:
        out.append(f"the alarm did NOT clear by the end (RSS {rows[-1]['rss'] / MiB:,.1f} MiB, depth "
                   f"{rows[-1].get('depth')}): memory the drain freed stayed in the process, or the drain was short")
    else:
        c = cleared[0]
        before = rows[rows.index(c) - 1]           # the last sample with the alarm raised
        resumed = rows[-1]["producer"].get("sent", 0) > before["producer"].get("sent", 0)
        out.append(f"alarm cleared at t={c['t']:.1f}s (RSS {c['rss'] / MiB:,.1f} MiB, depth {c.get('depth')}); "
                   f"producer {'RESUMED' if resumed else 'did not send again (its run may have ended)'}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60, help="flood without a consumer (default 60)")
    ap.add_argument("--drain-seconds", type=float, default=60, help="then a consumer for at most this long")
    ap.add_argument("--watermark", default="256MiB", help="memory_high_watermark_absolute (default 256MiB)")
    ap.add_argument("--size", type=int, default=1024, help="message body bytes (default 1024)")
    ap.add_argument("--keep", action="store_true", help="keep the data dir and broker log")
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--role", choices=["producer", "consumer"], help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.role == "producer":
        run_producer(a.url, a.address, a.size, a.seconds)
        return 0
    if a.role == "consumer":
        run_consumer(a.url, a.address, a.seconds)
        return 0

    import httpx

    tmp = Path(tempfile.mkdtemp(prefix="bench-alarm-flood-"))
    config = (f'[alarms]\nmemory_high_watermark_absolute = "{a.watermark}"\ncheck_interval = 0.5\n')
    broker = Broker(tmp, config)
    queue = f"flood-{os.getpid()}"
    rows: list[dict] = []
    children: list[Child] = []
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        broker.start()
        url = f"amqp://127.0.0.1:{broker.ports['amqp']}"
        http = httpx.Client(base_url=f"http://127.0.0.1:{broker.ports['management']}", timeout=10)
        log(f"broker up (RSS {broker.rss() / MiB:,.1f} MiB), watermark {a.watermark}; flooding {queue} with "
            f"{a.size} B non-durable messages for {a.seconds:g} s, no consumer")
        total = a.seconds + a.drain_seconds
        producer = Child(["--role", "producer", "--url", url, "--address", queue, "--size", str(a.size),
                          "--seconds", str(total)])
        children.append(producer)
        t0 = time.monotonic()
        consumer: Child | None = None
        phase = "flood"
        while time.monotonic() - t0 < total:
            time.sleep(1.0 - (time.monotonic() - t0) % 1.0)
            if consumer is None and time.monotonic() - t0 >= a.seconds:
                log("drain: a consumer attaches; the producer keeps trying to send")
                consumer = Child(["--role", "consumer", "--url", url, "--address", queue,
                                  "--seconds", str(a.drain_seconds)])
                children.append(consumer)
                phase = "drain"
            row = sample(broker, http, queue, producer, consumer, t0)
            print(fmt(row, rows[-1] if rows else None, phase), flush=True)
            rows.append(row)
            if phase == "drain" and row.get("depth") == 0 and row.get("alarms") and not row["alarms"]["blocking"] \
                    and len(rows) >= 3 and rows[-1]["producer"].get("sent", 0) > rows[-3]["producer"].get("sent", 0):
                log("drained, alarm clear, producer sending: done")
                break
        print()
        print(f"alarm flood: {a.size} B non-durable, watermark {a.watermark}, flood {a.seconds:g} s, "
              f"drain up to {a.drain_seconds:g} s")
        for line in verdict(rows):
            print("  " + line)
        print("  broker log:")
        for line in broker.alarm_lines():
            print("    " + line)
        if producer.err:
            print("  producer stderr: " + "".join(producer.err)[-500:])
    except KeyboardInterrupt:
        log("interrupted")
    finally:
        for child in children:
            child.kill()
        broker.kill()
        if a.keep:
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(rows, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
