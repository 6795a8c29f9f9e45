"""Ports: what a server/ module asks of an object above it, as small
`typing.Protocol`s, so that it names the object without importing its class
(docs/architecture.md, "Layers and ports"; tests/test_layering.py keeps both true:
no such import, and the concrete class has every name its port lists).

Above the link rooms (attach, links, producers, inbound, coordinator, sequence,
outbound) is the connection handler (handlers.py `ConnectionHandler`); above the
transports (engine, tls, websocket) and the live reload is the server (app.py
`BrokerServer`, `Listener`).  The cluster (amqpbroker/cluster) is above server/
altogether: `BrokerServer.cluster` is None on a broker that is not part of a
cluster: then none of its port is called, and nothing of amqpbroker/cluster is
imported.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

from ..core.settlement import LinkEnding

if TYPE_CHECKING:   # lower rooms, named for the types only
    from ..config import Settings
    from ..core.broker import Broker
    from ..core.handshakes import HandshakeGate
    from ..core.registry import SubscriptionRegistry
    from ..core.transactions import TransactionRegistry
    from ..security.guard import AccessGuard
    from ..store.base import Store
    from ..store.durability import DurabilityManager
    from .resources import ResourceWatch


# ------------------------------------------------------------------ a connection's links


class ConnectionIO(Protocol):
    """A connection's socket side (engine.py `AmqpProtocol`) as its links see it."""

    peer: str                  # "host:port", for log lines
    user: str | None           # the authenticated user
    transport: Any             # proton's Transport (None once the socket is gone)
    reads: int                 # socket reads so far, and when the last was made:
    read_at: float             # a producer's credit window counts transfers per read
    input_seq: int             # advances at each input; a consumer's peer_ending() cache
    write_paused: bool         # the socket's write buffer is full
    hold: Any                  # engine.OutputHold: `.held` while output waits for a commit
    output_waiters: list[Any]  # called once the pending output is written

    def mark_dirty(self) -> None:
        """Output to flush at the end of this loop turn."""

    def hold_for_store(self, stored_in: int) -> None:
        """A durable delivery went out: hold output until batch `stored_in` commits."""


class LinkServices(Protocol):
    """The broker-wide services (app.py `BrokerServer`) a connection's links use."""

    loop: asyncio.AbstractEventLoop
    settings: Settings
    broker: Broker
    store: Store
    durability: DurabilityManager
    subscriptions: SubscriptionRegistry
    transactions: TransactionRegistry
    access: AccessGuard
    flow: Any                         # flow.FlowGate (named loosely: it names the Producer)
    cluster: ClusterPort | None

    def flush_soon(self) -> None:
        """Write the dirty connections' output at the end of this loop turn."""


class LinkOwner(Protocol):
    """The connection a link belongs to (handlers.py `ConnectionHandler`), as every
    link room reads it."""

    protocol: ConnectionIO
    server: LinkServices
    broker: Broker
    container_id: str | None   # the peer's container-id (AMQP 1.0 §2.7.1 open)
    connection_key: str | None  # publisher identity for no-local (JMS 2.0 §6.11)
    ended: bool                # the connection ended: links stop acting


class ProducerOwner(LinkOwner, Protocol):
    """What a producer link (producers.py) asks of its connection."""

    settlement_orders: dict[Any, Any]   # raw pn_session_t* → core/ordering.py SettlementOrder

    def receive(self, producer: Any, dlv: Any, raw: bytes) -> None:
        """A whole transfer arrived (inbound.py `receive`)."""

    def route(self, producer: Any, dlv: Any, msg: Any, target: Any) -> None:
        """Route a message that waited for room (inbound.py `route`)."""

    def link_ended(self, link: Any) -> None:
        """The broker ended the link (detach sent): forget it."""

    def settled_after_release(self, producer: Any) -> None:
        """A released producer's last settlement went out."""


class ConsumerOwner(LinkOwner, Protocol):
    """What a consumer link (links.py `LinkConsumer`) asks of its connection."""

    ended_deliveries: Any   # links.EndedDeliveries: late outcomes of ended links

    def transactional_ack(self, consumer: Any, dlv: Any, entry: Any) -> None:
        """An outcome inside a transaction (coordinator.py `stage_ack`)."""


class AttachOwner(LinkOwner, Protocol):
    """What the consumer attacher (attach.py) asks of its connection."""

    consumers: list[Any]   # the connection's LinkConsumers

    def refuse_after(self, link: Any, condition: str, description: str) -> None:
        """Refuse a link whose attach was answered already (detach with an error)."""


class AttachContext(Protocol):
    """The consumer attacher (attach.py `ConsumerAttacher`) as a sequence-range read
    (sequence.py `attach_range_reader`) sees it: the connection it attaches for."""

    handler: LinkOwner


# ------------------------------------------------------------------ sockets, listeners


class ConnectionEvents(Protocol):
    """A connection's handler (handlers.py `ConnectionHandler`) as its engine
    (engine.py `AmqpProtocol`) drives it; built by `ConnectionServer.make_handler`."""

    opened: bool
    ended: bool
    free_after_output: list[Any]   # links to free once their dispositions are written

    def dispatch(self, ev: Any) -> None: ...
    def on_delivery_raw(self, dlv: Any) -> None: ...
    def on_link_flow_raw(self, link: Any) -> None: ...
    def output_written(self) -> None: ...
    def writable_again(self) -> None: ...
    def internal_error(self) -> None: ...
    def socket_closed(self) -> None: ...
    def release(self) -> None: ...


class ListenerSpec(Protocol):
    """A listener (app.py `Listener`) as its sockets' protocols see it."""

    name: str
    host: str
    sasl_policy: Any                  # sasl.SaslPolicy
    ssl_context: Any                  # ssl.SSLContext | None

    def external_identity(self, sock: Any) -> Any:
        """The user a verified client certificate names (SASL EXTERNAL), or None."""


class ConnectionServer(Protocol):
    """The server (app.py `BrokerServer`) as a socket's protocol sees it (engine.py,
    and tls.py / websocket.py in front of it)."""

    loop: asyncio.AbstractEventLoop
    settings: Settings
    store: Store
    users: Any                        # security/users.py UserStore
    handshakes: HandshakeGate
    resources: ResourceWatch
    auth_throttle: Any                # security/throttle.py
    guard: Callable[[], bool] | None  # [ha]: may this broker read and write now
    protocols: set[Any]               # every open connection's protocol
    dirty: list[Any]                  # protocols with output to flush
    metrics_auth_failures: int
    # The composition point: the handler of each connection's events (app.py binds
    # handlers.ConnectionHandler), called with the connection's protocol.
    make_handler: Callable[[Any], ConnectionEvents]

    def handshake_refused(self, address: str, why: str) -> None: ...
    def authentication_failed(self, address: str, user: str | None = None) -> None: ...
    def flush_soon(self) -> None: ...


class ReloadTarget(Protocol):
    """The server (app.py `BrokerServer`) as the live reload (reload.py) changes it."""

    loop: asyncio.AbstractEventLoop
    settings: Settings
    broker: Broker
    users: Any
    access: AccessGuard
    operations: Any                   # management/service.py Operations
    protocols: set[Any]
    handlers_by_container: dict[str, list[Any]]
    live_links: dict[Any, tuple[Any, Any]]

    def forget_link(self, handler: Any, link: Any) -> None: ...
    def flush_soon(self) -> None: ...


# ------------------------------------------------------------------ the cluster


class ForwardedEndpoint(Protocol):
    """A client link whose address another node owns (amqpbroker/cluster/forward.py).
    It sits in `ConnectionHandler.endpoints` like a LinkConsumer or a Producer and
    gets the same per-link events; it answers the client's attach and detach itself,
    once the owner has answered."""

    forwarded: bool   # True: how the handler tells it from its own endpoints

    def on_delivery(self, dlv: Any) -> None:
        """A transfer (client → broker) or a disposition (raw pn_delivery_t*)."""

    def on_flow(self) -> None:
        """The client's flow on this link (credit, drain)."""

    def detached(self, closed: bool) -> None:
        """The client detached (closed=True: closed) the link: detach it at the owner
        and answer the client with the owner's answer."""

    def released(self, ending: LinkEnding) -> None:
        """The link's session or connection ended (or the broker ended the link)."""


@dataclass(frozen=True)
class AttachHere:
    """ClusterPort.attach's answer for a producer served here under another address than
    the one it names: the member of a partitioned destination that this node owns
    (cluster/partitioned.py).  The client's link keeps its own terms; its messages go
    to `address` unless `partition` (opaque here) sends one elsewhere
    (ClusterPort.partition_target)."""

    address: str
    partition: Any


class ClusterPort(Protocol):
    """The cluster as the connection handler sees it."""

    node: str   # this node's id (named in temporary addresses)

    def attach(self, handler: Any, link: Any) -> ForwardedEndpoint | AttachHere | None:
        """An attach, after the ACL check: None when this node owns the address (the
        handler goes on as alone), `AttachHere` to serve it here under another address,
        else the forwarded endpoint.  Raises
        server.refusal.AttachRefused when it can go nowhere (owner away)."""

    def recovered(self) -> None:
        """The store is recovered, before any listener: raises (core/placement.py
        MisplacedSubscriptions) when it holds what this node must not serve and
        cannot move (cluster/moves.py)."""

    def protocol_factory(self, listener: Any, make: Any) -> Any:
        """The protocol factory of a plain AMQP listener: `make`, or one that puts a
        hand-off recorder in front of it (cluster/handoff.py)."""

    def claims(self, handler: Any) -> bool:
        """Whether the client's open (admitted here) needs another node's grant of
        its client-id (sole-connection-for-container across the cluster)."""

    def claim(self, handler: Any, done: Any) -> None:
        """Ask for that grant; `done(None)` or `done((condition, description, clash))`,
        BrokerServer.admit's refusal shape."""

    def late_delivery(self, handler: Any, link: Any, dlv: Any) -> bool:
        """A disposition for a delivery of a link that is no longer an endpoint:
        True when it belonged to a forwarded link (and was passed on)."""

    def relay(self, handler: Any, producer: Any, dlv: Any, msg: Any) -> bool:
        """A message of an anonymous-relay producer: True when another node owns its
        `to` and the message went there; False: route it here.  The client's delivery
        keeps its place in the producer's settlement order: a slot from
        `producer.settle_in_order(dlv, None, ready=False)`, filled and made ready when
        that node answers, then `producer.drain_settlements()` (as a store commit does)."""

    def partition_target(self, handler: Any, producer: Any, dlv: Any, msg: Any) -> Any:
        """A message of a producer attached through `AttachHere`: the Resolution to
        route it to here, or None when it went to another node's member (answered as a
        relayed message is, see `relay`)."""

    def discharge(self, coordinator: Any, dlv: Any, txn_id: Any, fail: bool) -> bool:
        """A Discharge on this node's coordinator: True when the transaction did its
        work on another node and is discharged there (the answer takes its place in
        `coordinator.settle_in_order`); False: discharge it here as alone."""

    def session_ended(self, handler: Any, session: Any) -> None:
        """A client session ended: its sessions on other nodes end too (session-end
        expiry policies apply there)."""

    def connection_ended(self, handler: Any, ending: LinkEnding) -> None:
        """A client connection ended: its connections to other nodes go too."""
