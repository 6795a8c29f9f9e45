"""The store's writer process: applies sealed batches to LMDB with group commit.

Why a process and not a thread: py-lmdb releases the GIL around every put and
delete, and taking it back after each one costs the event loop a GIL hand-over
per write (four per durable message).  In a process of its own the writer uses
the second core without touching the loop's GIL; LMDB is built for one writing
process beside reading ones (its lock file), so the broker keeps reading
(page-in, recovery) through its own read handle.

Protocol (stdin → batches, stdout → results), each frame a 4-byte big-endian
length and a pickle:

  broker → writer   ("batch", number, fields)   fields: see `batch_fields`
                    ("stop",)                   commit what is pending, exit
  writer → broker   (number, error kind, error text, seconds, operations, full, map size)
                    one per commit: every batch up to `number` is settled

The writer takes every batch already waiting, up to GROUP_BYTES of frames (one
transaction, one fsync: group commit), so it never waits for more than it has and
never holds more than that at once.  It dies with the broker (PR_SET_PDEATHSIG),
and exits on end of input, or with one log line when its pipes fail (the broker
then replays every batch not reported committed to a new writer).  A commit that
fails is reported ("error", or "full") and what its batches remove is still
committed.  Idle, it unmaps the store pages it touched and trims its heap.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import select
import signal
import struct
import sys
import time
from typing import Any

import lmdb

from .batch import Batch
from .faults import Faults
from .maps import release_map, trim_heap

log = logging.getLogger("amqpbroker.store.writer")

FRAME = struct.Struct(">I")
DBS = ("meta", "exchanges", "queues", "seqs", "bindings", "subscriptions", "messages", "entries",
       "dedup", "readers", "routes", "cursors")
MAP_RELEASE_INTERVAL = 2.0   # seconds: unmap touched store pages this often (when busy)
MAP_RELEASE_IDLE = 0.5       # and this long after the last commit
FULL_AT = 0.9                # share of the map in use at which the store counts as full
GROUP_BYTES = 32 << 20       # frames taken into one commit at most (bounds the writer's memory)
READ_SIZE = 1 << 20


def batch_fields(b: Batch) -> tuple:
    """What of a sealed batch the writer needs (not its callbacks)."""
    return (b.meta, b.entry_dels, b.entry_puts, b.msg_dels, b.msg_puts, b.last_seq, b.max_msg_id,
            b.new_keys, b.ops, b.marks)


def batch_from_fields(fields: tuple) -> Batch:
    b = Batch()
    (b.meta, b.entry_dels, b.entry_puts, b.msg_dels, b.msg_puts, b.last_seq, b.max_msg_id,
     b.new_keys, b.ops, b.marks) = fields
    return b


def frame(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return FRAME.pack(len(data)) + data


def take_frames(buf: bytearray, max_bytes: int | None = None) -> list[Any]:
    """The complete frames at the head of `buf` (removed from it); with `max_bytes`,
    only as many as fit in it (at least one)."""
    out = []
    off = 0
    n = len(buf)
    while n - off >= 4:
        size = FRAME.unpack_from(buf, off)[0]
        if n - off - 4 < size or (max_bytes is not None and out and off + 4 + size > max_bytes):
            break
        out.append(pickle.loads(memoryview(buf)[off + 4:off + 4 + size]))
        off += 4 + size
    if off:
        del buf[:off]
    return out


def has_frame(buf: bytearray) -> bool:
    return len(buf) >= 4 and len(buf) - 4 >= FRAME.unpack_from(buf, 0)[0]


class Writer:
    def __init__(self, path: str, map_size: int, max_map_size: int, faults: Faults | None = None):
        self.path = path
        self.max_map_size = max_map_size
        self.faults = faults   # store/faults.py (tests only), or None
        self.env = lmdb.open(path, map_size=map_size, max_dbs=16, sync=True, metasync=True,
                             readahead=False, max_readers=256)
        self.dbs = {name: self.env.open_db(name.encode()) for name in DBS}
        self.full = False

    def commit(self, batches: list[Batch]) -> tuple[str | None, str | None]:
        """Apply the batches, in hand-over order, in one transaction (one fsync);
        (error kind, text) or (None, None)."""
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    if self.faults is not None:
                        self.faults.check("commit")
                    for batch in batches:
                        batch.apply(txn, self.dbs)
                if self.full:
                    self.full = self.usage() > FULL_AT
                return None, None
            except lmdb.MapFullError:
                size = self.env.info()["map_size"]
                if size >= self.max_map_size:
                    self.full = True
                    self.commit_removals(batches)
                    return "full", f"store map reached its maximum of {self.max_map_size} bytes"
                size = min(size * 2, self.max_map_size)
                self.env.set_mapsize(size)
                log.info("store map grown to %d bytes", size)
            except lmdb.DiskError as exc:
                self.full = True
                self.commit_removals(batches)
                return "full", f"disk full: {exc}"
            except Exception as exc:   # MemoryError, I/O: reported, producers are told
                self.commit_removals(batches)
                return "error", f"{type(exc).__name__}: {exc}"

    def commit_removals(self, batches: list[Batch]) -> None:
        """The batches do not fit: still commit what they remove (acknowledged entries,
        dropped messages, deleted entities) and the updates of entries already stored.
        The broker already forgot those; losing them would leak the space (the store
        would stay full) and bring acknowledged messages back after a restart."""
        try:
            with self.env.begin(write=True) as txn:
                for batch in batches:
                    batch.removals_only().apply(txn, self.dbs)
        except Exception as exc:
            log.error("store: the removals of a batch that was not committed failed too: %s", exc)

    def usage(self) -> float:
        """Share of the map in use.  Pages of every database, not `last_pgno`: that is
        a high-water mark, and freed pages below it are reused (a drained store that
        once filled up must take writes again)."""
        info = self.env.info()
        main = self.env.stat()
        pages = 2  # the two meta pages
        with self.env.begin() as txn:
            for st in [main] + [txn.stat(db) for db in self.dbs.values()]:
                pages += st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
        return pages * main["psize"] / info["map_size"]


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def serve(writer: Writer, fd_in: int, fd_out: int) -> None:
    buf = bytearray()
    release_at = 0.0
    touched = False
    stop = False
    while not stop:
        if not has_frame(buf):
            # Wait for work; once idle for a moment, unmap what the last commits
            # touched and give the heap's free memory back.
            ready = select.select([fd_in], [], [], MAP_RELEASE_IDLE if touched else None)[0]
            if not ready:
                touched = False
                release_map(writer.path)
                trim_heap()
                continue
        batches: list[Batch] = []
        last = None
        taken = 0
        while True:   # everything already waiting, up to GROUP_BYTES: one commit
            size = len(buf)
            for msg in take_frames(buf, GROUP_BYTES - taken):
                if msg[0] == "stop":
                    stop = True
                else:
                    last = msg[1]
                    batches.append(batch_from_fields(msg[2]))
            taken += size - len(buf)
            if stop or taken >= GROUP_BYTES or not select.select([fd_in], [], [], 0)[0]:
                break
            chunk = os.read(fd_in, READ_SIZE)
            if not chunk:
                stop = True
                break
            buf += chunk
        if last is None:
            continue
        started = time.perf_counter()
        kind, text = writer.commit(batches)
        elapsed = time.perf_counter() - started
        if kind is not None:
            log.error("store commit of %d batch(es) failed: %s", len(batches), text)
        result = (last, kind, text, elapsed, sum(b.ops for b in batches), writer.full,
                  writer.env.info()["map_size"])
        del batches
        if writer.faults is not None:
            writer.faults.check("result-write")
        os.write(fd_out, frame(result))   # small: a pipe takes it whole
        touched = True
        if started >= release_at:
            release_at = started + MAP_RELEASE_INTERVAL
            touched = False
            release_map(writer.path)
    writer.env.close()


def main(argv: list[str] | None = None) -> int:
    path, map_size, max_map_size = (argv or sys.argv[1:])[:3]
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the broker decides when to stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    fd_in, fd_out = sys.stdin.fileno(), sys.stdout.fileno()
    sys.stdout = sys.stderr   # nothing but frames on the result pipe
    try:
        serve(Writer(path, int(map_size), int(max_map_size), Faults.from_env()), fd_in, fd_out)
    except Exception as exc:   # MemoryError, a pipe error, a torn frame: one line, not a traceback
        log.error("store writer process for %s exits: %s: %s (the broker replays what it did not "
                  "report committed)", path, type(exc).__name__, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
