"""Delivered marks by range: a durable queue's *delivery watermark* (pure decisions).

A consumer must never see a message that a crash could bring back as a first
delivery (AMQP 1.0 §3.2.1: delivery-count counts the attempts that may have been
processed).  Marking each entry stored by an earlier batch as delivered costs one
write and one output hold per delivery on a deep backlog.  Instead each durable
queue persists a watermark W: every entry with seq <= W may have been handed out,
and recovery gives each such entry delivery-count + 1 (as it does for an entry
marked delivered).  W is written ahead of the deliveries (seq + LOOKAHEAD), again
when they come within half of it, so in a FIFO drain the mark has committed long
before the deliveries it covers: no per-entry write and no hold.

Over-marking is allowed (JMS 2.0 §3.4.7: JMSRedelivered is "likely, but not
guaranteed" to mean an earlier delivery) but stays bounded: W only grows
over a range whose undelivered entries are few (at most LOOKAHEAD beyond the
delivery, and at most LOOKAHEAD ready entries below it); a delivery far from the
head (a high priority message, a selector taking from the middle) gets its own
per-entry mark as before.  Under-marking is not allowed: a delivery covered only
by a watermark not yet committed waits for that commit (OutputHold).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

LOOKAHEAD = 4096   # entries a watermark runs ahead of the deliveries (bounds the over-marking)


class Mark(Enum):
    COVERED = "covered"      # seq <= a committed watermark: nothing to write, nothing to wait for
    PENDING = "pending"      # seq <= a watermark still on its way: wait for its batch
    RAISED = "raised"        # a new watermark goes into the current batch; wait for it
    ENTRY = "entry"          # too far from the head: the entry's own delivered mark (current batch)


class Watermark:
    """One queue's delivery watermark: the highest one committed, the highest one
    written (maybe still on its way) and the store batch writing it."""

    __slots__ = ("batch", "committed", "pending")

    def __init__(self) -> None:
        self.committed = 0
        self.pending = 0
        self.batch = -1

    def decide(self, seq: int, tail: int, lowest_ready: Callable[[], int | None],
               lookahead: int = LOOKAHEAD) -> tuple[Mark, int]:
        """A delivery of the entry `seq` (stored by an earlier batch), with `tail` the
        highest sequence stored in the queue so far and `lowest_ready()` the lowest
        sequence still ready in it (None: none; asked only for a delivery above
        the watermark, rarely: it looks at every priority).  Returns the mark and the watermark to
        write into the current batch (0: none).  The watermark never passes the tail:
        messages that arrive later are above it, so a crash long after a drain does
        not mark them."""
        top = min(seq + lookahead, max(tail, seq))
        if seq <= self.pending:
            mark = Mark.COVERED if seq <= self.committed else Mark.PENDING
            # Ahead of time: entries <= pending are covered already, so raising it
            # over-marks at most `lookahead` more (the ones that were not handed out).
            if self.pending - seq < lookahead // 2 and top > self.pending:
                return mark, top
            return mark, 0
        low = lowest_ready()
        low = seq if low is None else min(low, seq)
        if seq - low > lookahead:
            return Mark.ENTRY, 0   # raising W here would mark the whole backlog below it
        return Mark.RAISED, top

    def written(self, value: int, batch: int) -> None:
        """The watermark `value` went into store batch `batch`."""
        if value > self.pending:
            self.pending = value
            self.batch = batch

    def settled(self, value: int, ok: bool) -> None:
        """The batch that wrote `value` committed (ok) or failed: a failed write is
        written again by the next delivery above the committed watermark."""
        if ok:
            self.committed = max(self.committed, value)
        elif self.pending <= value:
            self.pending = self.committed
            self.batch = -1
