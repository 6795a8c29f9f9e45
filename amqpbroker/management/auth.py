"""Who is asking: the management API's authentication.

* Without ACLs (no `[[acl]]`, no `[anonymous]`): loopback clients only, unauthenticated.
* With ACLs: HTTP basic against the broker's users, and the `manage` permission on
  some pattern (changes: on the entity's name, `Principal.require`; listings show
  what the grants cover, `Principal.sees`).  Verified credentials are cached for a
  minute (a SCRAM derivation costs ~5 ms of the loop).  A request without
  credentials is the anonymous identity only with `[management] allow_anonymous =
  true`: an `[anonymous]` grant written for AMQP clients (even `all` on
  `public.#`) never opens the management API by itself.

Password guessing is slowed per source address and per user name with the pure
`AuthThrottle` (security/throttle.py, shared with SASL): after `[limits]
auth_free_failures` wrong passwords (or unknown users) from an address, or
`auth_free_failures_per_user` for one name from anywhere, the next attempts wait,
the wait doubling per failure up to `auth_max_delay`; a success forgives only the
failures for the name that succeeded.  The wait is an `asyncio.sleep` (the loop
goes on), and attempts from a throttled address (for a throttled name) are taken
one at a time, so opening many connections does not multiply the guessing rate;
beyond `MAX_WAITING` attempts queued the others are answered 429 at once,
unchecked.  Other addresses and names are never slowed.  Behind a reverse proxy
every request comes from the proxy's address: they are throttled together.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import logging
import time
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable

from fastapi import Request

from ..config import is_loopback
from ..security.acl import MANAGE, pattern_matches
from .admin import AdminError

if TYPE_CHECKING:
    from .port import AuthOperations

log = logging.getLogger("amqpbroker.management")

AUTH_CACHE_SECONDS = 60.0
MAX_WAITING = 8            # attempts queued behind a throttled address's delay


class Unauthorized(AdminError):
    status = 401


class Principal:
    def __init__(self, user: str | None, groups: frozenset[str], ops: "AuthOperations"):
        self.user = user
        self.groups = groups
        self.ops = ops

    def require(self, name: str) -> None:
        """`manage` on this entity (only when ACLs are configured)."""
        if not self.may(name):
            raise AdminError(f"user '{self.user}' may not manage '{name}'", 403)

    def may(self, name: str) -> bool:
        """Whether `require(name)` passes."""
        guard = self.ops.managed.access
        return not guard.enabled or guard.policy.allows(self.user, self.groups, MANAGE, name)

    def require_all(self) -> None:
        """`manage` on every address (a grant on '#'): broker-wide actions."""
        if not self.sees_all:
            raise AdminError(f"user '{self.user}' may not manage '#' (every address)", 403)

    @property
    def sees_all(self) -> bool:
        """`manage` on every name (a grant on `#`): listings are not filtered.  Not
        `may("#")`: a grant on `*` matches the one-word text '#' too."""
        guard = self.ops.managed.access
        return not guard.enabled or guard.policy.allows_everywhere(self.user, self.groups, MANAGE)

    def sees(self, name: str) -> bool:
        """Whether a listing shows the entity `name`: the addresses its `manage`
        grants cover, and nothing of other tenants."""
        return self.sees_all or self.may(name)

    def visible(self) -> Callable[[str], bool] | None:
        """A pure test of names for listings (safe in the worker thread: the
        patterns are copied now), or None when everything is visible."""
        if self.sees_all:
            return None
        guard = self.ops.managed.access
        patterns = guard.policy.patterns(self.user, self.groups, MANAGE)
        return lambda name: any(pattern_matches(p, name) for p in patterns)


def basic_credentials(header: str) -> tuple[str | None, str]:
    """(user, password) from an Authorization header; (None, "") without basic
    credentials; Unauthorized when they do not decode."""
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic" or not value:
        return None, ""
    try:
        user, _, password = base64.b64decode(value.strip(), validate=True).decode("utf-8").partition(":")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise Unauthorized("malformed basic credentials") from None
    return user, password


class Authenticator:
    """The FastAPI dependency: `Depends(ops.authenticator)`."""

    def __init__(self, ops: "AuthOperations", clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        self.ops = ops
        self.clock = clock
        self.sleep = sleep
        self.throttle = ops.auth_throttle
        self._cache: dict[str, float] = {}          # sha256(user, password) → valid until
        self._gates: dict[str, tuple[asyncio.Lock, list[int]]] = {}   # address → lock, [waiting]

    def forget(self) -> None:
        """Drop the verified-credentials cache (a live reload changed the users)."""
        self._cache.clear()

    async def __call__(self, request: Request) -> Principal:
        guard = self.ops.managed.access
        address = request.client.host if request.client else ""
        if not guard.enabled:
            if not is_loopback(address):
                raise AdminError("without access control configured, the management API "
                                 "answers loopback clients only: configure a user and an [[acl]] "
                                 "rule granting manage (docs/deploy.md)", 403)
            return Principal(None, frozenset(), self.ops)
        user, password = None, ""
        try:
            user, password = basic_credentials(request.headers.get("authorization", ""))
        except Unauthorized:
            async with self._turn(address):
                self._failed(address)
            raise
        if user is None:
            if self.ops.settings.management.allow_anonymous and guard.policy.can_manage_any(None, ()):
                return Principal(None, frozenset(), self.ops)
            raise Unauthorized("authentication required")
        async with self._turn(address), self._turn(user, by_name=True):
            if not self._verify(user, password):
                self._failed(address, user)
                raise Unauthorized("invalid user name or password")
            self.throttle.succeeded(address, user)
        groups = guard.groups_of(user)
        if not guard.policy.can_manage_any(user, groups):
            raise AdminError(f"user '{user}' lacks the manage permission", 403)
        return Principal(user, groups, self.ops)

    def _verify(self, user: str, password: str) -> bool:
        token = hashlib.sha256(f"{user}\0{password}".encode()).hexdigest()
        now = self.clock()
        if self._cache.get(token, 0.0) >= now:
            return True
        if not self.ops.managed.users.verify_plain(user, password):
            return False
        if len(self._cache) > 1000:
            self._cache.clear()
        self._cache[token] = now + AUTH_CACHE_SECONDS
        return True

    def _failed(self, address: str, user: str | None = None) -> None:
        self.ops.http_auth_failures += 1
        failures = self.throttle.failed(address, user)
        if failures == self.throttle.free_failures + 1:
            # One line per address as it starts being slowed, not one per attempt.
            log.warning("management API: %d failed authentications from %s: its next attempts wait "
                        "(up to %g s)", failures, address, self.throttle.max_delay)

    @contextlib.asynccontextmanager
    async def _turn(self, key: str, by_name: bool = False) -> AsyncIterator[None]:
        """An attempt's turn to be checked: at once for an address (a user name) that
        is not slowed; otherwise one attempt at a time, each after its current delay."""
        throttle = self.throttle
        delay_of = throttle.user_delay if by_name else throttle.address_delay
        gate_key = ("user " if by_name else "address ") + key
        if delay_of(key) <= 0 and gate_key not in self._gates:
            yield                    # nothing between here and the check awaits: no interleaving
            return
        lock, waiting = self._gates.setdefault(gate_key, (asyncio.Lock(), [0]))
        if waiting[0] >= MAX_WAITING:
            what = f"for user '{key}'" if by_name else f"from {key}"
            raise AdminError(f"too many authentication attempts {what} waiting; try again later", 429)
        waiting[0] += 1
        try:
            async with lock:
                delay = delay_of(key)
                if delay > 0:
                    throttle.throttled_total += 1
                    await self.sleep(delay)
                yield
        finally:
            waiting[0] -= 1
            if waiting[0] == 0 and self._gates.get(gate_key, (None,))[0] is lock:
                del self._gates[gate_key]
