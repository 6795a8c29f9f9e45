"""LMDB store: one environment under the data dir, a writer process, group commit.

The loop thread records writes into this turn's `Batch` without blocking; once per
loop turn the batch is sealed and handed to the writer process (store/writer.py),
which applies *everything waiting* in one write transaction (LMDB commits are
fsync'd: one fsync per transaction, not per message) and writes one result back
per commit; `_on_results` runs the batches' callbacks in hand-over order.  Within a
batch, a message or entry that is written and removed again (a fast consumer
acknowledged it first) is never written at all (store/batch.py).

Start-up (`open`): the store's lock (store/lock.py: one broker per data dir), the
checks of what is on disk before LMDB maps it (store/integrity.py, store/verify.py),
then LMDB, the snapshot and the writer process.

Faults on the way to the disk (out of memory, pipe or I/O errors, a commit that
fails in the writer) never report a batch committed that was not: the batch is
failed (`Batch.fail`: its callbacks get StoreFault, its new entries leave the
queues, what it removes still goes to disk), the store turns `degraded` (durable
messages are refused at the door, one log line) and probes until a new batch goes
through again.  store/faults.py injects such faults in tests.

Layout (named databases):
  meta           format version, next message id
  exchanges      name → JSON
  queues         name → JSON (QueueRecord)
  seqs           queue id (u32) → last sequence number (u64): sequences never go back
  bindings       JSON [exchange, key, queue] → JSON arguments
  subscriptions  queue name → JSON (subscription + its registry link names)
  messages       msg id (u64) → raw message bytes, written once for every queue
  entries        queue id (u32) + seq (u64) → msg id (u64), delivery-count (u32), delivered (u8);
                 queue id 0: the topic log of durable subscriptions (store/logrecords.py)
  routes         route id (u32) → the exchange and routing key of topic log records
  cursors        durable subscription queue id (u32) → its cursor into the topic log
  dedup, readers small keyed records of server/sequence.py
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import struct
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path
from typing import Any, Callable

import lmdb

from . import journal as journal_mod
from . import writer as writer_proc
from .base import FORMAT_VERSION, QueueRecord, Snapshot, Store, StoreError
from .batch import U32, U64, Batch
from .channel import RESTART_BACKOFF, WriterChannel
from .faults import ENV as FAULTS_ENV, Faults
from .integrity import MARKER, RECOVERY_HINT, StoreDamaged, preflight, write_marker
from .lock import StoreLock
from .outbox import Outbox
from .reads import LmdbReads
from .stats import CommitStats
from .verify import verify_in_child

log = logging.getLogger("amqpbroker.store")

PIPE_SIZE = 1 << 20          # batches in flight to the writer (F_SETPIPE_SZ; the default is 64 KiB)
_F_SETPIPE_SZ = 1031


class LmdbStore(WriterChannel, LmdbReads, Store):
    persistent = True

    def __init__(self, path: Path, *, map_size: int = 64 << 20, max_map_size: int = 64 << 30,
                 verify: bool = True):
        super().__init__()
        self.path = Path(path)
        self.initial_map_size = map_size
        self.max_map_size = max(max_map_size, map_size)
        self.verify = verify                    # walk the store (in a child) before opening it
        self.env: lmdb.Environment | None = None
        self.loop: Any = None
        self._lock = StoreLock(self.path)
        self._faults = Faults.from_env()        # test-only fault injection: None unless set
        self._writers_started = 0               # writer processes started (faults go to the first)
        self._local = Batch()                  # loop thread: this turn's writes
        self._handoff_scheduled = False
        self._writer: subprocess.Popen | None = None
        self._inflight: deque[tuple[int, Batch]] = deque()   # handed over, not committed yet
        self._unsent: deque[tuple[int, Batch]] = deque()     # of those, not framed yet (a tail)
        self._waiting: deque[tuple[int, Batch]] = deque()    # callbacks not run yet, in order
        # Batches whose commit failed, as fail() left them, until a later commit: the
        # writer may hold their removals and entity records for its next commit
        # (store/writer.py `carry`); a new writer gets them first (store/channel.py).
        self._carried: list[tuple[int, Batch]] = []
        self._outbox = Outbox(faults=self._faults)           # framed, not in the pipe yet
        self._writing = False                   # add_writer armed on the pipe
        self._results = bytearray()
        self._restarts: list[float] = []        # when writers were lost (restart budget)
        self._backoff = RESTART_BACKOFF[0]
        self._timers: dict[str, Any] = {}       # "retry", "probe", "restart", "idle"
        self._read_lock = threading.Lock()
        self._release_at = 0.0
        # `full` (Store): durable messages are refused, server/handlers.py reads it per
        # message (a plain attribute: the hot path): the map at its maximum (as the
        # writer reports it), or the store degraded.
        self._map_full = False
        self.map_size = 0                       # as the writer last reported it
        # Called on the loop thread with [(queue id, seq)] of new entries a failed
        # commit did not store (before that batch's callbacks run).
        self.on_lost_entries: Callable[[list[tuple[int, int]]], None] | None = None
        self.on_closing: Callable[[], None] | None = None
        # HA (amqpbroker/ha/primary.py): sees every framed batch, gates the callbacks
        # on the backup's commit; None without [ha].
        self.replica: Any = None
        self.committed_upto = -1                # highest batch number the writer reported
        # Health (metrics): why durable messages are refused now (None: they are
        # not), since when (time.time()), and batches whose callbacks got an error.
        self.degraded: str | None = None
        self.degraded_since: float | None = None
        self.failed_batches = 0
        self._degraded_at = 0                   # first batch handed over after the fault
        self._episode_failed = 0
        self._burst_bytes = 0                   # framed since the last idle trim
        self._last_handoff = 0.0
        # Statistics (metrics).
        self.commits = 0
        self.last_batch_ops = 0
        self.commit_seconds_total = 0.0
        self.commit_stats = CommitStats()       # latency and batch-size histograms

    @property
    def pending_batches(self) -> int:
        """Batches handed over whose commit has not been reported yet (metrics; a
        measure of how far the writer is behind)."""
        return len(self._inflight)

    @property
    def outbox_bytes(self) -> int:
        """Framed batches waiting for the writer's pipe (bounded by OUTBOX_LIMIT)."""
        return self._outbox.nbytes

    # ------------------------------------------------------------------ lifecycle

    def open(self, loop: Any) -> Snapshot:
        self.loop = loop
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock.acquire()     # before LMDB maps anything: one broker per store
        try:
            snapshot = self._open_checked()
            self._start_writer()
        except BaseException:
            if self.env is not None:
                self.env.close()
                self.env = None
            self._lock.release()
            raise
        return snapshot

    def _open_checked(self) -> Snapshot:
        where = f"store at {self.path}"
        hint = RECOVERY_HINT.replace("DIR", str(self.path.parent))
        try:
            # Before anything maps data.mdb: LMDB back at the journal's last checkpoint
            # (store/journal.py); its records are applied again once LMDB is open.
            journal, records = journal_mod.restore(self.path)
        except (OSError, journal_mod.JournalError) as exc:
            raise StoreError(f"cannot read the journal of the {where}: {exc}") from exc
        try:
            found = preflight(self.path)
        except StoreDamaged as exc:
            raise StoreDamaged(f"{where} is damaged: {exc}; {hint}") from None
        if found.exists and self.verify:
            report = verify_in_child(self.path)
            if not report.ok:
                more = len(report.problems) - 1
                raise StoreDamaged(f"{where} is damaged: {report.problems[0]}"
                                   f"{f' (and {more} more problem(s))' if more else ''}; {hint}")
        try:
            self.env = lmdb.open(str(self.path), map_size=self.initial_map_size, max_dbs=16,
                                 sync=True, metasync=True, readahead=False, max_readers=256)
        except lmdb.Error as exc:
            raise StoreError(f"cannot open store at {self.path}: {exc}") from exc
        try:
            self._grow_to_fit()
            d = self._dbs = {name: self.env.open_db(name.encode()) for name in writer_proc.DBS}
            with self.env.begin(write=True) as txn:
                version = txn.get(b"format", db=d["meta"])
                if version is None:
                    txn.put(b"format", str(FORMAT_VERSION).encode(), db=d["meta"])
                elif version != str(FORMAT_VERSION).encode():
                    raise StoreError(
                        f"store at {self.path} has format version {version.decode(errors='replace')}; "
                        f"this broker reads version {FORMAT_VERSION} only")
            self._apply_journal(journal, records)
            snapshot = self._read_snapshot()
        except lmdb.Error as exc:
            raise StoreDamaged(f"{where} cannot be read: {type(exc).__name__}: {exc}; {hint}") from None
        except (ValueError, TypeError, KeyError, struct.error) as exc:   # JSON, records
            raise StoreDamaged(f"{where} holds a record that cannot be decoded "
                               f"({type(exc).__name__}: {exc}); {hint}") from None
        try:
            write_marker(self.path, self.env.stat()["psize"])
        except OSError as exc:
            raise StoreError(f"cannot write {self.path / MARKER}: {exc}") from exc
        self._next_msg_id = snapshot.next_msg_id
        return snapshot

    def _apply_journal(self, journal: journal_mod.Journal | None, records: list[bytes]) -> None:
        """The journal's records applied again (a crash left them), then a checkpoint:
        the journal starts empty, for this data.mdb."""
        if records:
            count = writer_proc.replay(self.env, self._dbs, records)
            log.info("store at %s: %d batch(es) of the journal applied again", self.path, count)
        journal = journal or journal_mod.Journal.open(self.path)
        try:
            journal.checkpoint(self.env)
        except (OSError, journal_mod.JournalError) as exc:
            raise StoreError(f"cannot write the journal of the store at {self.path}: {exc}") from exc
        finally:
            journal.close()

    def _start_writer(self) -> None:
        """The writer process (store/writer.py) on the same environment.  It gets the
        store lock's descriptor (store/lock.py: the lock lasts until it exited too)."""
        size = self.map_size = self.env.info()["map_size"]
        root = str(Path(__file__).resolve().parents[2])   # where this amqpbroker package lives
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        if self._writers_started and FAULTS_ENV in env:
            # Injected faults (tests only) are events of the first writer process: its
            # counts are its own, so a replacement would fire the same fault again at
            # the same count, and a one-time fault would look like a writer that keeps
            # failing (that case is tested by killing writers).
            del env[FAULTS_ENV]
        self._writers_started += 1
        self._writer = subprocess.Popen(
            [sys.executable, "-m", "amqpbroker.store.writer", str(self.path), str(size), str(self.max_map_size),
             "--recovered"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True, env=env,
            pass_fds=() if self._lock.fd is None else (self._lock.fd,))
        w, r = self._writer.stdin.fileno(), self._writer.stdout.fileno()
        try:
            fcntl.fcntl(w, _F_SETPIPE_SZ, PIPE_SIZE)
        except OSError:
            pass   # the default size works, with more waits for the pipe
        os.set_blocking(w, False)
        os.set_blocking(r, False)
        self._outbox.clear()
        self._results = bytearray()
        self.loop.add_reader(r, self._on_results)

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
        if self.replica is not None:
            # HA: the connections are closed by now, nobody is told about what commits
            # from here on; the last writes need not wait for a backup that may be gone.
            self.detach_replica()
        if self.on_closing is not None:   # last writes of a clean stop (DurabilityManager.closing)
            try:
                self.on_closing()
            except Exception:
                log.exception("store at %s: the writes before closing failed", self.path)
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        flushed = None
        clean = True
        try:
            while self._writer is not None and self._writer is not flushed:   # (a lost one is replaced)
                flushed = self._writer
                self._flush_with(flushed)
        except (OSError, MemoryError, StoreError) as exc:
            log.error("store at %s: what was pending could not be flushed at close: %s", self.path, exc)
            clean = False
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                if not clean:
                    raise StoreError("not flushed")
                self._send_all(writer, writer_proc.frame(("stop",)))
                writer.stdin.close()
                writer.wait(30)
            except (OSError, MemoryError, StoreError, subprocess.TimeoutExpired) as exc:
                log.error("store writer did not stop cleanly: %s", exc)
                writer.kill()
                writer.wait()
            try:
                self.loop.remove_reader(writer.stdout.fileno())
            except (ValueError, OSError, RuntimeError):
                pass   # the loop is closed already
            writer.stdout.close()
        if self.env is not None:
            self.env.close()
            self.env = None
        self._lock.release()   # after the writer exited: it held the lock too

    # ------------------------------------------------------------------ queued writes
    # (hand-over, the pipe, results: store/channel.py)

    def writes(self) -> Batch:   # Store.writes: the batch itself
        """This turn's batch; the hand-over to the writer is scheduled with its first write."""
        if not self._handoff_scheduled:
            self._handoff_scheduled = True
            self.loop.call_soon(self._handoff)
        return self._local

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
        self.writes().put_message(msg_id, raw)

    def drop_message(self, msg_id: int) -> None:
        self.writes().drop_message(msg_id)

    def _meta(self, action: str, db: str, key: bytes, value: bytes | None) -> None:
        self.writes().put_meta(action, db, key, value)

    def put_entry(self, queue_id: int, record: Any) -> None:
        self.writes().put_entry(queue_id, record)

    def update_entry(self, queue_id: int, record: Any) -> None:
        self.writes().update_entry(queue_id, record)

    def delete_entry(self, queue_id: int, seq: int) -> None:
        self.writes().delete_entry(queue_id, seq)

    def put_mark(self, queue_id: int, seq: int) -> None:
        self.writes().put_mark(queue_id, seq)

    # Small keyed records beside the broker model (duplicate-detection ids, log
    # reader claims: server/sequence.py), written in the same batches as messages.
    def put_record(self, db: str, key: bytes, value: bytes) -> None:
        self._meta("put", db, key, value)

    def delete_record(self, db: str, key: bytes) -> None:
        self._meta("del", db, key, None)

    def after_commit(self, callback: Callable[[BaseException | None], None]) -> None:
        batch = self.writes()
        batch.ops += 1
        batch.callbacks.append(callback)

    def settled(self, number: int) -> bool:
        waiting = self._waiting
        return number < (waiting[0][0] if waiting else self.batch)

    def after_batch(self, number: int, callback: Callable[[BaseException | None], None]) -> None:
        if number >= self.batch:
            self.after_commit(callback)
            return
        for n, batch in self._waiting:   # a few batches on their way at most
            if n == number:
                batch.callbacks.append(callback)   # run on the loop thread when it settles
                return
        callback(None)   # settled already

    def flush(self, timeout: float = 30.0) -> None:
        """Block (loop thread) until everything queued so far is committed (or failed)."""
        if self._writer is not None:
            self._flush_with(self._writer, timeout)
        else:
            self._handoff()

