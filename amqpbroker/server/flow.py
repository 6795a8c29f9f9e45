"""FlowGate: whether a producer link may get more credit, and who tops it up when it
may again.

Credit is how a receiver paces a sender (AMQP 1.0 §2.6.7): a producer that gets no
more credit sends nothing more, without a refusal.  Two things withhold it:

* the memory and disk alarms (core/alarms.py), broker-wide, as RabbitMQ blocks
  publishers: while `alarms.blocking`, no producer is topped up; when it clears (the
  `Alarms.subscribe` callback) every producer held is;
* a full queue whose overflow is `block` (core/limits.py; ActiveMQ Artemis's
  address-full-policy BLOCK): a producer whose target reaches it (the queue, or any
  queue an exchange target routes to) is held until that queue has room again, woken
  by the message that leaves it (`Queue.wait_for_room`), never by a polling timer.

Consumers are never held: they are how a full queue or a memory alarm drains.
Producers are woken on the next loop turn (`call_soon`): the message that makes room
is being settled inside a queue's dispatch, which must not re-enter a link.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable

from ..core.addresses import AddressKind

if TYPE_CHECKING:
    import asyncio

    from ..core.addresses import Resolution
    from ..core.alarms import Alarms
    from ..core.broker import Broker
    from ..core.queues import Queue
    from .links import Producer

log = logging.getLogger("amqpbroker.flow")

ALARM = "alarm"   # Producer.held: by the alarms (else the Queue it waits for, or None)


class FlowGate:
    def __init__(self, loop: "asyncio.AbstractEventLoop", broker: "Broker", alarms: "Alarms | None"):
        self.loop = loop
        self.broker = broker
        self.alarms = alarms
        self.by_alarm: set["Producer"] = set()
        self.by_queue: dict["Queue", set["Producer"]] = {}
        self.held_total = 0            # times a producer was held (metrics)
        if alarms is not None:
            alarms.subscribe(self._alarms_changed)

    def may_grant(self, producer: "Producer") -> bool:
        """True: give the producer credit now.  False: it is held, and topped up
        (`Producer.top_up`) when what held it is gone."""
        alarms = self.alarms
        if alarms is not None and alarms.blocking:
            self._hold(producer, ALARM)
            self.by_alarm.add(producer)
            return False
        target = producer.target
        queue = self.full_queue(target) if target is not None else None
        if queue is None:
            return True
        self._hold(producer, queue)
        waiting = self.by_queue.get(queue)
        if waiting is None:
            waiting = self.by_queue[queue] = set()
        waiting.add(producer)
        queue.wait_for_room(self._room)
        return False

    def full_queue(self, target: "Resolution") -> "Queue | None":
        """A queue the target reaches that blocks its producers (overflow `block`, full).
        Anonymous-relay producers (no target) are paced by the alarms only."""
        broker = self.broker
        if target.kind is not AddressKind.EXCHANGE:
            queue = broker.queues.get(target.name)
            return queue if queue is not None and not queue.may_grant() else None
        exchange = broker.exchanges.get(target.name)
        if exchange is None:
            return None
        bindings: Iterable[Any] = exchange.bindings if target.key is None else exchange.route(target.key)
        for binding in bindings:
            queue = binding.queue
            if queue.limits is not None and not queue.may_grant():
                return queue
        return None

    def forget(self, producer: "Producer") -> None:
        """The producer's link ended."""
        held = producer.held
        producer.held = None
        if held is ALARM:
            self.by_alarm.discard(producer)
        elif held is not None:
            waiting = self.by_queue.get(held)
            if waiting is not None:
                waiting.discard(producer)

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
            producer.top_up()   # checks the gate again (another queue, a new alarm)


__all__ = ["ALARM", "FlowGate"]
