"""Authentication throttling by source address and by user name (pure: no I/O,
no clock of its own).

Password guessing is cheap for the guesser and the broker answers at full speed, so
each wrong password makes the next attempts wait a little longer: the first few
failures are free (typos), then the delay doubles per failure up to a ceiling.  Two
records count failures:

* **per source address** (an IPv6 address by its /64 network, `network_of`), each
  failure remembered with the user name it tried.  A
  success from the address forgives only the failures *for the name that succeeded*
  (a typo, then the right password): a client that logs in as itself between
  guesses at other names keeps the record of those guesses (one good login used to
  clear the address, and alternating gave 78 guesses a second);
* **per user name**, from every address together (`free_failures_per_user`, more
  than per address: a user is not locked out by a few typos on several machines),
  so guesses at one account spread over many addresses are slowed too.  A success
  as that user clears it.

Other addresses, and other names, are never slowed by either record.  An address
or name that stops failing is forgotten after a while.  Used for SASL
(server/engine.py) and the management API's HTTP basic auth (management/auth.py).

The callers take turns (`Turns`): attempts from a slowed address, or for a slowed
name, are answered one at a time, each `delay` after the one before, so parallel
connections do not multiply the rate; beyond `max_waiting` queued, an attempt is
refused at once, unchecked.
"""

from __future__ import annotations

import ipaddress
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable

from ..core.numbers import ascii_int

MAX_NAMES_PER_ADDRESS = 64     # names remembered per address (more: their failures are never forgiven)
IPV6_NETWORK = 64              # IPv6 addresses are counted by network: this prefix length


@lru_cache(maxsize=4096)
def network_of(address: str) -> str:
    """What the per-address record counts by: an IPv4 address itself (an IPv4-mapped
    IPv6 one as IPv4), an IPv6 address by its /64.  Whoever has an IPv6 network has
    2^64 addresses of it (a /64 is what one host or one home is given): counted one
    by one, each had its own free failures and the slowing never came.  Anything
    that is not an address is its own key."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    if ip.version == 6:
        return str(ipaddress.ip_network(f"{ip}/{IPV6_NETWORK}", strict=False))
    return address


@dataclass
class _Record:
    failures: int
    last: float
    names: dict[str, int] = field(default_factory=dict)   # failures by the user name tried


class _Table:
    """Failure records by key (an address, or a user name), bounded."""

    def __init__(self, free: int, forget_after: float, max_keys: int):
        self.free = free
        self.forget_after = forget_after
        self.max_keys = max_keys
        self.records: dict[str, _Record] = {}

    def live(self, key: str, now: float) -> _Record | None:
        record = self.records.get(key)
        if record is not None and now - record.last > self.forget_after:
            del self.records[key]
            return None
        return record

    def add(self, key: str, now: float) -> _Record:
        record = self.live(key, now)
        if record is None:
            if len(self.records) >= self.max_keys:
                self._forget_oldest(now)
            record = self.records[key] = _Record(0, now)
        record.failures += 1
        record.last = now
        return record

    def over(self, key: str, now: float) -> int:
        record = self.live(key, now)
        return 0 if record is None else record.failures - self.free

    def _forget_oldest(self, now: float) -> None:
        """Bounded memory under a flood of keys: drop the stale ones, else the least
        recently seen tenth."""
        stale = [k for k, r in self.records.items() if now - r.last > self.forget_after]
        if not stale:
            by_age = sorted(self.records.items(), key=lambda item: item[1].last)
            stale = [k for k, _ in by_age[:max(1, len(by_age) // 10)]]
        for key in stale:
            del self.records[key]


class AuthThrottle:
    def __init__(self, *, free_failures: int = 5, free_failures_per_user: int = 20, base_delay: float = 0.2,
                 max_delay: float = 10.0, forget_after: float = 600.0, max_addresses: int = 100_000,
                 clock: Callable[[], float] = time.monotonic):
        self.free_failures = free_failures
        self.free_failures_per_user = free_failures_per_user
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.forget_after = forget_after
        self.max_addresses = max_addresses
        self.clock = clock
        self._addresses = _Table(free_failures, forget_after, max_addresses)
        self._users = _Table(free_failures_per_user, forget_after, max_addresses)
        self.turns = Turns(clock)
        # Statistics (metrics).
        self.failures_total = 0
        self.throttled_total = 0     # attempts answered late because of earlier failures

    # ------------------------------------------------------------------ delays

    def _delay_for(self, over: int) -> float:
        if over <= 0:
            return 0.0
        return min(self.max_delay, self.base_delay * (2 ** min(over - 1, 30)))

    def address_delay(self, address: str) -> float:
        return self._delay_for(self._addresses.over(network_of(address), self.clock()))

    def user_delay(self, user: str | None) -> float:
        return 0.0 if not user else self._delay_for(self._users.over(user, self.clock()))

    def delay(self, address: str, user: str | None = None) -> float:
        """Seconds to wait before answering the next attempt from `address` (for
        `user`, when known); counted as a throttled attempt when not 0."""
        wait = max(self.address_delay(address), self.user_delay(user))
        if wait > 0:
            self.throttled_total += 1
        return wait

    def address_turn(self, address: str) -> float | None:
        """An attempt from `address` takes its turn: seconds to wait (0: at once), or
        None when too many from it are waiting already (refuse it unchecked)."""
        return self._turn("address " + network_of(address), self.address_delay(address))

    def user_turn(self, user: str | None) -> float | None:
        """The same for an attempt at `user` (its answer waits: SASL)."""
        return self._turn("user " + user, self.user_delay(user)) if user else 0.0

    def _turn(self, key: str, delay: float) -> float | None:
        if delay <= 0:
            return 0.0
        self.throttled_total += 1
        return self.turns.take(key, delay)

    # ------------------------------------------------------------------ outcomes

    def failed(self, address: str, user: str | None = None) -> int:
        """A wrong password (or unknown user) from `address`, trying `user` when known;
        the address's failure count."""
        self.failures_total += 1
        now = self.clock()
        record = self._addresses.add(network_of(address), now)
        if user:
            if user in record.names or len(record.names) < MAX_NAMES_PER_ADDRESS:
                record.names[user] = record.names.get(user, 0) + 1
            self._users.add(user, now)
        return record.failures

    def succeeded(self, address: str, user: str | None = None) -> None:
        """`user` logged in from `address`: its own failures there are forgiven (and
        its record as a name cleared); failures for other names stay."""
        if not user:
            return
        self._users.records.pop(user, None)
        key = network_of(address)
        record = self._addresses.records.get(key)
        if record is None:
            return
        record.failures -= record.names.pop(user, 0)
        if record.failures <= 0:
            del self._addresses.records[key]

    def failures(self, address: str) -> int:
        record = self._addresses.live(network_of(address), self.clock())
        return 0 if record is None else record.failures

    def user_failures(self, user: str) -> int:
        record = self._users.live(user, self.clock())
        return 0 if record is None else record.failures

    def throttled_addresses(self) -> int:
        """Addresses whose next attempt waits (metrics)."""
        now = self.clock()
        return sum(1 for r in self._addresses.records.values()
                   if r.failures > self.free_failures and now - r.last <= self.forget_after)


class Turns:
    """One attempt at a time per key (an address, a user name), each `delay` after
    the one before (the first `delay` from now): `take(key, delay)` reserves the
    next turn and says how long to wait for it, or None when `max_waiting` turns
    are already taken (refuse it)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_waiting: int = 8,
                 max_keys: int = 100_000):
        self.clock = clock
        self.max_waiting = max_waiting
        self.max_keys = max_keys
        self._next: dict[str, float] = {}

    def take(self, key: str, delay: float) -> float | None:
        if delay <= 0:
            return 0.0
        now = self.clock()
        turn = max(now, self._next.get(key, now)) + delay
        if turn - now > delay * self.max_waiting:
            return None
        if len(self._next) >= self.max_keys:
            self._next = {k: t for k, t in self._next.items() if t > now}
        self._next[key] = turn
        return turn - now


def source_address(peer: str) -> str:
    """The address part of "host:port" (IPv6 "[::1]:5672" or "::1:5672" alike): the
    unit throttling counts by."""
    if peer.startswith("["):
        return peer[1:peer.find("]")] if "]" in peer else peer
    host, sep, port = peer.rpartition(":")
    return host if sep and ascii_int(port) is not None else peer


def auth_throttle(settings: Any) -> AuthThrottle:
    """The broker's throttle, from `[limits] auth_*`: one record per address and one
    per user name for every way to authenticate (SASL, HTTP basic), so a guesser
    gains nothing by switching."""
    lim = settings.limits
    return AuthThrottle(free_failures=lim.auth_free_failures,
                        free_failures_per_user=lim.auth_free_failures_per_user,
                        base_delay=lim.auth_base_delay, max_delay=lim.auth_max_delay)


__all__ = ["AuthThrottle", "Turns", "auth_throttle", "network_of", "source_address"]
