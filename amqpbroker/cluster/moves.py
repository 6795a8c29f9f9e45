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

Nothing is published to the topic meanwhile: no node has opened its client listeners
yet, so the moved subscription misses no message and its order is the old one.  A
crash in the middle leaves the subscription on both nodes: the next start moves the
rest (at least once: a message accepted there but not yet removed here comes twice).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from cproton import ffi, lib
from proton import Link, symbol

from ..core.placement import HeldSubscription
from ..core.subscriptions import Adoption
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


class MoveLink(ShovelLink):
    """One subscription's move: a shovel of its queue whose link names the subscription."""

    def __init__(self, moves: "SubscriptionMoves", sub: Any, queue: Any, owner: str):
        super().__init__(moves.shovels, queue, owner)
        self.moves = moves
        self.sub = sub
        self.finished = False
        self.total = queue.depth
        self.step = max(1, self.total // 10)   # a progress line at every tenth of the backlog

    def link_properties(self) -> dict:
        return {MOVE: json.dumps(subscription_to_json(self.sub))}

    def on_peer_attach(self) -> None:
        super().on_peer_attach()
        self._check_done()

    def on_peer_delivery(self, dlv: Any) -> None:
        before = self.moved
        super().on_peer_delivery(dlv)
        if self.moved != before and self.moved % self.step == 0 and self.moved < self.total:
            log.info("durable subscription '%s': %d of %d message(s) moved to node %s", self.sub.key.name,
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
    """This node's misplaced durable subscriptions, each moved to its topic's owner."""

    def __init__(self, server: Any, shovels: Shovels, misplaced: list[HeldSubscription]):
        self.server = server
        self.shovels = shovels
        registry = server.subscriptions
        self.pending = {m.queue: (registry.by_queue[m.queue], m.node) for m in misplaced}
        self.done = asyncio.get_running_loop().create_future()
        self.links: dict[str, MoveLink] = {}

    def start(self) -> "asyncio.Future[None]":
        if not self.pending:
            self.done.set_result(None)
        for name in list(self.pending):
            self._begin(name)
        return self.done

    def _begin(self, name: str) -> None:
        if name not in self.pending or self.done.done():
            return
        sub, owner = self.pending[name]
        queue = self.server.broker.queues[name]
        log.info("moving durable subscription '%s' (topic %s/%s, %d message(s)) to node %s", sub.key.name,
                 sub.binding.exchange, sub.binding.key, queue.depth, owner)
        link = self.links[name] = MoveLink(self, sub, queue, owner)
        link.start()

    def interrupted(self, link: MoveLink) -> None:
        """The owner went away or refused: again a little later (it may be starting)."""
        self.server.loop.call_later(RETRY, self._begin, link.queue.name)

    def moved(self, link: MoveLink) -> None:
        """Its queue is empty and everything in it accepted there: deleted here."""
        sub = link.sub
        self.server.subscriptions.delete(sub)
        name = sub.queue_name

        def committed(error: BaseException | None) -> None:
            if error is not None:
                log.error("durable subscription '%s' moved to node %s, not deleted here: %s", sub.key.name,
                          link.owner, error)
                self._fail(RuntimeError(f"store: {error}"))
                return
            log.info("durable subscription '%s' moved to node %s (%d message(s))", sub.key.name, link.owner,
                     link.moved)
            self.pending.pop(name, None)
            if not self.pending and not self.done.done():
                self.done.set_result(None)

        self.server.store.after_commit(committed)

    def refused(self, link: MoveLink, why: str) -> None:
        log.error("node %s refused durable subscription '%s': %s", link.owner, link.sub.key.name, why)
        self._fail(MoveRefused(f"node {link.owner} refused durable subscription '{link.sub.key.name}': {why}"))

    def _fail(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc)


# ---------------------------------------------------------------------- the owner's side


def moved_subscription(link: Link) -> Any:
    """The subscription record a move's link carries (another node's attach), or None."""
    if lib.pn_link_remote_properties(link._impl) == ffi.NULL:
        return None
    text = (link.remote_properties or {}).get(MOVE)
    if text is None:
        return None
    try:
        return subscription_from_json(json.loads(text))
    except (TypeError, ValueError, KeyError, IndexError) as exc:   # a node of another version, or damage
        raise AttachRefused("amqp:invalid-field", f"a subscription move's record does not read: {exc!r}") from None


def adopt(server: Any, link: Link, moved: Any) -> None:
    """Make the moved subscription here (before the link is attached as a producer
    into its queue: the records go in the same or an earlier store batch than the
    first message, so nothing is accepted before the subscription is committed)."""
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
