"""The waiting messages of a queue, for browsing and moving them (a part of `Queue`,
in a file of its own, as core/paging.py and core/limits.py are).  Pure: no I/O.

A queue's waiting messages are in three places: the ready list and the scheduled
heap in memory, and the paged region (core/paging.py): entries pending their store
commit in `_pending_page`, the rest in the store only.  `waiting_after` walks the
three together in sequence order, a bounded number at a time; the store part is
read a page at a time through the store hooks (`read_paged`), never the whole
queue.  Messages held by a consumer (acquired, not settled) are not waiting: they
are never listed or moved here.

Taking an entry out of the paged region (`take_waiting`) removes it from the store
in this loop turn's batch.  Until that batch commits, the store's committed view
(which page-in reads) still holds it: its sequence stays in `_paged_gone`, which
page-in and purges skip, so the entry can never come back as a live one.
"""

from __future__ import annotations

import heapq
from operator import attrgetter
from typing import Any

from .entries import Entry
from .message import Message

READY = "ready"
SCHEDULED = "scheduled"
PAGED = "paged"

_seq = attrgetter("seq")


class WaitingEntries:
    """Queue's browsing and moving of waiting entries: mixed into Queue (core/queues.py)."""

    __slots__ = ()

    _ready: Any
    _delayed: list
    _pending_page: dict
    _paged_gone: set
    paged_count: int
    paged_bytes: int
    page_cursor: int
    bytes: int
    hooks: Any

    def waiting_after(self, cursor: int, n: int, *, scheduled: bool = False) -> list[tuple[Entry, str]]:
        """Up to `n` (entry, state) with a sequence above `cursor`, in sequence order:
        ready ones, scheduled ones too when asked, and the paged region's.  Entries of
        the paged region read from the store are new objects (the queue holds none)."""
        parts = [[(e, READY) for e in self._ready.after(cursor, n)]]
        if scheduled and self._delayed:
            later = heapq.nsmallest(n, (e for _, _, e in self._delayed if e.seq > cursor), key=_seq)
            parts.append([(e, SCHEDULED) for e in later])
        if self.paged_count:
            parts.append([(e, PAGED) for e in self._paged_after(cursor, n)])
        if len(parts) == 1:
            return parts[0]
        return list(heapq.merge(*parts, key=lambda pair: pair[0].seq))[:n]

    def _paged_after(self, cursor: int, n: int) -> list[Entry]:
        """The paged region's next `n` entries after `cursor`: the store's (a page at a
        time, past those moved away whose removal is on its way) and the pending ones."""
        after = max(cursor, self.page_cursor)
        gone = self._paged_gone
        found: dict[int, Entry] = {}
        if self.paged_count > len(self._pending_page) and self.hooks is not None:
            read_after = after
            while True:
                page = self.hooks.read_paged(self, read_after, n)
                found.update((e.seq, e) for e in page if e.seq not in gone)
                if len(found) >= n or len(page) < n:
                    break
                read_after = page[-1].seq
        for seq, entry in self._pending_page.items():   # insertion order is sequence order
            if seq > after and seq not in gone:
                found[seq] = entry    # the queue's own object, whether committed yet or not
        return [found[s] for s in sorted(found)][:n]

    def peek_body(self, entry: Entry) -> Message | None:
        """The entry's message without changing the entry (a paged one is read from the
        store and not kept); None when it cannot be read back."""
        if entry.msg is not None:
            return entry.msg
        try:
            return self.hooks.load_body(entry)
        except Exception:   # the store's and the parser's errors: the caller skips it
            return None

    def take_waiting(self, entry: Entry, state: str) -> bool:
        """Remove a waiting entry (its message has gone elsewhere): from the ready list,
        the scheduled heap or the paged region, with its store records, in this loop
        turn's store batch.  False when it is no longer waiting there."""
        if state == READY:
            if entry.consumer is not None or entry not in self._ready:
                return False
            self._ready.remove(entry)
        elif state == SCHEDULED:
            if not any(e is entry for _, _, e in self._delayed):
                return False
            self._delayed = [d for d in self._delayed if d[2] is not entry]
            heapq.heapify(self._delayed)
        elif self._pending_page.get(entry.seq) is entry:
            del self._pending_page[entry.seq]
            self._leave_paged(entry)
        else:
            if entry.seq <= self.page_cursor or entry.seq in self._paged_gone or not self.paged_count:
                return False
            self._leave_paged(entry)
            self.bytes -= entry.size
            self.hooks.remove_paged(self, entry)
            self._room_check()
            return True
        self._drop(entry)
        return True

    def _leave_paged(self, entry: Entry) -> None:
        self.paged_count -= 1
        self.paged_bytes -= entry.size
        self._paged_gone.add(entry.seq)
        if self.hooks is not None:
            self.hooks.forget_gone(self, entry.seq)

    def gone_committed(self, seq: int, error: BaseException | None = None) -> None:
        """The store batch that removed paged entry `seq` is settled: the store's
        committed view no longer has it (or, after a failed batch, the removal was
        still written: store/batch.py fail keeps removals)."""
        self._paged_gone.discard(seq)
