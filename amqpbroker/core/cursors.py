"""A durable subscription's cursor into the topic log (pure state, no I/O).

A member of the topic log (core/topiclog.py) *owes* the log positions routed to
it.  Its cursor says which of those it has settled (acknowledged, expired,
dead-lettered, purged, moved away) and the delivery state of the few that
changed, in a form whose size follows the irregularities, not the backlog:

* `floor`: every owed position below it is settled (in a FIFO drain, the only
  thing that moves);
* `ranges`: sorted, disjoint [lo, hi] above the floor whose owed positions are all
  settled (acknowledged out of order: a higher priority, several consumers, a
  message scheduled for later at the head); two ranges merge when no owed position
  lies between them, so a stuck head with everything after it acknowledged is one
  range;
* `states`: position -> (delivery-count, delivered) of owed positions not settled
  whose count or delivered mark was written (a failed attempt, a message given
  back, a delivery far from the head: store/marks.py Mark.ENTRY);
* `bumps`: delivery watermarks found at recovery: an owed position up to a bump,
  without a state, comes back with delivery-count + 1 per bump (AMQP 1.0 §3.2.1:
  it may have been processed).

Which positions a member owes is the log's knowledge: the decisions take it as
`next_owed(x)`, the smallest owed position above x (or the first position not
allocated yet when there is none).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from typing import Callable

NextOwed = Callable[[int], int]


class Cursor:
    __slots__ = ("joined", "left", "floor", "ranges", "states", "bumps")

    def __init__(self, joined: int, floor: int | None = None, left: int | None = None):
        self.joined = joined            # the first position the member's rule covers
        self.left = left                # the rule covers positions below this (None: still bound)
        self.floor = joined if floor is None else floor
        self.ranges: list[list[int]] = []
        self.states: dict[int, tuple[int, bool]] = {}
        self.bumps: list[int] = []

    # ------------------------------------------------------------------ reading

    def settled(self, p: int) -> bool:
        if p < self.floor:
            return True
        ranges = self.ranges
        if not ranges:
            return False
        i = bisect_right(ranges, p, key=_lo) - 1
        return i >= 0 and ranges[i][1] >= p

    def skip(self, p: int) -> int:
        """`p`, or the first position after the settled range holding it."""
        ranges = self.ranges
        if ranges:
            i = bisect_right(ranges, p, key=_lo) - 1
            if i >= 0 and ranges[i][1] >= p:
                return ranges[i][1] + 1
        return p

    def delivery_count(self, p: int, base: int) -> int:
        """The delivery-count of owed position `p` whose record says `base`."""
        state = self.states.get(p)
        if state is not None:
            return state[0]
        bumps = self.bumps
        return base + (len(bumps) - bisect_left(bumps, p) if bumps else 0)

    def delivered(self, p: int) -> bool:
        state = self.states.get(p)
        return state is not None and state[1]

    # ------------------------------------------------------------------ changes

    def settle(self, p: int, next_owed: NextOwed) -> bool:
        """Owed position `p` is settled; False when it already was."""
        if self.states:
            self.states.pop(p, None)
        if p == self.floor:   # a FIFO drain: the floor moves on
            self._advance(next_owed(p), next_owed)
            return True
        if p < self.floor:
            return False
        self._advance(next_owed(self.floor - 1), next_owed)   # the floor: the first owed position
        if p < self.floor:
            return False
        if p == self.floor:
            self._advance(next_owed(p), next_owed)
            return True
        ranges = self.ranges
        i = bisect_right(ranges, p, key=_lo)
        if i > 0 and ranges[i - 1][1] >= p:
            return False   # settled already
        left = ranges[i - 1] if i > 0 and next_owed(ranges[i - 1][1]) == p else None
        right = ranges[i] if i < len(ranges) and next_owed(p) == ranges[i][0] else None
        if left is not None and right is not None:
            left[1] = right[1]
            del ranges[i]
        elif left is not None:
            left[1] = p
        elif right is not None:
            right[0] = p
        else:
            ranges.insert(i, [p, p])
        return True

    def _advance(self, floor: int, next_owed: NextOwed) -> None:
        """The floor moves to `floor`, and past the settled ranges it reaches."""
        ranges = self.ranges
        while ranges and ranges[0][0] <= floor:
            if ranges[0][1] >= floor:
                floor = next_owed(ranges[0][1])
            del ranges[0]
        self.floor = floor

    def set_state(self, p: int, count: int, delivered: bool) -> None:
        """Owed position `p`, not settled, now has this delivery-count and mark."""
        if p >= self.floor:
            self.states[p] = (count, delivered)

    def recover(self, watermark: int) -> int:
        """Recovery: what may have been handed out before the crash comes back with
        delivery-count + 1 (store/marks.py): positions marked delivered, positions up
        to the delivery watermark.  Returns the states changed."""
        changed = 0
        states = self.states
        for p, (count, delivered) in list(states.items()):
            if delivered or p <= watermark:
                states[p] = (count + 1, False)
                changed += 1
        if watermark >= self.floor:
            insort(self.bumps, watermark)
        return changed

    def prune(self) -> None:
        """Forget what the floor has passed (before the cursor is written)."""
        floor = self.floor
        if self.bumps and self.bumps[0] < floor:
            self.bumps = [b for b in self.bumps if b >= floor]
        if self.states and min(self.states) < floor:
            self.states = {p: s for p, s in self.states.items() if p >= floor}
        if self.ranges and self.ranges[0][1] < floor:
            self.ranges = [r for r in self.ranges if r[1] >= floor]

    def covers(self, p: int) -> bool:
        """Whether the member's rule covers position `p` (joined, not left)."""
        return p >= self.joined and (self.left is None or p < self.left)


def _lo(r: list[int]) -> int:
    return r[0]
