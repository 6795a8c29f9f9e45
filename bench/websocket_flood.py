#!/usr/bin/env python3
"""Hostile WebSocket clients against other clients' service: a benchmark (prints
figures, asserts nothing).

1. start amqpbroker with a `[websocket]` listener on a fresh data dir;
2. a canary AMQP client (python-qpid-proton over TCP, in a child process) makes round
   trips (send, the broker's accept, the delivery back, accept) for `--seconds`:
   at rest; while one client floods the plain TCP listener with AMQP heartbeats (8-byte
   empty frames, AMQP 1.0 §2.4.5); while one client sends the same AMQP bytes over
   WebSocket, one byte per WebSocket message (the cheapest bytes for it, the dearest
   for the broker);
3. a client that never reads floods pings: how many it got in before the broker hung
   up, and how much the broker's RSS grew.

    .venv/bin/python bench/websocket_flood.py
    .venv/bin/python bench/websocket_flood.py --seconds 10

Figures from a busy 2-core machine are indicative only; the ratios to the canary at
rest in the same run are what to compare.  Every broker it starts is stopped.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.broker_process import BrokerProcess  # noqa: E402
from tests.e2e.canary import Canary  # noqa: E402
from tests.e2e.helpers_conn import AMQP_HEADER, amqp_frame  # noqa: E402
from tests.e2e.test_websocket_floods import (EMPTY_FRAME, PING, _flood, rss, send_until,  # noqa: E402
                                             upgraded_socket, ws_frame)


def tcp_flood(port: int, stop: threading.Event) -> None:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(AMQP_HEADER + amqp_frame(0, 0x10, ["tcp-flooder"]))
    send_until(s, EMPTY_FRAME * 30000, stop)


def canary_under(broker: BrokerProcess, flood, port: int | None, seconds: float) -> dict:
    stop = threading.Event()
    thread = None
    if flood is not None:
        thread = threading.Thread(target=flood, args=(port, stop), daemon=True)
        thread.start()
        time.sleep(0.5)
    try:
        with Canary(broker) as canary:
            time.sleep(seconds)
    except RuntimeError as exc:       # the canary could not even connect (within a minute)
        print(f"canary: {exc}", file=sys.stderr)
        return {"round_trips": 0, "p50_ms": float("nan"), "p99_ms": float("nan"), "max_ms": float("nan")}
    finally:
        stop.set()
        if thread is not None:
            thread.join(10)
    rtts = canary.report.rtts
    return {"round_trips": len(rtts), "p50_ms": statistics.median(rtts) * 1000,
            "p99_ms": canary.report.quantile(0.99) * 1000, "max_ms": canary.report.worst * 1000}


def ping_flood(broker: BrokerProcess, megabytes: int) -> dict:
    s = upgraded_socket(broker.ports["ws"], rcvbuf=4096)
    chunk = ws_frame(PING, b"p" * 125) * 2000
    total = megabytes * 1_000_000
    before = rss(broker.proc.pid)
    sent = 0
    try:
        while sent < total:
            s.sendall(chunk)
            sent += len(chunk)
    except OSError:
        pass
    finally:
        s.close()
    return {"sent_mb": sent / 1e6, "disconnected": sent < total, "rss_growth_mb": (rss(broker.proc.pid) - before) / 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=5.0, help="canary time per phase")
    p.add_argument("--ping-mb", type=int, default=40, help="megabytes of pings the non-reader sends at most")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        broker = BrokerProcess(Path(tmp) / "data", config="[websocket]\nport = 0\n").start()
        try:
            rest = canary_under(broker, None, None, args.seconds)
            tcp = canary_under(broker, tcp_flood, broker.port, args.seconds)
            ws = canary_under(broker, _flood, broker.ports["ws"], args.seconds)
            pings = ping_flood(broker, args.ping_mb)
        finally:
            broker.stop()
    print(f"{'canary':<34} {'round trips':>11} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'p50 / rest':>10}")
    for name, r in (("at rest", rest), ("TCP: heartbeat flood", tcp), ("WebSocket: 1-byte message flood", ws)):
        print(f"{name:<34} {r['round_trips']:>11} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {r['max_ms']:>8.1f} "
              f"{r['p50_ms'] / rest['p50_ms']:>10.1f}")
    print(f"ping flood from a client that never reads: {pings['sent_mb']:.1f} MB sent, "
          f"{'disconnected' if pings['disconnected'] else 'NOT disconnected'}, broker RSS "
          f"+{pings['rss_growth_mb']:.1f} MB")


if __name__ == "__main__":
    main()
