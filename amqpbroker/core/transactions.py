"""AMQP 1.0 local transactions (Part 4 §4.4): staged sends and acknowledgements per
transaction id, applied together at discharge.  Pure: the I/O layer decodes the
coordinator's Declare/Discharge and the transactional states, and calls these.

* A transactional transfer (state `transactional-state{txn-id}`) is staged and
  routed only at commit, so it is visible to consumers only then (§4.4.2).
* A transactional acknowledgement keeps the entry acquired by its consumer until
  discharge; commit applies the outcome, rollback returns the entry with
  delivery-count+1 (it was delivered; JMSRedelivered must be true afterwards).

**Queue limits** (core/limits.py) hold for transactions too.  A staged send counts
against every limited queue it reaches from the moment it is staged (`staged_on`): a
`block` queue's room shrinks by it, so its transactional producers are held by credit
like any other (core/credit.py), and a send that would take a `reject` queue over its
limit, with what open transactions staged for it already, is refused when it arrives
(`amqp:resource-limit-exceeded`, as Artemis fails it at send time; the transaction goes
on).  What is staged can still meet a queue that others filled meanwhile: a commit that
would take a `reject` queue over its limit fails as a whole (`amqp:resource-limit-
exceeded`), nothing of it applied, its acknowledgements undone as by a rollback.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any

from .addresses import AddressKind, Resolution
from .broker import Broker, QueueFull
from .limits import Overflow, QueueLimits, fits, fits_batch, limits_for
from .message import Message
from .queues import Entry, Outcome, Queue

UNKNOWN_ID = "amqp:transaction:unknown-id"
ROLLBACK = "amqp:transaction:rollback"
INVALID_FIELD = "amqp:invalid-field"
RESOURCE_LIMIT = "amqp:resource-limit-exceeded"
MAX_TXN_ID = 32   # bytes; the ids this broker declares have 12


class TransactionError(Exception):
    def __init__(self, condition: str, description: str):
        super().__init__(description)
        self.condition = condition
        self.description = description


@dataclass(eq=False)
class StagedAck:
    queue: Queue
    entry: Entry
    outcome: Outcome
    delivery_failed: bool = False
    undeliverable_here: bool = False


@dataclass(eq=False)
class Transaction:
    txn_id: bytes
    owner: Any
    sends: list[tuple[Message, Any]] = field(default_factory=list)   # (message, resolution)
    acks: list[StagedAck] = field(default_factory=list)
    # What it staged for each limited queue it reaches: Queue (or, for a queue the commit
    # will create, its name) → [messages, bytes].
    staged: dict[Any, list[int]] = field(default_factory=dict)


class TransactionRegistry:
    def __init__(self) -> None:
        self._open: dict[bytes, Transaction] = {}
        self._counter = itertools.count(1)
        self._prefix = os.urandom(4)
        self.committed_total = 0
        self.rolled_back_total = 0
        self._staged: dict[Queue, list[int]] = {}   # limited queue → [messages, bytes] staged by open transactions

    def declare(self, owner: Any) -> Transaction:
        txn_id = self._prefix + next(self._counter).to_bytes(8, "big")
        txn = Transaction(txn_id, owner)
        self._open[txn_id] = txn
        return txn

    def get(self, txn_id: object, owner: Any = None) -> Transaction:
        """The open transaction a peer named.  A txn-id is binary (AMQP 1.0 §4.5.4);
        anything else, or an id longer than any this broker hands out, names none:
        it is neither converted (bytes(n) of an integer n allocates n bytes) nor
        echoed whole.  Given an `owner` (the peer's connection), an id another
        connection declared names none either: ids are a prefix and a counter, so a
        client that declares one knows everyone else's."""
        if not isinstance(txn_id, (bytes, bytearray, memoryview)):
            raise TransactionError(INVALID_FIELD, f"txn-id must be binary, not {type(txn_id).__name__}")
        txn_id = bytes(txn_id[:MAX_TXN_ID + 1])
        txn = self._open.get(txn_id) if len(txn_id) <= MAX_TXN_ID else None
        if txn is None or (owner is not None and txn.owner is not owner):
            raise TransactionError(UNKNOWN_ID, f"unknown transaction id {txn_id[:MAX_TXN_ID].hex()}")
        return txn

    def take(self, txn_id: object, owner: Any = None) -> Transaction:
        """Remove a transaction for discharge."""
        txn = self.get(txn_id, owner)
        del self._open[txn.txn_id]
        return txn

    def owned_by(self, owner: Any) -> list[Transaction]:
        return [t for t in self._open.values() if t.owner is owner]

    def __len__(self) -> int:
        return len(self._open)

    # ------------------------------------------------------------------ staging

    def staged_on(self, queue: Queue) -> tuple[int, int]:
        """Messages and bytes open transactions have staged for this queue."""
        counts = self._staged.get(queue)
        return (counts[0], counts[1]) if counts is not None else (0, 0)

    def stage(self, txn: Transaction, msg: Message, target: Resolution, broker: Broker) -> None:
        """A transactional send: refused (QueueFull) when a `reject` queue it reaches
        would go over its limit with what is staged for it already; else kept for the
        commit and counted against every limited queue it reaches.  Nothing is queued,
        dropped or created."""
        reached = _limited_reached(msg, target, broker)
        for key, limits, depth, size in reached:
            if limits.overflow is Overflow.REJECT:
                n, b = self._staged_for(txn, key)
                if not fits(limits, depth + n, size + b, msg.size):
                    _refuse(key, limits, depth, size, n)
        txn.sends.append((msg, target))
        for key, _, _, _ in reached:
            _count(txn.staged, key, msg.size)
            if isinstance(key, Queue):
                _count(self._staged, key, msg.size)

    def _staged_for(self, txn: Transaction, key: Any) -> tuple[int, int]:
        if isinstance(key, Queue):
            return self.staged_on(key)
        counts = txn.staged.get(key)   # a queue the commit creates: only this transaction's
        return (counts[0], counts[1]) if counts is not None else (0, 0)

    def _unstage(self, txn: Transaction) -> list[Queue]:
        queues = []
        for key, (n, b) in txn.staged.items():
            counts = self._staged.get(key) if isinstance(key, Queue) else None
            if counts is None:
                continue
            counts[0] -= n
            counts[1] -= b
            if counts[0] <= 0:
                del self._staged[key]
            queues.append(key)
        txn.staged.clear()
        return queues

    # ------------------------------------------------------------------ discharge

    def check_commit(self, txn: Transaction, broker: Broker) -> None:
        """Raise TransactionError(amqp:resource-limit-exceeded) when publishing every
        staged send now would take a `reject` queue over its limit (routed as the commit
        will route them), or the error routing meets; nothing changes."""
        totals: dict[Any, list] = {}
        for msg, target in txn.sends:
            for key, limits, depth, size in _limited_reached(msg, target, broker):
                if limits.overflow is not Overflow.REJECT:
                    continue
                total = totals.get(key)
                if total is None:
                    total = totals[key] = [limits, depth, size, 0, 0]
                total[3] += 1
                total[4] += msg.size
        for key, (limits, depth, size, n, b) in totals.items():
            if not fits_batch(limits, depth, size, n, b):
                name = key.name if isinstance(key, Queue) else key
                raise TransactionError(RESOURCE_LIMIT, (
                    f"commit would take queue '{name}' over its limit: {depth} messages, {size} bytes "
                    f"held, {n} messages ({b} bytes) in this transaction (max_depth {limits.max_depth or '-'}, "
                    f"max_bytes {limits.max_bytes or '-'}, overflow reject)"))

    def commit(self, txn: Transaction, broker: Broker) -> list[Queue]:
        """Publish every staged send and apply every staged acknowledgement, in the
        order they arrived (one store batch when the caller flushes once after).  All
        or nothing: `check_commit` first (TransactionError: nothing applied, the caller
        rolls back)."""
        self.check_commit(txn, broker)
        self._unstage(txn)
        touched: list[Queue] = []
        for msg, target in txn.sends:
            # Checked above as a whole: no reject queue refuses part of it; drop-head
            # queues make room as for any message.
            touched.extend(broker.publish(msg, target))
        for ack in txn.acks:
            ack.queue.settle(ack.entry, ack.outcome, delivery_failed=ack.delivery_failed,
                             undeliverable_here=ack.undeliverable_here)
        self.committed_total += 1
        return touched

    def rollback(self, txn: Transaction) -> None:
        """Staged sends vanish (the room they took is given back); acknowledged entries
        go back, counted as delivered."""
        txn.sends.clear()
        for queue in self._unstage(txn):
            queue.notify_room()
        for ack in reversed(txn.acks):
            if ack.entry.consumer is not None:
                ack.queue.settle(ack.entry, Outcome.MODIFIED, delivery_failed=True)
        txn.acks.clear()
        self.rolled_back_total += 1


def _limited_reached(msg: Message, target: Resolution, broker: Broker) -> list[tuple[Any, QueueLimits, int, int]]:
    """(queue, its limits, depth, bytes) for every limited queue a send to `target`
    reaches now; a queue the commit would create is named, with the limits a
    `[[queue_limits]]` rule will give it and nothing held.  Raises AddressNotFound as
    publishing would."""
    if target.kind is AddressKind.EXCHANGE:
        queues = broker.route(target.name, target.key, msg)
    else:
        queue = broker.queues.get(target.name)
        if queue is None:
            if target.kind is AddressKind.NEW_QUEUE:
                limits = limits_for(target.name, broker.policy.queue_limits)
                return [] if limits is None else [(target.name, limits, 0, 0)]
            return []   # deleted since: publishing says so at commit
        queues = [queue]
    return [(q, q.limits, q.depth, q.bytes) for q in queues if q.limits is not None]


def _count(counts: dict, key: Any, size: int) -> None:
    c = counts.get(key)
    if c is None:
        counts[key] = [1, size]
    else:
        c[0] += 1
        c[1] += size


def _refuse(key: Any, limits: QueueLimits, depth: int, size: int, staged: int) -> None:
    if isinstance(key, Queue):
        key.overflow_rejected_total += 1
    name = key.name if isinstance(key, Queue) else key
    raise QueueFull(f"queue '{name}' is full: {depth} messages, {size} bytes, {staged} staged by open "
                    f"transactions (max_depth {limits.max_depth or '-'}, max_bytes {limits.max_bytes or '-'}, "
                    f"overflow {limits.overflow.value})")
