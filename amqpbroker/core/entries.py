"""Queue entries and the ready list: a message's place in one queue, and the
available entries per priority in sequence order (core/queues.py dispatches them).

Ordering: one FIFO per priority (0–9, higher first; AMQP 1.0 §3.2.1 leaves the scheme
to the broker, JMS 2.0 §6.9 asks for 0–9).  An entry that comes back (released,
modified, link closed) returns to its original position by sequence number, so
redeliveries keep their original order.
"""

from __future__ import annotations

from bisect import bisect_left
from heapq import merge
from itertools import islice
from operator import attrgetter
from typing import Any, Iterator, Protocol

from .message import Message

PRIORITY_LEVELS = 10


class ConsumerPort(Protocol):
    """What a queue needs from a consumer (implemented by the I/O layer)."""

    consumer_id: int
    browser: bool         # distribution-mode copy: sees entries without acquiring them
    filtered: bool        # True when accepts() may say no (selector, no-local)
    standby: bool         # a second choice: offered an entry only when no other consumer
                          # takes it now (another node's consumer with a member of its own)

    # How many entries deliver() may take now; each delivery uses exactly one, until
    # the I/O layer hands in more input (a queue reads it once for a run of entries).
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
    # Moving a waiting entry away (core/waiting.py): remove a store-only entry of the
    # paged region; call queue.gone_committed(seq) once the current batch is settled.
    def remove_paged(self, queue: Any, entry: "Entry") -> None: ...
    def forget_gone(self, queue: Any, seq: int) -> None: ...


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
        self.stored_in = -1                          # the store batch that writes it (-1: on disk;
                                                     # once handed out, a hold_code())
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


def hold_code(batch: int) -> int:
    """`Entry.stored_in` of an entry handed out: the store batch its delivery must
    wait for, encoded below -1 (-1: none) so that it never equals a batch number
    (store/durability.py tells a new entry of the current batch by that equality;
    one slot, no extra bytes per entry)."""
    return -2 - batch if batch >= 0 else -1


def held_batch(stored_in: int) -> int:
    """The batch a delivery waits for (-1: none), from `Entry.stored_in`: a hold code,
    or the batch that stores the entry (a new entry handed out in the turn that stores
    it waits for nothing: server/engine.py hold_for_store tells it by the batch number)."""
    return -2 - stored_in if stored_in < -1 else stored_in


_SIZES: dict[int, int] = {}


def shared_size(n: int) -> int:
    """One int object per message size (bounded memory): a paged-out entry keeps its
    size, and 1M entries of one size need not hold 1M equal ints (32 bytes each)."""
    s = _SIZES.get(n)
    if s is None:
        if len(_SIZES) >= 65536:
            return n
        _SIZES[n] = s = n
    return s


_SEQ = attrgetter("seq")
BLOCK = 512          # entries per block of a level (a block splits past twice that)


class _Level:
    """One priority's entries in sequence order, as a list of sorted blocks: finding,
    inserting or removing an entry anywhere costs O(log n + BLOCK), where a deque
    pays the distance to its nearer end (a selector takes entries from the middle)."""

    __slots__ = ("blocks", "lasts")

    def __init__(self) -> None:
        self.blocks: list[list[Entry]] = []
        self.lasts: list[int] = []   # each block's last sequence

    def __len__(self) -> int:
        return sum(map(len, self.blocks))

    def __iter__(self) -> Iterator[Entry]:
        for block in self.blocks:
            yield from block

    def __getitem__(self, i: int) -> Entry:
        if i < 0:
            i += len(self)
        if i < 0:
            raise IndexError(i)
        for block in self.blocks:
            if i < len(block):
                return block[i]
            i -= len(block)
        raise IndexError(i)

    def _find(self, seq: int) -> tuple[int, int]:
        """(block, index) of the first entry with a sequence of at least `seq`."""
        b = bisect_left(self.lasts, seq)
        if b == len(self.blocks):
            return b, 0
        return b, bisect_left(self.blocks[b], seq, key=_SEQ)

    def append(self, entry: Entry) -> None:
        """Add an entry with a sequence above every one in the level."""
        blocks = self.blocks
        if blocks and len(blocks[-1]) < BLOCK:
            blocks[-1].append(entry)
            self.lasts[-1] = entry.seq
        else:
            blocks.append([entry])
            self.lasts.append(entry.seq)

    def popleft(self) -> Entry:
        block = self.blocks[0]
        entry = block.pop(0)
        if not block:
            del self.blocks[0], self.lasts[0]
        return entry

    def add(self, entry: Entry) -> None:
        blocks, lasts = self.blocks, self.lasts
        if not blocks or entry.seq > lasts[-1]:
            self.append(entry)
            return
        b, i = self._find(entry.seq)   # a returning entry lands between others
        block = blocks[b]
        block.insert(i, entry)
        if len(block) > 2 * BLOCK:
            blocks.insert(b + 1, block[BLOCK:])
            del block[BLOCK:]
            lasts.insert(b, block[-1].seq)

    def remove(self, entry: Entry) -> bool:
        b, i = self._find(entry.seq)
        if b == len(self.blocks) or i >= len(self.blocks[b]) or self.blocks[b][i] is not entry:
            return False
        block = self.blocks[b]
        del block[i]
        if not block:
            del self.blocks[b], self.lasts[b]
        elif i == len(block):
            self.lasts[b] = block[-1].seq
        return True

    def __contains__(self, entry: Entry) -> bool:
        b, i = self._find(entry.seq)
        return b < len(self.blocks) and i < len(self.blocks[b]) and self.blocks[b][i] is entry

    def window(self, seq: int, n: int) -> list[Entry]:
        """Up to `n` entries with a sequence of at least `seq`, in order (a copy)."""
        b, i = self._find(seq)
        out: list[Entry] = []
        blocks = self.blocks
        while b < len(blocks) and len(out) < n:
            out += blocks[b][i:i + n - len(out)]
            b, i = b + 1, 0
        return out

    def pop_below(self, seq: int) -> list[Entry]:
        out: list[Entry] = []
        blocks, lasts = self.blocks, self.lasts
        while blocks and blocks[0][0].seq < seq:
            if lasts[0] < seq:
                out += blocks[0]
                del blocks[0], lasts[0]
            else:
                k = bisect_left(blocks[0], seq, key=_SEQ)
                out += blocks[0][:k]
                del blocks[0][:k]
        return out


_EMPTY = _Level()   # a priority level nothing was pushed to (shared, never added to)


class ReadyList:
    """Available entries: one _Level per priority, each sorted by sequence.  A level
    gets its _Level on its first push, so an idle queue costs a list of ten
    references, not ten levels.

    Scan marks let a consumer that refuses entries (selector, message group) resume
    its scan where it stopped instead of examining them again for every message it
    takes: per consumer and level, every entry below the mark was examined and
    refused by it.  A push with a sequence above every one pushed before lands past
    every mark; any other push (an entry coming back, a scheduled or paged-in one
    overtaken by newer messages) makes its level dirty from its sequence on, and
    `marks()` lowers every consumer's mark there before the next scan."""

    __slots__ = ("count", "_dirty", "_high", "_levels", "_marks")

    def __init__(self) -> None:
        self._levels: list = [_EMPTY] * PRIORITY_LEVELS
        self.count = 0   # entries ready (read it: len() is a Python-level call on hot paths)
        self._high = 0                              # the highest sequence ever pushed
        self._dirty: dict[int, int] | None = None   # level -> lowest out-of-order push
        self._marks: dict[int, list[int]] | None = None   # consumer id -> mark per level

    def __len__(self) -> int:
        return self.count

    def _level(self, priority: int) -> _Level:
        level = self._levels[priority]
        if level is _EMPTY:
            level = self._levels[priority] = _Level()
        return level

    def push(self, entry: Entry) -> None:
        level = self._level(entry.priority)
        self.count += 1
        if entry.seq > self._high:   # above every mark (and every entry of its level)
            self._high = entry.seq
            level.append(entry)
        else:
            self.touch(entry)
            level.add(entry)

    def put_back(self, entry: Entry) -> None:
        """Undo pop_first(): the entry goes back in front, marks stay as they are."""
        self._level(entry.priority).add(entry)
        self.count += 1

    def touch(self, entry: Entry) -> None:
        """Record that scans must look at `entry` again (it came back, or a field a
        selector reads changed): its level is dirty from its sequence on."""
        dirty = self._dirty
        if dirty is None:
            dirty = self._dirty = {}
        low = dirty.get(entry.priority)
        if low is None or entry.seq < low:
            dirty[entry.priority] = entry.seq

    def marks(self, consumer_id: int) -> list[int]:
        """The consumer's scan marks by level, for the caller to move up as it scans;
        every consumer's marks are first lowered to the dirty levels' sequences."""
        dirty, self._dirty = self._dirty, None
        marks = self._marks
        if marks is None:
            marks = self._marks = {}
        elif dirty:
            for levels in marks.values():
                for p, seq in dirty.items():
                    levels[p] = min(levels[p], seq)
        own = marks.get(consumer_id)
        if own is None:
            own = marks[consumer_id] = [0] * PRIORITY_LEVELS
        return own

    def forget(self, consumer_id: int | None = None) -> None:
        """Drop one consumer's scan marks (its link ended), or everyone's (None: a
        refusal may no longer hold anywhere, e.g. a message group was released)."""
        if consumer_id is None:
            self._marks = None
        elif self._marks is not None:
            self._marks.pop(consumer_id, None)

    def lowest_seq(self) -> int | None:
        """The lowest sequence ready, at any priority (None: none ready)."""
        firsts = [level.blocks[0][0].seq for level in self._levels if level.blocks]
        return min(firsts) if firsts else None

    def pop_first(self) -> Entry | None:
        for level in reversed(self._levels):
            blocks = level.blocks
            if blocks:
                self.count -= 1
                return level.popleft()
        return None

    def __contains__(self, entry: Entry) -> bool:
        return entry in self._levels[entry.priority]

    def remove(self, entry: Entry) -> None:
        if not self._levels[entry.priority].remove(entry):
            raise ValueError(f"entry {entry.seq} is not ready")
        self.count -= 1

    def level_from(self, priority: int, seq: int, n: int) -> list[Entry]:
        """Up to `n` entries of one level with a sequence of at least `seq`, in order:
        a copy, so the caller may remove entries while it goes through them."""
        return self._levels[priority].window(seq, n)

    def after(self, seq: int, n: int) -> list[Entry]:
        """Up to `n` entries with a sequence above `seq`, in sequence order whatever
        their priority (browsing), without sorting the whole list."""
        parts = [level.window(seq + 1, n) for level in self._levels if level.blocks]
        if len(parts) == 1:
            return parts[0]
        return list(islice(merge(*parts, key=_SEQ), n))

    def __iter__(self) -> Iterator[Entry]:
        for level in reversed(self._levels):
            yield from list(level)

    def clear(self) -> list[Entry]:
        out = [e for level in reversed(self._levels) for e in level]
        self._levels = [_EMPTY] * PRIORITY_LEVELS
        self.count = 0
        return out

    def pop_below(self, seq: int) -> list[Entry]:
        """Remove and return every entry with a sequence number below `seq`."""
        out: list[Entry] = []
        for level in self._levels:
            if level.blocks:
                out += level.pop_below(seq)
        self.count -= len(out)
        return out
