"""Browsers of a queue (a part of `Queue`, in a file of its own, as core/paging.py
and core/limits.py are).  Pure: no I/O.

A browser is a consumer with distribution-mode `copy` (AMQP 1.0 §3.5.3: JMS
QueueBrowser): it sees the ready entries in sequence order, each once, without
acquiring them, so the entries stay for the consumers that take them.  Its
position is `browse_cursor` (the last sequence it was sent); the dispatch round
copies to browsers first, bounded like everything in a round by the dispatch slice
and the scan budget.
"""

from __future__ import annotations

from typing import Any, Callable

from .entries import ConsumerPort, Entry
from .selectors.like import spent

SCAN_CHUNK = 256   # ready entries looked at in one go (by scans and browsers)
# Selector evaluation counts against a dispatch's scan budget as well: every
# SCAN_STEPS steps spent (core/selectors/like.py) use up one entry of it, so the
# scan budget (4,096 entries) stands for 4 Mi steps too (like.py TURN_BUDGET).
# Each within its own budget, 40 evaluations of a costly selector against 1 MiB
# properties held the loop 7.8 s in one scan.
SCAN_STEPS = 1024


class QueueBrowsers:
    """Queue's browsing consumers: mixed into Queue (core/queues.py)."""

    __slots__ = ()

    consumers: list
    _ready: Any
    _slice: int
    _scan: int

    _load: Callable[[Entry], bool]          # Queue's: read a paged entry's body back

    def _browse(self) -> None:
        """Browsers (distribution-mode copy, AMQP 1.0 §3.5.3) see ready entries in
        order, each once, without acquiring them."""
        for consumer in self.consumers:
            if not consumer.browser:
                continue
            credit = consumer.credit()
            if credit > 0:
                self._browse_for(consumer, credit)
            if not self._slice:
                return

    def _browse_for(self, consumer: ConsumerPort, credit: int) -> None:
        """Copy the entries after the browser's cursor, in sequence order, a chunk at a
        time: bounded by its credit, the dispatch slice and the scan budget."""
        while credit > 0 and self._slice:
            chunk = self._ready.after(consumer.browse_cursor, SCAN_CHUNK)
            if not chunk:
                return
            for entry in chunk:
                if credit <= 0 or not self._slice:
                    return
                if self._scan == 0:
                    self._slice = 0   # the scan budget is spent: the next loop turn goes on
                    return
                self._scan -= 1
                consumer.browse_cursor = entry.seq
                if entry.msg is None and not self._load(entry):
                    continue
                if consumer.filtered:
                    before = spent()
                    accepted = consumer.accepts(entry)
                    self._charge_scan(before)
                    if not accepted:
                        continue
                consumer.deliver_copy(entry)
                credit -= 1
                self._slice -= 1

    def _charge_scan(self, before: int) -> None:
        """The selector steps spent since `before` use up the scan budget (SCAN_STEPS
        each); without a budget (-1: no loop to defer to) nothing changes."""
        if self._scan > 0:
            self._scan = max(0, self._scan - (spent() - before) // SCAN_STEPS)
