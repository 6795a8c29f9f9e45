"""The transaction coordinator link (AMQP 1.0 Part 4 §4.2) and the transactional
states on ordinary transfers and dispositions, translated for core.transactions.

Frames as Qpid JMS sends them (shared/notes/qpid-jms-wire.md): a coordinator
sender `qpid-jms:coordinator:<session>` with target Coordinator{amqp:local-transactions};
Declare (0x31) → Declared{txn-id} (0x33); transfers with transactional-state{txn-id}
(0x34) → transactional-state{txn-id, accepted}; settled dispositions carrying
transactional-state{txn-id, outcome}; Discharge (0x32) {txn-id, fail} → accepted, or
rejected with amqp:transaction:rollback / amqp:transaction:unknown-id.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from proton import Condition, Delivery, Described, Link, symbol, ulong

from ..core.message import MalformedMessage, Message
from ..core.queues import Outcome
from ..core.transactions import ROLLBACK, StagedAck, TransactionError
from .links import ACCEPTED, REJECTED
from .producers import Producer

if TYPE_CHECKING:
    from .ports import LinkOwner, ProducerOwner
    from .links import LinkConsumer

log = logging.getLogger("amqpbroker.transactions")

DECLARE = (0x31, "amqp:declare:list")
DISCHARGE = (0x32, "amqp:discharge:list")
DECLARED = 0x33
TRANSACTIONAL_STATE = 0x34
ACCEPTED_OUTCOME = Described(ulong(0x24), [])
_OUTCOMES = {0x24: Outcome.ACCEPTED, 0x25: Outcome.REJECTED, 0x26: Outcome.RELEASED, 0x27: Outcome.MODIFIED,
             "amqp:accepted:list": Outcome.ACCEPTED, "amqp:rejected:list": Outcome.REJECTED,
             "amqp:released:list": Outcome.RELEASED, "amqp:modified:list": Outcome.MODIFIED}


def _descriptor(value: Any) -> Any:
    d = value.descriptor
    return int(d) if isinstance(d, int) else str(d)


class Coordinator(Producer):
    """A receiving link whose messages are Declare and Discharge requests."""

    gated = False   # not paced by alarms or queue limits (server/flow.py)

    def __init__(self, handler: "ProducerOwner", link: Link, credit: int):
        super().__init__(handler, link, None, credit, 64 * 1024)
        self.txns = handler.server.transactions

    def on_delivery(self, dlv: Any) -> None:
        raw = self.whole_payload(dlv)
        if raw is None:
            return
        try:
            body = Message(raw).body()
        except MalformedMessage as exc:
            self.settle_in_order(dlv, REJECTED, Condition("amqp:decode-error", str(exc)))
            return
        if not isinstance(body, Described):
            self.settle_in_order(dlv, REJECTED, Condition("amqp:decode-error", "not a coordinator request"))
            return
        kind = _descriptor(body)
        if kind in DECLARE:
            txn = self.txns.declare(self.handler)
            self.settle_in_order(dlv, DECLARED, data=[txn.txn_id])
        elif kind in DISCHARGE:
            fields = list(body.value) + [None, None]
            self._discharge(dlv, fields[0], bool(fields[1]))
        else:
            self.settle_in_order(dlv, REJECTED, Condition("amqp:not-implemented",
                                                          f"unknown coordinator request {kind!r}"))

    def _discharge(self, dlv: Any, txn_id: Any, fail: bool) -> None:
        cluster = self.handler.server.cluster
        if cluster is not None and cluster.discharge(self, dlv, txn_id, fail):
            return   # its work went to another node (amqpbroker/cluster/txn.py): discharged there
        try:
            txn = self.txns.take(txn_id if txn_id is not None else b"", self.handler)
        except TransactionError as exc:
            self.settle_in_order(dlv, REJECTED, Condition(exc.condition, exc.description))
            return
        if fail:
            self.txns.rollback(txn)
            self.settle_in_order(dlv, ACCEPTED)
            return
        store = self.handler.server.store
        try:
            self.txns.commit(txn, self.handler.broker)
        except TransactionError as exc:   # a reject queue's limit: nothing of it applied
            self.txns.rollback(txn)
            log.warning("transaction %s rolled back: %s", txn.txn_id.hex(), exc.description)
            self.settle_in_order(dlv, REJECTED, Condition(exc.condition, exc.description))
            return
        except Exception as exc:  # routing failed (address gone): the transaction cannot complete
            self.txns.rollback(txn)
            log.warning("transaction %s rolled back: %s", txn.txn_id.hex(), exc)
            self.settle_in_order(dlv, REJECTED, Condition(ROLLBACK, f"commit failed: {exc}"))
            return
        if not store.persistent:
            self.settle_in_order(dlv, ACCEPTED)
            return
        # One store batch holds every write of the commit: answer once it is durable.
        slot = self.settle_in_order(dlv, ACCEPTED, ready=False)
        store.after_commit(lambda error: self._committed([slot], error, ROLLBACK, "commit"))


def transactional_txn_id(dlv: Any) -> object:
    """The txn-id of a transfer or disposition in transactional-state, as the peer
    sent it (TransactionRegistry.get checks its type)."""
    data = Delivery.wrap(dlv).remote.data or []
    return data[0] if data else b""


def stage_send(handler: "LinkOwner", producer: Producer, dlv: Any, msg: Message, target: Any) -> None:
    """A transfer inside a transaction: staged, answered transactional-state{txn, accepted}."""
    txn_id = transactional_txn_id(dlv)
    try:
        txn = handler.server.transactions.get(txn_id, handler)
    except TransactionError as exc:
        producer.settle_in_order(dlv, REJECTED, Condition(exc.condition, exc.description))
        return
    # A `reject` queue this would take over its limit, with what open transactions
    # staged for it, refuses the send now (QueueFull; the transaction goes on); what is
    # staged counts against the room of the queues it reaches (core/transactions.py).
    handler.server.transactions.stage(txn, msg, target, handler.broker)
    producer.settle_in_order(dlv, TRANSACTIONAL_STATE, data=[txn.txn_id, ACCEPTED_OUTCOME])


def stage_ack(handler: "LinkOwner", consumer: "LinkConsumer", dlv: Delivery, entry: Any) -> None:
    """A settled disposition in transactional-state{txn, outcome}: applied at discharge."""
    data = dlv.remote.data or []
    txn_id = data[0] if data else b""
    outcome_value = data[1] if len(data) > 1 else None
    try:
        txn = handler.server.transactions.get(txn_id, handler)
    except TransactionError as exc:
        log.warning("connection %s: %s; acknowledgement applied outside a transaction",
                    handler.protocol.peer, exc.description)
        consumer.apply_outcome(entry, ACCEPTED)
        dlv.settle()
        return
    outcome = Outcome.ACCEPTED
    failed = undeliverable = False
    if isinstance(outcome_value, Described):
        outcome = _OUTCOMES.get(_descriptor(outcome_value), Outcome.ACCEPTED)
        fields = list(outcome_value.value or []) + [None, None]
        if outcome is Outcome.MODIFIED:
            failed, undeliverable = bool(fields[0]), bool(fields[1])
    txn.acks.append(StagedAck(consumer.queue, entry, outcome, failed, undeliverable))
    dlv.settle()


__all__ = ["Coordinator", "stage_ack", "stage_send", "symbol"]
