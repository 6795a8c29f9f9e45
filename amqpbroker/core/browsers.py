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

SCAN_CHUNK = 256   # ready entries looked at in one go (by scans and browsers)


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
                if consumer.filtered and not consumer.accepts(entry):
                    continue
                consumer.deliver_copy(entry)
                credit -= 1
                self._slice -= 1
