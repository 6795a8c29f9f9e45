"""The cluster as server/ sees it (server/ports.py ClusterPort): at every attach,
ask core/placement.py where the link goes, and either let the node go on as alone
or forward the link (cluster/forward.py) over the client connection's connection
to the owning node (cluster/peer.py), made on first use.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Callable, Iterator

from ..core.placement import (
    NOT_IMPLEMENTED,
    Forward,
    Local,
    LinkShape,
    Partitioned,
    PerMessage,
    Refuse,
    Scatter,
    SlotMap,
    place_link,
)
from ..core.settlement import LinkEnding
from ..core.subscriptions import SubscriptionKey, identity
from ..core.terms import CAP_TOPIC, ExpiryPolicy
from ..server.peer_fields import symbols
from ..server.refusal import AttachRefused
from ..server.terminus import read_source, read_target
from .forward import ForwardedConsumer, ForwardedLink, ForwardedProducer
from .guard import LOCKED, SubscriptionGuard
from .peer import PeerConnection

log = logging.getLogger("amqpbroker.cluster")

SOLE_CONNECTION = "sole-connection-for-container"
NODE_LISTENER = "cluster"   # cluster/listener.py node_listener


class ExchangeTypes(Mapping):
    """The broker's exchanges as name → type, read live (placement's view)."""

    def __init__(self, broker: Any):
        self.exchanges = broker.exchanges

    def __getitem__(self, name: str) -> str:
        return self.exchanges[name].type.value

    def __contains__(self, name: object) -> bool:
        return name in self.exchanges

    def __iter__(self) -> Iterator[str]:
        return iter(self.exchanges)

    def __len__(self) -> int:
        return len(self.exchanges)


class ClientSide:
    """What the cluster keeps for one client connection: its connections to other
    nodes, and its forwarded consumers waiting for late dispositions."""

    def __init__(self, router: "Router", handler: Any):
        self.router = router
        self.handler = handler
        self.peers: dict[str, PeerConnection] = {}
        self.late: dict[Any, ForwardedConsumer] = {}   # client pn_link_t* → link

    def peer(self, node: str) -> PeerConnection:
        peer = self.peers.get(node)
        if peer is None or peer.closed:
            h = self.handler
            desired = [c for c in symbols(h.conn.remote_desired_capabilities) if c != SOLE_CONNECTION]
            peer = PeerConnection(self.router.server, node, self.router.address_of(node), self.router.secret,
                                  container_id=h.container_id, user=h.protocol.user,
                                  desired_capabilities=desired, on_lost=self._lost)
            self.peers[node] = peer
        return peer

    def _lost(self, peer: PeerConnection) -> None:
        if self.peers.get(peer.node) is peer:
            del self.peers[peer.node]

    def end_session(self, client_session: Any) -> None:
        for peer in self.peers.values():
            peer.end_session(client_session)

    def close(self, lost: bool) -> None:
        for link in list(self.late.values()):
            link.released(LinkEnding.CONNECTION_CLOSED)
        for peer in list(self.peers.values()):
            peer.close(lost=lost)
        self.peers.clear()


class Router:
    """ClusterPort: this node's forwarding."""

    def __init__(self, server: Any, node: str, slots: SlotMap, addresses: Callable[[str], str], secret: bytes):
        self.server = server
        self.node = node
        self.slots = slots
        self.address_of = addresses
        self.secret = secret
        self.exchanges = ExchangeTypes(server.broker)
        self.sides: dict[Any, ClientSide] = {}
        self.forwarded_total = 0

    def side(self, handler: Any) -> ClientSide:
        side = self.sides.get(handler)
        if side is None:
            side = self.sides[handler] = ClientSide(self, handler)
        return side

    # ------------------------------------------------------------------ ClusterPort

    @staticmethod
    def from_node(handler: Any) -> bool:
        """A connection another node opened for its client: whatever arrives on it
        was placed by that node, and is this node's to serve (never forwarded on)."""
        return handler.protocol.listener.name == NODE_LISTENER

    def attach(self, handler: Any, link: Any) -> ForwardedLink | None:
        if self.from_node(handler):
            return None
        shape = self._shape(link)
        placed = place_link(shape, self.node, self.slots, self.exchanges)
        if shape.consumer and isinstance(placed, (Forward, Local)):
            others = self._durable_elsewhere(handler, link, placed)
            if others:
                return self._guarded(handler, link, placed, others)
        if isinstance(placed, Forward):
            return self._forward(handler, link, [placed.node])
        if isinstance(placed, Refuse):
            raise AttachRefused(placed.condition, placed.description)
        if isinstance(placed, Scatter):
            return self._scatter(handler, link, placed)
        if isinstance(placed, PerMessage) and shape.address:
            raise AttachRefused(NOT_IMPLEMENTED,
                                f"a producer on exchange '{shape.address}' without a key: in a cluster the "
                                f"key goes in the address ('{shape.address}/key') or the message's `to` "
                                f"(anonymous relay)")
        if isinstance(placed, Partitioned):
            raise AttachRefused(NOT_IMPLEMENTED, f"partitioned destination '{placed.address}'")
        return None

    @staticmethod
    def _shape(link: Any) -> LinkShape:
        if link.is_sender:
            src = read_source(link.remote_source)
            return LinkShape(consumer=True, address=src.address, topic=src.has(CAP_TOPIC),
                             dynamic=src.dynamic, null_source=src.is_null)
        tgt = read_target(link.remote_target)
        return LinkShape(consumer=False, address=tgt.address, topic=tgt.has(CAP_TOPIC), dynamic=tgt.dynamic,
                         coordinator=tgt.coordinator)

    def _forward(self, handler: Any, link: Any, nodes: list[str]) -> ForwardedLink:
        side = self.side(handler)
        kind = ForwardedConsumer if link.is_sender else ForwardedProducer
        fwd = kind(side, handler, link, side.peer(nodes[0]), candidates=tuple(nodes[1:]))
        fwd.start()
        self.forwarded_total += 1
        log.debug("link '%s' of %s forwarded to node %s", link.name, handler.container_id, nodes[0])
        return fwd

    def _durable_elsewhere(self, handler: Any, link: Any, placed: Any) -> list[str]:
        """For a durable subscription attach: the other nodes that may hold a
        subscription of that name under another topic (cluster/guard.py).  This
        node's own is dealt with here and now."""
        source = read_source(link.remote_source)
        if source.expiry_policy is not ExpiryPolicy.NEVER or source.is_null or source.dynamic:
            return []
        target = self.node if isinstance(placed, Local) else placed.node
        if target != self.node:
            self._replace_local(handler, link, source)
        return [n for n in self.slots.nodes if n not in (target, self.node) and self.slots.available(n)]

    def _replace_local(self, handler: Any, link: Any, source: Any) -> None:
        namespace, name, _, _ = identity(link.name, handler.container_id, source)
        registry = self.server.subscriptions
        sub = registry.subscriptions.get(SubscriptionKey(namespace, name, True))
        if sub is None:
            return
        queue = self.server.broker.queues.get(sub.queue_name)
        if queue is not None and queue.consumers:
            raise AttachRefused(LOCKED, f"subscription '{name}' is in use with a different topic, selector "
                                        f"or no-local")
        log.info("durable subscription '%s' deleted here: attached again under a topic of another node", name)
        registry.delete(sub)

    def _guarded(self, handler: Any, link: Any, placed: Any, others: list[str]) -> ForwardedLink:
        """Ask the other nodes first (cluster/guard.py); then attach at the owner,
        which may be this node: then through this node's own inter-node listener."""
        side = self.side(handler)
        target = self.node if isinstance(placed, Local) else placed.node
        fwd = ForwardedConsumer(side, handler, link, side.peer(target))

        def then(refusal: Any) -> None:
            if fwd.state != "attaching" or fwd.client_gone:
                return
            if refusal is not None:
                fwd._refuse_client(refusal)
            else:
                fwd.start()

        SubscriptionGuard(side, fwd.client_session, link.name, others, then)
        self.forwarded_total += 1
        return fwd

    def _scatter(self, handler: Any, link: Any, placed: Scatter) -> ForwardedLink | None:
        """A null-source attach (Qpid JMS's unsubscribe): the subscription it names is
        on one node, which the name alone does not tell; here first, then each other."""
        namespace, name, _, _ = identity(link.name, handler.container_id, None)
        if SubscriptionKey(namespace, name, True) in self.server.subscriptions.subscriptions:
            return None
        if not placed.nodes:
            return None   # refused here: not-found
        return self._forward(handler, link, list(placed.nodes))

    def late_delivery(self, handler: Any, link: Any, dlv: Any) -> bool:
        side = self.sides.get(handler)
        fwd = side.late.get(link) if side is not None else None
        if fwd is None:
            return False
        fwd.late(dlv)
        return True

    def relay(self, handler: Any, producer: Any, dlv: Any, msg: Any) -> bool:
        return False

    def session_ended(self, handler: Any, session: Any) -> None:
        side = self.sides.get(handler)
        if side is not None:
            side.end_session(session._impl)

    def connection_ended(self, handler: Any, ending: LinkEnding) -> None:
        side = self.sides.pop(handler, None)
        if side is not None:
            side.close(lost=ending is LinkEnding.CONNECTION_LOST)
