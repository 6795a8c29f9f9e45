"""Fault injection on the store path.  TEST-ONLY.

    AMQPBROKER_STORE_FAULTS="point[:error][@after][*times],..."

Read once, when a store (or a writer process) starts; unset, the store holds None
and each hook costs one `is not None` test per batch (nothing per message).
Counters are per process.  The writer-side points fire in the first writer process of
a store only: a replacement writer starts without them (LmdbStore._start_writer).

points   where the error is raised
  seal          broker: sealing a batch at hand-over (LmdbStore._handoff)
  encode        broker: pickling a sealed batch into its frame
  pipe-write    broker: writing a frame to the writer's pipe (nothing of it written)
  results       broker: reading the writer's result pipe
  commit        writer process: inside the write transaction, before any write
  removals      writer process: writing what a failed commit must still write (its
                removals and entity records; when it fails they go with the next commit)
  journal       writer process: journaling a commit (its record is written just before
                the LMDB transaction, its fdatasync after it: store/journal.py)
  checkpoint    writer process: a checkpoint (LMDB synced, the journal started afresh)
  result-write  writer process: writing a commit result back
errors   MemoryError (default), an errno name (ENOSPC, EPIPE, EIO, ...) for an
         OSError, an lmdb exception name (MapFullError, DiskError, ...), or
         RuntimeError
@after   that many calls of the point pass first (default 0)
*times   then that many fail (default 1; `*inf`: every one after)

Example: `encode:MemoryError@50*3,commit:EIO@200` - the 51st to 53rd hand-overs
fail to encode, and the writer's 201st commit fails.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from dataclasses import dataclass

log = logging.getLogger("amqpbroker.store.faults")

ENV = "AMQPBROKER_STORE_FAULTS"
POINTS = ("seal", "encode", "pipe-write", "results", "commit", "removals", "journal", "checkpoint", "result-write")
_SPEC = re.compile(r"^(?P<point>[a-z-]+)(?::(?P<error>[A-Za-z]+))?(?:@(?P<after>\d+))?(?:\*(?P<times>\d+|inf))?$")


class FaultSpecError(ValueError):
    pass


@dataclass
class Fault:
    point: str
    error: str = "MemoryError"
    after: int = 0
    times: float = 1
    calls: int = 0
    fired: int = 0

    def make(self) -> BaseException:
        text = f"injected store fault at {self.point} ({ENV})"
        if self.error == "MemoryError":
            return MemoryError(text)
        if self.error == "RuntimeError":
            return RuntimeError(text)
        code = getattr(errno, self.error, None)
        if isinstance(code, int) and self.error.startswith("E"):
            return OSError(code, f"{os.strerror(code)}: {text}")
        import lmdb   # only when a fault names one of its errors
        cls = getattr(lmdb, self.error, None)
        if isinstance(cls, type) and issubclass(cls, lmdb.Error):
            return cls(text)
        raise FaultSpecError(f"{ENV}: unknown error {self.error!r}")


class Faults:
    def __init__(self, faults: list[Fault]):
        self.by_point: dict[str, list[Fault]] = {}
        for f in faults:
            f.make()   # unknown error names fail at start, not at the fault
            self.by_point.setdefault(f.point, []).append(f)

    @classmethod
    def parse(cls, text: str) -> "Faults":
        faults = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            m = _SPEC.match(part)
            if m is None or m["point"] not in POINTS:
                raise FaultSpecError(f"{ENV}: cannot read {part!r} (points: {', '.join(POINTS)})")
            times = m["times"]
            faults.append(Fault(m["point"], m["error"] or "MemoryError", int(m["after"] or 0),
                                float("inf") if times == "inf" else int(times or 1)))
        return cls(faults)

    @classmethod
    def from_env(cls, environ: dict | None = None) -> "Faults | None":
        text = (os.environ if environ is None else environ).get(ENV, "").strip()
        if not text:
            return None
        faults = cls.parse(text)
        log.warning("store fault injection enabled (test only): %s", text)
        return faults

    def check(self, point: str) -> None:
        """Raise the error due at this call of `point`, if any."""
        for f in self.by_point.get(point, ()):
            f.calls += 1
            if f.calls > f.after and f.fired < f.times:
                f.fired += 1
                log.warning("store fault injected at %s: %s (%d of %s)", point, f.error, f.fired,
                            "inf" if f.times == float("inf") else int(f.times))
                raise f.make()
