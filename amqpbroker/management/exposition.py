"""Prometheus text exposition from plain figures (pure: no broker objects, no I/O).

`metrics.py` copies the broker's numbers into the plain columns below on the event
loop, a slice at a time; everything here then runs in a worker thread: choosing the
queues that get their own series, summing, and writing the text.  The text is the
same, byte for byte, as prometheus_client's `generate_latest` for the same families
(tests/management/test_exposition.py), at a twentieth of the cost: 50,000 queues'
400,000 lines take ~0.15 s here against ~3 s there.

Two renderings of one snapshot:

* `main_families`: what `/metrics` shows.  Broker-wide figures (queue count, messages,
  bytes, consumers, and counters summed over every queue), the per-queue series of at
  most `queue_limit` queues (the deepest, then by name) and the per-subscription
  series of at most as many subscriptions (most pending first), and how many were
  left out (`amqpbroker_metrics_queues_omitted`).  A scrape stays small whatever the
  number of queues; a broker with fewer queues than the limit shows all of them, as
  before.
* `per_object_families`: every queue's and named subscription's series (or those whose
  name matches a glob/prefix), queues in the broker's order: `/metrics/per-object`,
  for the scrapes that want them.
"""

from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Sequence

from prometheus_client.utils import floatToGoString

from .listing import name_matcher

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


# ---------------------------------------------------------------------- figures (plain data)

QUEUE_FIELDS = ("depth", "bytes", "consumers", "enqueued", "delivered", "acked", "expired", "dead_lettered",
                "overflow_rejected", "overflow_dropped")
COUNTER_FIELDS = QUEUE_FIELDS[3:]          # the cumulative ones


@dataclass(frozen=True)
class QueueColumns:
    """Every queue's figures, a list per figure (the i-th entry of each: the i-th queue).

    Columns, not a record per queue: a tuple or object per queue is a container the
    garbage collector tracks, and 50,000 of them per scrape triggered a young-generation
    collection of ~35 ms, and fed the old generation, whose full collections took
    ~150-350 ms with 50,000 queues in the heap: every thread stops, the event loop with
    them.  Lists of ints and strings are nine containers, however many queues."""
    names: list[str] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    bytes: list[int] = field(default_factory=list)
    consumers: list[int] = field(default_factory=list)
    enqueued: list[int] = field(default_factory=list)
    delivered: list[int] = field(default_factory=list)
    acked: list[int] = field(default_factory=list)
    expired: list[int] = field(default_factory=list)
    dead_lettered: list[int] = field(default_factory=list)
    overflow_rejected: list[int] = field(default_factory=list)   # queue limits (core/limits.py)
    overflow_dropped: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.names)

    def column(self, name: str) -> list[int]:
        return getattr(self, name)

    @classmethod
    def of(cls, rows: Iterable[Sequence]) -> "QueueColumns":   # type: ignore[type-arg]
        """From (name, depth, bytes, consumers, enqueued, …) rows (tests, small sets);
        the overflow counters may be left out (0)."""
        cols = cls()
        lists = [cols.names] + [cols.column(f) for f in QUEUE_FIELDS]
        for row in rows:
            if len(row) == len(lists) - 2:
                row = (*row, 0, 0)
            for target, value in zip(lists, row, strict=True):
                target.append(value)
        return cols


# A named subscription's figures: a plain tuple (CPython stops tracking a tuple of
# strings and numbers at the first collection it survives; a NamedTuple never).
SubscriptionFigures = tuple   # (namespace, name, durable, pending, pending_bytes, consumers, idle_seconds)
S_NAMESPACE, S_NAME, S_DURABLE, S_PENDING = 0, 1, 2, 3


@dataclass(frozen=True)
class StoreFigures:
    commits: int = 0
    last_batch_ops: int = 0
    degraded: bool = False
    failed_batches: int = 0
    pending_batches: int = 0
    outbox_bytes: int = 0
    latency: tuple[list[tuple[str, float]], float] | None = None     # cumulative buckets, sum
    batch: tuple[list[tuple[str, float]], float] | None = None


@dataclass(frozen=True)
class BrokerFigures:
    queues: QueueColumns = field(default_factory=QueueColumns)
    subscriptions: Sequence[SubscriptionFigures] = ()     # named subscriptions only
    connections: int = 0
    sessions: int = 0
    links: int = 0
    routed: int = 0
    unroutable: int = 0
    store: StoreFigures = StoreFigures()
    refused: dict[str, int] = field(default_factory=dict)          # condition → attaches
    auth_failures: dict[str, int] = field(default_factory=dict)    # listener → failures
    auth_throttled: dict[str, int] = field(default_factory=dict)   # listener → addresses slowed
    acl_denials: dict[str, int] = field(default_factory=dict)
    expiry_actions: dict[str, int] = field(default_factory=dict)
    # Protections (docs/operations.md "Limits and protections"): name → (kind, help, value).
    protections: dict[str, tuple[str, str, float]] = field(default_factory=dict)


# ---------------------------------------------------------------------- text format

class Family(NamedTuple):
    name: str              # as exposed (counters end in _total)
    kind: str              # gauge | counter | histogram
    help: str
    lines: list[str]       # rendered samples, each ending in "\n"


def number(value: float) -> str:
    """prometheus_client's value format ("2.0", "1.2345678e+07", "+Inf"); ints fast."""
    if type(value) is int and -10**15 < value < 1_000_000:
        return f"{value}.0"
    return floatToGoString(value)


def escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def labels(pairs: Iterable[tuple[str, str]]) -> str:
    """`{a="x",b="y"}`, names sorted (as prometheus_client writes them)."""
    return "{" + ",".join(f'{k}="{escape_label(v)}"' for k, v in sorted(pairs)) + "}"


def render(families: Iterable[Family]) -> bytes:
    """The text of the families, which it consumes (their lines are emptied).

    Joined, encoded and freed family by family: joining 20 MB at once, or freeing
    400,000 lines in one go when the families are dropped, is a single C call holding
    the GIL (the event loop's too) for tens of milliseconds."""
    parts: list[bytes] = []
    for f in families:
        doc = f.help.replace("\\", r"\\").replace("\n", r"\n")
        parts.append(f"# HELP {f.name} {doc}\n# TYPE {f.name} {f.kind}\n".encode())
        parts.append("".join(f.lines).encode("utf-8"))
        f.lines.clear()
    return b"".join(parts)


def scalar(name: str, kind: str, doc: str, value: float) -> Family:
    return Family(name, kind, doc, [f"{name} {number(value)}\n"])


def by_label(name: str, kind: str, doc: str, label: str, rows: Iterable[tuple[str, float]]) -> Family:
    return Family(name, kind, doc, [f"{name}{labels([(label, key)])} {number(v)}\n" for key, v in rows])


def histogram(name: str, doc: str, buckets: list[tuple[str, float]], total: float) -> Family:
    lines = [f'{name}_bucket{{le="{le}"}} {number(n)}\n' for le, n in buckets]
    lines.append(f"{name}_count {number(buckets[-1][1] if buckets else 0)}\n")
    lines.append(f"{name}_sum {number(total)}\n")
    return Family(name, "histogram", doc, lines)


# ---------------------------------------------------------------------- per-queue / per-subscription

QUEUE_SERIES = (   # (name, kind, help, column)
    ("amqpbroker_queue_depth", "gauge", "Messages held (ready, scheduled, unsettled)", "depth"),
    ("amqpbroker_queue_bytes", "gauge", "Bytes of the messages held", "bytes"),
    ("amqpbroker_queue_consumers", "gauge", "Attached consumers", "consumers"),
    ("amqpbroker_queue_enqueued_total", "counter", "Messages enqueued", "enqueued"),
    ("amqpbroker_queue_delivered_total", "counter", "Deliveries to consumers", "delivered"),
    ("amqpbroker_queue_acked_total", "counter", "Messages accepted by consumers", "acked"),
    ("amqpbroker_queue_expired_total", "counter", "Messages expired (TTL)", "expired"),
    ("amqpbroker_queue_dead_lettered_total", "counter", "Messages dead-lettered", "dead_lettered"),
    ("amqpbroker_queue_overflow_rejected_total", "counter",
     "Messages rejected because the queue was full (overflow reject)", "overflow_rejected"),
    ("amqpbroker_queue_overflow_dropped_total", "counter",
     "Messages dropped or dead-lettered from the head because the queue was full (overflow drop-head)",
     "overflow_dropped"),
)

SUBSCRIPTION_SERIES = (
    ("amqpbroker_subscription_pending_messages", "Messages waiting in a subscription", 3),
    ("amqpbroker_subscription_pending_bytes", "Bytes waiting in a subscription", 4),
    ("amqpbroker_subscription_consumers", "Consumers attached to a subscription", 5),
    ("amqpbroker_subscription_idle_seconds",
     "Seconds a subscription has had no consumer (0 while consumed)", 6),
)


def queue_families(cols: QueueColumns, order: Sequence[int]) -> list[Family]:
    """The per-queue series of the queues at `order` (indices into the columns)."""
    names = cols.names
    keys = [f'{{queue="{escape_label(names[i])}"}} ' for i in order]
    return [Family(name, kind, doc, _lines(name, keys, [column[i] for i in order]))
            for name, kind, doc, column in ((n, k, d, cols.column(c)) for n, k, d, c in QUEUE_SERIES)]


def _lines(name: str, keys: list[str], values: list) -> list[str]:   # type: ignore[type-arg]
    if set(map(type, values)) <= {int}:
        # Queue figures are ints: the common case written inline (400,000 lines for
        # 50,000 queues: a function call each would be a third of the time).
        return [f"{name}{k}{v}.0\n" if 0 <= v < 1_000_000 else f"{name}{k}{number(v)}\n"
                for k, v in zip(keys, values)]
    return [f"{name}{k}{number(v)}\n" for k, v in zip(keys, values)]


def subscription_families(subs: Sequence[SubscriptionFigures]) -> list[Family]:
    keys = [labels([("namespace", s[S_NAMESPACE]), ("name", s[S_NAME]),
                    ("durable", "true" if s[S_DURABLE] else "false")]) + " " for s in subs]
    return [Family(name, "gauge", doc, [f"{name}{k}{number(s[i])}\n" for k, s in zip(keys, subs)])
            for name, doc, i in SUBSCRIPTION_SERIES]


def deepest(cols: QueueColumns, limit: int) -> list[int]:
    """Indices of the `limit` deepest queues, deepest first, then by name."""
    depth, names = cols.depth, cols.names
    return first(range(len(cols)), limit, lambda i: (-depth[i], names[i]))


def _most_pending(s: SubscriptionFigures) -> tuple[int, str, str]:
    return (-s[S_PENDING], s[S_NAMESPACE], s[S_NAME])


def first(items: Sequence, limit: int, key) -> list:   # type: ignore[type-arg]
    """The `limit` first items in `key` order: a heap selection (a Python loop, which
    the worker thread can be interrupted in) when that is a small part of them."""
    if limit * 4 >= len(items):
        return sorted(items, key=key)[:limit]
    return heapq.nsmallest(limit, items, key=key)


# ---------------------------------------------------------------------- broker-wide counters

class CounterCarry:
    """Broker-wide counters (messages enqueued, delivered, …) are sums over queues, and
    queues come and go (temporary queues all the time).  A plain sum would drop when a
    queue is deleted, and Prometheus reads a drop as a counter reset: `rate()` would
    then jump by the whole remaining sum.  So the last figures seen of every queue are
    kept, and a queue that is gone (or came back re-created, its counters lower) adds
    them to a carried total: the sums never go down.  What a deleted queue counted after
    the last scrape is not seen.  Used from one thread at a time (the renderer)."""

    def __init__(self) -> None:
        self._names: list[str] = []
        self._columns: list[list[int]] = [[] for _ in COUNTER_FIELDS]
        self._carried = [0] * len(COUNTER_FIELDS)

    def totals(self, cols: QueueColumns) -> tuple[int, ...]:
        columns = [cols.column(f) for f in COUNTER_FIELDS]
        names, last = self._names, self._columns
        if cols.names == names:
            # The same queues as last time (the usual case): C-level comparisons only.
            if any(any(map(operator.lt, now, before)) for now, before in zip(columns, last)):
                self._carry_lowered(range(len(names)), range(len(names)), columns)
        else:
            index = {name: i for i, name in enumerate(cols.names)}
            gone = [j for j, name in enumerate(names) if name not in index]
            for j in gone:
                self._carry(j)
            kept = [(index[name], j) for j, name in enumerate(names) if name in index]
            self._carry_lowered([i for i, _ in kept], [j for _, j in kept], columns)
        self._names, self._columns = cols.names, columns     # never changed once collected
        return tuple(carried + sum(column) for carried, column in zip(self._carried, columns))

    def _carry(self, j: int) -> None:
        self._carried = [c + column[j] for c, column in zip(self._carried, self._columns)]

    def _carry_lowered(self, now_at: Iterable[int], before_at: Iterable[int], columns: list[list[int]]) -> None:
        """Queues whose counters went down were re-created: their old figures are carried."""
        for i, j in zip(now_at, before_at):
            if any(now[i] < before[j] for now, before in zip(columns, self._columns)):
                self._carry(j)


# ---------------------------------------------------------------------- the two renderings

def main_families(fig: BrokerFigures, queue_limit: int, carry: CounterCarry) -> list[Family]:
    cols = fig.queues
    shown = deepest(cols, queue_limit)
    subs = first(fig.subscriptions, queue_limit, _most_pending)
    enq, dlv, ack, exp, dlq, rej, drop = carry.totals(cols)
    out = queue_families(cols, shown)
    out += [
        scalar("amqpbroker_queues", "gauge", "Queues", len(cols)),
        scalar("amqpbroker_messages", "gauge", "Messages held in all queues", sum(cols.depth)),
        scalar("amqpbroker_messages_bytes", "gauge", "Bytes of the messages held in all queues", sum(cols.bytes)),
        scalar("amqpbroker_consumers", "gauge", "Consumers attached to queues", sum(cols.consumers)),
        scalar("amqpbroker_messages_enqueued_total", "counter", "Messages enqueued, all queues", enq),
        scalar("amqpbroker_messages_delivered_total", "counter", "Deliveries to consumers, all queues", dlv),
        scalar("amqpbroker_messages_acked_total", "counter", "Messages accepted by consumers, all queues", ack),
        scalar("amqpbroker_messages_expired_total", "counter", "Messages expired (TTL), all queues", exp),
        scalar("amqpbroker_messages_dead_lettered_total", "counter", "Messages dead-lettered, all queues", dlq),
        scalar("amqpbroker_messages_overflow_rejected_total", "counter",
               "Messages rejected by full queues (overflow reject), all queues", rej),
        scalar("amqpbroker_messages_overflow_dropped_total", "counter",
               "Messages dropped from the head of full queues (overflow drop-head), all queues", drop),
        scalar("amqpbroker_metrics_queues_omitted", "gauge",
               "Queues without their own series here (see /metrics/per-object)", len(cols) - len(shown)),
        scalar("amqpbroker_metrics_subscriptions_omitted", "gauge",
               "Subscriptions without their own series here (see /metrics/per-object)",
               len(fig.subscriptions) - len(subs)),
    ]
    out += subscription_families(subs)
    out.append(scalar("amqpbroker_subscriptions", "gauge", "Named subscriptions", len(fig.subscriptions)))
    out += [
        scalar("amqpbroker_connections", "gauge", "Open AMQP connections", fig.connections),
        scalar("amqpbroker_sessions", "gauge", "Open AMQP sessions", fig.sessions),
        scalar("amqpbroker_links", "gauge", "Attached AMQP links", fig.links),
        scalar("amqpbroker_messages_routed_total", "counter", "Messages routed to at least one queue", fig.routed),
        scalar("amqpbroker_messages_unroutable_total", "counter", "Messages that reached no queue",
               fig.unroutable),
    ]
    out += store_families(fig.store)
    out += [
        by_label("amqpbroker_refused_attaches_total", "counter", "Link attaches refused, by condition",
                 "condition", sorted(fig.refused.items())),
        by_label("amqpbroker_auth_failures_total", "counter", "Failed authentications", "listener",
                 fig.auth_failures.items()),
        by_label("amqpbroker_auth_throttled_addresses", "gauge",
                 "Source addresses whose authentication attempts are being slowed", "listener",
                 fig.auth_throttled.items()),
        by_label("amqpbroker_acl_denials_total", "counter", "Requests denied by the ACL, by action", "action",
                 sorted(fig.acl_denials.items())),
        by_label("amqpbroker_expiry_actions_total", "counter", "Idle-expiry policy actions on subscriptions",
                 "action", [(a, fig.expiry_actions.get(a, 0)) for a in ("report", "delete")]),
    ]
    out += [scalar(name, kind, doc, value) for name, (kind, doc, value) in sorted(fig.protections.items())]
    return out


def store_families(st: StoreFigures) -> list[Family]:
    out = [
        scalar("amqpbroker_store_commits_total", "counter", "Store write transactions committed", st.commits),
        scalar("amqpbroker_store_last_batch_operations", "gauge", "Operations in the last commit",
               st.last_batch_ops),
        scalar("amqpbroker_store_degraded", "gauge",
               "1 while durable messages are refused after a store fault (the log line says why)",
               1 if st.degraded else 0),
        scalar("amqpbroker_store_failed_batches_total", "counter",
               "Store batches whose writes failed (their producers were told rejected)", st.failed_batches),
        scalar("amqpbroker_store_pending_batches", "gauge", "Batches handed to the writer, not yet committed",
               st.pending_batches),
        scalar("amqpbroker_store_outbox_bytes", "gauge", "Encoded batches waiting for the writer's pipe",
               st.outbox_bytes),
    ]
    if st.latency is not None:
        out.append(histogram("amqpbroker_store_commit_seconds", "Store commit latency (fsync included)",
                             *st.latency))
    if st.batch is not None:
        out.append(histogram("amqpbroker_store_batch_operations", "Operations per store commit", *st.batch))
    return out


def per_object_families(fig: BrokerFigures, pattern: str | None = None) -> list[Family]:
    # Queues in the broker's order (creation order), not sorted by name: sorting 50,000
    # names is one C call that holds the GIL, and the loop with it, for ~30 ms.
    match = name_matcher(pattern)
    order = [i for i, name in enumerate(fig.queues.names) if match(name)]
    subs = sorted((s for s in fig.subscriptions if match(s[S_NAME])), key=lambda s: (s[S_NAMESPACE], s[S_NAME]))
    return queue_families(fig.queues, order) + subscription_families(subs)


__all__ = ["BrokerFigures", "CONTENT_TYPE", "CounterCarry", "Family", "QueueColumns", "StoreFigures",
           "SubscriptionFigures", "main_families", "per_object_families", "render"]
