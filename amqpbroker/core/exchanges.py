"""Exchanges and bindings: direct, topic and fanout routing (the Qpid Broker-J /
AMQP 0-9-1 exchange model that the shared-subscription table assumes).

Topic keys are dot-separated words; in a binding key `*` matches exactly one word
and `#` matches zero or more words.  Routing results are cached per routing key
and the cache is dropped whenever the bindings change.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from .topics import topic_matches

if TYPE_CHECKING:
    from .message import Message
    from .queues import Queue


class ExchangeType(str, enum.Enum):
    DIRECT = "direct"
    TOPIC = "topic"
    FANOUT = "fanout"


# A binding filter gets the message and says whether the queue takes it
# (JMS selector, no-local); None means "take everything".
BindingFilter = Callable[["Message"], bool]


@dataclass(eq=False)
class Binding:
    exchange: str
    key: str
    queue: "Queue"
    filter: BindingFilter | None = None
    arguments: dict[str, Any] = field(default_factory=dict)  # selector text, no-local… as declared


def binding_matches(kind: ExchangeType, binding_key: str, routing_key: str) -> bool:
    """Whether a binding with `binding_key` on an exchange of this type takes a message
    routed with `routing_key`: the test `Exchange.route` applies to each binding (the
    topic log decides by it which subscriptions a stored message reached)."""
    if kind is ExchangeType.FANOUT:
        return True
    if kind is ExchangeType.DIRECT:
        return binding_key == routing_key
    return topic_matches(binding_key, routing_key)


_ROUTE_CACHE_LIMIT = 10_000


class Exchange:
    def __init__(self, name: str, type: ExchangeType, *, durable: bool = True, builtin: bool = False):
        self.name = name
        self.type = ExchangeType(type)
        self.durable = durable
        self.builtin = builtin
        self.bindings: list[Binding] = []
        self._cache: dict[str, tuple[Binding, ...]] = {}

    def default_key(self) -> str:
        """The binding key for a receiver that named this exchange with no key:
        everything on a topic exchange (Broker-J binds `#`), else the empty key."""
        return "#" if self.type is ExchangeType.TOPIC else ""

    def bind(self, binding: Binding) -> None:
        self.bindings.append(binding)
        self._cache.clear()

    def unbind(self, binding: Binding) -> None:
        try:
            self.bindings.remove(binding)
        except ValueError:
            return
        self._cache.clear()

    def unbind_queue(self, queue: "Queue") -> list[Binding]:
        removed = [b for b in self.bindings if b.queue is queue]
        if removed:
            self.bindings = [b for b in self.bindings if b.queue is not queue]
            self._cache.clear()
        return removed

    def route(self, key: str) -> tuple[Binding, ...]:
        """Bindings whose key matches the routing key."""
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        if self.type is ExchangeType.FANOUT:
            matched = tuple(self.bindings)
        elif self.type is ExchangeType.DIRECT:
            matched = tuple(b for b in self.bindings if b.key == key)
        else:
            matched = tuple(b for b in self.bindings if topic_matches(b.key, key))
        if len(self._cache) >= _ROUTE_CACHE_LIMIT:
            self._cache.clear()
        self._cache[key] = matched
        return matched
