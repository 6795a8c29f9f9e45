"""The interface the broker core talks to for durability, and a store that keeps
nothing (embedded tests, or `--no-persistence`).

Write operations are *queued*, never blocking: the broker calls them on the event
loop thread while it routes and settles; a store makes them durable in batches and
then runs the callbacks given to `after_commit()` on the loop thread.  Everything
written before an `after_commit(cb)` call is durable when `cb` runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

FORMAT_VERSION = 1


class StoreError(Exception):
    """The store cannot do what was asked (full, wrong format, unreadable)."""


class StoreFull(StoreError):
    """The map reached its configured maximum or the disk is full."""


class StoreFault(StoreError):
    """A fault on the way to the disk (out of memory, a pipe or I/O error, a writer
    process that keeps failing): what was being stored was not.  Transient: the
    store resumes once it clears (LmdbStore.degraded)."""


@dataclass
class QueueRecord:
    name: str
    queue_id: int
    exclusivity: str
    lifetime: str
    max_delivery_attempts: int | None
    last_seq: int = 0
    limits: dict | None = None    # limits declared with the queue (QueueLimits.describe)


@dataclass
class EntryRecord:
    """A queue entry as stored: enough to order, expire and group it without
    reading the message body (bounded memory keeps only this in memory)."""
    seq: int
    msg_id: int
    delivery_count: int
    delivered: bool = False
    priority: int = 4
    size: int = 0
    expires_at: float | None = None
    deliver_at: float | None = None
    group: str | None = None


@dataclass
class Snapshot:
    """Everything durable, as read at start-up."""
    exchanges: list[dict] = field(default_factory=list)
    queues: list[QueueRecord] = field(default_factory=list)
    bindings: list[dict] = field(default_factory=list)
    subscriptions: list[dict] = field(default_factory=list)
    next_msg_id: int = 1


def write_refusal(store: Any) -> str | None:
    """Why `store` refuses durable writes now (full, or degraded after a fault), or
    None.  A move of messages between queues must stop then: the batch that carries a
    copy would fail while the removal is kept (store/batch.py `Batch.fail`)."""
    if getattr(store, "full", False) or getattr(store, "degraded", None):
        return "the store refuses writes now (full or degraded); nothing more moved"
    return None


class Store:
    """No persistence: every call is accepted and forgotten; callbacks run at once."""

    persistent = False

    def __init__(self) -> None:
        self._next_msg_id = 1
        self.full = False
        # The batch that writes queued now commit in (a store that batches bumps it
        # at each hand-over).  Two writes queued under the same number are durable
        # together or not at all.
        self.batch = 0

    # ---- lifecycle
    def open(self, loop: Any) -> Snapshot:
        return Snapshot()

    def close(self) -> None:
        pass

    # ---- ids
    def new_msg_id(self) -> int:
        mid = self._next_msg_id
        self._next_msg_id += 1
        return mid

    # ---- entities
    def save_exchange(self, name: str, kind: str) -> None: ...
    def delete_exchange(self, name: str) -> None: ...
    def save_queue(self, record: QueueRecord) -> None: ...
    def delete_queue(self, queue_id: int, name: str) -> None: ...
    def save_binding(self, exchange: str, key: str, queue: str, arguments: dict) -> None: ...
    def delete_binding(self, exchange: str, key: str, queue: str) -> None: ...
    def save_subscription(self, queue: str, record: dict) -> None: ...
    def delete_subscription(self, queue: str) -> None: ...

    # ---- messages and entries
    def put_message(self, msg_id: int, raw: bytes) -> None: ...
    def drop_message(self, msg_id: int) -> None: ...
    def put_entry(self, queue_id: int, record: EntryRecord) -> None:
        """A new entry.  `record` may be live (a queue entry presenting the
        EntryRecord fields): a batching store reads it when it hands the batch to
        disk, so changes until then (a delivery in the same turn) need no update."""
    def update_entry(self, queue_id: int, record: EntryRecord) -> None: ...
    def delete_entry(self, queue_id: int, seq: int) -> None: ...
    def put_mark(self, queue_id: int, seq: int) -> None:
        """A queue's delivery watermark (store/marks.py): every entry with a sequence
        up to `seq` may have been handed out (0: none)."""

    def writes(self) -> Any:
        """Where the message and entry writes of this loop turn go: an object with
        put_message, drop_message, put_entry, update_entry and delete_entry (the hot
        path calls them there, one call fewer per write)."""
        return self

    # ---- reads (loop thread; committed data only)
    def read_message(self, msg_id: int) -> bytes | None:
        return None

    def read_messages(self, msg_ids: list[int]) -> list[bytes | None]:
        """Several bodies at once (page-in)."""
        return [self.read_message(mid) for mid in msg_ids]

    def read_entries(self, queue_id: int, after_seq: int, limit: int) -> list[EntryRecord]:
        return []

    def scan_entries(self, queue_id: int, after_seq: int, limit: int) -> list[tuple[int, int, int, bool]]:
        """(seq, msg id, size, delivered) of entries, as read_entries but without
        building records (recovery counts a paged backlog)."""
        return [(r.seq, r.msg_id, r.size, r.delivered) for r in self.read_entries(queue_id, after_seq, limit)]

    def message_id_range(self) -> tuple[int, int]:
        """(lowest stored message id, highest id handed out so far)."""
        return 1, self._next_msg_id - 1

    def read_last_seq(self, queue_id: int) -> int:
        return 0

    def read_watermark(self, queue_id: int) -> int:
        return 0

    # ---- small keyed records ("dedup", "readers"; server/sequence.py)
    def put_record(self, db: str, key: bytes, value: bytes) -> None: ...
    def delete_record(self, db: str, key: bytes) -> None: ...

    def read_records(self, db: str) -> list[tuple[bytes, bytes]]:
        return []

    # ---- commits
    def after_commit(self, callback: Callable[[BaseException | None], None]) -> None:
        callback(None)

    def settled(self, number: int) -> bool:
        """Batch `number` was handed over and its callbacks ran (or are on their way)."""
        return True

    def after_batch(self, number: int, callback: Callable[[BaseException | None], None]) -> None:
        """after_commit(), but for batch `number` (the current one or one on its way),
        which may commit before the current one."""
        callback(None)

    def flush(self) -> None:
        """Block until everything queued so far is durable (shutdown, tests)."""
