"""Authentication throttling per source address (pure: no I/O, no clock of its own).

Password guessing is cheap for the guesser and the broker answers at full speed, so
each wrong password from an address makes that address's next attempts wait a little
longer: the first few failures are free (typos), then the delay doubles per failure
up to a ceiling.  A success from the address clears it; an address that stops
failing is forgotten after a while.  Other addresses are never slowed: the right
password from another machine is answered at once.  Used for SASL (server/engine.py)
and for the management API's HTTP basic auth (management/api.py).

The caller waits `delay(address)` before answering an attempt (never blocks here).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class _Record:
    failures: int
    last: float


class AuthThrottle:
    def __init__(self, *, free_failures: int = 5, base_delay: float = 0.2, max_delay: float = 10.0,
                 forget_after: float = 600.0, max_addresses: int = 100_000,
                 clock: Callable[[], float] = time.monotonic):
        self.free_failures = free_failures
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.forget_after = forget_after
        self.max_addresses = max_addresses
        self.clock = clock
        self._records: dict[str, _Record] = {}
        # Statistics (metrics).
        self.failures_total = 0
        self.throttled_total = 0     # attempts answered late because of earlier failures

    def delay(self, address: str) -> float:
        """Seconds to wait before answering the next attempt from `address`."""
        record = self._records.get(address)
        if record is None:
            return 0.0
        if self.clock() - record.last > self.forget_after:
            del self._records[address]
            return 0.0
        over = record.failures - self.free_failures
        if over <= 0:
            return 0.0
        self.throttled_total += 1
        return min(self.max_delay, self.base_delay * (2 ** min(over - 1, 30)))

    def failed(self, address: str) -> int:
        """A wrong password (or unknown user) from `address`; its failure count."""
        self.failures_total += 1
        now = self.clock()
        record = self._records.get(address)
        if record is None or now - record.last > self.forget_after:
            if len(self._records) >= self.max_addresses:
                self._forget_oldest(now)
            record = self._records[address] = _Record(0, now)
        record.failures += 1
        record.last = now
        return record.failures

    def succeeded(self, address: str) -> None:
        self._records.pop(address, None)

    def failures(self, address: str) -> int:
        record = self._records.get(address)
        return 0 if record is None else record.failures

    def throttled_addresses(self) -> int:
        """Addresses whose next attempt waits (metrics)."""
        now = self.clock()
        return sum(1 for r in self._records.values()
                   if r.failures > self.free_failures and now - r.last <= self.forget_after)

    def _forget_oldest(self, now: float) -> None:
        """Bounded memory under a flood of addresses: drop the stale ones, else the
        least recently seen tenth."""
        stale = [a for a, r in self._records.items() if now - r.last > self.forget_after]
        if not stale:
            by_age = sorted(self._records.items(), key=lambda item: item[1].last)
            stale = [a for a, _ in by_age[:max(1, len(by_age) // 10)]]
        for address in stale:
            del self._records[address]


def source_address(peer: str) -> str:
    """The address part of "host:port" (IPv6 "[::1]:5672" or "::1:5672" alike): the
    unit throttling counts by."""
    if peer.startswith("["):
        return peer[1:peer.find("]")] if "]" in peer else peer
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else peer


def auth_throttle(settings: Any) -> AuthThrottle:
    """The broker's throttle, from `[limits] auth_*`: one record per address for every
    way to authenticate (SASL, HTTP basic), so a guesser gains nothing by switching."""
    lim = settings.limits
    return AuthThrottle(free_failures=lim.auth_free_failures, base_delay=lim.auth_base_delay,
                        max_delay=lim.auth_max_delay)


__all__ = ["AuthThrottle", "auth_throttle", "source_address"]
