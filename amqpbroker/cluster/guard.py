"""One subscription name, one subscription, across the cluster.

A subscription lives on its topic's node (core/placement.py), so a client that
attaches a durable subscription it already has under another topic (JMS 2.0 §6.11:
the same name with a changed topic replaces it when it has no consumers, and is an
error while it has some) would reach a node that does not know the old one.  Before
such an attach goes to its topic's node, every other node is asked, as Qpid JMS does
to unsubscribe: a null-source attach under the client's link name (its stored
subscription, if any, answers), then a detach with closed=true, which deletes it when
nobody consumes it and is refused `amqp:resource-locked` otherwise.  A lock refuses the
client's attach with that error; anything else lets it go on.  One found under the
*same* topic is never deleted (core/placement.py `replaces`): a subscription lives on
its topic's node, so only an unfinished change of the map left it on another, and its
backlog is what the client came for; the attach is refused `resource-unavailable`.

A shared non-durable subscription (JMS 2.0 §6.11, createSharedConsumer) exists only
while it has consumers, and one that exists under another topic or selector is an
error for a new consumer ("a JMSException will be thrown"): the single broker answers
`amqp:resource-locked`.  Under another topic it lives on another node, so before the
attach goes on every other node is asked with a *lookup*: the client's own link name
and source on a link marked with the property `amqpbroker:subscription-lookup`, which
the other node answers itself (`LookupAnswer`: the subscription's address, or a
refusal `amqp:not-found`) without attaching anything.  Found anywhere: the client's
attach is refused `amqp:resource-locked`, as alone.

Both checks ask the nodes at the moment of the attach: two first consumers of one
name attached at the same moment under two topics of two nodes are not seen by each
other (docs/cluster.md, "Not done yet").
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from cproton import lib
from proton import Condition, Link, Terminus, symbol

from ..core.placement import UNAVAILABLE
from ..core.subscriptions import SubscriptionKey, identity
from ..core.terms import ExpiryPolicy
from ..server.peer_fields import link_property
from ..server.refusal import AttachRefused
from ..server.terminus import read_source
from .deliveries import is_null

log = logging.getLogger("amqpbroker.cluster")

LOCKED = "amqp:resource-locked"
NOT_FOUND = "amqp:not-found"
LOOKUP = symbol("amqpbroker:subscription-lookup")


class GuardLink:
    """The lookup on one node (a PeerConnection link: gets its events)."""

    def __init__(self, guard: "SubscriptionGuard", node: str, peer: Any, client_session: Any, name: str):
        self.guard = guard
        self.node = node
        self.peer = peer
        ssn = peer.session_for(client_session)
        link = ssn.receiver(name)
        link.source.type = Terminus.UNSPECIFIED   # null source: "answer with what you hold"
        link.source.address = None
        link.open()
        self.mirror, self.mimpl, self.mirror_session = link, link._impl, ssn
        self.found = False
        self.kept = False   # found under the client's own topic: left there
        self.done = False
        peer.links[link._impl] = self
        peer.mark_dirty()

    def on_peer_attach(self) -> None:
        if is_null(self.mirror.remote_source):
            return   # not here (or locked): the detach says which
        self.found = True
        if self.guard.same_topic(self.mirror.remote_source):
            self.kept = True
            self.mirror.detach()   # closed=false: it stays, backlog and all
        else:
            self.mirror.close()   # closed=true: delete it unless others consume it
        self.peer.mark_dirty()

    def on_peer_detach(self, closed: bool, condition: Condition | None = None) -> None:
        cond = condition or self.mirror.remote_condition
        if not self.kept and not (self.mirror.state & Link.LOCAL_CLOSED):
            self.mirror.close()
            self.peer.mark_dirty()
        if self.kept:
            name = self.mirror.name.split("|", 1)[0]
            log.error("durable subscription '%s' of this topic is held by node %s, not by the topic's node: "
                      "not replaced (a change of the cluster's map is not finished)", name, self.node)
            self._done(Condition(UNAVAILABLE, f"durable subscription '{name}' is held by node {self.node}, "
                                              f"not by its topic's node (a change of the map is not finished)"))
        elif cond is not None and cond.name == LOCKED:
            self._done(cond)
        else:
            if self.found:
                log.info("durable subscription '%s' on node %s deleted: attached again under another topic",
                         self.mirror.name, self.node)
            self._done(None)

    def on_peer_lost(self, condition: Condition) -> None:
        log.warning("node %s not asked about subscription '%s' before its attach: %s", self.node,
                    self.mirror.name, condition.description)
        self._done(None)

    def on_peer_delivery(self, dlv: Any) -> None:   # credit 0: nothing is sent on a lookup
        pass

    def on_peer_flow(self) -> None:
        pass

    def _done(self, refusal: Condition | None) -> None:
        if self.done:
            return
        self.done = True
        if self.peer.links.get(self.mimpl) is self:
            del self.peer.links[self.mimpl]
        self.guard.answered(self, refusal)


class LookupLink(GuardLink):
    """The lookup of a shared non-durable subscription on one node: found there means
    in use there (it exists only with consumers), so the client's attach is locked."""

    def __init__(self, guard: "SubscriptionGuard", node: str, peer: Any, client_session: Any, client_link: Link):
        self.guard = guard
        self.node = node
        self.peer = peer
        ssn = peer.session_for(client_session)
        link = ssn.receiver(client_link.name)
        link.source.copy(client_link.remote_source)
        link.target.copy(client_link.remote_target)
        link.properties = {LOOKUP: True}
        link.open()
        self.mirror, self.mimpl, self.mirror_session = link, link._impl, ssn
        self.found = False
        self.done = False
        peer.links[link._impl] = self
        peer.mark_dirty()

    def on_peer_attach(self) -> None:
        if is_null(self.mirror.remote_source):
            return   # not there: the detach follows
        self.found = True
        self.where = self.mirror.remote_source.address
        self.mirror.detach()
        self.peer.mark_dirty()

    def on_peer_detach(self, closed: bool, condition: Condition | None = None) -> None:
        if not (self.mirror.state & Link.LOCAL_CLOSED):
            self.mirror.detach()
            self.peer.mark_dirty()
        if self.found:
            name = self.mirror.name.split("|", 1)[0]
            self._done(Condition(LOCKED, f"shared subscription '{name}' is in use with a different topic "
                                         f"('{self.where}' on node {self.node})"))
        else:
            self._done(None)

    def on_peer_lost(self, condition: Condition) -> None:
        log.warning("node %s not asked about shared subscription '%s' before its attach: %s", self.node,
                    self.mirror.name, condition.description)
        self._done(None)


class SubscriptionGuard:
    """Ask `nodes` about the subscription a client's consumer attach names (durable:
    delete an unused one there; shared non-durable: is it there); then
    `then(refusal or None)`."""

    def __init__(self, side: Any, client_session: Any, link: Link, nodes: list[str], durable: bool,
                 then: Callable[[Condition | None], None], same_topic: Callable[[Any], bool]):
        self.then = then
        self.same_topic = same_topic   # a found subscription's source → under the client's topic?
        self.refusal: Condition | None = None
        if durable:
            self.waiting = {GuardLink(self, n, side.peer(n), client_session, link.name) for n in nodes}
        else:
            self.waiting = {LookupLink(self, n, side.peer(n), client_session, link) for n in nodes}

    def answered(self, link: GuardLink, refusal: Condition | None) -> None:
        self.waiting.discard(link)
        if refusal is not None and self.refusal is None:
            self.refusal = refusal
        if not self.waiting:
            self.then(self.refusal)


class LocalAttach:
    """A subscription attach this node owns, waiting for the other nodes' answers.

    It sits in the handler's endpoints like a forwarded link (and holds the client's
    later frames, as one does) until the guard has answered; then the attach is made
    here, in this process, as alone (`ConnectionHandler.attach_here`), and the real
    consumer takes its place.  Never through this node's own inter-node listener: a
    subscription consumer forwarded to its own node paid for forwarding on every
    message (about 45 % more CPU per message at the node, bench/cluster.py)."""

    forwarded = True

    def __init__(self, side: Any, handler: Any, link: Link):
        self.side = side
        self.handler = handler
        self.link = link
        self.impl = link._impl
        self.client_session = lib.pn_link_session(self.impl)
        self.state = "attaching"   # attaching → done
        self.client_gone = False
        self.held = True
        side.hold()

    def _unhold(self) -> None:
        if self.held:
            self.held = False
            self.side.unhold()

    def _drop(self) -> None:
        h = self.handler
        if h.endpoints.get(self.impl) is self:
            del h.endpoints[self.impl]
            h.links -= 1

    def start(self) -> None:
        """No other node objects: attach here."""
        self.state = "done"
        self._drop()
        self.handler.attach_here(self.link)
        self.handler.protocol.mark_dirty()
        self._unhold()

    def refuse_client(self, cond: Condition | None) -> None:
        self.state = "done"
        self._drop()
        self.handler.refuse(self.link, cond.name if cond is not None else NOT_FOUND,
                            (cond.description if cond is not None else None) or "refused by another node")
        self.handler.protocol.mark_dirty()
        self._unhold()

    def detached(self, closed: bool) -> None:
        """The client detached before the answer (its frames are held, so only if
        something let them through): answer as a refusal would, nothing was made."""
        if self.state == "attaching":
            self.refuse_client(Condition(NOT_FOUND, "detached before the attach was answered"))

    def released(self, ending: Any) -> None:
        self.client_gone = True
        self.state = "done"
        self._unhold()

    def on_delivery(self, dlv: Any) -> None:   # a consumer link: the client sends none
        pass

    def on_flow(self) -> None:   # the credit stays on the link; the consumer reads it at attach
        pass


# ---------------------------------------------------------------------- the asked node's side


def is_lookup(link: Link) -> bool:
    """An attach from another node marked as a subscription lookup."""
    return bool(link_property(link, LOOKUP))


def held_subscription(registry: Any, broker: Any, link: Link, container_id: str) -> Any:
    """The subscription in use here under the lookup's name (namespace from the
    client's container-id and source, as the subscription table reads it), or None."""
    source = read_source(link.remote_source)
    namespace, name, shared, _ = identity(link.name, container_id, source)
    sub = registry.subscriptions.get(SubscriptionKey(namespace, name, source.expiry_policy is ExpiryPolicy.NEVER))
    if sub is None or not shared:
        return None
    queue = broker.queues.get(sub.queue_name)
    return sub if queue is not None and queue.consumers else None


class LookupAnswer:
    """This node's answer to a lookup: the subscription's address in the attach reply
    (or a refusal `amqp:not-found`, raised as AttachRefused), then the detach.  It sits
    in the handler's endpoints like a forwarded link; nothing is attached here."""

    forwarded = True

    def __init__(self, handler: Any, link: Link):
        self.handler = handler
        self.link = link
        sub = held_subscription(handler.server.subscriptions, handler.server.broker, link, handler.container_id)
        if sub is None:
            raise AttachRefused(NOT_FOUND, f"no shared subscription '{link.name.split('|', 1)[0]}' in use here")
        link.source.copy(link.remote_source)
        link.source.address = f"{sub.binding.exchange}/{sub.binding.key}"
        link.target.copy(link.remote_target)
        link.open()
        handler.protocol.mark_dirty()

    def on_delivery(self, dlv: Any) -> None:
        lib.pn_delivery_settle(dlv)

    def on_flow(self) -> None:
        pass

    def detached(self, closed: bool) -> None:
        link = self.link
        if not link.state & Link.LOCAL_CLOSED:
            link.close() if closed else link.detach()
        self.handler.free_after_output.append(link)
        self.handler.protocol.mark_dirty()

    def released(self, ending: Any) -> None:
        pass
