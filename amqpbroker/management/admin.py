"""Administrative views and actions on a running broker.

Everything here runs on the broker's event loop (the management API's endpoints
are `async def`, the expiry policy is an asyncio task) and changes broker state
only through the core APIs the AMQP side uses — `Broker.declare_queue`,
`delete_queue`, `bind`, `unbind`, `SubscriptionRegistry.delete` … — so the
durability hooks installed on them persist every change.  The views are plain
dicts (the API's pydantic models validate and document them).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
import weakref
from typing import Any, Awaitable, Callable

from proton import Condition, Endpoint

from ..core.addresses import TEMP_PREFIX
from ..core.exchanges import ExchangeType
from ..core.limits import QueueLimits
from ..core.queues import Queue
from ..core.subscriptions import GLOBAL_NAMESPACE, Subscription
from .expiry import SubscriptionState, is_abandoned
from .listing import DEFAULT_LIMIT, select_page
from .pacing import paced, paced_each
from .port import ManagedBroker, ManagedConnection
from .rates import RateTracker

log = logging.getLogger("amqpbroker.admin")

RESOURCE_DELETED = "amqp:resource-deleted"
CONNECTION_FORCED = "amqp:connection:forced"
SUBSCRIPTION_PREFIX = "qpidsub_/"


class AdminError(Exception):
    """An action that cannot be done; `status` is the HTTP status to answer with."""

    status = 400

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status


class NotFound(AdminError):
    status = 404


class Conflict(AdminError):
    status = 409


OffLoop = Callable[..., Awaitable[Any]]      # run a plain function in the worker thread


async def inline(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    return fn(*args, **kw)


# Fewer names than this are filtered and sorted on the loop: a thread hop costs more.
INLINE_NAMES = 2000


def _totals(q: Queue) -> tuple[str, tuple[int, int, int]]:
    return q.name, (q.enqueued_total, q.delivered_total, q.acked_total)


def _totals_reader(names: list[str], columns: list[list[int]]) -> Callable[[Queue], None]:
    name, enq, dlv, ack = names.append, columns[0].append, columns[1].append, columns[2].append

    def read(q: Queue) -> None:
        name(q.name)
        enq(q.enqueued_total)
        dlv(q.delivered_total)
        ack(q.acked_total)
    return read


def _depth(q: Queue) -> int:
    return q.depth


def _select(names: list[str], depths: list[int] | None, keep: Callable[[str], bool] | None = None,
            **kw: Any) -> tuple[int, list[str]]:
    """select_page, with the name → depth map built here (in the worker thread: a dict
    of 50,000 is one C call, ~5 ms the loop need not wait); `keep`: the names the
    asker may see (the rest are not counted either)."""
    depth_of = None if depths is None else dict(zip(names, depths))
    if keep is not None:
        names = [n for n in names if keep(n)]
    return select_page(names, depths=depth_of, **kw)


def link_addresses(conn: Any) -> list[str]:
    """The addresses a connection's open links attach to, as the peer named them (the
    source of a link the broker sends on, the target of one it receives on), from
    proton's link list; an address that does not decode is left out."""
    out: list[str] = []
    link = conn.link_head(Endpoint.LOCAL_ACTIVE)
    while link is not None:
        try:
            address = (link.remote_source if link.is_sender else link.remote_target).address
        except (UnicodeDecodeError, AttributeError):
            address = None
        if address and address not in out:
            out.append(address)
        link = link.next(Endpoint.LOCAL_ACTIVE)
    return out


def _visible_queue(visible: Callable[[str], bool], topics: dict[str, str], name: str) -> bool:
    topic = topics.get(name)
    return visible(name) if topic is None else visible(topic)


class Admin:
    def __init__(self, managed: ManagedBroker, clock: Callable[[], float] = time.time,
                 off_loop: OffLoop = inline):
        self.managed = managed
        self.broker = managed.broker
        self.registry = managed.subscriptions
        self.clock = clock
        self.off_loop = off_loop
        self.rates = RateTracker()
        self._conn_ids: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
        self._next_conn_id = itertools.count(1)

    # ------------------------------------------------------------------ sampling

    def sample_rates(self, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        self.rates.sample(now, dict(_totals(q) for q in self.broker.queues.values()))

    async def sample_rates_paced(self) -> None:
        """The periodic sampler: totals copied a slice at a time, rates computed in the
        worker thread (RateTracker is changed only here, one run at a time, and swaps
        its results in with one assignment: `rates(name)` on the loop stays safe)."""
        now = self.clock()
        names: list[str] = []
        columns: list[list[int]] = [[], [], []]
        await paced_each(list(self.broker.queues.values()), _totals_reader(names, columns))
        await self.off_loop(self.rates.sample_columns, now, names, columns)

    # ------------------------------------------------------------------ exchanges

    def exchanges(self) -> list[dict]:
        return [{"name": ex.name, "type": ex.type.value, "durable": ex.durable, "builtin": ex.builtin,
                 "bindings": len(ex.bindings)} for ex in sorted(self.broker.exchanges.values(),
                                                               key=lambda e: e.name)]

    def create_exchange(self, name: str, kind: str, durable: bool = True) -> dict:
        _check_name(name, "exchange")
        if name in self.broker.exchanges:
            raise Conflict(f"exchange '{name}' already exists")
        if name in self.broker.queues:
            raise Conflict(f"a queue named '{name}' exists: the address would be ambiguous")
        try:
            ExchangeType(kind)
        except ValueError:
            raise AdminError(f"unknown exchange type '{kind}' (direct, topic or fanout)") from None
        ex = self.broker.declare_exchange(name, kind, durable)
        if durable:
            # Broker.declare_exchange has no store hook (exchanges are otherwise saved
            # with their first durable binding): save it so it survives a restart.
            self.managed.store.save_exchange(name, ex.type.value)
        log.info("admin: exchange '%s' (%s%s) created", name, ex.type.value, ", durable" if durable else "")
        return self._exchange_view(name)

    def delete_exchange(self, name: str, *, force: bool = False) -> None:
        ex = self.broker.exchanges.get(name)
        if ex is None:
            raise NotFound(f"no exchange '{name}'")
        if ex.builtin:
            raise Conflict(f"exchange '{name}' is built in and cannot be deleted")
        if ex.bindings and not force:
            raise Conflict(f"exchange '{name}' has {len(ex.bindings)} binding(s); "
                           "use force=true to delete it with them")
        self.broker.delete_exchange(name)
        self.managed.store.delete_exchange(name)
        log.info("admin: exchange '%s' deleted", name)

    def _exchange_view(self, name: str) -> dict:
        return next(e for e in self.exchanges() if e["name"] == name)

    # ------------------------------------------------------------------ queues

    def queue_view(self, q: Queue) -> dict:
        enq, dlv, ack = self.rates.rates(q.name)
        return {
            "name": q.name, "durable": q.durable, "exclusivity": q.exclusivity.value,
            "lifetime": q.lifetime.value, "depth": q.depth, "ready": q.ready_count,
            "unacked": q.acquired, "bytes": q.bytes, "consumers": len(q.consumers) - q.browsers,
            "browsers": q.browsers, "enqueued_total": q.enqueued_total,
            "delivered_total": q.delivered_total, "acked_total": q.acked_total,
            "expired_total": q.expired_total, "dead_lettered_total": q.dead_lettered_total,
            "limits": q.limits.describe() if q.limits is not None else None,
            "overflow_rejected_total": q.overflow_rejected_total,
            "overflow_dropped_total": q.overflow_dropped_total,
            "enqueue_rate": round(enq, 3), "deliver_rate": round(dlv, 3), "ack_rate": round(ack, 3),
            "created_at": q.created_at, "last_delivered_at": q.last_delivered_at,
            "last_consumer_at": q.last_consumer_at,
            "subscription": q.name in self.registry.by_queue,
            "temporary": q.name.startswith(TEMP_PREFIX),
        }

    async def queue_page(self, *, offset: int = 0, limit: int = DEFAULT_LIMIT, pattern: str | None = None,
                         sort: str = "name", subscription: bool | None = None,
                         visible: Callable[[str], bool] | None = None) -> tuple[int, list[dict]]:
        """(queues matching, views of the page asked for), without holding the loop:
        names (and depths, to sort by depth) are copied a slice at a time, filtered and
        sorted in the worker thread, and only the page's queues are viewed.
        `visible`: the names (addresses) the asker's grants cover; a subscription's
        queue is visible when its topic is."""
        names = list(self.broker.queues)
        keep = None
        if visible is not None:
            topics = {name: self.subscription_state(sub).topic for name, sub in self.registry.by_queue.items()}
            keep = functools.partial(_visible_queue, visible, topics)
        depths = None
        if sort == "depth":
            depths = await paced(list(self.broker.queues.values()), _depth)    # in the order of names
        subs = set(self.registry.by_queue) if subscription is not None else ()
        run = self.off_loop if len(names) > INLINE_NAMES else inline
        total, page = await run(_select, names, depths, keep, pattern=pattern, sort=sort, offset=offset,
                                limit=limit, subscription_queues=subs, subscription=subscription)
        queues = [q for q in (self.broker.queues.get(n) for n in page) if q is not None]
        return total, await paced(queues, self.queue_view)

    def queue(self, name: str) -> Queue:
        q = self.broker.queues.get(name)
        if q is None:
            raise NotFound(f"no queue '{name}'")
        return q

    def create_queue(self, name: str, *, durable: bool = True,
                     max_delivery_attempts: int | None = None, limits: QueueLimits | None = None) -> dict:
        """`limits`: declared with the queue (else a [[queue_limits]] pattern's); they
        are kept with a durable queue (its store record) and apply again after a restart."""
        _check_name(name, "queue")
        if name.startswith(SUBSCRIPTION_PREFIX) or name.startswith(TEMP_PREFIX):
            raise AdminError(f"queue names starting with '{SUBSCRIPTION_PREFIX}' or '{TEMP_PREFIX}' "
                             "are reserved for the broker")
        if name in self.broker.queues:
            raise Conflict(f"queue '{name}' already exists")
        if name in self.broker.exchanges:
            raise Conflict(f"an exchange named '{name}' exists: the address would be ambiguous")
        q = self.broker.declare_queue(name, durable=durable, max_delivery_attempts=max_delivery_attempts,
                                      limits=limits)
        log.info("admin: queue '%s' created%s%s", name, " (durable)" if durable else "",
                 f" with limits {q.limits.describe()}" if q.limits is not None else "")
        return self.queue_view(q)

    def delete_queue(self, name: str, *, force: bool = False) -> int:
        """Delete a queue; returns the number of messages dropped with it."""
        q = self.queue(name)
        if name in self.registry.by_queue:
            raise Conflict(f"queue '{name}' belongs to a subscription: delete the subscription instead")
        if q.consumers and not force:
            raise Conflict(f"queue '{name}' has {len(q.consumers)} consumer(s) attached; "
                           "use force=true to detach them")
        detached = self.detach_consumers(q, f"queue '{name}' deleted by an administrator")
        dropped = q.depth
        self.broker.delete_queue(name)
        log.info("admin: queue '%s' deleted (%d message(s) dropped, %d consumer(s) detached)",
                 name, dropped, detached)
        return dropped

    def purge(self, name: str) -> int:
        q = self.queue(name)
        removed = q.purge()
        log.info("admin: queue '%s' purged (%d message(s))", name, removed)
        return removed

    # ------------------------------------------------------------------ bindings

    def bindings(self) -> list[dict]:
        out = []
        for ex in sorted(self.broker.exchanges.values(), key=lambda e: e.name):
            for b in ex.bindings:
                args = b.arguments or {}
                out.append({"exchange": b.exchange, "queue": b.queue.name, "key": b.key,
                            "selector": args.get("selector"), "no_local": bool(args.get("no_local")),
                            "subscription": b.queue.name in self.registry.by_queue})
        return out

    def _find_binding(self, exchange: str, queue: str, key: str) -> Any:
        ex = self.broker.exchanges.get(exchange)
        if ex is None:
            raise NotFound(f"no exchange '{exchange}'")
        return next((b for b in ex.bindings if b.queue.name == queue and b.key == key), None)

    def bind(self, exchange: str, queue: str, key: str = "") -> dict:
        q = self.queue(queue)
        if self._find_binding(exchange, queue, key) is not None:
            raise Conflict(f"'{exchange}' is already bound to '{queue}' with key '{key}'")
        if queue in self.registry.by_queue:
            raise Conflict(f"queue '{queue}' belongs to a subscription; its binding is the subscription's")
        self.broker.bind(exchange, key, q)
        log.info("admin: bound '%s' → '%s' with key '%s'", exchange, queue, key)
        return {"exchange": exchange, "queue": queue, "key": key, "selector": None, "no_local": False,
                "subscription": False}

    def unbind(self, exchange: str, queue: str, key: str = "") -> None:
        binding = self._find_binding(exchange, queue, key)
        if binding is None:
            raise NotFound(f"no binding '{exchange}' → '{queue}' with key '{key}'")
        if queue in self.registry.by_queue:
            raise Conflict(f"queue '{queue}' belongs to a subscription: delete the subscription instead")
        self.broker.unbind(binding)
        log.info("admin: unbound '%s' → '%s' (key '%s')", exchange, queue, key)

    # ------------------------------------------------------------------ subscriptions

    def subscription_state(self, sub: Subscription) -> SubscriptionState:
        q = self.broker.queues.get(sub.queue_name)
        key = sub.key
        b = sub.binding
        consumers = (len(q.consumers) - q.browsers) if q else 0
        idle_since = None
        if q is not None:
            idle_since = q.last_consumer_at if q.last_consumer_at is not None else q.created_at
        return SubscriptionState(
            namespace=key.namespace if key else sub.owner_container,
            name=key.name if key else sub.queue_name,
            topic=sub.source.address or (f"{b.exchange}/{b.key}" if b.key else b.exchange),
            durable=sub.durable, consumers=consumers, pending=q.depth if q else 0,
            created_at=sub.created_at, idle_since=idle_since)

    def subscription_view(self, sub: Subscription, idle: float | None, now: float) -> dict:
        st = self.subscription_state(sub)
        q = self.broker.queues.get(sub.queue_name)
        key = sub.key
        b = sub.binding
        idle_for = st.idle_for(now)
        return {
            "name": st.name, "namespace": st.namespace,
            "client_id": None if (key and key.namespace == GLOBAL_NAMESPACE) else st.namespace,
            "global": bool(key and key.namespace == GLOBAL_NAMESPACE),
            "durable": sub.durable, "shared": sub.shared, "named": key is not None,
            "queue": sub.queue_name, "topic": st.topic, "exchange": b.exchange, "key": b.key,
            "selector": b.selector, "no_local": b.no_local, "consumers": st.consumers,
            "pending": st.pending, "pending_bytes": q.bytes if q else 0,
            "created_at": sub.created_at,
            "last_delivered_at": q.last_delivered_at if q else None,
            "last_consumer_at": q.last_consumer_at if q else None,
            "idle_seconds": idle_for,
            "abandoned": idle is not None and is_abandoned(st, idle, now),
            "links": sorted(sub.links),
        }

    def subscriptions(self, idle: float | None = None, *, abandoned_only: bool = False,
                      now: float | None = None) -> list[dict]:
        now = self.clock() if now is None else now
        views = [self.subscription_view(s, idle, now) for s in list(self.registry.by_queue.values())]
        if abandoned_only:
            views = [v for v in views if v["abandoned"]]
        return sorted(views, key=lambda v: (v["namespace"], v["name"], not v["durable"]))

    def find_subscription(self, name: str, namespace: str | None = None,
                          durable: bool | None = None) -> Subscription:
        found = []
        for sub in self.registry.by_queue.values():
            st = self.subscription_state(sub)
            if st.name != name and sub.queue_name != name:
                continue
            if namespace is not None and st.namespace != namespace:
                continue
            if durable is not None and sub.durable != durable:
                continue
            found.append(sub)
        if not found:
            where = f" in namespace '{namespace}'" if namespace is not None else ""
            raise NotFound(f"no subscription '{name}'{where}")
        if len(found) > 1:
            which = ", ".join(sorted(f"{self.subscription_state(s).namespace} "
                                     f"({'durable' if s.durable else 'non-durable'})" for s in found))
            raise Conflict(f"subscription name '{name}' is ambiguous: it exists in {which}; "
                           "pass namespace (and durable) to choose")
        return found[0]

    def delete_subscription(self, name: str, namespace: str | None = None, durable: bool | None = None,
                            *, force: bool = False, reason: str = "an administrator") -> dict:
        """Admin unsubscribe: the subscription, its queue and its backlog go."""
        sub = self.find_subscription(name, namespace, durable)
        q = self.broker.queues.get(sub.queue_name)
        consumers = len(q.consumers) if q else 0
        if consumers and not force:
            raise Conflict(f"subscription '{name}' has {consumers} consumer(s) attached; "
                           "use force=true to detach them and delete it")
        view = self.subscription_view(sub, None, self.clock())
        detached = self.detach_consumers(q, f"subscription '{name}' deleted by {reason}") if q else 0
        if sub.queue_name in self.registry.by_queue:   # a non-durable one may have gone with its links
            self.registry.delete(sub)
        log.info("admin: subscription '%s' (namespace %s) deleted by %s: %d pending message(s) dropped, "
                 "%d consumer(s) detached", view["name"], view["namespace"], reason, view["pending"],
                 detached)
        view["consumers_detached"] = detached
        return view

    # ------------------------------------------------------------------ consumers, connections

    def detach_consumers(self, q: Queue, description: str) -> int:
        """Detach every consumer link of a queue with amqp:resource-deleted."""
        n = 0
        for consumer in list(q.consumers):
            handler = getattr(consumer, "handler", None)
            link = getattr(consumer, "link", None)
            if handler is None or link is None:
                continue
            link.condition = Condition(RESOURCE_DELETED, description)
            link.close()
            handler.link_ended(link)        # releases the consumer (closed=false: keeps durables)
            self.managed.forget_link(handler, link)
            handler.protocol.mark_dirty()
            n += 1
        return n

    def handlers(self) -> list[ManagedConnection]:
        return [h for hs in list(self.managed.handlers_by_container.values()) for h in hs]

    def connection_id(self, handler: ManagedConnection) -> int:
        cid = self._conn_ids.get(handler)
        if cid is None:
            cid = self._conn_ids[handler] = next(self._next_conn_id)
        return cid

    def connections(self) -> list[dict]:
        out = []
        for h in self.handlers():
            p = h.protocol
            out.append({"id": self.connection_id(h), "container_id": h.container_id, "user": p.user,
                        "addresses": link_addresses(h.conn),
                        "remote_address": p.peer, "listener": p.listener.name,
                        "tls": p.listener.ssl_context is not None, "sessions": h.sessions,
                        "links": h.links, "consumers": len(h.consumers)})
        return sorted(out, key=lambda c: c["id"])

    def close_connection(self, conn_id: int, description: str = "closed by an administrator") -> dict:
        for h in self.handlers():
            if self.connection_id(h) == conn_id:
                view = next(c for c in self.connections() if c["id"] == conn_id)
                if not h.ended:
                    h.conn.condition = Condition(CONNECTION_FORCED, description)
                    h.conn.close()
                    h.protocol.mark_dirty()
                    proto = h.protocol
                    # A peer that never answers the Close loses its socket anyway.
                    self.managed.loop.call_later(
                        5.0, lambda: proto.abort() if proto in self.managed.protocols else None)
                log.info("admin: connection %d (%s, container %s) closed", conn_id,
                         view["remote_address"], view["container_id"])
                return view
        raise NotFound(f"no connection {conn_id}")

    # ------------------------------------------------------------------ overview

    async def overview(self) -> dict:
        from .. import __version__
        handlers = self.handlers()
        depths = await paced(list(self.broker.queues.values()), lambda q: q.depth)
        return {"version": __version__, "container_id": self.managed.settings.container_id,
                "queues": len(self.broker.queues), "exchanges": len(self.broker.exchanges),
                "subscriptions": len(self.registry.by_queue), "connections": len(handlers),
                "links": sum(h.links for h in handlers), "messages": sum(depths),
                "routed_total": self.broker.routed_total, "unroutable_total": self.broker.unroutable_total,
                "store_persistent": self.managed.store.persistent,
                "access_control": self.managed.access.enabled, "alarms": self.managed.alarms.reasons}

    # ------------------------------------------------------------------ alarms

    def alarms_view(self) -> dict:
        a = self.managed.alarms
        return {
            "blocking": a.blocking, "reasons": a.reasons,
            "memory": {"raised": a.raised("memory"), "used": a.memory_used, "limit": a.memory_limit,
                       "clear_below": a.clear_at("memory"), "available": a.memory_total, "basis": a.memory_basis,
                       "high_watermark": a.memory_high_watermark,
                       "high_watermark_absolute": a.memory_high_watermark_absolute,
                       "raised_total": a.raised_total["memory"]},
            "disk": {"enabled": a.disk_enabled, "raised": a.raised("disk"), "free": a.disk_free,
                     "limit": a.disk_free_limit, "clear_from": a.clear_at("disk"),
                     "raised_total": a.raised_total["disk"]},
            "check_interval": self.managed.settings.alarms.check_interval,
            "producers_held": self.managed.flow.held,
        }

    def set_alarms(self, changes: dict[str, Any], who: str) -> dict:
        """New thresholds (the keys given; `memory_high_watermark` without
        `memory_high_watermark_absolute` drops the absolute one, as `rabbitmqctl
        set_vm_memory_high_watermark` does).  Decided again at once on the last
        readings; lasts until the broker restarts (the config file is not changed)."""
        if "memory_high_watermark" in changes and "memory_high_watermark_absolute" not in changes:
            changes = {**changes, "memory_high_watermark_absolute": None}
        if changes.get("memory_high_watermark") is None:
            changes.pop("memory_high_watermark", None)
        if changes.get("disk_free_limit", 0) is None:
            raise AdminError("disk_free_limit: a number of bytes (0 turns the disk alarm off)", 422)
        # Logged first: the alarm lines the change causes follow it.  (The API's model
        # has checked the ranges; configure checks them again.)
        log.info("admin: alarm thresholds changed by %s: %s", who,
                 ", ".join(f"{k}={v}" for k, v in sorted(changes.items())))
        try:
            self.managed.alarms.configure(**changes)
        except ValueError as exc:
            raise AdminError(str(exc)) from None
        return self.alarms_view()

    async def synced(self) -> None:
        """Wait until the store has committed what was queued so far."""
        store = self.managed.store
        if not store.persistent:
            return
        fut = asyncio.get_running_loop().create_future()
        store.after_commit(lambda err: fut.done() or fut.set_result(err))
        err = await fut
        if err is not None:
            raise AdminError(f"the change could not be stored: {err}", 507)


def _check_name(name: str, what: str) -> None:
    if not name or not name.strip():
        raise AdminError(f"{what} name must not be empty")
    if len(name) > 255:
        raise AdminError(f"{what} name longer than 255 characters")
