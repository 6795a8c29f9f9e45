"""Per-second rates from cumulative counters, sampled periodically.  Pure.

Queues only count (enqueued_total, delivered_total, acked_total); a sampler calls
`sample()` every few seconds with those totals and the rate of each counter over
the last interval is kept.  Nothing happens per message."""

from __future__ import annotations

from typing import Mapping, Sequence


class RateTracker:
    def __init__(self, width: int = 3):
        self.width = width
        self._last: dict[str, tuple[float, tuple[int, ...]]] = {}
        self._rates: dict[str, tuple[float, ...]] = {}

    def sample(self, now: float, totals: Mapping[str, Sequence[int]]) -> None:
        for name, values in totals.items():
            values = tuple(values)
            prev = self._last.get(name)
            if prev is not None and now > prev[0]:
                dt = now - prev[0]
                # A counter that went down belongs to a re-created entity: no rate.
                self._rates[name] = tuple(max(0, v - p) / dt if v >= p else 0.0
                                          for v, p in zip(values, prev[1]))
            self._last[name] = (now, values)
        for name in [n for n in self._last if n not in totals]:
            del self._last[name]
            self._rates.pop(name, None)

    def rates(self, name: str) -> tuple[float, ...]:
        return self._rates.get(name, (0.0,) * self.width)
