"""The cluster side of one `[cluster]` node's broker: its ZooKeeper membership, the
router that forwards what other nodes own, the inter-node listener and the shovels,
put around a BrokerServer in four steps:

  connect(server-less)   the ZooKeeper session and the slot map
  attach(server)         the router becomes the server's ClusterPort (before start)
  listen()               the inter-node listener (after start)
  go_live()              take the node's live znode (waits while another process of
                         the node's name holds it), then watch the others, shovel
  close()                serve nothing, delete the live znode (session closed), stop

A plain node (node.py `run_member`) runs them in a row.  A node that is an HA pair
(cluster/pair.py) runs them in the live broker of the pair only, each time a broker of
the pair goes live, and closes them when it stops or is demoted: the backup has no
session, no znode and no listener, and a broker that takes over registers the same
node id with its own addresses once the old one's znode is gone.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..config import Settings
from ..core.placement import SlotMap

log = logging.getLogger("amqpbroker.cluster")


class MemberSide:
    def __init__(self, settings: Settings, loop: asyncio.AbstractEventLoop):
        from .tls import node_tls
        self.settings = settings
        self.cfg = settings.cluster
        self.loop = loop
        self.secret = self.cfg.secret.encode()
        self.tls = node_tls(settings)       # ValueError / OSError: a configuration to fix
        self.membership: Any = None
        self.slots: SlotMap | None = None
        self.router: Any = None
        self.server: Any = None
        self.inter: asyncio.AbstractServer | None = None
        self.where = ""
        self.shovels: Any = None
        self.gate: Any = None               # zkgate.ZkGate while this node waits at it

    async def connect(self) -> None:
        """The ZooKeeper session and the slot map (raises when ZooKeeper cannot be had)."""
        from .membership import Membership
        from .options import check_partitioned, cluster_options
        self.membership = Membership(self.cfg, self.loop)
        try:
            await self.membership.start()
            slots = await self.membership.slot_map()
            pinned, partitioned = cluster_options(self.settings)
            self.slots = SlotMap(slots.owners, slots.live, slots.epoch, slots.pinned | pinned, partitioned)
            check_partitioned(self.slots)
            await self._gate()
        except BaseException:
            await self.membership.stop()
            raise

    async def _gate(self) -> None:
        """A map made by a remap whose start gate is still shut: this node moves what
        the map took from it and serves no client until every node has (zkgate.py)."""
        from .zkgate import ZkGate
        m = self.membership
        if not m.gated:
            return
        gate = ZkGate(m, self.slots.epoch, m.map_nodes)
        if not await gate.is_open():
            self.gate = gate

    def _address_of(self, node: str) -> str:
        # Asked at each connection to a node: after a node's pair failed over, its
        # live znode names the new live broker's address.
        info = self.membership.live.get(node)
        if info is None:
            raise OSError(f"node {node} is not live")
        return info["inter"]

    def attach(self, server: Any) -> None:
        from .router import Router
        cfg, membership = self.cfg, self.membership
        self.server = server
        router = self.router = Router(server, cfg.node_id, self.slots, self._address_of, self.secret)
        router.serving = False            # until our live znode is held
        router.redirect = cfg.redirect
        router.tls = self.tls
        router.client_address = lambda n: tuple(membership.live[n]["amqp"].rsplit(":", 1))
        router.membership = membership
        if self.gate is not None:
            # Its misplaced subscriptions move (cluster/moves.py) instead of refusing the start.
            router.moves_allowed = True
            router.gate = (f"node {cfg.node_id} serves no client until every node has taken its place in the "
                           f"new slot map (epoch {self.slots.epoch}: `amqpbroker cluster remap`)")
        server.cluster = router

    async def listen(self) -> None:
        from .listener import start_listener
        cfg, tls = self.cfg, self.tls
        self.inter, self.where = await start_listener(self.server, self.secret, host=cfg.listen_host,
                                                      port=cfg.listen_port,
                                                      ssl_context=tls.server if tls is not None else None)

    async def go_live(self) -> None:
        from .shovel import Shovels
        router, membership, cfg = self.router, self.membership, self.cfg

        def changed() -> None:
            router.slots = router.slots.with_live(membership.live)

        def serving(yes: bool) -> None:
            router.serving = yes

        membership.on_change = changed
        membership.on_serving = serving
        main = self.server.listeners[0]
        amqp = cfg.advertised_amqp or f"{main.host}:{main.port}"   # what clients are told (redirects, Spark)
        # What it held at its last stop is unknown from now on (cluster/remap.py): before
        # it can serve, and again once live (a broker of its pair that stopped cleanly
        # reports while it still holds the live znode this one waits for).
        await membership.forget_holdings()
        await membership.go_live({"inter": cfg.advertised or self.where, "amqp": amqp})
        await membership.forget_holdings()
        membership.watch()
        self.shovels = Shovels(self.server, router)
        self.shovels.start()
        if self.gate is not None:
            await self._through_gate()
        log.info("cluster: node %s of %s, %d of %d slots (slot map epoch %d), inter-node %s%s", cfg.node_id,
                 ", ".join(membership.map_nodes or cfg.nodes), len(self.slots.slots_of(cfg.node_id)),
                 self.slots.slots, self.slots.epoch, self.where, " (TLS)" if self.tls is not None else "")

    async def _through_gate(self) -> None:
        """Move out the subscriptions whose topics other nodes own now, say so, and wait
        for every node to have done the same; then serve clients."""
        from .moves import SubscriptionMoves
        router, gate = self.router, self.gate
        if router.to_move:
            await SubscriptionMoves(self.server, self.shovels, router.to_move).start()
            router.to_move = []
        await gate.mark_ready(self.cfg.node_id)
        await gate.wait_open()
        router.gate = None
        self.gate = None
        log.info("cluster: node %s serves clients under slot map epoch %d", self.cfg.node_id, gate.epoch)

    async def _report_holdings(self) -> None:
        from ..core.remap import Holdings
        queues = [q for q in self.server.broker.queues.values() if q.durable]
        subs = {s.queue_name for s in self.server.subscriptions.subscriptions.values() if s.durable}
        held = Holdings(self.slots.epoch, sum(q.depth for q in queues), len(subs),
                        tuple(q.name for q in queues if q.depth and q.name not in subs)[:5])
        try:
            # Bounded: a stop does not wait on a ZooKeeper that is away or paused.
            await asyncio.wait_for(self.membership.report_holdings(held.as_record()),
                                   self.cfg.zookeeper_session_timeout)
        except Exception as exc:   # the report is missing: a remap leaving this node out is refused
            log.warning("cluster: node %s could not report what it holds: %s", self.cfg.node_id, exc)
            return
        log.info("cluster: node %s stops holding %d message(s) and %d durable subscription(s) (slot map epoch %d)",
                 self.cfg.node_id, held.messages, held.subscriptions, held.epoch)

    async def close(self) -> None:
        """Serve nothing more, report what this node holds (while its live znode is
        still its own: a broker of its pair that takes over deletes the report only
        after); closing the session deletes the live znode at once."""
        if self.router is not None:
            self.router.serving = False
        if self.membership is not None:
            if self.membership.holding and self.server is not None:
                await self._report_holdings()
            await self.membership.stop()
        if self.inter is not None:
            self.inter.close()
        if self.shovels is not None:
            self.shovels.close()
