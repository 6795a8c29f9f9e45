"""Queue entries and the ready list: a message's place in one queue, and the
available entries per priority in sequence order (core/queues.py dispatches them).

Ordering: one FIFO per priority (0–9, higher first; AMQP 1.0 §3.2.1 leaves the scheme
to the broker, JMS 2.0 §6.9 asks for 0–9).  An entry that comes back (released,
modified, link closed) returns to its original position by sequence number, so
redeliveries keep their original order.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterator, Protocol

from .message import Message

PRIORITY_LEVELS = 10


class ConsumerPort(Protocol):
    """What a queue needs from a consumer (implemented by the I/O layer)."""

    consumer_id: int
    browser: bool         # distribution-mode copy: sees entries without acquiring them
    filtered: bool        # True when accepts() may say no (selector, no-local)

    def credit(self) -> int: ...
    def accepts(self, entry: "Entry") -> bool: ...
    def deliver(self, entry: "Entry") -> None: ...
    # Browsers only: the last sequence seen, and a non-acquiring delivery.
    browse_cursor: int
    def deliver_copy(self, entry: "Entry") -> None: ...


class StoreHooks(Protocol):
    """What a durable queue asks of the store layer (store/durability.py implements it
    once for all queues: one reference per queue, not a closure per hook)."""

    def entry_added(self, queue: Any, entry: "Entry") -> None: ...
    def entry_removed(self, queue: Any, entry: "Entry") -> None: ...
    def entry_updated(self, queue: Any, entry: "Entry", delivered: bool) -> None: ...
    def load_body(self, entry: "Entry") -> Message: ...
    # The paged region (core/paging.py): after the commit of a paged entry the store
    # calls queue.page_committed(seq, error); read back `limit` entries after `after`;
    # remove store-only entries after `after` (below `below`; None: all) except `skip`.
    def page_out(self, queue: Any, entry: "Entry") -> None: ...
    def read_paged(self, queue: Any, after: int, limit: int) -> list["Entry"]: ...
    def drop_paged(self, queue: Any, after: int, below: int | None, skip: set[int]) -> tuple[int, int]: ...


class Entry:
    """A message's place in one queue.  `msg` is None while the entry is paged out
    (bounded memory: only this index stays in memory; the body is in the store)."""

    __slots__ = ("msg", "seq", "priority", "delivery_count", "expires_at", "deliver_at",
                 "consumer", "excluded", "group", "store_ref", "size", "stored_in")

    def __init__(self, msg: Message | None, seq: int):
        self.msg = msg
        self.seq = seq
        self.consumer: ConsumerPort | None = None   # who holds it while acquired
        self.excluded: set[int] | None = None        # consumers it is undeliverable-here for
        self.store_ref: Any = None                   # the store's message id for durable entries
        self.stored_in = -1                          # the store batch that writes it (-1: on disk)
        if msg is None:
            return
        p = msg.priority
        self.priority = 0 if p < 0 else (PRIORITY_LEVELS - 1 if p >= PRIORITY_LEVELS else p)
        self.delivery_count = msg.delivery_count
        self.expires_at, self.deliver_at, self.group = msg.routing_times()
        self.size = msg.size

    @classmethod
    def paged(cls, seq: int, store_ref: Any, *, size: int, priority: int, delivery_count: int,
              expires_at: float | None, deliver_at: float | None, group: str | None) -> "Entry":
        entry = cls(None, seq)
        entry.store_ref = store_ref
        entry.size = size
        entry.priority = priority
        entry.delivery_count = delivery_count
        entry.expires_at = expires_at
        entry.deliver_at = deliver_at
        entry.group = group
        return entry

    def payload(self) -> bytes:
        return self.msg.encoded(self.delivery_count)

    # The store's view of an entry (the EntryRecord fields it encodes when it hands a
    # batch over): a new durable entry is written as it is at the end of its loop turn.
    @property
    def msg_id(self) -> Any:
        return self.store_ref

    @property
    def delivered(self) -> bool:
        """Held by a consumer: after a crash it comes back with delivery-count + 1."""
        return self.consumer is not None


_EMPTY: tuple = ()   # a priority level nothing was pushed to: no deque (600 bytes each)


class ReadyList:
    """Available entries: one deque per priority, each sorted by sequence.  A level
    gets its deque on its first push, so an idle queue costs a list of ten
    references, not ten deques (50,000 queues: 30 MB less)."""

    __slots__ = ("_levels", "_count")

    def __init__(self) -> None:
        self._levels: list = [_EMPTY] * PRIORITY_LEVELS
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def push(self, entry: Entry) -> None:
        level = self._levels[entry.priority]
        if level is _EMPTY:
            level = self._levels[entry.priority] = deque()
        if not level or level[-1].seq < entry.seq:
            level.append(entry)
        elif entry.seq < level[0].seq:
            level.appendleft(entry)
        else:  # a returning entry lands between others: find its slot
            lo, hi = 0, len(level)
            while lo < hi:
                mid = (lo + hi) // 2
                if level[mid].seq < entry.seq:
                    lo = mid + 1
                else:
                    hi = mid
            level.insert(lo, entry)
        self._count += 1

    def pop_first(self) -> Entry | None:
        for level in reversed(self._levels):
            if level:
                self._count -= 1
                return level.popleft()
        return None

    def __contains__(self, entry: Entry) -> bool:
        level = self._levels[entry.priority]
        lo, hi = 0, len(level)
        while lo < hi:   # each level is sorted by sequence
            mid = (lo + hi) // 2
            if level[mid].seq < entry.seq:
                lo = mid + 1
            else:
                hi = mid
        return lo < len(level) and level[lo] is entry

    def remove(self, entry: Entry) -> None:
        self._levels[entry.priority].remove(entry)
        self._count -= 1

    def __iter__(self) -> Iterator[Entry]:
        for level in reversed(self._levels):
            yield from list(level)

    def clear(self) -> list[Entry]:
        out = [e for level in reversed(self._levels) for e in level]
        self._levels = [_EMPTY] * PRIORITY_LEVELS
        self._count = 0
        return out

    def pop_below(self, seq: int) -> list[Entry]:
        """Remove and return every entry with a sequence number below `seq`."""
        out: list[Entry] = []
        for level in self._levels:
            while level and level[0].seq < seq:
                out.append(level.popleft())
        self._count -= len(out)
        return out
