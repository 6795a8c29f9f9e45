"""The pure metrics rendering (management/exposition.py): the same text as
prometheus_client for the same families, the bounded /metrics selection, the
broker-wide counters that never go down, and the per-object filter."""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from amqpbroker.management.exposition import (QUEUE_FIELDS, BrokerFigures, CounterCarry, QueueColumns,
                                              StoreFigures, main_families, per_object_families, render)

NAMES = ['plain', 'quo"te', "back\\slash", "new\nline", "ünï"]


def queues(n: int = 5, depth=lambda i: i) -> QueueColumns:
    return QueueColumns.of((f"q{i:03d}", depth(i), 100 * i, i % 3, 10 * i, 9 * i, 8 * i, i, 2 * i) for i in range(n))


def figures(**kw) -> BrokerFigures:
    store = StoreFigures(commits=12345678, last_batch_ops=3, failed_batches=1,
                         latency=([("0.001", 1), ("0.01", 3), ("+Inf", 4)], 0.0375),
                         batch=([("1.0", 2), ("+Inf", 4)], 11.0))
    base = dict(queues=QueueColumns.of((n, 2, 30, 1, 7, 6, 5, 0, 1) for n in NAMES),
                subscriptions=[("app", "audit", True, 4, 40, 0, 12.5), ("_global_", 'g"1', False, 0, 0, 2, 0.0)],
                connections=2, sessions=3, links=4, routed=99, unroutable=1, store=store,
                refused={"amqp:not-found": 2}, auth_failures={"amqp": 1, "management": 5},
                auth_throttled={"management": 1}, acl_denials={"send": 3}, expiry_actions={"report": 1})
    return BrokerFigures(**{**base, **kw})


def reference(fig: BrokerFigures) -> bytes:
    """The per-queue and per-subscription part, written by prometheus_client itself."""
    class Collector:
        def collect(self):
            lab = ["queue"]
            specs = [("amqpbroker_queue_depth", GaugeMetricFamily, "Messages held (ready, scheduled, unsettled)", 1),
                     ("amqpbroker_queue_bytes", GaugeMetricFamily, "Bytes of the messages held", 2),
                     ("amqpbroker_queue_consumers", GaugeMetricFamily, "Attached consumers", 3),
                     ("amqpbroker_queue_enqueued", CounterMetricFamily, "Messages enqueued", 4),
                     ("amqpbroker_queue_delivered", CounterMetricFamily, "Deliveries to consumers", 5),
                     ("amqpbroker_queue_acked", CounterMetricFamily, "Messages accepted by consumers", 6),
                     ("amqpbroker_queue_expired", CounterMetricFamily, "Messages expired (TTL)", 7),
                     ("amqpbroker_queue_dead_lettered", CounterMetricFamily, "Messages dead-lettered", 8),
                     ("amqpbroker_queue_overflow_rejected", CounterMetricFamily,
                      "Messages rejected because the queue was full (overflow reject)", 9),
                     ("amqpbroker_queue_overflow_dropped", CounterMetricFamily,
                      "Messages dropped or dead-lettered from the head because the queue was full "
                      "(overflow drop-head)", 10)]
            for name, cls, doc, i in specs:
                fam = cls(name, doc, labels=lab)
                rows = list(zip(fig.queues.names, *(fig.queues.column(c) for c in QUEUE_FIELDS)))
                for q in rows:
                    fam.add_metric([q[0]], q[i])
                yield fam
            lab = ["namespace", "name", "durable"]
            for name, doc, i in [
                    ("amqpbroker_subscription_pending_messages", "Messages waiting in a subscription", 3),
                    ("amqpbroker_subscription_pending_bytes", "Bytes waiting in a subscription", 4),
                    ("amqpbroker_subscription_consumers", "Consumers attached to a subscription", 5),
                    ("amqpbroker_subscription_idle_seconds",
                     "Seconds a subscription has had no consumer (0 while consumed)", 6)]:
                fam = GaugeMetricFamily(name, doc, labels=lab)
                for s in sorted(fig.subscriptions):
                    fam.add_metric([s[0], s[1], "true" if s[2] else "false"], s[i])
                yield fam

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    return generate_latest(registry)


def test_per_object_text_is_prometheus_clients_byte_for_byte():
    fig = figures()
    assert render(per_object_families(fig)) == reference(fig)


def test_odd_values_are_written_as_prometheus_client_writes_them():
    odd = QueueColumns.of([("a", 2.5, 10**7, 0, 123456789012, 999_999, 1_000_000, -3, 0),
                           ("b", 0, 1, 2, 3, 4, 5, 6, 7)])
    fig = figures(queues=odd)
    assert render(per_object_families(fig)) == reference(fig)
    text = render(per_object_families(fig)).decode()
    assert 'amqpbroker_queue_bytes{queue="a"} 1e+07' in text
    assert 'amqpbroker_queue_acked_total{queue="a"} 1e+06' in text
    assert 'amqpbroker_queue_delivered_total{queue="a"} 999999.0' in text


def test_scalars_histograms_and_big_numbers_match_prometheus_client():
    fig = figures()
    text = render(main_families(fig, 1000, CounterCarry())).decode()

    class Collector:
        def collect(self):
            yield CounterMetricFamily("amqpbroker_store_commits", "Store write transactions committed",
                                      value=12345678)
            yield HistogramMetricFamily("amqpbroker_store_commit_seconds", "Store commit latency (fsync included)",
                                        buckets=fig.store.latency[0], sum_value=fig.store.latency[1])
            fam = CounterMetricFamily("amqpbroker_auth_failures", "Failed authentications", labels=["listener"])
            fam.add_metric(["amqp"], 1)
            fam.add_metric(["management"], 5)
            yield fam

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    for block in generate_latest(registry).decode().split("# HELP ")[1:]:
        assert "# HELP " + block in text, block


def test_main_text_parses_and_keeps_the_existing_names():
    text = render(main_families(figures(), 1000, CounterCarry())).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("amqpbroker_queue_depth", "amqpbroker_queue_enqueued", "amqpbroker_subscription_pending_messages",
                 "amqpbroker_subscriptions", "amqpbroker_connections", "amqpbroker_messages_routed",
                 "amqpbroker_store_commits", "amqpbroker_store_commit_seconds", "amqpbroker_refused_attaches",
                 "amqpbroker_auth_failures", "amqpbroker_acl_denials", "amqpbroker_expiry_actions",
                 "amqpbroker_queues", "amqpbroker_messages", "amqpbroker_messages_enqueued",
                 "amqpbroker_auth_throttled_addresses", "amqpbroker_metrics_queues_omitted"):
        assert name in families, name
    depth = {s.labels["queue"]: s.value for s in families["amqpbroker_queue_depth"].samples}
    assert depth == {n: 2.0 for n in NAMES}, "label values survive escaping"
    assert 'amqpbroker_auth_failures_total{listener="management"} 5.0' in text
    assert 'amqpbroker_expiry_actions_total{action="delete"} 0.0' in text
    assert "amqpbroker_messages 10.0" in text and "amqpbroker_queues 5.0" in text


def test_main_metrics_show_the_deepest_queues_up_to_the_limit():
    fig = BrokerFigures(queues=queues(50, depth=lambda i: (i * 7) % 11))
    text = render(main_families(fig, 4, CounterCarry())).decode()
    shown = re.findall(r'^amqpbroker_queue_depth\{queue="(q\d+)"\} (\S+)$', text, re.M)
    assert shown == [("q003", "10.0"), ("q014", "10.0"), ("q025", "10.0"), ("q036", "10.0")]
    for name in ("amqpbroker_queue_bytes", "amqpbroker_queue_acked_total"):
        assert len(re.findall(rf"^{name}\{{", text, re.M)) == 4
    assert "amqpbroker_metrics_queues_omitted 46.0" in text and "amqpbroker_queues 50.0" in text
    assert f"amqpbroker_messages {float(sum(fig.queues.depth))}" in text
    assert f"amqpbroker_messages_enqueued_total {float(sum(10 * i for i in range(50)))}" in text
    none = render(main_families(fig, 0, CounterCarry())).decode()
    assert "amqpbroker_queue_depth{" not in none and "amqpbroker_metrics_queues_omitted 50.0" in none


def test_subscriptions_are_bounded_too():
    subs = [("app", f"s{i}", True, i, 0, 0, 0.0) for i in range(10)]
    text = render(main_families(BrokerFigures(subscriptions=subs), 3, CounterCarry())).decode()
    shown = re.findall(r'^amqpbroker_subscription_pending_messages\{.*name="(s\d)".*\} ', text, re.M)
    assert shown == ["s9", "s8", "s7"]
    assert "amqpbroker_subscriptions 10.0" in text and "amqpbroker_metrics_subscriptions_omitted 7.0" in text


def test_per_object_filter_by_glob_or_prefix():
    fig = BrokerFigures(queues=queues(30), subscriptions=[("app", "q01x", True, 1, 0, 0, 0.0)])
    for pattern, expected in (("q01", [f"q{i:03d}" for i in range(10, 20)]), ("q0*5", ["q005", "q015", "q025"]),
                              (None, [f"q{i:03d}" for i in range(30)]), ("zzz", [])):
        text = render(per_object_families(fig, pattern)).decode()
        assert re.findall(r'^amqpbroker_queue_depth\{queue="([^"]+)"\}', text, re.M) == expected, pattern
    assert 'name="q01x"' in render(per_object_families(fig, "q01")).decode()
    assert 'name="q01x"' not in render(per_object_families(fig, "q02")).decode()


def carried(rows) -> QueueColumns:
    return QueueColumns.of((name, 0, 0, 0, *counts) for name, counts in rows)


def test_broker_wide_counters_never_go_down():
    carry = CounterCarry()
    z = (0, 0, 0)
    assert carry.totals(carried([("a", (5, 1, *z)), ("b", (3, 0, *z))]))[:2] == (8, 1)
    assert carry.totals(carried([("a", (6, 1, *z)), ("b", (3, 0, *z))]))[:2] == (9, 1)
    assert carry.totals(carried([("a", (6, 1, *z))]))[:2] == (9, 1), "b deleted: what it counted stays"
    assert carry.totals(carried([("a", (6, 1, *z)), ("b", (1, 0, *z))]))[:2] == (10, 1), "b re-created"
    assert carry.totals(carried([("a", (2, 0, *z)), ("b", (1, 0, *z))]))[:2] == (12, 1), \
        "a re-created in place (same queues, lower counters)"
    assert carry.totals(carried([]))[:2] == (12, 1) and carry.totals(carried([]))[:2] == (12, 1)
    assert carry.totals(carried([("c", (0, 0, 0, 0, 4))])) == (12, 1, 0, 0, 4, 0, 0)
    assert carry.totals(carried([("c", (0, 0, 0, 0, 4, 2, 3))])) == (12, 1, 0, 0, 4, 2, 3)


def test_figures_are_columns_the_gc_does_not_see_per_queue():
    """A record per queue is a container the garbage collector tracks: 50,000 per scrape
    brought on collections that stop the loop (35 ms young, 150-350 ms full)."""
    import gc

    from amqpbroker.management.metrics import queue_reader

    class FakeQueue:
        name, depth, bytes, consumers = "q", 1, 2, []
        enqueued_total = delivered_total = acked_total = expired_total = dead_lettered_total = 0
        overflow_rejected_total = overflow_dropped_total = 0

    cols = QueueColumns()
    read = queue_reader(cols)
    gc.disable()
    try:
        start = len(gc.get_objects(0))
        for _ in range(10_000):
            read(FakeQueue())
        grown = len(gc.get_objects(0)) - start
    finally:
        gc.enable()
    assert len(cols) == 10_000 and cols.depth[:2] == [1, 1]
    assert grown < 100, f"{grown} tracked objects for 10,000 queues"
