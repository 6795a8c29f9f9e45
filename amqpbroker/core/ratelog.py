"""Log lines that cannot flood the log: at most one line per kind per interval, and
the next one says how many were left out.  Pure apart from the logger it writes to
(the clock is given).

A condition a client or a configuration can repeat in a tight loop (a dead-letter
cycle, a selector over its budget, a message dropped at every arrival) must be
visible once and counted, never written per occurrence: a cycle once wrote 1.2
million dead-letter lines (163 MB) in two minutes.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

DEFAULT_INTERVAL = 10.0   # seconds between two lines of one kind


class RateLimitedLog:
    """`log(level, kind, fmt, *args)`: the first line of `kind` goes out; the ones
    within `interval` seconds after it are counted; the first one after that goes
    out with "(N similar lines left out)".  `kind` is any hashable (a string naming
    the condition, a queue name with it).  The table of kinds is bounded."""

    MAX_KINDS = 1024

    def __init__(self, logger: logging.Logger, interval: float = DEFAULT_INTERVAL,
                 clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.interval = interval
        self.clock = clock
        self._kinds: dict[Any, list] = {}      # kind -> [last written at, left out since]

    def log(self, level: int, kind: Any, fmt: str, *args: Any) -> bool:
        """True when the line was written."""
        now = self.clock()
        state = self._kinds.get(kind)
        if state is not None and now - state[0] < self.interval:
            state[1] += 1
            return False
        left_out = state[1] if state is not None else 0
        if state is None and len(self._kinds) >= self.MAX_KINDS:
            self._forget(now)
        self._kinds[kind] = [now, 0]
        if left_out:
            fmt += " (%d similar line(s) left out in the last %.0f s)"
            args = args + (left_out, self.interval)
        self.logger.log(level, fmt, *args)
        return True

    def _forget(self, now: float) -> None:
        """Drop the kinds whose interval is over (their count is lost: a bound)."""
        for kind in [k for k, s in self._kinds.items() if now - s[0] >= self.interval] or list(self._kinds):
            del self._kinds[kind]
