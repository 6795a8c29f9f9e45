#!/usr/bin/env python3
"""How near a synchronous durable send through this broker comes to what its design
could reach at best, on this machine, in one interleaved run.

Issue: "a synchronous durable send costs at most one fsync plus the round trip"
(goal: rate >= 0.5 x 1/fsync).  bench/sync_send.py measures the broker against
1/fsync; this measures how much of the gap is the round trip itself:

  amqpbroker, not durable   the broker's round trip with nothing to store (settled
                            Accepted as it is routed): its floor
  amqpbroker                durable: the journal's fdatasync in the writer process,
                            LMDB, the hand-over there and back
  sink                      proton's reactor in Python, every transfer accepted on
                            arrival (bench/floor_sink.py): another Python server's
                            round trip, nothing stored
  sink + fdatasync          the same, each message appended to a file and
                            fdatasync'ed on the loop before the Accepted
  C example broker          Qpid Proton's C example broker (bench/build.sh), which
                            stores nothing: the client's and the loopback's share of
                            any round trip on this machine

and derives the best a commit inside the broker's process could do: the not-durable
round trip plus one fdatasync, nothing else (no hand-over, no index).  Each runs
loadgen with 1 sender, `--window 1`, 256 B messages (as Qpid JMS sends persistent
messages), --reps times, interleaved.  Prints the median rate of each and
rate / (1 / fsync), with the fsync time measured in the same directory.

    .venv/bin/python bench/sync_floor.py [--messages 3000] [--reps 3]

A benchmark: it prints figures and asserts nothing.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from backlog import Broker, loadgen, log  # noqa: E402  bench/backlog.py: one broker, loadgen runs
from sync_send import GOAL, run_options, sync_time  # noqa: E402


class CBroker:
    def __init__(self):
        binary = HERE / "build" / "cbroker"
        if not binary.exists():
            raise RuntimeError(f"{binary} not built: run bench/build.sh")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.proc = subprocess.Popen([str(binary), "127.0.0.1", str(self.port)], cwd=binary.parent,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("the C example broker did not listen")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


class Sink:
    def __init__(self, sync_file: Path | None):
        cmd = [sys.executable, str(HERE / "floor_sink.py"), "--port", "0"]
        if sync_file is not None:
            cmd += ["--sync", str(sync_file)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "listening":
            raise RuntimeError("the sink did not start")
        self.port = int(line[1])

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def main(argv=None) -> int:
    a = run_options(__doc__).parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="sync-floor-"))
    (tmp / "data").mkdir()
    broker = Broker(tmp / "data", tmp / "broker.log", None)
    subjects: dict[str, object] = {}
    sinks: dict[str, Sink | CBroker] = {}
    rates: dict[str, list[float]] = {}
    try:
        broker.start()
        sinks = {"sink": Sink(None), "sink + fdatasync": Sink(tmp / "data" / "sink.log"),
                 "C example broker": CBroker()}
        subjects = {"amqpbroker, not durable": broker, "amqpbroker": broker, **sinks}
        rates = {label: [] for label in subjects}
        fsync = sync_time(tmp / "data", a.fsyncs)
        fdatasync = sync_time(tmp / "data", a.fsyncs, os.fdatasync)
        log(f"in the data dir: fsync {fsync * 1e6:,.0f} us, fdatasync {fdatasync * 1e6:,.0f} us")
        labels = list(subjects)
        for rep in range(a.reps):
            for label in labels[rep % len(labels):] + labels[:rep % len(labels)]:
                durable = [] if label.endswith("not durable") else ["--durable"]
                r = loadgen(f"amqp://127.0.0.1:{subjects[label].port}",
                            ["--address", f"floor{rep}-{len(durable)}", "--messages", str(a.messages), "--size",
                             "256", "--senders", "1", "--receivers", "0", "--window", "1", *durable], a.timeout)
                rate = r.get("msgs_per_s") if r.get("accepted") == a.messages else None
                log(f"rep {rep}: {label}: {rate or 0:,.0f} msgs/s  {'' if rate else r}")
                if rate:
                    rates[label].append(rate)
    finally:
        for sink in sinks.values():
            sink.stop()
        broker.stop()
        broker.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"synchronous durable sends, 1 producer, window 1, 256 B, median of {a.reps} x {a.messages:,}:")
    print(f"  fsync in the data dir {fsync * 1e6:,.0f} us (1 / fsync = {1 / fsync:,.0f}/s), "
          f"fdatasync {fdatasync * 1e6:,.0f} us")
    print(f"  {'':<24} {'msgs/s':>8} {'round trip':>11} {'rate / (1/fsync)':>17}")
    for label, got in rates.items():
        if not got:
            print(f"  {label:<24} no measurement")
            continue
        rate = statistics.median(got)
        print(f"  {label:<24} {rate:>8,.0f} {1e6 / rate:>8,.0f} us {rate * fsync:>17.2f}")
    if rates.get("amqpbroker, not durable") and rates.get("amqpbroker"):
        bare = 1 / statistics.median(rates["amqpbroker, not durable"])
        best = 1 / (bare + fdatasync)
        print(f"  best a commit in the broker's own process could do (the not-durable round trip + one "
              f"fdatasync): {best:,.0f} msgs/s = {best * fsync:.2f} x 1/fsync (goal {GOAL}: "
              f"{'within reach' if best * fsync >= GOAL else 'out of reach'} on this machine); "
              f"the broker now: {statistics.median(rates['amqpbroker']) / best:.2f} of that")
    print("(a shared machine's disk: compare within the run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
