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

import fcntl
import json
import logging
import os
import select
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

import lmdb

from . import writer as writer_proc
from .base import FORMAT_VERSION, EntryRecord, QueueRecord, Snapshot, Store, StoreError, StoreFull
from .batch import ENTRY_KEY, ENTRY_VAL, U32, U64, Batch
from .maps import release_map
from .stats import CommitStats

log = logging.getLogger("amqpbroker.store")

_SCAN_VAL = struct.Struct(">QIBBI")      # the head of ENTRY_VAL: up to the size


MAP_RELEASE_INTERVAL = 2.0   # seconds: the broker unmaps store pages its reads touched this often
MAX_RESTARTS, RESTART_WINDOW = 3, 60.0   # writers lost in that many seconds before giving up
PIPE_SIZE = 1 << 20          # batches in flight to the writer (F_SETPIPE_SZ; the default is 64 KiB)
_F_SETPIPE_SZ = 1031


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
        self._writer: subprocess.Popen | None = None
        self._inflight: deque[tuple[int, Batch]] = deque()   # sent, not yet committed
        self._out = bytearray()                 # frames the writer's pipe did not take yet
        self._results = bytearray()
        self._writer_lost = False
        self._restarts: list[float] = []        # when writers were lost (restart budget)
        self._read_lock = threading.Lock()
        self._release_at = 0.0
        self.full = False
        self.map_size = 0                       # as the writer last reported it
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
        self._start_writer()
        return snapshot

    def _start_writer(self) -> None:
        """The writer process (store/writer.py) on the same environment."""
        size = self.map_size = self.env.info()["map_size"]
        root = str(Path(__file__).resolve().parents[2])   # where this amqpbroker package lives
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        self._writer = subprocess.Popen(
            [sys.executable, "-m", "amqpbroker.store.writer", str(self.path), str(size), str(self.max_map_size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True, env=env)
        w, r = self._writer.stdin.fileno(), self._writer.stdout.fileno()
        try:
            fcntl.fcntl(w, _F_SETPIPE_SZ, PIPE_SIZE)
        except OSError:
            pass   # the default size works, with more waits in _send
        os.set_blocking(w, False)
        os.set_blocking(r, False)
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
        if self._writer is None:
            return
        writer = self._writer
        try:
            self._flush_with(writer)
            self._writer = None
            self._send_now(writer, writer_proc.frame(("stop",)))
            writer.stdin.close()
            writer.wait(30)
        except (OSError, StoreError, subprocess.TimeoutExpired) as exc:
            log.error("store writer did not stop cleanly: %s", exc)
            self._writer = None
            writer.kill()
        try:
            self.loop.remove_reader(writer.stdout.fileno())
        except (ValueError, OSError, RuntimeError):
            pass   # the loop is closed already
        writer.stdout.close()
        self.env.close()

    # ------------------------------------------------------------------ queued writes

    def writes(self) -> Batch:   # Store.writes: the batch itself
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
        number = self.batch
        self.batch += 1
        batch.seal()
        self._inflight.append((number, batch))
        if self._writer_lost or self._writer is None:
            self._settle(number, StoreError("the store writer process is gone"))
            return
        self._send(writer_proc.frame(("batch", number, writer_proc.batch_fields(batch))))

    def _send(self, data: bytes) -> None:
        """Queue a frame for the writer's pipe without blocking the loop."""
        fd = self._writer.stdin.fileno()
        if not self._out:
            try:
                n = os.write(fd, data)
            except BlockingIOError:
                n = 0
            except OSError as exc:
                self._lost(exc)
                return
            if n == len(data):
                return
            data = data[n:]
            self.loop.add_writer(fd, self._drain_out)
        self._out += data

    def _drain_out(self) -> None:
        fd = self._writer.stdin.fileno() if self._writer is not None else None
        try:
            n = os.write(fd, self._out) if fd is not None else len(self._out)
        except BlockingIOError:
            return
        except OSError as exc:
            self._lost(exc)   # a new writer gets every uncommitted batch again
            return
        del self._out[:n]
        if not self._out and fd is not None:
            self.loop.remove_writer(fd)

    def _send_now(self, writer: subprocess.Popen, data: bytes) -> None:
        """Write everything queued plus `data`, blocking (flush, close)."""
        fd = writer.stdin.fileno()
        if self._out:
            try:
                self.loop.remove_writer(fd)
            except (ValueError, OSError, RuntimeError):
                pass
        pending = bytes(self._out) + data
        self._out.clear()
        view = memoryview(pending)
        os.set_blocking(fd, True)
        try:
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.set_blocking(fd, False)

    # ------------------------------------------------------------------ commit results

    def _on_results(self) -> None:
        """The writer reported commits (loop thread, via add_reader)."""
        if self._writer is None:
            return
        try:
            chunk = os.read(self._writer.stdout.fileno(), 65536)
        except BlockingIOError:
            return
        except OSError as exc:
            chunk = b""
            log.error("store writer result pipe failed: %s", exc)
        if not chunk:
            self._lost(EOFError("the store writer process exited"))
            return
        self._results += chunk
        for result in writer_proc.take_frames(self._results):
            self._apply_result(result)

    def _apply_result(self, result: tuple, defer: bool = False) -> None:
        number, kind, text, elapsed, ops, full, map_size = result
        self.commits += 1
        self.last_batch_ops = ops
        self.commit_seconds_total += elapsed
        self.commit_stats.observe(elapsed, ops)
        self.full = full
        if map_size > self.map_size:
            self.map_size = map_size
            with self._read_lock:   # no read transaction is open outside it
                self.env.set_mapsize(0)   # adopt the size the writer grew the map to
        error = None
        if kind is not None:
            error = StoreFull(text) if kind == "full" else StoreError(text)
        self._settle(number, error, defer)
        now = time.monotonic()
        if now >= self._release_at:   # pages this process read (page-in) leave its RSS too
            self._release_at = now + MAP_RELEASE_INTERVAL
            self.release_map()

    def _settle(self, number: int, error: BaseException | None, defer: bool = False) -> None:
        """Every batch up to `number` is committed (or failed with `error`).  Deferred
        (flush): the callbacks run from the loop, as they would have without it."""
        done: list[Batch] = []
        inflight = self._inflight
        while inflight and inflight[0][0] <= number:
            done.append(inflight.popleft()[1])
        for b in done:
            _run_callbacks(b.waiters, error)
        if defer and not self.loop.is_closed():
            self.loop.call_soon(self._finish, done, error)
        else:
            self._finish(done, error)

    def _finish(self, done: list[Batch], error: BaseException | None) -> None:
        if error is not None and self.on_lost_entries is not None:
            # Before the callbacks: the broker drops these entries from its queues
            # before producers are told their messages were rejected.
            lost = [ENTRY_KEY.unpack(key) for b in done for key in b.new_keys]
            if lost:
                self.on_lost_entries(lost)
        for b in done:
            _run_callbacks(b.callbacks, error)

    def _lost(self, exc: BaseException) -> None:
        """The writer process died (killed, out of memory).  A new one takes over and
        gets every batch not yet reported committed, in order: their writes are blind
        puts and deletes, so applying again what the dead one may have committed ends
        in the same state.  Only when writers keep dying is durability given up:
        durable messages are refused (resource-limit-exceeded) from then on."""
        if self._writer_lost or self._writer is None:
            return
        old, self._writer = self._writer, None
        for fd, remove in ((old.stdout.fileno(), self.loop.remove_reader),
                           (old.stdin.fileno(), self.loop.remove_writer)):
            try:
                remove(fd)
            except (ValueError, OSError, RuntimeError):
                pass
        for pipe in (old.stdin, old.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        old.kill()
        old.wait()
        self._out.clear()
        self._results.clear()
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW] + [now]
        if len(self._restarts) <= MAX_RESTARTS:
            try:
                self._start_writer()
            except OSError as start_error:
                exc = start_error
            else:
                log.error("store writer process lost (%s); a new one replays %d uncommitted batch(es)",
                          exc, len(self._inflight))
                for number, batch in self._inflight:
                    self._send(writer_proc.frame(("batch", number, writer_proc.batch_fields(batch))))
                return
        self._writer_lost = True
        self.full = True
        log.error("store writer process lost (%s): durable messages are refused from now on", exc)
        if self._inflight:
            self._settle(self._inflight[-1][0], StoreError(f"the store writer process is gone: {exc}"))

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

    def put_entry(self, queue_id: int, record: EntryRecord) -> None:
        self.writes().put_entry(queue_id, record)

    def update_entry(self, queue_id: int, record: EntryRecord) -> None:
        self.writes().update_entry(queue_id, record)

    def delete_entry(self, queue_id: int, seq: int) -> None:
        self.writes().delete_entry(queue_id, seq)

    def after_commit(self, callback: Callable[[BaseException | None], None]) -> None:
        batch = self.writes()
        batch.ops += 1
        batch.callbacks.append(callback)

    def flush(self, timeout: float = 30.0) -> None:
        """Block (loop thread) until everything queued so far is committed."""
        if self._writer is not None:
            self._flush_with(self._writer, timeout)

    def _flush_with(self, writer: subprocess.Popen, timeout: float = 30.0) -> None:
        self._handoff()
        if not self._inflight or self._writer_lost:
            return
        target = self._inflight[-1][0]
        self._send_now(writer, b"")
        fd = writer.stdout.fileno()
        deadline = time.monotonic() + timeout
        while self._inflight and self._inflight[0][0] <= target:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise StoreError("store flush timed out")
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                self._lost(EOFError("the store writer process exited"))
                return
            self._results += chunk
            for result in writer_proc.take_frames(self._results):
                self._apply_result(result, defer=True)

    # ------------------------------------------------------------------ reads

    def read_message(self, msg_id: int) -> bytes | None:
        with self._read_lock, self._begin() as txn:
            return txn.get(U64.pack(msg_id), db=self._dbs["messages"])

    def read_messages(self, msg_ids: list[int]) -> list[bytes | None]:
        pack = U64.pack
        with self._read_lock, self._begin() as txn:
            get = txn.get
            db = self._dbs["messages"]
            return [get(pack(mid), db=db) for mid in msg_ids]

    def read_entries(self, queue_id: int, after_seq: int, limit: int) -> list[EntryRecord]:
        out: list[EntryRecord] = []
        prefix = U32.pack(queue_id)
        with self._read_lock, self._begin() as txn:
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
        with self._read_lock, self._begin() as txn:
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
        with self._read_lock, self._begin() as txn:
            cur = txn.cursor(db=self._dbs["messages"])
            lo = U64.unpack(cur.key())[0] if cur.first() else 1
        return lo, self._next_msg_id - 1

    def _begin(self) -> lmdb.Transaction:
        """A read transaction; adopts a map the writer process has grown."""
        try:
            return self.env.begin()
        except lmdb.MapResizedError:
            self.env.set_mapsize(0)
            return self.env.begin()

    def release_map(self) -> int:
        """Unmap the pages of the store this process has touched (not the data: the
        kernel keeps them in its page cache).  Scans, fills and drains touch most of
        the map, and every touched page counts in the broker's RSS.  The map is
        shared and read-only (no writemap): MADV_DONTNEED only drops page-table
        entries, a later read faults the page back in.  Linux only; returns the
        bytes of map advised (0 elsewhere or on failure)."""
        if self.env is None:
            return 0
        with self._read_lock:
            return release_map(self.path)

    def count_entries(self, queue_id: int) -> int:
        n = 0
        prefix = U32.pack(queue_id)
        with self._read_lock, self._begin() as txn:
            cur = txn.cursor(db=self._dbs["entries"])
            if cur.set_range(prefix):
                for key in cur.iternext(values=False):
                    if key[:4] != prefix:
                        break
                    n += 1
        return n

    def read_last_seq(self, queue_id: int) -> int:
        """The last sequence number committed for a queue (0: none yet)."""
        with self._read_lock, self._begin() as txn:
            raw = txn.get(U32.pack(queue_id), db=self._dbs["seqs"])
        return U64.unpack(raw)[0] if raw else 0

    # Small keyed records beside the broker model (duplicate-detection ids, log
    # reader claims: server/sequence.py), written in the same batches as messages.
    def put_record(self, db: str, key: bytes, value: bytes) -> None:
        self._meta("put", db, key, value)

    def delete_record(self, db: str, key: bytes) -> None:
        self._meta("del", db, key, None)

    def read_records(self, db: str) -> list[tuple[bytes, bytes]]:
        with self._read_lock, self._begin() as txn:
            return [(bytes(k), bytes(v)) for k, v in txn.cursor(db=self._dbs[db])]


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
