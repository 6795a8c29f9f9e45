"""Durable subscriptions moved to their topic's new node when the slot map changed.

A subscription lives beside its topic (core/placement.py).  `serve --workers N`
started again with another N (or other weights) gives most topics another owner;
a node that finds, once its store is recovered, durable subscriptions whose topic
another node owns now (`misplaced_subscriptions`) moves each one there before any
node serves a client (the supervisor's start gate, cluster/workers.py):

1. a sender link to the owner's inter-node listener, targeting the subscription's
   queue and carrying the subscription's stored record (store/subscription_json.py)
   in the link property `amqpbroker:subscription-move`.  The owner makes the
   subscription as it was (`SubscriptionRegistry.adopt`: name, client-id, binding,
   selector, no-local, the registry links of a later null-source lookup), or finds it
   there from an earlier, interrupted move; a different subscription of that name is
   refused, never merged (core/subscriptions.py `decide_adoption`).
2. the backlog, in order, as raw bytes on that link (cluster/shovel.py ShovelLink):
   each message is removed here only once the owner accepted it (committed there).
3. the subscription deleted here once its queue is empty, and committed.

A subscription whose topic became partitioned (`[cluster] partitioned`) goes to every
member: a copy on each member's node (`member_copy`: bound to the member's name, as a
consumer attached through the partitioned name makes it), its backlog with the first
member that is not here, and the copy of this node's own member, if any, made here
once the old one is deleted.

Nothing is published to the topic meanwhile: no node has opened its client listeners
yet, so the moved subscription misses no message and its order is the old one.  A
crash in the middle leaves the subscription on both nodes: the next start moves the
rest (at least once: a message accepted there but not yet removed here comes twice).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from proton import Link, symbol

from ..core.placement import HeldSubscription
from ..core.subscriptions import Adoption, member_copy
from ..server.peer_fields import link_property
from ..server.refusal import AttachRefused
from ..store.subscription_json import subscription_from_json, subscription_to_json
from .shovel import ShovelLink, Shovels

log = logging.getLogger("amqpbroker.cluster")

MOVE = symbol("amqpbroker:subscription-move")
REFUSALS = ("amqp:resource-locked", "amqp:invalid-field")
RETRY = 0.5   # seconds before a move whose link ended is tried again (its owner not up yet)


# ---------------------------------------------------------------------- the old node's side


class MoveRefused(Exception):
    """The topic's owner refused a moved subscription (one of that name is there already
    under another topic): this node must not start (cluster/node.py EXIT_REFUSED)."""


class NoBacklog:
    """The queue side of a link that carries only a subscription's record (a member
    copy that gets none of the backlog): nothing to send."""

    depth = 0

    def __init__(self, name: str):
        self.name = name

    def add_consumer(self, consumer: Any) -> None:
        pass

    def remove_consumer(self, consumer: Any, held: Any, failed: bool) -> None:
        pass

    def dispatch(self) -> None:
        pass


@dataclass
class Plan:
    """Where one misplaced subscription goes: (record, node, with its backlog) per link,
    and the copy made here at the end (its topic partitioned, one member here)."""
    sub: Any
    sends: list[tuple[Any, str, bool]]
    local: Any = None
    left: set[str] = field(default_factory=set)   # nodes whose link is not done


def plan(sub: Any, held: HeldSubscription, here: str) -> Plan:
    """To its topic's node, backlog and all; or, its topic partitioned, a copy on every
    member (core/subscriptions.py `member_copy`), the backlog with the first member that
    is not here."""
    if held.node:
        return Plan(sub, [(sub, held.node, True)], left={held.node})
    carrier = next(node for _, node in held.members if node != here)
    sends = [(member_copy(sub, address), node, node == carrier) for address, node in held.members if node != here]
    local = next((member_copy(sub, address) for address, node in held.members if node == here), None)
    return Plan(sub, sends, local, {node for _, node, _ in sends})


class MoveLink(ShovelLink):
    """One link of a subscription's move: a shovel of its queue (or of nothing, for a
    record alone) whose link carries the subscription's record."""

    def __init__(self, moves: "SubscriptionMoves", record: Any, queue: Any, owner: str):
        super().__init__(moves.shovels, queue, owner)
        self.moves = moves
        self.record = record
        self.finished = False
        self.total = queue.depth
        self.step = max(100, self.total // 10)   # a progress line at every tenth of a long backlog

    def link_properties(self) -> dict:
        return {MOVE: json.dumps(subscription_to_json(self.record))}

    def on_peer_attach(self) -> None:
        super().on_peer_attach()
        self._check_done()

    def on_peer_delivery(self, dlv: Any) -> None:
        before = self.moved
        super().on_peer_delivery(dlv)
        if self.moved != before and self.moved % self.step == 0 and self.moved < self.total:
            log.info("durable subscription '%s': %d of %d message(s) moved to node %s", self.record.key.name,
                     self.moved, self.total, self.owner)
        self._check_done()

    def on_peer_detach(self, closed: bool, condition: Any = None) -> None:
        cond = condition or self.mirror.remote_condition
        if cond is not None and cond.name in REFUSALS:   # the owner will not take it: no retry helps
            self.finished = True
            self.moves.refused(self, cond.description or cond.name)
        super().on_peer_detach(closed, condition)

    def _check_done(self) -> None:
        if self.open and not self.stopped and not self.inflight and self.queue.depth == 0:
            self.finished = True
            self.stop()
            self.moves.moved(self)

    def stop(self, why: str | None = None) -> None:
        was = self.stopped
        super().stop(why)
        if not was and not self.finished:
            self.moves.interrupted(self)


class SubscriptionMoves:
    """This node's misplaced durable subscriptions, each moved where its topic is now."""

    def __init__(self, server: Any, shovels: Shovels, misplaced: list[HeldSubscription]):
        self.server = server
        self.shovels = shovels
        registry, here = server.subscriptions, shovels.node
        self.pending = {m.queue: plan(registry.by_queue[m.queue], m, here) for m in misplaced}
        self.done = asyncio.get_running_loop().create_future()
        self.told: set[tuple[str, str]] = set()   # (queue, node) said to wait for that node

    def start(self) -> "asyncio.Future[None]":
        if not self.pending:
            self.done.set_result(None)
        for name, p in list(self.pending.items()):
            for _, node, _ in p.sends:
                self._begin(name, node)
        return self.done

    def _begin(self, name: str, node: str) -> None:
        p = self.pending.get(name)
        if p is None or node not in p.left or self.done.done():
            return
        record, _, backlog = next(send for send in p.sends if send[1] == node)
        b = record.binding
        if not self.shovels.router.slots.available(node):
            # A node of a cluster of machines that is not up yet (a remap's gate waits for
            # it too: cluster/zkgate.py); `serve --workers` nodes are always named live.
            if (name, node) not in self.told:
                self.told.add((name, node))
                log.info("durable subscription '%s' (topic %s/%s) waits for node %s to be live to move there",
                         record.key.name, b.exchange, b.key, node)
            self.server.loop.call_later(RETRY, self._begin, name, node)
            return
        queue = self.server.broker.queues[name] if backlog else NoBacklog(name)
        log.info("moving durable subscription '%s' (topic %s/%s, %d message(s)) to node %s", record.key.name,
                 b.exchange, b.key, queue.depth, node)
        MoveLink(self, record, queue, node).start()

    def interrupted(self, link: MoveLink) -> None:
        """The owner went away or refused: again a little later (it may be starting)."""
        self.server.loop.call_later(RETRY, self._begin, link.record.queue_name, link.owner)

    def moved(self, link: MoveLink) -> None:
        """Everything this link carried is accepted there; once every link of its
        subscription is done, the subscription is deleted here (and its copy made,
        when a member of its topic is here)."""
        name = link.record.queue_name
        p = self.pending[name]
        p.left.discard(link.owner)
        log.info("durable subscription '%s' moved to node %s (%d message(s))", link.record.key.name, link.owner,
                 link.moved)
        if p.left:
            return
        registry = self.server.subscriptions
        registry.delete(p.sub)
        if p.local is not None:
            registry.adopt(p.local)
            log.info("durable subscription '%s' (topic %s/%s) made here: this node's member", p.local.key.name,
                     p.local.binding.exchange, p.local.binding.key)

        def committed(error: BaseException | None) -> None:
            if error is not None:
                # The deletion (and this node's member copy) are removals and entity
                # records, which a failed batch still writes, or the writer's next
                # commit does (store/writer.py `carry`); lost only with the writer too,
                # a later start finds the subscription on both nodes and moves what is
                # left (at least once).
                log.warning("durable subscription '%s' moved; the commit that deletes it here failed (%s): "
                            "written with the next one", p.sub.key.name, error)
            self.pending.pop(name, None)
            if not self.pending and not self.done.done():
                self.done.set_result(None)

        self.server.store.after_commit(committed)

    def refused(self, link: MoveLink, why: str) -> None:
        log.error("node %s refused durable subscription '%s': %s", link.owner, link.record.key.name, why)
        self._fail(MoveRefused(f"node {link.owner} refused durable subscription '{link.record.key.name}': {why}"))

    def _fail(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc)


# ---------------------------------------------------------------------- the owner's side


def moved_subscription(link: Link) -> Any:
    """The subscription record a move's link carries (another node's attach), or None."""
    text = link_property(link, MOVE)
    if text is None:
        return None
    try:
        return subscription_from_json(json.loads(text))
    except (TypeError, ValueError, KeyError, IndexError) as exc:   # a node of another version, or damage
        raise AttachRefused("amqp:invalid-field", f"a subscription move's record does not read: {exc!r}") from None


def adopt(server: Any, link: Link, moved: Any) -> None:
    """Make the moved subscription here; the link is answered (attached as a producer
    into its queue) once that is committed (cluster/router.py `_once_committed`)."""
    if moved.key is None or not moved.durable or link.remote_target.address != moved.queue_name:
        raise AttachRefused("amqp:invalid-field", "a subscription move must name the subscription's queue")
    verdict, _ = server.subscriptions.adopt(moved)
    if verdict is Adoption.REFUSE:
        raise AttachRefused("amqp:resource-locked",
                            f"durable subscription '{moved.key.name}' exists here under another topic or "
                            f"selector: not merged with the one moved from another node")
    log.info("durable subscription '%s' (topic %s/%s) %s: moved from another node", moved.key.name,
             moved.binding.exchange, moved.binding.key,
             "made here" if verdict is Adoption.ADOPT else "here already (an earlier move)")
