"""Idle-expiry policy for durable subscriptions, and the `abandoned` test.  Pure:
no I/O, the clock is passed in.

WebLogic's "abandoned subscriptions" (seed 003): a durable subscription nobody
consumes any more keeps collecting messages until the broker runs out of room.
An administrator spots them by the time since a consumer was last attached and by
their pending count/bytes; this module makes that decision, and the policy runner
(management/service.py) carries it out:

    [[expiry_policies]]
    pattern = "orders.*"     # glob over the subscription's topic address or its name
    idle = "7d"              # no consumer for this long …
    max_backlog = 10000      # … and/or more than this many pending messages
    match = "any"            # any (default): one condition is enough; all: every one
    action = "report"        # report (default: log + metric) | delete

A subscription is *idle* when it has no consumer; it has been idle since the last
consumer left (or since it was created, or since the broker started for a
subscription recovered from the store with no consumer since).  The first policy
whose pattern matches a subscription decides for it.  `delete` never removes a
subscription that has a consumer attached (a backlog-only match with consumers
attached is reported instead).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Iterable

from ..core.durations import format_duration

REPORT = "report"
DELETE = "delete"

@dataclass(frozen=True)
class ExpiryRule:
    pattern: str
    idle: float | None = None            # seconds
    max_backlog: int | None = None
    action: str = REPORT
    match: str = "any"

    def __post_init__(self) -> None:
        if self.action not in (REPORT, DELETE):
            raise ValueError(f"unknown expiry action '{self.action}'")
        if self.match not in ("any", "all"):
            raise ValueError(f"unknown match '{self.match}' (any | all)")
        if self.idle is None and self.max_backlog is None:
            raise ValueError("an expiry policy needs idle and/or max_backlog")

    def covers(self, sub: "SubscriptionState") -> bool:
        return any(fnmatch.fnmatchcase(text, self.pattern) for text in (sub.topic, sub.name) if text)


@dataclass(frozen=True)
class SubscriptionState:
    """What the policy needs to know about one subscription."""
    namespace: str
    name: str
    topic: str                      # the address the subscriber named (or exchange/key)
    durable: bool
    consumers: int
    pending: int
    created_at: float
    idle_since: float | None        # the last time a consumer left (None: never had one)

    @property
    def ident(self) -> tuple[str, str, bool]:
        return (self.namespace, self.name, self.durable)

    def idle_for(self, now: float) -> float | None:
        """Seconds without a consumer; None while one is attached."""
        if self.consumers:
            return None
        since = self.idle_since if self.idle_since is not None else self.created_at
        return max(0.0, now - since)


def is_abandoned(sub: SubscriptionState, idle: float, now: float) -> bool:
    """A durable subscription with no consumer for at least `idle` seconds."""
    idle_for = sub.idle_for(now)
    return sub.durable and idle_for is not None and idle_for >= idle


@dataclass(frozen=True)
class ExpiryAction:
    sub: SubscriptionState
    rule: ExpiryRule
    action: str                     # report | delete
    reasons: tuple[str, ...]

    def describe(self) -> str:
        s = self.sub
        return (f"subscription '{s.name}' (namespace {s.namespace}, topic {s.topic}): "
                f"{'; '.join(self.reasons)} [policy '{self.rule.pattern}', action {self.action}]")


def evaluate_one(rule: ExpiryRule, sub: SubscriptionState, now: float) -> ExpiryAction | None:
    reasons: list[str] = []
    checks: list[bool] = []
    if rule.idle is not None:
        idle_for = sub.idle_for(now)
        hit = idle_for is not None and idle_for >= rule.idle
        checks.append(hit)
        if hit:
            reasons.append(f"no consumer for {format_duration(idle_for)} (limit {format_duration(rule.idle)})")
    if rule.max_backlog is not None:
        hit = sub.pending > rule.max_backlog
        checks.append(hit)
        if hit:
            reasons.append(f"backlog of {sub.pending} message(s) over {rule.max_backlog}")
    fired = all(checks) if rule.match == "all" else any(checks)
    if not fired:
        return None
    action = rule.action
    if action == DELETE and sub.consumers:
        action = REPORT
        reasons.append(f"{sub.consumers} consumer(s) attached: not deleted")
    return ExpiryAction(sub, rule, action, tuple(reasons))


def evaluate(rules: Iterable[ExpiryRule], subs: Iterable[SubscriptionState], now: float) -> list[ExpiryAction]:
    """One action per durable subscription that the first matching policy fires for."""
    rules = list(rules)
    out: list[ExpiryAction] = []
    for sub in subs:
        if not sub.durable:
            continue
        for rule in rules:
            if rule.covers(sub):
                act = evaluate_one(rule, sub, now)
                if act is not None:
                    out.append(act)
                break
    return out


@dataclass
class ExpiryTracker:
    """Reports a subscription once when it starts matching (again), not on every
    run: a `report` is logged and counted the first time, and again only after the
    subscription stopped matching in between.  Deletions always go through."""
    reported: set[tuple] = field(default_factory=set)

    def due(self, actions: list[ExpiryAction]) -> list[ExpiryAction]:
        current = {(a.sub.ident, a.rule.pattern) for a in actions}
        fresh = [a for a in actions
                 if a.action == DELETE or (a.sub.ident, a.rule.pattern) not in self.reported]
        self.reported = {k for k in current}
        return fresh


__all__ = ["ExpiryRule", "SubscriptionState", "ExpiryAction", "ExpiryTracker", "evaluate", "evaluate_one",
           "is_abandoned", "REPORT", "DELETE"]
