"""LmdbStore's reads (loop thread, committed data only): page-in, recovery, the
small keyed records.  A mixin: the store's environment, named databases and read
lock are LmdbStore's (store/lmdb_store.py)."""

from __future__ import annotations

import struct
import threading
from pathlib import Path
from typing import Any

import lmdb

from .base import EntryRecord
from .batch import ENTRY_KEY, ENTRY_VAL, MARK_KEY, U32, U64
from .maps import release_map

_SCAN_VAL = struct.Struct(">QIBBI")      # the head of ENTRY_VAL: up to the size
LOG_QUEUE = 0                            # the queue id the topic log's records are stored under


class LmdbReads:
    path: Path
    env: lmdb.Environment | None
    _dbs: dict[str, Any]
    _read_lock: threading.Lock
    _next_msg_id: int

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

    def read_watermark(self, queue_id: int) -> int:
        """A queue's committed delivery watermark (store/marks.py; 0: none)."""
        with self._read_lock, self._begin() as txn:
            raw = txn.get(MARK_KEY + U32.pack(queue_id), db=self._dbs["meta"])
        return U64.unpack(raw)[0] if raw else 0

    # The topic log (store/topiclog.py): the records of durable subscriptions, in
    # the entries db under queue id LOG_QUEUE, keyed by position.
    def scan_log(self, decode: Any, batch: int = 65_536) -> list[Any]:
        """Every log record, as `decode(position, value)`, in position order (the store
        pages the scan touched are released every `batch` records)."""
        out: list[Any] = []
        after = 0
        prefix = U32.pack(LOG_QUEUE)
        while True:
            n = 0
            with self._read_lock, self._begin() as txn:
                cur = txn.cursor(db=self._dbs["entries"])
                if not cur.set_range(ENTRY_KEY.pack(LOG_QUEUE, after + 1)):
                    return out
                for key, val in cur:
                    if key[:4] != prefix:
                        return out
                    after = ENTRY_KEY.unpack(key)[1]
                    out.append(decode(after, val))
                    n += 1
                    if n >= batch:
                        break
                else:
                    return out
            self.release_map()

    def read_log(self, positions: list[int]) -> list[bytes | None]:
        """The committed values of these log records (None: not there), in one read."""
        pack = ENTRY_KEY.pack
        with self._read_lock, self._begin() as txn:
            get = txn.get
            db = self._dbs["entries"]
            return [get(pack(LOG_QUEUE, p), db=db) for p in positions]

    # Small keyed records beside the broker model (duplicate-detection ids, log
    # reader claims: server/sequence.py; the topic log's routes and cursors);
    # written through LmdbStore.put_record or a batch.
    def read_records(self, db: str) -> list[tuple[bytes, bytes]]:
        with self._read_lock, self._begin() as txn:
            return [(bytes(k), bytes(v)) for k, v in txn.cursor(db=self._dbs[db])]


def _decode_entry(seq: int, val: bytes) -> EntryRecord:
    msg_id, count, delivered, priority, size, expires, deliver = ENTRY_VAL.unpack_from(val)
    group = val[ENTRY_VAL.size:]
    return EntryRecord(seq, msg_id, count, bool(delivered), priority, size,
                       None if expires != expires else expires, None if deliver != deliver else deliver,
                       bytes(group).decode() if group else None)

