"""One group commit's worth of store writes, coalesced as they are queued.

The loop thread records every write of a loop turn straight into a `Batch` (no
operation log to replay): an entry or message written and removed again before
the batch is handed over (a consumer acknowledged it first) leaves nothing
behind.  At hand-over, still on the loop thread, `seal()` encodes the entries
that were queued as live objects, so a record carries the state its entry has
then (a delivery made in the same turn marks it delivered without a second
write).  The writer thread applies sealed batches in hand-over order inside one
LMDB transaction: a later batch's removal of an earlier batch's write is just
applied after it.
"""

from __future__ import annotations

import struct
from typing import Any, Callable

import lmdb

ENTRY_KEY = struct.Struct(">IQ")
ENTRY_VAL = struct.Struct(">QIBBIdd")   # msg id, delivery-count, delivered, priority, size,
                                         # expires-at, deliver-at (NaN: none); then group (utf-8)
U64 = struct.Struct(">Q")
U32 = struct.Struct(">I")
MARK_KEY = b"delivered-to:"   # + queue id (u32), in the meta db: the queue's delivery watermark
                              # (u64; store/marks.py)
_NAN = float("nan")
_pack_val = ENTRY_VAL.pack


def encode_entry(r: Any) -> bytes:
    """An entry record's value.  `r` has the EntryRecord fields (msg_id, delivery_count,
    delivered, priority, size, expires_at, deliver_at, group): a record, or a live
    queue entry that presents them."""
    expires, deliver, group = r.expires_at, r.deliver_at, r.group
    head = _pack_val(r.msg_id, r.delivery_count, r.delivered, r.priority, r.size,
                     _NAN if expires is None else expires, _NAN if deliver is None else deliver)
    return head if group is None else head + group.encode()


class Batch:
    __slots__ = ("entry_new", "entry_puts", "entry_dels", "msg_puts", "msg_dels", "meta",
                 "last_seq", "max_msg_id", "callbacks", "error", "ops", "new_keys", "marks", "live")

    def __init__(self) -> None:
        self.entry_new: dict[bytes, Any] = {}     # key → live entry (encoded by seal())
        self.entry_puts: dict[bytes, bytes] = {}  # key → encoded value (updates; new, once sealed)
        self.entry_dels: set[bytes] = set()
        self.msg_puts: dict[bytes, bytes] = {}    # packed msg id → raw message
        self.msg_dels: set[bytes] = set()
        self.meta: list[tuple] = []               # (action, db, key, value), in order
        self.last_seq: dict[int, int] = {}        # queue id → highest sequence written
        self.max_msg_id = 0
        self.callbacks: list[Callable] = []       # run on the loop thread after the commit
        self.error: BaseException | None = None   # set by fail(): what the callbacks are told
        self.ops = 0
        self.new_keys: list[bytes] = []           # the new entries (sealed): lost if the commit fails
        self.marks: dict[int, int] = {}           # queue id → delivery watermark (store/marks.py)
        self.live: dict[tuple[str, bytes], Any] = {}   # (db, key) → state encoded at seal (None: delete)

    # ---- recording (loop thread)

    def put_message(self, msg_id: int, raw: bytes) -> None:
        self.ops += 1
        self.msg_puts[U64.pack(msg_id)] = raw
        if msg_id > self.max_msg_id:
            self.max_msg_id = msg_id

    def drop_message(self, msg_id: int) -> None:
        self.ops += 1
        key = U64.pack(msg_id)
        if self.msg_puts.pop(key, None) is None:
            self.msg_dels.add(key)

    def put_entry(self, queue_id: int, record: Any) -> None:
        self.ops += 1
        seq = record.seq
        self.entry_new[ENTRY_KEY.pack(queue_id, seq)] = record
        if seq > self.last_seq.get(queue_id, 0):
            self.last_seq[queue_id] = seq

    def put_entry_bytes(self, queue_id: int, seq: int, value: bytes) -> None:
        """A new entry whose value is encoded already (a topic log record,
        store/topiclog.py): kept, failed and lost like any new entry."""
        self.ops += 1
        self.entry_new[ENTRY_KEY.pack(queue_id, seq)] = value
        if seq > self.last_seq.get(queue_id, 0):
            self.last_seq[queue_id] = seq

    def update_entry(self, queue_id: int, record: Any) -> None:
        self.ops += 1
        key = ENTRY_KEY.pack(queue_id, record.seq)
        if key in self.entry_new:
            self.entry_new[key] = record
        elif key not in self.entry_dels:
            self.entry_puts[key] = encode_entry(record)

    def delete_entry(self, queue_id: int, seq: int) -> None:
        self.ops += 1
        key = ENTRY_KEY.pack(queue_id, seq)
        if self.entry_new.pop(key, None) is None:
            self.entry_puts.pop(key, None)
            self.entry_dels.add(key)

    def put_mark(self, queue_id: int, seq: int) -> None:
        """A queue's delivery watermark (0: none).  Kept by fail() and removals_only()
        like an update of an entry stored earlier: deliveries were made under it."""
        self.ops += 1
        self.marks[queue_id] = seq

    def put_meta(self, action: str, db: str, key: bytes, value: bytes | None) -> None:
        """`action`: "put" (an entity record), "set" (state that must follow what the
        broker did, as removals must), "del", "drop-queue-entries"; fail() and
        removals_only() keep them all: the broker has applied them in memory."""
        self.ops += 1
        self.meta.append((action, db, key, value))

    def put_live(self, db: str, key: bytes, record: Any) -> None:
        """State written once per batch however often it changes in the turn (a
        subscription's cursor, store/topiclog.py): `record.encode()` is called when
        the batch is sealed and written as a "set"; None deletes the key."""
        self.ops += 1
        self.live[(db, key)] = record

    def seal(self) -> "Batch":
        """Encode the live entries as they are now (loop thread, at hand-over)."""
        if self.entry_new:
            puts = self.entry_puts
            for key, record in self.entry_new.items():
                puts[key] = record if record.__class__ is bytes else encode_entry(record)
            self.new_keys = list(self.entry_new)
            self.entry_new = {}
        if self.live:
            meta = self.meta
            for (db, key), record in self.live.items():
                meta.append(("del", db, key, None) if record is None else ("set", db, key, record.encode()))
            self.live = {}
        return self

    # ---- failing (loop thread)

    def fail(self, error: BaseException) -> None:
        """This batch cannot be stored as it is (hand-over or pipe failure, or its
        writer is gone): its callbacks will be told `error`, and what it still has to
        write shrinks to what keeps the store consistent with a broker that goes on.
        Its new entries and messages become deletes (a writer that died may have
        committed them before it could say so; their producers are told Rejected, so
        they must not come back); removals, updates of entries stored earlier and
        entity records stay (the broker has already applied those in memory)."""
        new = list(dict.fromkeys([*self.entry_new, *self.new_keys]))
        self.new_keys = new
        self.entry_new = {}
        puts, dels = self.entry_puts, self.entry_dels
        for key in new:
            puts.pop(key, None)
            dels.add(key)
        self.msg_dels.update(self.msg_puts)
        self.msg_puts = {}
        self.error = error

    def abandon(self, error: BaseException) -> None:
        """fail() when even that cannot allocate: write only what was recorded as a
        removal or an entity record before it (both applied in memory already), never
        a new entry, message or update (fail() may have stopped half-way through
        moving them).  Entity records above all stay: the broker made those queues,
        bindings and subscriptions, and what it accepts next is stored under them.
        Cursor state sealed later (`live`) and updates are lost: those messages come
        back after a restart, as duplicates, never as losses.  Allocates nothing."""
        self.entry_new.clear()
        self.entry_puts.clear()
        self.msg_puts.clear()
        self.live.clear()   # (the high-water marks stay, as fail() keeps them: ids never go back)
        self.error = error

    # ---- applying (writer thread)

    def removals_only(self) -> "Batch":
        """This batch without what takes space: its new entries and messages (their
        producers are told the batch failed).  Entity records stay: the broker made
        those queues, bindings and subscriptions in memory, so messages it accepts
        later are stored under them; without their records a restart would drop
        those messages."""
        out = Batch()
        new = set(self.new_keys)
        out.entry_dels = self.entry_dels
        out.entry_puts = {k: v for k, v in self.entry_puts.items() if k not in new}
        out.msg_dels = self.msg_dels
        out.meta = list(self.meta)
        out.marks = self.marks
        return out

    def apply(self, txn: lmdb.Transaction, dbs: dict) -> None:
        for action, db, key, val in self.meta:
            if action == "put" or action == "set":
                txn.put(key, val, db=dbs[db])
            elif action == "del":
                txn.delete(key, db=dbs[db])
            elif action == "drop-queue-entries":
                cur = txn.cursor(db=dbs["entries"])
                if cur.set_range(key):
                    while cur.key()[:4] == key and cur.delete():
                        pass
                for k in [k for k in self.entry_puts if k[:4] == key]:
                    del self.entry_puts[k]
        entries, messages = dbs["entries"], dbs["messages"]
        delete = txn.delete
        for key in self.entry_dels:
            delete(key, db=entries)
        if self.entry_puts:
            txn.cursor(db=entries).putmulti(self.entry_puts.items())
        for key in self.msg_dels:
            delete(key, db=messages)
        if self.msg_puts:
            txn.cursor(db=messages).putmulti(self.msg_puts.items())
        for qid, seq in self.last_seq.items():
            txn.put(U32.pack(qid), U64.pack(seq), db=dbs["seqs"])
        if self.max_msg_id:
            txn.put(b"next_msg_id", U64.pack(self.max_msg_id + 1), db=dbs["meta"])
        for qid, seq in self.marks.items():
            key = MARK_KEY + U32.pack(qid)
            if seq:
                txn.put(key, U64.pack(seq), db=dbs["meta"])
            else:
                txn.delete(key, db=dbs["meta"])
