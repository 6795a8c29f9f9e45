"""How much credit a producer link is given at a time (AMQP 1.0 §2.6.7).  Pure: no I/O.

Credit is how much a producer may put in front of its own next message, and in
front of every other connection the event loop serves: the broker handles what
one socket read brought before it answers (~13 µs a message), so a window of 1000
lets a client that starts with a backlog, or sends a batch at once, hand over
13 ms of work in one read, and every message of that burst waits for the ones
before it.  A moderate-rate producer whose first batch was 512 messages saw 5 %
of its messages 6-10 ms late (p99 = max), where the Proton C example broker,
which grants 5 at a time, showed 0.4 ms.

So the window starts small (`INITIAL`: well under a millisecond of work) and
grows only for a producer that shows it needs more: one that sends in bursts.
A producer waiting for credit sends everything it is given at once, so its
transfers arrive many to a socket read; so do those of one that simply sends
faster than the window lets it, and of one on a long round trip (it sends the
window, then waits for the flow).  When one read of a half window carried at
least a `GROW`-th of the window, the next top-up doubles it, up to the
configured maximum (`limits.link_credit`).  A producer at a moderate rate sends
one or a few transfers per read: when no read of a half window carried a
`SHRINK`-th of it, the window halves again (never below the start), so one that
once went at full speed cannot later put a full window in front of its messages.

Top-ups happen when the credit left falls below half the window (the caller
checks that); `refill` says how large the window is from then on.
"""

from __future__ import annotations

INITIAL = 64    # credit a new producer link gets
GROW = 4        # a read carrying window / GROW of a half window's transfers: double
SHRINK = 16     # no read carrying window / SHRINK of them: halve


class CreditWindow:
    """One producer link's window, and the transfers of the current half window
    seen per socket read: `read` names the read of the last one (any value that
    changes from one read to the next), `run` counts them in it, `peak` is the
    most in one read since the last top-up."""

    __slots__ = ("window", "maximum", "minimum", "read", "run", "peak")

    def __init__(self, maximum: int, initial: int = INITIAL):
        self.maximum = max(1, maximum)
        self.minimum = min(initial, self.maximum)
        self.window = self.minimum
        self.read = -1
        self.run = 0
        self.peak = 0

    def arrived(self, read: int) -> None:
        """A transfer that socket read `read` brought."""
        if read != self.read:
            self.read = read
            self.run = 0
        self.run += 1
        if self.run > self.peak:
            self.peak = self.run

    def refill(self) -> int:
        """A top-up is due (credit below half the window): the window to give back
        from now on."""
        peak, self.peak, self.run = self.peak, 0, 0
        if peak:   # (a top-up without transfers, e.g. the flow gate releasing a held producer: as it is)
            if peak * GROW >= self.window:
                self.window = min(self.window * 2, self.maximum)
            elif peak * SHRINK < self.window:
                self.window = max(self.window // 2, self.minimum)
        return self.window
