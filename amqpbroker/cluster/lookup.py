"""A null-source receiver attach in a cluster: Qpid JMS's unsubscribe (then a detach
with closed=true), and any client's "attach to the durable subscription I name".

The name alone does not tell where the subscription lives (it lives beside its topic,
core/placement.py), and a subscription of a partitioned topic lives on every member's
node (cluster/partitioned.py).  So the lookup is asked of every node that may hold it
at once (this node through its own inter-node listener when it holds the name), under
the client's link name and container-id, and answered when every node has answered:

* nobody holds it: refused `amqp:not-found` (`amqpbroker:resource-unavailable` when
  a node could not be asked: it may hold it);
* a node refuses it `amqp:resource-locked` (an unshared one with a consumer): the
  client's attach is refused so, and the others' lookups are detached (closed=false:
  nothing deleted);
* otherwise the client's attach is answered with the first holder's source (a
  member's address given as its partitioned destination's), and the link is a fan-in
  of every holder (cluster/partitioned.py `FanInConsumer`): its detach goes to each,
  so an unsubscribe (closed=true) deletes the subscription on every node that holds
  it; any holder's refusal (`amqp:resource-locked` while consumers are attached) is the
  client's answer.
"""

from __future__ import annotations

from typing import Any

from proton import Condition, Link

from ..core.placement import UNAVAILABLE, member_base
from .guard import LOCKED
from .partitioned import FanInConsumer, MemberReceiver


class LookupConsumer(FanInConsumer):
    """The client's null-source link, asked of `nodes`."""

    def __init__(self, side: Any, handler: Any, link: Link, nodes: list[str]):
        super().__init__(side, handler, link, tuple((None, node) for node in nodes))

    def member_ready(self) -> None:
        self._answered()

    def member_detached(self, member: MemberReceiver) -> None:
        if self.state == "attaching":
            self._answered()
        else:
            super().member_detached(member)

    def _answered(self) -> None:
        if self.gone or self.state != "attaching":
            return
        members = self.members
        if not all(m.attached or m.detached for m in members):
            return
        found = [m for m in members if m.attached and not m.detached]
        refusals = [m.condition for m in members if m.detached and m.condition is not None]
        locked = next((c for c in refusals if c.name == LOCKED), None)
        if locked is not None or not found:
            for m in found:   # closed=false: a lookup that found it deletes nothing
                m.mirror.detach()
                m.peer.mark_dirty()
            self.refuse_client(locked or self._not_found(refusals))
            return
        self.members = found
        link, first = self.link, found[0].mirror
        link.source.copy(first.remote_source)
        address = first.remote_source.address
        base = member_base(address, self.side.router.slots) if address else None
        if base is not None:
            link.source.address = base
        link.target.copy(link.remote_target)
        link.snd_settle_mode = first.remote_snd_settle_mode
        link.rcv_settle_mode = first.remote_rcv_settle_mode
        link.open()
        self.state = "open"
        self.attach_answered()
        self.on_flow()
        self.protocol.mark_dirty()

    @staticmethod
    def _not_found(refusals: list[Condition]) -> Condition:
        away = next((c for c in refusals if c.name == UNAVAILABLE), None)
        if away is not None:
            return Condition(UNAVAILABLE, f"not found on the nodes asked, and {away.description}")
        return next((c for c in refusals if c.name == "amqp:not-found"),
                    Condition("amqp:not-found", "no such durable subscription"))
