"""Ports: what server/ asks of rooms above it, as small `typing.Protocol`s, so that
server/ names them without importing them (docs/architecture.md, "Cluster").

`BrokerServer.cluster` is None on a broker that is not part of a cluster: then none
of these is called, and nothing of amqpbroker/cluster is imported.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..core.settlement import LinkEnding


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


class ClusterPort(Protocol):
    """The cluster as the connection handler sees it."""

    node: str   # this node's id (named in temporary addresses)

    def attach(self, handler: Any, link: Any) -> ForwardedEndpoint | None:
        """An attach, after the ACL check: None when this node owns the address (the
        handler goes on as alone), else the forwarded endpoint.  Raises
        server.refusal.AttachRefused when it can go nowhere (owner away)."""

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

    def discharge(self, coordinator: Any, dlv: Any, txn_id: Any, fail: bool) -> bool:
        """A Discharge on this node's coordinator: True when the transaction did its
        work on another node and is discharged there (the answer takes its place in
        `coordinator.settle_in_order`); False: discharge it here as alone."""

    def session_ended(self, handler: Any, session: Any) -> None:
        """A client session ended: its sessions on other nodes end too (session-end
        expiry policies apply there)."""

    def connection_ended(self, handler: Any, ending: LinkEnding) -> None:
        """A client connection ended: its connections to other nodes go too."""
