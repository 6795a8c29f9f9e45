"""Partitioned destinations: one queue or topic spread over K members, each a normal
destination (`orders.p0` …, `amq.topic/prices.p0` …) owned by a different node
(core/placement.py `Partitioned`, `[[cluster.partitioned]]`).

* A producer's message goes to exactly one member: by its JMSXGroupID (properties
  group-id) when it has one, so a group stays on one member; else to the member the
  producer's link was given when it attached (sticky), so a producer's order holds.
  The client's deliveries are settled in the order they came, each with its member's
  outcome (Accepted only once that member's node has committed it).
* A consumer link is fed from every member (fan-in): it is attached, under the
  client's link name and terms, on each member, so a durable or shared subscription
  exists on every member, and consumers of one shared subscription attached at any
  nodes share each member's messages: one copy per subscription.

Ordering guarantees: per member (and so per group, and per producer link without a
group); none across members.

A producer attached at a node that owns a member sticks to that member (`own_member`):
it is a producer of this node, attached in-process (server/ports.py `AttachHere`), and
only a message whose group belongs to another node's member goes over an inter-node
connection (Router.partition_target, as the anonymous relay sends it).  Elsewhere the
producer is a `PartitionedProducer` (sticky to a member chosen at random).  A consumer
at a node that owns a member takes that member in-process and first
(cluster/fanin.py `LocalFirstFanIn`); elsewhere it is a `FanInConsumer`, fed from
every member through connections to their nodes.
"""

from __future__ import annotations

import logging
import random
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Any

from cproton import ffi, lib
from proton import Condition, Link

from ..core.message import MalformedMessage, Message
from ..core.placement import UNAVAILABLE, Partitioned
from ..core.settlement import LinkEnding
from ..server.attach import CREATED, STANDBY
from ..server.refusal import detach_with_condition
from ..server.links import LATE_OUTCOME_WINDOW, flow_up_to, link_credit
from ..server.peer_fields import link_property
from .deliveries import RELEASED, Tags, copy_outcome, is_null
from .relay import RelayLink
from .sends import Outgoing, write_state
from .txn import TRANSACTIONAL_STATE, route_transactional_ack

log = logging.getLogger("amqpbroker.cluster")

WINDOW = 1000   # credit a partitioned producer gets (topped up as outcomes come back)


def member_of(group: str | None, sticky: int, count: int) -> int:
    """The member a message goes to: its group's, else the link's own."""
    if group is None:
        return sticky
    return zlib.crc32(group.encode("utf-8", "surrogatepass")) % count


@dataclass(frozen=True)
class MemberRoute:
    """A producer's partitioned destination with a member on this node: the members,
    and this node's own, the producer's sticky one (Router.partition_target)."""

    members: tuple[tuple[str, str], ...]   # (member address, node) each
    sticky: int

    @property
    def address(self) -> str:
        return self.members[self.sticky][0]


def own_member(members: tuple[tuple[str, str], ...], node: str) -> MemberRoute | None:
    """The route of a producer attached at `node`: its messages without a group go to
    the node's own member (a node has one at most: core/placement.py partition_members,
    cluster/options.py check_partitioned), so they are routed in this process, never
    through an inter-node connection; None: `node` has no member."""
    for i, (_, owner) in enumerate(members):
        if owner == node:
            return MemberRoute(members, i)
    return None


class Unplaced(Exception):
    """A message that can go to no node (core/placement.py `Refuse`)."""

    def __init__(self, condition: str, description: str):
        super().__init__(description)
        self.condition = condition
        self.description = description


class PartitionedProducer:
    """A client producer link on a partitioned destination (and the base of the
    keyless exchange producer, cluster/keyless.py: `choose` says where each message
    goes).  One sender per (target address, node) on the client connection's
    connection to that node."""

    forwarded = True

    def __init__(self, side: Any, handler: Any, link: Link, placed: Partitioned | None):
        self.side = side
        self.handler = handler
        self.protocol = handler.protocol
        self.link = link
        self.impl = link._impl
        self.client_session = lib.pn_link_session(self.impl)
        self.members = placed.members if placed is not None else ()
        self.sticky = random.randrange(len(self.members)) if self.members else 0
        self.senders: dict[tuple[str, str], RelayLink] = {}   # (target address, node) → its link
        self.in_order: deque[list] = deque()
        self.max_message_size = handler.server.settings.limits.max_message_size
        self.gone = False
        link.source.copy(link.remote_source)
        link.target.copy(link.remote_target)
        link.snd_settle_mode = link.remote_snd_settle_mode
        link.rcv_settle_mode = link.remote_rcv_settle_mode
        link.open()
        lib.pn_link_flow(self.impl, WINDOW)
        self.protocol.mark_dirty()

    def _sender(self, address: str, node: str) -> RelayLink:
        sender = self.senders.get((address, node))
        if sender is None or sender.peer.closed:
            sender = self.senders[(address, node)] = RelayLink(self.side, self.handler, self.client_session,
                                                               self.side.peer(node), target=address)
        return sender

    def choose(self, msg: Message) -> tuple[str, str]:
        """(target address, node) of one message: its group's member, else the link's.
        Raises Unplaced when it can go nowhere."""
        return self.members[member_of(msg.group_id(), self.sticky, len(self.members))]

    def on_delivery(self, cdlv: Any) -> None:
        if lib.pn_delivery_aborted(cdlv):
            lib.pn_delivery_settle(cdlv)
            return
        pending = lib.pn_delivery_pending(cdlv)
        if pending > self.max_message_size:
            lib.pn_delivery_settle(cdlv)
            self.link.condition = Condition("amqp:link:message-size-exceeded", f"message exceeds the maximum "
                                            f"message size of {self.max_message_size} bytes")
            self.detached(True)
            return
        if lib.pn_delivery_partial(cdlv):
            return
        buf = bytearray(pending)
        lib.pn_link_recv(self.impl, ffi.from_buffer(buf), pending)
        lib.pn_link_advance(self.impl)
        slot = None if lib.pn_delivery_settled(cdlv) else self.settle_in_order(cdlv)
        try:
            address, node = self.choose(Message(bytes(buf)))
        except MalformedMessage as exc:
            self._refused(slot, cdlv, "amqp:decode-error", str(exc))
            return
        except Unplaced as exc:
            log.warning("connection %s: message on link '%s' rejected: %s: %s", self.protocol.peer,
                        self.link.name, exc.condition, exc.description)
            self._refused(slot, cdlv, exc.condition, exc.description)
            return
        self._sender(address, node).pass_on(Outgoing(cdlv, buf, (self, slot)), address)
        self._top_up()

    def _refused(self, slot: list | None, cdlv: Any, condition: str, description: str) -> None:
        if slot is None:
            lib.pn_delivery_settle(cdlv)
            return
        slot[1], slot[2], slot[3] = lib.PN_REJECTED, Condition(condition, description), True
        self.drain_settlements()

    def settle_in_order(self, cdlv: Any) -> list:
        slot = [cdlv, None, None, False, None]   # Producer.settle_in_order's shape (RelayLink fills it)
        self.in_order.append(slot)
        return slot

    def drain_settlements(self) -> None:
        q = self.in_order
        while q and q[0][3]:
            cdlv, state, cond, _, data = q.popleft()
            if not self.gone:
                write_state(cdlv, state or lib.PN_ACCEPTED, data, cond)
                lib.pn_delivery_settle(cdlv)
        self._top_up()
        self.protocol.mark_dirty()

    def _top_up(self) -> None:
        if self.gone or self.link.state & Link.LOCAL_CLOSED:
            return
        credit = lib.pn_link_credit(self.impl)
        if credit < WINDOW // 2 and len(self.in_order) < WINDOW:
            lib.pn_link_flow(self.impl, WINDOW - credit)
            self.protocol.mark_dirty()

    def on_flow(self) -> None:
        pass

    def detached(self, closed: bool) -> None:
        """The client detached: the member links go; outcomes still on their way are
        settled as they come (the session carries them)."""
        for sender in self.senders.values():
            if not sender.peer.closed and not (sender.mirror.state & Link.LOCAL_CLOSED):
                sender.mirror.close()
                sender.peer.mark_dirty()
        link = self.link
        if not link.state & Link.LOCAL_CLOSED:
            link.close() if closed else detach_with_condition(link)
        self.protocol.mark_dirty()

    def released(self, ending: LinkEnding) -> None:
        self.gone = True
        self.in_order.clear()


class MemberReceiver:
    """One member's link of a fan-in consumer (a PeerConnection link)."""

    def __init__(self, fanin: "FanInConsumer", address: str | None, peer: Any):
        self.fanin = fanin
        self.peer = peer
        link = fanin.link
        ssn = peer.session_for(fanin.client_session)
        m = ssn.receiver(link.name)
        m.source.copy(link.remote_source)
        if address is not None:   # None: the client's own source (a null-source lookup)
            m.source.address = address
        props = {CREATED: True}   # told when this attach creates the subscription there
        if fanin.standby_members:   # the member's own node's consumers first (server/attach.py)
            props[STANDBY] = True
        m.properties = props
        m.target.copy(link.remote_target)
        m.snd_settle_mode = link.remote_snd_settle_mode
        m.rcv_settle_mode = link.remote_rcv_settle_mode
        m.open()
        self.mirror, self.mimpl, self.mirror_session = m, m._impl, ssn
        self.attached = False
        self.created = False   # this attach created the durable subscription there
        self.withdrawn = False
        self.detached = False
        self.condition: Condition | None = None
        self.draining = False
        peer.links[m._impl] = self
        peer.mark_dirty()

    def on_peer_attach(self) -> None:
        if not is_null(self.mirror.remote_source):   # a null source: refused, the detach follows
            self.attached = True
            self.created = link_property(self.mirror, CREATED) is True
            self.fanin.member_ready()

    def withdraw(self) -> None:
        """The client's attach was refused by another member: what this attach created
        here goes (closed=true, an unsubscribe: the member's node keeps it when another
        consumer has attached to it meanwhile, `amqp:resource-locked`); anything else
        stays (closed=false, AMQP 1.0 §2.6.6)."""
        self.withdrawn = True
        m = self.mirror
        if not (self.detached or self.peer.closed or m.state & Link.LOCAL_CLOSED):
            m.close() if self.created else m.detach()
            self.peer.mark_dirty()

    def on_peer_detach(self, closed: bool, condition: Condition | None = None) -> None:
        m = self.mirror
        if not (m.state & Link.LOCAL_CLOSED):
            m.close() if closed else m.detach()
            self.peer.mark_dirty()
        self._ended(condition or m.remote_condition)

    def on_peer_lost(self, condition: Condition) -> None:
        self._ended(Condition(UNAVAILABLE, condition.description or f"node {self.peer.node} went away"))

    def _ended(self, condition: Condition | None) -> None:
        if self.detached:
            return
        self.detached, self.condition = True, condition
        self.draining = False
        self.peer.links.pop(self.mimpl, None)
        self.fanin.member_detached(self)

    def on_peer_delivery(self, mdlv: Any) -> None:
        if not lib.pn_delivery_readable(mdlv) or lib.pn_delivery_partial(mdlv):
            return
        pending = lib.pn_delivery_pending(mdlv)
        buf = bytearray(pending)
        lib.pn_link_recv(self.mimpl, ffi.from_buffer(buf), pending)
        lib.pn_link_advance(self.mimpl)
        self.fanin.arrived(self, mdlv, buf)

    def on_peer_flow(self) -> None:
        if self.draining and not lib.pn_link_draining(self.mimpl):
            self.draining = False
            lib.pn_link_set_drain(self.mimpl, False)
            self.fanin.member_drained()


class FanInConsumer:
    """A client consumer link on a partitioned destination: fed from every member."""

    forwarded = True
    standby_members = False   # (cluster/fanin.py: True, its node has a member of its own)

    def __init__(self, side: Any, handler: Any, link: Link, targets: tuple[tuple[str | None, str], ...],
                 start: bool = True):
        self.side = side
        self.handler = handler
        self.protocol = handler.protocol
        self.link = link
        self.impl = link._impl
        self.client_session = lib.pn_link_session(self.impl)
        self.targets = targets         # (member address, node) each
        self.state = "attaching"       # → open → detaching → done; or → withdrawing → done
        self.refusal: Condition | None = None   # the member's refusal the client is answered with
        self.client_closed = False
        self.gone = False
        self.tags = Tags()
        self.unsettled: dict[Any, tuple[MemberReceiver, Any]] = {}
        self.waiting: deque[tuple[MemberReceiver, Any, bytearray]] = deque()
        self.draining = False
        self.late_timer: Any = None
        self.members: list[MemberReceiver] = []
        # The client's later frames wait until its attach is answered (ClientSide.hold).
        self.held = True
        side.hold()
        if start:
            self.start()

    def attach_answered(self) -> None:
        if self.held:
            self.held = False
            self.side.unhold()

    # --- attach

    @property
    def client_gone(self) -> bool:
        return self.gone

    def start(self) -> None:
        """Attach on every member (after cluster/guard.py's checks, when there are some)."""
        self.members = [MemberReceiver(self, address, self.side.peer(node)) for address, node in self.targets]

    def refuse_client(self, cond: Condition | None) -> None:
        """The client's attach refused (null source + detach with `cond`)."""
        if self.handler.endpoints.pop(self.impl, None) is not None:
            self.handler.links -= 1
        cond = cond or Condition("amqp:not-found", "refused by a member's node")
        self.handler.refuse(self.link, cond.name, cond.description or "refused by a member's node")
        self.protocol.mark_dirty()
        self.state = "done"
        self.attach_answered()

    def member_ready(self) -> None:
        if self.state == "withdrawing":
            self._withdraw()
        elif self.state == "attaching" and all(m.attached for m in self.members):
            self.all_attached()

    def all_attached(self) -> None:
        link, first = self.link, self.members[0].mirror
        address = link.remote_source.address
        link.source.copy(first.remote_source)
        link.source.address = address   # the destination the client named, not a member
        link.target.copy(link.remote_target)
        link.snd_settle_mode = first.remote_snd_settle_mode
        link.rcv_settle_mode = first.remote_rcv_settle_mode
        link.open()
        self.state = "open"
        self.attach_answered()
        self.on_flow()
        self.protocol.mark_dirty()

    def member_detached(self, member: MemberReceiver) -> None:
        if self.gone:
            return
        if self.state == "attaching":        # refused by a member: by all, for the client
            self.refuse_after_withdrawing(member.condition)
        elif self.state == "withdrawing":
            self._withdraw()
        elif self.state == "open":           # a member's node ended it: the link ends
            self._detach_members(False)
            self._answer(False, member.condition)
            self.state = "peer-detached"
        elif self.state == "detaching" and all(m.detached for m in self.members):
            cond = next((m.condition for m in self.members if m.condition is not None), None)
            self._answer(self.client_closed, cond)
            self._done()

    def refuse_after_withdrawing(self, cond: Condition | None) -> None:
        """The attach is refused for the client; first each member that accepted it
        takes it back (MemberReceiver.withdraw).  Only what this attach created goes:
        a close of a durable subscription's link is an unsubscribe, and closing
        every accepted link deleted existing subscriptions, backlog and all (a refusal
        while one member's node is down is routine).  The client is answered once no
        member's answer is still awaited, so that one that has not answered yet is
        withdrawn by what it answers: detached at once, it would keep a subscription
        it created for an attach nobody holds."""
        self.state, self.refusal = "withdrawing", cond
        self._withdraw()

    def _withdraw(self) -> None:
        for m in self.members:
            if m.attached and not m.withdrawn:
                m.withdraw()
        if self.state == "withdrawing" and all(m.attached or m.detached for m in self.members):
            self.refuse_client(self.refusal)   # (a client gone meanwhile: `released` ended this)

    def _detach_members(self, closed: bool) -> None:
        for m in self.members:
            if not m.detached and not m.peer.closed and not (m.mirror.state & Link.LOCAL_CLOSED):
                m.mirror.close() if closed else m.mirror.detach()
                m.peer.mark_dirty()

    def _answer(self, closed: bool, cond: Condition | None) -> None:
        link = self.link
        if self.gone or link.state & Link.LOCAL_CLOSED:
            return
        if cond is not None:
            link.condition = cond
        link.close() if closed else detach_with_condition(link)
        self.protocol.mark_dirty()

    # --- credit and drain

    def credit(self) -> int:
        """The client link's credit (an overdraft: 0; server/links.py link_credit)."""
        return link_credit(self.impl, self.sent())

    def sent(self) -> int:
        """Transfers sent on the client's link so far."""
        return self.tags.n

    def next_tag(self) -> Any:
        return self.tags.next()

    def on_flow(self) -> None:
        if self.waiting:
            self._send_waiting()
        if self.state != "open":
            return
        want = self.credit() - len(self.waiting)
        for m in self.members:
            if not (m.detached or m.peer.closed):
                flow_up_to(m.mimpl, want)
                m.peer.mark_dirty()
        if lib.pn_link_get_drain(self.impl) and not self.draining:
            self.drain_members()

    def drain_members(self) -> None:
        """The client asked for a drain: every member's link is drained, and the
        client's answered once each of them has been (member_drained)."""
        for m in self.members:
            if not (m.detached or m.peer.closed):
                lib.pn_link_drain(m.mimpl, 0)
                m.draining = bool(lib.pn_link_draining(m.mimpl))
                m.peer.mark_dirty()
        self.draining = True
        self.member_drained()

    def member_drained(self) -> None:
        """AMQP 1.0 §2.6.7: the client's drain is answered once every member's is."""
        if self.draining and not any(m.draining for m in self.members) and not self.waiting:
            self.draining = False
            if not self.gone:
                lib.pn_link_drained(self.impl)
                self.protocol.mark_dirty()

    # --- transfers members → client

    def arrived(self, member: MemberReceiver, mdlv: Any, buf: bytearray) -> None:
        if self.gone or self.state != "open":
            lib.pn_delivery_update(mdlv, RELEASED)   # nobody to give it to: the member keeps it
            lib.pn_delivery_settle(mdlv)
            member.peer.mark_dirty()
            return
        if self.waiting or self.credit() <= 0:
            self.waiting.append((member, mdlv, buf))
            return
        self._send(member, mdlv, buf)

    def _send(self, member: MemberReceiver, mdlv: Any, buf: bytearray) -> None:
        impl = self.impl
        cdlv = lib.pn_delivery(impl, self.next_tag())
        lib.pn_link_send(impl, ffi.from_buffer(buf), len(buf))
        lib.pn_link_advance(impl)
        if lib.pn_delivery_settled(mdlv):
            lib.pn_delivery_settle(cdlv)
            lib.pn_delivery_settle(mdlv)
        else:
            self.unsettled[cdlv] = (member, mdlv)
        self.protocol.mark_dirty()

    def _send_waiting(self) -> None:
        while self.waiting and self.credit() > 0:
            self._send(*self.waiting.popleft())
        if not self.waiting:
            self.member_drained()

    # --- dispositions client → members

    def on_delivery(self, cdlv: Any) -> None:
        settled = lib.pn_delivery_settled(cdlv)
        if not (settled or lib.pn_delivery_updated(cdlv)):
            return
        found = self.unsettled.pop(cdlv, None) if settled else self.unsettled.get(cdlv)
        if found is None:
            lib.pn_delivery_settle(cdlv)
            return
        member, mdlv = found
        if member.peer.closed:
            lib.pn_delivery_settle(cdlv)
            return
        if lib.pn_delivery_remote_state(cdlv) == TRANSACTIONAL_STATE:
            self._transactional_ack(cdlv, member, mdlv, settled)
            return
        copy_outcome(cdlv, mdlv)
        if settled:
            lib.pn_delivery_settle(mdlv)
            lib.pn_delivery_settle(cdlv)
        member.peer.mark_dirty()
        if self.late_timer is not None and not self.unsettled:
            self._forget_late()

    def _transactional_ack(self, cdlv: Any, member: MemberReceiver, mdlv: Any, settled: bool) -> None:
        route_transactional_ack(self.handler, cdlv, mdlv, settled, member.peer, member.mirror.source.address)

    def late(self, cdlv: Any) -> None:
        self.on_delivery(cdlv)

    # --- detach

    def detached(self, closed: bool) -> None:
        if self.state == "peer-detached":
            self._done()
            return
        if self.state in ("done", "detaching"):
            return
        self.client_closed = closed
        self.state = "detaching"
        self._detach_members(closed)
        if all(m.detached for m in self.members):
            self._answer(closed, None)
            self._done()

    def _done(self) -> None:
        self.state = "done"
        for member, mdlv, _ in self.waiting:   # never reached the client: back at the member
            if not member.peer.closed:
                lib.pn_delivery_update(mdlv, RELEASED)
                lib.pn_delivery_settle(mdlv)
                member.peer.mark_dirty()
        self.waiting.clear()
        if self.unsettled and not self.gone:
            self.side.late[self.impl] = self
            self.late_timer = self.protocol.loop.call_later(LATE_OUTCOME_WINDOW, self._forget_late)

    def _forget_late(self) -> None:
        if self.late_timer is not None:
            self.late_timer.cancel()
            self.late_timer = None
        self.side.late.pop(self.impl, None)
        if not self.gone:
            for cdlv in self.unsettled:
                lib.pn_delivery_settle(cdlv)
        self.unsettled = {}

    def released(self, ending: LinkEnding) -> None:
        self.gone = True
        self.attach_answered()
        if self.late_timer is not None:
            self.late_timer.cancel()
            self.late_timer = None
        self.side.late.pop(self.impl, None)
        self.unsettled = {}
        self.waiting.clear()
        self.state = "done"
