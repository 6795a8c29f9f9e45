"""`$amqpbroker.cluster`: what a client asks a node about the cluster (the Spark source,
amqpbroker/spark/, reads each queue from the node that holds it).

A request (a message on a link to `$amqpbroker.cluster`, with a `reply-to`, like
`$amqpbroker.queue-info`: docs/spark.md) may name an address in the application
property `address`.  The answer (application properties `status-code` 200 and `node`;
the amqp-value body a map):

    node       this node
    nodes      [{node, live, amqp: "host:port" its clients reach it at}] of the map
    address    the address asked about, and
    members    [[queue, node], ...]: where a reader of it reads (its owner, or each
               member of a partitioned queue); absent when any node may hold it (a
               subscription's queue: ask every node's queue-info)
    partitioned  whether it is a partitioned destination

A broker that is no node of a cluster refuses the link (`amqp:not-found`, as for any
unknown control address): the client knows it talks to a single broker.
"""

from __future__ import annotations

from typing import Any

from proton import Link

from ..core.codec import encode
from ..core.message import Message, MalformedMessage
from ..core.placement import queue_members
from ..core.terms import TargetTerms
from ..server.links import ACCEPTED, REJECTED
from ..server.sequence import ControlLink
from ..server.terminus import write_target

CLUSTER_INFO_ADDRESS = "$amqpbroker.cluster"


def cluster_answer(router: Any, address: str | None) -> dict:
    """The answer's body (plain values: it is encoded as an AMQP map)."""
    slots = router.slots
    nodes = []
    for node in slots.nodes:
        host, port = router.client_address(node)
        nodes.append({"node": node, "live": slots.available(node), "amqp": f"{host}:{port}"})
    out: dict = {"node": router.node, "nodes": nodes}
    if address:
        out["address"] = address
        members = queue_members(address, router.node, slots, router.exchanges)
        out["partitioned"] = bool(members) and members[0][0] != address
        if members is not None:
            out["members"] = [[queue, node] for queue, node in members]
    return out


class ClusterInfoLink(ControlLink):
    """The client's link to `$amqpbroker.cluster` (answered to each request's reply-to)."""

    def __init__(self, handler: Any, link: Link, router: Any):
        link.source.copy(link.remote_source)
        write_target(link.target, TargetTerms(address=CLUSTER_INFO_ADDRESS))
        link.snd_settle_mode = link.remote_snd_settle_mode
        link.rcv_settle_mode = link.remote_rcv_settle_mode
        link.open()
        super().__init__(handler, link, CLUSTER_INFO_ADDRESS)
        self.router = router

    def on_delivery(self, dlv: Any) -> None:
        raw = self.whole_payload(dlv)
        if raw is None:
            return
        try:
            msg = Message(raw)
            refusal = self._reply_refusal(msg)
            if refusal is not None:
                self._answer(dlv, REJECTED, "amqp:unauthorized-access", f"reply-to: {refusal}")
            else:
                address = msg.application_properties.get("address")
                body = cluster_answer(self.router, str(address) if address else None)
                if self._send_reply(msg, {"status-code": 200, "node": self.router.node}, body):
                    self._answer(dlv, ACCEPTED)
                else:
                    self._answer(dlv, REJECTED, "amqp:invalid-field", "a request needs a usable reply-to address")
        except MalformedMessage as exc:
            self._answer(dlv, REJECTED, "amqp:decode-error", str(exc))
        except LookupError as exc:
            self._answer(dlv, REJECTED, "amqp:not-found", str(exc))
        self.handler.protocol.mark_dirty()

    def _send_reply(self, request: Message, properties: dict, body: dict) -> bool:
        from ..core.addresses import AddressKind, AddressNotFound
        from ..core.message import PROPERTIES
        if not request.has_section(PROPERTIES) or not request.prop("reply_to"):
            return False
        reply_to = str(request.prop("reply_to"))
        correlation = request.prop("message_id")
        if correlation is None:
            correlation = request.prop("correlation_id")
        broker = self.handler.broker
        try:
            target = broker.resolve(reply_to)
            if target.kind is AddressKind.NEW_QUEUE:
                return False   # replies never create queues
            raw = (b"\x00\x53\x73" + encode([None, None, reply_to, None, None, correlation])
                   + b"\x00\x53\x74" + encode(properties) + b"\x00\x53\x77" + encode(body))
            broker.publish(Message(raw), target)
        except AddressNotFound:
            return False
        return True
