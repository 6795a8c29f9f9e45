"""Prometheus metrics: a custom collector that reads broker state at scrape time.

Nothing is counted per message beyond the totals the queues already keep;
rates come from the `_total` counters (`rate(amqpbroker_queue_enqueued_total[1m])`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from .service import Operations


class BrokerCollector:
    def __init__(self, ops: "Operations"):
        self.ops = ops

    def describe(self) -> list:
        return []          # collected lazily; nothing to describe up front

    def collect(self) -> Iterator[Metric]:
        server = self.ops.server
        broker = server.broker
        yield from self._queues(broker)
        yield from self._subscriptions()
        handlers = [h for hs in list(server.handlers_by_container.values()) for h in hs]
        yield _gauge("amqpbroker_connections", "Open AMQP connections", len(handlers))
        yield _gauge("amqpbroker_sessions", "Open AMQP sessions", sum(h.sessions for h in handlers))
        yield _gauge("amqpbroker_links", "Attached AMQP links", sum(h.links for h in handlers))
        yield _counter("amqpbroker_messages_routed", "Messages routed to at least one queue",
                       broker.routed_total)
        yield _counter("amqpbroker_messages_unroutable", "Messages that reached no queue",
                       broker.unroutable_total)
        yield from self._store(server.store)
        refused = CounterMetricFamily("amqpbroker_refused_attaches", "Link attaches refused, by condition",
                                      labels=["condition"])
        for condition, n in sorted(server.metrics_refused.items()):
            refused.add_metric([condition], n)
        yield refused
        auth = CounterMetricFamily("amqpbroker_auth_failures", "Failed authentications", labels=["listener"])
        auth.add_metric(["amqp"], server.metrics_auth_failures)
        auth.add_metric(["management"], self.ops.auth_failures)
        yield auth
        denied = CounterMetricFamily("amqpbroker_acl_denials", "Requests denied by the ACL, by action",
                                     labels=["action"])
        for action, n in sorted(server.access.denied.items()):
            denied.add_metric([action], n)
        yield denied
        expiry = CounterMetricFamily("amqpbroker_expiry_actions",
                                     "Idle-expiry policy actions on subscriptions", labels=["action"])
        for action in ("report", "delete"):
            expiry.add_metric([action], self.ops.expiry_actions.get(action, 0))
        yield expiry

    def _queues(self, broker) -> Iterator[Metric]:
        lab = ["queue"]
        depth = GaugeMetricFamily("amqpbroker_queue_depth", "Messages held (ready, scheduled, unsettled)", labels=lab)
        size = GaugeMetricFamily("amqpbroker_queue_bytes", "Bytes of the messages held", labels=lab)
        consumers = GaugeMetricFamily("amqpbroker_queue_consumers", "Attached consumers", labels=lab)
        enq = CounterMetricFamily("amqpbroker_queue_enqueued", "Messages enqueued", labels=lab)
        dlv = CounterMetricFamily("amqpbroker_queue_delivered", "Deliveries to consumers", labels=lab)
        ack = CounterMetricFamily("amqpbroker_queue_acked", "Messages accepted by consumers", labels=lab)
        exp = CounterMetricFamily("amqpbroker_queue_expired", "Messages expired (TTL)", labels=lab)
        dlq = CounterMetricFamily("amqpbroker_queue_dead_lettered", "Messages dead-lettered", labels=lab)
        for q in list(broker.queues.values()):
            v = [q.name]
            depth.add_metric(v, q.depth)
            size.add_metric(v, q.bytes)
            consumers.add_metric(v, len(q.consumers))
            enq.add_metric(v, q.enqueued_total)
            dlv.add_metric(v, q.delivered_total)
            ack.add_metric(v, q.acked_total)
            exp.add_metric(v, q.expired_total)
            dlq.add_metric(v, q.dead_lettered_total)
        yield from (depth, size, consumers, enq, dlv, ack, exp, dlq)

    def _subscriptions(self) -> Iterator[Metric]:
        admin = self.ops.admin
        now = self.ops.clock()
        lab = ["namespace", "name", "durable"]
        pending = GaugeMetricFamily("amqpbroker_subscription_pending_messages",
                                    "Messages waiting in a subscription", labels=lab)
        pbytes = GaugeMetricFamily("amqpbroker_subscription_pending_bytes",
                                   "Bytes waiting in a subscription", labels=lab)
        consumers = GaugeMetricFamily("amqpbroker_subscription_consumers",
                                      "Consumers attached to a subscription", labels=lab)
        idle = GaugeMetricFamily("amqpbroker_subscription_idle_seconds",
                                 "Seconds a subscription has had no consumer (0 while consumed)", labels=lab)
        count = 0
        for sub in list(admin.registry.by_queue.values()):
            if sub.key is None:
                continue            # private topic-consumer queues: see the queue metrics
            st = admin.subscription_state(sub)
            v = [st.namespace, st.name, "true" if st.durable else "false"]
            q = admin.broker.queues.get(sub.queue_name)
            pending.add_metric(v, st.pending)
            pbytes.add_metric(v, q.bytes if q else 0)
            consumers.add_metric(v, st.consumers)
            idle.add_metric(v, st.idle_for(now) or 0.0)
            count += 1
        yield from (pending, pbytes, consumers, idle)
        yield _gauge("amqpbroker_subscriptions", "Named subscriptions", count)

    def _store(self, store) -> Iterator[Metric]:
        yield _counter("amqpbroker_store_commits", "Store write transactions committed",
                       getattr(store, "commits", 0))
        yield _gauge("amqpbroker_store_last_batch_operations", "Operations in the last commit",
                     getattr(store, "last_batch_ops", 0))
        degraded = getattr(store, "degraded", None)
        yield _gauge("amqpbroker_store_degraded",
                     "1 while durable messages are refused after a store fault (the log line says why)",
                     1 if degraded else 0)
        yield _counter("amqpbroker_store_failed_batches",
                       "Store batches whose writes failed (their producers were told rejected)",
                       getattr(store, "failed_batches", 0))
        yield _gauge("amqpbroker_store_pending_batches", "Batches handed to the writer, not yet committed",
                     getattr(store, "pending_batches", 0))
        yield _gauge("amqpbroker_store_outbox_bytes", "Encoded batches waiting for the writer's pipe",
                     getattr(store, "outbox_bytes", 0))
        stats = getattr(store, "commit_stats", None)
        if stats is None:
            return
        yield HistogramMetricFamily("amqpbroker_store_commit_seconds", "Store commit latency (fsync included)",
                                    buckets=stats.latency.cumulative(), sum_value=stats.latency.sum)
        yield HistogramMetricFamily("amqpbroker_store_batch_operations", "Operations per store commit",
                                    buckets=stats.batch.cumulative(), sum_value=stats.batch.sum)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def render(ops: "Operations") -> tuple[bytes, str]:
    registry = getattr(ops, "_metrics_registry", None)
    if registry is None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(BrokerCollector(ops))
        ops._metrics_registry = registry
    return generate_latest(registry), CONTENT_TYPE_LATEST
