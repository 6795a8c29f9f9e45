"""Prometheus metrics, read at scrape time without stalling the broker.

A scrape (1) copies the broker's numbers into plain columns on the event loop, a
slice at a time (pacing.py), (2) renders the text from those copies in the
management worker thread (exposition.py), never touching a live broker object
there.  Scrapes that arrive while a copy is being made share it.  Nothing is counted
per message beyond the totals the queues already keep; rates are left to Prometheus
(`rate(amqpbroker_messages_enqueued_total[1m])`).

With 50,000 queues the text of every queue's series is 21 MB and took 3.3-3.7 s of
the loop: `/metrics` now carries broker-wide figures and the series of at most
`[management] metrics_queue_limit` queues (the deepest), and `/metrics/per-object`
all of them (docs/operations.md, "Metrics").
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Callable

from .exposition import (BrokerFigures, CounterCarry, QueueColumns, StoreFigures, SubscriptionFigures,
                         main_families, per_object_families, render)
from .cluster import cluster_figures
from .ha import ha_figures
from .pacing import paced, paced_each

if TYPE_CHECKING:
    from .port import MetricsOperations


def queue_reader(cols: QueueColumns) -> Callable[[Any], None]:
    """A function appending one queue's figures to the columns (one slice at a time)."""
    names, depth, size, consumers = cols.names.append, cols.depth.append, cols.bytes.append, cols.consumers.append
    enq, dlv, ack = cols.enqueued.append, cols.delivered.append, cols.acked.append
    exp, dlq = cols.expired.append, cols.dead_lettered.append
    rej, drop = cols.overflow_rejected.append, cols.overflow_dropped.append

    def read(q: Any) -> None:
        names(q.name)
        depth(q.depth)
        size(q.bytes)
        consumers(len(q.consumers))
        enq(q.enqueued_total)
        dlv(q.delivered_total)
        ack(q.acked_total)
        exp(q.expired_total)
        dlq(q.dead_lettered_total)
        rej(q.overflow_rejected_total)
        drop(q.overflow_dropped_total)
    return read


def store_figures(store: Any) -> StoreFigures:
    stats = getattr(store, "commit_stats", None)
    return StoreFigures(
        commits=getattr(store, "commits", 0), last_batch_ops=getattr(store, "last_batch_ops", 0),
        degraded=bool(getattr(store, "degraded", None)), failed_batches=getattr(store, "failed_batches", 0),
        pending_batches=getattr(store, "pending_batches", 0), outbox_bytes=getattr(store, "outbox_bytes", 0),
        latency=(stats.latency.cumulative(), stats.latency.sum) if stats is not None else None,
        batch=(stats.batch.cumulative(), stats.batch.sum) if stats is not None else None)


class Metrics:
    def __init__(self, ops: "MetricsOperations"):
        self.ops = ops
        self.carry = CounterCarry()              # touched by the worker thread only
        self._copying: asyncio.Future[BrokerFigures] | None = None

    async def figures(self) -> BrokerFigures:
        """A fresh copy of the broker's figures (shared with scrapes already waiting)."""
        if self._copying is None or self._copying.done():
            self._copying = asyncio.ensure_future(self._copy())
        # shield: a scraper that hangs up must not cancel the copy others wait for.
        return await asyncio.shield(self._copying)

    async def _copy(self) -> BrokerFigures:
        ops = self.ops
        managed = ops.managed
        admin = ops.admin
        now = ops.clock()
        queues = QueueColumns()
        await paced_each(list(managed.broker.queues.values()), queue_reader(queues))

        def subscription(sub: Any) -> SubscriptionFigures | None:
            if sub.key is None:
                return None          # a plain topic consumer's private queue: see the queue series
            st = admin.subscription_state(sub)
            q = managed.broker.queues.get(sub.queue_name)
            return (st.namespace, st.name, st.durable, st.pending, q.bytes if q else 0, st.consumers,
                    st.idle_for(now) or 0.0)

        subs = [s for s in await paced(list(managed.subscriptions.by_queue.values()), subscription)
                if s is not None]
        handlers = admin.handlers()
        access = managed.access
        return BrokerFigures(
            queues=queues, subscriptions=subs, connections=len(handlers),
            sessions=sum(h.sessions for h in handlers), links=sum(h.links for h in handlers),
            routed=managed.broker.routed_total, unroutable=managed.broker.unroutable_total,
            store=store_figures(managed.store), refused=dict(managed.metrics_refused),
            auth_failures={"amqp": managed.metrics_auth_failures, "management": ops.auth_failures},
            auth_throttled={"all": ops.auth_throttle.throttled_addresses()},
            acl_denials=dict(access.denied), expiry_actions=dict(ops.expiry_actions),
            protections=protection_figures(managed))

    async def main_text(self) -> bytes:
        figures = await self.figures()
        limit = self.ops.settings.management.metrics_queue_limit
        return await self.ops.off_loop(lambda: render(main_families(figures, limit, self.carry)))

    async def per_object_text(self, pattern: str | None) -> bytes:
        figures = await self.figures()
        return await self.ops.off_loop(lambda: render(per_object_families(figures, pattern)))


def protection_figures(managed: Any) -> dict[str, tuple[str, str, float]]:
    """The broker's own protections, where it has them (a test double may not)."""
    out: dict[str, tuple[str, str, float]] = {}
    gate = getattr(managed, "handshakes", None)
    if gate is not None:
        out["amqpbroker_handshakes_in_progress"] = (
            "gauge", "Sockets accepted that have not opened their AMQP connection yet", gate.in_progress)
        out["amqpbroker_handshakes_refused_total"] = (
            "counter", "Sockets closed at accept: too many handshakes in all or from one address",
            gate.refused_total)
        out["amqpbroker_handshakes_timed_out_total"] = (
            "counter", "Sockets closed for not reaching the AMQP open in time", gate.timed_out_total)
    watch = getattr(managed, "resources", None)
    if watch is not None:
        out["amqpbroker_open_fds"] = ("gauge", "File descriptors open (counted every 5 s)", watch.fds)
        out["amqpbroker_fd_limit"] = ("gauge", "The process's file descriptor limit", watch.fd_limit)
        out["amqpbroker_fd_refused_total"] = (
            "counter", "Sockets closed at accept to keep file descriptors in reserve", watch.fd_refused_total)
    throttle = getattr(managed, "auth_throttle", None)
    if throttle is not None:
        out["amqpbroker_auth_throttled_attempts_total"] = (
            "counter", "Authentication attempts answered late because of earlier failures",
            throttle.throttled_total)
    alarms = getattr(managed, "alarms", None)
    if alarms is not None:
        out.update(alarm_figures(alarms))
    out.update(ha_figures(managed))   # none without [ha]
    out.update(cluster_figures(managed))   # none outside a cluster
    broker = getattr(managed, "broker", None)
    if broker is not None:
        from ..core.selectors import Stats
        out["amqpbroker_dead_letters_dropped_total"] = (
            "counter", "Messages that died in a dead-letter queue, or whose dead-letter address was unusable or "
            "full: dropped, never dead-lettered again", broker.dead_letters_dropped_total)
        out["amqpbroker_selector_budget_exceeded_total"] = (
            "counter", "Selector evaluations stopped by their budget (the message did not match)",
            Stats.budget_exceeded_total)
    flow = getattr(managed, "flow", None)
    if flow is not None:
        out["amqpbroker_producers_held"] = (
            "gauge", "Producer links given no credit now: by an alarm, by an overflow block queue without room for "
            "them, or behind anonymous-relay transfers waiting for room", flow.held)
        out["amqpbroker_producers_held_total"] = (
            "counter", "Times a producer link was held without credit", flow.held_total)
    return out


def alarm_figures(alarms: Any) -> dict[str, tuple[str, str, float]]:
    """Memory and disk alarms (core/alarms.py), one gauge per kind as RabbitMQ's
    rabbitmq_alarms_memory_used_watermark / _free_disk_space_watermark; readings not
    made yet (or the disk alarm off: no store) are left out rather than shown as 0."""
    out: dict[str, tuple[str, str, float]] = {}
    for kind in ("memory", "disk"):
        out[f"amqpbroker_alarm_{kind}"] = (
            "gauge", f"1 while the {kind} alarm is raised (producers get no new credit)", int(alarms.raised(kind)))
        out[f"amqpbroker_alarm_{kind}_raised_total"] = (
            "counter", f"Times the {kind} alarm was raised", alarms.raised_total[kind])
    figures = (("amqpbroker_memory_used_bytes", "Resident memory of the broker process (RSS)", alarms.memory_used),
               ("amqpbroker_memory_limit_bytes", "Memory high watermark: the memory alarm is raised above it",
                alarms.memory_limit))
    if alarms.disk_enabled:
        figures += (("amqpbroker_disk_free_bytes", "Free space on the data dir's filesystem", alarms.disk_free),
                    ("amqpbroker_disk_free_limit_bytes", "The disk alarm is raised below this much free space",
                     alarms.disk_free_limit))
    for name, doc, value in figures:
        if value is not None:
            out[name] = ("gauge", doc, value)
    return out
