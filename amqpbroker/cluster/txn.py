"""Transactions in a cluster: a transaction whose work all goes to one node is that
node's; one that spans nodes is refused.

The client's coordinator link stays on the node it is connected to (its Declare names
no address, so nothing tells where the work will go).  The first transactional
transfer or acknowledgement that goes to another node binds the transaction there:
this node declares a transaction of its own at that node (a coordinator link on the
client's connection to it, so the owner ties it to the client's connection as usual)
and passes the work on under that node's txn-id; the discharge goes there too and the
client gets that node's outcome.  Work for a second node, or work here and on another
node, is refused with an error naming the two addresses
(`amqp:transaction:rollback` at the commit; the transfer that would span it is
rejected at once).  Two-phase commit is not done.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from cproton import ffi, lib
from proton import Condition, Delivery, Described, Message, Terminus, symbol, ulong

from ..core.placement import UNAVAILABLE
from ..core.transactions import ROLLBACK, TransactionError
from .deliveries import MODIFIED, Tags, is_null

log = logging.getLogger("amqpbroker.cluster")

TRANSACTIONAL_STATE = 0x34
DECLARED = 0x33
SPANS = "amqp:transaction:rollback"

# (state, data of a non-terminal state, condition) of the owner's answer
Answer = Callable[[int, Any, Condition | None], None]


def _request(body: Described) -> bytes:
    return Message(body=body).encode()


def txn_state_data(dlv: Any) -> list:
    """The fields of a transactional-state (AMQP 1.0 §4.5.5) a peer set on a delivery."""
    return list(Delivery.wrap(dlv).remote.data or [])


def set_txn_state(dlv: Any, txn_id: bytes, outcome: Any = None) -> None:
    """Put transactional-state{txn-id, outcome} on our side of a delivery."""
    wrapped = Delivery.wrap(dlv)
    wrapped.local.data = [txn_id] if outcome is None else [txn_id, outcome]
    wrapped.update(TRANSACTIONAL_STATE)


class CoordinatorLink:
    """A coordinator sender on a client connection's connection to another node."""

    def __init__(self, peer: Any):
        self.peer = peer
        ssn = peer.session_for(self)
        m = ssn.sender(f"amqpbroker:coordinator:{uuid.uuid4().hex[:12]}")
        m.target.type = Terminus.COORDINATOR
        m.target.capabilities.put_array(False, 21)
        m.target.capabilities.enter()
        m.target.capabilities.put_symbol(symbol("amqp:local-transactions"))
        m.target.capabilities.exit()
        m.open()
        self.mirror, self.mimpl, self.mirror_session = m, m._impl, ssn
        self.open = False
        self.failed: Condition | None = None
        self.pending: dict[Any, Answer] = {}
        self.waiting: list[tuple[bytes, Answer]] = []
        self.tags = Tags()
        peer.links[m._impl] = self
        peer.mark_dirty()

    def request(self, body: Described, answer: Answer) -> None:
        if self.failed is not None:
            answer(lib.PN_REJECTED, None, self.failed)
            return
        self.waiting.append((_request(body), answer))
        self._send()

    def _send(self) -> None:
        while self.open and self.waiting and lib.pn_link_credit(self.mimpl) > 0:
            raw, answer = self.waiting.pop(0)
            dlv = lib.pn_delivery(self.mimpl, self.tags.next())
            lib.pn_link_send(self.mimpl, ffi.from_buffer(raw), len(raw))
            lib.pn_link_advance(self.mimpl)
            self.pending[dlv] = answer
        self.peer.mark_dirty()

    def on_peer_attach(self) -> None:
        if is_null(self.mirror.remote_target):
            return
        self.open = True
        self._send()

    def on_peer_flow(self) -> None:
        self._send()

    def on_peer_delivery(self, dlv: Any) -> None:
        if not (lib.pn_delivery_settled(dlv) or lib.pn_delivery_updated(dlv)):
            return
        answer = self.pending.pop(dlv, None)
        state = lib.pn_delivery_remote_state(dlv)
        remote = Delivery.wrap(dlv).remote
        data, cond = remote.data, remote.condition
        lib.pn_delivery_settle(dlv)
        if answer is not None:
            answer(state, data, cond)

    def on_peer_detach(self, closed: bool, condition: Condition | None = None) -> None:
        self._fail(condition or self.mirror.remote_condition
                   or Condition(UNAVAILABLE, f"node {self.peer.node} ended the transaction coordinator"))

    def on_peer_lost(self, condition: Condition) -> None:
        self._fail(Condition(UNAVAILABLE, condition.description or "node lost"))

    def _fail(self, cond: Condition) -> None:
        self.failed = cond
        answers = list(self.pending.values()) + [a for _, a in self.waiting]
        self.pending, self.waiting = {}, []
        for answer in answers:
            answer(lib.PN_REJECTED, None, cond)


@dataclass(eq=False)
class Binding:
    """Where one of this node's transactions does its work."""
    txn_id: bytes
    node: str | None = None            # the other node it is bound to
    address: str | None = None         # its first address there
    xid: bytes | None = None           # that node's txn-id (None until Declared)
    coordinator: CoordinatorLink | None = None
    waiters: list[Callable[[bytes | None, tuple[str, str] | None], None]] = field(default_factory=list)
    spans: str | None = None           # why it may only roll back now


class TxnRoutes:
    """This node's transactions that do work on other nodes."""

    def __init__(self, router: Any):
        self.router = router
        self.bindings: dict[tuple[Any, bytes], Binding] = {}
        self.coordinators: dict[tuple[Any, str], CoordinatorLink] = {}

    def route(self, handler: Any, txn_id: Any, node: str, address: str,
              then: Callable[[bytes | None, tuple[str, str] | None], None]) -> None:
        """Transactional work for `node` (`address`): `then(xid, None)` once it may
        go there under `xid`, or `then(None, (condition, description))`."""
        try:
            txn = self.router.server.transactions.get(txn_id, handler)   # only its own connection's
        except TransactionError as exc:
            then(None, (exc.condition, exc.description))
            return
        key = (handler, txn.txn_id)
        b = self.bindings.get(key)
        if b is None:
            b = self.bindings[key] = Binding(txn.txn_id)
        if b.spans is None:
            if b.node is None and (txn.sends or txn.acks):
                here = _local_address(txn)
                b.spans = (f"transaction spans nodes: '{here}' on node {self.router.node} and "
                           f"'{address}' on node {node} (a transaction may use one node's addresses only)")
            elif b.node is not None and b.node != node:
                b.spans = (f"transaction spans nodes: '{b.address}' on node {b.node} and '{address}' on "
                           f"node {node} (a transaction may use one node's addresses only)")
        if b.spans is not None:
            log.warning("connection %s: %s", handler.protocol.peer, b.spans)
            then(None, (ROLLBACK, b.spans))
            return
        if b.node is None:
            b.node, b.address = node, address
            self._declare(handler, b)
        if b.xid is None:
            b.waiters.append(then)
        else:
            then(b.xid, None)

    def _declare(self, handler: Any, b: Binding) -> None:
        side = self.router.side(handler)
        ckey = (handler, b.node)
        coordinator = self.coordinators.get(ckey)
        if coordinator is None or coordinator.failed is not None or coordinator.peer.closed:
            coordinator = self.coordinators[ckey] = CoordinatorLink(side.peer(b.node))
        b.coordinator = coordinator

        def declared(state: int, data: Any, cond: Condition | None) -> None:
            if state == DECLARED and data:
                b.xid = bytes(data[0])
                error = None
            else:
                b.spans = (cond.description if cond is not None else None) or f"node {b.node} declined the transaction"
                error = (ROLLBACK, b.spans)
            waiters, b.waiters = b.waiters, []
            for waiter in waiters:
                waiter(b.xid, error)

        coordinator.request(Described(ulong(0x31), []), declared)

    # ------------------------------------------------------------------ discharge

    def discharge(self, coordinator: Any, dlv: Any, txn_id: Any, fail: bool) -> bool:
        """The client's Discharge: True when this room answers it (the transaction
        did work on another node), False for a transaction of this node alone."""
        handler = coordinator.handler
        try:
            key = (handler, bytes(txn_id))
        except TypeError:
            return False
        b = self.bindings.pop(key, None)
        if b is None:
            return False
        txns = self.router.server.transactions
        try:
            txn = txns.take(txn_id, handler)
        except TransactionError as exc:
            coordinator.settle_in_order(dlv, lib.PN_REJECTED, Condition(exc.condition, exc.description))
            return True
        if b.spans is None and (txn.sends or txn.acks) and not fail:
            b.spans = (f"transaction spans nodes: '{_local_address(txn)}' on node {self.router.node} and "
                       f"'{b.address}' on node {b.node} (a transaction may use one node's addresses only)")
        txns.rollback(txn)   # nothing of it was done here (or it is refused)
        slot = coordinator.settle_in_order(dlv, None, ready=False)
        refused = b.spans if not fail else None

        def discharged(state: int, data: Any, cond: Condition | None) -> None:
            if refused is not None:
                slot[1], slot[2] = lib.PN_REJECTED, Condition(ROLLBACK, refused)
            elif state == lib.PN_ACCEPTED:
                slot[1] = lib.PN_ACCEPTED
            else:
                slot[1] = lib.PN_REJECTED
                slot[2] = cond or Condition(ROLLBACK, f"node {b.node} did not commit the transaction")
            slot[3] = True
            if not handler.ended:
                coordinator.drain_settlements()
                handler.protocol.mark_dirty()

        def when_declared(xid: bytes | None, error: tuple[str, str] | None) -> None:
            if xid is None:   # never declared there: nothing to discharge
                discharged(lib.PN_ACCEPTED if fail else lib.PN_REJECTED, None,
                           Condition(*(error or (ROLLBACK, "not declared"))))
                return
            # A refused (spanning) transaction rolls back there too.
            b.coordinator.request(Described(ulong(0x32), [xid, bool(fail or refused)]), discharged)

        if b.xid is None and b.spans is None:
            b.waiters.append(when_declared)
        else:
            when_declared(b.xid, (ROLLBACK, b.spans) if b.spans else None)
        return True

    def connection_ended(self, handler: Any) -> None:
        """The connection's transactions at other nodes roll back there with it."""
        for key in [k for k in self.bindings if k[0] is handler]:
            del self.bindings[key]
        for key in [k for k in self.coordinators if k[0] is handler]:
            del self.coordinators[key]


def route_transactional_ack(handler: Any, cdlv: Any, mdlv: Any, settled: bool, peer: Any, address: str) -> None:
    """A client's acknowledgement inside a transaction of a delivery that came from
    another node (`mdlv` on `peer`'s link from `address`): passed on under that node's
    txn-id; one that would span nodes gives the message back there (modified,
    delivery-failed, as the rollback that follows would)."""
    data = txn_state_data(cdlv)
    txn_id = bytes(data[0]) if data and isinstance(data[0], (bytes, bytearray, memoryview)) else b""
    outcome = data[1] if len(data) > 1 else None

    def then(xid: bytes | None, error: tuple[str, str] | None) -> None:
        if peer.closed:
            return
        if xid is None:
            lib.pn_disposition_set_failed(lib.pn_delivery_local(mdlv), True)
            lib.pn_delivery_update(mdlv, MODIFIED)
        else:
            set_txn_state(mdlv, xid, outcome)
        if settled:
            lib.pn_delivery_settle(mdlv)
        peer.mark_dirty()

    if settled:
        lib.pn_delivery_settle(cdlv)
    handler.server.cluster.txns.route(handler, txn_id, peer.node, address, then)


def _local_address(txn: Any) -> str:
    """The first address of a transaction's work staged on this node."""
    for _, target in txn.sends:
        return target.name if target.key is None else f"{target.name}/{target.key}"
    for ack in txn.acks:
        return ack.queue.name
    return "?"
