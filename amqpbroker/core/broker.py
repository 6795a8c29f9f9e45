"""The broker model: exchanges, queues, bindings and routing.  Pure: no I/O.

The I/O layer resolves link addresses here at attach time and hands every
received message to `publish()`; queues call back into the I/O layer only
through the `ConsumerPort` of their consumers.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .addresses import AddressKind, AddressNotFound, Resolution, resolve
from .budget import MemoryBudget
from .deadletters import AnnotationError, mark_dead_lettered, return_address
from .exchanges import Binding, BindingFilter, Exchange, ExchangeType
from .limits import OVERFLOW_REASON, Admission, LimitRule, QueueLimits, limits_for
from .message import JMS_DEST, MalformedMessage, Message
from .queues import Entry, ExclusivityPolicy, LifetimePolicy, Queue
from .ratelog import RateLimitedLog
from .selectors.like import end_shared, share_budget

log = logging.getLogger("amqpbroker.broker")

BUILTIN_EXCHANGES = (
    ("amq.direct", ExchangeType.DIRECT),
    ("amq.topic", ExchangeType.TOPIC),
    ("amq.fanout", ExchangeType.FANOUT),
)


class QueueLimit(Exception):
    """A user reached policy.max_queues_per_user (amqp:resource-limit-exceeded)."""


class QueueFull(QueueLimit):
    """A message met a full queue whose overflow is `reject` (core/limits.py):
    the transfer is rejected with amqp:resource-limit-exceeded."""


@dataclass
class BrokerPolicy:
    auto_create_queues: bool = True
    max_delivery_attempts: int = 0          # 0: unlimited
    dead_letter_address: str | None = None  # queue or exchange[/key]
    max_consumers_per_subscription: int = 0  # 0: unlimited
    topic_exchange: str = "amq.topic"
    max_queues_per_user: int = 0             # queues an address may create per user; 0: unlimited
    queue_limits: tuple[LimitRule, ...] = ()  # [[queue_limits]]: limits by queue-name pattern


class Broker:
    def __init__(self, policy: BrokerPolicy | None = None, clock: Callable[[], float] = time.time):
        self.policy = policy or BrokerPolicy()
        self.clock = clock
        self.exchanges: dict[str, Exchange] = {}
        self.queues: dict[str, Queue] = {}
        self.routed_total = 0
        self.unroutable_total = 0
        self.dead_letters_dropped_total = 0     # died in a dead-letter queue, or nowhere to go: dropped
        self._dead_log = RateLimitedLog(log)    # a dead-letter storm writes a line per kind per 10 s
        for name, kind in BUILTIN_EXCHANGES:
            self.exchanges[name] = Exchange(name, kind, durable=True, builtin=True)
        # Runs a callable at the next loop turn (set by the server; queues dispatch in
        # slices with it): None dispatches everything at once.
        self.defer: Callable[[Callable[[], None]], Any] | None = None
        self.created_by: dict[str, int] = {}   # user → queues its addresses created (this run)
        # A routing result without filters (Exchange.route's cached tuple, held here so its
        # id stays its own) → its queues, each once: a fan-out to 10,000 subscriptions
        # does not dedupe 10,000 bindings per message.
        self._unfiltered: dict[int, tuple[tuple, tuple[Queue, ...]]] = {}
        self.timers: set[Queue] = set()        # queues holding scheduled (delayed) entries
        # Temporary (dynamic) queues and topic exchanges → the connection that made them.
        self.temporaries: dict[str, Any] = {}
        # The broker-wide memory budget every queue charges (core/budget.py; None: none).
        self.budget: MemoryBudget | None = None
        # The topic log (store/topiclog.py): fan_out(msg, exchange, key, members) stores a
        # message for the durable subscription queues it reaches and returns its position
        # (their sequence number).  Set by the persistence layer; None without one.
        self.fan_out: Callable[[Message, str | None, str | None, list[Queue]], int] | None = None
        # Hooks for the store (durable entities) — set by the persistence layer.
        self.on_queue_declared: Callable[[Queue], None] | None = None
        self.on_queue_deleted: Callable[[Queue], None] | None = None
        self.on_binding_changed: Callable[[Binding, bool], None] | None = None

    # ------------------------------------------------------------------ entities

    def declare_exchange(self, name: str, kind: ExchangeType | str, durable: bool = True) -> Exchange:
        existing = self.exchanges.get(name)
        if existing is not None:
            if existing.type is not ExchangeType(kind):
                raise ValueError(f"exchange '{name}' exists with type {existing.type.value}")
            return existing
        exchange = Exchange(name, ExchangeType(kind), durable=durable)
        self.exchanges[name] = exchange
        return exchange

    def declare_queue(
        self,
        name: str,
        *,
        durable: bool = False,
        exclusivity: ExclusivityPolicy = ExclusivityPolicy.NONE,
        lifetime: LifetimePolicy = LifetimePolicy.PERMANENT,
        owner: Any = None,
        max_delivery_attempts: int | None = None,
        max_consumers: int = 0,
        limits: QueueLimits | None = None,
    ) -> Queue:
        """`limits`: declared limits (core/limits.py); else a `queue_limits` rule's."""
        queue = self.queues.get(name)
        if queue is not None:
            return queue
        queue = Queue(
            name,
            durable=durable,
            exclusivity=exclusivity,
            lifetime=lifetime,
            owner=owner,
            max_delivery_attempts=(self.policy.max_delivery_attempts
                                   if max_delivery_attempts is None else max_delivery_attempts),
            max_consumers=max_consumers,
            dead_letter=functools.partial(self._dead_letter, name),
            clock=self.clock,
        )
        queue.defer = self.defer
        queue.timers = self.timers
        queue.budget = self.budget
        queue.limits = limits_for(name, self.policy.queue_limits, limits)
        queue.declared_limits = limits
        self.queues[name] = queue
        if self.on_queue_declared is not None:
            self.on_queue_declared(queue)
        return queue

    def auto_create(self, name: str, creator: str | None) -> Queue:
        """A queue an address names into being (policy.auto_create_queues: an attach,
        or a message to an unknown `to`): durable, as a configured queue is, and counted
        against the user whose client named it (policy.max_queues_per_user), so one
        client cannot fill the broker with queues.  Raises QueueLimit."""
        existing = self.queues.get(name)
        if existing is not None:
            return existing
        limit = self.policy.max_queues_per_user
        who = creator or "anonymous"
        if limit and self.created_by.get(who, 0) >= limit:
            raise QueueLimit(f"user '{who}' has created {limit} queues (policy.max_queues_per_user)")
        queue = self.declare_queue(name, durable=True)
        queue.creator = who
        self.created_by[who] = self.created_by.get(who, 0) + 1
        return queue

    def declare_temporary(self, name: str, creator: Any, *, topic: bool = False) -> None:
        """A dynamic node (AMQP 1.0 §3.5.3 dynamic terminus; a JMS TemporaryQueue or
        TemporaryTopic): a non-durable queue, or a fanout exchange for a topic,
        consumable only by `creator` (see `may_consume`)."""
        if topic:
            self.declare_exchange(name, ExchangeType.FANOUT, durable=False)
        else:
            self.declare_queue(name, durable=False)
        self.temporaries[name] = creator

    def may_consume(self, node: str, requester: Any) -> bool:
        """JMS 2.0 §6.2.8: a temporary destination "can be consumed only by the
        Connection that created it"; anyone (ACLs permitting) may send to it, which
        is what request/reply needs.  Every other node is open to all."""
        creator = self.temporaries.get(node)
        return creator is None or creator is requester

    def delete_queue(self, name: str) -> Queue | None:
        queue = self.queues.pop(name, None)
        self.temporaries.pop(name, None)
        if queue is None:
            return None
        for exchange in self.exchanges.values():
            for binding in exchange.unbind_queue(queue):
                if self.on_binding_changed is not None:
                    self.on_binding_changed(binding, False)
        queue.purge()
        queue.deleted = True
        queue._room_check()   # producers blocked on it learn it is gone
        if queue.creator is not None:
            left = self.created_by.get(queue.creator, 1) - 1
            if left > 0:
                self.created_by[queue.creator] = left
            else:
                self.created_by.pop(queue.creator, None)
        if self.on_queue_deleted is not None:
            self.on_queue_deleted(queue)
        return queue

    def delete_exchange(self, name: str) -> Exchange | None:
        exchange = self.exchanges.get(name)
        if exchange is None or exchange.builtin:
            return None
        del self.exchanges[name]
        self.temporaries.pop(name, None)
        for binding in list(exchange.bindings):
            exchange.unbind(binding)
            if self.on_binding_changed is not None:
                self.on_binding_changed(binding, False)
        return exchange

    def bind(self, exchange: str, key: str, queue: Queue, filter: BindingFilter | None = None,
             arguments: dict | None = None) -> Binding:
        binding = Binding(exchange, key, queue, filter, dict(arguments or {}))
        self.exchanges[exchange].bind(binding)
        if self.on_binding_changed is not None:
            self.on_binding_changed(binding, True)
        return binding

    def unbind(self, binding: Binding) -> None:
        exchange = self.exchanges.get(binding.exchange)
        if exchange is not None:
            exchange.unbind(binding)
            if self.on_binding_changed is not None:
                self.on_binding_changed(binding, False)

    def bindings_of(self, queue: Queue) -> list[Binding]:
        return [b for ex in self.exchanges.values() for b in ex.bindings if b.queue is queue]

    # ------------------------------------------------------------------ addresses

    def resolve(self, address: str, *, topic: bool = False) -> Resolution:
        """Resolve a link address (see addresses.py); raises AddressNotFound."""
        return resolve(
            address,
            queue_exists=self.queues.__contains__,
            exchange_exists=self.exchanges.__contains__,
            topic=topic,
            auto_create=self.policy.auto_create_queues,
            topic_exchange=self.policy.topic_exchange,
        )

    def resolve_for_relay(self, msg: Message) -> Resolution:
        """Anonymous relay (AMQP 1.0 §2.6.3 note; ANONYMOUS-RELAY): route by `to`.
        Qpid JMS marks topics with x-opt-jms-dest 1 (topic) or 3 (temporary topic)."""
        to = msg.prop("to")
        if not to:
            raise AddressNotFound("", "message has no 'to' address for the anonymous relay")
        dest_type = msg.annotations.get(JMS_DEST) if msg.has_section(0x72) else None
        return self.resolve(str(to), topic=dest_type in (1, 3))

    # ------------------------------------------------------------------ routing

    def publish(self, msg: Message, target: Resolution, creator: str | None = None, *,
                exclude: frozenset[str] | set[str] = frozenset()) -> list[Queue]:
        """Route a message to every queue the target reaches; return those queues.
        `creator`: the user a queue the target names into being is counted against.
        Raises QueueFull when a routed queue is full with overflow `reject` (then no
        queue gets it).  `exclude`: names of queues the message must not go into
        (core/history.py: a move's copy and its source)."""
        queues = self.destinations(msg, target, creator)
        if exclude:
            queues = [q for q in queues if q.name not in exclude]
        if not queues:
            self.unroutable_total += 1
            return queues
        self._admit(queues, msg.size)
        self.routed_total += 1
        fan_out = self.fan_out
        members = [q for q in queues if q.in_log] if fan_out is not None else None
        if members:
            # One log record, one position for every durable subscription it reaches.
            exchange, key = self.routed_by(target, msg)
            pos = fan_out(msg, exchange, key, members)
            for queue in queues:
                queue.enqueue(msg, pos if queue.in_log else None)
            return queues
        for queue in queues:
            queue.enqueue(msg)
        return queues

    def routed_by(self, target: Resolution, msg: Message) -> tuple[str | None, str | None]:
        """The exchange and key a message published to `target` is routed by (None,
        None when the target is a queue)."""
        if target.kind in (AddressKind.QUEUE, AddressKind.NEW_QUEUE):
            return None, None
        return target.name, self.routing_key(target.key, msg)

    @staticmethod
    def routing_key(key: str | None, msg: Message) -> str:
        """The key an exchange routes by: the address's, else the message subject."""
        if key is not None:
            return key
        subject = msg.prop("subject") if msg.has_section(0x73) else None
        return "" if subject is None else str(subject)

    def destinations(self, msg: Message, target: Resolution, creator: str | None = None) -> list[Queue]:
        """The queues `target` routes `msg` to (a queue it names is created)."""
        if target.kind is AddressKind.QUEUE:
            queue = self.queues.get(target.name)
            if queue is None:  # deleted since the link attached
                raise AddressNotFound(target.name, f"queue '{target.name}' no longer exists")
            return [queue]
        if target.kind is AddressKind.NEW_QUEUE:
            return [self.auto_create(target.name, creator)]
        return self.route(target.name, target.key, msg)

    @classmethod
    def _admit(cls, queues: list[Queue], incoming: int) -> None:
        """Queue limits (core/limits.py) for one message, fan-out included: one full
        `reject` queue rejects it for all (a retry must not duplicate it elsewhere);
        `drop-head` queues make room; `block` is applied to credit, not here."""
        dropping = None
        for queue in queues:
            if queue.limits is None:
                continue
            verdict = queue.admission(incoming)
            if verdict is Admission.REJECT:
                cls._refuse(queue)
            if verdict is Admission.DROP_HEAD:
                dropping = (dropping or []) + [queue]
        for queue in dropping or ():
            queue.make_room(incoming)

    @staticmethod
    def _refuse(queue: Queue) -> None:
        queue.overflow_rejected_total += 1
        lim = queue.limits
        raise QueueFull(f"queue '{queue.name}' is full: {queue.depth} messages, {queue.bytes} bytes "
                        f"(max_depth {lim.max_depth or '-'}, max_bytes {lim.max_bytes or '-'}, "
                        f"overflow {lim.overflow.value})")

    def route(self, exchange_name: str, key: str | None, msg: Message) -> list[Queue]:
        exchange = self.exchanges.get(exchange_name)
        if exchange is None:
            raise AddressNotFound(exchange_name, f"exchange '{exchange_name}' no longer exists")
        bindings = exchange.route(self.routing_key(key, msg))
        if len(bindings) == 1 and bindings[0].filter is None:
            return [bindings[0].queue]
        hit = self._unfiltered.get(id(bindings))
        if hit is not None and hit[0] is bindings:
            return list(hit[1])   # a fan-out without filters: its queues, once per routing result
        seen: dict[int, Queue] = {}
        shared = False      # the filters' selectors share one evaluation budget (like.py)
        try:
            for binding in bindings:
                queue = binding.queue
                if id(queue) in seen:
                    continue
                if binding.filter is not None:
                    if not shared:
                        shared = True
                        share_budget()
                    if not binding.filter(msg):
                        continue
                seen[id(queue)] = queue
        finally:
            if shared:
                end_shared()
        queues = list(seen.values())
        if len(bindings) > 8 and all(b.filter is None for b in bindings):
            if len(self._unfiltered) >= 64:
                self._unfiltered.clear()
            self._unfiltered[id(bindings)] = (bindings, tuple(queues))
        return queues

    # ------------------------------------------------------------------ timers

    def next_wakeup(self) -> float | None:
        """The earliest delivery time of a scheduled entry, visiting only the queues
        that have some (called once per loop turn: not a walk over every queue)."""
        earliest = None
        for queue in list(self.timers):
            t = queue.next_wakeup()
            if t is None or queue.deleted:
                self.timers.discard(queue)
            elif earliest is None or t < earliest:
                earliest = t
        return earliest

    def tick(self, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        for queue in list(self.timers):
            queue.promote_due(now)

    def sweep_expired(self, now: float | None = None) -> int:
        now = self.clock() if now is None else now
        return sum(q.expire_sweep(now) for q in list(self.queues.values()))

    # ------------------------------------------------------------------ dead letters
    # A dead letter goes where the dead-letter address routes it, computed at each
    # death (bindings change at run time).  A message that dies in a queue that
    # address routes to (a dead-letter queue: the address itself, or through an
    # exchange) is dropped, never dead-lettered again: no dead-letter cycle can
    # form, whatever the exchanges and overflow policies (a full drop-head DLQ
    # behind a fan-out once fed itself for ever).  Lines are rate-limited.

    def dead_letter_queues(self) -> list[str]:
        """The queues the dead-letter address routes to now (by its fixed key, or for a
        key taken from a message's subject, every binding of the exchange): where dead
        letters can land, and the queues whose own dead messages are dropped."""
        address = self.policy.dead_letter_address
        if not address:
            return []
        try:
            target = self.resolve(address)
        except AddressNotFound:
            return []
        if target.kind is not AddressKind.EXCHANGE:
            return [target.name]
        exchange = self.exchanges[target.name]
        bindings = exchange.route(target.key) if target.key is not None else exchange.bindings
        return sorted({b.queue.name for b in bindings})

    def resolve_declared(self, address: str) -> Resolution:
        """`address` resolved, and the queue it names into being (policy.auto_create_queues)
        declared now, durable, for a destination the broker itself writes to before any
        client has named it (the dead-letter queue, a merge's target).  Raises
        AddressNotFound."""
        target = self.resolve(address)
        if target.kind is AddressKind.NEW_QUEUE:
            self.declare_queue(target.name, durable=True)
        return target

    def declare_dead_letters(self) -> tuple[int, str]:
        """At start (the configuration's check): the queue the dead-letter address names
        is declared (durable) when neither it nor an exchange of that name exists, so
        that it can be browsed and replayed before anything died.  Returns a log level
        and a line saying where dead letters go and which queues never dead-letter."""
        address = self.policy.dead_letter_address
        if not address:
            return logging.INFO, "no dead-letter address: rejected and over-delivered messages are dropped"
        try:
            self.resolve_declared(address)
        except AddressNotFound as exc:
            return logging.WARNING, f"dead-letter address {address} cannot be used: {exc.why}; dead letters are dropped"
        queues = self.dead_letter_queues()
        if not queues:
            return logging.WARNING, (f"dead-letter address {address} routes to no queue (yet): dead letters are "
                                     "dropped until one is bound")
        return logging.INFO, (f"dead letters go to {address} (queue(s) {', '.join(queues)}); a message that dies "
                              "in one of these is dropped, never dead-lettered again (no cycle)")

    def _dead_letter(self, queue_name: str, entry: Entry, reason: str) -> None:
        address = self.policy.dead_letter_address
        if not address:
            self._dropped(queue_name, entry, reason, "no dead-letter address",
                          logging.DEBUG if reason == OVERFLOW_REASON else logging.INFO, counted=False)
            return
        try:
            target = self.resolve(address)
            if queue_name in {q.name for q in self._reached(target, entry)}:
                self._dropped(queue_name, entry, reason, f"it died in a queue the dead-letter address {address} "
                              "routes to; a dead letter is never dead-lettered again")
                return
            copy = Message(self._origin_marked(queue_name, entry, reason), publisher=entry.msg.publisher)
            queues = self.publish(copy, target)
        except MalformedMessage as exc:   # stored before the edge checked it: nothing to route
            self._dropped(queue_name, entry, reason, f"it cannot be dead-lettered: {exc}", logging.WARNING)
            return
        except AddressNotFound as exc:
            self._dropped(queue_name, entry, reason, f"dead-letter address {address} unusable: {exc.why}",
                          logging.WARNING)
            return
        except QueueLimit as exc:   # the dead-letter queue is full with overflow reject
            self._dropped(queue_name, entry, reason, f"not dead-lettered: {exc}", logging.WARNING)
            return
        if not queues:
            self._dropped(queue_name, entry, reason, f"dead-letter address {address} routed it nowhere",
                          logging.WARNING)
            return
        self._dead_log.log(logging.INFO, ("dead-lettered", queue_name, reason),
                           "queue %s: message seq=%d dead-lettered to %s (%s)", queue_name, entry.seq, address, reason)

    def _reached(self, target: Resolution, entry: Entry) -> list[Queue]:
        """The queues a dead letter of `entry` would go to (nothing created or queued)."""
        if target.kind is AddressKind.EXCHANGE:
            return self.route(target.name, target.key, entry.msg)
        queue = self.queues.get(target.name)
        return [queue] if queue is not None else []

    def _dropped(self, queue_name: str, entry: Entry, reason: str, why: str, level: int = logging.WARNING,
                 counted: bool = True) -> None:
        if counted:
            self.dead_letters_dropped_total += 1
        self._dead_log.log(level, ("dropped", queue_name, why[:40]), "queue %s: dropped message seq=%d (%s; %s)",
                           queue_name, entry.seq, reason, why)

    def _origin_marked(self, queue_name: str, entry: Entry, reason: str) -> bytes:
        """The entry's bytes with its origin and reason as message annotations and
        application properties, and its history (core/deadletters.py), so that a replay
        knows where it goes back to.  A message whose annotations cannot be walked goes
        as it is (it is still dead-lettered)."""
        payload = entry.payload()
        queue = self.queues.get(queue_name)
        bindings = [(b.exchange, b.key) for b in self.bindings_of(queue)] if queue is not None else []
        try:
            return mark_dead_lettered(payload, queue_name, return_address(queue_name, bindings), reason,
                                      int(self.clock() * 1000))
        except AnnotationError as exc:
            self._dead_log.log(logging.WARNING, ("unmarked", queue_name),
                               "queue %s: message seq=%d dead-lettered without origin annotations (%s)",
                               queue_name, entry.seq, exc)
            return payload

    def queues_owned_by(self, owner: Any) -> Iterable[Queue]:
        return [q for q in self.queues.values() if q.owner is owner]
