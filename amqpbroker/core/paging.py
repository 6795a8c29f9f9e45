"""The paged region of a durable queue (a part of `Queue`, in a file of its own).

Bounded memory: once a durable queue holds more than its `memory_budget` of message
bodies, new persistent entries are not kept in memory at all.  They live only in the
store, after `page_cursor` (the last sequence moved into memory), FIFO by sequence
whatever their priority, and are read back `page_in_batch` at a time when fewer than
`page_in_low` are ready.  Until its store commit an entry waits in `_pending_page`
(seq -> Entry); `hooks.page_out(queue, entry)` arranges `page_committed(seq, error)` after the
commit.  Non-persistent messages are never paged: they may overtake paged ones.
Browsers, selectors, TTL sweeps and scheduled delivery see the in-memory window only
(a paged entry expires, or waits for its time, once paged in).

The attributes are Queue's (created in `Queue.__init__`); the store layer sets the
hooks (`Queue.hooks`: core/entries.py StoreHooks).
"""

from __future__ import annotations

import logging
from typing import Any

from .budget import ENTRY_COST, entry_bytes, page_in_count, page_in_low
from .entries import Entry

log = logging.getLogger("amqpbroker.queue")


class PagedRegion:
    """Queue's paging: mixed into Queue (core/queues.py)."""

    __slots__ = ()

    name: str
    consumers: list
    _ready: Any
    _delayed: list
    _pending_page: dict
    _paged_gone: set
    page_in_batch: int
    paged_count: int
    paged_bytes: int
    page_cursor: int
    mem_bytes: int
    bytes: int
    acked_total: int
    hooks: Any
    budget: Any
    in_log: bool
    _schedule: Any
    _forget_memory: Any

    def restore_paged(self, cursor: int, count: int, size: int) -> None:
        """Recovery: `count` stored entries (`size` bytes) after sequence `cursor` stay
        in the store only (the paged region)."""
        self.page_cursor = cursor
        self.paged_count += count
        self.paged_bytes += size
        self.bytes += size

    def _page(self, entry: Entry) -> None:
        """Put a new stored entry in the paged region: held until its commit, then gone
        from memory (the body's bytes stay in `mem_bytes` until then).  A topic log
        member's entry goes at once: the log holds its record until the commit."""
        if self.in_log:
            self._forget_memory(entry)
            self.page_log(entry.seq, entry.size)
            return
        if not self.paged_count:
            self.page_cursor = entry.seq - 1   # every stored entry after it is paged
        self._pending_page[entry.seq] = entry
        self.paged_count += 1
        self.paged_bytes += entry.size
        self.hooks.page_out(self, entry)

    def page_log(self, seq: int, size: int) -> None:
        """A topic log member (store/topiclog.py): position `seq` of `size` bytes joins
        the paged region without any object (the caller counted it in `bytes`)."""
        if not self.paged_count:
            self.page_cursor = seq - 1
        self.paged_count += 1
        self.paged_bytes += size
        if self.consumers:
            self.dispatch()

    def forget_paged(self, size: int) -> None:
        """A position of a topic log member's paged region was not stored after all
        (a failed batch; its producer is told so)."""
        self.paged_count -= 1
        self.paged_bytes -= size
        self.bytes -= size

    def page_committed(self, seq: int, error: BaseException | None = None) -> None:
        """The store committed a paged entry: forget it (unless paged in meanwhile).
        After a failed commit it stays pending (lost entries are discarded first)."""
        if error is None:
            entry = self._pending_page.pop(seq, None)
            if entry is not None:
                self._forget_memory(entry)

    def _page_low(self) -> int:
        """Below how many ready entries the paged region is read (core/budget.py: what
        the consumers ask for, less as the broker's budget runs out)."""
        budget = self.budget
        if budget is None or not budget.limit:
            return self.page_in_low
        demand = self._demand()
        if not demand:
            return 0
        return page_in_low(self.page_in_low, budget.room(), entry_bytes(self.paged_bytes, self.paged_count),
                           demand)

    def _demand(self) -> int:
        """What the queue's consumers (browsers too) may take now: their credit."""
        consumers = self.consumers
        if len(consumers) == 1:
            return max(0, consumers[0].credit())
        return sum(max(0, c.credit()) for c in consumers)

    def _page_in(self) -> int:
        """Move the next entries of the paged region into memory, in sequence order
        (`hooks.read_paged` reads bodies while the budget has room; `_load` reads the rest
        on dispatch).  Committed ones come from the store;
        one still pending is taken as it is, and so are entries whose commit is in
        flight once the store has nothing more."""
        pending = self._pending_page
        want = self.page_in_batch
        budget = self.budget
        if budget is not None and budget.limit:   # what the consumers ask for, the budget's room
            want = page_in_count(want, budget.room(), entry_bytes(self.paged_bytes, self.paged_count),
                                 self._demand())
        entries: list[Entry] = []
        if self.paged_count > len(pending) and self.hooks is not None:
            entries = self.hooks.read_paged(self, self.page_cursor, want)
        if len(entries) < want and pending:
            last = entries[-1].seq if entries else self.page_cursor
            for s, e in pending.items():   # insertion order is sequence order
                if s > last:
                    entries.append(e)
                    if len(entries) >= want:
                        break
        if not entries:
            if not pending:   # nothing left to read: the count was off
                log.warning("queue %s: %d paged entr(y/ies) not found in the store", self.name, self.paged_count)
                self.bytes -= self.paged_bytes
                self.paged_count = self.paged_bytes = 0
            return 0
        now = self.clock()
        gone = self._paged_gone
        budget = self.budget
        for entry in entries:
            if entry.seq in gone:   # moved away, its removal not committed yet (core/waiting.py)
                self.page_cursor = max(self.page_cursor, entry.seq)
                continue
            held = pending.pop(entry.seq, None)
            if held is not None:
                entry = held           # its body is counted in mem_bytes already
            else:
                cost = ENTRY_COST
                if entry.msg is not None:
                    self.mem_bytes += entry.size
                    cost += entry.size
                if budget is not None:
                    budget.used += cost
            self.paged_count -= 1
            self.paged_bytes -= entry.size
            self.page_cursor = entry.seq
            if entry.expires_at is not None and entry.expires_at <= now:
                self._expire(entry)
            elif entry.deliver_at is not None and entry.deliver_at > now:
                self._schedule(entry)
            else:
                self._ready.push(entry)
        return len(entries)

    def _drop_paged(self, below: int | None = None, *, acked: bool = False) -> int:
        """Remove the paged entries (all, or those with a sequence below `below`):
        pending ones like any entry, store-only ones through `hooks.drop_paged`."""
        if not self.paged_count or (below is not None and below <= self.page_cursor + 1):
            return 0
        pending = self._pending_page
        store_only = self.paged_count - len(pending)
        gone = [e for s, e in pending.items() if below is None or s < below]
        for entry in gone:
            del pending[entry.seq]
        n = size = 0
        if store_only and self.hooks is not None:
            n, size = self.hooks.drop_paged(self, self.page_cursor, below,
                                            {e.seq for e in gone} | self._paged_gone)
        self.paged_count -= n + len(gone)
        self.paged_bytes -= size + sum(e.size for e in gone)
        self.bytes -= size
        if below is None:
            self.bytes -= self.paged_bytes   # whatever the store no longer had
            self.paged_count = self.paged_bytes = 0
        elif below - 1 > self.page_cursor:
            self.page_cursor = below - 1
        for entry in gone:
            if acked:
                self.acked_total += 1
            self._drop(entry)
        if acked:
            self.acked_total += n
        return n + len(gone)
