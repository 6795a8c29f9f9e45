"""The store side of the topic log: what the durability layer does for durable
subscription queues (docs/architecture.md "Durable subscriptions: the topic log
and cursors"; the index and cursors are core/topiclog.py and core/cursors.py, the
encodings store/logrecords.py).

A fan-out writes one log record (and the body once) whatever the number of
subscriptions it reaches; settling a member's entry settles its position in the
member's cursor, written once per batch; the record and its reference to the body
go when no member owes it.  Every write goes into the loop turn's batch, so what
a member settles commits with what happened in the same turn (a move's copy, a
transaction's messages).
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from typing import Any, Protocol

from ..core.budget import body_room
from ..core.cursors import Cursor
from ..core.entries import PRIORITY_LEVELS, Entry, shared_size
from ..core.exchanges import Binding
from ..core.logrecovery import rebuild
from ..core.message import Message
from ..core.policies import ExclusivityPolicy
from ..core.queues import Queue
from ..core.subscriptions import Subscription
from ..core.topiclog import DIRECT, Member, TopicLog
from .base import EntryRecord
from .logrecords import (LogRecord, StoredCursor, decode_cursor, decode_record, decode_route, encode_record,
                         encode_route, key, scan_row, unkey)
from .reads import LOG_QUEUE


class LogOwner(Protocol):
    """What the topic log needs of the durability layer that owns it (store/durability.py
    DurabilityManager): the store, the broker model, the subscription table, and the
    reference counts of bodies shared by several entries."""

    store: Any
    broker: Any
    registry: Any
    refs: dict[int, int]

    def _hold_message(self, msg: Message) -> int: ...

    def _release_message(self, mid: int) -> bool: ...

log = logging.getLogger("amqpbroker.store")

# Read back for page-in, kept for the members that read the same positions next
# (after a restart every subscription pages in the same records).
RECORD_CACHE = 16_384     # decoded log records
BODY_CACHE = 16 << 20     # bytes of message bodies


class Pending:
    """A log record waiting for its batch to commit: page-in reads it from here."""

    __slots__ = ("msg", "mid", "batch", "size")

    def __init__(self, msg: Message, mid: int, batch: int):
        self.msg = msg
        self.mid = mid
        self.batch = batch
        self.size = msg.size


class SubscriptionLog:
    def __init__(self, dm: LogOwner):
        self.dm = dm
        self.store = dm.store
        self.broker = dm.broker
        self.log = TopicLog()
        self.queues: dict[int, Queue] = {}          # member queue id -> queue
        self.primary: dict[int, Binding] = {}       # member queue id -> its subscription binding
        self._stored: dict[int, tuple[bytes, StoredCursor]] = {}   # member queue id -> (key, record)
        self.pending: dict[int, Pending] = {}       # position -> record until its batch commits
        self.bodies: OrderedDict[int, Message] = OrderedDict()
        self._body_bytes = 0
        self.records: OrderedDict[int, LogRecord] = OrderedDict()   # position -> decoded record
        self._callback_batch = -1
        self.recovered = 0
        self.redelivered = 0

    # ------------------------------------------------------------------ members

    def join(self, queue: Queue, sub: Subscription, binding: Binding | None) -> None:
        """A new durable subscription queue becomes a member (empty: it owes nothing
        before the next position)."""
        qid = queue.store_id
        cursor = Cursor(joined=self.log.positions.last + 1)
        self._enrol(queue, sub, binding, cursor)
        self._write_cursor(qid)

    def _enrol(self, queue: Queue, sub: Subscription, binding: Binding | None, cursor: Cursor) -> None:
        qid = queue.store_id
        exchange = self.broker.exchanges.get(sub.binding.exchange)
        filtered = (binding.filter is not None if binding is not None
                    else bool(sub.binding.selector) or (sub.binding.no_local
                                                        and sub.exclusivity is not ExclusivityPolicy.SHARED_SUBSCRIPTION))
        if exchange is None or filtered:
            member = Member(qid, cursor)
        else:
            member = Member(qid, cursor, exchange.name, exchange.type, sub.binding.key)
        self.log.join(member)
        self.queues[qid] = queue
        if binding is not None:
            self.primary[qid] = binding
        queue.in_log = True
        queue._seq = self.log.positions   # its sequence numbers are log positions

    def unbound(self, queue: Queue, binding: Binding) -> None:
        """A binding of a member went: if it was the subscription's, its rule ends."""
        qid = queue.store_id
        if self.primary.get(qid) is binding:
            del self.primary[qid]
            self.log.unbind(qid)
            self._write_cursor(qid)

    def leave(self, queue: Queue) -> None:
        """The member's queue is deleted: what it still owes is released."""
        qid = queue.store_id
        if qid not in self.log.members:
            return
        freed = self.log.leave(qid)
        self._free_all(freed)
        self.queues.pop(qid, None)
        self.primary.pop(qid, None)
        self._stored.pop(qid, None)
        self.store.writes().put_live("cursors", key(qid), None)
        self._drop_routes()

    def _write_cursor(self, qid: int) -> None:
        stored = self._stored.get(qid)
        if stored is None:
            m = self.log.members.get(qid)
            if m is None:
                return
            stored = self._stored[qid] = (key(qid), StoredCursor(m.cursor))
        self.store.writes().put_live("cursors", stored[0], stored[1])

    # ------------------------------------------------------------------ fan-out

    def fan_out(self, msg: Message, exchange: str | None, routing_key: str | None, members: list[Queue]) -> int:
        """Broker.fan_out: one position for every member reached; a durable message is
        stored once, as one log record."""
        pos = next(self.log.positions)
        if msg.durable:
            route = ("exchange", exchange, routing_key) if exchange is not None else DIRECT
            self._append(msg, pos, route, [q.store_id for q in members])
        return pos

    def _append(self, msg: Message, pos: int, route: tuple, qids: list[int]) -> Pending:
        store = self.store
        writes = store.writes()
        mid = self.dm._hold_message(msg)
        rid, new = self.log.route(route)
        if new:
            writes.put_meta("set", "routes", key(rid), encode_route(route))
        plus, minus = self.log.append(pos, rid, qids)
        expires, deliver, group = msg.routing_times()
        writes.put_entry_bytes(LOG_QUEUE, pos, encode_record(mid, msg.delivery_count, _priority(msg), msg.size,
                                                               expires, deliver, group, rid, plus, minus))
        batch = store.batch
        rec = self.pending[pos] = Pending(msg, mid, batch)
        if self._callback_batch != batch:
            self._callback_batch = batch
            store.after_commit(functools.partial(self._committed, batch))
        return rec

    def _committed(self, batch: int, error: BaseException | None) -> None:
        """Records of `batch` and before are on disk (or were lost, and handled): page-in
        reads them from the store now."""
        pending = self.pending
        while pending:
            pos = next(iter(pending))
            if pending[pos].batch > batch:
                return
            del pending[pos]

    # ------------------------------------------------------------------ a member's entries

    def entry_added(self, queue: Queue, entry: Entry) -> None:
        """A member's new entry in memory: its record is the fan-out's (or, enqueued
        outside a publish, a record of its own)."""
        rec = self.pending.get(entry.seq)
        if rec is None or rec.msg is not entry.msg:
            rec = self._append(entry.msg, entry.seq, DIRECT, [queue.store_id])
        entry.store_ref = rec.mid
        entry.stored_in = rec.batch
        entry.size = shared_size(entry.size)

    def entry_removed(self, queue: Queue, entry: Entry) -> None:
        mid = entry.store_ref
        if mid is None:
            return
        entry.store_ref = None
        if self.settle(queue, entry.seq, mid) and entry.msg is not None and entry.msg.store_id == mid:
            entry.msg.store_id = None

    def settle(self, queue: Queue, pos: int, mid: int) -> bool:
        """A member settled `pos`; True when that dropped the body too."""
        qid = queue.store_id
        freed = self.log.settle(qid, pos)
        self._write_cursor(qid)
        if not freed:
            return False
        return self._free(pos, mid)

    def record_state(self, queue: Queue, entry: Entry, delivered: bool) -> None:
        """A member's entry changed its delivery-count or delivered mark (a failed
        attempt, given back, a delivery far from the head): kept in its cursor."""
        m = self.log.members.get(queue.store_id)
        if m is not None and not m.cursor.settled(entry.seq):
            m.cursor.set_state(entry.seq, entry.delivery_count, delivered)
            self._write_cursor(queue.store_id)

    def _free(self, pos: int, mid: int) -> bool:
        """No member owes the record any more: it goes, with its reference to the body."""
        self.store.writes().delete_entry(LOG_QUEUE, pos)
        self.records.pop(pos, None)
        self._drop_routes()
        dropped = self.dm._release_message(mid)
        if dropped:
            msg = self.bodies.pop(mid, None)
            if msg is not None:
                self._body_bytes -= msg.size
        return dropped

    def _free_all(self, positions: list[int]) -> None:
        for pos, mid, _ in self._mids_sizes(positions):
            self._free(pos, mid)

    def _drop_routes(self) -> None:
        freed = self.log.freed_routes
        if freed:
            writes = self.store.writes()
            for rid in freed:
                writes.put_meta("del", "routes", key(rid), None)
            freed.clear()

    def _mids_sizes(self, positions: list[int]) -> list[tuple[int, int, int]]:
        """(position, msg id, size) of records, pending or stored."""
        out = []
        for p, rec in self._records(positions):
            if isinstance(rec, Pending):
                out.append((p, rec.mid, rec.size))
            else:
                out.append((p, rec.msg_id, rec.size))
        return out

    def _records(self, positions: list[int]) -> list[tuple[int, "Pending | LogRecord"]]:
        """The records at these positions: pending ones from memory, the rest decoded
        from the store (once: the decoded records are kept for the members that read
        them next).  A position found nowhere is logged and left out."""
        pending, cache = self.pending, self.records
        need = [p for p in positions if p not in pending and p not in cache]
        if need:
            for p, val in zip(need, self.store.read_log(need)):
                if val is None:
                    log.error("topic log: record %d is not in the store; skipped", p)
                    continue
                cache[p] = decode_record(p, val)
            while len(cache) > RECORD_CACHE:
                cache.popitem(last=False)
        out = []
        for p in positions:
            rec = pending.get(p)
            if rec is None:
                rec = cache.get(p)
                if rec is None:
                    continue
            out.append((p, rec))
        return out

    # ------------------------------------------------------------------ the paged region

    def read_paged(self, queue: Queue, after: int, limit: int) -> list[Entry]:
        """StoreHooks.read_paged for a member: the positions it owes after `after`, with
        bodies while the budgets have room (the rest are read on dispatch)."""
        qid = queue.store_id
        positions = self.log.owed_after(qid, after, limit)
        if not positions:
            return []
        cursor = self.log.members[qid].cursor
        room = body_room(queue.memory_budget - queue.mem_bytes, queue.budget)
        out: list[Entry] = []
        unread: list[Entry] = []
        bodies = self.bodies
        for p, rec in self._records(positions):
            if isinstance(rec, Pending):
                msg = rec.msg
                entry = Entry.paged(p, rec.mid, size=shared_size(msg.size), priority=_priority(msg),
                                    delivery_count=cursor.delivery_count(p, msg.delivery_count),
                                    expires_at=None, deliver_at=None, group=None)
                entry.expires_at, entry.deliver_at, entry.group = msg.routing_times()
                entry.stored_in = rec.batch
                entry.msg = msg
                room -= msg.size
                out.append(entry)
                continue
            entry = Entry.paged(p, rec.msg_id, size=shared_size(rec.size), priority=rec.priority,
                                delivery_count=cursor.delivery_count(p, rec.delivery_count),
                                expires_at=rec.expires_at, deliver_at=rec.deliver_at, group=rec.group)
            msg = bodies.get(rec.msg_id)
            if msg is not None:
                bodies.move_to_end(rec.msg_id)
                entry.msg = msg
                room -= rec.size
            elif rec.size <= room:
                room -= rec.size
                unread.append(entry)
            out.append(entry)
        if unread:
            self._read_bodies(unread)
        return out

    def _read_bodies(self, entries: list[Entry]) -> None:
        raws = self.store.read_messages([e.store_ref for e in entries])
        bodies = self.bodies
        for entry, raw in zip(entries, raws):
            if raw is None:
                continue   # Queue._load reports it on dispatch
            try:
                msg = Message(bytes(raw))
            except Exception:   # the parser's errors: Queue._load drops it, loudly
                continue
            msg.store_id = entry.store_ref
            entry.msg = msg
            if entry.store_ref not in bodies:
                bodies[entry.store_ref] = msg
                self._body_bytes += msg.size
        while self._body_bytes > BODY_CACHE and bodies:
            self._body_bytes -= bodies.popitem(last=False)[1].size

    def load_body(self, entry: Entry) -> Message | None:
        """A member's paged entry read on dispatch: the shared copy when one was read."""
        msg = self.bodies.get(entry.store_ref)
        if msg is not None:
            self.bodies.move_to_end(entry.store_ref)
        return msg

    def drop_paged(self, queue: Queue, after: int, below: int | None, skip: set[int] | frozenset[int]) -> tuple[int, int]:
        """Purge / remove-below of a member's paged region: each position is settled."""
        positions = [p for p in self.log.owed_after(queue.store_id, after, 1 << 62, below) if p not in skip]
        n = size = 0
        for p, mid, s in self._mids_sizes(positions):
            self.settle(queue, p, mid)
            n += 1
            size += s
        return n, size

    # ------------------------------------------------------------------ failures

    def lost(self, positions: list[int]) -> None:
        """Records of a failed batch: not on disk, their producers are told Rejected.
        Each member that got one forgets it (one already handed out stays with its
        consumer, as for any queue)."""
        for pos in positions:
            rec = self.pending.pop(pos, None)
            owners = [qid for qid in self.queues if self.log.owes(qid, pos)]
            self.log.lost(pos)
            for qid in owners:
                queue = self.queues[qid]
                if queue.paged_count and pos > queue.page_cursor:
                    queue.forget_paged(rec.size if rec is not None else 0)
                else:
                    queue.discard({pos})
            if rec is not None:
                self.dm._release_message(rec.mid)
        self._drop_routes()

    # ------------------------------------------------------------------ recovery

    def recover(self, by_id: dict[int, Queue], seen: Any) -> None:
        """Rebuild the log and the members (docs/architecture.md: recovery reads the
        records' index, not the members' backlogs); every member starts paged."""
        store = self.store
        lg = self.log
        for k, v in store.read_records("routes"):
            lg.add_route(unkey(k), decode_route(v))
        last = store.read_last_seq(LOG_QUEUE)
        marks: dict[int, int] = {}
        registry = self.dm.registry
        bound: dict[int, list[Binding]] = {}   # id(queue) -> its bindings (one pass, not one per member)
        for exchange in self.broker.exchanges.values():
            for b in exchange.bindings:
                bound.setdefault(id(b.queue), []).append(b)
        for k, v in store.read_records("cursors"):
            qid, cursor = unkey(k), decode_cursor(v)
            queue = by_id.get(qid)
            sub = registry.by_queue.get(queue.name) if queue is not None else None
            if queue is None or sub is None or not sub.durable:
                store.writes().put_live("cursors", key(qid), None)
                continue
            binding = next((b for b in bound.get(id(queue), ()) if b.exchange == sub.binding.exchange
                            and b.key == sub.binding.key), None)
            self._enrol(queue, sub, binding, cursor)
            # What may have been handed out comes back counted (store/marks.py): the
            # delivery watermark becomes a bump, delivered states a count, in one batch.
            watermark = store.read_watermark(qid)
            if cursor.recover(watermark) or watermark:
                self._write_cursor(qid)
            if watermark:
                marks[qid] = watermark
                store.put_mark(qid, 0)
            last = max(last, watermark, cursor.floor - 1, cursor.joined - 1, *(cursor.bumps or [0]))
        lg.positions.last = max(lg.positions.last, last)
        rows = store.scan_log(scan_row)
        refs = self.dm.refs
        for row in rows:
            mid = row[5]
            if seen.add(mid):
                refs[mid] = refs.get(mid, 1) + 1
        out = rebuild(lg, rows, marks=marks, takers=self._takers)
        if out.orphans:
            mids = {row[0]: row[5] for row in rows}
            for pos in out.orphans:
                self._free(pos, mids[pos])
            log.info("topic log: %d record(s) no subscription owes removed", len(out.orphans))
        for rid, n in list(lg.route_refs.items()):
            if not n:
                lg._drop_route(rid)
        self._drop_routes()
        for qid, (count, size) in out.backlog.items():
            if count:
                self.queues[qid].restore_paged(lg.members[qid].cursor.floor - 1, count, size)
                self.recovered += count
        self.redelivered = out.redelivered

    def _takers(self, rid: int) -> list[int]:
        """Members a route's rule may take (recovery): those the exchange routes the
        key to, as at publish time, and those no longer bound (their rule still covers
        what came before)."""
        route = self.log.routes.get(rid)
        members = self.log.members
        if route is None or route[0] != "exchange":
            return list(members)
        exchange = self.broker.exchanges.get(route[1])
        unbound = [q for q, m in members.items() if m.cursor.left is not None]
        if exchange is None:
            return unbound
        return [b.queue.store_id for b in exchange.route(route[2]) if b.queue.store_id in members] + unbound

    # ------------------------------------------------------------------ reads by sequence

    def records_after(self, queue: Queue, after: int, limit: int) -> list[EntryRecord]:
        """A member's committed records after `after` (server/sequence.py range reads)."""
        qid = queue.store_id
        positions = []
        for p in self.log.owed_after(qid, after, limit):
            if p in self.pending:
                break   # (pending positions are the newest: the rest is not committed either)
            positions.append(p)
        m = self.log.members.get(qid)
        out = []
        for p, val in zip(positions, self.store.read_log(positions) if positions else []):
            if val is None:
                continue
            r = decode_record(p, val)
            out.append(EntryRecord(p, r.msg_id, m.cursor.delivery_count(p, r.delivery_count),
                                   m.cursor.delivered(p), r.priority, r.size, r.expires_at, r.deliver_at, r.group))
        return out

    def last_position(self, queue: Queue) -> int:
        """The newest committed position the member got (its floor - 1 when none is left)."""
        qid = queue.store_id
        m = self.log.members.get(qid)
        if m is None:
            return 0
        lg = self.log
        p = lg.start + len(lg.route_of) - 1
        while p >= max(lg.start, m.cursor.floor):
            if p not in self.pending and lg._owes(m, p):
                return p
            p -= 1
        return m.cursor.floor - 1


def _priority(msg: Message) -> int:
    p = msg.priority
    return 0 if p < 0 else (PRIORITY_LEVELS - 1 if p >= PRIORITY_LEVELS else p)
