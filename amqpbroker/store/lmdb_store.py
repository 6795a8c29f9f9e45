"""LMDB store: one environment under the data dir, a writer thread, group commit.

The loop thread records writes into this turn's `Batch` without blocking; once per
loop turn the batch is sealed and handed to the writer thread, which applies
*everything pending* in one write transaction (LMDB commits are fsync'd: one fsync
per transaction, not per message) and hands the completion back with
`call_soon_threadsafe`.  Within a batch, a message or entry that is written and
removed again (a fast consumer acknowledged it first) is never written at all
(store/batch.py).  The writer thread runs as little Python as possible: the GIL it
takes is the loop's.

Layout (named databases):
  meta           format version, next message id
  exchanges      name → JSON
  queues         name → JSON (QueueRecord)
  seqs           queue id (u32) → last sequence number (u64): sequences never go back
  bindings       JSON [exchange, key, queue] → JSON arguments
  subscriptions  queue name → JSON (subscription + its registry link names)
  messages       msg id (u64) → raw message bytes, written once for every queue
  entries        queue id (u32) + seq (u64) → msg id (u64), delivery-count (u32), delivered (u8)
"""

from __future__ import annotations

import ctypes
import json
import logging
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import lmdb

from .batch import ENTRY_KEY, ENTRY_VAL, U32, U64, Batch
from .stats import CommitStats
from .base import FORMAT_VERSION, EntryRecord, QueueRecord, Snapshot, Store, StoreError, StoreFull

log = logging.getLogger("amqpbroker.store")

_SCAN_VAL = struct.Struct(">QIBBI")      # the head of ENTRY_VAL: up to the size


def _load_madvise() -> Callable[[int, int, int], int] | None:
    """libc madvise(2) (release_map), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise()
_MADV_DONTNEED = 4
MAP_RELEASE_INTERVAL = 2.0   # seconds: the writer unmaps touched store pages this often (when busy)
MAP_RELEASE_IDLE = 0.5       # and this long after its last commit


class LmdbStore(Store):
    persistent = True

    def __init__(self, path: Path, *, map_size: int = 64 << 20, max_map_size: int = 64 << 30):
        super().__init__()
        self.path = Path(path)
        self.initial_map_size = map_size
        self.max_map_size = max(max_map_size, map_size)
        self.env: lmdb.Environment | None = None
        self.loop: Any = None
        self._local = Batch()                  # loop thread: this turn's writes
        self._handoff_scheduled = False
        self._pending: list[Batch] = []        # sealed, handed to the writer
        self._cv = threading.Condition()
        self._stop = False
        self._writer: threading.Thread | None = None
        self._read_lock = threading.Lock()
        self._inflight = 0
        self._map_touched = False               # writer thread: commits since release_map()
        self._release_at = 0.0
        self.full = False
        # Called on the loop thread with [(queue id, seq)] of new entries a failed
        # commit did not store (before that batch's callbacks run).
        self.on_lost_entries: Callable[[list[tuple[int, int]]], None] | None = None
        # Statistics (metrics).
        self.commits = 0
        self.last_batch_ops = 0
        self.commit_seconds_total = 0.0
        self.commit_stats = CommitStats()       # latency and batch-size histograms

    # ------------------------------------------------------------------ lifecycle

    def open(self, loop: Any) -> Snapshot:
        self.loop = loop
        self.path.mkdir(parents=True, exist_ok=True)
        try:
            self.env = lmdb.open(str(self.path), map_size=self.initial_map_size, max_dbs=16,
                                 sync=True, metasync=True, readahead=False, max_readers=256)
        except lmdb.Error as exc:
            raise StoreError(f"cannot open store at {self.path}: {exc}") from exc
        self._grow_to_fit()
        d = self._dbs = {name: self.env.open_db(name.encode()) for name in
                         ("meta", "exchanges", "queues", "seqs", "bindings", "subscriptions",
                          "messages", "entries", "dedup", "readers")}
        with self.env.begin(write=True) as txn:
            version = txn.get(b"format", db=d["meta"])
            if version is None:
                txn.put(b"format", str(FORMAT_VERSION).encode(), db=d["meta"])
            elif version != str(FORMAT_VERSION).encode():
                raise StoreError(
                    f"store at {self.path} has format version {version.decode(errors='replace')}; "
                    f"this broker reads version {FORMAT_VERSION} only")
        snapshot = self._read_snapshot()
        self._next_msg_id = snapshot.next_msg_id
        self._writer = threading.Thread(target=self._write_loop, name="amqpbroker-store", daemon=True)
        self._writer.start()
        return snapshot

    def _grow_to_fit(self) -> None:
        """A store written with a larger map (it grew last run) opens at that size."""
        info = self.env.info()
        needed = (info["last_pgno"] + 1) * self.env.stat()["psize"]
        size = info["map_size"]
        while size < needed * 2 and size * 2 <= self.max_map_size:
            size *= 2
        if size != info["map_size"]:
            self.env.set_mapsize(size)

    def _read_snapshot(self) -> Snapshot:
        d = self._dbs
        snap = Snapshot()
        with self.env.begin() as txn:
            raw = txn.get(b"next_msg_id", db=d["meta"])
            snap.next_msg_id = U64.unpack(raw)[0] if raw else 1
            snap.exchanges = [json.loads(v) for _, v in txn.cursor(db=d["exchanges"])]
            seqs = {U32.unpack(k)[0]: U64.unpack(v)[0] for k, v in txn.cursor(db=d["seqs"])}
            for _, v in txn.cursor(db=d["queues"]):
                rec = QueueRecord(**json.loads(v))
                rec.last_seq = max(rec.last_seq, seqs.get(rec.queue_id, 0))
                snap.queues.append(rec)
            for k, v in txn.cursor(db=d["bindings"]):
                exchange, key, queue = json.loads(k)
                snap.bindings.append({"exchange": exchange, "key": key, "queue": queue,
                                      "arguments": json.loads(v)})
            snap.subscriptions = [json.loads(v) for _, v in txn.cursor(db=d["subscriptions"])]
        return snap

    def close(self) -> None:
        if self._writer is None:
            return
        self.flush()
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._writer.join(30)
        self._writer = None
        self.env.close()

    # ------------------------------------------------------------------ queued writes

    def _current(self) -> Batch:
        """This turn's batch; the hand-over to the writer is scheduled with its first write."""
        if not self._handoff_scheduled:
            self._handoff_scheduled = True
            self.loop.call_soon(self._handoff)
        return self._local

    def _handoff(self) -> None:
        self._handoff_scheduled = False
        batch = self._local
        if not batch.ops:
            return
        self._local = Batch()
        self.batch += 1
        batch.seal()
        with self._cv:
            self._pending.append(batch)
            self._cv.notify()

    def new_msg_id(self) -> int:
        mid = self._next_msg_id
        self._next_msg_id += 1
        return mid

    def save_exchange(self, name: str, kind: str) -> None:
        self._meta("put", "exchanges", name.encode(), json.dumps({"name": name, "type": kind}).encode())

    def delete_exchange(self, name: str) -> None:
        self._meta("del", "exchanges", name.encode(), None)

    def save_queue(self, record: QueueRecord) -> None:
        self._meta("put", "queues", record.name.encode(), json.dumps(record.__dict__).encode())

    def delete_queue(self, queue_id: int, name: str) -> None:
        self._meta("del", "queues", name.encode(), None)
        self._meta("drop-queue-entries", "entries", U32.pack(queue_id), None)

    def save_binding(self, exchange: str, key: str, queue: str, arguments: dict) -> None:
        self._meta("put", "bindings", json.dumps([exchange, key, queue]).encode(), json.dumps(arguments).encode())

    def delete_binding(self, exchange: str, key: str, queue: str) -> None:
        self._meta("del", "bindings", json.dumps([exchange, key, queue]).encode(), None)

    def save_subscription(self, queue: str, record: dict) -> None:
        self._meta("put", "subscriptions", queue.encode(), json.dumps(record).encode())

    def delete_subscription(self, queue: str) -> None:
        self._meta("del", "subscriptions", queue.encode(), None)

    def put_message(self, msg_id: int, raw: bytes) -> None:
        self._current().put_message(msg_id, raw)

    def drop_message(self, msg_id: int) -> None:
        self._current().drop_message(msg_id)

    def _meta(self, action: str, db: str, key: bytes, value: bytes | None) -> None:
        self._current().put_meta(action, db, key, value)

    def put_entry(self, queue_id: int, record: EntryRecord) -> None:
        self._current().put_entry(queue_id, record)

    def update_entry(self, queue_id: int, record: EntryRecord) -> None:
        self._current().update_entry(queue_id, record)

    def delete_entry(self, queue_id: int, seq: int) -> None:
        self._current().delete_entry(queue_id, seq)

    def after_commit(self, callback: Callable[[BaseException | None], None]) -> None:
        batch = self._current()
        batch.ops += 1
        batch.callbacks.append(callback)

    def flush(self, timeout: float = 30.0) -> None:
        """Block (loop thread) until everything queued so far is committed."""
        if self._writer is None:
            return
        done = threading.Event()
        self._local.ops += 1
        self._local.waiters.append(lambda err: done.set())
        self._handoff()
        if not done.wait(timeout):
            raise StoreError("store flush timed out")

    # ------------------------------------------------------------------ reads

    def read_message(self, msg_id: int) -> bytes | None:
        with self._read_lock, self.env.begin() as txn:
            return txn.get(U64.pack(msg_id), db=self._dbs["messages"])

    def read_messages(self, msg_ids: list[int]) -> list[bytes | None]:
        pack = U64.pack
        with self._read_lock, self.env.begin() as txn:
            get = txn.get
            db = self._dbs["messages"]
            return [get(pack(mid), db=db) for mid in msg_ids]

    def read_entries(self, queue_id: int, after_seq: int, limit: int) -> list[EntryRecord]:
        out: list[EntryRecord] = []
        prefix = U32.pack(queue_id)
        with self._read_lock, self.env.begin() as txn:
            cur = txn.cursor(db=self._dbs["entries"])
            if not cur.set_range(ENTRY_KEY.pack(queue_id, after_seq + 1)):
                return out
            for key, val in cur:
                if key[:4] != prefix or len(out) >= limit:
                    break
                out.append(_decode_entry(ENTRY_KEY.unpack(key)[1], val))
        return out

    def scan_entries(self, queue_id: int, after_seq: int, limit: int) -> list[tuple[int, int, int, bool]]:
        out: list[tuple[int, int, int, bool]] = []
        prefix = U32.pack(queue_id)
        key_seq = ENTRY_KEY.unpack
        head = _SCAN_VAL.unpack_from
        with self._read_lock, self.env.begin() as txn:
            cur = txn.cursor(db=self._dbs["entries"])
            if not cur.set_range(ENTRY_KEY.pack(queue_id, after_seq + 1)):
                return out
            append = out.append
            for key, val in cur:
                if key[:4] != prefix or len(out) >= limit:
                    break
                msg_id, _, delivered, _, size = head(val)
                append((key_seq(key)[1], msg_id, size, delivered != 0))
        return out

    def message_id_range(self) -> tuple[int, int]:
        with self._read_lock, self.env.begin() as txn:
            cur = txn.cursor(db=self._dbs["messages"])
            lo = U64.unpack(cur.key())[0] if cur.first() else 1
        return lo, self._next_msg_id - 1

    def release_map(self) -> int:
        """Unmap the pages of the store this process has touched (not the data: the
        kernel keeps them in its page cache).  Scans, fills and drains touch most of
        the map, and every touched page counts in the broker's RSS.  The map is
        shared and read-only (no writemap): MADV_DONTNEED only drops page-table
        entries, a later read faults the page back in.  Linux only; returns the
        bytes of map advised (0 elsewhere or on failure)."""
        if _madvise is None or self.env is None:
            return 0
        target = str((self.path / "data.mdb").resolve())
        done = 0
        with self._read_lock:   # set_mapsize (which remaps) takes it too
            try:
                with open("/proc/self/maps") as f:
                    spans = [line.split(None, 5) for line in f if line.rstrip("\n").endswith(target)]
            except OSError:
                return 0
            for fields in spans:
                if len(fields) < 6 or fields[5].rstrip("\n") != target or fields[1] != "r--s":
                    continue   # only the shared, read-only map of data.mdb
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if _madvise(start, end - start, _MADV_DONTNEED) == 0:
                    done += end - start
        return done

    def count_entries(self, queue_id: int) -> int:
        n = 0
        prefix = U32.pack(queue_id)
        with self._read_lock, self.env.begin() as txn:
            cur = txn.cursor(db=self._dbs["entries"])
            if cur.set_range(prefix):
                for key in cur.iternext(values=False):
                    if key[:4] != prefix:
                        break
                    n += 1
        return n

    def read_last_seq(self, queue_id: int) -> int:
        """The last sequence number committed for a queue (0: none yet)."""
        with self._read_lock, self.env.begin() as txn:
            raw = txn.get(U32.pack(queue_id), db=self._dbs["seqs"])
        return U64.unpack(raw)[0] if raw else 0

    # Small keyed records beside the broker model (duplicate-detection ids, log
    # reader claims: server/sequence.py), written in the same batches as messages.
    def put_record(self, db: str, key: bytes, value: bytes) -> None:
        self._meta("put", db, key, value)

    def delete_record(self, db: str, key: bytes) -> None:
        self._meta("del", db, key, None)

    def read_records(self, db: str) -> list[tuple[bytes, bytes]]:
        with self._read_lock, self.env.begin() as txn:
            return [(bytes(k), bytes(v)) for k, v in txn.cursor(db=self._dbs[db])]

    # ------------------------------------------------------------------ writer thread

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._stop:
                    if not self._map_touched:
                        self._cv.wait()
                    elif not self._cv.wait(MAP_RELEASE_IDLE):
                        break
                if not self._pending and self._stop:
                    return
                batches, self._pending = self._pending, []
            if not batches:   # idle since the last commits: unmap the pages they touched
                self._map_touched = False
                self.release_map()
                continue
            callbacks = [cb for b in batches for cb in b.callbacks]
            waiters = [cb for b in batches for cb in b.waiters]   # flush(): the loop thread blocks
            ops = sum(b.ops for b in batches)
            error: BaseException | None = None
            started = time.perf_counter()
            try:
                self._commit(batches)
            except BaseException as exc:  # handed to the callbacks: producers are told
                error = exc
                log.error("store commit of %d operation(s) failed: %s", ops, exc)
            self.commits += 1
            self.last_batch_ops = ops
            elapsed = time.perf_counter() - started
            self.commit_seconds_total += elapsed
            self.commit_stats.observe(elapsed, ops)
            if error is not None and self.on_lost_entries is not None:
                # Before the callbacks: the broker drops these entries from its queues
                # before producers are told their messages were rejected.
                lost = [ENTRY_KEY.unpack(key) for b in batches for key in b.new_keys]
                if lost:
                    self.loop.call_soon_threadsafe(self.on_lost_entries, lost)
            if callbacks:
                self.loop.call_soon_threadsafe(_run_callbacks, callbacks, error)
            _run_callbacks(waiters, error)
            self._map_touched = True
            if started >= self._release_at:   # after the callbacks: nobody waits on this
                self._release_at = started + MAP_RELEASE_INTERVAL
                self._map_touched = False
                self.release_map()

    def _commit(self, batches: list[Batch]) -> None:
        """Apply the batches, in hand-over order, in one transaction (one fsync)."""
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    for batch in batches:
                        batch.apply(txn, self._dbs)
                if self.full:
                    self.full = self._usage() > 0.9
                return
            except lmdb.MapFullError:
                size = self.env.info()["map_size"]
                if size >= self.max_map_size:
                    self.full = True
                    self._commit_removals(batches)
                    raise StoreFull(f"store map reached its maximum of {self.max_map_size} bytes")
                size = min(size * 2, self.max_map_size)
                with self._read_lock:
                    self.env.set_mapsize(size)
                log.info("store map grown to %d bytes", size)
            except lmdb.DiskError as exc:
                self.full = True
                raise StoreFull(f"disk full: {exc}") from exc

    def _commit_removals(self, batches: list[Batch]) -> None:
        """The batch does not fit: still commit what it removes (acknowledged entries,
        dropped messages, deleted entities) and the updates of entries already stored.
        The broker already forgot those; losing them would leak the space (the store
        would stay full) and bring acknowledged messages back after a restart."""
        try:
            with self.env.begin(write=True) as txn:
                for batch in batches:
                    batch.removals_only().apply(txn, self._dbs)
        except lmdb.Error as exc:
            log.error("store: the removals of a batch that did not fit failed too: %s", exc)

    def _usage(self) -> float:
        """Share of the map in use.  Pages of every database, not `last_pgno`: that is
        a high-water mark, and freed pages below it are reused (a drained store that
        once filled up must take writes again)."""
        info = self.env.info()
        main = self.env.stat()
        pages = 2  # the two meta pages
        with self.env.begin() as txn:
            for st in [main] + [txn.stat(db) for db in self._dbs.values()]:
                pages += st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
        return pages * main["psize"] / info["map_size"]


def _decode_entry(seq: int, val: bytes) -> EntryRecord:
    msg_id, count, delivered, priority, size, expires, deliver = ENTRY_VAL.unpack_from(val)
    group = val[ENTRY_VAL.size:]
    return EntryRecord(seq, msg_id, count, bool(delivered), priority, size,
                       None if expires != expires else expires, None if deliver != deliver else deliver,
                       bytes(group).decode() if group else None)


def _run_callbacks(callbacks: list, error: BaseException | None) -> None:
    for cb in callbacks:
        try:
            cb(error)
        except Exception:  # one bad callback must not starve the others
            log.exception("store callback failed")
