"""A consumer of a partitioned destination at a node that owns one of its members:
its own member served in this process, first; the other members through their
nodes (cluster/partitioned.py `FanInConsumer` is the consumer at a node with none).

Why: fed through the node's own inter-node listener, every message of the own member
was forwarded by the node to itself: the consumer's side of the protocol ran twice
(bench/cluster.py, "through the topic's one name": 10.4 + 10.6 µs of CPU per message
on the two nodes against 6.9 + 6.9 for clients naming the members).  Here the own
member's consumer is a plain `LinkConsumer` on the client's link (attached as alone,
server/attach.py `ConsumerAttacher.attach(link, address)`, the reply naming the
client's address), and the other members' deliveries are sent on the same link
with tags from the same counter (`LinkConsumer.next_tag`).

Credit, local first (the client's credit is one budget for every member):
* at each flow, what waits from other members goes first (it came earlier), then
  the own member's queue takes what it can, and each other member is given what
  credit is left;
* so that a member whose own node has no consumer is never starved by a busy own
  member, each other member keeps a share of each grant, about credit / (2 × members)
  (at least 1), whatever the own member took: those messages wait here when the
  client has no credit left, and go first at its next grant;
* a member's credit is topped up again as its deliveries arrive (to what the
  client's credit then leaves, or its share), so credit the own member no longer
  needs reaches the other members without waiting for the client's next flow.
The other members' own nodes hold back too: this consumer's links to them carry the
`amqpbroker:standby` property, so each member's queue offers it only what that
node's own consumers cannot take now (core/queues.py `_offer_first_choice`).  With a
consumer at every member's node, a message crosses between nodes only when it must.
Drain (AMQP 1.0 §2.6.7): the other members are drained, then the own member's
queue is given its turn, and the client's drain is answered with what is left.

Everything else is FanInConsumer's: the other members attach first (a refusal by one
refuses the client), then the own member; a member's node that ends its link ends
the client's; the client's detach is answered once every member's has been (and,
for an unsubscribe, once the own member's deletion is committed).
"""

from __future__ import annotations

import logging
from typing import Any

from cproton import lib
from proton import Condition, Link

from ..core.settlement import LinkEnding
from ..server.links import flow_up_to
from ..server.refusal import AttachRefused, check_access
from .partitioned import FanInConsumer, MemberReceiver

log = logging.getLogger("amqpbroker.cluster")


def member_share(credit: int, members: int) -> int:
    """What each other member keeps of a grant of `credit` whatever the own member
    takes (0 without credit: nothing is asked for that the client did not ask)."""
    if credit <= 0:
        return 0
    return max(1, credit // (2 * members))


class LocalFirstFanIn(FanInConsumer):
    """A client consumer link on a partitioned destination with a member here."""

    standby_members = True

    def __init__(self, side: Any, handler: Any, link: Link, members: tuple[tuple[str, str], ...],
                 own: int, start: bool = True):
        self.own = members[own][0]    # this node's member address
        self.local: Any = None        # its LinkConsumer, once attached
        self.share = 0                # what each other member keeps of the last grant
        self.count = len(members)
        self.answer: Condition | None = None   # the own member's detach answer
        self.committing = False       # an unsubscribe's deletion not on disk yet
        self.held_answer: tuple[bool, Condition | None] | None = None
        others = tuple(m for i, m in enumerate(members) if i != own)
        self.sent_before = 0          # transfers on the link when the own member's consumer ended
        super().__init__(side, handler, link, others, start=False)
        if start:
            self.start()

    # --- attach: the other members, then the own one

    def start(self) -> None:
        if self.targets:
            super().start()
        else:
            self._attach_local()

    def all_attached(self) -> None:
        self._attach_local()

    def _attach_local(self) -> None:
        h, link = self.handler, self.link
        try:
            check_access(h.server.access, h.protocol.user, link, h.container_id, self.own)
            h.server.steal_link(h, link)
            self.local = h.attacher.attach(link, self.own)
        except AttachRefused as refused:
            h.server.forget_link(h, link)
            # What the other members' attaches created there goes; nothing else
            # (FanInConsumer.refuse_after_withdrawing).
            self.refuse_after_withdrawing(Condition(refused.condition, refused.description))
            return
        self.state = "open"
        self.attach_answered()
        if self.local.ready:
            self.on_flow()
        else:   # a durable subscription: its attach reply waits for its commit (server/attach.py)
            h.server.store.after_commit(lambda err: self.on_flow())
        self.protocol.mark_dirty()

    # --- credit and drain

    def _open(self) -> bool:
        local = self.local
        return self.state == "open" and local is not None and local.ready and not local.closed

    def on_flow(self) -> None:
        if not self._open():
            return
        if self.waiting:
            self._send_waiting()
        impl = self.impl
        credit = self.credit() - len(self.waiting)
        self.share = member_share(credit, self.count)
        self.local.queue.dispatch()
        for m in self.members:
            self._top_up(m)
        if lib.pn_link_get_drain(impl) and not self.draining:
            self.drain_members()
        self.protocol.mark_dirty()

    @property
    def served_as(self) -> str | None:
        """The address a reload checks besides the one the client named, as the attach
        did (server/reload.py)."""
        return self.own if self.local is not None else None

    def sent(self) -> int:
        local = self.local
        return local._tag if local is not None else self.sent_before

    def next_tag(self) -> Any:
        """The own member's consumer's counter: one tag space, one count of transfers."""
        return self.local.next_tag()

    def _top_up(self, m: MemberReceiver, lazily: bool = False) -> None:
        """`lazily` (as its deliveries arrive): only once half of it is used, so that
        a member's node is not sent a flow frame per message."""
        if m.detached or m.peer.closed or m.draining:
            return
        waiting = len(self.waiting)
        want = max(self.credit() - waiting, self.share - waiting)
        if lazily and lib.pn_link_credit(m.mimpl) > want // 2:
            return
        if flow_up_to(m.mimpl, want):
            m.peer.mark_dirty()

    def member_drained(self) -> None:
        """The client's drain is answered once every other member's is, and the own
        member's queue has had its turn."""
        if self.draining and not any(m.draining for m in self.members) and not self.waiting:
            self.draining = False
            if not self.gone and self._open():
                self.local.queue.dispatch()
                lib.pn_link_drained(self.impl)
                self.protocol.mark_dirty()

    def arrived(self, member: MemberReceiver, mdlv: Any, buf: bytearray) -> None:
        if not self._open() and self.state == "open":   # the reply waits for a commit: so does this
            self.waiting.append((member, mdlv, buf))
            return
        super().arrived(member, mdlv, buf)
        if self.state == "open":
            self._top_up(member, lazily=True)

    # --- dispositions: the own member's go to its consumer

    def on_delivery(self, cdlv: Any) -> None:
        """Also late ones (`late`, after the client's detach)."""
        local = self.local
        if local is not None and (cdlv in local.unsettled or cdlv in local.browsed):
            local.on_delivery(cdlv)
        elif cdlv in self.unsettled or local is not None:
            super().on_delivery(cdlv)
        else:   # the own member's after it ended: its late outcomes (server/links.py EndedDeliveries)
            self.handler.ended_deliveries.on_delivery(cdlv)

    # --- detach

    def _end_local(self, closed: bool, ending: LinkEnding) -> None:
        local, self.local = self.local, None
        if local is None or local.closed:
            return
        self.sent_before = local._tag
        h = self.handler
        h.server.forget_link(h, self.link)
        self.answer = h.release_endpoint(local, closed=closed, ending=ending)
        sub = local.subscription
        if closed and sub is not None and sub.durable and h.server.store.persistent:
            # Unsubscribe: answered once the deletion is on disk (as alone).
            self.committing = True
            h.server.store.after_commit(lambda err: self._committed())

    def _committed(self) -> None:
        self.committing = False
        if self.held_answer is not None:
            closed, cond = self.held_answer
            self.held_answer = None
            self._answer(closed, cond)

    def _answer(self, closed: bool, cond: Condition | None) -> None:
        cond = cond or self.answer
        if self.committing:
            self.held_answer = (closed, cond)
            return
        super()._answer(closed, cond)

    def detached(self, closed: bool) -> None:
        if self.state == "open":
            self._end_local(closed, LinkEnding.DETACHED)
        super().detached(closed)

    def member_detached(self, member: MemberReceiver) -> None:
        if not self.gone and self.state == "open":   # a member's node ended it: the whole link ends
            self._end_local(False, LinkEnding.BROKER_ENDED)
        super().member_detached(member)

    def released(self, ending: LinkEnding) -> None:
        """The client's link went without a detach of its own (its session or
        connection ended, stolen, its durable attach failed to commit)."""
        self._end_local(False, ending)
        self._detach_members(False)
        super().released(ending)
