"""Link endpoints: a consumer (broker → client) and a producer (client → broker).

Thin wrappers around proton links: they translate transfers and dispositions into
calls on core queues and the broker, and nothing else.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from proton import Condition, Delivery, Link

from ..core.addresses import AddressNotFound, Resolution
from ..core.message import MalformedMessage, Message, selector_lookup
from ..core.queues import Entry, Outcome, Queue

if TYPE_CHECKING:
    from .handlers import ConnectionHandler

log = logging.getLogger("amqpbroker.links")

_consumer_ids = itertools.count(1)

# Delivery state codes, AMQP 1.0 §3.4.
ACCEPTED = Delivery.ACCEPTED
REJECTED = Delivery.REJECTED
RELEASED = Delivery.RELEASED
MODIFIED = Delivery.MODIFIED
TRANSACTIONAL_STATE = 0x34


class LinkConsumer:
    """A sending link on a queue: implements core.queues.ConsumerPort."""

    def __init__(self, handler: "ConnectionHandler", link: Link, queue: Queue, *,
                 selector: Any = None, no_local: bool = False, browser: bool = False):
        self.consumer_id = next(_consumer_ids)
        self.handler = handler
        self.link = link
        self.queue = queue
        self.selector = selector
        self.no_local = no_local
        self.browser = browser
        self.filtered = selector is not None or no_local
        self.presettled = link.snd_settle_mode == Link.SND_SETTLED
        self.unsettled: dict[str, Entry] = {}
        self._tags = itertools.count(1)
        self.closed = False
        self.ready = True              # False until the attach reply is sent (durable commit)
        self.subscription: Any = None  # set by the subscription layer

    # --- ConsumerPort

    def credit(self) -> int:
        if self.closed or not self.ready or self.handler.protocol.write_paused:
            return 0
        return self.link.credit

    def accepts(self, entry: Entry) -> bool:
        if self.no_local and entry.msg.publisher == self.handler.connection_key:
            return False
        if self.selector is not None:
            try:
                return self.selector.matches(selector_lookup(entry.msg, entry.delivery_count))
            except MalformedMessage:
                # Sections are decoded lazily: a bad application-properties section
                # shows up only here.  It matches no selector; raising would abort
                # dispatch (and the event handler) on every later attempt.
                return False
        return True

    def deliver(self, entry: Entry) -> None:
        tag = str(next(self._tags))  # proton hands tags back as str (bytes2string)
        link = self.link
        dlv = link.delivery(tag)
        link.send(entry.payload())
        link.advance()
        if self.presettled:
            dlv.settle()
            self.queue.settle(entry, Outcome.ACCEPTED)
        else:
            self.unsettled[tag] = entry
        self.handler.protocol.mark_dirty()

    # --- proton events

    def on_flow(self) -> None:
        self.queue.dispatch()
        link = self.link
        if link.drain_mode and link.credit > 0:
            # AMQP 1.0 §2.6.7: a drain request with nothing more to send consumes
            # the credit (delivery-count advances, credit 0, drain echoed).
            link.drained()
        self.handler.protocol.mark_dirty()

    def on_disposition(self, dlv: Delivery) -> None:
        if not (dlv.updated or dlv.settled):
            return
        entry = self.unsettled.pop(dlv.tag, None)
        if entry is None:
            dlv.settle()
            return
        state = dlv.remote_state
        if state == TRANSACTIONAL_STATE:
            self.handler.transactional_ack(self, dlv, entry)
            return
        self.apply_outcome(entry, state, dlv.remote)
        dlv.settle()

    def apply_outcome(self, entry: Entry, state: int, remote: Any) -> None:
        if state == REJECTED:
            self.queue.settle(entry, Outcome.REJECTED)
        elif state == RELEASED:
            self.queue.settle(entry, Outcome.RELEASED)
        elif state == MODIFIED:
            self.queue.settle(entry, Outcome.MODIFIED, delivery_failed=bool(remote.failed),
                              undeliverable_here=bool(remote.undeliverable))
        else:  # accepted, or settled without a state: treat as consumed
            self.queue.settle(entry, Outcome.ACCEPTED)

    def close(self) -> None:
        """The link ended: give back what was not settled, in order."""
        if self.closed:
            return
        self.closed = True
        pending = list(self.unsettled.values())
        self.unsettled.clear()
        self.queue.remove_consumer(self, pending)


class Producer:
    """A receiving link: messages in, routed through the broker, settled in order."""

    def __init__(self, handler: "ConnectionHandler", link: Link, target: Resolution | None,
                 credit: int, max_message_size: int):
        self.handler = handler
        self.link = link
        self.target = target           # None: anonymous relay, route by `to`
        self.window = credit
        self.max_message_size = max_message_size
        # Dispositions go out in arrival order (Qpid JMS completion ordering): a
        # delivery waiting on the store holds back the ones behind it.
        self.in_order: deque[list] = deque()
        link.flow(credit)

    def on_delivery(self, dlv: Delivery) -> None:
        if dlv.aborted:
            dlv.settle()
            return
        if dlv.pending > self.max_message_size:
            self._too_large(dlv)
            return
        if dlv.partial:
            return
        link = self.link
        raw = link.recv(dlv.pending)
        link.advance()
        if link.credit < self.window // 2:
            link.flow(self.window - link.credit)
        self.handler.receive(self, dlv, raw)

    def _too_large(self, dlv: Delivery) -> None:
        log.warning("connection %s: link '%s': message larger than %d bytes refused",
                    self.handler.protocol.peer, self.link.name, self.max_message_size)
        dlv.settle()
        self.link.condition = Condition(
            "amqp:link:message-size-exceeded",
            f"message exceeds the maximum message size of {self.max_message_size} bytes")
        self.link.close()
        self.handler.link_ended(self.link)

    def settle_in_order(self, dlv: Delivery, state: int | None, condition: Condition | None = None,
                        ready: bool = True) -> list:
        """Queue a settlement; emit every settlement at the head that is ready."""
        slot = [dlv, state, condition, ready]
        self.in_order.append(slot)
        if ready:
            self.drain_settlements()
        return slot

    def drain_settlements(self) -> None:
        q = self.in_order
        while q and q[0][3]:
            dlv, state, condition, _ = q.popleft()
            if state is not None and not dlv.settled:
                if condition is not None:
                    dlv.local.condition = condition
                dlv.update(state)
            dlv.settle()


def message_from(raw: bytes, publisher: Any) -> Message:
    """Build a Message or raise MalformedMessage."""
    return Message(raw, publisher=publisher)


__all__ = ["LinkConsumer", "Producer", "message_from", "AddressNotFound", "MalformedMessage",
           "Callable"]
