"""A partitioned queue made plain again (its `[[cluster.partitioned]]` entry
removed): what its members hold goes into it, instead of staying under member names
nobody reads any more (docs/cluster.md, "Partitioned destinations").

Only a node's store knows that a name of a member's form (`orders.p1`) was one: a
plain queue may be called so.  So each node records, in its store's meta records,
the partitioned destinations it was started with (`HISTORY`: owning key → member
count), and at its next start reads which of them are plain now (core/placement.py
`partition_history`, `former_plain`).  A member queue's messages then go into the
plain queue: by the shovel to its owner (cluster/shovel.py), or, when that is this
node, moved in-process (`LocalMerge`, core/moves.py `Move`: each message removed and
added in one batch).  A destination stays in the record while this node holds a name
of one of its members, so a crash in the middle finds it again at the next start.
Ordering: per member, as while it was partitioned; the members' messages interleave.
The other way, a plain queue made partitioned: what its own name holds goes into its
member 0 the same way (cluster/shovel.py `misplaced_target`).

A topic's member copies of a durable subscription are not merged (a subscription's
queue lives in the topic log under its member's routing key: store/topiclog.py): a
node holding one refuses to start (core/placement.py `misplaced_subscriptions`).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ..core.addresses import AddressNotFound
from ..core.moves import Move, MoveRefused
from ..store.base import write_refusal

log = logging.getLogger("amqpbroker.cluster")

HISTORY = b"cluster.partitioned"   # key in the store's "meta" records


def read_history(store: Any) -> dict[str, int]:
    """The partitioned destinations this store was last started with; {} when none
    were recorded (a store of an older version, or not a node's) or the record is damaged."""
    for key, value in store.read_records("meta"):
        if bytes(key) != HISTORY:
            continue
        try:
            found = json.loads(bytes(value))
            return {str(k): int(v) for k, v in found.items()}
        except (ValueError, TypeError, AttributeError) as exc:
            log.warning("cluster: the store's record of partitioned destinations does not read (%s): ignored",
                        exc)
    return {}


def write_history(store: Any, stored: dict[str, int], history: dict[str, int]) -> None:
    if history != stored:
        store.put_record("meta", HISTORY, json.dumps(history, sort_keys=True).encode())


class LocalMerge:
    """A member of a queue that is plain again, held by that queue's owner (or a
    plain queue made partitioned, held by its member 0's node): its waiting messages
    moved into the queue in this process, a slice a loop turn (the shape of
    cluster/shovel.py ShovelLink for Shovels: `start`, `stop`, `moved`)."""

    def __init__(self, shovels: Any, queue: Any, target: str):
        self.shovels = shovels
        self.queue = queue
        self.target = target
        self.moved = 0
        self.stopped = False
        self.move: Move | None = None

    def start(self) -> None:
        why = write_refusal(self.shovels.server.store)
        if why is None:
            broker = self.shovels.server.broker
            try:
                # A member 0 nobody has sent to yet, or one deleted once emptied
                # (cluster/shovel.py), is made as the owner's attach makes a shovel's
                # target; else the move refuses it (an explicit target must exist).
                broker.resolve_declared(self.target)
                self.move = Move(broker, self.queue, to=self.target, replay=False,
                                 op=f"merge-{self.queue.name}")
            except AddressNotFound as exc:   # e.g. no such queue and no auto-create
                why = exc.why
            except MoveRefused as exc:
                why = str(exc)
        if why is not None:   # said once; tried again at each look (cluster/shovel.py Shovels.look)
            self._refused(why)
            return
        log.info("queue '%s': moving %d message(s) into '%s' (its destination's partitioning changed)",
                 self.queue.name, self.move.report.total, self.target)
        self.shovels.server.loop.call_soon(self._step)

    def _refused(self, why: str) -> None:
        if self.queue.name not in self.shovels.told:
            self.shovels.told.add(self.queue.name)
            log.warning("queue '%s': cannot move its messages into '%s' (its destination's partitioning "
                        "changed): %s", self.queue.name, self.target, why)
        self.stop()

    def _step(self) -> None:
        if self.stopped or self.move is None:
            return
        why = write_refusal(self.shovels.server.store)
        if why is not None:   # a copy's batch would fail while the removal is kept (store/batch.py)
            self.move.cancel(why)
            self.moved = self.move.report.moved
            self._refused(why)
            return
        done = self.move.step()
        self.moved = self.move.report.moved
        if not done:
            self.shovels.server.loop.call_soon(self._step)
            return
        log.info("queue '%s': %d message(s) moved into '%s'", self.queue.name, self.moved, self.target)
        self.stop()

    def stop(self, why: str | None = None) -> None:
        if not self.stopped:
            self.stopped = True
            self.shovels.stopped(self)
