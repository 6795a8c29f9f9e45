"""Queues: ordered entries, consumers, credit-aware round-robin dispatch, outcomes.

Pure model: no sockets, no proton.  The I/O layer implements `ConsumerPort` for a
sending link and calls `settle()` with the outcome the peer chose.

Ordering: entries wait in a ReadyList (core/entries.py): per priority, by sequence,
so redeliveries keep their original order.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from typing import Any, Callable

from .entries import PRIORITY_LEVELS, ConsumerPort, Entry, ReadyList
from .policies import ExclusivityPolicy, LifetimePolicy
from .message import Message
from .settlement import LateAction, Outcome, Place, late_outcome

log = logging.getLogger("amqpbroker.queue")

__all__ = ["ConsumerPort", "Entry", "ExclusivityPolicy", "LifetimePolicy", "Outcome", "Queue",
           "ReadyList", "PRIORITY_LEVELS"]


class Queue:
    page_in_low = 1000       # page in when fewer entries than this are ready in memory
    page_in_batch = 2000     # entries per page-in (and the window built at recovery)

    def __init__(
        self,
        name: str,
        *,
        durable: bool = False,
        exclusivity: ExclusivityPolicy = ExclusivityPolicy.NONE,
        lifetime: LifetimePolicy = LifetimePolicy.PERMANENT,
        max_delivery_attempts: int = 0,
        max_consumers: int = 0,
        dead_letter: Callable[[Entry, str], None] | None = None,
        clock: Callable[[], float] = time.time,
        owner: Any = None,
    ):
        self.name = name
        self.durable = durable
        self.exclusivity = exclusivity
        self.lifetime = lifetime
        self.max_delivery_attempts = max_delivery_attempts
        self.max_consumers = max_consumers
        self.dead_letter = dead_letter
        self.clock = clock
        self.owner = owner          # session/connection the lifetime is tied to
        self.deleted = False
        self.consumers: list[ConsumerPort] = []
        self._browsers = 0
        self._ready = ReadyList()
        self._delayed: list[tuple[float, int, Entry]] = []
        self._groups: dict[str, ConsumerPort] = {}
        self._seq = itertools.count(1)
        self._rr = 0
        self._dispatching = False
        self._again = False
        # Statistics (management API, metrics).
        self.acquired = 0
        self.bytes = 0
        self.enqueued_total = 0
        self.delivered_total = 0
        self.acked_total = 0
        self.expired_total = 0
        self.dead_lettered_total = 0
        self.unreadable_total = 0
        self.created_at = clock()
        self.last_delivered_at: float | None = None
        self.last_consumer_at: float | None = None
        # Bounded memory: beyond `memory_budget` bytes of loaded bodies, durable
        # entries drop their body once stored and `loader` reads it back on dispatch.
        self.memory_budget = 0
        self.mem_bytes = 0
        self.loader: Callable[[Entry], Message] | None = None
        self.on_page_out: Callable[[Entry], None] | None = None
        # The paged region: once over the budget, new persistent entries are not kept
        # in memory at all.  They live only in the store, after `page_cursor` (the last
        # sequence moved into memory), FIFO by sequence whatever their priority, and are
        # read back `page_in_batch` at a time when fewer than `page_in_low` are ready.
        # Until its store commit an entry waits in `_pending_page` (seq -> Entry);
        # `on_page_out(entry)` arranges `page_committed(seq, error)` after the commit.
        # Non-persistent messages are never paged: they may overtake paged ones.
        # Browsers, selectors, TTL sweeps and scheduled delivery see the in-memory
        # window only (a paged entry expires, or waits for its time, once paged in).
        self.paged_count = 0
        self.paged_bytes = 0
        self.page_cursor = 0
        self._pending_page: dict[int, Entry] = {}
        self.page_reader: Callable[[int, int], list[Entry]] | None = None
        # drop_paged(after, below, skip) removes store-only entries after `after` (and
        # below `below`; None: all) except the sequences in `skip`: (count, bytes).
        self.drop_paged: Callable[[int, int | None, set[int]], tuple[int, int]] | None = None
        # Durability hooks, set by the store layer on durable queues.
        self.store_id: int | None = None
        self.on_enqueue: Callable[[Entry], None] | None = None
        self.on_remove: Callable[[Entry], None] | None = None
        self.on_deliver: Callable[[Entry], None] | None = None
        self.on_return: Callable[[Entry], None] | None = None

    # ------------------------------------------------------------------ counts

    @property
    def depth(self) -> int:
        """Messages held: ready (in memory or paged), scheduled and acquired-but-unsettled."""
        return len(self._ready) + len(self._delayed) + self.acquired + self.paged_count

    def congested(self, high_water: int, active_within: float = 1.0) -> bool:
        """Consumers are taking messages (one in the last `active_within` seconds)
        and still more than `high_water` wait: the producers outrun them.  Idle or
        absent consumers never make a queue congested (a backlog for later is fine)."""
        if len(self._ready) + self.paged_count <= high_water or not self.consumers:
            return False
        last = self.last_delivered_at
        return last is not None and self.clock() - last < active_within

    @property
    def ready_count(self) -> int:
        return len(self._ready) + self.paged_count

    def next_seq(self) -> int:
        return next(self._seq)

    def reset_seq(self, start: int) -> None:
        """Continue numbering at `start` (recovery: sequences never go back)."""
        self._seq = itertools.count(start)

    # ------------------------------------------------------------------ enqueue

    def enqueue(self, msg: Message, seq: int | None = None) -> Entry:
        entry = Entry(msg, self.next_seq() if seq is None else seq)
        self.bytes += msg.size
        self.mem_bytes += msg.size
        self.enqueued_total += 1
        if self.on_enqueue is not None:
            self.on_enqueue(entry)
            if (self.memory_budget and entry.store_ref is not None and self.on_page_out is not None
                    and (self.paged_count or self.mem_bytes > self.memory_budget)):
                self._page(entry)
                self.dispatch()
                return entry
        if entry.deliver_at is not None and entry.deliver_at > self.clock():
            heapq.heappush(self._delayed, (entry.deliver_at, entry.seq, entry))
        else:
            self._ready.push(entry)
            self.dispatch()
        return entry

    def restore(self, entry: Entry) -> None:
        """Put back an entry rebuilt by the store at start-up (no store hook)."""
        self.bytes += entry.size
        if entry.msg is not None:
            self.mem_bytes += entry.size
        if entry.deliver_at is not None and entry.deliver_at > self.clock():
            heapq.heappush(self._delayed, (entry.deliver_at, entry.seq, entry))
        else:
            self._ready.push(entry)

    def restore_paged(self, cursor: int, count: int, size: int) -> None:
        """Recovery: `count` stored entries (`size` bytes) after sequence `cursor` stay
        in the store only (the paged region)."""
        self.page_cursor = cursor
        self.paged_count += count
        self.paged_bytes += size
        self.bytes += size

    # ------------------------------------------------------------------ paging

    def _page(self, entry: Entry) -> None:
        """Put a new stored entry in the paged region: held until its commit, then gone
        from memory (the body's bytes stay in `mem_bytes` until then)."""
        if not self.paged_count:
            self.page_cursor = entry.seq - 1   # every stored entry after it is paged
        self._pending_page[entry.seq] = entry
        self.paged_count += 1
        self.paged_bytes += entry.size
        self.on_page_out(entry)

    def page_committed(self, seq: int, error: BaseException | None = None) -> None:
        """The store committed a paged entry: forget it (unless paged in meanwhile).
        After a failed commit it stays pending (lost entries are discarded first)."""
        if error is None:
            entry = self._pending_page.pop(seq, None)
            if entry is not None and entry.msg is not None:
                self.mem_bytes -= entry.size

    def _page_in(self) -> int:
        """Move the next entries of the paged region into memory, in sequence order
        (`page_reader` reads bodies while the budget has room; `_load` reads the rest
        on dispatch).  Committed ones come from the store;
        one still pending is taken as it is, and so are entries whose commit is in
        flight once the store has nothing more."""
        pending = self._pending_page
        want = self.page_in_batch
        entries: list[Entry] = []
        if self.paged_count > len(pending) and self.page_reader is not None:
            entries = self.page_reader(self.page_cursor, want)
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
        for entry in entries:
            held = pending.pop(entry.seq, None)
            if held is not None:
                entry = held           # its body is counted in mem_bytes already
            elif entry.msg is not None:
                self.mem_bytes += entry.size
            self.paged_count -= 1
            self.paged_bytes -= entry.size
            self.page_cursor = entry.seq
            if entry.expires_at is not None and entry.expires_at <= now:
                self._expire(entry)
            elif entry.deliver_at is not None and entry.deliver_at > now:
                heapq.heappush(self._delayed, (entry.deliver_at, entry.seq, entry))
            else:
                self._ready.push(entry)
        return len(entries)

    def _drop_paged(self, below: int | None = None, *, acked: bool = False) -> int:
        """Remove the paged entries (all, or those with a sequence below `below`):
        pending ones like any entry, store-only ones through `drop_paged`."""
        if not self.paged_count or (below is not None and below <= self.page_cursor + 1):
            return 0
        pending = self._pending_page
        store_only = self.paged_count - len(pending)
        gone = [e for s, e in pending.items() if below is None or s < below]
        for entry in gone:
            del pending[entry.seq]
        n = size = 0
        if store_only and self.drop_paged is not None:
            n, size = self.drop_paged(self.page_cursor, below, {e.seq for e in gone})
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

    def next_wakeup(self) -> float | None:
        return self._delayed[0][0] if self._delayed else None

    def promote_due(self, now: float) -> int:
        """Move scheduled entries whose delivery time has come to the ready list."""
        moved = 0
        while self._delayed and self._delayed[0][0] <= now:
            _, _, entry = heapq.heappop(self._delayed)
            self._ready.push(entry)
            moved += 1
        if moved:
            self.dispatch()
        return moved

    # ------------------------------------------------------------------ consumers

    @property
    def browsers(self) -> int:
        return self._browsers

    def add_consumer(self, consumer: ConsumerPort) -> None:
        self.consumers.append(consumer)
        if consumer.browser:
            self._browsers += 1
        self.last_consumer_at = self.clock()
        self.dispatch()

    def remove_consumer(self, consumer: ConsumerPort, unsettled: list[Entry], *,
                        failed: bool) -> None:
        """The consumer's link ended; its unsettled entries come back in order, with
        delivery-count + 1 only when `failed` (core/settlement.py: a lost connection;
        a normal detach, end or close returns them released)."""
        try:
            self.consumers.remove(consumer)
            if consumer.browser:
                self._browsers -= 1
        except ValueError:
            pass
        self.last_consumer_at = self.clock()
        for group, owner in list(self._groups.items()):
            if owner is consumer:
                del self._groups[group]
        for entry in sorted(unsettled, key=lambda e: e.seq):
            if entry.consumer is consumer:
                self._return(entry, delivery_failed=failed)
        if self.consumers:
            self.dispatch()

    # ------------------------------------------------------------------ dispatch

    def dispatch(self) -> None:
        """Hand ready entries to consumers with credit, round-robin."""
        if self._dispatching:
            self._again = True
            return
        self._dispatching = True
        try:
            while True:
                self._again = False
                self._dispatch_round()
                if not self._again:
                    break
        finally:
            self._dispatching = False

    def _dispatch_round(self) -> None:
        consumers = self.consumers
        if self.paged_count and consumers and len(self._ready) < self.page_in_low:
            self._page_in()
        if self.browsers:
            self._browse()
        while (self._ready or self.paged_count) and consumers:
            if self.paged_count and len(self._ready) < self.page_in_low:
                if not self._page_in() and not self._ready:
                    return
                if not self._ready:
                    continue   # that batch expired or is scheduled: the next one
            n = len(consumers)
            start = self._rr % n
            for i in range(n):
                consumer = consumers[(start + i) % n]
                if consumer.browser or consumer.credit() <= 0:
                    continue
                entry = self._take_for(consumer)
                if entry is None:
                    continue
                self._rr = start + i + 1
                self._hand_over(entry, consumer)
                break
            else:
                return

    def _browse(self) -> None:
        """Browsers (distribution-mode copy, AMQP 1.0 §3.5.3) see ready entries in
        order, each once, without acquiring them."""
        for consumer in self.consumers:
            if not consumer.browser:
                continue
            credit = consumer.credit()
            if credit <= 0:
                continue
            cursor = consumer.browse_cursor
            fresh = sorted((e for e in self._ready if e.seq > cursor), key=lambda e: e.seq)
            for entry in fresh:
                if credit <= 0:
                    break
                consumer.browse_cursor = entry.seq
                if entry.msg is None and not self._load(entry):
                    continue
                if consumer.filtered and not consumer.accepts(entry):
                    continue
                consumer.deliver_copy(entry)
                credit -= 1

    def _take_for(self, consumer: ConsumerPort) -> Entry | None:
        now = self.clock()
        if not consumer.filtered and not self._groups:
            while True:
                entry = self._ready.pop_first()
                if entry is None:
                    return None
                if entry.expires_at is not None and entry.expires_at <= now:
                    self._expire(entry)
                    continue
                if entry.excluded is None and not self._group_elsewhere(entry, consumer):
                    return entry
                self._ready.push(entry)
                break
        for entry in self._ready:
            if entry.expires_at is not None and entry.expires_at <= now:
                self._ready.remove(entry)
                self._expire(entry)
                continue
            if entry.excluded is not None and consumer.consumer_id in entry.excluded:
                continue
            if self._group_elsewhere(entry, consumer):
                continue
            if entry.msg is None and not self._load(entry):
                continue
            if not consumer.accepts(entry):
                continue
            self._ready.remove(entry)
            return entry
        return None

    def _group_elsewhere(self, entry: Entry, consumer: ConsumerPort) -> bool:
        """Message groups (JMSXGroupID): a group sticks to one consumer while it
        lives.  True when the entry's group belongs to a different consumer."""
        group = entry.group
        if group is None:
            return False
        owner = self._groups.get(group)
        return owner is not None and owner is not consumer

    def _load(self, entry: Entry) -> bool:
        """Read a paged entry's body back.  A body that cannot be read or parsed (a
        damaged store, a message stored before the broker checked it at the edge)
        must not stop the queue: the entry is dropped, loudly, and False returned."""
        if entry.msg is not None:
            return True
        try:
            entry.msg = self.loader(entry)
        except Exception as exc:  # the loader's errors are the store's and the parser's
            log.error("queue %s: message seq=%d cannot be read back (%s: %s); dropped",
                      self.name, entry.seq, type(exc).__name__, exc)
            self.unreadable_total += 1
            if entry in self._ready:
                self._ready.remove(entry)
            self._drop(entry)
            return False
        self.mem_bytes += entry.size
        return True

    def _hand_over(self, entry: Entry, consumer: ConsumerPort) -> None:
        if entry.msg is None and not self._load(entry):
            return
        entry.consumer = consumer
        if entry.group is not None:
            self._groups.setdefault(entry.group, consumer)
        self.acquired += 1
        self.delivered_total += 1
        self.last_delivered_at = self.clock()
        if entry.store_ref is not None and self.on_deliver is not None:
            self.on_deliver(entry)
        consumer.deliver(entry)

    # ------------------------------------------------------------------ outcomes

    def settle(self, entry: Entry, outcome: Outcome, *, delivery_failed: bool = False,
               undeliverable_here: bool = False) -> None:
        """Apply the consumer's outcome (AMQP 1.0 §3.4) to an acquired entry."""
        if entry.consumer is None:
            return  # already settled (e.g. link closed first)
        if outcome is Outcome.ACCEPTED:
            self._release_hold(entry)
            self.acked_total += 1
            self._drop(entry)
        elif outcome is Outcome.REJECTED:
            self._release_hold(entry)
            self._dead_letter(entry, "rejected")
        else:
            if outcome is Outcome.MODIFIED and undeliverable_here:
                if entry.excluded is None:
                    entry.excluded = set()
                entry.excluded.add(entry.consumer.consumer_id)
            self._return(entry, delivery_failed=(outcome is Outcome.MODIFIED and delivery_failed))
        self.dispatch()

    def settle_late(self, entry: Entry, outcome: Outcome, *, delivery_failed: bool = False) -> LateAction:
        """An outcome for an entry that went back when its consumer's link ended
        (core/settlement.py: late outcomes)."""
        action = late_outcome(outcome, delivery_failed, self._place(entry))
        if action is LateAction.COUNT:
            self._count_late_failure(entry)
        elif action is LateAction.CONSUME:
            self._ready.remove(entry)
            self.acked_total += 1
            self._drop(entry)
        elif action is LateAction.DEAD_LETTER:
            self._ready.remove(entry)
            self._dead_letter(entry, "rejected")
        return action

    def _place(self, entry: Entry) -> Place:
        if self.deleted:
            return Place.GONE
        if entry.consumer is not None:
            return Place.ACQUIRED
        return Place.WAITING if entry in self._ready else Place.GONE

    def _count_late_failure(self, entry: Entry) -> None:
        entry.delivery_count += 1
        held = entry.consumer is not None
        if (not held and self.max_delivery_attempts
                and entry.delivery_count >= self.max_delivery_attempts):
            self._ready.remove(entry)
            self._dead_letter(entry, f"delivery attempts reached {self.max_delivery_attempts}")
            return
        hook = self.on_deliver if held else self.on_return
        if entry.store_ref is not None and hook is not None:
            hook(entry)

    def _release_hold(self, entry: Entry) -> None:
        entry.consumer = None
        self.acquired -= 1

    def _return(self, entry: Entry, *, delivery_failed: bool) -> None:
        self._release_hold(entry)
        if delivery_failed:
            entry.delivery_count += 1
            if self.max_delivery_attempts and entry.delivery_count >= self.max_delivery_attempts:
                self._dead_letter(entry, f"delivery attempts reached {self.max_delivery_attempts}")
                return
        if entry.store_ref is not None and self.on_return is not None:
            self.on_return(entry)
        self._ready.push(entry)

    def _expire(self, entry: Entry) -> None:
        self.expired_total += 1
        self._drop(entry)

    def _dead_letter(self, entry: Entry, reason: str) -> None:
        self.dead_lettered_total += 1
        if self.dead_letter is not None:
            self.dead_letter(entry, reason)
        else:
            log.info("queue %s: dropped message seq=%d (%s; no dead-letter address)",
                     self.name, entry.seq, reason)
        self._drop(entry)

    def _drop(self, entry: Entry) -> None:
        self.bytes -= entry.size
        if entry.msg is not None:
            self.mem_bytes -= entry.size
        if self.on_remove is not None:
            self.on_remove(entry)

    # ------------------------------------------------------------------ admin

    def purge(self) -> int:
        """Remove every ready, scheduled and paged entry (acquired ones stay with their consumers)."""
        removed = self._ready.clear() + [e for _, _, e in self._delayed]
        self._delayed.clear()
        for entry in removed:
            self._drop(entry)
        return len(removed) + self._drop_paged()

    def discard(self, seqs: set[int]) -> int:
        """Remove the waiting (ready or scheduled) entries with these sequence numbers:
        the store could not keep them and their producers are told so."""
        removed = [e for e in self._ready if e.seq in seqs]
        for entry in removed:
            self._ready.remove(entry)
        if self._delayed:
            later = [e for _, s, e in self._delayed if s in seqs]
            if later:
                self._delayed = [d for d in self._delayed if d[1] not in seqs]
                heapq.heapify(self._delayed)
                removed += later
        for seq in seqs:   # not stored: still pending in the paged region
            entry = self._pending_page.pop(seq, None)
            if entry is not None:
                self.paged_count -= 1
                self.paged_bytes -= entry.size
                removed.append(entry)
        for entry in removed:
            self._drop(entry)
        return len(removed)

    def remove_below(self, seq: int) -> int:
        """Acknowledge by sequence (a log reader's `ack-below`): remove every ready
        and scheduled entry with a sequence number below `seq`.  Entries acquired by
        a consumer stay with it.  The durability hook deletes their store entries."""
        removed = []
        for level in self._ready._levels:
            while level and level[0].seq < seq:
                removed.append(level.popleft())
        self._ready._count -= len(removed)
        if any(e.seq < seq for _, _, e in self._delayed):
            removed += [e for _, _, e in self._delayed if e.seq < seq]
            self._delayed = [d for d in self._delayed if d[2].seq >= seq]
            heapq.heapify(self._delayed)
        for entry in sorted(removed, key=lambda e: e.seq):
            self.acked_total += 1
            self._drop(entry)
        return len(removed) + self._drop_paged(seq, acked=True)

    def entries(self) -> list[Entry]:
        """Ready entries in delivery order (browsing, management)."""
        return list(self._ready)

    def expire_sweep(self, now: float) -> int:
        expired = [e for e in self._ready if e.expires_at is not None and e.expires_at <= now]
        for entry in expired:
            self._ready.remove(entry)
            self._expire(entry)
        return len(expired)
