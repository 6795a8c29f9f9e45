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

from .budget import ENTRY_COST, MemoryBudget, pages_new
from .entries import PRIORITY_LEVELS, ConsumerPort, Entry, ReadyList, StoreHooks
from .browsers import QueueBrowsers
from .limits import LimitedQueue, QueueLimits
from .policies import ExclusivityPolicy, LifetimePolicy
from .message import Message
from .paging import PagedRegion
from .picking import EntryPicking
from .waiting import WaitingEntries
from .settlement import LateAction, Outcome, Place, late_outcome

log = logging.getLogger("amqpbroker.queue")

__all__ = ["ConsumerPort", "Entry", "ExclusivityPolicy", "LifetimePolicy", "Outcome", "Queue",
           "ReadyList", "PRIORITY_LEVELS"]


PAGE_IN_LOW = 1000       # page in when fewer entries than this are ready in memory
PAGE_IN_BATCH = 2000     # entries per page-in (and the window built at recovery)

# Hand-overs, and message bytes, per dispatch call before the rest waits for the next
# loop turn (the bytes bound what one turn puts in a connection's output at once).
DISPATCH_SLICE = 256
DISPATCH_SLICE_BYTES = 4 << 20
# Entries a dispatch call may examine without handing them over (a selector or a
# message group says no, a browser's selector skips them) before the rest waits for
# the next loop turn; scans go through a level SCAN_CHUNK entries at a time.
SCAN_BUDGET = 4096

# Queue._offer's passes over the consumers: every one at once (None), or, with standby
# consumers, the others first (False) and then those (True).
_PASSES = ((None,), (False, True))


class Queue(PagedRegion, LimitedQueue, WaitingEntries, QueueBrowsers, EntryPicking):
    # Slots, not a __dict__: 50,000 idle queues must stay small (≤ 2 KB each).
    __slots__ = (
        "_again", "_browsers", "_deferred", "_delayed", "_dispatching", "_groups", "_paged_gone", "_pending_page",
        "_ready", "_rr", "_scan", "_seq", "_slice", "_slice_bytes", "acked_total", "acquired", "budget", "bytes",
        "clock", "consumers", "created_at", "creator", "dead_letter", "dead_lettered_total", "defer",
        "deleted", "delivered_total", "durable", "enqueued_total", "exclusivity", "expired_total", "in_log",
        "_room", "hooks", "last_consumer_at", "last_delivered_at", "lifetime", "limits", "declared_limits", "max_consumers",
        "max_delivery_attempts", "mem_bytes", "memory_budget", "name", "overflow_dropped_total",
        "overflow_rejected_total", "owner", "page_cursor",
        "page_in_batch", "page_in_low", "paged_bytes", "paged_count", "store_id", "timers", "unreadable_total",
        "_standby",
    )

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
        self.page_in_low = PAGE_IN_LOW
        self.page_in_batch = PAGE_IN_BATCH
        self.durable = durable
        self.exclusivity = exclusivity
        self.lifetime = lifetime
        self.max_delivery_attempts = max_delivery_attempts
        self.max_consumers = max_consumers
        self.dead_letter = dead_letter
        self.clock = clock
        self.owner = owner          # session/connection the lifetime is tied to
        self.creator: str | None = None   # the user whose address created it (Broker.auto_create)
        self.deleted = False
        self.consumers: list[ConsumerPort] = []
        self._browsers = 0
        self._standby = 0   # consumers that are a second choice (ConsumerPort.standby)
        self._ready = ReadyList()
        self._delayed: list[tuple[float, int, Entry]] = []
        self._groups: dict[str, ConsumerPort] = {}
        self._seq = itertools.count(1)
        self._rr = 0
        self._dispatching = False
        self._again = False
        # Bounded dispatch: `defer(fn)` runs fn at the next loop turn (the server sets
        # it: loop.call_soon); None (pure use, tests) dispatches without slices.
        self.defer: Callable[[Callable[[], None]], Any] | None = None
        self.timers: set | None = None   # the broker's queues with scheduled entries
        self._slice = -1
        self._slice_bytes = 0
        self._scan = -1               # entries this dispatch call may still examine (-1: no bound)
        self._deferred = False
        # Statistics (management API, metrics).
        self.acquired = 0
        self.bytes = 0
        self.enqueued_total = 0
        self.delivered_total = 0
        self.acked_total = 0
        self.expired_total = 0
        self.dead_lettered_total = 0
        self.unreadable_total = 0
        # Limits and overflow (core/limits.py): None is no limit.  `_room` is called once
        # when a queue that blocked its producers has room again (the server tops them up).
        self.limits: QueueLimits | None = None
        self.declared_limits: QueueLimits | None = None   # given at declare (kept by the store)
        self._room: Callable[["Queue"], None] | None = None
        self.overflow_rejected_total = 0
        self.overflow_dropped_total = 0
        self.created_at = clock()
        self.last_delivered_at: float | None = None
        self.last_consumer_at: float | None = None
        # Bounded memory: beyond `memory_budget` bytes of loaded bodies, durable
        # entries drop their body once stored and `loader` reads it back on dispatch.
        self.memory_budget = 0
        self.mem_bytes = 0
        # The broker-wide budget (core/budget.py) this queue charges its in-memory
        # entries and bodies to (None: none).
        self.budget: MemoryBudget | None = None
        # A durable subscription queue stored in the topic log (store/topiclog.py):
        # its sequence numbers are log positions, its paged region is the log's.
        self.in_log = False

        # The paged region (core/paging.py): persistent entries beyond the budget
        # live only in the store, after `page_cursor`, until they are paged in.
        self.paged_count = 0
        self.paged_bytes = 0
        self.page_cursor = 0
        self._pending_page: dict[int, Entry] = {}
        self._paged_gone: set[int] = set()   # paged entries moved away, until that commit (core/waiting.py)
        # Durability hooks, set by the store layer on durable queues.
        self.store_id: int | None = None
        self.hooks: StoreHooks | None = None

    # ------------------------------------------------------------------ counts

    @property
    def depth(self) -> int:
        """Messages held: ready (in memory or paged), scheduled and acquired-but-unsettled."""
        return len(self._ready) + len(self._delayed) + self.acquired + self.paged_count


    @property
    def ready_count(self) -> int:
        return len(self._ready) + self.paged_count

    def lowest_ready_seq(self) -> int | None:
        """The lowest sequence ready, in memory or paged (None: none); how far a
        delivery is from the head (store/marks.py: delivery watermark)."""
        low = self._ready.lowest_seq()
        if self.paged_count and (low is None or self.page_cursor < low):
            low = self.page_cursor + 1
        return low

    def next_seq(self) -> int:
        return next(self._seq)

    def reset_seq(self, start: int) -> None:
        """Continue numbering at `start` (recovery: sequences never go back)."""
        self._seq = itertools.count(start)

    # ------------------------------------------------------------------ enqueue

    def enqueue(self, msg: Message, seq: int | None = None) -> Entry | None:
        """Queue a message (`seq`: its position, for a fan-out to topic log members).
        None when it went to the topic log's paged region without an entry at all."""
        size = msg.size
        if (seq is not None and self.in_log and msg.durable
                and pages_new(self.paged_count > 0, self.memory_budget, self.mem_bytes + size, self.budget)):
            self.enqueued_total += 1   # stored once for every member (store/topiclog.py): counts only
            self.bytes += size
            self.page_log(seq, size)
            return None
        entry = Entry(msg, self.next_seq() if seq is None else seq)
        self.bytes += size
        self.mem_bytes += size
        self.enqueued_total += 1
        budget = self.budget
        if budget is not None:
            budget.used += ENTRY_COST + size
        hooks = self.hooks
        if hooks is not None:
            hooks.entry_added(self, entry)
            if (entry.store_ref is not None
                    and pages_new(self.paged_count > 0, self.memory_budget, self.mem_bytes, budget)):
                self._page(entry)
                self.dispatch()
                return entry
        if entry.deliver_at is not None and entry.deliver_at > self.clock():
            self._schedule(entry)
        elif not self._hand_over_new(entry):
            self._ready.push(entry)
            self.dispatch()
        return entry

    def _hand_over_new(self, entry: Entry) -> bool:
        """The usual case of a queue keeping up (fan-out to subscriptions, a consumer
        with credit): nothing is waiting, so a new entry is the first in any order and
        goes straight to the next consumer in the round with credit, without the ready
        list or a dispatch round.  False, and nothing changed, whenever the general
        path has anything to decide: entries waiting, paging, browsers, groups, a
        consumer with a selector or no-local before one with credit, a dispatch
        already running or deferred."""
        consumers = self.consumers
        n = len(consumers)
        if (not n or self._ready.count or self.paged_count or self._browsers or self._groups
                or entry.group is not None or self._dispatching or self._deferred
                or (entry.expires_at is not None and entry.expires_at <= self.clock())):
            return False
        start = self._rr % n
        standby = self._standby   # those wait their turn: the general path offers them what is left
        for i in range(n):
            consumer = consumers[(start + i) % n]
            if consumer.filtered or consumer.browser:
                return False
            if standby and consumer.standby:
                continue
            if consumer.credit() > 0:
                self._rr = start + i + 1
                self._slice = self._slice_bytes = 1 << 30   # no slice to spend: one entry
                self._hand_over(entry, consumer)
                return True
        return False

    def restore(self, entry: Entry) -> None:
        """Put back an entry rebuilt by the store at start-up (no store hook)."""
        self.bytes += entry.size
        held = ENTRY_COST
        if entry.msg is not None:
            self.mem_bytes += entry.size
            held += entry.size
        if self.budget is not None:
            self.budget.used += held
        if entry.deliver_at is not None and entry.deliver_at > self.clock():
            self._schedule(entry)
        else:
            self._ready.push(entry)

    def _schedule(self, entry: Entry) -> None:
        """Hold an entry until its delivery time; the broker's set of queues with
        scheduled entries (`timers`) lets it find the next wake-up without visiting
        every queue."""
        heapq.heappush(self._delayed, (entry.deliver_at, entry.seq, entry))
        if self.timers is not None:
            self.timers.add(self)

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
        if getattr(consumer, "standby", False):
            self._standby += 1
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
            if getattr(consumer, "standby", False):
                self._standby -= 1
        except ValueError:
            pass
        self.last_consumer_at = self.clock()
        self._ready.forget(consumer.consumer_id)
        released = [group for group, owner in self._groups.items() if owner is consumer]
        for group in released:
            del self._groups[group]
        if released:
            self._ready.forget()   # entries refused as another consumer's group are free now
        # Newest first: the entries a consumer held are usually older than every one
        # still waiting, so each goes to the front of its level (appendleft) instead
        # of being searched into a deque, which costs O(n) per probe.
        for entry in sorted(unsettled, key=lambda e: e.seq, reverse=True):
            if entry.consumer is consumer:
                self._return(entry, delivery_failed=failed)
        if self.consumers:
            self.dispatch()

    # ------------------------------------------------------------------ dispatch

    def dispatch(self) -> None:
        """Hand ready entries to consumers with credit, round-robin; at most
        DISPATCH_SLICE of them per call when the queue can `defer` the rest to the
        next loop turn.  Every connection shares the loop: a credit of a million on a
        deep backlog must not be served in one go while the others wait (and the
        deliveries' store writes stay small batches)."""
        if self._dispatching:
            self._again = True
            return
        if self._deferred:
            return   # this turn's slice is used up: the deferred call goes on next turn
        self._dispatching = True
        self._slice = DISPATCH_SLICE if self.defer is not None else -1
        self._slice_bytes = DISPATCH_SLICE_BYTES
        self._scan = SCAN_BUDGET if self.defer is not None else -1
        try:
            while True:
                self._again = False
                self._dispatch_round()
                if self._slice == 0:
                    if not self._deferred:
                        self._deferred = True
                        self.defer(self._resume)
                    break
                if not self._again:
                    break
        finally:
            self._dispatching = False

    def _resume(self) -> None:
        self._deferred = False
        if not self.deleted:
            self.dispatch()

    def _dispatch_round(self) -> None:
        consumers = self.consumers
        if (self.paged_count and consumers and self._ready.count < self.page_in_low
                and self._ready.count < self._page_low()):
            self._page_in()
        if self.browsers:
            self._browse()
        while (self._ready.count or self.paged_count) and consumers and self._slice:
            if (self.paged_count and self._ready.count < self.page_in_low
                    and self._ready.count < self._page_low()):
                if not self._page_in() and not self._ready:
                    return
                if not self._ready:
                    continue   # that batch expired or is scheduled: the next one
            n = len(consumers)
            if n == 1 and not self._groups:
                only = consumers[0]
                if not (only.filtered or only.browser):
                    if not self._run_to(only):
                        return
                    continue
            if not self._offer(consumers, n):
                return

    def _offer(self, consumers: list[ConsumerPort], n: int) -> bool:
        """One entry to the next consumer in the round with credit that takes one;
        False when none did (or the scan budget is spent: the next loop turn goes
        on).  With standby consumers (ConsumerPort.standby: another node's consumer
        of a partitioned destination whose own node has a member, cluster/fanin.py),
        they are offered an entry only when none of the others takes it now (no
        credit, a selector), so that a message crosses between nodes only when it
        must."""
        start = self._rr % n
        for standby in _PASSES[self._standby > 0]:
            for i in range(n):
                consumer = consumers[(start + i) % n]
                if standby is not None and consumer.standby is not standby:
                    continue
                if consumer.browser or consumer.credit() <= 0:
                    continue
                entry = self._take_for(consumer)
                if entry is None:
                    if not self._slice:
                        return False
                    continue
                self._rr = start + i + 1
                self._hand_over(entry, consumer)
                return True
        return False

    def _load(self, entry: Entry) -> bool:
        """Read a paged entry's body back.  A body that cannot be read or parsed (a
        damaged store, a message stored before the broker checked it at the edge)
        must not stop the queue: the entry is dropped, loudly, and False returned."""
        if entry.msg is not None:
            return True
        try:
            entry.msg = self.hooks.load_body(entry)
        except Exception as exc:  # the loader's errors are the store's and the parser's
            log.error("queue %s: message seq=%d cannot be read back (%s: %s); dropped",
                      self.name, entry.seq, type(exc).__name__, exc)
            self.unreadable_total += 1
            if entry in self._ready:
                self._ready.remove(entry)
            self._drop(entry)
            return False
        self.mem_bytes += entry.size
        if self.budget is not None:
            self.budget.used += entry.size
        return True

    def _hand_over(self, entry: Entry, consumer: ConsumerPort) -> None:
        if entry.msg is None and not self._load(entry):
            return
        entry.consumer = consumer
        self._slice -= 1
        self._slice_bytes -= entry.size
        if self._slice_bytes <= 0 and self._slice > 0:
            self._slice = 0
        if entry.group is not None:
            self._groups.setdefault(entry.group, consumer)
        self.acquired += 1
        self.delivered_total += 1
        self.last_delivered_at = self.clock()
        if entry.store_ref is not None and self.hooks is not None:
            self.hooks.entry_updated(self, entry, True)
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
        if self._ready.count or self.paged_count:   # the settled one freed a consumer's slot
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
        if not held:
            self._ready.touch(entry)   # a selector may read JMSXDeliveryCount: scan it again
        if entry.store_ref is not None and self.hooks is not None:
            self.hooks.entry_updated(self, entry, held)

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
        if entry.store_ref is not None and self.hooks is not None:
            self.hooks.entry_updated(self, entry, False)
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
        self._forget_memory(entry)
        if self.hooks is not None:
            self.hooks.entry_removed(self, entry)
        if self._room is not None:
            self._room_check()

    def _forget_memory(self, entry: Entry) -> None:
        """An entry leaves memory: its body's bytes and its cost go back (core/budget.py)."""
        held = ENTRY_COST
        if entry.msg is not None:
            self.mem_bytes -= entry.size
            held += entry.size
        if self.budget is not None:
            self.budget.used -= held

    # ------------------------------------------------------------------ admin

    def purge(self) -> int:
        """Remove every ready, scheduled and paged entry (acquired ones stay with their consumers)."""
        removed = self._ready.clear() + [e for _, _, e in self._delayed]
        self._delayed.clear()
        for entry in removed:
            self._drop(entry)
        n = len(removed) + self._drop_paged()
        self._room_check()
        return n

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
        removed = self._ready.pop_below(seq)
        if any(e.seq < seq for _, _, e in self._delayed):
            removed += [e for _, _, e in self._delayed if e.seq < seq]
            self._delayed = [d for d in self._delayed if d[2].seq >= seq]
            heapq.heapify(self._delayed)
        for entry in sorted(removed, key=lambda e: e.seq):
            self.acked_total += 1
            self._drop(entry)
        n = len(removed) + self._drop_paged(seq, acked=True)
        self._room_check()
        return n

    def entries(self) -> list[Entry]:
        """Ready entries in delivery order (browsing, management)."""
        return list(self._ready)

    def expire_sweep(self, now: float) -> int:
        expired = [e for e in self._ready if e.expires_at is not None and e.expires_at <= now]
        for entry in expired:
            self._ready.remove(entry)
            self._expire(entry)
        return len(expired)
