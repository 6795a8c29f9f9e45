"""The start gate of a `[cluster]` slot map made by `amqpbroker cluster remap`: no node
serves a client under it until every node of it has moved out what the map took from
it (the ZooKeeper counterpart of cluster/gate.py, which `serve --workers` keeps in
files on one machine).

Under /amqpbroker-cluster/<name>/gate/<epoch> (persistent znodes, so that a node that
crashes after its moves need not do them again, and one started later finds the gate
as it is):

  ready/<node>   the node's durable subscriptions whose topics other nodes own now are
                 there (cluster/moves.py), backlog and all
  open           every node of the map is ready: made by whichever node sees that first
                 (create-if-absent), never removed

Meanwhile each node holds its live znode and inter-node listener (the moves, the
shovels and the other nodes' look-ups reach it) and refuses clients' attaches
`amqpbroker:resource-unavailable` naming the gate (cluster/router.py `gate`): nothing is
published to a topic whose subscriptions are still on their way, so none misses a
message.  A node that never comes keeps the gate shut: start it, or remap again
without it (core/remap.py says when a node may leave).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("amqpbroker.cluster")

LOOK = 0.25   # seconds between looks at the gate while it is shut


class ZkGate:
    def __init__(self, membership: Any, epoch: int, nodes: list[str]):
        self.membership = membership
        self.epoch = epoch
        self.nodes = list(nodes)            # every node of the map: each must be ready
        self.path = f"{membership.root}/gate/{epoch}"

    async def is_open(self) -> bool:
        m = self.membership
        return bool(await m._call(m.client.exists, f"{self.path}/open"))

    async def mark_ready(self, node: str) -> None:
        m = self.membership
        await m._call(m.client.ensure_path, f"{self.path}/ready/{node}")
        log.info("cluster: node %s is ready under slot map epoch %d (what it no longer owns has moved)",
                 node, self.epoch)

    async def wait_open(self) -> None:
        """Until the gate is open; opens it once every node is ready.  A ZooKeeper call
        that fails (session in doubt) is tried again at the next look."""
        from kazoo.exceptions import NodeExistsError, NoNodeError
        m = self.membership
        told: list[str] = []
        while True:
            try:
                if await self.is_open():
                    return
                ready = set(await m._call(m.client.get_children, f"{self.path}/ready"))
                waiting = [n for n in self.nodes if n not in ready]
                if not waiting:
                    try:
                        await m._call(m.client.create, f"{self.path}/open", b"")
                        log.info("cluster: every node is ready under slot map epoch %d: the gate is open",
                                 self.epoch)
                    except NodeExistsError:
                        pass
                    return
                if waiting != told:
                    log.info("cluster: slot map epoch %d: waiting for node(s) %s to be ready before serving "
                             "clients", self.epoch, ", ".join(waiting))
                    told = waiting
            except NoNodeError:
                pass
            except Exception as exc:   # session in doubt
                log.warning("cluster: looking at the start gate: %s", exc)
            await asyncio.sleep(LOOK)
