"""Link endpoints: a consumer (broker → client) and a producer (client → broker).

Thin wrappers around proton links: they translate transfers and dispositions into
calls on core queues and the broker, and nothing else.

The per-message paths (transfer in, transfer out, disposition, flow) call the
proton C API through cffi directly with raw pointers: proton's Python wrappers
cost about a dozen object constructions per message (shared/notes/proton-server.md),
which is most of a Python broker's CPU budget.  Rare paths use the wrappers.
"""

from __future__ import annotations

import logging
import struct
from collections import deque
from typing import TYPE_CHECKING, Any

from cproton import ffi, lib
from proton import Condition, Delivery, Link

from ..core.credit import CreditWindow
from ..core.message import selector_accepts
from ..core.queues import Entry, Outcome, Queue
from ..core.settlement import LinkEnding, counts_as_failed
from ..core.subscriptions import RESOURCE_LIMIT

if TYPE_CHECKING:
    from ..core.addresses import Resolution
    from .handlers import ConnectionHandler

log = logging.getLogger("amqpbroker.links")

# Delivery state codes, AMQP 1.0 §3.4 (and §4.5.5 for the transactional state).
ACCEPTED = Delivery.ACCEPTED
REJECTED = Delivery.REJECTED
RELEASED = Delivery.RELEASED
MODIFIED = Delivery.MODIFIED
TRANSACTIONAL_STATE = 0x34

_consumer_ids = iter(range(1, 1 << 62))
_pack_tag = struct.Struct(">Q").pack_into
_REMOTE_CLOSED = lib.PN_REMOTE_CLOSED
# How long the deliveries of an ended consumer link wait for a late disposition
# (Qpid JMS sends one round trip after the broker's detach); then they are settled.
LATE_OUTCOME_WINDOW = 5.0


class LinkConsumer:
    """A sending link on a queue: implements core.queues.ConsumerPort."""

    def __init__(self, handler: "ConnectionHandler", link: Link, queue: Queue, *,
                 selector: Any = None, no_local: bool = False, browser: bool = False):
        self.consumer_id = next(_consumer_ids)
        self.handler = handler
        self.link = link
        self.impl = link._impl
        self._session = lib.pn_link_session(self.impl)
        self._connection = lib.pn_session_connection(self._session)
        self.queue = queue
        self.selector = selector
        self.no_local = no_local
        self.browser = browser
        self.filtered = selector is not None or no_local
        self.presettled = link.snd_settle_mode == Link.SND_SETTLED
        # Keyed by the raw pn_delivery_t* (cffi pointers hash and compare by address).
        self.unsettled: dict[Any, Entry] = {}   # delivery → entry, in send order
        self.browsed: set[Any] = set()           # browser copies awaiting the peer's settle
        self.browse_cursor = 0
        self.temp_node: tuple[str, str] | None = None   # dynamic node this link created
        # Delivery tags: a counter written into one buffer; pn_delivery copies it.
        self._tag = 0
        self._tag_buf = bytearray(8)
        self._tag_ptr = ffi.from_buffer(self._tag_buf)
        self._tag_t = ffi.new("pn_delivery_tag_t*", (8, self._tag_ptr))
        self.closed = False
        self.max_unsettled = handler.server.settings.limits.max_unsettled_per_link
        self.ready = True              # False until the attach reply is sent (durable commit)
        self._open_at = -1             # protocol.input_seq when peer_ending() was last False
        self.subscription: Any = None  # set by the subscription layer

    # --- ConsumerPort

    def credit(self) -> int:
        """How many deliveries may go now (ConsumerPort): each uses exactly one, so a
        queue may read this once for a run of entries."""
        if self.closed or not self.ready or self.handler.protocol.write_paused:
            return 0
        room = self.max_unsettled - len(self.unsettled)
        if room <= 0:
            return 0   # credit is a permission, not a duty (AMQP 1.0 §2.6.7): memory is bounded
        credit = link_credit(self.impl)
        if credit > 0:
            seen = self.handler.protocol.input_seq
            if self._open_at != seen:   # input came since we last looked
                if self.peer_ending():
                    return 0
                self._open_at = seen
        return credit if credit < room else room

    def peer_ending(self) -> bool:
        """The peer has closed this link, ended its session or closed the connection
        in frames not handled yet (a disposition it sent just before is being
        handled now): nothing may be sent on it again (Qpid JMS's modified → end)."""
        return bool(lib.pn_link_state(self.impl) & _REMOTE_CLOSED
                    or lib.pn_session_state(self._session) & _REMOTE_CLOSED
                    or lib.pn_connection_state(self._connection) & _REMOTE_CLOSED)

    def accepts(self, entry: Entry) -> bool:
        if self.no_local and entry.msg.publisher == self.handler.connection_key:
            return False
        if self.selector is not None:
            # Never raises: a message whose application-properties do not decode
            # matches no selector (and stays for consumers without one).
            return selector_accepts(self.selector, entry.msg, entry.delivery_count)
        return True

    def _transfer(self, entry: Entry) -> Any:
        """Send the entry's bytes as one delivery; return the raw pn_delivery_t*."""
        impl = self.impl
        self._tag += 1
        _pack_tag(self._tag_buf, 0, self._tag)
        dlv = lib.pn_delivery(impl, self._tag_t[0])
        payload = entry.payload()
        lib.pn_link_send(impl, ffi.from_buffer(payload), len(payload))
        lib.pn_link_advance(impl)
        return dlv

    def deliver(self, entry: Entry) -> None:
        dlv = self._transfer(entry)
        if entry.store_ref is not None:
            self.handler.protocol.hold_for_store(entry.stored_in)
        if self.presettled:
            lib.pn_delivery_settle(dlv)
            self.queue.settle(entry, Outcome.ACCEPTED)
        else:
            self.unsettled[dlv] = entry
        self.handler.protocol.mark_dirty()

    def deliver_copy(self, entry: Entry) -> None:
        """A browser's copy: the entry stays on the queue, outcomes are ignored."""
        dlv = self._transfer(entry)
        if self.presettled:
            lib.pn_delivery_settle(dlv)
        else:
            self.browsed.add(dlv)
        self.handler.protocol.mark_dirty()

    # --- proton events

    def on_flow(self) -> None:
        self.queue.dispatch()
        impl = self.impl
        if lib.pn_link_get_drain(impl) and link_credit(impl) > 0:
            # AMQP 1.0 §2.6.7: a drain request with nothing more to send consumes
            # the credit (delivery-count advances, credit 0, drain echoed).
            lib.pn_link_drained(impl)
        self.handler.protocol.mark_dirty()

    def on_delivery(self, dlv: Any) -> None:
        """A disposition from the consumer (dlv: raw pn_delivery_t*)."""
        if not (lib.pn_delivery_updated(dlv) or lib.pn_delivery_settled(dlv)):
            return
        key = dlv
        entry = self.unsettled.pop(key, None)
        if entry is None:
            self.browsed.discard(key)
            lib.pn_delivery_settle(dlv)
            return
        state = lib.pn_delivery_remote_state(dlv)
        if state == ACCEPTED:   # the common case: no disposition fields to read
            self.queue.settle(entry, Outcome.ACCEPTED)
            lib.pn_delivery_settle(dlv)
            return
        if state == TRANSACTIONAL_STATE:
            self.handler.transactional_ack(self, Delivery.wrap(dlv), entry)
            return
        remote = lib.pn_delivery_remote(dlv)
        self.apply_outcome(entry, state, lib.pn_disposition_is_failed(remote),
                           lib.pn_disposition_is_undeliverable(remote))
        lib.pn_delivery_settle(dlv)

    def apply_outcome(self, entry: Entry, state: int, failed: bool = False,
                      undeliverable: bool = False) -> None:
        if state == REJECTED:
            self.queue.settle(entry, Outcome.REJECTED)
        elif state == RELEASED:
            self.queue.settle(entry, Outcome.RELEASED)
        elif state == MODIFIED:
            self.queue.settle(entry, Outcome.MODIFIED, delivery_failed=bool(failed),
                              undeliverable_here=bool(undeliverable))
        else:  # accepted, or settled without a state: treat as consumed
            self.queue.settle(entry, Outcome.ACCEPTED)

    def close(self, ending: LinkEnding) -> None:
        """The link ended: give back what was not settled, in order, counted as a
        failed attempt only when the connection was lost (core/settlement.py).  After
        a normal ending the deliveries wait a while for late dispositions."""
        if self.closed:
            return
        self.closed = True
        held, self.unsettled = self.unsettled, {}
        self.queue.remove_consumer(self, list(held.values()), failed=counts_as_failed(ending))
        if ending is not LinkEnding.CONNECTION_LOST:
            self.handler.ended_deliveries.keep(self.impl, self.queue, held, self.browsed)
        self.browsed = set()


class EndedDeliveries:
    """Deliveries of consumer links that ended unsettled.  Dispositions name delivery-ids
    on the session (AMQP 1.0 §2.7.6), so the peer may still settle them after its
    detach; such a late outcome is honoured (`Queue.settle_late`) instead of the
    source's default outcome.  Each link's deliveries are settled and forgotten after
    LATE_OUTCOME_WINDOW, when their session ends, or with the connection."""

    def __init__(self, loop: Any):
        self.loop = loop
        # raw pn_link_t* → (queue, {pn_delivery_t*: entry}, {browser copies}, timer)
        self.by_link: dict[Any, tuple[Queue, dict[Any, Entry], set[Any], Any]] = {}
        self._free_after: set[Any] = set()   # links to free once forgotten

    def free_when_done(self, link: Any) -> bool:
        """The handler is done with this link: True when it may be freed now, False
        when its deliveries still wait (then `forget` frees it)."""
        if link not in self.by_link:
            return True
        self._free_after.add(link)
        return False

    def keep(self, link: Any, queue: Queue, held: dict[Any, Entry], browsed: set[Any]) -> None:
        if not held and not browsed:
            return
        timer = self.loop.call_later(LATE_OUTCOME_WINDOW, self.forget, link)
        self.by_link[link] = (queue, held, browsed, timer)

    def on_delivery(self, dlv: Any) -> None:
        """A disposition for a delivery of a link that is no longer an endpoint."""
        kept = self.by_link.get(lib.pn_delivery_link(dlv))
        if kept is not None and (lib.pn_delivery_updated(dlv) or lib.pn_delivery_settled(dlv)):
            queue, held, browsed, _ = kept
            entry = held.pop(dlv, None)
            browsed.discard(dlv)
            if entry is not None:
                self._late_outcome(queue, entry, dlv)
        lib.pn_delivery_settle(dlv)

    @staticmethod
    def _late_outcome(queue: Queue, entry: Entry, dlv: Any) -> None:
        state = lib.pn_delivery_remote_state(dlv)
        outcome = _OUTCOMES.get(state)
        if outcome is None:   # settled without a state, or transactional: nothing to do
            return
        failed = outcome is Outcome.MODIFIED and lib.pn_disposition_is_failed(lib.pn_delivery_remote(dlv))
        action = queue.settle_late(entry, outcome, delivery_failed=bool(failed))
        log.debug("queue %s: late %s for seq=%d after its link ended: %s", queue.name,
                  outcome.value, entry.seq, action.value)

    def forget(self, link: Any) -> None:
        """Stop waiting for this link's late dispositions: settle what is left."""
        kept = self.by_link.pop(link, None)
        if kept is None:
            return
        _, held, browsed, timer = kept
        timer.cancel()
        for dlv in list(held) + list(browsed):
            lib.pn_delivery_settle(dlv)
        if link in self._free_after:
            self._free_after.discard(link)
            lib.pn_link_free(link)

    def session_ended(self, session: Any) -> None:
        for link in [k for k in self.by_link if lib.pn_link_session(k) == session]:
            self.forget(link)

    def clear(self) -> None:
        """The connection ended: nothing more can arrive."""
        for _, _, _, timer in self.by_link.values():
            timer.cancel()
        self.by_link.clear()
        self._free_after.clear()


_OUTCOMES = {ACCEPTED: Outcome.ACCEPTED, REJECTED: Outcome.REJECTED,
             RELEASED: Outcome.RELEASED, MODIFIED: Outcome.MODIFIED}


class Producer:
    """A receiving link: messages in, routed through the broker, settled in order."""

    def __init__(self, handler: "ConnectionHandler", link: Link, target: "Resolution | None",
                 credit: int, max_message_size: int):
        self.handler = handler
        self.link = link
        self.impl = link._impl
        self.target = target           # None: anonymous relay, route by `to`
        # The credit window starts small and grows for a producer that uses it up in
        # bursts, up to `credit` (core/credit.py: what a burst costs everyone's latency).
        self.credit_window = CreditWindow(credit)
        self.window = self.credit_window.window
        self.protocol = handler.protocol
        self.max_message_size = max_message_size
        # Dispositions go out in arrival order (Qpid JMS completion ordering): a
        # delivery waiting on the store holds back the ones behind it.
        self.in_order: deque[list] = deque()
        self.temp_node: tuple[str, str] | None = None   # dynamic node this link created
        # Not None while server/flow.py holds its credit back: ALARM or the full queue.
        self.held: Any = None
        # Deliveries waiting on one store batch share one commit callback.
        self._batch = -1
        self._batch_slots: list[list] = []
        # No longer the link's endpoint (detached, ended by the broker, stolen) while
        # settlements still wait on the store: the handler keeps it in `settling`
        # until they drain (then frees the link if `free_when_settled`) or its
        # session ends first (then `abandon`).
        self.released = False
        self.free_when_settled = False
        if not self.gated or self._may_grant():
            link.flow(self.window)

    # Producer links are paced by the flow gate (alarms, full queues); the transaction
    # coordinator is not (discharges go on during an alarm: they are how work completes).
    gated = True

    def _may_grant(self) -> bool:
        gate = getattr(self.handler.server, "flow", None)
        return gate is None or gate.may_grant(self)

    def on_delivery(self, dlv: Any) -> None:
        """A transfer arrived (dlv: raw pn_delivery_t*)."""
        if lib.pn_delivery_aborted(dlv):
            lib.pn_delivery_settle(dlv)
            return
        pending = lib.pn_delivery_pending(dlv)
        if pending > self.max_message_size:
            self._too_large(dlv)
            return
        if lib.pn_delivery_partial(dlv):
            return
        self.handler.receive(self, dlv, self.take_payload(dlv, pending))

    def whole_payload(self, dlv: Any) -> bytes | None:
        """A control link's delivery: its bytes once complete; None while partial or
        when aborted (settled)."""
        if lib.pn_delivery_aborted(dlv):
            lib.pn_delivery_settle(dlv)
            return None
        if lib.pn_delivery_partial(dlv):
            return None
        return self.take_payload(dlv, lib.pn_delivery_pending(dlv))

    def take_payload(self, dlv: Any, pending: int) -> bytes:
        """Read a complete delivery's bytes, move on, and top the credit window up."""
        impl = self.impl
        buf = bytearray(pending)
        n = lib.pn_link_recv(impl, ffi.from_buffer(buf), pending)
        lib.pn_link_advance(impl)
        if self.held is None:   # (a held producer is topped up by the flow gate)
            window = self.credit_window
            protocol = self.protocol
            window.arrived(protocol.reads, protocol.read_at)
            if lib.pn_link_credit(impl) < self.window // 2:
                self.window = window.refill(protocol.read_at)
                self.top_up()
        return bytes(buf) if n == pending else bytes(buf[:max(n, 0)])

    def top_up(self) -> None:
        """Give the producer its window of credit back (AMQP 1.0 §2.6.7) when half is
        used, unless the flow gate (server/flow.py) holds it: a memory or disk alarm,
        or a full target queue with overflow `block`.  The gate tops it up when that
        is over.  A slow consumer alone never holds a producer back."""
        impl = self.impl
        credit = lib.pn_link_credit(impl)
        if credit >= self.window // 2 or self.handler.ended or self.released:
            return
        if self.gated and not self._may_grant():
            return
        lib.pn_link_flow(impl, self.window - credit)
        self.handler.protocol.mark_dirty()

    def _too_large(self, dlv: Any) -> None:
        log.warning("connection %s: link '%s': message larger than %d bytes refused",
                    self.handler.protocol.peer, self.link.name, self.max_message_size)
        lib.pn_delivery_settle(dlv)
        self.link.condition = Condition(
            "amqp:link:message-size-exceeded",
            f"message exceeds the maximum message size of {self.max_message_size} bytes")
        self.link.close()
        self.handler.link_ended(self.link)

    def settle_in_order(self, dlv: Any, state: int | None, condition: Condition | None = None,
                        ready: bool = True, data: list | None = None) -> list:
        """Queue a settlement; emit every settlement at the head that is ready.
        `data` carries the fields of a non-terminal state (declared, transactional-state)."""
        slot = [dlv, state, condition, ready, data]
        self.in_order.append(slot)
        if ready:
            self.drain_settlements()
        return slot

    def accept_after_commit(self, dlv: Any, store: Any) -> None:
        """Settle Accepted once the store batch holding this delivery's writes is on
        disk (AMQP 1.0 §3.4: Accepted means the message is safe).  Every delivery of
        this link queued in the same batch shares one commit callback."""
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
        q = self.in_order
        while q and q[0][3]:
            dlv, state, condition, _, data = q.popleft()
            if condition is not None or data is not None:
                wrapped = Delivery.wrap(dlv)
                if condition is not None:
                    wrapped.local.condition = condition
                if data is not None:
                    wrapped.local.data = data
                wrapped.update(state)
            elif state is not None:
                lib.pn_delivery_update(dlv, state)
            lib.pn_delivery_settle(dlv)
        if self.released and not q:
            self.handler.settled_after_release(self)

    def holds(self, dlv: Any) -> bool:
        """Whether this delivery waits in the settlement order (a raw pn_delivery_t*)."""
        return any(slot[0] == dlv for slot in self.in_order)

    def abandon(self) -> None:
        """The session or connection ended: deliveries waiting on the store get no
        answer (nothing can be settled on an ended session, AMQP 1.0 §2.5.2).  The
        messages stay stored: they were received, only the outcome is lost.

        Called before the session (and so the link and its deliveries) is freed: the
        commit callbacks still hold these slots, and must find no pn_delivery_t*
        in them to update or settle afterwards (that was a use-after-free)."""
        for slot in self.in_order:
            slot[0] = None
        self.in_order.clear()
        self._batch_slots = []
        self._batch = -1
        self.free_when_settled = False
        self.stop_flow()

    def stop_flow(self) -> None:
        """The link ended: the flow gate forgets it."""
        if self.held is not None:
            gate = getattr(self.handler.server, "flow", None)
            if gate is not None:
                gate.forget(self)
            self.held = None


def link_credit(impl: Any) -> int:
    """A sending link's credit.  The peer grants up to 2^32 - 1 (AMQP 1.0 §2.7.4
    link-credit is a uint); proton keeps it unsigned but hands it out as a C int,
    so a grant of 2^31 or more would read as negative, and never be served."""
    return lib.pn_link_credit(impl) & 0xFFFFFFFF


def link_key(link: Link) -> Any:
    """A stable key for a proton link (Python wrappers are recreated per event): its
    raw pn_link_t*, equal to the pointer a raw event carries (cffi pointers hash
    and compare by address)."""
    return link._impl


def session_key(session: Any) -> int:
    """The owner key of a session's non-durable nodes (expiry policy session-end)."""
    return hash(session)
