"""Commit statistics for metrics: fixed-bucket histograms of commit latency and
batch size.  Observed on the loop thread once per commit result from the store's
writer process (one bisect and two increments: nothing per message); read at
scrape time."""

from __future__ import annotations

from bisect import bisect_left

LATENCY_BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BATCH_BOUNDS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class Histogram:
    """Counts per upper bound (`le`), plus +Inf, a sum and a count."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)   # last: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """[(le, cumulative count)] ending with ('+Inf', count), Prometheus-style."""
        out, running = [], 0
        for bound, n in zip(self.bounds, self.counts):
            running += n
            out.append((_fmt(bound), running))
        out.append(("+Inf", running + self.counts[-1]))
        return out


def _fmt(bound: float) -> str:
    return repr(float(bound))


class CommitStats:
    def __init__(self) -> None:
        self.latency = Histogram(LATENCY_BOUNDS)
        self.batch = Histogram(BATCH_BOUNDS)

    def observe(self, seconds: float, operations: int) -> None:
        self.latency.observe(seconds)
        self.batch.observe(operations)
