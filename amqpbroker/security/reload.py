"""Live reload: what a new configuration changes.  Pure: no sockets, no broker.

A reload (SIGHUP, `POST /api/reload`, `amqpbroker admin reload`) re-reads the
configuration file; the server (server/reload.py) validates it, asks `plan` what
it changes and applies that.  Reloaded: `[users.*]`, `[[acl]]`, `[anonymous]`,
`[[expiry_policies]]`, `[[queue_limits]]` and the limits of `[[queues]]`.  Every
other setting is reported as needing a restart and left as it is.

What happens to what is already connected:

* a connection whose user was removed is closed with `amqp:unauthorized-access`
  (AMQP 1.0 §2.4.3, §2.8.15): its authentication no longer names a user;
* a link whose attach needed a permission the new rules no longer grant
  (consume / browse on its source, send on its target: security/guard.py) is
  detached with `amqp:unauthorized-access` (§2.6.6), producers and consumers alike;
* a changed password does not end anyone's connection (it authenticated with the
  old one, as a database session outlives a password change): new connections
  need the new one.

A reload that would open access is not taken unless asked for explicitly
(`opens_access`): turning access control off (no `[[acl]]` rule and no
`[anonymous]` section left), removing every user, or giving the anonymous identity
more than it had.  A file cut short while an editor or `cp` writes it is a valid
TOML prefix more often than not, and the first thing such a prefix loses is the
`[[acl]]` rules at its end; an empty file is valid TOML too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from ..core.limits import LimitRule, QueueLimits, limits_for
from .acl import AclPolicy

if TYPE_CHECKING:
    from ..config import Settings

UNAUTHORIZED = "amqp:unauthorized-access"

# The settings a reload applies (Settings field names); the rest need a restart.
RELOADABLE = frozenset({"users", "acl", "anonymous", "expiry_policies", "queue_limits", "queues"})


class ReloadError(ValueError):
    """The new configuration is not taken; nothing was changed.  One line a person can act on."""


@dataclass(frozen=True)
class LiveConnection:
    ref: Any                   # the server's handle, opaque here
    user: str | None
    description: str = ""      # for the log: peer address, container-id


@dataclass(frozen=True)
class LiveLink:
    ref: Any                   # the server's handle, opaque here
    connection: Any            # the LiveConnection.ref it belongs to
    user: str | None
    name: str
    action: str                # the permission its attach needed (send, consume, browse)
    address: str
    # Further addresses its attach needed the same permission on: a producer served
    # as a partitioned destination's member here is checked on the member too
    # (server/refusal.py check_access), as the member's node checks a forwarded one.
    also: tuple[str, ...] = ()


@dataclass
class ReloadPlan:
    users_added: list[str] = field(default_factory=list)
    users_removed: list[str] = field(default_factory=list)
    users_changed: list[str] = field(default_factory=list)     # password or groups
    acl_changed: bool = False
    anonymous_changed: bool = False
    expiry_changed: bool = False
    # queue name → (declared limits, effective limits) for queues whose limits change
    queue_limits: dict[str, tuple[QueueLimits | None, QueueLimits | None]] = field(default_factory=dict)
    restart_needed: list[str] = field(default_factory=list)
    opened: list[str] = field(default_factory=list)            # what it opens (allowed explicitly)
    close: list[tuple[LiveConnection, str]] = field(default_factory=list)
    detach: list[tuple[LiveLink, str]] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.users_added or self.users_removed or self.users_changed or self.acl_changed
                    or self.anonymous_changed or self.expiry_changed or self.queue_limits)

    def summary(self) -> dict:
        """The answer to the API / CLI (plain JSON values)."""
        return {
            "changed": self.changed,
            "users_added": self.users_added, "users_removed": self.users_removed,
            "users_changed": self.users_changed,
            "acl_changed": self.acl_changed, "anonymous_changed": self.anonymous_changed,
            "expiry_policies_changed": self.expiry_changed,
            "queue_limits_changed": {name: None if eff is None else eff.describe()
                                     for name, (_, eff) in sorted(self.queue_limits.items())},
            "connections_closed": len(self.close), "links_detached": len(self.detach),
            "restart_needed": self.restart_needed,
            "opened": self.opened,
        }

    def describe(self) -> str:
        """One log line's worth."""
        parts = []
        for what, names in (("users added", self.users_added), ("users removed", self.users_removed),
                            ("users changed", self.users_changed)):
            if names:
                parts.append(f"{what}: {', '.join(names)}")
        if self.acl_changed:
            parts.append("[[acl]] changed")
        if self.anonymous_changed:
            parts.append("[anonymous] changed")
        for what in self.opened:
            parts.append(f"{_short(what)} (allowed)")
        if self.expiry_changed:
            parts.append("expiry policies changed")
        if self.queue_limits:
            parts.append(f"limits of {len(self.queue_limits)} queue(s) changed")
        if not parts:
            parts.append("nothing reloadable changed")
        parts.append(f"{len(self.close)} connection(s) closed, {len(self.detach)} link(s) detached")
        if self.restart_needed:
            parts.append(f"needs a restart to apply: {', '.join(self.restart_needed)}")
        return "; ".join(parts)


def _short(opening: str) -> str:
    """`opens_access` phrases as past facts, for the log line of a reload taken."""
    if opening.startswith("it turns access control off"):
        return "access control turned off"
    if opening.startswith("it removes every user"):
        return "every user removed"
    return "the anonymous identity given more"


def plan(old: "Settings", new: "Settings", policy: AclPolicy, connections: Iterable[LiveConnection],
         links: Iterable[LiveLink], queues: Mapping[str, tuple[QueueLimits | None, QueueLimits | None]]
         ) -> ReloadPlan:
    """What taking `new` (whose ACL policy is `policy`) instead of `old` changes.
    `queues`: every queue's (effective limits, declared limits) now."""
    p = ReloadPlan()
    p.users_added, p.users_removed, p.users_changed = diff_users(old, new)
    p.acl_changed = _dump(old.acl) != _dump(new.acl)
    p.anonymous_changed = _dump(old.anonymous) != _dump(new.anonymous)
    p.expiry_changed = _dump(old.expiry_policies) != _dump(new.expiry_policies)
    p.queue_limits = queue_limit_changes(old, new, queues)
    p.restart_needed = restart_needed(old, new)
    removed = set(p.users_removed)
    p.close = [(c, f"user '{c.user}' was removed from the configuration")
               for c in connections if c.user in removed]
    closing = {c.ref for c, _ in p.close}
    groups = {name: frozenset(u.groups) for name, u in new.users.items()}
    p.detach = links_losing_permission(policy, groups, (ln for ln in links if ln.connection not in closing))
    return p


def opens_access(old: "Settings", new: "Settings", old_policy: AclPolicy, new_policy: AclPolicy) -> list[str]:
    """What taking `new` would open that `old` kept closed (empty: nothing).  Each
    item is one phrase for the refusal: such a reload needs an explicit
    `allow_open` (`amqpbroker admin reload --allow-open`)."""
    out = []
    if old_policy.enabled and not new_policy.enabled:
        out.append("it turns access control off (no [[acl]] rule and no [anonymous] section left: "
                   "everyone may do everything)")
    if old.users and not new.users:
        out.append(f"it removes every user ({len(old.users)} configured now)")
    if old_policy.enabled and new_policy.enabled and _anonymous_wider(old_policy, new_policy):
        out.append("it gives the anonymous identity more than it has "
                   f"({_grant(old_policy)} now, {_grant(new_policy)} then)")
    if old_policy.enabled and new_policy.enabled:
        out.extend(_everywhere_wider(old_policy, new_policy))
    return out


def _everywhere(policy: AclPolicy) -> dict[str, frozenset[str]]:
    """Who has which permissions on every address (a rule with pattern '#')."""
    out: dict[str, frozenset[str]] = {}
    for rule in policy.rules:
        if rule.pattern == "#":
            who = f"user '{rule.user}'" if rule.user is not None else f"group '{rule.group}'"
            out[who] = out.get(who, frozenset()) | rule.permissions
    return out


def _everywhere_wider(old: AclPolicy, new: AclPolicy) -> list[str]:
    """A rule cut before its `pattern` line (a half-written file) grants on '#', the
    default: a user or group given permissions on every address it did not have is
    an opening, as more for the anonymous identity is."""
    before = _everywhere(old)
    out = []
    for who, perms in sorted(_everywhere(new).items()):
        gained = perms - before.get(who, frozenset())
        if gained:
            out.append(f"it gives {who} {', '.join(sorted(gained))} on every address (pattern '#', the "
                       "default when a rule has none)")
    return out


def _anonymous_wider(old: AclPolicy, new: AclPolicy) -> bool:
    if not new.anonymous:
        return False
    if not old.anonymous:
        return True
    return bool(new.anonymous - old.anonymous) or new.anonymous_pattern != old.anonymous_pattern


def _grant(policy: AclPolicy) -> str:
    if not policy.anonymous:
        return "nothing"
    return f"{', '.join(sorted(policy.anonymous))} on '{policy.anonymous_pattern}'"


def diff_users(old: "Settings", new: "Settings") -> tuple[list[str], list[str], list[str]]:
    """(added, removed, changed): changed is a new password (hash or text) or groups."""
    added = sorted(set(new.users) - set(old.users))
    removed = sorted(set(old.users) - set(new.users))
    changed = sorted(name for name in set(old.users) & set(new.users)
                     if _dump(old.users[name]) != _dump(new.users[name]))
    return added, removed, changed


def links_losing_permission(policy: AclPolicy, groups: Mapping[str, frozenset[str]],
                            links: Iterable[LiveLink]) -> list[tuple[LiveLink, str]]:
    """The live links the new policy no longer allows what their attach needed."""
    out = []
    for link in links:
        denied = next((address for address in (link.address, *link.also)
                       if not policy.decide(link.user, groups.get(link.user or "", frozenset()), link.action,
                                            address).allowed), None)
        if denied is not None:
            who = "anonymous" if AclPolicy.is_anonymous(link.user) else f"user '{link.user}'"
            out.append((link, f"{who} is no longer allowed to {link.action} on '{denied}' "
                              f"(configuration reloaded)"))
    return out


def queue_limit_changes(old: "Settings", new: "Settings",
                        queues: Mapping[str, tuple[QueueLimits | None, QueueLimits | None]]
                        ) -> dict[str, tuple[QueueLimits | None, QueueLimits | None]]:
    """Queues whose limits the new `[[queue_limits]]` / `[[queues]]` change:
    name → (declared, effective).  A `[[queues]]` entry's limits win over patterns
    (as at start); an entry whose limits were removed leaves its queue to the
    patterns; limits declared through the API stay."""
    rules = tuple(LimitRule(r.pattern, r.queue_limits()) for r in new.queue_limits)
    new_decl = {q.name: q.queue_limits() for q in new.queues}
    old_decl = {q.name: q.queue_limits() for q in old.queues}
    out = {}
    for name, (current, declared) in queues.items():
        if new_decl.get(name) is not None:
            declared = new_decl[name]
        elif old_decl.get(name) is not None:
            declared = None          # the file no longer declares them
        effective = limits_for(name, rules, declared)
        if effective != current:
            out[name] = (declared, effective)
    return out


def restart_needed(old: "Settings", new: "Settings") -> list[str]:
    """Top-level settings that differ but are not reloaded; `[[queues]]` entries
    other than their limits (a new queue, durability) count too."""
    out = sorted(k for k in type(old).model_fields
                 if k not in RELOADABLE and _dump(getattr(old, k)) != _dump(getattr(new, k)))
    limit_fields = {"max_depth", "max_bytes", "overflow"}
    if [q.model_dump(exclude=limit_fields) for q in old.queues] != \
            [q.model_dump(exclude=limit_fields) for q in new.queues]:
        out.append("queues (other than limits)")
    return out


def _dump(value: Any) -> Any:
    if isinstance(value, list):
        return [_dump(v) for v in value]
    if isinstance(value, dict):
        return {k: _dump(v) for k, v in value.items()}
    return value.model_dump(mode="json") if hasattr(value, "model_dump") else value


__all__ = ["LiveConnection", "LiveLink", "RELOADABLE", "ReloadError", "ReloadPlan", "diff_users", "opens_access",
           "links_losing_permission", "plan", "queue_limit_changes", "restart_needed"]
