"""Messages that land on a node that does not own their queue go to the node that does.

Clients' links are forwarded to owners, so this happens only for what a node puts into
a queue by itself: a dead letter (the dead-letter address is owned by one node; every
node dead-letters the messages of the queues it owns), a management move or replay
into a queue owned elsewhere, or a queue that a change of the slot map left behind.

A *shovel* is a consumer of such a local queue (core's ConsumerPort, like a client's
link consumer) that sends each message, as its raw bytes, on a producer link to the
owner, and takes it out of the local queue only when the owner has answered Accepted
(its commit included): at least once, never lost (a crash between the owner's accept
and the local removal sends it again).  Misplaced queues are known from the moment
they are declared (a broker hook) and get their shovel then; a shovel that stopped (its
owner away or refusing) starts again at the next look (once a second) while its queue
holds messages.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Mapping

from cproton import ffi, lib
from proton import Condition

from ..core.addresses import TEMP_PREFIX
from ..core.placement import (Forward, SlotMap, former_member, former_plain, map_id, member_node, owning_key,
                              partition_members, slot_of)
from ..core.queues import Outcome
from ..server.producers import Producer
from .deliveries import Tags, is_null
from .peer import PeerConnection

log = logging.getLogger("amqpbroker.cluster")

WINDOW = 256          # messages a shovel has in flight at most
CHECK_INTERVAL = 1.0  # seconds between looks at misplaced queues
SUBSCRIPTION_PREFIX = "qpidsub_/"
_ids = itertools.count(1 << 61)


def misplaced_owner(name: str, here: str, slots: SlotMap, exchanges: Any) -> str | None:
    """The node that owns queue `name` if it is not this one (subscription queues live
    with their topic and temporary queues with their connection: never misplaced)."""
    found = misplaced_target(name, here, slots, exchanges)
    return None if found is None else found[0]


def misplaced_target(name: str, here: str, slots: SlotMap, exchanges: Any,
                     formerly: Mapping[str, int] | None = None) -> tuple[str, str] | None:
    """(owner, the address there) of queue `name` if another node owns it: its own
    name, or for a member its partitioned queue no longer has (`orders.p2` of `orders`
    now over 2), member 0 (core/placement.py `former_member`); for a member of a queue
    that is plain now (`formerly`: core/placement.py `former_plain`), that queue, at its
    owner; for a queue that is partitioned now, its member 0.  The owner may be this
    node (Shovels then moves the messages in-process: cluster/unpartition.py)."""
    if name.startswith((SUBSCRIPTION_PREFIX, TEMP_PREFIX)):
        return None
    former = former_member(name, slots)
    if former is not None:
        return former[1], former[0]
    base = former_plain(name, slots, formerly or {})
    if base is not None:
        key = owning_key(base, topic=False, exchanges=exchanges, pinned=slots.pinned)
        if key.exchange is None:
            return slots.owners[slot_of(key.key, slots.slots)], base
    target = owning_key(name, topic=False, exchanges=exchanges, pinned=slots.pinned)
    if target.exchange is not None:
        return None
    if target.key in slots.partitioned:
        # A plain queue made partitioned (or made plain and partitioned again): nobody
        # reads its own name any more (consumers read the members); member 0 takes it.
        address, owner = partition_members(target.key, slots.partitioned[target.key], slots)[0]
        return owner, address
    # A member of a partitioned queue (`orders.p1`) lives on its member's node, not at
    # the hash of its name (core/placement.py).
    owner = member_node(target.key, slots) or slots.owners[slot_of(target.key, slots.slots)]
    return None if owner == here else (owner, name)


class ShovelLink:
    """One queue's shovel: a ConsumerPort on the local queue, a sender to the owner."""

    browser = False
    filtered = False
    standby = False
    browse_cursor = 0
    forwarded = False

    def __init__(self, shovels: "Shovels", queue: Any, owner: str, target: str | None = None):
        self.shovels = shovels
        self.queue = queue
        self.owner = owner
        self.target = target or queue.name   # the address at the owner
        self.consumer_id = next(_ids)
        self.peer: PeerConnection | None = None
        self.mirror: Any = None
        self.mimpl: Any = None
        self.mirror_session: Any = None
        self.inflight: dict[Any, Any] = {}   # our pn_delivery_t* → the local entry
        self.tags = Tags()
        self.open = False
        self.stopped = False
        self.refusal: str | None = None   # the owner refused one: nothing more is sent
        self.moved = 0

    def start(self) -> None:
        self.peer = self.shovels.peer(self.owner)
        ssn = self.peer.session_for(self)
        m = ssn.sender(f"amqpbroker:shovel:{self.shovels.node}:{self.queue.name}")
        m.target.address = self.target
        m.source.address = self.queue.name
        props = self.link_properties()
        if props:
            m.properties = props
        m.open()
        self.mirror, self.mimpl, self.mirror_session = m, m._impl, ssn
        self.peer.links[m._impl] = self
        self.peer.mark_dirty()

    def link_properties(self) -> dict:
        return {}   # cluster/moves.py: a subscription's record

    # --- ConsumerPort

    def credit(self) -> int:
        if not self.open or self.stopped or self.refusal is not None:
            return 0
        return min(WINDOW - len(self.inflight), lib.pn_link_credit(self.mimpl))

    def accepts(self, entry: Any) -> bool:
        return True

    def deliver(self, entry: Any) -> None:
        m = self.mimpl
        dlv = lib.pn_delivery(m, self.tags.next())
        payload = entry.payload()
        lib.pn_link_send(m, ffi.from_buffer(payload), len(payload))
        lib.pn_link_advance(m)
        self.inflight[dlv] = entry
        self.peer.mark_dirty()

    def deliver_copy(self, entry: Any) -> None:   # pragma: no cover - never a browser
        raise AssertionError("a shovel does not browse")

    # --- the owner's side

    def on_peer_attach(self) -> None:
        if is_null(self.mirror.remote_target):
            return   # refused: the detach follows
        self.open = True
        self.queue.add_consumer(self)

    def on_peer_flow(self) -> None:
        if self.open:
            self.queue.dispatch()

    def on_peer_delivery(self, dlv: Any) -> None:
        if not lib.pn_delivery_settled(dlv) and not lib.pn_delivery_updated(dlv):
            return
        entry = self.inflight.pop(dlv, None)
        lib.pn_delivery_settle(dlv)
        if entry is None:
            return
        if lib.pn_delivery_remote_state(dlv) == lib.PN_ACCEPTED:
            self.moved += 1
            self.queue.settle(entry, Outcome.ACCEPTED)
        else:   # refused there (full, ...): it stays here and is tried again later
            if self.refusal is None:
                self.refusal = f"node {self.owner} did not accept a message of '{self.queue.name}'"
            self.queue.settle(entry, Outcome.RELEASED)
        if self.refusal is not None and not self.inflight:
            # Only once every message in flight is answered: one the owner accepted
            # after the refusal is removed here, not given back and sent twice.
            self.stop(self.refusal)

    def on_peer_detach(self, closed: bool, condition: Condition | None = None) -> None:
        cond = condition or self.mirror.remote_condition
        self.stop(f"node {self.owner} detached: {cond.name if cond else 'no error'}")

    def on_peer_lost(self, condition: Condition) -> None:
        self.stop(condition.description or "connection lost")

    def stop(self, why: str | None = None) -> None:
        """Give back what is in flight (released: it was not consumed) and step aside;
        the next look starts again."""
        if self.stopped:
            return
        self.stopped = True
        held, self.inflight = list(self.inflight.values()), {}
        if self.open:
            self.queue.remove_consumer(self, held, failed=False)
        if self.peer is not None:
            self.peer.links.pop(self.mimpl, None)
            if not self.peer.closed and self.mirror is not None:
                self.mirror.close()
                self.peer.mark_dirty()
        self.shovels.stopped(self)
        if why:
            log.info("shovel of queue '%s' to node %s stopped (%d moved): %s", self.queue.name, self.owner,
                     self.moved, why)


class Shovels:
    """The node's shovels, and the misplaced queues they serve."""

    def __init__(self, server: Any, router: Any):
        self.server = server
        self.router = router
        self.node = router.node
        self.misplaced: dict[str, tuple[str, str]] = {}   # queue name → (owner, address there)
        self.active: dict[str, ShovelLink] = {}
        self.peers: dict[str, PeerConnection] = {}
        self.timer: Any = None
        self.moved_total = 0
        self.told: set[str] = set()   # queues whose in-process merge was refused (said once: unpartition.py)

    def start(self) -> None:
        broker = self.server.broker
        for queue in list(broker.queues.values()):
            self.declared(queue)
        previous = broker.on_queue_declared

        def declared(queue: Any) -> None:
            if previous is not None:
                previous(queue)
            self.declared(queue)

        broker.on_queue_declared = declared
        self.timer = self.server.loop.call_later(CHECK_INTERVAL, self.look)

    def declared(self, queue: Any) -> None:
        """A queue appeared here (recovered, configured, or named into being by a dead
        letter): if another node owns it, a shovel is attached at once, so what lands
        in it goes on without waiting for a look."""
        found = misplaced_target(queue.name, self.node, self.router.slots, self.router.exchanges,
                                 self.router.formerly)
        if found is not None:
            self.misplaced[queue.name] = found
            self.server.loop.call_soon(self._ensure, queue.name)

    def _ensure(self, name: str) -> None:
        found = self.misplaced.get(name)
        queue = self.server.broker.queues.get(name)
        if found is None or queue is None or name in self.active or not self.router.slots.available(found[0]):
            return
        if found[0] == self.node:   # a queue whose partitioning changed, merged into one this node owns
            from .unpartition import LocalMerge
            merge = self.active[name] = LocalMerge(self, queue, found[1])
            merge.start()
            return
        link = self.active[name] = ShovelLink(self, queue, *found)
        link.start()

    def look(self) -> None:
        """Once a second: a shovel again for each misplaced queue whose shovel stopped
        (its owner away, or refusing), queues that are gone forgotten, and those a
        change of partitioning left behind deleted once emptied."""
        self.timer = self.server.loop.call_later(CHECK_INTERVAL, self.look)
        queues = self.server.broker.queues
        for name in list(self.misplaced):
            if name not in queues:
                self._forget(name)
                continue
            if self._emptied_leftover(name, queues[name]):
                address = self.misplaced[name][1]
                self._forget(name)
                self.server.broker.delete_queue(name)
                log.info("queue '%s' deleted: empty, its messages went into '%s' (its destination's "
                         "partitioning changed)", name, address)
                continue
            if name not in self.active and queues[name].ready_count:
                self._ensure(name)

    def _emptied_leftover(self, name: str, queue: Any) -> bool:
        """A queue whose messages go under another name (a member of a destination
        that is plain now or has fewer members, or a plain queue made partitioned:
        `misplaced_target`), holding nothing, in flight included, and read by nobody
        but its shovel.  Nobody uses that name any more: left, it would stay listed,
        empty, for ever.  (A queue that only lives on another node keeps its name and
        is kept: a dead letter names it into being again.)"""
        address = self.misplaced[name][1]
        link = self.active.get(name)
        if address == name or queue.depth or (link is not None and not isinstance(link, ShovelLink)):
            return False
        return all(c is link for c in queue.consumers) and not self._sent_to(name)

    def _sent_to(self, name: str) -> bool:
        """Whether a client's producer link here targets queue `name` (its next message
        would be refused `amqp:not-found` once the queue is deleted)."""
        return any(isinstance(e, Producer) and e.target is not None and e.target.name == name
                   for hs in list(self.server.handlers_by_container.values()) for h in hs
                   for e in h.endpoints.values())

    def _forget(self, name: str) -> None:
        self.misplaced.pop(name, None)
        link = self.active.get(name)
        if link is not None:
            link.stop()

    def stopped(self, link: Any) -> None:
        self.moved_total += link.moved
        if self.active.get(link.queue.name) is link:
            del self.active[link.queue.name]

    def peer(self, node: str) -> PeerConnection:
        peer = self.peers.get(node)
        if peer is None or peer.closed:
            peer = PeerConnection(self.server, node, self.router.address_of(node), self.router.secret,
                                  container_id=f"amqpbroker-node-{self.node}", user=None,
                                  desired_capabilities=[], on_lost=self._lost, map_id=map_id(self.router.slots))
            self.peers[node] = peer
        return peer

    def _lost(self, peer: PeerConnection) -> None:
        if self.peers.get(peer.node) is peer:
            del self.peers[peer.node]

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        for link in list(self.active.values()):
            link.stop()
        for peer in list(self.peers.values()):
            peer.close()


__all__ = ["Shovels", "ShovelLink", "misplaced_owner", "Forward"]
