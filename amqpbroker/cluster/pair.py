"""A node of a cluster that is an HA pair (`[cluster]` and `[ha]` together, docs/cluster.md).

The two brokers of the pair share one cluster node id (`[cluster] node_id`); the pair
elects its live broker as a pair alone does (ha/node.py, docs/ha.md).  The cluster side
(cluster/member.py) runs in the live broker only, made each time a broker of the pair
goes live and closed when it stops or is demoted:

* the backup holds no cluster session, no live znode, no inter-node listener: the
  other nodes never see it;
* a broker that goes live takes `live/<node_id>` with its own inter-node and AMQP
  addresses.  A live znode of the node that is still there (the old live broker's
  session, a killed broker's until its session expires) makes it wait, serving no
  slot (every attach refused `amqpbroker:resource-unavailable`): no slot is ever
  served by two brokers.  The activation sequence of the pair (core/ha.py) fences the
  store, the live znode fences the slots;
* the slot map names node ids, not brokers: nothing is reassigned or moved.  The other
  nodes connect to whatever address `live/<node_id>` names at each new connection
  (cluster/router.py `address_of`): their forwarded links to the old broker end
  `amqpbroker:resource-unavailable`, and the clients' next attaches reach the new one.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from ..config import Settings

log = logging.getLogger("amqpbroker.cluster")


def pair_settings(settings: Settings) -> Settings:
    """The pair's name under /amqpbroker in ZooKeeper: `[ha] cluster` when it is set,
    else `<cluster name>.<node id>`, so that the pairs of the nodes of one cluster
    never share a live lock."""
    ha, cfg = settings.ha, settings.cluster
    if "cluster" in ha.model_fields_set:
        return settings
    return settings.model_copy(update={"ha": ha.model_copy(update={"cluster": f"{cfg.name}.{cfg.node_id}"})})


class PairCompanion:
    """ha/node.py LiveCompanion: the node's cluster side in the live broker of the pair."""

    def __init__(self, settings: Settings, loop: asyncio.AbstractEventLoop):
        from .member import MemberSide
        self.side = MemberSide(settings, loop)
        self.loop = loop
        self.joining: asyncio.Task | None = None

    async def prepare(self, server: Any) -> None:
        await self.side.connect()
        self.side.attach(server)

    async def started(self, server: Any) -> None:
        await self.side.listen()
        # Taking the live znode waits while the previous live broker's session holds
        # it (one session timeout after a kill -9): meanwhile this broker is live for
        # the pair and serves no slot.  The pair's own loop must not wait for it.
        self.joining = self.loop.create_task(self.side.go_live())
        self.joining.add_done_callback(_told)

    async def close(self) -> None:
        if self.joining is not None and not self.joining.done():
            self.joining.cancel()
            await asyncio.gather(self.joining, return_exceptions=True)
        await self.side.close()


def _told(task: asyncio.Task) -> None:
    """A live broker's join that failed (a move refused behind a remapped map's gate,
    cluster/zkgate.py): it serves no client, and says why."""
    if not task.cancelled() and task.exception() is not None:
        log.error("cluster: this node serves no client: %s", task.exception())


async def run_pair(settings: Settings, loop: asyncio.AbstractEventLoop, config_file: Path | None = None,
                   overrides: dict | None = None) -> int:
    """cli.py's entry with [cluster] and [ha]: one broker of the node's pair."""
    from ..ha.node import run_node
    from .tls import node_tls
    cfg = settings.cluster
    try:
        node_tls(settings)   # a configuration to fix is told now, not at the first activation
    except (ValueError, OSError) as exc:
        log.error("cannot start node %s: %s", cfg.node_id, exc)
        return 2
    settings = pair_settings(settings)
    log.info("cluster: node %s is an HA pair (%s under /amqpbroker): its live broker serves the node",
             cfg.node_id, settings.ha.cluster)
    return await run_node(settings, loop, config_file, overrides,
                          companion_factory=lambda: PairCompanion(settings, loop))
