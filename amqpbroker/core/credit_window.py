"""How much credit a producer link is given at a time (its window; core/credit.py says
what a block queue's room allows of it) (AMQP 1.0 §2.6.7).  Pure: no I/O.

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
faster than the broker reads, and of one on a long round trip (it sends the
window, then waits for the flow).  A half window one of whose reads carried at
least a `GROW`-th of the window is a burst.  Bursts that go on for `SUSTAIN`
seconds, each half window following the last within `GAP`, double the window
at every top-up from then on, up to the configured maximum
(`limits.link_credit`).  Not one burst alone: a producer that fell behind its
own schedule catches up in a burst of a few hundred messages, and a window grown
for it lets that catch-up, and every later one, in at once.  (amqp-bench paces
its sends on a timer that first fires 100 ms after its first batch: at 5,000
msgs/s it then sends ~485 at once.  With the window doubled at the first burst
they came in as reads of 97, 193 and 158, waited 1.5-5.4 ms each, and made the
run's p99; the Proton C example broker's 5 credits keep such a backlog in the
client.)  A producer at full speed bursts without end: after `SUSTAIN` (a
thousand messages or so) its window grows as before, so its throughput is that
of the large window (a window held at 64 cost 13-25 % of full-speed p2p).

A window shrinks only for a producer that has become slow: when a half window's
transfers took more than `SPREAD` seconds to arrive, it halves (never below the
start), so one that once went at full speed cannot later put a full window in
front of its moderate-rate messages.  (Not by reads alone: a fast producer whose
messages a fast broker reads a few at a time is no slower for it, and halving
its window would cap it at a window per round trip.)

Top-ups happen when the credit left falls below half the window (the caller
checks that); `refill` says how large the window is from then on.
"""

from __future__ import annotations

INITIAL = 64      # credit a new producer link gets
GROW = 4          # a read carrying window / GROW of a half window's transfers: double
SPREAD = 0.2      # seconds: a half window spread over more than this: halve
SUSTAIN = 0.02    # seconds of bursts, one after the other, before the window grows
GAP = 0.05        # seconds: a half window spread over more than this ends a run of bursts


class CreditWindow:
    """One producer link's window, and the transfers of the current half window:
    `read` names the socket read of the last one (any value that changes from one
    read to the next), `run` counts them in it, `peak` is the most in one read since
    the last top-up, `first_at` when the first of them was read; `bursting_since`
    when the present run of bursts began (None: the last half window was none)."""

    __slots__ = ("window", "maximum", "minimum", "read", "run", "peak", "first_at", "bursting_since")

    def __init__(self, maximum: int, initial: int = INITIAL):
        self.maximum = max(1, maximum)
        self.minimum = min(initial, self.maximum)
        self.window = self.minimum
        self.read = -1
        self.run = 0
        self.peak = 0
        self.first_at: float | None = None
        self.bursting_since: float | None = None

    def arrived(self, read: int, at: float) -> None:
        """A transfer that socket read `read`, made at time `at` (seconds), brought."""
        if read != self.read:
            self.read = read
            self.run = 0
        self.run += 1
        if self.run > self.peak:
            self.peak = self.run
        if self.first_at is None:
            self.first_at = at

    def refill(self, at: float) -> int:
        """A top-up is due (credit below half the window) while handling a transfer
        read at `at`: the window to give back from now on."""
        peak, first = self.peak, self.first_at
        self.peak, self.run, self.first_at = 0, 0, None
        if peak:   # (a top-up without transfers, e.g. the flow gate releasing a held producer: as it is)
            if peak * GROW >= self.window:
                self._burst(first, at)
            else:
                self.bursting_since = None
                if first is not None and at - first > SPREAD:
                    self.window = max(self.window // 2, self.minimum)
        return self.window

    def _burst(self, first: float | None, at: float) -> None:
        """A half window that was a burst, its first transfer read at `first`."""
        if first is None or at - first > GAP:
            self.bursting_since = at          # after a pause: a run of bursts starts here
        elif self.bursting_since is None:
            self.bursting_since = first
        if at - self.bursting_since >= SUSTAIN:
            self.window = min(self.window * 2, self.maximum)
