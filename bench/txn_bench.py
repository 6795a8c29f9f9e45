#!/usr/bin/env python3
"""Transaction benchmark: transactions of 10 messages, commits per second, durable
and non-durable, against amqpbroker (started here on a free port).

Each session runs declare → 10 transactional sends → discharge(commit) → wait for
the outcome, back to back; several sessions run at once on one connection so the
broker, not the round trip, is what is measured.  The client's own CPU share is
printed so it can be seen not to be the bottleneck.

    .venv/bin/python bench/txn_bench.py [--seconds 10] [--sessions 4] [--size 256]
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from proton import Collector, Connection, Delivery, Described, Message, Terminus, Transport, symbol, ulong

DECLARE, DISCHARGE, DECLARED, TXN_STATE = 0x31, 0x32, 0x33, 0x34


class Client:
    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setblocking(False)
        self.t = Transport(Transport.CLIENT)
        self.t.sasl().allowed_mechs("ANONYMOUS")
        self.c = Connection()
        self.c.container = "txn-bench"
        self.coll = Collector()
        self.c.collect(self.coll)
        self.t.bind(self.c)
        self.c.open()

    def pump(self, wait: float = 0.01) -> None:
        t = self.t
        pending = t.pending()
        if pending > 0:
            try:
                n = self.sock.send(t.peek(pending))
                t.pop(n)
            except BlockingIOError:
                pass
        r, _, _ = select.select([self.sock], [], [], wait)
        if r:
            data = self.sock.recv(1 << 20)
            if not data:
                raise SystemExit("broker closed the connection")
            while data:
                cap = t.capacity()
                t.push(data[:cap])
                data = data[cap:]
        while self.coll.peek():
            self.coll.pop()

    def wait(self, pred, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > end:
                raise SystemExit("timed out")
            self.pump()


class TxnSession:
    """One session driving its own transaction loop as a small state machine."""

    def __init__(self, client: Client, address: str, size: int, durable: bool):
        self.client = client
        ssn = client.c.session()
        ssn.open()
        self.coord = ssn.sender(f"qpid-jms:coordinator:bench-{id(self)}")
        self.coord.target.type = Terminus.COORDINATOR
        caps = self.coord.target.capabilities
        caps.put_array(False, 21)
        caps.enter()
        caps.put_symbol(symbol("amqp:local-transactions"))
        caps.exit()
        self.coord.open()
        self.snd = ssn.sender(f"qpid-jms:sender:bench-{id(self)}")
        self.snd.target.address = address
        self.snd.open()
        self.body = Message(body=b"x" * size, durable=durable).encode()
        self.pending = None
        self.state = "declare"
        self.txn = b""
        self.commits = 0
        self.tag = 0

    def _send_ctrl(self, body) -> Delivery:
        self.tag += 1
        return self.coord.send(Message(body=body), tag=str(self.tag))

    def step(self) -> None:
        if self.coord.credit <= 0 or self.snd.credit <= 0 and self.state == "sending":
            return
        if self.state == "declare":
            self.pending = self._send_ctrl(Described(ulong(DECLARE), [None]))
            self.state = "declaring"
        elif self.state == "declaring" and self.pending.remote_state:
            assert self.pending.remote_state == DECLARED
            self.txn = bytes(self.pending.remote.data[0])
            self.pending.settle()
            for _ in range(10):
                self.tag += 1
                dlv = self.snd.delivery(str(self.tag))
                dlv.local.data = [self.txn]
                dlv.update(TXN_STATE)
                self.snd.stream(self.body)
                self.snd.advance()
                dlv.settle()
            self.pending = self._send_ctrl(Described(ulong(DISCHARGE), [self.txn, False]))
            self.state = "committing"
        elif self.state == "committing" and (self.pending.remote_state or self.pending.settled):
            if self.pending.remote_state != Delivery.ACCEPTED:
                raise SystemExit(f"commit failed: {self.pending.remote_state}")
            self.pending.settle()
            self.commits += 1
            self.state = "declare"


def start_broker(data_dir: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-m", "amqpbroker.cli", "serve", "--port", "0",
                             "--data-dir", data_dir, "--log-level", "info"],
                            stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, AMQPBROKER_MANAGEMENT__PORT="0"))
    for line in proc.stderr:
        m = re.search(r"amqp listening on [\d.]+:(\d+)", line)
        if m:
            return proc, int(m.group(1))
    raise SystemExit("broker did not start")


def drain_queue(port: int, address: str) -> None:
    """Empty the queue so the next run starts clean (not timed)."""
    from proton.utils import BlockingConnection
    conn = BlockingConnection(f"127.0.0.1:{port}")
    rcv = conn.create_receiver(address, credit=1000)
    try:
        while True:
            rcv.receive(timeout=0.5)
            rcv.accept()
    except Exception:
        pass
    conn.close()


def run(port: int, durable: bool, seconds: float, sessions: int, size: int) -> dict:
    address = f"txn-bench-{'d' if durable else 'n'}-{os.getpid()}"
    client = Client(port)
    txns = [TxnSession(client, address, size, durable) for _ in range(sessions)]
    client.wait(lambda: all(s.coord.credit > 0 and s.snd.credit > 0 for s in txns))
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        for s in txns:
            s.step()
        client.pump(0.001)
    wall = time.monotonic() - start
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    commits = sum(s.commits for s in txns)
    client.sock.close()
    drain_queue(port, address)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    return {"commits_per_s": commits / wall, "msgs_per_s": commits * 10 / wall, "client_cpu_pct": 100 * cpu / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--size", type=int, default=256)
    args = ap.parse_args()
    data_dir = tempfile.mkdtemp(prefix="txn-bench-")
    proc, port = start_broker(data_dir)
    try:
        rows = []
        for durable in (False, True):
            r = run(port, durable, args.seconds, args.sessions, args.size)
            rows.append(("durable" if durable else "non-durable", r))
        print(f"transactions of 10 x {args.size} B, {args.sessions} sessions, {args.seconds:g} s each")
        print(f"{'kind':<12} {'commits/s':>10} {'msgs/s':>10} {'client CPU':>11}")
        for kind, r in rows:
            print(f"{kind:<12} {r['commits_per_s']:>10,.0f} {r['msgs_per_s']:>10,.0f} {r['client_cpu_pct']:>10.0f}%")
        nd, d = rows[0][1], rows[1][1]
        print(f"durable / non-durable commit rate: {d['commits_per_s'] / nd['commits_per_s']:.2f}")
    finally:
        proc.terminate()
        proc.wait(15)
        shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
