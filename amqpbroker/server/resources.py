"""File descriptors and memory of the broker process: watched, and given back.

* **File descriptors.**  Every socket takes one, and when the process runs out the
  event loop cannot accept any more: with uvloop that happens silently, new clients
  wait in the kernel's backlog and nothing is logged.  At start the soft limit is
  raised to the hard one; while running, sockets beyond `limit - RESERVE` are closed
  at accept (the reserve keeps the store, its writer pipe and the management API
  working), a warning is logged when 90 % are in use, and both show as metrics.
* **Memory after a burst.**  glibc keeps freed memory mapped (a burst of large or
  partial deliveries leaves the broker at its peak RSS for good).  After a burst of
  connections closing or bytes moving, once traffic is low for QUIET_FOR, a heap trim
  gives it back.  Closed connections hold no reference cycle (ConnectionHandler.release),
  so they are freed at once, without waiting for a garbage collection an idle broker,
  with its raised thresholds (tune_gc, below), would never run.
"""

from __future__ import annotations

import gc
import logging
import os
import resource
import time
from typing import Any

from ..store.maps import trim_heap

log = logging.getLogger("amqpbroker.resources")

RESERVE = 64                 # descriptors kept for the store, pipes, the management API, logs
WARN_SHARE = 0.9
CHECK_INTERVAL = 5.0         # seconds between counts of the open descriptors
QUIET_FOR = 2.0              # seconds of little traffic before memory is given back
QUIET_BYTES = 8 << 20        # "little": fewer message bytes than this in the window ...
QUIET_CLOSES = 4             # ... and no more connections closed than this
CLOSES_WORTH_IT = 32         # connections closed since the last give-back that make one worth it
BYTES_WORTH_IT = 64 << 20    # or message bytes received since


def raise_fd_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit (the default soft 1024 is far too low
    for a broker); the soft limit in force."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        return soft
    except (ValueError, OSError):
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


class ResourceWatch:
    def __init__(self, loop: Any, protocols: set):
        self.loop = loop
        self.protocols = protocols
        self.fd_limit = raise_fd_limit()
        self.fds = open_fds()
        self._base = self.fds - len(protocols)     # descriptors that are not client sockets
        self.fd_refused_total = 0
        self._warned_at = 0.0
        self._closes = 0
        self._bytes = 0
        self._recent_bytes = 0
        self._recent_closes = 0
        self._quiet_timer: Any = None
        self.given_back_total = 0
        self._timer = loop.call_later(CHECK_INTERVAL, self._check)

    def may_accept(self) -> bool:
        """Whether one more client socket leaves the reserve intact (an estimate kept
        between counts: the sockets open now plus what else was open)."""
        if self._base + len(self.protocols) < self.fd_limit - RESERVE:
            return True
        self.fd_refused_total += 1
        return False

    def _check(self) -> None:
        self._timer = self.loop.call_later(CHECK_INTERVAL, self._check)
        self.fds = open_fds()
        self._base = self.fds - len(self.protocols)
        now = time.monotonic()
        if self.fds >= WARN_SHARE * self.fd_limit and now - self._warned_at > 60:
            self._warned_at = now
            log.warning("%d of %d file descriptors in use: sockets beyond %d are closed at accept "
                        "(raise the limit: ulimit -n / LimitNOFILE)", self.fds, self.fd_limit,
                        self.fd_limit - RESERVE)

    # ------------------------------------------------------------------ memory

    def connection_closed(self) -> None:
        self._closes += 1
        self._recent_closes += 1
        self._maybe_arm()

    def bytes_moved(self, n: int) -> None:
        self._bytes += n
        self._recent_bytes += n
        if self._bytes >= BYTES_WORTH_IT and self._quiet_timer is None:
            self._maybe_arm()

    def _maybe_arm(self) -> None:
        if self._quiet_timer is None and (self._closes >= CLOSES_WORTH_IT or self._bytes >= BYTES_WORTH_IT):
            self._recent_bytes = self._recent_closes = 0
            self._quiet_timer = self.loop.call_later(QUIET_FOR, self._when_quiet)

    def _when_quiet(self) -> None:
        """QUIET_FOR after a burst: give memory back once a window passes with little
        traffic (a trickle, such as a health check, does not count as busy)."""
        if self._recent_bytes > QUIET_BYTES or self._recent_closes > QUIET_CLOSES:
            self._recent_bytes = self._recent_closes = 0
            self._quiet_timer = self.loop.call_later(QUIET_FOR, self._when_quiet)
            return
        self._quiet_timer = None
        self._closes = self._bytes = 0
        started = time.perf_counter()
        trimmed = trim_heap()
        self.given_back_total += 1
        log.debug("memory given back after a burst (heap trimmed: %s) in %.3f s", trimmed,
                  time.perf_counter() - started)

    def close(self) -> None:
        self._timer.cancel()
        if self._quiet_timer is not None:
            self._quiet_timer.cancel()


def tune_gc() -> None:
    """After start-up: everything built so far (recovered queues, the store's
    structures) moves out of the collector's sight (gc.freeze), and the young
    generation is collected every 50,000 allocations instead of 700.  Every
    message allocates a handful of objects and almost none form cycles; the
    default threshold spent ~10 % of a durable p2p run in the collector."""
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


__all__ = ["ResourceWatch", "raise_fd_limit", "open_fds", "RESERVE", "tune_gc"]

