"""Which ready entry a consumer gets next (a part of `Queue`, in a file of its own, as
core/browsers.py and core/paging.py are).  Pure: no I/O.

Three ways, cheapest first:
- `_run_to`: a queue with one consumer that takes everything (a topic subscription,
  a point-to-point queue) takes ready entries in order while its credit lasts.  Its
  credit is read once per run: each delivery uses exactly one (ConsumerPort.credit),
  so the round over consumers and the credit read per entry are not needed.
- `_take_for`: the first entry, highest priority first (several consumers share the
  queue, round-robin, one entry per consumer per round: an even split).
- `_scan_for`: a consumer that may refuse entries (selector, no-local, a message
  group held elsewhere) scans from its marks, within the scan budget.
"""

from __future__ import annotations

from typing import Any, Callable

from .browsers import SCAN_CHUNK
from .selectors.like import spent
from .entries import PRIORITY_LEVELS, ConsumerPort, Entry


class EntryPicking:
    """Queue's choice of entries for a consumer: mixed into Queue (core/queues.py)."""

    __slots__ = ()

    _ready: Any
    _groups: dict
    _slice: int
    _scan: int
    clock: Callable[[], float]
    _expire: Callable[[Entry], None]
    _load: Callable[[Entry], bool]
    _hand_over: Callable[[Entry, ConsumerPort], None]
    _charge_scan: Callable[[int], None]     # QueueBrowsers': selector steps use up the scan budget

    def _run_to(self, consumer: ConsumerPort) -> bool:
        """Ready entries to the queue's only consumer, in order, while its credit and
        the dispatch slice last (the caller checked: it takes everything, no message
        groups).  False when it took nothing: no credit, or nothing it may take."""
        credit = consumer.credit()
        if credit <= 0:
            return False
        ready = self._ready
        now = self.clock()
        took = False
        while credit > 0 and self._slice and ready.count:
            entry = ready.pop_first()
            if entry.expires_at is not None and entry.expires_at <= now:
                self._expire(entry)
                continue
            if entry.excluded is not None:   # it refused this one before (released)
                ready.put_back(entry)
                entry = self._scan_for(consumer, now)
                if entry is None:
                    break
            self._hand_over(entry, consumer)
            credit -= 1
            took = True
        return took

    def _take_for(self, consumer: ConsumerPort) -> Entry | None:
        now = self.clock()
        if not consumer.filtered and not self._groups:
            while True:   # the usual case: the first entry, with no scan
                entry = self._ready.pop_first()
                if entry is None:
                    return None
                if entry.expires_at is not None and entry.expires_at <= now:
                    self._expire(entry)
                    continue
                if entry.excluded is None:
                    return entry
                self._ready.put_back(entry)
                break
        return self._scan_for(consumer, now)

    def _scan_for(self, consumer: ConsumerPort, now: float) -> Entry | None:
        """The first entry, highest priority first, that `consumer` may take.  The
        scan resumes at the consumer's mark in each level, so every entry is examined
        once per consumer however many messages it takes; only an entry pushed back
        below a mark (core/entries.py: scan marks) or a released message group sends
        a scan back.  Past the scan budget the dispatch waits for the next loop turn."""
        ready = self._ready
        marks = ready.marks(consumer.consumer_id)
        for p in range(PRIORITY_LEVELS - 1, -1, -1):
            while True:
                chunk = ready.level_from(p, marks[p], SCAN_CHUNK)
                for entry in chunk:
                    if self._scan == 0:
                        self._slice = 0
                        return None
                    self._scan -= 1
                    marks[p] = entry.seq + 1
                    before = spent()
                    taken = self._may_take(entry, consumer, now)
                    self._charge_scan(before)
                    if taken:
                        ready.remove(entry)
                        return entry
                if len(chunk) < SCAN_CHUNK:
                    break
        return None

    def _may_take(self, entry: Entry, consumer: ConsumerPort, now: float) -> bool:
        """Whether `consumer` may take this ready entry (an expired one is expired)."""
        if entry.expires_at is not None and entry.expires_at <= now:
            self._ready.remove(entry)
            self._expire(entry)
            return False
        if entry.excluded is not None and consumer.consumer_id in entry.excluded:
            return False
        if self._group_elsewhere(entry, consumer):
            return False
        if entry.msg is None and not self._load(entry):
            return False
        return consumer.accepts(entry)

    def _group_elsewhere(self, entry: Entry, consumer: ConsumerPort) -> bool:
        """Message groups (JMSXGroupID): a group sticks to one consumer while it
        lives.  True when the entry's group belongs to a different consumer."""
        group = entry.group
        if group is None:
            return False
        owner = self._groups.get(group)
        return owner is not None and owner is not consumer
