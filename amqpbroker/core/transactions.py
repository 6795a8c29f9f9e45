"""AMQP 1.0 local transactions (Part 4 §4.4): staged sends and acknowledgements per
transaction id, applied together at discharge.  Pure: the I/O layer decodes the
coordinator's Declare/Discharge and the transactional states, and calls these.

* A transactional transfer (state `transactional-state{txn-id}`) is staged and
  routed only at commit, so it is visible to consumers only then (§4.4.2).
* A transactional acknowledgement keeps the entry acquired by its consumer until
  discharge; commit applies the outcome, rollback returns the entry with
  delivery-count+1 (it was delivered; JMSRedelivered must be true afterwards).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any

from .broker import Broker
from .message import Message
from .queues import Entry, Outcome, Queue

UNKNOWN_ID = "amqp:transaction:unknown-id"
ROLLBACK = "amqp:transaction:rollback"
INVALID_FIELD = "amqp:invalid-field"
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


class TransactionRegistry:
    def __init__(self) -> None:
        self._open: dict[bytes, Transaction] = {}
        self._counter = itertools.count(1)
        self._prefix = os.urandom(4)
        self.committed_total = 0
        self.rolled_back_total = 0

    def declare(self, owner: Any) -> Transaction:
        txn_id = self._prefix + next(self._counter).to_bytes(8, "big")
        txn = Transaction(txn_id, owner)
        self._open[txn_id] = txn
        return txn

    def get(self, txn_id: object) -> Transaction:
        """The open transaction a peer named.  A txn-id is binary (AMQP 1.0 §4.5.4);
        anything else, or an id longer than any this broker hands out, names none:
        it is neither converted (bytes(n) of an integer n allocates n bytes) nor
        echoed whole."""
        if not isinstance(txn_id, (bytes, bytearray, memoryview)):
            raise TransactionError(INVALID_FIELD, f"txn-id must be binary, not {type(txn_id).__name__}")
        txn_id = bytes(txn_id[:MAX_TXN_ID + 1])
        txn = self._open.get(txn_id) if len(txn_id) <= MAX_TXN_ID else None
        if txn is None:
            raise TransactionError(UNKNOWN_ID, f"unknown transaction id {txn_id[:MAX_TXN_ID].hex()}")
        return txn

    def take(self, txn_id: object) -> Transaction:
        """Remove a transaction for discharge."""
        txn = self.get(txn_id)
        del self._open[txn.txn_id]
        return txn

    def owned_by(self, owner: Any) -> list[Transaction]:
        return [t for t in self._open.values() if t.owner is owner]

    def __len__(self) -> int:
        return len(self._open)

    # ------------------------------------------------------------------ discharge

    def commit(self, txn: Transaction, broker: Broker) -> list[Queue]:
        """Publish every staged send and apply every staged acknowledgement, in the
        order they arrived (one store batch when the caller flushes once after)."""
        touched: list[Queue] = []
        for msg, target in txn.sends:
            # all or nothing: queue limits do not reject part of a committed transaction
            touched.extend(broker.publish(msg, target, enforce_limits=False))
        for ack in txn.acks:
            ack.queue.settle(ack.entry, ack.outcome, delivery_failed=ack.delivery_failed,
                             undeliverable_here=ack.undeliverable_here)
        self.committed_total += 1
        return touched

    def rollback(self, txn: Transaction) -> None:
        """Staged sends vanish; acknowledged entries go back, counted as delivered."""
        txn.sends.clear()
        for ack in reversed(txn.acks):
            if ack.entry.consumer is not None:
                ack.queue.settle(ack.entry, Outcome.MODIFIED, delivery_failed=True)
        txn.acks.clear()
        self.rolled_back_total += 1
