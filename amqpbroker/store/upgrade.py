"""Upgrading a store written before the topic log (docs/architecture.md "Upgrade").

Before the topic log, a durable subscription queue kept an entry per message in the
`entries` db, like any queue.  A durable subscription queue with no cursor record
is in that layout: at start-up, before anything is recovered, its entries become
log records and its state a cursor, in one batch that also drops the old entries
(one transaction: after a crash the store is either all old or all new), and the
start goes on with the log.

`plan` decides (pure): the messages held in message-id order, which is the order of
every queue that got them by fan-out, become one record each, with the route
"every member" and a minus list of the upgraded queues that did not hold it; a
queue whose entries are not in message-id order (a message moved or replayed into
it, say) gets records of its own.  What recovery would have done with the old
entries is done here: an entry marked delivered or under its queue's delivery
watermark comes back with delivery-count + 1 (a cursor state), and the watermark
goes.
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from ..core.cursors import Cursor
from ..core.topiclog import DIRECT, EVERY
from .base import EntryRecord, StoreError
from .batch import ENTRY_KEY, U32, U64
from .logrecords import encode_cursor, encode_record, encode_route, key
from .reads import LOG_QUEUE

log = logging.getLogger("amqpbroker.store")

@dataclass
class Plan:
    records: list[tuple[int, int, EntryRecord, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    # (position, route: "every" or "direct", fields, plus, minus)
    cursors: dict[int, Cursor] = field(default_factory=dict)
    last: int = 0


EVERY_ROUTE, DIRECT_ROUTE = "every", "direct"


def plan(queues: list[int], read: Callable[[int], Iterable[EntryRecord]], marks: dict[int, int],
         first: int = 1) -> Plan:
    """`read(q)`: queue q's entries in sequence order (called twice per queue, so that
    a large store is streamed: what is kept is 4 bytes per entry and one record per
    message); `marks`: queue id -> its delivery watermark (0: none).  Positions
    from `first` on."""
    out = Plan()
    shared = [q for q in queues if _in_id_order(read(q))]
    holders: dict[int, array] = {}
    fields: dict[int, EntryRecord] = {}
    counts: dict[tuple[int, int], int] = {}
    firsts: dict[int, int] = {}   # queue -> the first message it holds
    for q in shared:
        for e in read(q):
            e = _fixed(e, marks.get(q, 0))
            firsts.setdefault(q, e.msg_id)
            held = holders.get(e.msg_id)
            if held is None:
                holders[e.msg_id] = array("I", [q])
                fields[e.msg_id] = e
            else:
                held.append(q)
            if e.delivery_count != fields[e.msg_id].delivery_count:
                counts[(q, e.msg_id)] = e.delivery_count
    pos = first - 1
    at: dict[int, int] = {}
    starting: dict[int, list[int]] = {}   # message -> the queues whose first it is
    for q, mid in firsts.items():
        starting.setdefault(mid, []).append(q)
    covering: set[int] = set()            # the queues holding messages from here on
    for mid in sorted(holders):
        pos += 1
        at[mid] = pos
        for q in starting.get(mid, ()):
            covering.add(q)
            out.cursors[q] = Cursor(joined=pos, floor=pos)
        out.records.append((pos, EVERY_ROUTE, fields[mid], (), tuple(sorted(covering - set(holders[mid])))))
    for (q, mid), count in counts.items():
        out.cursors[q].states[at[mid]] = (count, False)
    for q in queues:
        if q in firsts:
            continue   # (a queue with no entry, or not in message-id order: records of its own)
        out.cursors[q] = Cursor(joined=pos + 1, floor=pos + 1)
        for e in read(q):
            pos += 1
            out.records.append((pos, DIRECT_ROUTE, _fixed(e, marks.get(q, 0)), (q,), ()))
    out.last = pos
    return out


def _in_id_order(es: Iterable[EntryRecord]) -> bool:
    last = -1
    for e in es:
        if e.msg_id <= last:
            return False
        last = e.msg_id
    return True


def _fixed(e: EntryRecord, watermark: int) -> EntryRecord:
    """The entry as recovery would bring it back (store/marks.py)."""
    if e.delivered or e.seq <= watermark:
        return EntryRecord(e.seq, e.msg_id, e.delivery_count + 1, False, e.priority, e.size, e.expires_at,
                           e.deliver_at, e.group)
    return e


def pending_queues(store: Any, snap: Any) -> list[Any]:
    """The durable subscription queues (QueueRecords) that have no cursor yet."""
    subs = {s["queue"] for s in snap.subscriptions if s.get("key") and s["key"][2]}
    have = {U32.unpack(bytes(k))[0] for k, _ in store.read_records("cursors")}
    return [q for q in snap.queues if q.name in subs and q.queue_id not in have]


def upgrade(store: Any, snap: Any) -> int:
    """Convert the durable subscription queues of `store` still in the per-entry
    layout; returns how many.  Blocks until the batch is on disk."""
    queues = pending_queues(store, snap)
    if not queues:
        return 0
    ids = [q.queue_id for q in queues]
    marks = {q: store.read_watermark(q) for q in ids}
    p = plan(ids, lambda q: _entries(store, q), marks, first=store.read_last_seq(LOG_QUEUE) + 1)
    writes = store.writes()
    top = max((U32.unpack(bytes(k))[0] for k, _ in store.read_records("routes")), default=0)
    rids = {EVERY_ROUTE: top + 1, DIRECT_ROUTE: top + 2}
    writes.put_meta("set", "routes", key(top + 1), encode_route(EVERY))
    writes.put_meta("set", "routes", key(top + 2), encode_route(DIRECT))
    for pos, route, e, plus, minus in p.records:
        value = encode_record(e.msg_id, e.delivery_count, e.priority, e.size, e.expires_at, e.deliver_at,
                              e.group, rids[route], plus, minus)
        writes.put_meta("set", "entries", ENTRY_KEY.pack(LOG_QUEUE, pos), value)
    if p.records:
        writes.put_meta("set", "seqs", U32.pack(LOG_QUEUE), U64.pack(p.last))
    for qid, cursor in p.cursors.items():
        writes.put_meta("set", "cursors", key(qid), encode_cursor(cursor))
        writes.put_meta("drop-queue-entries", "entries", U32.pack(qid), None)
        if marks[qid]:
            writes.put_mark(qid, 0)
    store.flush()
    if pending_queues(store, snap):   # what is committed is all old or all new: still old
        raise StoreError(f"store at {store.path}: upgrading {len(queues)} durable subscription queue(s) to "
                         f"the topic log failed ({store.degraded or 'the batch did not commit'}); "
                         f"the store is unchanged")
    log.info("store upgraded: %d durable subscription queue(s) now in the topic log (%d record(s))",
             len(queues), len(p.records))
    return len(queues)


def _entries(store: Any, queue_id: int, chunk: int = 10_000) -> Iterator[EntryRecord]:
    after = 0
    while True:
        got = store.read_entries(queue_id, after, chunk)
        if not got:
            return
        yield from got
        after = got[-1].seq
