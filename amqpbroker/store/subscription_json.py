"""The stored (JSON) form of a subscription and its source terms: what
DurabilityManager writes for every durable subscription and reads back at recovery
(and `store verify` checks).  Changing a field here is a store format change
(store/upgrade.py)."""

from __future__ import annotations

from ..core.queues import ExclusivityPolicy, LifetimePolicy
from ..core.subscriptions import BindingSpec, Subscription, SubscriptionKey
from ..core.terms import Durability, ExpiryPolicy, Filter, SourceTerms


def source_to_json(s: SourceTerms) -> dict:
    return {"address": s.address, "durable": int(s.durable), "expiry_policy": s.expiry_policy.value,
            "timeout": s.timeout, "dynamic": s.dynamic, "distribution_mode": s.distribution_mode,
            "capabilities": sorted(s.capabilities),
            "filters": [[f.key, f.descriptor, f.value] for f in s.filters]}


def source_from_json(d: dict) -> SourceTerms:
    return SourceTerms(address=d["address"], durable=Durability(d["durable"]),
                       expiry_policy=ExpiryPolicy(d["expiry_policy"]), timeout=d["timeout"],
                       dynamic=d["dynamic"], distribution_mode=d["distribution_mode"],
                       capabilities=frozenset(d["capabilities"]),
                       filters=tuple(Filter(k, desc, v) for k, desc, v in d["filters"]))


def subscription_to_json(sub: Subscription) -> dict:
    b = sub.binding
    return {"key": [sub.key.namespace, sub.key.name, sub.key.durable] if sub.key else None,
            "queue": sub.queue_name, "exclusivity": sub.exclusivity.value, "lifetime": sub.lifetime.value,
            "binding": [b.exchange, b.key, b.selector, b.no_local], "source": source_to_json(sub.source),
            "owner": sub.owner_container, "created": sub.created_at, "links": sorted(sub.links)}


def subscription_from_json(d: dict) -> Subscription:
    key = SubscriptionKey(*d["key"]) if d["key"] else None
    return Subscription(key, d["queue"], ExclusivityPolicy(d["exclusivity"]), LifetimePolicy(d["lifetime"]),
                        BindingSpec(*d["binding"]), source_from_json(d["source"]), d["owner"],
                        d["created"], set(d["links"]))
