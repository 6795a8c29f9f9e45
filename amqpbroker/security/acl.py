"""Access control: (user, groups, action, address) → allow or deny.  Pure: no I/O.

Configuration (see docs/operations.md):

    [users.alice]
    password = "..."
    groups = ["ops"]

    [[acl]]
    group = "ops"                 # or user = "alice"
    pattern = "orders.#"
    permissions = ["send", "consume", "browse", "manage"]   # or ["all"]

    [anonymous]                   # the SASL ANONYMOUS / no-SASL identity
    permissions = ["consume"]
    pattern = "#"

Rules:

* **No ACL configured at all** (no `[[acl]]` rule and no `[anonymous]` section):
  everything is allowed — the broker behaves as it did before ACLs existed.
* Otherwise a request is allowed only when some rule grants it: a rule applies to
  its `user`, or to every member of its `group`, and grants its permissions on the
  addresses its `pattern` matches.  There are no deny rules: what no rule grants is
  denied.
* The anonymous identity (`anonymous`) gets what `[anonymous]` grants (nothing
  when the section is absent) plus any `user = "anonymous"` rule; group rules never
  apply to it.
* `consume` implies `browse` (a consumer may always look without taking).
* Patterns are matched against the address the client names, word by word on
  `.` the way topic bindings are: `*` is exactly one word, `#` zero or more words
  (so `orders.#` matches `orders`, `orders.eu` and `orders.eu.paid`; `#` matches
  everything).
* `manage` is checked against the entity's name (queue, exchange, subscription
  topic) for changes; listing needs `manage` on any pattern (`can_manage_any`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ..core.exchanges import topic_matches

SEND = "send"
CONSUME = "consume"
BROWSE = "browse"
MANAGE = "manage"
ALL = "all"
PERMISSIONS = (SEND, CONSUME, BROWSE, MANAGE)
ANONYMOUS_USER = "anonymous"

_CACHE_LIMIT = 10_000


def expand_permissions(permissions: Iterable[str]) -> frozenset[str]:
    """`all` → every permission; unknown names raise ValueError."""
    out: set[str] = set()
    for p in permissions:
        p = p.strip().lower()
        if p == ALL or p == "*":
            out.update(PERMISSIONS)
        elif p in PERMISSIONS:
            out.add(p)
        else:
            raise ValueError(f"unknown permission '{p}' (expected one of {', '.join(PERMISSIONS)}, all)")
    return frozenset(out)


def pattern_matches(pattern: str, address: str) -> bool:
    """Topic-style matching on `.` words: `*` one word, `#` zero or more."""
    if pattern == "#":
        return True
    return topic_matches(pattern, address)


def covers_everything(pattern: str) -> bool:
    """Whether a pattern matches every address (`#`, `#.#` …).  Not the same as
    matching the text '#': `*` (one word) does that, and covers one-word names only."""
    return all(word == "#" for word in pattern.split("."))


@dataclass(frozen=True)
class Rule:
    pattern: str
    permissions: frozenset[str]
    user: str | None = None
    group: str | None = None

    def __post_init__(self) -> None:
        if (self.user is None) == (self.group is None):
            raise ValueError("an ACL rule names exactly one of user or group")

    def applies_to(self, user: str, groups: frozenset[str], anonymous: bool) -> bool:
        if self.user is not None:
            return self.user == user
        return not anonymous and self.group in groups

    def grants(self, action: str) -> bool:
        return action in self.permissions or (action == BROWSE and CONSUME in self.permissions)

    def describe(self) -> str:
        who = f"user '{self.user}'" if self.user is not None else f"group '{self.group}'"
        return f"{who} {sorted(self.permissions)} on '{self.pattern}'"


@dataclass(frozen=True)
class AclDecision:
    allowed: bool
    reason: str
    rule: Rule | None = None

    def __bool__(self) -> bool:
        return self.allowed


class AclPolicy:
    """The configured rules; `decide()` is the one decision."""

    def __init__(self, rules: Iterable[Rule] = (), *, anonymous: frozenset[str] | None = None,
                 anonymous_pattern: str = "#"):
        self.rules: tuple[Rule, ...] = tuple(rules)
        self.anonymous = anonymous                   # None: no [anonymous] section
        self.anonymous_pattern = anonymous_pattern
        self.enabled = bool(self.rules) or anonymous is not None
        self._cache: dict[tuple, AclDecision] = {}

    @classmethod
    def from_config(cls, acl: Iterable[dict], anonymous: dict | None) -> "AclPolicy":
        """From plain dicts shaped like the TOML sections (see the module docstring)."""
        rules = [Rule(pattern=r.get("pattern") or "#",
                      permissions=expand_permissions(r.get("permissions") or ()),
                      user=r.get("user"), group=r.get("group")) for r in acl]
        anon = None
        pattern = "#"
        if anonymous is not None:
            anon = expand_permissions(anonymous.get("permissions") or ())
            pattern = anonymous.get("pattern") or "#"
        return cls(rules, anonymous=anon, anonymous_pattern=pattern)

    @staticmethod
    def is_anonymous(user: str | None) -> bool:
        return user is None or user == ANONYMOUS_USER

    def decide(self, user: str | None, groups: Iterable[str], action: str, address: str) -> AclDecision:
        if action not in PERMISSIONS:
            raise ValueError(f"unknown action '{action}'")
        if not self.enabled:
            return AclDecision(True, "no access control configured")
        groups = frozenset(groups)
        key = (user, groups, action, address)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        decision = self._decide(user, groups, action, address)
        if len(self._cache) >= _CACHE_LIMIT:
            self._cache.clear()
        self._cache[key] = decision
        return decision

    def allows(self, user: str | None, groups: Iterable[str], action: str, address: str) -> bool:
        return self.decide(user, groups, action, address).allowed

    def _decide(self, user: str | None, groups: frozenset[str], action: str, address: str) -> AclDecision:
        anonymous = self.is_anonymous(user)
        name = ANONYMOUS_USER if anonymous else user
        if anonymous and self.anonymous is not None and pattern_matches(self.anonymous_pattern, address):
            if action in self.anonymous or (action == BROWSE and CONSUME in self.anonymous):
                return AclDecision(True, f"[anonymous] grants {action} on '{self.anonymous_pattern}'")
        for rule in self.rules:
            if rule.applies_to(name, groups, anonymous) and rule.grants(action) \
                    and pattern_matches(rule.pattern, address):
                return AclDecision(True, f"granted by {rule.describe()}", rule)
        return AclDecision(False, f"no rule grants {'anonymous' if anonymous else 'user'} "
                                  f"'{name}' {action} on '{address}'")

    def patterns(self, user: str | None, groups: Iterable[str], action: str) -> tuple[str, ...]:
        """The patterns on which `user` holds `action` (all of them: ("#",) when
        access control is off).  What a listing may show is what they match."""
        if not self.enabled:
            return ("#",)
        groups = frozenset(groups)
        anonymous = self.is_anonymous(user)
        name = ANONYMOUS_USER if anonymous else user
        out = [r.pattern for r in self.rules if r.applies_to(name, groups, anonymous) and r.grants(action)]
        if anonymous and self.anonymous is not None and (
                action in self.anonymous or (action == BROWSE and CONSUME in self.anonymous)):
            out.append(self.anonymous_pattern)
        return tuple(dict.fromkeys(out))

    def allows_everywhere(self, user: str | None, groups: Iterable[str], action: str) -> bool:
        """`action` on every address: what broker-wide actions and unfiltered
        listings need (a grant whose pattern covers everything, or no access control)."""
        return any(covers_everything(p) for p in self.patterns(user, groups, action))

    def can_manage_any(self, user: str | None, groups: Iterable[str]) -> bool:
        """`manage` on some pattern: enough to use the management API's listings."""
        if not self.enabled:
            return True
        groups = frozenset(groups)
        anonymous = self.is_anonymous(user)
        if anonymous and self.anonymous is not None and MANAGE in self.anonymous:
            return True
        name = ANONYMOUS_USER if anonymous else user
        return any(r.applies_to(name, groups, anonymous) and MANAGE in r.permissions for r in self.rules)


__all__ = ["AclDecision", "AclPolicy", "Rule", "PERMISSIONS", "SEND", "CONSUME", "BROWSE", "MANAGE",
           "ANONYMOUS_USER", "covers_everything", "expand_permissions", "pattern_matches"]
