"""FlowGate: how much credit a producer link may get, who tops it up when it may again,
and when an anonymous-relay transfer must wait for room.

Credit is how a receiver paces a sender (AMQP 1.0 §2.6.7): a producer that gets no
more credit sends nothing more, without a refusal.  Two things limit it:

* the memory and disk alarms (core/alarms.py), broker-wide, as RabbitMQ blocks
  publishers: while `alarms.blocking`, no producer is topped up; when it clears (the
  `Alarms.subscribe` callback) every producer held is;
* queues with overflow `block` (core/limits.py; ActiveMQ Artemis's address-full-policy
  BLOCK) that a producer's target reaches (the queue, or any queue an exchange target
  routes to): the producers feeding a block queue share the room it has left as credit
  (core/credit.py: an even share each, never more than the room altogether, counting
  what each already holds and what open transactions staged).  A producer granted
  nothing, with nothing outstanding, is held until that queue may have room again,
  woken by the message that leaves (`Queue.wait_for_room`), a rollback, or another
  producer of that queue going, never by a polling timer.

**Anonymous-relay producers** (no target: each message names its address) cannot be
given credit from a queue's room before their messages say where they go.  The queues
a relay feeds are those its messages are for: a relay transfer for a block queue with
no room left (`relay_wait`) waits at the broker, unsettled and not queued, and so do the
relay's later transfers (in order); the relay gets no more credit until they have gone
in.  So at most its credit window waits, and the queue never goes over.

Consumers are never held: they are how a full queue or a memory alarm drains.
Producers are woken on the next loop turn (`call_soon`): the message that makes room
is being settled inside a queue's dispatch, which must not re-enter a link.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable

from ..core.addresses import AddressKind
from ..core.credit import room, share, top_up_below
from ..core.limits import Overflow

if TYPE_CHECKING:
    import asyncio

    from ..core.addresses import Resolution
    from ..core.alarms import Alarms
    from ..core.broker import Broker
    from ..core.message import Message
    from ..core.queues import Queue
    from ..core.transactions import TransactionRegistry
    from .producers import Producer

log = logging.getLogger("amqpbroker.flow")

ALARM = "alarm"   # Producer.held: by the alarms (else the Queue it waits for, or None)


class FlowGate:
    def __init__(self, loop: "asyncio.AbstractEventLoop", broker: "Broker", alarms: "Alarms | None",
                 transactions: "TransactionRegistry | None" = None):
        self.loop = loop
        self.broker = broker
        self.alarms = alarms
        self.transactions = transactions
        self.by_alarm: set["Producer"] = set()
        self.by_queue: dict["Queue", set["Producer"]] = {}
        # Block queues → the producers with a target that feed them (Producer.feeds).
        self.feeders: dict["Queue", set["Producer"]] = {}
        self.held_total = 0            # times a producer was held (metrics)
        if alarms is not None:
            alarms.subscribe(self._alarms_changed)

    # ------------------------------------------------------------------ credit

    def grant(self, producer: "Producer", outstanding: int) -> int:
        """How much more credit to give `producer`, which holds `outstanding` (credit not
        used yet, and transfers that arrived but are not taken yet).  0 with nothing
        outstanding: it is held, and topped up (`Producer.top_up`) when what held it may
        be gone.  Sets `producer.low`, the credit below which it asks again."""
        window = producer.window
        alarms = self.alarms
        if alarms is not None and alarms.blocking:
            if outstanding <= 0:
                self._hold(producer, ALARM)
                self.by_alarm.add(producer)
            return 0
        target = producer.target
        queues = self.block_queues(target) if target is not None else ()
        if queues != producer.feeds:
            self._feed(producer, queues)
        allowed, limiting = window, None
        for queue in queues:
            can = self._share(producer, queue, window)
            if can < allowed:
                allowed, limiting = can, queue
        producer.low = top_up_below(allowed)
        more = allowed - outstanding
        if more > 0:
            return more
        if outstanding <= 0 and limiting is not None:
            self.hold_on(producer, limiting)
        return 0

    def _share(self, producer: "Producer", queue: "Queue", window: int) -> int:
        """The credit `producer` may hold for this block queue (core/credit.py)."""
        staged, staged_bytes = self.staged_on(queue)
        depth = queue.depth
        expected = max(producer.last_size, queue.bytes // depth if depth else 0)
        left = room(queue.limits, depth, queue.bytes, staged, staged_bytes, expected)
        if left is None:   # its limits changed since it was listed
            return window
        feeders = self.feeders.get(queue, ())
        reserved = sum(p.outstanding() for p in feeders if p is not producer)
        return share(left, reserved, len(feeders), window)

    def staged_on(self, queue: "Queue") -> tuple[int, int]:
        txns = self.transactions
        return txns.staged_on(queue) if txns is not None else (0, 0)

    def block_queues(self, target: "Resolution") -> tuple["Queue", ...]:
        """The queues with overflow `block` a producer's target reaches: the queue; for an
        exchange, every queue bound to it (only those its fixed key routes to)."""
        broker = self.broker
        if target.kind is not AddressKind.EXCHANGE:
            queue = broker.queues.get(target.name)
            if queue is None or queue.limits is None or queue.limits.overflow is not Overflow.BLOCK:
                return ()
            return (queue,)
        exchange = broker.exchanges.get(target.name)
        if exchange is None:
            return ()
        bindings: Iterable[Any] = exchange.bindings if target.key is None else exchange.route(target.key)
        found: dict[int, "Queue"] = {}
        for binding in bindings:
            queue = binding.queue
            if queue.limits is not None and queue.limits.overflow is Overflow.BLOCK:
                found[id(queue)] = queue
        return tuple(found.values())

    def _feed(self, producer: "Producer", queues: tuple["Queue", ...]) -> None:
        for queue in producer.feeds:
            feeders = self.feeders.get(queue)
            if feeders is not None:
                feeders.discard(producer)
                if not feeders:
                    del self.feeders[queue]
        for queue in queues:
            feeders = self.feeders.get(queue)
            if feeders is None:
                feeders = self.feeders[queue] = set()
            feeders.add(producer)
        producer.feeds = queues

    # ------------------------------------------------------------------ anonymous relay

    def relay_wait(self, msg: "Message", target: "Resolution") -> "Queue | None":
        """The block queue a relay transfer must wait for (no room left for it, counting
        what the producers with a target hold and what transactions staged), or None."""
        broker = self.broker
        if target.kind is AddressKind.EXCHANGE:
            queues = broker.route(target.name, target.key, msg)
        else:
            queue = broker.queues.get(target.name)
            queues = [queue] if queue is not None else []
        for queue in queues:
            limits = queue.limits
            if limits is None or limits.overflow is not Overflow.BLOCK:
                continue
            staged, staged_bytes = self.staged_on(queue)
            left = room(limits, queue.depth, queue.bytes, staged, staged_bytes, msg.size)
            reserved = sum(p.outstanding() for p in self.feeders.get(queue, ()))
            if left is not None and left - reserved <= 0:
                return queue
        return None

    # ------------------------------------------------------------------ holding and waking

    def hold_on(self, producer: "Producer", queue: "Queue") -> None:
        """Hold `producer` until this queue may have room."""
        self._hold(producer, queue)
        waiting = self.by_queue.get(queue)
        if waiting is None:
            waiting = self.by_queue[queue] = set()
        waiting.add(producer)
        queue.wait_for_room(self._room)

    def forget(self, producer: "Producer") -> None:
        """The producer's link ended: it holds nothing, feeds nothing."""
        held = producer.held
        producer.held = None
        if held is ALARM:
            self.by_alarm.discard(producer)
        elif held is not None:
            waiting = self.by_queue.get(held)
            if waiting is not None:
                waiting.discard(producer)
        fed = producer.feeds
        if fed:
            self._feed(producer, ())
            for queue in fed:   # the credit it held is room for the others again
                if self.by_queue.get(queue):
                    self._room(queue)

    @property
    def held(self) -> int:
        """Producers held now."""
        return len(self.by_alarm) + sum(len(w) for w in self.by_queue.values())

    def _hold(self, producer: "Producer", why: Any) -> None:
        if producer.held is None:
            self.held_total += 1
        producer.held = why

    def _room(self, queue: "Queue") -> None:
        waiting = self.by_queue.pop(queue, None)
        if waiting:
            self.loop.call_soon(self._wake, waiting)

    def _alarms_changed(self, blocking: bool) -> None:
        if blocking or not self.by_alarm:
            return
        waiting, self.by_alarm = self.by_alarm, set()
        self.loop.call_soon(self._wake, waiting)

    @staticmethod
    def _wake(producers: Iterable["Producer"]) -> None:
        for producer in producers:
            producer.held = None
            handler = producer.handler
            # Only a producer still its link's endpoint: an ended link may be freed.
            if handler.ended or producer.released or handler.endpoints.get(producer.impl) is not producer:
                continue
            producer.top_up()   # decides again (another queue, a new alarm, the room shared)


__all__ = ["ALARM", "FlowGate"]
