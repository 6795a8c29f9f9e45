"""The subscription registry: subscriptions by key, registry links by
(namespace, link name), and the application of attach/detach decisions to the
broker model.  Pure state; no I/O."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any, Callable

from .broker import Broker
from .message import Message, selector_accepts
from .selectors import compile_selector
from .queues import Queue
from .subscriptions import (
    Adoption,
    AttachDecision,
    BindingSpec,
    Decision,
    DetachAction,
    Subscription,
    SubscriptionKey,
    SubscriptionView,
    decide_adoption,
    decide_attach,
    decide_detach,
    keeps_registry_link,
)

log = logging.getLogger("amqpbroker.subscriptions")

# Builds a binding filter from (selector text, no-local owner container) or None.
FilterFactory = Callable[[str | None, str | None], Callable[[Message], bool] | None]


def subscription_filter(selector_text: str | None, no_local_owner: str | None) -> Callable[[Message], bool] | None:
    """The binding filter of a subscription: its JMS selector and/or no-local by
    client-id (None when it has neither).  Never raises (`selector_accepts`)."""
    selector = compile_selector(selector_text) if selector_text else None
    if selector is None and no_local_owner is None:
        return None

    def accept(msg: Message) -> bool:
        if no_local_owner is not None and msg.publisher == no_local_owner:
            return False
        return selector is None or selector_accepts(selector, msg, msg.delivery_count)

    return accept


class SubscriptionRegistry:
    def __init__(self, broker: Broker, filter_factory: FilterFactory):
        self.broker = broker
        self.filter_factory = filter_factory
        self.subscriptions: dict[SubscriptionKey, Subscription] = {}
        self.by_queue: dict[str, Subscription] = {}
        self.links: dict[tuple[str, str], SubscriptionKey] = {}
        # Store hooks (durable subscriptions and their registry links).
        self.on_saved: Callable[[Subscription], None] | None = None
        self.on_deleted: Callable[[Subscription], None] | None = None

    # ------------------------------------------------------------------ views

    def view(self) -> Mapping[SubscriptionKey, SubscriptionView]:
        """What the decision table sees of the subscriptions: built per key on lookup,
        so an attach costs the same with 10 subscriptions or 100,000."""
        return _Views(self)

    def decide(self, link_name: str, container_id: str, source, binding: BindingSpec | None) -> AttachDecision:
        return decide_attach(link_name, container_id, source, binding, self.view(),
                             max_consumers=self.broker.policy.max_consumers_per_subscription)

    # ------------------------------------------------------------------ attach

    def apply(self, decision: AttachDecision, *, link_name: str, container_id: str, owner: Any,
              now: float) -> tuple[Subscription, Queue]:
        """Carry out a non-refusal decision; return the subscription and its queue."""
        d = decision
        if d.decision is Decision.RECREATE:
            old = self.subscriptions.get(d.key)
            queue = self.broker.queues.get(d.queue_name)
            dropped = queue.depth if queue else 0
            log.warning("subscription %s: topic/selector/no-local changed; recreated, "
                        "backlog of %d message(s) dropped", d.key.name, dropped)
            if old is not None:
                self._delete(old)
        if d.decision in (Decision.CREATE, Decision.RECREATE):
            sub = self._create(d, container_id, owner, now)
        else:
            sub = self.subscriptions[d.key]
        if d.key is not None:
            namespace = d.key.namespace
            self.links[(namespace, link_name)] = d.key
            if link_name not in sub.links and keeps_registry_link(link_name):
                sub.links.add(link_name)
                self._saved(sub)
        queue = self.broker.queues[sub.queue_name]
        return sub, queue

    def adopt(self, moved: Subscription) -> tuple[Adoption, Subscription | None]:
        """A durable subscription moved here from another node (cluster/moves.py):
        made as it was there (queue name, binding, source terms, client-id, the
        registry links a later null-source lookup uses) when absent (`decide_adoption`)."""
        existing = self.subscriptions.get(moved.key)
        view = self.view().get(moved.key) if existing is not None else None
        verdict = decide_adoption(view, moved.binding)
        if verdict is not Adoption.ADOPT:
            return verdict, existing if verdict is Adoption.KEEP else None
        d = AttachDecision(Decision.CREATE, moved.key, moved.queue_name, moved.exclusivity, moved.lifetime,
                           moved.binding, moved.source, shared=moved.shared)
        sub = self._create(d, moved.owner_container, None, moved.created_at)
        for name in moved.links:
            self.links[(moved.key.namespace, name)] = moved.key
            sub.links.add(name)
        self._saved(sub)
        return verdict, sub

    def _create(self, d: AttachDecision, container_id: str, owner: Any, now: float) -> Subscription:
        b = d.binding
        durable = d.key is not None and d.key.durable
        queue = self.broker.declare_queue(
            d.queue_name, durable=durable, exclusivity=d.exclusivity, lifetime=d.lifetime,
            owner=None if durable else owner)
        # An unshared subscription's no-local also covers messages its own client-id
        # published while it was away (the container-id is the JMS clientID).
        no_local_owner = container_id if (b.no_local and not d.shared) else None
        binding_filter = self.filter_factory(b.selector, no_local_owner)
        self.broker.bind(b.exchange, b.key, queue, binding_filter,
                         {"selector": b.selector, "no_local": b.no_local,
                          "no_local_owner": no_local_owner})
        sub = Subscription(d.key, d.queue_name, d.exclusivity, d.lifetime, b, d.reply_source,
                           container_id, now)
        self.by_queue[d.queue_name] = sub
        if d.key is not None:
            self.subscriptions[d.key] = sub
            self._saved(sub)
        return sub

    def _saved(self, sub: Subscription) -> None:
        if sub.durable and self.on_saved is not None:
            self.on_saved(sub)

    # ------------------------------------------------------------------ detach

    def detach(self, sub: Subscription, link_name: str, *, closed: bool) -> DetachAction:
        """A consumer link of `sub` detached (its consumer is already removed from the queue)."""
        queue = self.broker.queues.get(sub.queue_name)
        others = len(queue.consumers) if queue else 0
        action = decide_detach(closed, sub.durable, sub.lifetime, others)
        if sub.key is None and not others:
            # A private subscription (random queue name, exclusivity link): no attach can
            # ever reach its queue again, so keeping it until the session/connection ends
            # (session-end is proton's default expiry policy) would only pile up copies.
            action = DetachAction.DELETE
        if sub.key is not None and (closed or not keeps_registry_link(link_name)):
            if action is not DetachAction.REFUSE_LOCKED:
                self.links.pop((sub.key.namespace, link_name), None)
                if link_name in sub.links:
                    sub.links.discard(link_name)
                    if action is not DetachAction.DELETE:
                        self._saved(sub)
        if action is DetachAction.DELETE:
            self._delete(sub)
        return action

    def delete(self, sub: Subscription) -> None:
        self._delete(sub)

    def _delete(self, sub: Subscription) -> None:
        """Delete the queue and every registry link of the subscription."""
        self.broker.delete_queue(sub.queue_name)
        self.by_queue.pop(sub.queue_name, None)
        if sub.key is not None:
            self.subscriptions.pop(sub.key, None)
            for name in list(sub.links):
                self.links.pop((sub.key.namespace, name), None)
            sub.links.clear()
            if sub.durable and self.on_deleted is not None:
                self.on_deleted(sub)

    def owned_by(self, owner: Any) -> list[Subscription]:
        return [s for s in self.by_queue.values()
                if (q := self.broker.queues.get(s.queue_name)) is not None and q.owner is owner]

    def restore(self, sub: Subscription) -> None:
        """Re-register a durable subscription rebuilt by the store."""
        self.by_queue[sub.queue_name] = sub
        if sub.key is not None:
            self.subscriptions[sub.key] = sub
            for name in sub.links:
                self.links[(sub.key.namespace, name)] = sub.key


class _Views(Mapping):
    """SubscriptionRegistry.view(): a SubscriptionView per key, made when asked for."""

    __slots__ = ("registry",)

    def __init__(self, registry: SubscriptionRegistry):
        self.registry = registry

    def __getitem__(self, key: SubscriptionKey) -> SubscriptionView:
        sub = self.registry.subscriptions[key]
        queue = self.registry.broker.queues.get(sub.queue_name)
        return SubscriptionView(sub.exclusivity, sub.binding, len(queue.consumers) if queue else 0, sub.source)

    def __iter__(self) -> Iterator[SubscriptionKey]:
        return iter(self.registry.subscriptions)

    def __len__(self) -> int:
        return len(self.registry.subscriptions)
