"""A timeline of the event loop, for latency work: off unless AMQPBROKER_LOOP_TRACE
names a file (bench/latency_trace.py reads it).

Each row is (CLOCK_MONOTONIC ns, kind, connection id, number):

  read     bytes one socket read brought (AmqpProtocol.data_received)
  pump     proton events popped in one pass over a connection's collector
  dlv      of those, deliveries (transfers in, dispositions)
  write    bytes one flush wrote to a connection's socket
  flush    the server's flush starts (number: connections dirty) / flushed (-1)
  timer    a transport timer fired (idle-timeout frames)
  wakeup   the delayed-delivery timer fired
  handoff  a store batch sealed and handed to the writer (number: the batch)
  piped    that batch framed and written to the writer's pipe (conn: frames still
           waiting for the pipe)
  commit   a commit result read back (number: the highest batch it settles)
  gc       a cyclic collection started (number: generation) / ended (-1)
  in, out  a stamped message in a read / a write (number: its sequence number);
           `stamp` rows carry its send time (ns, the client's clock)

The store's writer process keeps its own file (the same path + ".writer"), rows
of one commit (number: the highest batch it holds):

  w-wake   batches found in the pipe       w-read    read and unpickled (a group)
  w-txn    the LMDB transaction committed  w-write   the journal record written
  w-sync   its fdatasync returned          w-result  the commit result written back

Stamps are found by the markers of amqp-bench (`AMQPBNCH`, CLOCK_REALTIME) and
bench/loadgen.c (`LGBENCH1`, CLOCK_MONOTONIC) in the bytes read and written, so
a slow message can be followed from its send through the broker's loop turns to
the write that delivered it, whatever the client.  The header row has both
clocks at start to line them up.  Tracing costs a list append per row (and a
scan of every read and write for markers); off, one `None` test per call site.
"""

from __future__ import annotations

import atexit
import gc
import os
import struct
import time
from array import array
from typing import Any

ENV = "AMQPBROKER_LOOP_TRACE"
_AB = b"AMQPBNCH"   # amqp-bench: magic, run id u32, sender u32, seq u64 BE, ns (realtime) u64 BE
_LG = b"LGBENCH1"   # loadgen: magic, ns (monotonic) i64 LE, seq u64 LE
_AB_FIELDS = struct.Struct(">QQ")
_LG_FIELDS = struct.Struct("<qQ")


KINDS = ("read", "pump", "dlv", "write", "flush", "timer", "wakeup", "handoff", "commit", "gc",
         "in", "out", "stamp", "piped", "w-wake", "w-read", "w-txn", "w-write", "w-sync", "w-result")
_CODE = {kind: i for i, kind in enumerate(KINDS)}


class LoopTrace:
    """Rows go into an array of int64 (four per row): no object per row, so tracing
    does not feed the cyclic collector it also records."""

    def __init__(self, path: str, limit: int = 20_000_000):
        self.path = path
        self.limit = limit * 4
        self.rows = array("q")
        self.clock = time.monotonic_ns
        self.started = (time.time_ns(), time.monotonic_ns())
        gc.callbacks.append(self._gc)
        atexit.register(self.dump)

    def mark(self, kind: str, conn: int, n: int = 0) -> None:
        rows = self.rows
        if len(rows) < self.limit:
            rows.extend((self.clock(), _CODE[kind], conn, n))

    def stamps(self, kind: str, conn: int, data: Any) -> None:
        """`in`/`out` rows for every stamped message in `data`."""
        now = self.clock()
        rows = self.rows
        code, stamp = _CODE[kind], _CODE["stamp"]
        for magic, fields, realtime in ((_AB, _AB_FIELDS, True), (_LG, _LG_FIELDS, False)):
            at = data.find(magic)
            while at >= 0 and at + 32 <= len(data) and len(rows) < self.limit:
                if realtime:
                    seq, sent = fields.unpack_from(data, at + 16)
                else:
                    sent, seq = fields.unpack_from(data, at + 8)
                rows.extend((now, code, conn, seq & 0x7FFFFFFFFFFFFFFF))
                if kind == "in":
                    rows.extend((now, stamp, 1 if realtime else 0, sent & 0x7FFFFFFFFFFFFFFF))
                at = data.find(magic, at + 32)

    def _gc(self, phase: str, info: dict) -> None:
        self.mark("gc", 0, info.get("generation", 0) if phase == "start" else -1)

    def dump(self) -> None:
        rows, self.rows = self.rows, array("q")
        if not rows:
            return
        with open(self.path, "w") as f:
            f.write(f"# realtime_ns {self.started[0]} monotonic_ns {self.started[1]}\n")
            for i in range(0, len(rows), 4):
                f.write(f"{rows[i]}\t{KINDS[rows[i + 1]]}\t{rows[i + 2]}\t{rows[i + 3]}\n")


def from_env(suffix: str = "") -> LoopTrace | None:
    path = os.environ.get(ENV)
    return LoopTrace(path + suffix) if path else None


TRACE: LoopTrace | None = from_env()
