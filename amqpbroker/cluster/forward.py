"""Forwarded links: a client link whose address another node owns is opened, under the
same name and terms, on that node, and everything on it is passed both ways:

    client ─ link ─▶ this node (edge) ─ mirror link on a PeerConnection ─▶ owner

* attach: the same name, source and target (address, capabilities, filters,
  durability, expiry, dynamic flags), settle modes, link properties and
  max-message-size; the client's attach is answered with the owner's reply, a
  refusal (null terminus + detach with its error) included;
* transfers as raw bytes, never decoded or re-encoded;
* credit: a consumer's credit is granted at the owner (drain included: the client's
  drain is answered once the owner has answered it); a producer gets the credit the
  owner gives the edge, so the owner's flow control reaches the client;
* dispositions both ways; a producer's transfer is settled with the owner's outcome,
  so Accepted still means committed on the owner (accept-after-commit end to end);
* detach both ways, with the owner's error (unsubscribe's `amqp:resource-locked`).

The decision where a link goes is core/placement.py's; server/ reaches this room only
through server/ports.py (`BrokerServer.cluster`).
"""

from __future__ import annotations

import logging
from typing import Any

from cproton import ffi, lib
from proton import Condition, Link

from ..core.placement import UNAVAILABLE
from ..core.settlement import LinkEnding
from ..server.refusal import detach_with_condition
from ..server.links import LATE_OUTCOME_WINDOW, flow_up_to, link_credit
from .deliveries import REJECTED, RELEASED, Tags, copy_outcome, is_null
from .sends import OrderedSender, Outgoing, owner_state, write_state
from .txn import TRANSACTIONAL_STATE, route_transactional_ack

log = logging.getLogger("amqpbroker.cluster")

class ForwardedLink:
    """The common part of a forwarded consumer and producer: attach and detach."""

    forwarded = True
    consumer = False

    def __init__(self, side: Any, handler: Any, link: Link, peer: Any, candidates: tuple[str, ...] = ()):
        self.side = side
        self.handler = handler
        self.protocol = handler.protocol
        self.link = link
        self.impl = link._impl
        self.client_session = lib.pn_link_session(self.impl)
        self.peer = peer
        self.mirror: Link | None = None
        self.mimpl: Any = None
        self.mirror_session: Any = None
        # attaching → open → (detaching | peer-detached) → done
        self.state = "attaching"
        self.client_closed = False
        self.client_gone = False      # the client's session or connection ended
        self.candidates = list(candidates)   # further nodes to ask (null-source lookups)
        self.tags = Tags()
        self.max_message_size = handler.server.settings.limits.max_message_size
        self.finished = False
        self.free_client = False     # both ends of the client link detached: free it when done
        # The client's later frames wait until its attach is answered (ClientSide.hold).
        self.held = True
        side.hold()

    def attach_answered(self) -> None:
        """The client's attach is answered (or moot): its later frames may go on."""
        if self.held:
            self.held = False
            self.side.unhold()

    # ------------------------------------------------------------------ attach

    def start(self) -> None:
        link = self.link
        ssn = self.peer.session_for(self.client_session)
        m = ssn.receiver(link.name) if self.consumer else ssn.sender(link.name)
        m.source.copy(link.remote_source)
        m.target.copy(link.remote_target)
        m.snd_settle_mode = link.remote_snd_settle_mode
        m.rcv_settle_mode = link.remote_rcv_settle_mode
        size = lib.pn_link_remote_max_message_size(self.impl)
        if size:
            lib.pn_link_set_max_message_size(m._impl, size)
        props = lib.pn_link_remote_properties(self.impl)
        if props != ffi.NULL:   # NULL: the client sent none
            lib.pn_data_copy(lib.pn_link_properties(m._impl), props)
        m.open()
        self.mirror, self.mimpl, self.mirror_session = m, m._impl, ssn
        self.peer.links[m._impl] = self
        self.peer.mark_dirty()

    def on_peer_attach(self) -> None:
        m = self.mirror
        refused = is_null(m.remote_source if self.consumer else m.remote_target)
        if refused or self.state != "attaching":
            return   # a refusal: its detach (with the error) follows
        link = self.link
        if self.client_gone:
            return
        if self.consumer:
            link.source.copy(m.remote_source)
            link.target.copy(link.remote_target)
        else:
            link.source.copy(link.remote_source)
            link.target.copy(m.remote_target)
        link.snd_settle_mode = m.remote_snd_settle_mode
        link.rcv_settle_mode = m.remote_rcv_settle_mode
        link.open()
        self.state = "open"
        self.opened()
        self.attach_answered()
        self.protocol.mark_dirty()

    def opened(self) -> None:
        """The owner accepted the link (credit may move now)."""

    # ------------------------------------------------------------------ detach

    def on_peer_detach(self, closed: bool, condition: Condition | None = None) -> None:
        """The owner detached (or ended the session of) our link."""
        m = self.mirror
        cond = condition if condition is not None else m.remote_condition
        state = self.state
        if not (m.state & Link.LOCAL_CLOSED):
            if closed:
                m.close()
            else:
                m.detach()
        if self.client_gone:
            self._finish()
            return
        if state == "attaching":
            if self.candidates and cond is not None and cond.name == "amqp:not-found":
                self._try_next()
                return
            self.refuse_client(cond)
            return
        if state == "detaching":   # the answer to the client's detach
            self._answer_client(self.client_closed, cond)
            self.state = "done"
            self.answered()
            return
        if state == "open":        # the owner ended it (stolen, deleted, unauthorized ...)
            self._answer_client(closed, cond)
            self.state = "peer-detached"

    def _try_next(self) -> None:
        """A null-source lookup the node did not know: ask the next one."""
        self.peer.links.pop(self.mimpl, None)
        self.peer.free_after_output.append(self.mimpl)
        self.peer.mark_dirty()
        self.peer = self.side.peer(self.candidates.pop(0))
        self.start()

    def refuse_client(self, cond: Condition | None) -> None:
        name = cond.name if cond is not None else "amqp:not-found"
        desc = (cond.description if cond is not None else None) or "refused by the owning node"
        h = self.handler
        if h.endpoints.pop(self.impl, None) is not None:
            h.links -= 1
        h.refuse(self.link, name, desc)
        self.protocol.mark_dirty()
        self.state = "done"
        self.attach_answered()
        self._finish()

    def _answer_client(self, closed: bool, cond: Condition | None) -> None:
        link = self.link
        if link.state & Link.LOCAL_CLOSED or self.client_gone:
            return
        if link.state & Link.LOCAL_UNINIT:   # the client detached before the owner answered
            link.source.copy(link.remote_source)
            link.target.copy(link.remote_target)
            link.open()
        if cond is not None:
            link.condition = cond
        if closed:
            link.close()
        else:
            detach_with_condition(link)
        self.protocol.mark_dirty()

    def detached(self, closed: bool) -> None:
        """The client detached: detach at the owner; answer the client when it answers."""
        if self.state == "peer-detached":     # the client's answer to the owner's detach
            self.state = "done"
            self.answered()
            return
        if self.state in ("done", "detaching"):
            return
        self.client_closed = closed
        self.state = "detaching"
        m = self.mirror
        if self.peer.closed or m is None:   # (m None: still asking other nodes, cluster/guard.py)
            self._answer_client(closed, None)
            self.state = "done"
            self.answered()
            return
        if not (m.state & Link.LOCAL_CLOSED):
            if closed:
                m.close()
            else:
                m.detach()
            self.peer.mark_dirty()

    def answered(self) -> None:
        """Both ends of the client link have detached."""
        self.free_client = True
        self._finish()

    def released(self, ending: LinkEnding) -> None:
        """The client's session or connection ended: the client link is gone (the
        session or connection hook ends ours the same way)."""
        self.client_gone = True
        self.state = "done"
        self.attach_answered()
        self._finish()

    def on_peer_lost(self, condition: Condition) -> None:
        """The connection to the owner went: the client link ends with the reason."""
        if self.client_gone or self.state == "done":
            self.client_gone = True
            self._finish()
            return
        cond = Condition(UNAVAILABLE, condition.description or "the owning node is not available")
        if self.state == "attaching":
            self.refuse_client(cond)
            return
        if self.state == "detaching":
            self._answer_client(self.client_closed, None)
            self.state = "done"
        else:
            # Closed, not just detached: this node can never resume the link (its owner
            # side is gone with the connection), and a detach that does not close reads
            # to a client as "suspended" (AMQP 1.0 §2.6.6): proton's blocking clients
            # then wait forever.  As when the broker ends a link itself (an ACL
            # reload), the close ends the link, not a durable subscription at the owner:
            # the client's closing answer is not forwarded anywhere.
            self._answer_client(True, cond)
            self.state = "peer-detached"
        self.peer_gone()

    def peer_gone(self) -> None:
        """Deliveries waiting on the owner will never be answered."""

    def busy(self) -> bool:
        """Deliveries still waiting for an answer from one side or the other."""
        return False

    def _finish(self) -> None:
        """Forget and free the link once both sides are done with it (a connection
        whose application opens and closes links per unit of work stays flat)."""
        if self.state != "done" or self.busy() or self.finished:
            return
        self.finished = True
        peer = self.peer
        if peer.links.get(self.mimpl) is self:
            del peer.links[self.mimpl]
        m = self.mirror
        if m is not None and not peer.closed and m.state & Link.LOCAL_CLOSED and m.state & Link.REMOTE_CLOSED:
            peer.free_after_output.append(self.mimpl)
            peer.mark_dirty()
        if self.free_client and not self.client_gone and not self.handler.ended:
            self.handler.free_after_output.append(self.link)
            self.protocol.mark_dirty()

    # ------------------------------------------------------------------ per-link events

    def on_delivery(self, dlv: Any) -> None:   # pragma: no cover - overridden
        raise NotImplementedError

    def on_flow(self) -> None:
        pass

    def on_peer_delivery(self, dlv: Any) -> None:   # pragma: no cover - overridden
        raise NotImplementedError

    def on_peer_flow(self) -> None:
        pass


class ForwardedConsumer(ForwardedLink):
    """The broker sends to the client: the owner sends to us."""

    consumer = True

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.unsettled: dict[Any, Any] = {}   # client pn_delivery_t* → owner's pn_delivery_t*
        self.waiting: list[tuple[Any, bytes]] = []   # owner's transfers beyond the client's credit
        self.draining = False
        self.late_timer: Any = None

    def start(self) -> None:
        super().start()
        if link_credit(self.impl) or lib.pn_link_get_drain(self.impl):
            self.on_flow()   # granted while other nodes were asked (cluster/guard.py)

    # --- credit

    def on_flow(self) -> None:
        """The client's flow: grant the owner what the client grants us."""
        if self.waiting:
            self._send_waiting()
        if self.mimpl is None or self.peer.closed:
            return
        impl, m = self.impl, self.mimpl
        flow_up_to(m, link_credit(impl, self.tags.n) - len(self.waiting))
        if lib.pn_link_get_drain(impl) and not self.draining:
            # AMQP 1.0 §2.6.7: answered once the owner has drained (or at once when
            # nothing is granted there any more).
            self.draining = True
            lib.pn_link_drain(m, 0)
            if not lib.pn_link_draining(m):
                self.on_peer_flow()
        self.peer.mark_dirty()

    def on_peer_flow(self) -> None:
        """The owner answered a drain (its credit is used up): answer the client's."""
        if self.draining and not lib.pn_link_draining(self.mimpl):
            self.draining = False
            lib.pn_link_set_drain(self.mimpl, False)
            if not self.client_gone and not self.waiting:
                lib.pn_link_drained(self.impl)
                self.protocol.mark_dirty()

    # --- transfers owner → client

    def on_peer_delivery(self, mdlv: Any) -> None:
        if not lib.pn_delivery_readable(mdlv) or lib.pn_delivery_partial(mdlv):
            return   # an update of a delivery already passed on, or not complete yet
        pending = lib.pn_delivery_pending(mdlv)
        buf = bytearray(pending)
        lib.pn_link_recv(self.mimpl, ffi.from_buffer(buf), pending)
        lib.pn_link_advance(self.mimpl)
        if self.client_gone or self.state not in ("open", "attaching"):
            lib.pn_delivery_update(mdlv, RELEASED)   # nobody to give it to: the owner keeps it
            lib.pn_delivery_settle(mdlv)
            return
        if self.waiting or link_credit(self.impl, self.tags.n) <= 0:
            self.waiting.append((mdlv, buf))
            return
        self._send(mdlv, buf)

    def _send(self, mdlv: Any, buf: bytearray) -> None:
        impl = self.impl
        cdlv = lib.pn_delivery(impl, self.tags.next())
        lib.pn_link_send(impl, ffi.from_buffer(buf), len(buf))
        lib.pn_link_advance(impl)
        if lib.pn_delivery_settled(mdlv):   # sent settled by the owner (snd-settle-mode settled)
            lib.pn_delivery_settle(cdlv)
            lib.pn_delivery_settle(mdlv)
        else:
            self.unsettled[cdlv] = mdlv
        self.protocol.mark_dirty()

    def _send_waiting(self) -> None:
        while self.waiting and link_credit(self.impl, self.tags.n) > 0:
            self._send(*self.waiting.pop(0))
        if not self.waiting and self.draining and not lib.pn_link_draining(self.mimpl):
            self.on_peer_flow()

    # --- dispositions client → owner

    def on_delivery(self, cdlv: Any) -> None:
        settled = lib.pn_delivery_settled(cdlv)
        if not (settled or lib.pn_delivery_updated(cdlv)):
            return
        mdlv = self.unsettled.pop(cdlv, None) if settled else self.unsettled.get(cdlv)
        if mdlv is None:
            lib.pn_delivery_settle(cdlv)
            return
        if lib.pn_delivery_remote_state(cdlv) == TRANSACTIONAL_STATE:
            self._transactional_ack(cdlv, mdlv, settled)
            return
        self._pass_outcome(cdlv, mdlv, settled)

    def _transactional_ack(self, cdlv: Any, mdlv: Any, settled: bool) -> None:
        """An acknowledgement inside a transaction (cluster/txn.py): passed on under
        the owner's txn-id; one that would span nodes gives the message back there
        (as the rollback that follows would)."""
        route_transactional_ack(self.handler, cdlv, mdlv, settled, self.peer,
                                self.link.remote_source.address or "")

    def _pass_outcome(self, cdlv: Any, mdlv: Any, settled: bool) -> None:
        if self.peer.closed:
            lib.pn_delivery_settle(cdlv)
            return
        copy_outcome(cdlv, mdlv)
        if settled:
            lib.pn_delivery_settle(mdlv)
            lib.pn_delivery_settle(cdlv)
        self.peer.mark_dirty()

    def late(self, cdlv: Any) -> None:
        """A disposition after the client's detach (Qpid JMS releases its prefetch
        then): passed on; the owner honours it as it would the client's own."""
        self.on_delivery(cdlv)
        if not self.unsettled:
            self._forget_late()

    # --- ending

    def busy(self) -> bool:
        return self.late_timer is not None

    def answered(self) -> None:
        for mdlv, _ in self.waiting:   # never reached the client: back at the owner
            lib.pn_delivery_update(mdlv, RELEASED)
            lib.pn_delivery_settle(mdlv)
        self.waiting = []
        self.peer.mark_dirty()
        if self.unsettled and not self.client_gone:
            # Dispositions may still come for them (they name delivery-ids on the
            # session): passed on for LATE_OUTCOME_WINDOW, as the owner waits for them.
            self.side.late[self.impl] = self
            self.late_timer = self.protocol.loop.call_later(LATE_OUTCOME_WINDOW, self._forget_late)
        super().answered()

    def _forget_late(self) -> None:
        if self.late_timer is not None:
            self.late_timer.cancel()
            self.late_timer = None
        self.side.late.pop(self.impl, None)
        if not self.client_gone:
            for cdlv in self.unsettled:
                lib.pn_delivery_settle(cdlv)
        self.unsettled = {}
        self._finish()

    def released(self, ending: LinkEnding) -> None:
        if self.late_timer is not None:
            self.late_timer.cancel()
            self.late_timer = None
        self.side.late.pop(self.impl, None)
        self.unsettled = {}
        self.waiting = []
        super().released(ending)

    def peer_gone(self) -> None:
        self.waiting = []
        # The owner's deliveries are gone with its connection: the client's copies
        # can only be settled here (the owner gives them to others again).
        for cdlv in self.unsettled:
            lib.pn_delivery_settle(cdlv)
        self.unsettled = {}


class ForwardedProducer(ForwardedLink, OrderedSender):
    """The client sends: we send to the owner and settle with its outcome."""

    consumer = False

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.init_sends()
        self.address = self.link.remote_target.address or ""

    def opened(self) -> None:
        self.on_peer_flow()

    def busy(self) -> bool:
        return bool(self.sent)

    def can_send(self) -> bool:
        return self.state == "open" and lib.pn_link_credit(self.mimpl) > 0

    # --- credit: the owner's, passed on

    def on_peer_flow(self) -> None:
        if self.client_gone or self.state != "open":
            return
        if self.queue:
            self.send_queued()
        if flow_up_to(self.impl, link_credit(self.mimpl) - len(self.queue)):
            self.protocol.mark_dirty()

    # --- transfers client → owner

    def on_delivery(self, cdlv: Any) -> None:
        if lib.pn_delivery_aborted(cdlv):
            lib.pn_delivery_settle(cdlv)
            return
        pending = lib.pn_delivery_pending(cdlv)
        if pending > self.max_message_size:
            self._too_large(cdlv)
            return
        if lib.pn_delivery_partial(cdlv):
            return
        buf = bytearray(pending)
        lib.pn_link_recv(self.impl, ffi.from_buffer(buf), pending)
        lib.pn_link_advance(self.impl)
        if self.peer.closed or self.state != "open":
            self._reject(cdlv, UNAVAILABLE, f"node {self.peer.node} is not available")
            return
        self.pass_on(Outgoing(cdlv, buf), self.address)

    def _reject(self, cdlv: Any, condition: str, description: str) -> None:
        if not lib.pn_delivery_settled(cdlv):
            write_state(cdlv, REJECTED, None, Condition(condition, description))
        lib.pn_delivery_settle(cdlv)
        self.protocol.mark_dirty()

    def _too_large(self, cdlv: Any) -> None:
        log.warning("connection %s: link '%s': message larger than %d bytes refused",
                    self.protocol.peer, self.link.name, self.max_message_size)
        lib.pn_delivery_settle(cdlv)
        self.link.condition = Condition(
            "amqp:link:message-size-exceeded",
            f"message exceeds the maximum message size of {self.max_message_size} bytes")
        self.link.close()
        self.detached(True)

    # --- outcomes owner → client (sends.py OrderedSender)

    def on_peer_delivery(self, mdlv: Any) -> None:
        self.outcome(mdlv)
        if not self.sent and self.state == "done":
            self._finish()   # the last outcome after the detach went out

    def answer(self, item: Outgoing, mdlv: Any, settled: bool) -> None:
        if self.client_gone:
            return
        if lib.pn_delivery_remote_state(mdlv) == TRANSACTIONAL_STATE:
            write_state(item.cdlv, *owner_state(item, mdlv))
        else:
            copy_outcome(mdlv, item.cdlv)
        if settled:
            lib.pn_delivery_settle(item.cdlv)
        self.protocol.mark_dirty()

    def refuse(self, item: Outgoing, condition: str, description: str) -> None:
        if not self.client_gone:
            self._reject(item.cdlv, condition, description)

    def presettled(self, item: Outgoing) -> None:
        lib.pn_delivery_settle(item.cdlv)

    # --- ending

    def released(self, ending: LinkEnding) -> None:
        self.sent = {}
        self.queue.clear()
        super().released(ending)

    def peer_gone(self) -> None:
        # Sent to the owner, never answered: the client's sends fail; it may resend
        # (at-least-once: the owner may have stored some).
        self.fail_all(UNAVAILABLE, f"node {self.peer.node} went away before answering")
