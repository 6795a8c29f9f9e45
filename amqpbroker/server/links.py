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
from typing import TYPE_CHECKING, Any

from cproton import ffi, lib
from proton import Delivery, Link

from ..core.message import selector_accepts
from ..core.queues import Entry, Outcome, Queue
from ..core.settlement import LinkEnding, counts_as_failed
from .outbound import DELIVERY_COST, BoundedOutput

if TYPE_CHECKING:
    from .ports import ConsumerOwner

log = logging.getLogger("amqpbroker.links")

# Delivery state codes, AMQP 1.0 §3.4 (and §4.5.5 for the transactional state).
ACCEPTED = Delivery.ACCEPTED
REJECTED = Delivery.REJECTED
RELEASED = Delivery.RELEASED
MODIFIED = Delivery.MODIFIED
TRANSACTIONAL_STATE = 0x34
TRANSFER_LIMIT = "amqp:link:transfer-limit-exceeded"   # AMQP 1.0 §2.8.16

_consumer_ids = iter(range(1, 1 << 62))
_pack_tag = struct.Struct(">Q").pack_into
_REMOTE_CLOSED = lib.PN_REMOTE_CLOSED
# How long the deliveries of an ended consumer link wait for a late disposition
# (Qpid JMS sends one round trip after the broker's detach); then they are settled.
LATE_OUTCOME_WINDOW = 5.0


class LinkConsumer(BoundedOutput):
    """A sending link on a queue: implements core.queues.ConsumerPort."""

    standby = False   # a second choice of its queue (attach.py `asks_standby`)

    def __init__(self, handler: "ConsumerOwner", link: Link, queue: Queue, *,
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
        self._budget = 0               # what it may hand the engine before it looks again (BoundedOutput)
        self._waiting_output = False

    # --- ConsumerPort

    def credit(self) -> int:
        """How many deliveries may go now (ConsumerPort): each uses exactly one, so a
        queue may read this once for a run of entries.  None while the socket is
        paused, or while the connection's output waits for a store commit
        (AmqpProtocol.hold_for_store): deliveries handed over then would only pile up
        in the engine, and each may ask for a newer batch, so the output could stay
        held for as long as the backlog lasts (settled transfers: nothing else bounds
        them).  The queue is dispatched again when the output is released.  None
        either while the engine holds as much of this link or its session unsent as
        it may (BoundedOutput: a peer whose session window stays closed)."""
        protocol = self.handler.protocol
        if self.closed or not self.ready or protocol.write_paused or protocol.hold.held:
            return 0
        room = self.max_unsettled - len(self.unsettled)
        if room <= 0:
            return 0   # credit is a permission, not a duty (AMQP 1.0 §2.6.7): memory is bounded
        if self._budget <= 0 and not self.engine_room():
            return 0
        credit = link_credit(self.impl, self._tag)
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
        size = len(payload)
        lib.pn_link_send(impl, ffi.from_buffer(payload), size)
        lib.pn_link_advance(impl)
        self._budget -= size + DELIVERY_COST   # core/outbound.py cost(), inline
        return dlv

    def next_tag(self) -> Any:
        """The tag of a delivery another sender puts on this link (a partitioned
        destination's other members, cluster/fanin.py): from the same counter, so
        tags stay unique on the link and `_tag` counts every transfer on it."""
        self._tag += 1
        _pack_tag(self._tag_buf, 0, self._tag)
        return self._tag_t[0]

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

    def output_moved(self) -> None:
        """The connection's output moved while the link waited on the engine: go on."""
        self._waiting_output = False
        if not self.closed:
            self.queue.dispatch()

    def on_flow(self) -> None:
        self.queue.dispatch()
        impl = self.impl
        if lib.pn_link_get_drain(impl) and link_credit(impl, self._tag) > 0:
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


CREDIT_CAP = (1 << 31) - 1   # the most one pn_link_flow may grant (a C int)


def link_credit(impl: Any, sent: int | None = None) -> int:
    """A sending link's credit.  The peer grants up to 2^32 - 1 (AMQP 1.0 §2.7.4
    link-credit is a uint); proton keeps it unsigned but hands it out as a C int,
    so a grant of 2^31 or more would read as negative, and never be served.

    A negative value is also what a receiver that lowered its credit leaves: its
    flow counted fewer transfers than were on their way (AMQP 1.0 §2.6.7 lets it
    change link-credit at any time; python-qpid-proton's BlockingReceiver does), so
    the sender is overdrawn and may send nothing.  Told how many transfers went on
    the link (`sent`), a deficit no larger than that is such an overdraft: 0 (read
    as a huge grant, the link would be sent far more than the peer asked for, and a
    grant passed on to another link would not fit in a C int)."""
    credit = lib.pn_link_credit(impl)
    if credit >= 0:
        return credit
    if sent is not None and -credit <= sent:
        return 0
    return credit & 0xFFFFFFFF


def flow_up_to(impl: Any, want: int) -> bool:
    """Grant a receiving link what it needs to hold `want` credit (capped at
    CREDIT_CAP: another link's credit passed on); True when a flow was made."""
    have = lib.pn_link_credit(impl)
    want = want if want < CREDIT_CAP else CREDIT_CAP
    if want <= have:
        return False
    lib.pn_link_flow(impl, want - have)
    return True


def link_key(link: Link) -> Any:
    """A stable key for a proton link (Python wrappers are recreated per event): its
    raw pn_link_t*, equal to the pointer a raw event carries (cffi pointers hash
    and compare by address)."""
    return link._impl


def session_key(session: Any) -> int:
    """The owner key of a session's non-durable nodes (expiry policy session-end)."""
    return hash(session)
