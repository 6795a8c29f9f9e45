"""Per-second rates from cumulative counters, sampled periodically.  Pure.

Queues only count (enqueued_total, delivered_total, acked_total); a sampler calls
`sample()` every few seconds with those totals and the rate of each counter over
the last interval is kept.  Nothing happens per message.

Kept as columns (a list per counter, a name → position map), not a tuple per queue:
with 50,000 queues, 100,000 fresh tuples every 5 s were work for the garbage
collector, whose pauses stop the event loop.  The sampler may run in a worker thread
while the loop reads `rates()`: a sample's results replace the previous ones in one
assignment, so a reader sees one sample or the other, never a mix."""

from __future__ import annotations

from typing import Mapping, Sequence


class RateTracker:
    def __init__(self, width: int = 3):
        self.width = width
        self._time: float | None = None
        self._index: dict[str, int] = {}                 # name → position in _totals
        self._totals: list[list[int]] = [[] for _ in range(width)]
        self._current: tuple[dict[str, int], list[list[float]]] = ({}, [[] for _ in range(width)])

    def sample(self, now: float, totals: Mapping[str, Sequence[int]]) -> None:
        names = list(totals)
        columns = [list(c) for c in zip(*totals.values())] if totals else [[] for _ in range(self.width)]
        self.sample_columns(now, names, columns)

    def sample_columns(self, now: float, names: list[str], columns: list[list[int]]) -> None:
        """`columns[c][i]`: counter c of the queue `names[i]`."""
        if self._time is not None and now <= self._time:
            return                     # the clock went back: keep what we have
        index = {name: i for i, name in enumerate(names)}
        rate_index: dict[str, int] = {}
        rates: list[list[float]] = [[] for _ in range(self.width)]
        if self._time is not None:
            dt = now - self._time
            before, prev_index = self._totals, self._index
            for i, name in enumerate(names):
                j = prev_index.get(name)
                if j is None:
                    continue           # new since the last sample: no rate yet
                rate_index[name] = len(rates[0])
                for c in range(self.width):
                    v, p = columns[c][i], before[c][j]
                    # A counter that went down belongs to a re-created entity: no rate.
                    rates[c].append((v - p) / dt if v >= p else 0.0)
        self._time, self._index, self._totals = now, index, columns
        self._current = (rate_index, rates)

    def rates(self, name: str) -> tuple[float, ...]:
        index, rates = self._current
        i = index.get(name)
        if i is None:
            return (0.0,) * self.width
        return tuple(column[i] for column in rates)

    def __len__(self) -> int:
        """Queues known from the last sample."""
        return len(self._index)
