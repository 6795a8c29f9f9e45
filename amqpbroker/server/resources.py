"""File descriptors and memory of the broker process: watched, and given back.

* **File descriptors.**  Every socket takes one, and when the process runs out the
  event loop cannot accept any more: with uvloop that happens silently, new clients
  wait in the kernel's backlog and nothing is logged.  At start the soft limit is
  raised to the hard one; while running, sockets beyond `limit - RESERVE` are closed
  at accept (the reserve keeps the store, its writer pipe and the management API
  working), a warning is logged when 90 % are in use, and both show as metrics.
* **Memory after a burst.**  The broker runs with everything from start-up frozen and
  a young-generation GC threshold of 50,000 (cli.tune_gc), so once traffic stops no
  collection runs, and closed connections (the protocol, its handler and proton's
  transport refer to each other) keep their buffers; glibc also keeps freed memory
  mapped.  After a burst of connections closing or bytes moving, once quiet, one full
  collection and a heap trim give it back.
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
QUIET_FOR = 2.0              # seconds without closes or big traffic before memory is given back
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
        self._last_activity = 0.0
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
        self._activity()

    def bytes_moved(self, n: int) -> None:
        self._bytes += n
        if self._bytes >= BYTES_WORTH_IT:
            self._activity()

    def _activity(self) -> None:
        self._last_activity = time.monotonic()
        if self._quiet_timer is None and (self._closes >= CLOSES_WORTH_IT or self._bytes >= BYTES_WORTH_IT):
            self._quiet_timer = self.loop.call_later(QUIET_FOR, self._when_quiet)

    def _when_quiet(self) -> None:
        quiet = time.monotonic() - self._last_activity
        if quiet < QUIET_FOR:
            self._quiet_timer = self.loop.call_later(QUIET_FOR - quiet, self._when_quiet)
            return
        self._quiet_timer = None
        self._closes = self._bytes = 0
        started = time.perf_counter()
        collected = gc.collect()
        trim_heap()
        self.given_back_total += 1
        log.debug("memory given back after a burst: %d objects collected, heap trimmed in %.3f s",
                  collected, time.perf_counter() - started)

    def close(self) -> None:
        self._timer.cancel()
        if self._quiet_timer is not None:
            self._quiet_timer.cancel()


__all__ = ["ResourceWatch", "raise_fd_limit", "open_fds", "RESERVE"]
