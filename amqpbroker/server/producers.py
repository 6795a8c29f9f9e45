"""Producer links (client → broker): transfers taken within the credit granted, routed
through the broker, answered in the order they arrived on the session.

Like the consumer side (links.py), the per-message path calls the proton C API
through cffi with raw pointers; the decisions it applies are pure: credit
(core/credit.py, core/credit_window.py) and settlement order (core/ordering.py).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Any

from cproton import ffi, lib
from proton import Condition, Delivery, Link

from ..core.credit import beyond_credit, top_up_below
from ..core.credit_window import CreditWindow
from ..core.ordering import SettlementOrder
from ..core.subscriptions import RESOURCE_LIMIT
from .links import ACCEPTED, REJECTED, RELEASED, TRANSFER_LIMIT

if TYPE_CHECKING:
    from ..core.addresses import Resolution
    from .ports import ProducerOwner

log = logging.getLogger("amqpbroker.links")

_REMOTE_CLOSED = lib.PN_REMOTE_CLOSED


class Producer:
    """A receiving link: messages in, routed through the broker, answered in the order
    they arrived on the link's session (core/ordering.py), with credit from the flow
    gate (server/flow.py), which the peer must not exceed (core/credit.py)."""

    def __init__(self, handler: "ProducerOwner", link: Link, target: "Resolution | None",
                 credit: int, max_message_size: int):
        self.handler = handler
        self.link = link
        self.impl = link._impl
        self.target = target           # None: anonymous relay, route by `to`
        # A partitioned destination's route (cluster/partitioned.py), asked of each
        # message (ClusterPort.partition_target); None: every message to `target`.
        self.partition: Any = None
        self.served_as: str | None = None   # the member's address then (ACLs: server/reload.py)
        # The credit window starts small and grows for a producer that uses it up in
        # bursts, up to `credit` (core/credit_window.py: what a burst costs everyone's
        # latency); the flow gate may allow less (core/credit.py).
        self.credit_window = CreditWindow(credit)
        self.window = self.credit_window.window
        self.low = top_up_below(self.window)   # top up when the credit falls below (set by the gate)
        self.protocol = handler.protocol
        self.max_message_size = max_message_size
        # Answers go out in the order transfers arrived on the session (Qpid JMS
        # completion ordering): one order per session, shared by its producers.
        session = lib.pn_link_session(self.impl)
        orders = handler.settlement_orders
        order = orders.get(session)
        if order is None:
            order = orders[session] = SettlementOrder()
        self.order = order
        self.waiting = 0               # this link's answers in `order`, not sent yet
        self.temp_node: tuple[str, str] | None = None   # dynamic node this link created
        # Not None while server/flow.py holds its credit back: ALARM or the Queue.
        self.held: Any = None
        self.feeds: tuple = ()         # the block queues its target reaches (server/flow.py)
        self.last_size = 0             # bytes of its last message: what one is expected to weigh
        # Relay transfers waiting for room in a block queue, in arrival order:
        # (pn_delivery_t*, message, resolution, reserved answer slot or None).
        self.parked: deque[tuple] = deque()
        self._filling: list | None = None   # the reserved slot of the parked transfer being routed
        # Deliveries waiting on one store batch share one commit callback.
        self._batch = -1
        self._batch_slots: list[list] = []
        # No longer the link's endpoint (detached, ended by the broker, stolen) while
        # settlements still wait on the store: the handler keeps it in `settling`
        # until they drain (then frees the link if `free_when_settled`) or its
        # session ends first (then `abandon`).
        self.released = False
        self.free_when_settled = False
        self.top_up()

    # Producer links are paced by the flow gate (alarms, block queues); the transaction
    # coordinator is not (discharges go on during an alarm: they are how work completes).
    gated = True

    def outstanding(self) -> int:
        """Credit granted and not taken yet (proton counts a receiving link's credit
        down as the broker takes each transfer, so this includes transfers that arrived
        but are not taken yet): what this producer may still put into its queues."""
        n = lib.pn_link_credit(self.impl)
        return n if n > 0 else 0

    # --- transfers in

    def on_flow(self) -> None:
        """A `flow` from the peer, the link's sender.  Only the sender changes its
        delivery-count, and only forward, using up credit (AMQP 1.0 §2.6.7); proton
        adds a move back to the link's credit (an unsigned difference), so a sender
        could grant itself credit and send past every limit.  proton sums the moves
        since the last call in `pn_link_drained` (signed): below 0, the link ends."""
        if lib.pn_link_drained(self.impl) < 0:
            log.warning("connection %s (container %s): link '%s': the sender moved its delivery-count back "
                        "(AMQP 1.0 §2.6.7); link ended with %s", self.handler.protocol.peer,
                        self.handler.container_id, self.link.name, TRANSFER_LIMIT)
            self._end_link(TRANSFER_LIMIT, "the sender's delivery-count moved back: credit it was not granted")

    def on_delivery(self, dlv: Any) -> None:
        """A transfer arrived (dlv: raw pn_delivery_t*)."""
        impl = self.impl
        if dlv != lib.pn_link_current(impl):
            return   # the peer's disposition for one taken already (read only the current one)
        if lib.pn_delivery_aborted(dlv):
            lib.pn_delivery_settle(dlv)   # (and moves past it: it used its credit too)
            self._beyond_credit(lib.pn_link_credit(impl) + 1)
            return
        pending = lib.pn_delivery_pending(dlv)
        if pending > self.max_message_size:
            self._too_large(dlv)
            return
        if lib.pn_delivery_partial(dlv):
            # Its first frame used the credit: a peer beyond it is stopped before the rest.
            if self._beyond_credit(lib.pn_link_credit(impl)):
                lib.pn_delivery_settle(dlv)
            return
        buf = bytearray(pending)
        n = lib.pn_link_recv(impl, ffi.from_buffer(buf), pending)
        lib.pn_link_advance(impl)
        credit = lib.pn_link_credit(impl)   # counted down by the advance
        if credit < 0 and self._beyond_credit(credit + 1):
            lib.pn_delivery_settle(dlv)
            return
        self.last_size = pending
        self.handler.receive(self, dlv, bytes(buf) if n == pending else bytes(buf[:max(n, 0)]))
        self._taken(credit)

    def whole_payload(self, dlv: Any) -> bytes | None:
        """A control link's delivery: its bytes once complete; None while partial, when
        aborted (settled), or beyond the credit (the link is ended)."""
        impl = self.impl
        if dlv != lib.pn_link_current(impl):
            return None
        if lib.pn_delivery_aborted(dlv):
            lib.pn_delivery_settle(dlv)
            self._beyond_credit(lib.pn_link_credit(impl) + 1)
            return None
        if lib.pn_delivery_partial(dlv):
            return None
        pending = lib.pn_delivery_pending(dlv)
        buf = bytearray(pending)
        n = lib.pn_link_recv(impl, ffi.from_buffer(buf), pending)
        lib.pn_link_advance(impl)
        credit = lib.pn_link_credit(impl)
        if credit < 0 and self._beyond_credit(credit + 1):
            lib.pn_delivery_settle(dlv)
            return None
        self._taken(credit)
        return bytes(buf) if n == pending else bytes(buf[:max(n, 0)])

    def _taken(self, credit: int) -> None:
        """A transfer was taken, `credit` left: the window learns how it came (one socket
        read among many, or a burst: core/credit_window.py) and, below `low`, grows or
        shrinks and the producer is topped up.  A held producer is topped up by the gate."""
        if self.held is not None:
            return
        protocol = self.protocol
        window = self.credit_window
        window.arrived(protocol.reads, protocol.read_at)
        if credit < self.low:
            self.window = window.refill(protocol.read_at)
            self.top_up()

    def _beyond_credit(self, credit_left: int) -> bool:
        """AMQP 1.0 §2.6.7: a transfer beyond the credit granted is a protocol violation.
        When the transfer being taken is one (`credit_left`: the credit not counting it),
        the link is ended with amqp:link:transfer-limit-exceeded (§2.8.16) and True is
        returned: the caller drops the transfer, never queues it."""
        if not beyond_credit(credit_left):
            return False
        log.warning("connection %s (container %s): link '%s': transfer beyond the credit granted "
                    "(AMQP 1.0 §2.6.7); link ended with %s", self.handler.protocol.peer,
                    self.handler.container_id, self.link.name, TRANSFER_LIMIT)
        self._end_link(TRANSFER_LIMIT, "transfer beyond the link credit granted")
        return True

    def _too_large(self, dlv: Any) -> None:
        log.warning("connection %s: link '%s': message larger than %d bytes refused",
                    self.handler.protocol.peer, self.link.name, self.max_message_size)
        lib.pn_delivery_settle(dlv)
        self._end_link("amqp:link:message-size-exceeded",
                       f"message exceeds the maximum message size of {self.max_message_size} bytes")

    def _end_link(self, condition: str, description: str) -> None:
        self.link.condition = Condition(condition, description)
        self.link.close()
        self.handler.link_ended(self.link)
        self.handler.protocol.mark_dirty()

    # --- credit

    def top_up(self) -> None:
        """Give the producer credit (AMQP 1.0 §2.6.7) once it has used half of what it
        was last allowed, as much as the flow gate (server/flow.py) allows: its window,
        less during an alarm (none) or for block queues (their room, shared).  Held, the
        gate tops it up when that is over.  A slow consumer alone never holds a producer
        back.  Relay transfers waiting for room go in first."""
        if self.handler.ended or self.released:
            return
        if self.parked and not self.resume_parked():
            return
        impl = self.impl
        credit = lib.pn_link_credit(impl)
        # Enough; or transfers already here beyond the credit (proton counts a transfer
        # when it is taken): a grant now would make them look sent within it.  The
        # first of them ends the link when it is taken (core/credit.py).
        if credit >= self.low or lib.pn_link_queued(impl) > credit:
            return
        gate = self.handler.server.flow if self.gated else None
        if gate is None:
            more = self.window - credit
        else:
            more = gate.grant(self, credit)
        if more > 0:
            lib.pn_link_flow(impl, more)
            self.handler.protocol.mark_dirty()

    # --- relay transfers waiting for room

    def park(self, dlv: Any, msg: Any, target: Any, queue: Any) -> None:
        """A relay transfer for a block queue without room (`queue`; None: one waits
        already, this one waits behind it): it waits, unsettled, holding its place in
        the session's answers, and the producer is held on that queue."""
        slot = None
        if not lib.pn_delivery_settled(dlv):
            slot = [dlv, None, None, False, None, self]
            self.order.add(slot)
        self.parked.append((dlv, msg, target, slot))
        gate = self.handler.server.flow
        if queue is not None and self.held is None and gate is not None:
            gate.hold_on(self, queue)

    def resume_parked(self) -> bool:
        """Route the waiting relay transfers that have room now, in order; True when none
        waits any more (else the producer is held on the queue the next one waits for)."""
        gate = self.handler.server.flow
        parked = self.parked
        while parked:
            dlv, msg, target, slot = parked[0]
            queue = gate.relay_wait(msg, target) if gate is not None else None
            if queue is not None:
                gate.hold_on(self, queue)
                return False
            parked.popleft()
            self._filling = slot
            try:
                self.handler.route(self, dlv, msg, target)
            finally:
                self._filling = None
        self.handler.protocol.mark_dirty()
        return True

    def _drop_parked(self) -> None:
        """The link ended: its waiting relay transfers were not taken (released).  When
        the session or connection is ending, nothing can be answered (the slots are
        cancelled with the session's answers, `abandon`)."""
        parked, self.parked = self.parked, deque()
        session = lib.pn_link_session(self.impl)
        if (lib.pn_session_state(session) & _REMOTE_CLOSED
                or lib.pn_connection_state(lib.pn_session_connection(session)) & _REMOTE_CLOSED):
            return
        for dlv, _, _, slot in parked:
            if slot is not None:
                slot[1] = RELEASED
                slot[3] = True
            else:
                lib.pn_delivery_settle(dlv)
        if parked:
            self.drain_settlements()

    # --- answers, in arrival order

    def settle_in_order(self, dlv: Any, state: int | None, condition: Condition | None = None,
                        ready: bool = True, data: list | None = None) -> list | None:
        """Queue an answer in the session's order; emit every answer at the head that is
        ready.  `data` carries the fields of a non-terminal state (declared,
        transactional-state).  Returns the slot (to make ready later) unless it went out
        at once."""
        slot = self._filling
        if slot is not None and slot[0] == dlv:   # a parked transfer's reserved place
            self._filling = None
            slot[1], slot[2], slot[3], slot[4] = state, condition, ready, data
        else:
            order = self.order
            if ready and not order.slots:   # nothing earlier on the session waits
                self._write_answer(order, dlv, state, condition, data)
                return None
            slot = [dlv, state, condition, ready, data, self]
            order.add(slot)
        if ready:
            self.drain_settlements()
        return slot

    def accept_after_commit(self, dlv: Any, store: Any) -> None:
        """Settle Accepted once the store batch holding this delivery's writes is on
        disk (AMQP 1.0 §3.4: Accepted means the message is safe).  Every delivery of
        this link queued in the same batch shares one commit callback."""
        if self._filling is None:   # the common case, inline (settle_in_order)
            slot = [dlv, ACCEPTED, None, False, None, self]
            self.order.slots.append(slot)
            self.waiting += 1
        else:
            slot = self.settle_in_order(dlv, ACCEPTED, ready=False)
        if self._batch != store.batch:
            self._batch = store.batch
            self._batch_slots = []
            store.after_commit(lambda err, slots=self._batch_slots: self._committed(slots, err))
        self._batch_slots.append(slot)

    def _committed(self, slots: list[list], error: BaseException | None,
                   condition: str = RESOURCE_LIMIT, what: str = "message") -> None:
        """The store batch of these settlements committed (or failed: Rejected with
        `condition`); emit what is ready, in order."""
        if self.handler.ended:
            return
        for slot in slots:
            if error is not None:
                slot[1] = REJECTED
                slot[2] = Condition(condition, f"{what} could not be stored: {error}")
            slot[3] = True
        self.drain_settlements()
        self.handler.protocol.mark_dirty()

    def drain_settlements(self) -> None:
        """Emit the answers at the head of the session's order that are ready (this
        link's and the other links' of the session)."""
        order = self.order
        for slot in order.take_ready():
            dlv, state, condition, data = slot[0], slot[1], slot[2], slot[4]
            if condition is None and data is None:   # the common case, inline (_write_answer)
                if state is not None:
                    lib.pn_delivery_update(dlv, state)
                    order.batched = True
                lib.pn_delivery_settle(dlv)
            else:
                self._write_answer(order, dlv, state, condition, data)
            owner = slot[5]
            if owner.released and not owner.waiting:
                owner.handler.settled_after_release(owner)

    def _write_answer(self, order: SettlementOrder, dlv: Any, state: int | None, condition: Condition | None,
                data: list | None) -> None:
        """Settle a received transfer with its outcome (raw pn_delivery_t*).

        proton holds a plain outcome back to send it with the next ones as one ranged
        disposition, but sends one with fields (a rejection's error, a transactional
        state) at once: written in that order they would go out swapped.  So before an
        outcome with fields, the transport writes out what it holds (`batched`)."""
        if condition is None and data is None:
            if state is not None:
                lib.pn_delivery_update(dlv, state)
                order.batched = True
            lib.pn_delivery_settle(dlv)
            return
        if order.batched:
            order.batched = False
            transport = self.handler.protocol.transport
            if transport is not None:
                lib.pn_transport_pending(transport._impl)
        wrapped = Delivery.wrap(dlv)
        if condition is not None:
            wrapped.local.condition = condition
        if data is not None:
            wrapped.local.data = data
        wrapped.update(state)
        lib.pn_delivery_settle(dlv)

    def holds(self, dlv: Any) -> bool:
        """Whether this delivery waits in the settlement order (a raw pn_delivery_t*)."""
        return self.order.holds(self, dlv)

    def abandon(self) -> None:
        """The session or connection ended: deliveries waiting on the store get no
        answer (nothing can be settled on an ended session, AMQP 1.0 §2.5.2).  The
        messages stay stored: they were received, only the outcome is lost.

        Called before the session (and so the link and its deliveries) is freed: the
        commit callbacks still hold these slots, and must find no pn_delivery_t*
        in them to update or settle afterwards (that was a use-after-free)."""
        self.order.cancel(self)
        self.parked.clear()
        self._batch_slots = []
        self._batch = -1
        self.free_when_settled = False
        self.stop_flow()

    def stop_flow(self) -> None:
        """The link ended: the flow gate forgets it; relay transfers still waiting for
        room are answered released (not taken)."""
        if self.parked:
            self._drop_parked()
        if self.held is not None or self.feeds:
            gate = getattr(self.handler.server, "flow", None)
            if gate is not None:
                gate.forget(self)
            self.held = None
