"""JMS 2.0 topic subscriptions over AMQP 1.0: the attach/detach decision table.

`decide_attach()` and `decide_detach()` are pure functions from (link name,
container-id, source terms or a null source, registry state) to a decision; the
`SubscriptionRegistry` holds the state and applies decisions to the broker model.
See docs/shared-subscriptions.md for the table row by row.

Identity (Qpid JMS link mapping, JMS 2.0 §6.11.x):
* namespace: the peer's container-id (the JMS clientID), or the global namespace when
  the source has the `global` capability or the link name has a `|global…` suffix
  (proton cannot read link-level capabilities, so a null-source attach tells us
  "global" only through the name);
* subscription name: the link name up to the first `|` when shared, else the whole
  link name;
* durable: expiry-policy `never` (as Qpid Broker-J decides; terminus durability is
  echoed but not used);
* exclusivity: shared → SHARED_SUBSCRIPTION, else LINK.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field, replace
from typing import Mapping

from .queues import ExclusivityPolicy, LifetimePolicy
from .terms import (
    CAP_GLOBAL,
    CAP_SHARED,
    CAP_TOPIC,
    ExpiryPolicy,
    SourceTerms,
)

GLOBAL_NAMESPACE = "_global_"
RESOURCE_LOCKED = "amqp:resource-locked"
NOT_FOUND = "amqp:not-found"
RESOURCE_LIMIT = "amqp:resource-limit-exceeded"

_LIFETIME = {
    ExpiryPolicy.NEVER: LifetimePolicy.PERMANENT,
    ExpiryPolicy.LINK_DETACH: LifetimePolicy.DELETE_ON_NO_LINKS,
    ExpiryPolicy.SESSION_END: LifetimePolicy.DELETE_ON_SESSION_END,
    ExpiryPolicy.CONNECTION_CLOSE: LifetimePolicy.DELETE_ON_CONNECTION_CLOSE,
}


def lifetime_for(expiry: ExpiryPolicy) -> LifetimePolicy:
    return _LIFETIME[expiry]


@dataclass(frozen=True)
class SubscriptionKey:
    namespace: str
    name: str
    durable: bool

    @property
    def queue_name(self) -> str:
        """`qpidsub_/<namespace>_/<name>_/<durable|nondurable>` (Broker-J's scheme);
        `_` in the parts is doubled so the `_/` separator cannot be forged."""
        kind = "durable" if self.durable else "nondurable"
        return f"qpidsub_/{_esc(self.namespace)}_/{_esc(self.name)}_/{kind}"


def _esc(part: str) -> str:
    return part.replace("_", "__")


@dataclass(frozen=True)
class BindingSpec:
    exchange: str
    key: str
    selector: str | None = None
    no_local: bool = False


@dataclass(frozen=True)
class SubscriptionView:
    """What the decision table needs to know about an existing subscription."""
    exclusivity: ExclusivityPolicy
    binding: BindingSpec
    consumers: int
    source: SourceTerms


class Decision(str, enum.Enum):
    CREATE = "create"              # new subscription queue + binding
    REUSE = "reuse"                # attach to the existing queue
    RECREATE = "recreate"          # bindings changed, no consumers: drop and create anew
    ATTACH_EXISTING = "attach-existing"  # null-source lookup found it
    REFUSE = "refuse"


@dataclass(frozen=True)
class AttachDecision:
    decision: Decision
    key: SubscriptionKey | None = None      # None for a private (unnamed) subscription
    queue_name: str | None = None
    exclusivity: ExclusivityPolicy = ExclusivityPolicy.LINK
    lifetime: LifetimePolicy = LifetimePolicy.DELETE_ON_NO_LINKS
    binding: BindingSpec | None = None
    reply_source: SourceTerms | None = None
    condition: str | None = None
    description: str | None = None
    shared: bool = False


def is_global_name(link_name: str) -> bool:
    """`sub|global`, `sub|global2`, `sub|global-volatile1` …"""
    _, sep, suffix = link_name.partition("|")
    return bool(sep) and suffix.startswith("global")


def identity(link_name: str, container_id: str, source: SourceTerms | None) -> tuple[str, str, bool, bool]:
    """(namespace, subscription name, shared, global) for a receiver attach."""
    if source is None or source.is_null:
        shared = "|" in link_name           # only shared consumers carry `|` suffixes
        is_global = is_global_name(link_name)
    else:
        shared = source.has(CAP_SHARED)
        is_global = source.has(CAP_GLOBAL) or is_global_name(link_name)
    name = link_name.split("|", 1)[0] if shared else link_name
    return (GLOBAL_NAMESPACE if is_global else container_id), name, shared, is_global


def reply_source_for(source: SourceTerms, shared: bool, is_global: bool) -> SourceTerms:
    """Echo shared/global, always add topic, distribution-mode copy, keep only the
    filters the broker honours (selector, no-local)."""
    caps = {CAP_TOPIC}
    if shared:
        caps.add(CAP_SHARED)
    if is_global:
        caps.add(CAP_GLOBAL)
    return source.with_(capabilities=frozenset(caps), distribution_mode="copy",
                        filters=source.honoured_filters())


def decide_attach(
    link_name: str,
    container_id: str,
    source: SourceTerms | None,
    binding: BindingSpec | None,
    existing: Mapping[SubscriptionKey, SubscriptionView],
    *,
    max_consumers: int = 0,
) -> AttachDecision:
    """The seed table (rows: null source or not × shared × global × durable)."""
    namespace, name, shared, is_global = identity(link_name, container_id, source)
    if source is None or source.is_null:
        return _null_source(namespace, name, existing)
    assert binding is not None
    durable = source.expiry_policy is ExpiryPolicy.NEVER
    lifetime = lifetime_for(source.expiry_policy)
    reply = reply_source_for(source, shared, is_global)
    if not shared and not durable:
        # Rows "YES|NO|*|NO": a private queue with a random name, exclusivity link.
        return AttachDecision(Decision.CREATE, None, f"qpidsub_/{uuid.uuid4().hex}_/nondurable",
                              ExclusivityPolicy.LINK, lifetime, binding, reply)
    key = SubscriptionKey(namespace, name, durable)
    exclusivity = ExclusivityPolicy.SHARED_SUBSCRIPTION if shared else ExclusivityPolicy.LINK
    base = dict(key=key, queue_name=key.queue_name, exclusivity=exclusivity, lifetime=lifetime,
                binding=binding, reply_source=reply, shared=shared)
    current = existing.get(key)
    if current is None:
        return AttachDecision(Decision.CREATE, **base)
    if current.exclusivity is not exclusivity:
        kind = "shared" if current.exclusivity is ExclusivityPolicy.SHARED_SUBSCRIPTION else "unshared"
        return _refuse(RESOURCE_LOCKED, f"subscription '{name}' already exists as a {kind} subscription")
    if current.binding != binding:
        if current.consumers:
            return _refuse(RESOURCE_LOCKED,
                           f"subscription '{name}' is in use with a different topic, selector or no-local")
        return AttachDecision(Decision.RECREATE, **base)
    if not shared and current.consumers:
        return _refuse(RESOURCE_LOCKED, f"durable subscription '{name}' already has an active consumer")
    if shared and max_consumers and current.consumers >= max_consumers:
        return _refuse(RESOURCE_LIMIT,
                       f"shared subscription '{name}' has reached its limit of {max_consumers} consumers")
    return AttachDecision(Decision.REUSE, **base)


def _null_source(namespace: str, name: str, existing: Mapping[SubscriptionKey, SubscriptionView]) -> AttachDecision:
    """Rows "NO|*|*": look up the durable subscription and answer with its source."""
    key = SubscriptionKey(namespace, name, True)
    current = existing.get(key)
    if current is None:
        return _refuse(NOT_FOUND, f"no durable subscription '{name}'"
                       + (" in the global namespace" if namespace == GLOBAL_NAMESPACE else ""))
    if current.exclusivity is ExclusivityPolicy.LINK and current.consumers:
        return _refuse(RESOURCE_LOCKED, f"durable subscription '{name}' already has an active consumer")
    return AttachDecision(Decision.ATTACH_EXISTING, key, key.queue_name, current.exclusivity,
                          LifetimePolicy.PERMANENT, current.binding, current.source,
                          shared=current.exclusivity is ExclusivityPolicy.SHARED_SUBSCRIPTION)


def _refuse(condition: str, description: str) -> AttachDecision:
    return AttachDecision(Decision.REFUSE, condition=condition, description=description)


class DetachAction(str, enum.Enum):
    KEEP = "keep"                  # subscription stays
    DELETE = "delete"              # delete the subscription queue and its registry links
    REFUSE_LOCKED = "refuse-locked"  # closed=true while others consume: answer resource-locked


def decide_detach(closed: bool, durable: bool, lifetime: LifetimePolicy, other_consumers: int) -> DetachAction:
    """Detach rules: closed=false keeps a subscription; closed=true on a durable one
    deletes it unless other consumers are attached (then resource-locked); a
    non-durable one follows its lifetime policy."""
    if durable:
        if not closed:
            return DetachAction.KEEP
        return DetachAction.REFUSE_LOCKED if other_consumers else DetachAction.DELETE
    if lifetime is LifetimePolicy.DELETE_ON_NO_LINKS and not other_consumers:
        return DetachAction.DELETE
    return DetachAction.KEEP


class Adoption(str, enum.Enum):
    """What a node does with a durable subscription another node hands it because
    the slot map moved the subscription's topic here (cluster/moves.py)."""
    ADOPT = "adopt"      # not here yet: made here as it was there (name, binding, links)
    KEEP = "keep"        # here already under the same binding: an earlier, interrupted move
    REFUSE = "refuse"    # a different subscription of that name is here: never merged


def decide_adoption(existing: SubscriptionView | None, binding: BindingSpec) -> Adoption:
    """A moved subscription's records against what this node holds under its key.
    Its messages are appended either way (at least once: a crash between the
    owner's accept and the old node's removal sends one again)."""
    if existing is None:
        return Adoption.ADOPT
    return Adoption.KEEP if existing.binding == binding else Adoption.REFUSE


def member_copy(sub: "Subscription", member_address: str) -> "Subscription":
    """A durable subscription's copy on one member of its topic, now partitioned
    (`amq.topic/prices.p1`): what a consumer attached through the partitioned name
    makes on that member (cluster/partitioned.py): the same key, queue name, selector
    and no-local, bound to the member's name."""
    exchange, _, key = member_address.partition("/")
    binding = replace(sub.binding, exchange=exchange, key=key)
    return replace(sub, binding=binding, source=sub.source.with_(address=member_address), links=set(sub.links))


def keeps_registry_link(link_name: str) -> bool:
    """Only the names a later null-source lookup uses stay registered: `sub` and
    `sub|global`.  Qpid JMS attaches `sub|2`, `sub|global2`, `sub|volatile1` … and never
    reuses them, so their records go at detach (no leak)."""
    _, sep, suffix = link_name.partition("|")
    return not sep or suffix == "global"


@dataclass
class Subscription:
    key: SubscriptionKey | None
    queue_name: str
    exclusivity: ExclusivityPolicy
    lifetime: LifetimePolicy
    binding: BindingSpec
    source: SourceTerms
    owner_container: str
    created_at: float
    links: set[str] = field(default_factory=set)

    @property
    def durable(self) -> bool:
        return self.key is not None and self.key.durable

    @property
    def shared(self) -> bool:
        return self.exclusivity is ExclusivityPolicy.SHARED_SUBSCRIPTION
