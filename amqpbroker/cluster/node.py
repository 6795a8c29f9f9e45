"""One node of a cluster: a BrokerServer with its own store, the router that forwards
what other nodes own (cluster/router.py), the inter-node listener where the other
nodes' forwarded links arrive (cluster/listener.py), and the shovels that take what
lands here to its owner (cluster/shovel.py).

`serve --workers N` runs N of these on one machine (cluster/workers.py), with a static
slot map and Unix sockets between them (`run_worker`); a `[cluster]` section makes this
broker one node of a cluster of machines, with the map and membership in ZooKeeper
(`run_member`, cluster/membership.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import Settings
from ..core.placement import DEFAULT_SLOTS, MisplacedSubscriptions, static_map
from .options import check_partitioned, cluster_options

log = logging.getLogger("amqpbroker.cluster")

# A node's exit status when it must not be started again as it is (its store holds
# what another node owns under this map): the supervisor stops every worker.
EXIT_REFUSED = 3
# A draining node's exit status once its store holds no message (cluster/workers.py).
EXIT_DRAINED = 4
DRAIN_LOOK = 0.5   # seconds between a draining node's looks at its queues


@dataclass
class WorkerSpec:
    """What the workers of one machine share (written by the supervisor, mode 0600)."""
    nodes: list[str]
    weights: dict[str, int]
    sockets: dict[str, str]     # node → inter-node address (`unix:@name`)
    secret: str                 # hex
    port: int                   # the shared AMQP port
    slots: int = DEFAULT_SLOTS
    node_ports: dict[str, int] = dataclasses.field(default_factory=dict)   # each node's own AMQP port
    gate: str = ""              # the start gate's directory (cluster/gate.py); "" none
    draining: list[str] = dataclasses.field(default_factory=list)   # weight-0 nodes being emptied

    @classmethod
    def read(cls, path: Path) -> "WorkerSpec":
        return cls(**json.loads(Path(path).read_text()))

    def write(self, path: Path) -> None:
        path = Path(path)
        path.touch(mode=0o600)
        path.chmod(0o600)
        path.write_text(json.dumps(dataclasses.asdict(self)))


def worker_settings(settings: Settings, spec: WorkerSpec, index: int) -> Settings:
    """A worker's own settings: its data dir (data/node-K), the shared port, and its
    own management port (the configured one + K; 0 stays 0: each a free one)."""
    mgmt = settings.management
    port = mgmt.port + index if mgmt.port else 0
    return settings.model_copy(update={
        "data_dir": settings.data_dir / f"node-{index}",
        "port": spec.port,
        "management": mgmt.model_copy(update={"port": port}),
    })


async def run_worker(settings: Settings, loop: asyncio.AbstractEventLoop, spec: WorkerSpec, index: int,
                     config_file: Path | None = None, overrides: dict | None = None) -> int:
    """Run worker `index` of `spec` until SIGTERM / SIGINT."""
    import lmdb

    from ..server.app import BrokerServer, install_signal_handlers
    from ..store.base import StoreError
    from .gate import StartGate
    from .listener import start_listener
    from .moves import MoveRefused, SubscriptionMoves
    from .router import Router
    from .shovel import Shovels

    node = spec.nodes[index]
    settings = worker_settings(settings, spec, index)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    pinned, partitioned = cluster_options(settings)
    slots = static_map(spec.nodes, spec.weights, spec.slots, pinned=pinned, partitioned=partitioned)
    secret = bytes.fromhex(spec.secret)
    stopped = asyncio.Event()
    install_signal_handlers(loop, stopped.set)   # before the start: a SIGTERM meanwhile stops it once up
    try:
        check_partitioned(slots)
        server = BrokerServer(settings, loop, config_file=config_file, overrides=overrides)
        server.reuse_port = True
        router = Router(server, node, slots, spec.sockets.__getitem__, secret)
        router.client_address = lambda n: (settings.host, spec.node_ports[n])
        router.redirect = settings.cluster is not None and settings.cluster.redirect
        if settings.cluster is None or settings.cluster.handoff:
            router.handoff_path = lambda n: _unix_path(spec.sockets[n]) + ".handoff"
        server.cluster = router
        router.moves_allowed = bool(spec.gate)
        gate = StartGate(spec.gate) if spec.gate else None
        server.prepare()
        if gate is not None:
            gate.mark(node, "recovered")
        inter, where = await start_listener(server, secret, unix_path=_unix_path(spec.sockets[node]))
        shovels = Shovels(server, server.cluster)
        shovels.start()
        if router.to_move:
            if gate is None or gate.is_open():   # clients are served already: a move could miss messages
                raise MisplacedSubscriptions(node, router.to_move)
            await _unless_stopped(SubscriptionMoves(server, shovels, router.to_move).start(), stopped)
        if gate is not None and not stopped.is_set():   # ready only once everything moved
            gate.mark(node, "ready")
            if node in spec.draining:   # never serves a client: its queues go to their owners, then it ends
                empty = await _drained(server, stopped)
                await _close(inter, shovels, server)
                return EXIT_DRAINED if empty else 0
            await gate.wait_open(stopped)
        if stopped.is_set():
            log.info("node %s stopped before it served", node)
            await _close(inter, shovels, server)
            return 0
        await server.listen()
        if router.handoff_path is not None:
            from .handoff import HandoffListener
            router.handoff_listener = HandoffListener(
                server, router.handoff_path(node), secret,
                lambda name: next((lst for lst in server.listeners if lst.name == name), None))
        # A port of this node alone (the shared one lands anywhere): for clients and
        # tests that must reach this node, and for placement redirects.
        main = server.listeners[0]
        own = dataclasses.replace(main, name="amqp-node", port=spec.node_ports.get(node, 0), server=None)
        own.server = await loop.create_server(server._protocol_factory(own), main.host, own.port,
                                              reuse_address=True, reuse_port=True)
        own.port = own.server.sockets[0].getsockname()[1]
        server.listeners.append(own)
    except (MisplacedSubscriptions, MoveRefused) as exc:
        log.error("cannot start node %s: %s", node, exc)
        return EXIT_REFUSED
    except (ValueError, OSError, StoreError) as exc:
        log.error("cannot start node %s: %s", node, exc)
        return 2
    except lmdb.Error as exc:
        log.error("cannot start node %s: store: %s: %s", node, type(exc).__name__, exc)
        return 2
    log.info("amqp-node listening on %s:%d (node %s)", own.host, own.port, node)
    if gate is not None:
        gate.mark(node, "serving")   # the supervisor stops a start only for a node that never got here
    log.info("cluster: node %s of %d, %d of %d slots, inter-node %s", node, len(spec.nodes),
             len(slots.slots_of(node)), slots.slots, where)
    from ..server.resources import tune_gc
    tune_gc()
    install_signal_handlers(loop, stopped.set, server.reloader.on_signal)   # SIGHUP: live reload, once started
    await stopped.wait()
    log.info("node %s shutting down", node)
    await _close(inter, shovels, server)
    return 0


async def _close(inter: Any, shovels: Any, server: Any) -> None:
    """A worker's stop: its inter-node and hand-off listeners, its shovels, its broker."""
    inter.close()
    if server.cluster.handoff_listener is not None:
        server.cluster.handoff_listener.close()
    shovels.close()
    await server.stop()


async def _drained(server: Any, stopped: asyncio.Event) -> bool:
    """Until no queue of this (draining) node holds a message (its shovels take each to
    its owner: cluster/shovel.py); False if a stop came first."""
    queues = server.broker.queues
    while any(q.depth for q in list(queues.values())):
        if stopped.is_set():
            return False
        await asyncio.sleep(DRAIN_LOOK)
    log.info("node %s holds no message any more: stopping", server.cluster.node)
    return True


def _unix_path(address: str) -> str:
    path = address[len("unix:"):]
    return "\0" + path[1:] if path.startswith("@") else path


__all__ = ["WorkerSpec", "run_worker", "worker_settings", "Any"]


async def _unless_stopped(step: Any, stopped: asyncio.Event) -> None:
    """Run `step` (a coroutine) unless a stop comes first: then it is cancelled."""
    task = asyncio.ensure_future(step)
    waiter = asyncio.ensure_future(stopped.wait())
    await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return
    task.result()


async def run_member(settings: Settings, loop: asyncio.AbstractEventLoop, config_file: Path | None = None,
                     overrides: dict | None = None) -> int:
    """Run this broker as node `[cluster] node_id` until SIGTERM / SIGINT."""
    import lmdb

    from ..server.app import BrokerServer, install_signal_handlers
    from ..store.base import StoreError
    from .member import MemberSide

    cfg = settings.cluster
    try:
        side = MemberSide(settings, loop)
    except (ValueError, OSError) as exc:
        log.error("cannot start node %s: %s", cfg.node_id, exc)
        return 2
    # Before the start, not after (as cli.py's plain broker): a SIGTERM while the node
    # starts stops it cleanly once it is up, or while it waits for its live znode.
    stopped = asyncio.Event()
    install_signal_handlers(loop, stopped.set)
    try:
        await side.connect()
    except ValueError as exc:   # the slot map and this node's configuration disagree (not in it, members)
        log.error("cannot start node %s: %s", cfg.node_id, exc)
        return 2
    except Exception as exc:
        log.error("cannot start node %s: ZooKeeper at %s: %s", cfg.node_id, cfg.zookeeper, exc)
        return 2
    try:
        server = BrokerServer(settings, loop, config_file=config_file, overrides=overrides)
        side.attach(server)
        await server.start()
        await side.listen()
    except (MisplacedSubscriptions, ValueError, OSError, StoreError, lmdb.Error) as exc:
        log.error("cannot start node %s: %s", cfg.node_id, exc)
        await side.membership.stop()
        return EXIT_REFUSED if isinstance(exc, MisplacedSubscriptions) else 2
    from .moves import MoveRefused
    try:
        await _unless_stopped(side.go_live(), stopped)   # behind a remapped map's gate: its moves first
    except MoveRefused as exc:
        log.error("cannot start node %s: %s", cfg.node_id, exc)
        await side.close()
        await server.stop()
        return EXIT_REFUSED
    from ..server.resources import tune_gc
    tune_gc()
    install_signal_handlers(loop, stopped.set, server.reloader.on_signal)   # SIGHUP: live reload, once started
    await stopped.wait()
    log.info("node %s shutting down", cfg.node_id)
    await side.close()
    await server.stop()
    return 0
