"""Consumer attaches (the broker's sending links): read the source, ask the core
(address resolution, subscription decision table), answer with the reply source."""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, Any

from proton import Link, symbol

from ..core.addresses import TEMP_PREFIX, AddressKind, AddressNotFound
from ..core.broker import QueueLimit
from ..core.queues import ExclusivityPolicy, LifetimePolicy, Queue
from ..core.selectors import SelectorError, check_length, compile_selector
from ..core.subscriptions import (
    RESOURCE_LIMIT,
    RESOURCE_LOCKED,
    BindingSpec,
    Decision,
    lifetime_for,
)
from ..core.terms import CAP_TOPIC, SourceTerms
from ..security.guard import UNAUTHORIZED
from .links import LinkConsumer, session_key
from .peer_fields import link_property
from .refusal import AttachRefused
from .sequence import attach_range_reader, range_filter
from .terminus import read_source, write_source

if TYPE_CHECKING:
    from .ports import AttachOwner

log = logging.getLogger("amqpbroker.attach")


# A link property: the consumer is its queue's second choice (core/queues.py
# `_offer_first_choice`): set by another node's consumer of a partitioned destination
# that has a member of its own (cluster/fanin.py).  A client may set it on its own
# links too: it only ever holds that consumer back.
STANDBY = symbol("amqpbroker:standby")


def asks_standby(link: Link) -> bool:
    return link_property(link, STANDBY) is True


# A link property, asked and answered: an attach that carries it (any value) is told,
# by the same property set to true in the reply, that it created the durable
# subscription it names (a new one, or one made again with new terms).  Another
# node's fan-in consumer of a partitioned topic asks it (cluster/partitioned.py): a
# client's attach refused by one member must not leave, on the members that
# accepted it, a copy that this attach created and that nobody would ever read.
CREATED = symbol("amqpbroker:created")


def temp_name(kind: str, cluster: Any = None) -> str:
    """Addresses of temporary nodes: unguessable, and recognisable in listings; in a
    cluster they name the node that holds them (core/placement.py temp_node)."""
    if cluster is not None:
        return f"{TEMP_PREFIX}{kind}.{cluster.node}.{uuid.uuid4().hex}"
    return f"{TEMP_PREFIX}{kind}.{uuid.uuid4().hex}"


class ConsumerAttacher:
    def __init__(self, handler: "AttachOwner"):
        self.handler = handler
        self.server = handler.server
        self.broker = handler.broker

    def attach(self, link: Link, address: str | None = None) -> LinkConsumer:
        """The consumer of an attach; `address`: served from that address instead of
        the source's, the reply still naming the client's (a partitioned
        destination's member on this node, cluster/fanin.py)."""
        source = read_source(link.remote_source)
        shown = None
        if address is not None:
            shown, source = source.address, source.with_(address=address)
        if source.filters:
            flt = range_filter(source)
            if flt is not None:   # a log read by sequence number (server/sequence.py)
                return attach_range_reader(self, link, source, flt)
        selector = self._selector(source)
        if source.dynamic:
            return self._attach_dynamic(link, source, selector)
        if source.is_null:
            return self._attach_subscription(link, None, None, selector)
        if not source.address:
            raise AttachRefused("amqp:not-found", "source has no address")
        try:
            resolution = self.broker.resolve(source.address, topic=source.has(CAP_TOPIC))
        except AddressNotFound as exc:
            raise AttachRefused("amqp:not-found", exc.why) from None
        if not self.broker.may_consume(resolution.name, self.handler):
            raise AttachRefused(UNAUTHORIZED,
                                f"temporary destination '{resolution.name}' can be consumed only by "
                                f"the connection that created it")
        if resolution.kind is AddressKind.EXCHANGE:
            exchange = self.broker.exchanges[resolution.name]
            key = resolution.key if resolution.key is not None else exchange.default_key()
            binding = BindingSpec(resolution.name, key, source.selector, source.no_local)
            return self._attach_subscription(link, source, binding, selector, shown)
        if resolution.kind is AddressKind.NEW_QUEUE:
            try:
                queue = self.broker.auto_create(resolution.name, self.handler.protocol.user)
            except QueueLimit as exc:
                raise AttachRefused(RESOURCE_LIMIT, str(exc)) from None
        else:
            queue = self.broker.queues[resolution.name]
        return self._attach_queue(link, source, queue, selector, shown)

    def _selector(self, source: SourceTerms) -> Any:
        text = source.selector
        if text is None:
            return None
        try:
            check_length(text, self.server.settings.limits.max_selector_length)
            return compile_selector(text)
        except SelectorError as exc:
            raise AttachRefused("amqp:invalid-field", f"Invalid JMS Selector: {exc}") from None

    # ------------------------------------------------------------------ queues

    def _attach_queue(self, link: Link, source: SourceTerms, queue: Queue, selector: Any,
                      shown: str | None = None) -> LinkConsumer:
        browser = source.distribution_mode == "copy"
        if queue.exclusivity is ExclusivityPolicy.LINK and queue.consumers:
            raise AttachRefused(RESOURCE_LOCKED, f"queue '{queue.name}' has an exclusive consumer")
        reply = source.with_(filters=source.honoured_filters())
        return self._open(link, _shown(reply, shown), queue, selector, source.no_local, browser)

    def _attach_dynamic(self, link: Link, source: SourceTerms, selector: Any) -> LinkConsumer:
        """A dynamic source (AMQP 1.0 §3.5.3; a reply queue): a fresh queue that
        lives as long as this link (or its connection)."""
        name = temp_name("queue", self.server.cluster)
        self.broker.declare_temporary(name, self.handler)
        queue = self.broker.queues[name]
        queue.owner = self.handler   # deleted with the connection (and with this link)
        reply = source.with_(address=name, filters=())
        consumer = self._open(link, reply, queue, selector, source.no_local, False)
        consumer.temp_node = ("queue", name)
        return consumer

    # ------------------------------------------------------------------ subscriptions

    def _attach_subscription(self, link: Link, source: SourceTerms | None, binding: BindingSpec | None,
                             selector: Any, shown: str | None = None) -> LinkConsumer:
        h = self.handler
        registry = self.server.subscriptions
        decision = registry.decide(link.name, h.container_id, source, binding)
        if decision.decision is Decision.REFUSE:
            raise AttachRefused(decision.condition, decision.description)
        if decision.decision is Decision.RECREATE:
            existing = registry.subscriptions.get(decision.key)
            refusal = existing and self.server.access.replace_refusal(h.protocol.user, existing)
            if refusal:
                raise AttachRefused(UNAUTHORIZED, f"subscription '{decision.key.name}' exists: {refusal}")
        owner = self._owner(link, source)
        sub, queue = registry.apply(decision, link_name=link.name, container_id=h.container_id,
                                    owner=owner, now=self.broker.clock())
        if decision.decision is Decision.ATTACH_EXISTING and source is None:
            selector = _compile_quiet(sub.binding.selector)
        if (sub.durable and decision.decision in (Decision.CREATE, Decision.RECREATE)
                and link_property(link, CREATED) is not None):
            link.properties = {CREATED: True}
        no_local = sub.binding.no_local
        # A durable subscription exists for the client once the attach reply arrives:
        # send the reply only after its records are on disk.
        durable = sub.durable and self.server.store.persistent
        consumer = self._open(link, _shown(decision.reply_source, shown), queue, selector, no_local, False,
                              defer=durable)
        consumer.subscription = sub
        return consumer

    def _owner(self, link: Link, source: SourceTerms | None) -> Any:
        """The entity a non-durable subscription queue's lifetime is tied to."""
        if source is None:
            return None
        lifetime = lifetime_for(source.expiry_policy)
        if lifetime is LifetimePolicy.DELETE_ON_SESSION_END:
            return session_key(link.session)
        if lifetime is LifetimePolicy.DELETE_ON_CONNECTION_CLOSE:
            return self.handler
        return None

    # ------------------------------------------------------------------ reply

    def _open(self, link: Link, reply: SourceTerms, queue: Queue, selector: Any, no_local: bool,
              browser: bool, defer: bool = False) -> LinkConsumer:
        write_source(link.source, reply)
        link.target.copy(link.remote_target)
        link.snd_settle_mode = link.remote_snd_settle_mode
        link.rcv_settle_mode = link.remote_rcv_settle_mode
        consumer = LinkConsumer(self.handler, link, queue, selector=selector, no_local=no_local,
                                browser=browser)
        if asks_standby(link):
            consumer.standby = True
        self.handler.consumers.append(consumer)
        if not defer:
            link.open()
            queue.add_consumer(consumer)
            return consumer
        # Counted as a consumer at once (the decision table sees it), silent until then.
        consumer.ready = False
        queue.add_consumer(consumer)
        self.server.store.after_commit(lambda err: self._opened(consumer, err))
        return consumer

    def _opened(self, consumer: LinkConsumer, error: BaseException | None) -> None:
        if consumer.closed or self.handler.ended:
            return
        if error is not None:
            self.handler.refuse_after(consumer.link, "amqp:resource-limit-exceeded",
                                      f"subscription could not be stored: {error}")
            return
        consumer.link.open()
        consumer.ready = True
        consumer.queue.dispatch()
        self.handler.protocol.mark_dirty()


def _shown(reply: SourceTerms, address: str | None) -> SourceTerms:
    return reply if address is None else reply.with_(address=address)


def _compile_quiet(text: str | None) -> Any:
    return compile_selector(text) if text else None

