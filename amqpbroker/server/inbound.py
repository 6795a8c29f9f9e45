"""Transfers in: a complete message from a producer link is checked, routed through
the broker (or staged in a transaction, or passed to the node that owns its address),
and answered in the session's order once it is safe (AMQP 1.0 §3.4: Accepted means
stored).  The functions take the connection's handler first; ConnectionHandler
uses them as its `receive` and `route` methods."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from cproton import lib
from proton import Condition

from ..core.addresses import AddressNotFound, Resolution
from ..core.broker import QueueLimit
from ..core.message import MalformedMessage, Message
from ..core.subscriptions import RESOURCE_LIMIT
from ..security.guard import UNAUTHORIZED
from .coordinator import TRANSACTIONAL_STATE, stage_send
from .links import ACCEPTED, REJECTED
from .sequence import dedup_publish

if TYPE_CHECKING:
    from .ports import LinkOwner
    from .producers import Producer

log = logging.getLogger("amqpbroker.connection")

_REFUSALS = (MalformedMessage, AddressNotFound, QueueLimit)   # what a received message may be refused for


def receive(handler: "LinkOwner", producer: Producer, dlv: Any, raw: bytes) -> None:
    """A complete message arrived on a producer link."""
    store = handler.server.store
    try:
        msg = Message(raw, publisher=handler.connection_key)
        # What routing reads, read once here: a wrong-typed field (priority as a
        # string, a NaN delivery delay, a group-id that is not text ...) is
        # rejected now, never met by a queue.
        msg.routing_times()
        if msg.durable and store.full:
            why = getattr(store, "degraded", None)
            _reject(handler, producer, dlv, RESOURCE_LIMIT,
                         f"durable messages are refused for now: {why}" if why else "message store is full")
            return
        target = producer.target
        if producer.partition is not None:   # a partitioned destination's member here
            target = handler.server.cluster.partition_target(handler, producer, dlv, msg)
            if target is None:
                return   # another node's member: settled with that node's outcome
        if target is None:
            if handler.server.access.enabled:
                denied = handler.server.access.relay_denied(handler.protocol.user, msg)
                if denied is not None:
                    _reject(handler, producer, dlv, UNAUTHORIZED, denied)
                    return
            cluster = handler.server.cluster
            if cluster is not None and cluster.relay(handler, producer, dlv, msg):
                return   # another node owns it; settled with that node's outcome
            target = handler.broker.resolve_for_relay(msg)
            # A relay transfer for a block queue without room waits, and so do the
            # ones after it (server/flow.py).
            if producer.parked:
                producer.park(dlv, msg, target, None)
                return
            full = handler.server.flow.relay_wait(msg, target)
            if full is not None:
                producer.park(dlv, msg, target, full)
                return
    except _REFUSALS as exc:
        _refused(handler, producer, dlv, exc)
        return
    route(handler, producer, dlv, msg, target)


def route(handler: "LinkOwner", producer: Producer, dlv: Any, msg: Message, target: Resolution) -> None:
    """Stage, or publish and answer, a received message whose target is known."""
    store = handler.server.store
    try:
        if lib.pn_delivery_remote_state(dlv) == TRANSACTIONAL_STATE:
            stage_send(handler, producer, dlv, msg, target)
            return
        if handler.server.settings.duplicate_detection:
            if dedup_publish(handler, producer, dlv, msg, target):
                return   # a duplicate: settled and dropped
        else:
            handler.broker.publish(msg, target, handler.protocol.user)
    except _REFUSALS as exc:
        _refused(handler, producer, dlv, exc)
        return
    if lib.pn_delivery_settled(dlv):  # pre-settled by the producer: nothing to answer
        lib.pn_delivery_settle(dlv)
        return
    if msg.store_id is not None and store.persistent:
        producer.accept_after_commit(dlv, store)   # once on disk (group commit)
    else:
        producer.settle_in_order(dlv, ACCEPTED)


def _refused(handler: "LinkOwner", producer: Producer, dlv: Any, exc: Exception) -> None:
    """Answer a message the broker refuses: rejected with the condition."""
    if isinstance(exc, MalformedMessage):
        _reject(handler, producer, dlv, "amqp:decode-error", str(exc))
    elif isinstance(exc, AddressNotFound):
        _reject(handler, producer, dlv, "amqp:not-found", exc.why)
    else:
        _reject(handler, producer, dlv, RESOURCE_LIMIT, str(exc))


def _reject(handler: "LinkOwner", producer: Producer, dlv: Any, condition: str, description: str) -> None:
    log.warning("connection %s: message on link '%s' rejected: %s: %s", handler.protocol.peer,
                producer.link.name, condition, description)
    if lib.pn_delivery_settled(dlv):
        lib.pn_delivery_settle(dlv)
        return
    producer.settle_in_order(dlv, REJECTED, Condition(condition, description))
