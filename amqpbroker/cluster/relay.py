"""The anonymous relay in a cluster: each message goes to the node that owns its `to`.

A client's anonymous-relay producer (null target, ANONYMOUS-RELAY) stays a producer of
the node it is connected to; `ConnectionHandler.receive` asks the cluster about each
message (server/ports.py `relay`).  A message for another node goes there on a relay
link of the client's connection to that node (one per client session and node, so a
loop turn's messages for one owner go out together), as raw bytes; the owner routes
it by `to` as it would for the client.  The client's delivery keeps its place in the
producer's settlement order (Qpid JMS completes sends in order) and is settled with
the owner's outcome.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from cproton import lib
from proton import Condition

from ..core.placement import UNAVAILABLE
from .deliveries import is_null
from .sends import OrderedSender, Outgoing, owner_state

log = logging.getLogger("amqpbroker.cluster")


class RelayLink(OrderedSender):
    """Relay messages of one client session for one owning node."""

    def __init__(self, side: Any, handler: Any, client_session: Any, peer: Any, target: str | None = None):
        self.side = side
        self.handler = handler
        self.protocol = handler.protocol
        self.client_session = client_session
        self.peer = peer
        self.init_sends()
        ssn = peer.session_for(client_session)
        m = ssn.sender(f"amqpbroker:relay:{uuid.uuid4().hex[:12]}")
        # None: the owner's anonymous relay (it routes by `to`); else one address
        # (a member of a partitioned destination, cluster/partitioned.py).
        m.target.address = target
        m.open()
        self.mirror, self.mimpl, self.mirror_session = m, m._impl, ssn
        self.open = False
        peer.links[m._impl] = self
        peer.mark_dirty()

    def can_send(self) -> bool:
        return self.open and lib.pn_link_credit(self.mimpl) > 0

    def send(self, producer: Any, dlv: Any, raw: bytes, to: str) -> None:
        slot = None if lib.pn_delivery_settled(dlv) else producer.settle_in_order(dlv, None, ready=False)
        self.pass_on(Outgoing(dlv, raw, (producer, slot)), to)

    # --- the owner's side

    def on_peer_attach(self) -> None:
        if is_null(self.mirror.remote_target):
            return   # refused: the detach says why
        self.open = True
        self.send_queued()

    def on_peer_flow(self) -> None:
        self.send_queued()

    def on_peer_delivery(self, mdlv: Any) -> None:
        self.outcome(mdlv)

    def on_peer_detach(self, closed: bool, condition: Condition | None = None) -> None:
        cond = condition or self.mirror.remote_condition
        self._gone(cond.name if cond else UNAVAILABLE,
                   (cond.description if cond else None) or f"node {self.peer.node} ended the relay link")

    def on_peer_lost(self, condition: Condition) -> None:
        self._gone(UNAVAILABLE, condition.description or f"node {self.peer.node} went away")

    def _gone(self, condition: str, description: str) -> None:
        self.side.relay_gone(self)
        self.fail_all(condition, description)

    # --- the client's side (sends.py)

    def answer(self, item: Outgoing, mdlv: Any, settled: bool) -> None:
        producer, slot = item.slot
        if slot is None or producer.handler.ended:
            return
        state, data, cond = owner_state(item, mdlv)
        slot[1], slot[2], slot[4] = state, cond, data
        slot[3] = True
        producer.drain_settlements()
        self.protocol.mark_dirty()

    def refuse(self, item: Outgoing, condition: str, description: str) -> None:
        producer, slot = item.slot
        log.warning("connection %s: relayed message for node %s rejected: %s: %s", self.protocol.peer,
                    self.peer.node, condition, description)
        if slot is None or producer.handler.ended:
            return
        slot[1], slot[2] = lib.PN_REJECTED, Condition(condition, description)
        slot[3] = True
        producer.drain_settlements()
        self.protocol.mark_dirty()

    def presettled(self, item: Outgoing) -> None:
        lib.pn_delivery_settle(item.cdlv)
