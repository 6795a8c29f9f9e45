"""The cluster as server/ sees it (server/ports.py ClusterPort): at every attach,
ask core/placement.py where the link goes, and either let the node go on as alone
or forward the link (cluster/forward.py) over the client connection's connection
to the owning node (cluster/peer.py), made on first use.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Mapping

from cproton import lib
from proton import Condition, symbol
from typing import Any, Callable, Iterator

from ..core.placement import (
    Forward,
    HeldSubscription,
    Local,
    LinkShape,
    MisplacedSubscriptions,
    Partitioned,
    PerMessage,
    Placement,
    Refuse,
    Scatter,
    SlotMap,
    UNAVAILABLE,
    client_home,
    map_id,
    misplaced_subscriptions,
    partition_history,
    movable,
    partition_members,
    place_link,
    place_message,
    replaces,
)
from ..config import ClientIdPolicy
from ..core.handoff import Candidate, decide as decide_handoff, spread_owner
from ..core.message import JMS_DEST, MESSAGE_ANNOTATIONS
from ..core.settlement import LinkEnding
from ..core.subscriptions import SubscriptionKey, identity
from ..core.terms import CAP_SHARED, CAP_TOPIC, ExpiryPolicy
from ..server.peer_fields import symbols
from ..server.ports import AttachHere
from ..server.refusal import AttachRefused
from ..server.terminus import read_source, read_target
from .fanin import LocalFirstFanIn
from .forward import ForwardedConsumer, ForwardedLink, ForwardedProducer
from .handoff import HANDED_OFF, Recorder, hand_off
from .guard import LOCKED, LocalAttach, LookupAnswer, SubscriptionGuard, held_subscription, is_lookup
from .info import CLUSTER_INFO_ADDRESS, ClusterInfoLink
from .keyless import KeylessProducer
from .lookup import LookupConsumer
from .moves import adopt, moved_subscription
from .partitioned import FanInConsumer, MemberRoute, PartitionedProducer, member_of, own_member
from .relay import RelayLink
from .txn import TxnRoutes
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
        self.relays: dict[tuple[Any, str], RelayLink] = {}   # (client pn_session_t*, node) → link
        self.claim: PeerConnection | None = None   # the connection that holds the client-id
        self.holding = 0   # client attaches waiting for other nodes' answers (hold / unhold)

    def peer(self, node: str, claim: bool = False) -> PeerConnection:
        """The client's connection to `node` (made on first use).  `claim`: it also
        holds the client-id there (it desires sole-connection-for-container, so the
        node refuses it if that container-id is connected there already)."""
        peer = self.peers.get(node)
        if peer is None or peer.closed:
            h = self.handler
            desired = [c for c in symbols(h.conn.remote_desired_capabilities) if c != SOLE_CONNECTION]
            peer = PeerConnection(self.router.server, node, self.router.address_of(node), self.router.secret,
                                  container_id=h.container_id, user=h.protocol.user,
                                  desired_capabilities=desired + [SOLE_CONNECTION] * claim, on_lost=self._lost,
                                  map_id=map_id(self.router.slots), tls=self.router.tls)
            self.peers[node] = peer
            if claim:
                self.claim = peer
        return peer

    # The single broker answers a connection's frames in order: an attach (with its
    # credit) before a Declare sent after it.  An attach that waits for another node
    # holds the client's later frames (server/engine.py pause_events) until it is
    # answered, so nothing sent after it is answered before it.

    def hold(self) -> None:
        self.holding += 1
        if self.holding == 1:
            self.handler.protocol.pause_events()

    def unhold(self) -> None:
        if self.holding <= 0:
            return
        self.holding -= 1
        if self.holding == 0:
            # Never from inside the client connection's own event handling: next turn.
            self.handler.protocol.loop.call_soon(self._resume)

    def _resume(self) -> None:
        h = self.handler
        if self.holding == 0 and h.protocol.events_paused and not h.ended:
            h.protocol.resume_events()

    def _lost(self, peer: PeerConnection) -> None:
        if self.peers.get(peer.node) is peer:
            del self.peers[peer.node]
        if peer is self.claim and peer.remote_open and peer.refused is None and self.handler.opened:
            # Its client-id is no longer held: another connection could take it now.
            h = self.handler
            log.warning("connection %s (container %s) closed: the client-id's claim on node %s ended",
                        h.protocol.peer, h.container_id, peer.node)
            if not h.ended and not (h.conn.state & h.conn.LOCAL_CLOSED):
                h.conn.condition = Condition("amqp:connection:forced",
                                             f"client-id '{h.container_id}' is no longer held by node {peer.node}")
                h.conn.close()
                h.protocol.mark_dirty()

    def relay(self, client_session: Any, node: str) -> RelayLink:
        link = self.relays.get((client_session, node))
        if link is None:
            link = self.relays[(client_session, node)] = RelayLink(self, self.handler, client_session,
                                                                   self.peer(node))
        return link

    def member(self, client_session: Any, node: str, address: str) -> RelayLink:
        """A sender to one member of a partitioned destination, for relayed messages."""
        key = (client_session, f"{node}\0{address}")
        link = self.relays.get(key)
        if link is None or link.peer.closed:
            link = self.relays[key] = RelayLink(self, self.handler, client_session, self.peer(node), target=address)
        return link

    def relay_gone(self, link: RelayLink) -> None:
        if self.relays.get((link.client_session, link.peer.node)) is link:
            del self.relays[(link.client_session, link.peer.node)]

    def end_session(self, client_session: Any) -> None:
        for key in [k for k in self.relays if k[0] == client_session]:
            del self.relays[key]
        for peer in self.peers.values():
            peer.end_session(client_session)

    def close(self, lost: bool) -> None:
        for link in list(self.late.values()):
            link.released(LinkEnding.CONNECTION_CLOSED)
        for peer in list(self.peers.values()):
            peer.close(lost=lost)
        self.peers.clear()


def held_as(sub: Any) -> HeldSubscription:
    """A subscription as core/placement.py `misplaced_subscriptions` reads it: its
    binding as an address (`amq.topic/prices`)."""
    b = sub.binding
    return HeldSubscription(sub.key.name, f"{b.exchange}/{b.key}" if b.key else b.exchange, queue=sub.queue_name)


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
        self.txns = TxnRoutes(self)
        self.forwarded_total = 0
        # False while this node may not serve its slots ([cluster]: its ZooKeeper
        # session is in doubt or its live znode is not held; cluster/membership.py).
        self.serving = True
        self.membership: Any = None
        self.redirect = False      # [cluster] redirect: opens go to their client-id's home node
        self.tls: Any = None       # [cluster] tls: connections to other nodes in TLS (cluster/tls.py)
        # serve --workers: node → its hand-off socket (cluster/handoff.py); None: off.
        self.handoff_path: Callable[[str], str] | None = None
        self.handed_off_total = 0
        # (partitioned destination, sender link?) → first attaches counted here (spread_owner)
        self.spread_arrivals: dict[tuple[str, bool], int] = {}
        self.handoff_listener: Any = None
        self.client_address: Callable[[str], tuple[str, Any]] = lambda node: ("", 0)
        self.moves_allowed = False   # serve --workers: misplaced subscriptions move (cluster/moves.py)
        self.to_move: list[HeldSubscription] = []
        self.formerly: dict[str, int] = {}   # partitioned when this store was last started, plain now
        self.gate: str | None = None   # why clients wait: a remapped map's start gate is shut (cluster/zkgate.py)

    def describe(self) -> dict:
        """GET /api/cluster (and the cluster's /metrics): this node's view of the cluster."""
        slots = self.slots
        peers = [p for side in self.sides.values() for p in side.peers.values()]
        links = [f for p in peers for f in p.links.values()]
        # Client messages sent (or queued) to the nodes that own their addresses and
        # not answered yet; deliveries passed on to clients and not settled by them.
        waiting = sum(len(getattr(f, "sent", ()) or ()) + len(getattr(f, "queue", ()) or ()) for f in links)
        at_clients = sum(len(getattr(f, "unsettled", ()) or ()) for f in links)
        incoming = sum(1 for hs in list(self.server.handlers_by_container.values()) for h in hs
                       if self.from_node(h))
        nodes = []
        # The map's nodes (a node of weight 0 owns no slot, and is one until a remap
        # leaves it out), and any other live one.
        names = sorted(set(slots.nodes) | set(self.membership.map_nodes if self.membership is not None else ()))
        for node in names:
            live = slots.available(node)
            nodes.append({"node": node, "live": live, "slots": len(slots.slots_of(node)),
                          "here": node == self.node,
                          "connections": sum(1 for p in peers if p.node == node)})
            if self.membership is not None:   # [cluster]: a node not live reported its last stop
                report = None if live else self.membership.reports.get(node)
                nodes[-1]["last_stop"] = report.as_record() if report is not None else None
        view = {"node": self.node, "serving": self.serving, "gate": self.gate, "epoch": slots.epoch,
                "slots": slots.slots,
                "slots_owned": len(slots.slots_of(self.node)), "tls": self.tls is not None,
                "nodes": nodes, "pinned_exchanges": sorted(slots.pinned),
                "partitioned": [{"address": key, "members": [{"address": a, "node": n} for a, n in
                                                             partition_members(key, count, slots)]}
                                for key, count in sorted(slots.partitioned.items())],
                "forwarded": {"clients": len(self.sides), "connections": len(peers), "links": len(links),
                              "waiting_on_owners": waiting, "unsettled_at_clients": at_clients,
                              "links_total": self.forwarded_total},
                "handoff": None if self.handoff_path is None else {
                    "handed_total": self.handed_off_total,
                    "adopted_total": getattr(self.handoff_listener, "adopted_total", 0)},
                "inter_node_connections_in": incoming}
        if self.membership is not None:
            view["zookeeper"] = self.membership.describe()
        return view

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
        if not self.serving:
            raise AttachRefused(UNAVAILABLE, f"node {self.node} serves nothing now (its ZooKeeper session is "
                                             f"in doubt, or it is taking its place again)")
        if self.gate is not None and not self.from_node(handler):
            raise AttachRefused(UNAVAILABLE, self.gate)   # a remapped map's start gate (cluster/zkgate.py)
        if self.from_node(handler):
            # Placed by the node that sent it: served here; or another node's lookup
            # of a subscription name (cluster/guard.py), answered here.
            if link.is_sender:
                return LookupAnswer(handler, link) if is_lookup(link) else None
            moved = moved_subscription(link)
            if moved is not None:   # a subscription moved here with its topic (cluster/moves.py)
                self._check_owned(moved)
                adopt(self.server, link, moved)
                return self._once_committed(handler, link)
            return None
        shape = self._shape(link)
        if not shape.consumer and shape.address == CLUSTER_INFO_ADDRESS:
            return ClusterInfoLink(handler, link, self)   # cluster/info.py: answered here
        placed = place_link(shape, self.node, self.slots, self.exchanges)
        recorder = getattr(handler.protocol, "handoff", None)
        if recorder is not None and recorder.recording:
            # The connection's first attach: hand the whole connection to the node that
            # owns its address when nothing of it exists elsewhere (core/handoff.py).
            if self._hand_off(handler, recorder, placed, link.is_sender):
                return HANDED_OFF
            recorder.stop()
        if shape.consumer and isinstance(placed, (Forward, Local, Partitioned)):
            check = self._subscription_check(handler, link, placed)
            if check is not None:
                return self._guarded(handler, link, shape, placed, *check)
        if isinstance(placed, Forward):
            return self._forward(handler, link, [placed.node])
        if isinstance(placed, Refuse):
            raise AttachRefused(placed.condition, placed.description)
        if isinstance(placed, Scatter):
            return self._scatter(handler, link, placed)
        if isinstance(placed, PerMessage) and shape.address:
            # An exchange without a key: each message by its subject (cluster/keyless.py).
            self.forwarded_total += 1
            return KeylessProducer(self.side(handler), handler, link, shape.address)
        if isinstance(placed, Partitioned):
            own = own_member(placed.members, self.node)
            if own is not None and not link.is_sender:
                return AttachHere(own.address, own)   # in-process; each message: partition_target
            side = self.side(handler)
            self.forwarded_total += 1
            if link.is_sender:
                return self._fan_in(side, handler, link, placed, own)
            return PartitionedProducer(side, handler, link, placed)
        return None

    def protocol_factory(self, listener: Any, make: Callable[[], Any]) -> Callable[[], Any]:
        """ClusterPort: a hand-off recorder in front of each client connection of a
        plain listener, when connections may be handed between workers."""
        if self.handoff_path is None or listener.name == NODE_LISTENER:
            return make
        return lambda: Recorder(make())

    def _hand_off(self, handler: Any, recorder: Recorder, placed: Placement, sender: bool) -> bool:
        payload = recorder.payload()
        node, why = decide_handoff(Candidate(
            recording=recorder.recording, owner=self._handoff_owner(placed, sender),
            links=handler.links, claims_elsewhere=handler in self.sides, replayable=payload is not None,
            enabled=self.handoff_path is not None))
        if node is None or payload is None or self.handoff_path is None:
            log.debug("connection %s stays at node %s: %s", handler.protocol.peer, self.node, why)
            return False
        if hand_off(handler, payload, self.handoff_path(node), node, self.secret):
            self.handed_off_total += 1
            return True
        return False

    def _handoff_owner(self, placed: Placement, sender: bool) -> str | None:
        """The node a connection whose first link is `placed` belongs to, None: here.  A
        partitioned destination's connections are dealt over its members' nodes
        (core/handoff.py spread_owner), consumers and producers counted apart."""
        if isinstance(placed, Forward):
            return placed.node
        if not isinstance(placed, Partitioned):
            return None
        key = (placed.address, sender)
        arrivals = self.spread_arrivals.get(key, 0)
        self.spread_arrivals[key] = arrivals + 1
        return spread_owner(tuple(node for _, node in placed.members), self.node, arrivals)

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

    def _subscription_check(self, handler: Any, link: Any, placed: Any) -> tuple[list[str], bool] | None:
        """For a durable or a shared non-durable subscription attach: the other nodes
        to ask about its name (cluster/guard.py), and whether it is durable.  This
        node's own is dealt with here and now when the subscription goes elsewhere."""
        source = read_source(link.remote_source)
        if source.is_null or source.dynamic:
            return None
        durable = source.expiry_policy is ExpiryPolicy.NEVER
        if not durable and not source.has(CAP_SHARED):
            return None
        if isinstance(placed, Local):
            targets = {self.node}
        elif isinstance(placed, Forward):
            targets = {placed.node}
        else:
            targets = {node for _, node in placed.members}
        if self.node not in targets:
            self._check_local(handler, link, source, durable)
        others = [n for n in self.slots.nodes if n not in targets and n != self.node and self.slots.available(n)]
        return (others, durable) if others else None

    def _check_local(self, handler: Any, link: Any, source: Any, durable: bool) -> None:
        """This node's subscription of that name, its topic elsewhere: a durable one
        unused is replaced (deleted here), one in use refuses the attach."""
        if not durable:
            if held_subscription(self.server.subscriptions, self.server.broker, link, handler.container_id):
                raise AttachRefused(LOCKED, f"shared subscription '{link.name.split('|', 1)[0]}' is in use "
                                            f"with a different topic (on node {self.node})")
            return
        namespace, name, _, _ = identity(link.name, handler.container_id, source)
        registry = self.server.subscriptions
        sub = registry.subscriptions.get(SubscriptionKey(namespace, name, True))
        if sub is None:
            return
        if not replaces((held_as(sub).topic, False), (source.address, source.has(CAP_TOPIC)),
                        self.slots, self.exchanges):
            log.error("durable subscription '%s' of this topic is held here, not by the topic's node: not "
                      "replaced (a change of the cluster's map is not finished)", name)
            raise AttachRefused(UNAVAILABLE, f"durable subscription '{name}' is held by node {self.node}, not by "
                                             f"its topic's node (a change of the map is not finished)")
        queue = self.server.broker.queues.get(sub.queue_name)
        if queue is not None and queue.consumers:
            raise AttachRefused(LOCKED, f"subscription '{name}' is in use with a different topic, selector "
                                        f"or no-local")
        log.info("durable subscription '%s' deleted here: attached again under a topic of another node", name)
        registry.delete(sub)

    def _guarded(self, handler: Any, link: Any, shape: LinkShape, placed: Any, others: list[str],
                 durable: bool) -> Any:
        """Ask the other nodes first (cluster/guard.py); then attach at the owner:
        this node (in-process, as alone: guard.LocalAttach), another node, or every
        member of a partitioned topic."""
        side = self.side(handler)
        if isinstance(placed, Partitioned):
            fwd: Any = self._fan_in(side, handler, link, placed, own_member(placed.members, self.node), start=False)
        elif isinstance(placed, Local):
            fwd = LocalAttach(side, handler, link)   # then attached here, in-process
        else:
            fwd = ForwardedConsumer(side, handler, link, side.peer(placed.node))

        def then(refusal: Any) -> None:
            if fwd.state != "attaching" or fwd.client_gone:
                return
            if refusal is not None:
                fwd.refuse_client(refusal)
            else:
                fwd.start()

        def same_topic(found: Any) -> bool:
            src = read_source(found)
            return bool(src.address) and not replaces((src.address, src.has(CAP_TOPIC)), (shape.address, shape.topic),
                                                      self.slots, self.exchanges)

        SubscriptionGuard(side, fwd.client_session, link, others, durable, then, same_topic)
        if not isinstance(placed, Local):
            self.forwarded_total += 1
        return fwd

    @staticmethod
    def _fan_in(side: Any, handler: Any, link: Any, placed: Partitioned, own: MemberRoute | None,
                start: bool = True) -> FanInConsumer:
        """A consumer of every member: this node's own, when it has one, in-process and
        first (cluster/fanin.py); the others through their nodes."""
        if own is None:
            return FanInConsumer(side, handler, link, placed.members, start=start)
        return LocalFirstFanIn(side, handler, link, placed.members, own.sticky, start=start)

    def _scatter(self, handler: Any, link: Any, placed: Scatter) -> Any:
        """A null-source attach (Qpid JMS's unsubscribe): the subscription it names may
        be on any node, and on several (a partitioned topic's members): asked of every
        node at once (cluster/lookup.py), this one included when it holds the name."""
        namespace, name, _, _ = identity(link.name, handler.container_id, None)
        if not placed.nodes:
            return None   # no other node: as alone
        here = SubscriptionKey(namespace, name, True) in self.server.subscriptions.subscriptions
        self.forwarded_total += 1
        return LookupConsumer(self.side(handler), handler, link, list(placed.nodes) + [self.node] * here)

    # ------------------------------------------------------------------ client-ids

    def claims(self, handler: Any) -> bool:
        """Whether this client's open waits for the cluster: a redirect to its
        client-id's home node (`[cluster] redirect`), or that node's grant of its
        client-id (it desires sole-connection-for-container on a `restricted`
        listener, and the home (core/placement.client_home) is another node)."""
        if self.from_node(handler):
            return False
        if self.redirect and client_home(handler.container_id, self.slots) != self.node:
            return True
        if handler.protocol.listener.client_id_policy is not ClientIdPolicy.RESTRICTED:
            return False
        if SOLE_CONNECTION not in symbols(handler.conn.remote_desired_capabilities):
            return False
        return client_home(handler.container_id, self.slots) != self.node

    def claim(self, handler: Any, done: Callable[[tuple[str, str, bool] | None], None]) -> None:
        """Hold the client-id at its home node, then `done(None)`, or `done(refusal)`
        in BrokerServer.admit's shape (a clash: the Qpid JMS InvalidClientIDException)."""
        home = client_home(handler.container_id, self.slots)
        cid = handler.container_id
        if not self.slots.available(home):
            done((UNAVAILABLE, f"node {home}, which grants client-id '{cid}', is not available", False))
            return
        if self.redirect:
            # AMQP 1.0 §2.8.16: Qpid JMS under failover: reconnects there (its own
            # open never got further than here: never mid-connection).
            host, port = self.client_address(home)
            log.info("connection %s (container %s) redirected to node %s at %s:%s", handler.protocol.peer,
                     cid, home, host, port)
            done(("amqp:connection:redirect", f"client-id '{cid}' is served by node {home}", False,
                  {symbol("hostname"): str(host), symbol("network-host"): str(host), symbol("port"): int(port)}))
            return

        def answered(peer: PeerConnection) -> None:
            if peer.refused is not None or not peer.remote_open:
                self.sides.pop(handler, None)
                peer.close()
            if peer.refused is not None:
                done(("amqp:invalid-field", f"container-id '{cid}' is already connected", True))
            elif not peer.remote_open:
                done((UNAVAILABLE, f"node {home}, which grants client-id '{cid}', is not available", False))
            else:
                done(None)

        self.side(handler).peer(home, claim=True).open_waiters.append(answered)

    def late_delivery(self, handler: Any, link: Any, dlv: Any) -> bool:
        side = self.sides.get(handler)
        fwd = side.late.get(link) if side is not None else None
        if fwd is None:
            return False
        fwd.late(dlv)
        return True

    def relay(self, handler: Any, producer: Any, dlv: Any, msg: Any) -> bool:
        """An anonymous-relay message (cluster/relay.py): False when this node owns
        its `to` (or nobody can: the node refuses it as alone)."""
        if self.from_node(handler):
            return False
        to = msg.prop("to")
        dest = msg.annotations.get(JMS_DEST) if msg.has_section(MESSAGE_ANNOTATIONS) else None
        placed = place_message(str(to) if to else None, dest in (1, 3), self.node, self.slots, self.exchanges)
        if isinstance(placed, Forward):
            side = self.side(handler)
            side.relay(lib.pn_link_session(producer.impl), placed.node).send(producer, dlv, msg.raw, str(to))
            return True
        if isinstance(placed, Partitioned):   # one member: the group's, else this link's
            sticky = zlib.crc32(producer.link.name.encode("utf-8", "surrogatepass"))
            address, node = placed.members[member_of(msg.group_id(), sticky % len(placed.members),
                                                     len(placed.members))]
            side = self.side(handler)
            side.member(lib.pn_link_session(producer.impl), node, address).send(producer, dlv, msg.raw, address)
            return True
        if isinstance(placed, Refuse):
            cond = Condition(placed.condition, placed.description)
            log.warning("connection %s: message for '%s' rejected: %s: %s", handler.protocol.peer, to,
                        cond.name, cond.description)
            if lib.pn_delivery_settled(dlv):
                lib.pn_delivery_settle(dlv)
            else:
                producer.settle_in_order(dlv, lib.PN_REJECTED, cond)
            return True
        return False

    def recovered(self) -> None:
        """The store is recovered and nothing is served yet: the durable subscriptions
        whose topic another node owns under this map (core/placement.py
        `misplaced_subscriptions`) are kept in `to_move` when this node may move them
        (`moves_allowed`: a `--workers` start, behind its gate; cluster/moves.py);
        else, and for one whose topic became partitioned, or plain again (a member's
        copy), the start is refused (MisplacedSubscriptions).  The partitioned
        destinations this store knew and are plain now (`formerly`) are what the
        shovels merge member queues by (cluster/unpartition.py)."""
        from .unpartition import read_history, write_history
        store = self.server.store
        held = [held_as(s) for s in self.server.subscriptions.subscriptions.values() if s.durable]
        stored = read_history(store)
        self.formerly, history = partition_history(stored, self.slots,
                                                   [h.topic for h in held] + list(self.server.broker.queues))
        misplaced = misplaced_subscriptions(held, self.node, self.slots, self.exchanges, self.formerly)
        stuck = [m for m in misplaced if not (self.moves_allowed and movable(m, self.node))]
        if stuck:
            raise MisplacedSubscriptions(self.node, stuck)
        self.to_move = misplaced
        write_history(store, stored, history)

    def _once_committed(self, handler: Any, link: Any) -> LocalAttach:
        """A move's link answered (and so its subscription taken by the node it leaves)
        only once the subscription made here is on disk; its frames wait meanwhile."""
        waiting = LocalAttach(self.side(handler), handler, link)

        def committed(error: BaseException | None) -> None:
            if waiting.state != "attaching":
                return
            if error is None:
                waiting.start()
            else:
                waiting.refuse_client(Condition("amqp:resource-limit-exceeded",
                                                f"moved subscription could not be stored: {error}"))

        self.server.store.after_commit(committed)
        return waiting

    def _check_owned(self, moved: Any) -> None:
        """A moved subscription comes only to its topic's owner under this map."""
        held = held_as(moved)
        if misplaced_subscriptions([held], self.node, self.slots, self.exchanges):
            raise AttachRefused("amqp:invalid-field", f"node {self.node} does not own topic {held.topic} under "
                                                      f"its map: subscription '{held.name}' not taken")

    def partition_target(self, handler: Any, producer: Any, dlv: Any, msg: Any) -> Any:
        """A message of a producer whose partitioned destination has a member here
        (`own_member`): routed here unless its group's member is another node's, then
        relayed there on the client's connection to that node (cluster/relay.py)."""
        route: MemberRoute = producer.partition
        address, node = route.members[member_of(msg.group_id(), route.sticky, len(route.members))]
        if node != self.node:
            side = self.side(handler)
            side.member(lib.pn_link_session(producer.impl), node, address).send(producer, dlv, msg.raw, address)
            return None
        return producer.target   # this node's member is the producer's own (one member a node)

    def discharge(self, coordinator: Any, dlv: Any, txn_id: Any, fail: bool) -> bool:
        return self.txns.discharge(coordinator, dlv, txn_id, fail)

    def session_ended(self, handler: Any, session: Any) -> None:
        side = self.sides.get(handler)
        if side is not None:
            side.end_session(session._impl)

    def connection_ended(self, handler: Any, ending: LinkEnding) -> None:
        self.txns.connection_ended(handler)
        side = self.sides.pop(handler, None)
        if side is not None:
            side.close(lost=ending is LinkEnding.CONNECTION_LOST)
