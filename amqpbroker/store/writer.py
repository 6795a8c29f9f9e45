"""The store's writer process: applies sealed batches to LMDB with group commit,
one fdatasync per commit (store/journal.py).

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
transaction: group commit), so it never waits for more than it has and never
holds more than that at once.  The same frames are written to the journal as one
record and its write-back started, the transaction commits without a sync (LMDB
MDB_NOSYNC: visible at once to the broker's reads and to a store copy) while the
device writes the record, then one fdatasync, and only then is the commit
reported (a transaction that fails takes its record back first).  A checkpoint
(LMDB synced, the journal started afresh) follows
when the journal is half full, when the writer is idle, and at a clean stop;
store/journal.py says why a system crash cannot then lose or corrupt anything.
Started by a broker, the broker has already brought LMDB back to its last
checkpoint and applied the journal (`--recovered`); started alone (a replica's
writer, amqpbroker/ha), it does that itself.  It dies with the broker (PR_SET_PDEATHSIG),
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
from pathlib import Path
from typing import Any

import lmdb

from . import journal as journal_mod
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


def take_raw_frames(buf: bytearray, max_bytes: int | None = None) -> list[tuple[Any, bytes]]:
    """As take_frames, with each frame's bytes (length prefix included)."""
    out = []
    off = 0
    n = len(buf)
    view = memoryview(buf)
    while n - off >= 4:
        size = FRAME.unpack_from(buf, off)[0]
        if n - off - 4 < size or (max_bytes is not None and out and off + 4 + size > max_bytes):
            break
        raw = bytes(view[off:off + 4 + size])
        out.append((pickle.loads(memoryview(raw)[4:]), raw))
        off += 4 + size
    view.release()
    if off:
        del buf[:off]
    return out


def has_frame(buf: bytearray) -> bool:
    return len(buf) >= 4 and len(buf) - 4 >= FRAME.unpack_from(buf, 0)[0]


def replay(env: lmdb.Environment, dbs: dict, records: list[bytes]) -> int:
    """Apply journal records (each the batch frames of one group commit) in one
    transaction, in their order: the batches they hold, again.  The batches' count."""
    count = 0
    with env.begin(write=True) as txn:
        for record in records:
            for msg in take_frames(bytearray(record)):
                batch_from_fields(msg[2]).apply(txn, dbs)
                count += 1
    return count


def open_dbs(env: lmdb.Environment) -> dict:
    return {name: env.open_db(name.encode()) for name in DBS}


def recover(path: str | os.PathLike) -> int:
    """Bring a store nobody has open back to its last checkpoint and apply its
    journal again (store/journal.py), then checkpoint: what a broker does at start.
    The batches applied (0: nothing was waiting)."""
    from .integrity import preflight
    journal, records = journal_mod.restore(path)
    if journal is None and not records:
        return 0
    if not preflight(Path(path)).exists:   # (StoreDamaged for a file LMDB must not map)
        journal.close()
        return 0
    env = lmdb.open(str(path), max_dbs=16, readahead=False, max_readers=256)
    try:
        count = replay(env, open_dbs(env), records) if records else 0
        (journal or journal_mod.Journal.open(path)).checkpoint(env)
    finally:
        env.close()
        if journal is not None:
            journal.close()
    return count


class Writer:
    def __init__(self, path: str, map_size: int, max_map_size: int, faults: Faults | None = None,
                 recovered: bool = False):
        self.path = path
        self.max_map_size = max_map_size
        self.faults = faults   # store/faults.py (tests only), or None
        journal, records = (None, []) if recovered else journal_mod.restore(path)
        # No sync at commit: the journal makes each commit durable (module docstring).
        self.env = lmdb.open(path, map_size=map_size, max_dbs=16, sync=False, metasync=False,
                             readahead=False, max_readers=256)
        self.dbs = open_dbs(self.env)
        if records:
            log.info("store: %d batch(es) of the journal applied again", replay(self.env, self.dbs, records))
        self.journal = journal or journal_mod.Journal.open(path)
        self.pin: lmdb.Transaction | None = None   # the last checkpoint's snapshot (journal.py)
        self.trace = None   # the writer's loop trace (looptrace.py, serve), or None
        self.checkpoint()
        # Only now may a dead writer's pin on an earlier checkpoint go.
        self.env.reader_check()
        self.full = False
        # What a failed commit must still write and could not (its removals commit
        # failed too): applied first, in the same transaction, by the next commit, so
        # nothing that comes after it is ever on disk without it.
        self.carry: list[Batch] = []

    def commit(self, batches: list[Batch], frames: list[bytes]) -> tuple[str | None, str | None]:
        """Apply the batches, in hand-over order, in one transaction, and journal their
        frames (one fdatasync); (error kind, text) or (None, None).  The record is
        written first and its write-back started, so the device writes it while the
        transaction runs; the fdatasync comes after the transaction, and a
        transaction that fails takes the record back (zeroed) before anything is
        reported.  A journal that cannot be written raises: nothing may be reported
        then (main exits, the broker replays every batch not reported committed to a
        new writer)."""
        if self.carry:
            batches = self.carry + batches
            frames = [frame(("batch", -1, batch_fields(b))) for b in self.carry] + frames
            self.carry = []   # in this transaction now; a failure carries them again
        payload = b"".join(frames)
        early = self.journal.fits(len(payload))   # else a checkpoint after the transaction (log)
        if early:
            if self.faults is not None:
                self.faults.check("journal")
            self.journal.write(payload)
        unpinned = False
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    if self.faults is not None:
                        self.faults.check("commit")
                    for batch in batches:
                        batch.apply(txn, self.dbs)
                break
            except lmdb.MapFullError:
                early = self.take_back(early)
                size = self.env.info()["map_size"]
                if size >= self.max_map_size and not unpinned and self.journal.used:
                    # Pages freed since the last checkpoint are pinned with it: a new
                    # one lets LMDB reuse them before the store counts as full.
                    self.checkpoint()
                    unpinned = True
                    continue
                if size >= self.max_map_size:
                    self.full = True
                    self.commit_removals(batches)
                    return "full", f"store map reached its maximum of {self.max_map_size} bytes"
                self.grow(min(size * 2, self.max_map_size))
            except lmdb.DiskError as exc:
                self.take_back(early)
                self.full = True
                self.commit_removals(batches)
                return "full", f"disk full: {exc}"
            except Exception as exc:   # MemoryError, I/O: reported, producers are told
                self.take_back(early)
                self.commit_removals(batches)
                return "error", f"{type(exc).__name__}: {exc}"
        if self.trace is not None:
            self.trace.mark("w-txn", len(batches))
        if early:
            self.journal.sync()
        else:
            self.log(payload)
        if self.full:
            self.full = self.usage() > FULL_AT
        return None, None

    def take_back(self, early: bool) -> bool:
        """The transaction failed: the record written before it must never be applied
        (its group is reported failed).  False: no record is on its way now."""
        if early:
            self.journal.retract()
        return False

    def log(self, payload: bytes) -> None:
        """`payload` (already applied to LMDB) durable: a journal record, or, when it
        does not fit in what is left of the journal, a checkpoint (LMDB synced)."""
        if self.faults is not None:
            self.faults.check("journal")
        if self.journal.fits(len(payload)):
            self.journal.append(payload)
        else:
            self.checkpoint()

    def checkpoint(self) -> None:
        """LMDB synced and the journal started afresh; the snapshot pinned until the
        next checkpoint (store/journal.py)."""
        if self.faults is not None:
            self.faults.check("checkpoint")
        self.journal.checkpoint(self.env)
        old, self.pin = self.pin, self.env.begin()
        if old is not None:
            old.abort()

    def grow(self, size: int) -> None:
        """A larger map.  LMDB takes a new map size only with no transaction open in
        the process: a checkpoint first, so that the pin may go meanwhile."""
        self.checkpoint()
        self.pin.abort()
        self.pin = None
        try:
            self.env.set_mapsize(size)
        finally:
            self.pin = self.env.begin()
        log.info("store map grown to %d bytes", size)

    def commit_removals(self, batches: list[Batch]) -> None:
        """The batches do not fit: still commit what they remove (acknowledged entries,
        dropped messages, deleted entities) and the updates of entries already stored.
        The broker already forgot those; losing them would leak the space (the store
        would stay full) and bring acknowledged messages back after a restart.  Its
        entity records too: the broker made those queues, bindings and subscriptions
        in memory, and what it accepts next refers to them.  When even this fails,
        the next commit writes it first (`carry`)."""
        removals: list[Batch] = []
        try:
            removals = [batch.removals_only() for batch in batches]
            if self.faults is not None:
                self.faults.check("removals")
            with self.env.begin(write=True) as txn:
                for batch in removals:
                    batch.apply(txn, self.dbs)
        except Exception as exc:
            log.error("store: the removals and entity records of a batch that was not committed failed too "
                      "(written with the next commit): %s", exc)
            self.carry = removals
            return
        self.log(b"".join(frame(("batch", -1, batch_fields(b))) for b in removals))

    def close(self) -> None:
        """A clean stop: everything in LMDB for good, the journal empty."""
        self.pin.abort()
        self.pin = None
        self.journal.checkpoint(self.env, clean=True)
        self.journal.close()
        self.env.close()

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
    from .. import looptrace   # (here: only the writer process has this trace)
    trace = writer.trace = writer.journal.trace = looptrace.from_env(".writer")
    buf = bytearray()
    into = memoryview(bytearray(READ_SIZE))   # reads land here: no 1 MiB allocation per read
    release_at = 0.0
    touched = False
    stop = False
    while not stop:
        if not has_frame(buf):
            # Wait for work; once idle for a moment, checkpoint (a restart then has
            # nothing to apply again), unmap what the last commits touched and give
            # the heap's free memory back.
            ready = select.select([fd_in], [], [], MAP_RELEASE_IDLE if touched else None)[0]
            if not ready:
                touched = False
                if writer.journal.used:
                    writer.checkpoint()
                release_map(writer.path)
                trim_heap()
                continue
        if trace is not None:
            trace.mark("w-wake", len(buf))
        batches: list[Batch] = []
        frames: list[bytes] = []
        last = None
        taken = 0
        while True:   # everything already waiting, up to GROUP_BYTES: one commit
            size = len(buf)
            for msg, raw in take_raw_frames(buf, GROUP_BYTES - taken):
                if msg[0] == "stop":
                    stop = True
                else:
                    last = msg[1]
                    batches.append(batch_from_fields(msg[2]))
                    frames.append(raw)
            taken += size - len(buf)
            if stop or taken >= GROUP_BYTES or not select.select([fd_in], [], [], 0)[0]:
                break
            n = os.readv(fd_in, [into])
            if not n:
                stop = True
                break
            buf += into[:n]
        if last is None:
            continue
        if trace is not None:
            trace.mark("w-read", len(batches), last)
        started = time.perf_counter()
        kind, text = writer.commit(batches, frames)
        elapsed = time.perf_counter() - started
        if kind is not None:
            log.error("store commit of %d batch(es) failed: %s", len(batches), text)
        result = (last, kind, text, elapsed, sum(b.ops for b in batches), writer.full,
                  writer.env.info()["map_size"])
        del batches, frames
        if writer.faults is not None:
            writer.faults.check("result-write")
        os.write(fd_out, frame(result))   # small: a pipe takes it whole
        if trace is not None:
            trace.mark("w-result", 0, last)
        touched = True
        if writer.journal.used >= writer.journal.checkpoint_at:
            writer.checkpoint()
        if started >= release_at:
            release_at = started + MAP_RELEASE_INTERVAL
            touched = False
            release_map(writer.path)
    if writer.carry:   # a clean stop: what a failed commit must still write goes first
        kind, text = writer.commit([], [])
        if kind is not None:
            log.error("store: the removals and entity records of a failed commit could not be written "
                      "before stopping: %s", text)
    writer.close()


def main(argv: list[str] | None = None) -> int:
    args = argv or sys.argv[1:]
    path, map_size, max_map_size = args[:3]
    recovered = "--recovered" in args[3:]   # the broker has applied the journal already
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the broker decides when to stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    fd_in, fd_out = sys.stdin.fileno(), sys.stdout.fileno()
    sys.stdout = sys.stderr   # nothing but frames on the result pipe
    try:
        serve(Writer(path, int(map_size), int(max_map_size), Faults.from_env(), recovered), fd_in, fd_out)
    except Exception as exc:   # MemoryError, a pipe error, a torn frame: one line, not a traceback
        log.error("store writer process for %s exits: %s: %s (the broker replays what it did not "
                  "report committed)", path, type(exc).__name__, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
