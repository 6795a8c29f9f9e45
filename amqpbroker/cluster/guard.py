"""One durable subscription name, one subscription, across the cluster.

A subscription lives on its topic's node (core/placement.py), so a client that
attaches a durable subscription it already has under another topic (JMS 2.0 §6.11:
the same name with a changed topic replaces it when it has no consumers, and is an
error while it has some) would reach a node that does not know the old one.  Before
such an attach goes to its topic's node, every other node is asked, as Qpid JMS does
to unsubscribe: a null-source attach under the client's link name (its stored
subscription, if any, answers), then a detach with closed=true, which deletes it when
nobody consumes it and is refused `amqp:resource-locked` otherwise.  A lock refuses the
client's attach with that error; anything else lets it go on.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from proton import Condition, Link, Terminus

from .deliveries import is_null

log = logging.getLogger("amqpbroker.cluster")

LOCKED = "amqp:resource-locked"


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
        self.done = False
        peer.links[link._impl] = self
        peer.mark_dirty()

    def on_peer_attach(self) -> None:
        if is_null(self.mirror.remote_source):
            return   # not here (or locked): the detach says which
        self.found = True
        self.mirror.close()   # closed=true: delete it unless others consume it
        self.peer.mark_dirty()

    def on_peer_detach(self, closed: bool, condition: Condition | None = None) -> None:
        cond = condition or self.mirror.remote_condition
        if not (self.mirror.state & Link.LOCAL_CLOSED):
            self.mirror.close()
            self.peer.mark_dirty()
        if cond is not None and cond.name == LOCKED:
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


class SubscriptionGuard:
    """Ask `nodes` about a durable subscription name; then `then(refusal or None)`."""

    def __init__(self, side: Any, client_session: Any, name: str, nodes: list[str],
                 then: Callable[[Condition | None], None]):
        self.then = then
        self.refusal: Condition | None = None
        self.waiting = {GuardLink(self, node, side.peer(node), client_session, name) for node in nodes}

    def answered(self, link: GuardLink, refusal: Condition | None) -> None:
        self.waiting.discard(link)
        if refusal is not None and self.refusal is None:
            self.refusal = refusal
        if not self.waiting:
            self.then(self.refusal)
