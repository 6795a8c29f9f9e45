"""Glue between the pure broker model and a Store: which entities and messages are
durable, the hooks that queue their writes, and recovery at start-up.

Durable = a message whose header says durable=true, routed to a durable queue
(AMQP 1.0 §3.2.1; JMS PERSISTENT).  Its bytes are written once, however many
durable queues it lands in; each queue writes an entry referring to them.
"""

from __future__ import annotations

import functools
import itertools
import logging
import struct
import time
from typing import Any

import lmdb

from ..core.broker import Broker
from ..core.entries import held_batch, hold_code, shared_size
from ..core.exchanges import Binding
from ..core.message import Message
from ..core.limits import QueueLimits
from ..core.queues import Entry, ExclusivityPolicy, LifetimePolicy, Queue
from ..core.registry import SubscriptionRegistry
from ..core.subscriptions import Subscription
from .base import EntryRecord, QueueRecord, Snapshot, Store, StoreError
from ..core.budget import UNLIMITED, body_room
from .integrity import RECOVERY_HINT, StoreDamaged
from .marks import Mark, Watermark
from .reads import LOG_QUEUE
from .seen import SeenIds as _SeenIds
from .topiclog import SubscriptionLog
from .subscription_json import subscription_from_json, subscription_to_json
from .upgrade import upgrade

log = logging.getLogger("amqpbroker.store")


class DurabilityManager:
    def __init__(self, broker: Broker, registry: SubscriptionRegistry, store: Store,
                 memory_budget: int = 0):
        self.broker = broker
        self.registry = registry
        self.store = store
        # 0 in the configuration: no limit of the queue's own; durable queues still
        # page for the broker's budget (core/budget.py).
        self.memory_budget = (memory_budget or UNLIMITED) if store.persistent else 0
        # Stored messages referred to by more than one entry (fan-out); absent = one.
        self.refs: dict[int, int] = {}
        self._queue_ids = itertools.count(1)
        self.recovered_messages = 0
        self.redelivered = 0
        self.watermarks: dict[int, Watermark] = {}   # queue store id → delivery watermark
        self.tails: dict[int, int] = {}              # queue store id → highest sequence stored
        # Recovery: queue store id → the watermark found, until the batch with its
        # fix-ups (delivery-count+1) has committed (page-in reads committed records).
        self.fixups: dict[int, int] = {}
        self.fixup_batch = -1
        self.entry_marks = 0                         # deliveries that needed their own mark
        # Durable subscription queues: the topic log (store/topiclog.py).
        self.topic: SubscriptionLog | None = SubscriptionLog(self) if store.persistent else None
        self._last_bound: Binding | None = None      # the binding a new subscription just made

    # ------------------------------------------------------------------ hooks

    def install(self) -> None:
        b = self.broker
        b.on_queue_declared = self._queue_declared
        b.on_queue_deleted = self._queue_deleted
        b.on_binding_changed = self._binding_changed
        self.registry.on_saved = self._subscription_saved
        self.registry.on_deleted = lambda sub: self.store.delete_subscription(sub.queue_name)
        self.store.on_lost_entries = self._entries_lost
        self.store.on_closing = self._closing
        if self.topic is not None:
            b.fan_out = self.topic.fan_out

    def _closing(self) -> None:
        """A clean stop: every link has ended, so a queue with nothing acquired has no
        delivery its watermark must cover; dropping the watermark spares the next
        start its false redeliveries (up to LOOKAHEAD per queue)."""
        for queue in self.broker.queues.values():
            wm = self.watermarks.get(queue.store_id) if queue.store_id is not None else None
            if wm is not None and wm.pending and not queue.acquired:
                self._drop_watermark(queue)

    def _entries_lost(self, lost: list[tuple[int, int]]) -> None:
        """A commit failed (store full, a store fault): its new entries are not on disk and their
        producers are about to be told Rejected, so they leave the queues rather than
        be delivered.  (One already handed to a consumer stays with it.)"""
        by_queue: dict[int, set[int]] = {}
        for queue_id, seq in lost:
            by_queue.setdefault(queue_id, set()).add(seq)
        positions = by_queue.pop(LOG_QUEUE, None)
        if positions and self.topic is not None:
            self.topic.lost(sorted(positions))
        for queue in list(self.broker.queues.values()):
            seqs = by_queue.get(queue.store_id) if queue.store_id is not None else None
            if seqs:
                n = queue.discard(seqs)
                log.warning("queue %s: %d message(s) the store did not take removed", queue.name, n)

    def _queue_declared(self, queue: Queue) -> None:
        if not queue.durable:
            return
        if queue.store_id is None:
            queue.store_id = next(self._queue_ids)
            self.store.save_queue(self._record(queue))
        queue.hooks = self            # StoreHooks (core/entries.py): one reference per queue
        queue.memory_budget = self.memory_budget

    # StoreHooks: what durable queues ask of the store.

    def entry_added(self, queue: Queue, entry: Entry) -> None:
        if queue.in_log:
            if entry.msg.durable:
                self.topic.entry_added(queue, entry)
            return
        self._entry_added(queue, entry)

    def entry_removed(self, queue: Queue, entry: Entry) -> None:
        if queue.in_log:
            self.topic.entry_removed(queue, entry)
            return
        self._entry_removed(queue, entry)

    def entry_updated(self, queue: Queue, entry: Entry, delivered: bool) -> None:
        self._entry_update(queue, entry, delivered)

    def load_body(self, entry: Entry) -> Message:
        if self.topic is not None:
            msg = self.topic.load_body(entry)
            if msg is not None:
                return msg
        return self._load_body(entry)

    def page_out(self, queue: Queue, entry: Entry) -> None:
        self.store.after_commit(functools.partial(queue.page_committed, entry.seq))

    def read_paged(self, queue: Queue, after: int, limit: int) -> list[Entry]:
        if queue.in_log:
            return self.topic.read_paged(queue, after, limit)
        return self._read_paged(queue, after, limit)

    def remove_paged(self, queue: Queue, entry: Entry) -> None:
        """A store-only entry of the paged region moved elsewhere (core/waiting.py): its
        removal goes in this loop turn's batch, with the copy's arrival."""
        if queue.in_log:
            self.topic.settle(queue, entry.seq, entry.store_ref)
            return
        self._remove_stored(queue, entry.seq, entry.store_ref)

    # Reads by sequence number (server/sequence.py), of any durable queue.
    def read_entries(self, queue: Queue, after: int, limit: int) -> list[EntryRecord]:
        """A durable queue's committed entries after sequence `after`."""
        if queue.in_log:
            return self.topic.records_after(queue, after, limit)
        return self.store.read_entries(queue.store_id, after, limit)

    def last_seq(self, queue: Queue) -> int:
        """The last sequence number committed for a durable queue (0: none yet)."""
        if queue.in_log:
            return self.topic.last_position(queue)
        return self.store.read_last_seq(queue.store_id)

    def forget_gone(self, queue: Queue, seq: int) -> None:
        self.store.after_commit(functools.partial(queue.gone_committed, seq))

    def _record(self, queue: Queue) -> QueueRecord:
        declared = queue.declared_limits
        return QueueRecord(queue.name, queue.store_id, queue.exclusivity.value, queue.lifetime.value,
                           queue.max_delivery_attempts,
                           limits=declared.describe() if declared is not None else None)

    def _queue_deleted(self, queue: Queue) -> None:
        if queue.in_log and self.topic is not None:
            self.topic.leave(queue)
        if queue.store_id is not None:
            self.store.delete_queue(queue.store_id, queue.name)
            self.tails.pop(queue.store_id, None)
            if self.watermarks.pop(queue.store_id, None) is not None:
                self.store.put_mark(queue.store_id, 0)

    def _binding_changed(self, binding: Binding, added: bool) -> None:
        if not binding.queue.durable:
            return
        if added:
            self._last_bound = binding
        elif binding.queue.in_log:
            self.topic.unbound(binding.queue, binding)
        exchange = self.broker.exchanges.get(binding.exchange)
        if exchange is not None and not exchange.builtin and added:
            self.store.save_exchange(exchange.name, exchange.type.value)
        if added:
            self.store.save_binding(binding.exchange, binding.key, binding.queue.name, binding.arguments)
        else:
            self.store.delete_binding(binding.exchange, binding.key, binding.queue.name)

    def _subscription_saved(self, sub: Subscription) -> None:
        self.store.save_subscription(sub.queue_name, subscription_to_json(sub))
        queue = self.broker.queues.get(sub.queue_name)
        if self.topic is not None and sub.durable and queue is not None and queue.durable and not queue.in_log:
            bound = self._last_bound
            if bound is None or bound.queue is not queue:
                bound = next((b for b in self.broker.bindings_of(queue) if b.key == sub.binding.key), None)
            self.topic.join(queue, sub, bound)

    # ------------------------------------------------------------------ messages

    def _entry_added(self, queue: Queue, entry: Entry) -> None:
        msg = entry.msg
        if not msg.durable:
            return
        store = self.store
        writes = store.writes()
        mid = self._hold_message(msg)
        entry.store_ref = mid
        entry.stored_in = store.batch
        self.tails[queue.store_id] = entry.seq
        entry.size = _shared(entry.size)   # outlives the body once paged out: one int per size
        writes.put_entry(queue.store_id, entry)   # live: encoded as it is at the batch's hand-over

    def _hold_message(self, msg: Message) -> int:
        """One more reference to a durable message's stored bytes (an entry, a topic
        log record): the bytes are written with the first; its store id."""
        mid = msg.store_id
        if mid is None:
            mid = msg.store_id = self.store.new_msg_id()
            self.store.writes().put_message(mid, msg.raw)
        else:  # the same message in another durable queue: one body, one more reference
            self.refs[mid] = self.refs.get(mid, 1) + 1
        return mid

    def _entry_removed(self, queue: Queue, entry: Entry) -> None:
        mid = entry.store_ref
        if mid is None:
            return
        entry.store_ref = None
        if self._remove_stored(queue, entry.seq, mid):
            if entry.msg is not None and entry.msg.store_id == mid:
                entry.msg.store_id = None

    def _remove_stored(self, queue: Queue, seq: int, mid: int) -> bool:
        """Delete a stored entry and release its reference to the message; True when
        that was the last reference (the message is dropped too)."""
        self.store.writes().delete_entry(queue.store_id, seq)
        return self._release_message(mid)

    def _release_message(self, mid: int) -> bool:
        """One reference to a stored message is gone (an entry, a topic log record);
        True when it was the last and the message is deleted."""
        left = self.refs.get(mid)
        if left is None:
            self.store.writes().drop_message(mid)
            return True
        if left <= 2:
            del self.refs[mid]
        else:
            self.refs[mid] = left - 1
        return False

    def _read_paged(self, queue: Queue, after: int, limit: int) -> list[Entry]:
        """The next entries of a queue's paged region (page-in), with their bodies read
        in one go while the queue's memory budget has room (the rest index only, read
        on dispatch).  One still marked delivered, or up to the recovery watermark,
        is a recovery fix-up not committed yet: count it the same (asked before the
        read: a commit in between counts it twice, an over-mark, never an under-mark)."""
        upto = self._fixup_upto(queue)
        records = self.store.read_entries(queue.store_id, after, limit)
        room = body_room(queue.memory_budget - queue.mem_bytes, queue.budget)
        k = 0
        while k < len(records) and records[k].size <= room:
            room -= records[k].size
            k += 1
        raws = self.store.read_messages([r.msg_id for r in records[:k]]) if k else []
        out = []
        for i, r in enumerate(records):
            entry = Entry.paged(r.seq, r.msg_id, size=_shared(r.size), priority=r.priority,
                                delivery_count=(r.delivery_count + 1 if r.delivered or r.seq <= upto
                                                else r.delivery_count),
                                expires_at=r.expires_at, deliver_at=r.deliver_at, group=r.group)
            if i < k and raws[i] is not None:
                entry.msg = msg = Message(bytes(raws[i]))
                msg.store_id = r.msg_id
            out.append(entry)
        return out

    def _fixup_upto(self, queue: Queue) -> int:
        """The recovery watermark of a queue whose fix-ups have not committed yet (0:
        none): entries up to it read back still need their delivery-count+1."""
        if not self.fixups:
            return 0
        if self.store.settled(self.fixup_batch):
            self.fixups.clear()
            return 0
        return self.fixups.get(queue.store_id, 0)

    def drop_paged(self, queue: Queue, after: int, below: int | None = None,
                   skip: set[int] | frozenset[int] = frozenset(), chunk: int = 10_000) -> tuple[int, int]:
        """Remove a queue's store-only (paged) entries with a sequence after `after`
        (and below `below`; None: to the end), except those in `skip` (still held in
        memory, removed by the queue): each goes like `_entry_removed`, so messages
        and fan-out references follow.  Returns (entries, bytes) removed."""
        if queue.in_log:
            return self.topic.drop_paged(queue, after, below, skip)
        n = size = 0
        while True:
            records = self.store.read_entries(queue.store_id, after, chunk)
            if not records:
                return n, size
            for rec in records:
                if below is not None and rec.seq >= below:
                    return n, size
                after = rec.seq
                if rec.seq in skip:
                    continue
                self._remove_stored(queue, rec.seq, rec.msg_id)
                n += 1
                size += rec.size

    def _entry_update(self, queue: Queue, entry: Entry, delivered: bool) -> None:
        """Delivered-but-unsettled entries come back after a crash with
        delivery-count+1 (AMQP 1.0 §3.2.1: the delivery may have been processed).
        An entry new in the batch still being filled is written with its state at
        the hand-over: nothing more to queue.  A hand-over of an entry stored
        earlier is covered by the queue's delivery watermark (store/marks.py)."""
        store = self.store
        if not delivered and not queue.acquired:
            self._drop_watermark(queue)
        if queue.in_log:   # no entry record: the delivered mark is the watermark (or a cursor state)
            if delivered:
                self._delivered(queue, entry)
            else:
                self.topic.record_state(queue, entry, False)
            return
        if entry.stored_in == store.batch:
            return   # (stored_in stays: a later redelivery waits for this batch if need be)
        if delivered:
            self._delivered(queue, entry)
        else:
            store.update_entry(queue.store_id, _record(entry, delivered))

    def _drop_watermark(self, queue: Queue) -> None:
        """An entry went back and the queue has nothing handed out any more: every
        delivery its watermark covers was settled or given back with its own record,
        so the watermark goes (messages given back at a normal close stay uncounted
        after a crash).  Not on acknowledgements: a consumer taking one message at a
        time would rewrite it, and wait for it, at every delivery.  A new object: a
        commit callback of the old watermark must not make this one look committed."""
        wm = self.watermarks.get(queue.store_id)
        if wm is not None and wm.pending:
            self.store.put_mark(queue.store_id, 0)
            self.watermarks[queue.store_id] = Watermark()

    def _delivered(self, queue: Queue, entry: Entry) -> None:
        """Hand-over of an entry stored by an earlier batch: what makes it come back
        marked after a crash, and the batch the delivery must wait for, left in
        `entry.stored_in` as a hold code (core/entries.py hold_code)."""
        store = self.store
        current = store.batch
        # The batch that stores the entry (or, handed out before, the one its last
        # delivery waited for: it went back unseen, say) may still be on its way.
        prev = held_batch(entry.stored_in)
        wait = prev if prev >= 0 and not store.settled(prev) else -1
        wm = self.watermarks.get(queue.store_id)
        if wm is None:
            wm = self.watermarks[queue.store_id] = Watermark()
        tail = self.topic.log.positions.last if queue.in_log else self.tails.get(queue.store_id, entry.seq)
        mark, raise_to = wm.decide(entry.seq, tail, queue.lowest_ready_seq)
        if raise_to:
            store.put_mark(queue.store_id, raise_to)
            wm.written(raise_to, current)
            store.after_commit(functools.partial(_mark_settled, wm, raise_to))
        if mark is Mark.PENDING:
            if not store.settled(wm.batch):
                wait = max(wait, wm.batch)
        elif mark is Mark.RAISED:
            wait = current
        elif mark is Mark.ENTRY:
            self.entry_marks += 1
            if queue.in_log:
                self.topic.record_state(queue, entry, True)
            else:
                store.update_entry(queue.store_id, _record(entry, True))
            wait = current
        entry.stored_in = hold_code(wait)

    def _load_body(self, entry: Entry) -> Message:
        raw = self.store.read_message(entry.store_ref)
        if raw is None:
            raise RuntimeError(f"stored message {entry.store_ref} is missing")
        msg = Message(bytes(raw))
        msg.store_id = entry.store_ref
        return msg

    # ------------------------------------------------------------------ recovery

    def recover(self, snap: Snapshot, filter_factory: Any) -> None:
        """Rebuild the model from the store.  A record that cannot be read back (a
        damaged page LMDB notices, a record that does not decode) stops the start-up
        with StoreDamaged, one line naming the store, never a traceback."""
        try:
            self._recover(snap, filter_factory)
        except StoreError:
            raise
        except Exception as exc:
            if not _unreadable(exc):
                raise
            path = getattr(self.store, "path", None)
            hint = RECOVERY_HINT.replace("DIR", str(path.parent) if path is not None else "DIR")
            raise StoreDamaged(f"store at {path} cannot be read back: {type(exc).__name__}: {exc}; "
                               f"{hint}") from None

    def _recover(self, snap: Snapshot, filter_factory: Any) -> None:
        started = time.monotonic()
        if self.topic is not None:
            upgrade(self.store, snap)   # durable subscription queues still stored per entry
        b = self.broker
        for ex in snap.exchanges:
            b.declare_exchange(ex["name"], ex["type"])
        by_id: dict[int, Queue] = {}
        top = 0
        for rec in snap.queues:
            queue = b.declare_queue(
                rec.name, durable=True, exclusivity=ExclusivityPolicy(rec.exclusivity),
                lifetime=LifetimePolicy(rec.lifetime), max_delivery_attempts=rec.max_delivery_attempts,
                limits=QueueLimits.from_dict(rec.limits) if rec.limits else None)
            queue.store_id = rec.queue_id
            queue.reset_seq(rec.last_seq + 1)
            self.tails[rec.queue_id] = rec.last_seq
            self._queue_declared(queue)
            by_id[rec.queue_id] = queue
            top = max(top, rec.queue_id)
        self._queue_ids = itertools.count(top + 1)
        for bd in snap.bindings:
            queue = b.queues.get(bd["queue"])
            if queue is None or bd["exchange"] not in b.exchanges:
                continue
            args = bd["arguments"]
            flt = filter_factory(args.get("selector"), args.get("no_local_owner"))
            b.exchanges[bd["exchange"]].bind(Binding(bd["exchange"], bd["key"], queue, flt, args))
        for rec in snap.subscriptions:
            sub = subscription_from_json(rec)
            if sub.queue_name in b.queues:
                self.registry.restore(sub)
        self._seen = _SeenIds(*self.store.message_id_range())
        for queue in by_id.values():
            self._queue_declared(queue)  # budget and loader before loading
        if self.topic is not None:   # durable subscription queues: the topic log, nothing loaded
            self.topic.recover(by_id, self._seen)
            self.recovered_messages += self.topic.recovered
            self.redelivered += self.topic.redelivered
        for queue in by_id.values():
            if not queue.in_log:
                self._load_entries(queue)
        del self._seen
        release = getattr(self.store, "release_map", None)
        if release is not None:
            release()   # the scan mapped the whole entry index: not ours to keep in RSS
        log.info("store recovered %d queue(s), %d message entr%s (%d redelivered) in %.2f s",
                 len(by_id), self.recovered_messages, "y" if self.recovered_messages == 1 else "ies",
                 self.redelivered, time.monotonic() - started)

    def _load_entries(self, queue: Queue, batch: int = 10_000) -> None:
        """Rebuild a queue's entries in sequence order; bodies are read only while the
        queue is under its memory budget, the rest stay paged (index only).  With a
        budget, only the first `page_in_batch` entries become Entry objects: the rest
        is the paged region, counted (and its references noted) without building any."""
        cache: dict[int, Message] = {}
        after = 0
        store = self.store
        refs = self.refs
        budget = queue.memory_budget
        window = queue.page_in_batch if budget else 0
        loaded = 0
        # Entries up to the delivery watermark may have been handed out: they come
        # back with delivery-count+1 like entries marked delivered (store/marks.py).
        # The watermark is then spent: the fix-ups are written in the same batch.
        upto = self._upto = store.read_watermark(queue.store_id)
        if upto:
            store.put_mark(queue.store_id, 0)
            self.fixups[queue.store_id] = upto
            self.fixup_batch = store.batch
        while True:
            if window and loaded >= window:
                self._count_paged(queue, after)
                return
            records = store.read_entries(queue.store_id, after, min(batch, window - loaded) if window else batch)
            if not records:
                return
            loaded += len(records)
            for rec in records:
                after = rec.seq
                mid = rec.msg_id
                if rec.delivered or rec.seq <= upto:
                    rec.delivery_count += 1
                    rec.delivered = False
                    self.redelivered += 1
                    store.update_entry(queue.store_id, rec)
                if mid in self._seen:
                    refs[mid] = refs.get(mid, 1) + 1
                else:
                    self._seen.add(mid)
                if budget and queue.mem_bytes + rec.size > budget:
                    entry = Entry.paged(rec.seq, mid, size=_shared(rec.size), priority=rec.priority,
                                        delivery_count=rec.delivery_count, expires_at=rec.expires_at,
                                        deliver_at=rec.deliver_at, group=rec.group)
                else:
                    msg = cache.get(mid)
                    if msg is None:
                        raw = store.read_message(mid)
                        if raw is None:
                            log.error("queue %s: entry %d refers to missing message %d; skipped",
                                      queue.name, rec.seq, mid)
                            store.delete_entry(queue.store_id, rec.seq)
                            continue
                        msg = cache[mid] = Message(bytes(raw))
                        msg.store_id = mid
                    entry = Entry(msg, rec.seq)
                    entry.delivery_count = rec.delivery_count
                    entry.store_ref = mid
                queue.restore(entry)
                self.recovered_messages += 1

    def _count_paged(self, queue: Queue, after: int, batch: int = 16_384) -> None:
        """Recovery: the stored entries after `after` stay in the store (the paged
        region): count them and their bytes, note shared messages, and give entries
        that were delivered-but-unsettled their delivery-count+1."""
        store = self.store
        refs = self.refs
        seen = self._seen.add
        upto = self._upto   # the delivery watermark read by _load_entries
        release = getattr(store, "release_map", None)
        cursor = after
        count = size = 0
        while True:
            rows = store.scan_entries(queue.store_id, after, batch)
            if not rows:
                break
            if release is not None:
                release()   # keep the scan's mapped pages (and their neighbours) out of RSS
            for seq, mid, n, delivered in rows:
                size += n
                if seen(mid):
                    refs[mid] = refs.get(mid, 1) + 1
                if delivered or seq <= upto:
                    rec = store.read_entries(queue.store_id, seq - 1, 1)[0]
                    rec.delivery_count += 1
                    rec.delivered = False
                    self.redelivered += 1
                    store.update_entry(queue.store_id, rec)
            count += len(rows)
            after = rows[-1][0]
        if count:
            queue.restore_paged(cursor, count, size)
            self.recovered_messages += count


def _mark_settled(wm: Watermark, value: int, error: BaseException | None) -> None:
    wm.settled(value, error is None)


def _unreadable(exc: BaseException) -> bool:
    """A failure of reading stored records back (LMDB, a record's decoding), not a bug."""
    return isinstance(exc, (lmdb.Error, struct.error, ValueError, KeyError, TypeError, IndexError))


_shared = shared_size   # (core/entries.py; bench/backlog.py imports it from here)


def _record(entry: Entry, delivered: bool) -> EntryRecord:
    return EntryRecord(entry.seq, entry.store_ref, entry.delivery_count, delivered, entry.priority,
                       entry.size, entry.expires_at, entry.deliver_at, entry.group)
