"""The ZooKeeper side of a `[cluster]` node (kazoo): the slot map, who is live, fencing.

Layout under /amqpbroker-cluster/<name>:
  map          persistent JSON {"nodes", "weights", "slots", "owners", "pinned", "unstarted"}: the slot
               map, made from the configuration by the first node that finds none
               (create-if-absent: one of them wins, the others read it).  Its znode
               version is the map's epoch (core/placement.SlotMap.epoch): nodes speak to
               each other only under the same epoch (cluster/wire.py).  Written again
               only by `amqpbroker cluster remap` (cluster/remap.py, compare-and-set,
               with every node stopped), with "gate": true.
  gate/<epoch> the start gate of a remapped map (cluster/zkgate.py).
  live/<node>  ephemeral JSON {"inter", "amqp"}: the node serves its slots while it holds
               it (the lock recipe without a queue); it goes with the node's session, so
               a node killed or cut off loses it one session timeout later, and its slots
               are unavailable (`amqpbroker:resource-unavailable`) until it is back.  A
               second process with the same node name waits until the first is gone:
               no slot is ever served by two processes.
  holds/<node> persistent JSON {"epoch", "messages", "subscriptions", "queues"}: what
               the node held at its last clean stop (core/remap.py Holdings), deleted
               as it goes live again; `cluster remap` leaves out only a node whose
               report says it held nothing under the current map.
  served/<node> persistent, written before the node first takes its live znode and
               never deleted: a node of the map's "unstarted" list without it has never
               served, so holds nothing, and a remap may leave it out at once
               (core/remap.py never_served).

While its session is in doubt (SUSPENDED) a node goes on for one session timeout (no
other process can take its live znode before the session expires), then, and as soon
as the session is lost, it serves nothing new (every attach is refused unavailable)
until it holds its live znode again.  No consensus is
made here: ZooKeeper's create-if-absent, ephemeral nodes and versions do it all.

kazoo runs its own threads; every blocking call runs in the loop's default executor and
watches come back to the loop with call_soon_threadsafe.  Nothing imports kazoo unless
[cluster] is configured.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Callable

from ..config import ClusterConfig
from ..core.placement import SlotMap, spread
from ..core.remap import Holdings, map_record

log = logging.getLogger("amqpbroker.cluster")

RETRY = 0.5   # seconds between attempts to take the live znode


def holds_path(root: str, node: str) -> str:
    """The znode of what `node` reported holding at its last clean stop."""
    return f"{root}/holds/{node}"


def served_path(root: str, node: str) -> str:
    """The znode that says `node` has gone live at least once."""
    return f"{root}/served/{node}"


def read_holdings(client: Any, root: str, node: str) -> Holdings | None:
    """`node`'s report (a blocking kazoo read); None when it has none or one that cannot
    be read (as good as none: the node is not known to be empty).  Other errors (the
    session in doubt) are raised."""
    from kazoo.exceptions import NoNodeError
    try:
        data, _ = client.get(holds_path(root, node))
        return Holdings.from_record(json.loads(data))
    except NoNodeError:
        return None
    except (ValueError, KeyError, TypeError):
        return None


class Membership:
    def __init__(self, cfg: ClusterConfig, loop: asyncio.AbstractEventLoop):
        from kazoo.client import KazooClient   # only with [cluster]

        self.cfg = cfg
        self.loop = loop
        self.root = f"/amqpbroker-cluster/{cfg.name}"
        self.map_path = f"{self.root}/map"
        self.live_path = f"{self.root}/live"
        self.me = f"{self.live_path}/{cfg.node_id}"
        self.holds = holds_path(self.root, cfg.node_id)   # its report at its last stop (report_holdings)
        self.served = served_path(self.root, cfg.node_id)  # it has gone live once (_mark_served)
        self.client = KazooClient(hosts=cfg.zookeeper, timeout=cfg.zookeeper_session_timeout)
        self.session = "LOST"
        self.live: dict[str, dict] = {}          # node → its live znode's data
        self.info: dict = {}                     # ours
        self.holding = False                     # we hold our live znode (in this session)
        self.on_change: Callable[[], None] = lambda: None
        self.on_serving: Callable[[bool], None] = lambda serving: None
        self.client.add_listener(self._listener)
        self._stopping = False
        self._taking = False
        self._fence_timer: asyncio.TimerHandle | None = None
        self._stale = False                      # the live nodes changed since the last read
        self._refreshing: asyncio.Task | None = None
        self.watching = False
        self.map_nodes: list[str] = []           # the slot map's nodes (slot_map)
        self.reports: dict[str, Holdings | None] = {}   # node not live → its report at its last stop
        self.gated = False

    async def _call(self, fn: Callable, *args: Any) -> Any:
        return await self.loop.run_in_executor(None, fn, *args)

    # ------------------------------------------------------------------ session

    async def start(self, timeout: float = 15.0) -> None:
        await self._call(lambda: self.client.start(timeout))
        self.session = "CONNECTED"
        await self._call(self.client.ensure_path, self.live_path)

    def _listener(self, state: Any) -> None:   # kazoo's thread: never block here
        self.loop.call_soon_threadsafe(self._state_changed, str(state))

    def _state_changed(self, state: str) -> None:
        if state == self.session or self._stopping:
            return
        previous, self.session = self.session, state
        if self._fence_timer is not None:
            self._fence_timer.cancel()
            self._fence_timer = None
        if state == "SUSPENDED":
            # In doubt: our live znode lasts as long as the session, which ZooKeeper
            # keeps for a session timeout without us; until then no other process of our
            # name can take it, so we go on, and stop serving once that time has passed.
            log.warning("cluster: ZooKeeper session SUSPENDED: node %s stops serving in %.1f s unless it is back",
                        self.cfg.node_id, self.cfg.zookeeper_session_timeout)
            self._fence_timer = self.loop.call_later(self.cfg.zookeeper_session_timeout, self._fence,
                                                     "no ZooKeeper for a session timeout")
            return
        if state != "CONNECTED":
            self.holding = False
            self._fence(f"ZooKeeper session {state}")
            return
        log.info("cluster: ZooKeeper session CONNECTED (was %s)", previous)
        if self.watching:
            # kazoo's ChildrenWatch, set again after a lost connection, says nothing
            # when the list of names is the same: a node replaced meanwhile would keep
            # its old address here.
            self.refresh_soon()
        if self.holding:
            self.on_serving(True)         # the same session: our live znode is still ours
        else:
            self.loop.create_task(self._take_live())   # a new session: take it again

    def _fence(self, why: str) -> None:
        self._fence_timer = None
        log.warning("cluster: node %s serves nothing new until it holds its live node again (%s)",
                    self.cfg.node_id, why)
        self.on_serving(False)

    async def stop(self) -> None:
        """Closing the session deletes our live znode at once: our slots are known to
        be unavailable without waiting for a session timeout."""
        self._stopping = True
        try:
            await self._call(self.client.stop)
            await self._call(self.client.close)
        except Exception as exc:
            log.warning("cluster: closing the ZooKeeper session: %s", exc)

    # ------------------------------------------------------------------ what it holds

    async def forget_holdings(self) -> None:
        """Serving: what this node held at its last stop is no longer known
        (cluster/remap.py leaves out only a node that reported being empty).  A stale
        report left behind could let a remap drop a node that holds messages: tried
        until it is gone (session in doubt) or the node stops."""
        from kazoo.exceptions import NoNodeError
        while not self._stopping:
            try:
                await self._call(self.client.delete, self.holds)
                return
            except NoNodeError:
                return
            except Exception as exc:
                log.warning("cluster: deleting node %s's report of what it held: %s", self.cfg.node_id, exc)
                await asyncio.sleep(RETRY)

    async def report_holdings(self, record: dict) -> None:
        """At a clean stop, while the live znode is still ours: what this node holds."""
        from kazoo.exceptions import NodeExistsError
        data = json.dumps(record).encode()
        try:
            await self._call(lambda: self.client.create(self.holds, data, makepath=True))
        except NodeExistsError:
            await self._call(self.client.set, self.holds, data)

    # ------------------------------------------------------------------ the slot map

    async def slot_map(self) -> SlotMap:
        from kazoo.exceptions import NodeExistsError
        cfg = self.cfg
        weights = {n: cfg.weights.get(n, 1) for n in cfg.nodes}
        wanted = map_record(cfg.nodes, weights, spread(cfg.nodes, weights, cfg.slots), cfg.pinned_exchanges,
                            unstarted=cfg.nodes)
        try:
            await self._call(self.client.create, self.map_path, json.dumps(wanted).encode())
            log.info("cluster: slot map made (%d slots over %s)", cfg.slots, ", ".join(cfg.nodes))
        except NodeExistsError:
            pass
        data, stat = await self._call(self.client.get, self.map_path)
        found = json.loads(data)
        if found["nodes"] != cfg.nodes or found["weights"] != weights:
            log.warning("cluster: the slot map in ZooKeeper (nodes %s, weights %s) is not this node's "
                        "configuration (%s, %s): the map wins", found["nodes"], found["weights"], cfg.nodes,
                        weights)
        if cfg.node_id not in found["nodes"]:
            raise ValueError(f"node '{cfg.node_id}' is not in the cluster's slot map (nodes {found['nodes']}): "
                             f"`amqpbroker cluster remap` makes a map with it (docs/cluster.md)")
        self.map_nodes = list(found["nodes"])
        self.gated = bool(found.get("gate"))     # made by a remap: cluster/zkgate.py
        return SlotMap(tuple(found["owners"]), frozenset(), stat.version, frozenset(found.get("pinned", ())))

    # ------------------------------------------------------------------ live nodes

    async def go_live(self, info: dict) -> None:
        """Hold our live znode (waits while another process of our name holds it)."""
        self.info = info
        await self._take_live()

    async def _take_live(self) -> None:
        if self._taking or not self.info:
            return
        self._taking = True
        try:
            await self._take_live_once()
        finally:
            self._taking = False

    async def _take_live_once(self) -> None:
        from kazoo.exceptions import NodeExistsError, NoNodeError
        waited = marked = False
        while not self._stopping:
            try:
                if not marked:
                    await self._call(self._mark_served)
                    marked = True
                await self._call(lambda: self.client.create(self.me, json.dumps(self.info).encode(),
                                                            ephemeral=True))
                return self._live_now()
            except NodeExistsError:
                try:
                    _, stat = await self._call(self.client.get, self.me)
                    if stat.ephemeralOwner == (self.client.client_id or (None,))[0]:
                        return self._live_now()   # ours already (a create answered late)
                except NoNodeError:
                    continue
                if not waited:
                    log.warning("cluster: node %s is live elsewhere (another process, or this one's "
                                "previous session): waiting for it to go", self.cfg.node_id)
                    waited = True
            except Exception as exc:   # session in doubt: try again
                log.warning("cluster: taking the live node: %s", exc)
            await asyncio.sleep(RETRY)

    def _mark_served(self) -> None:
        """Before the node first goes live (kazoo, blocking): from then on it may hold
        something, and a remap leaves it out only once it reported being empty."""
        from kazoo.exceptions import NodeExistsError
        try:
            self.client.create(self.served, b"", makepath=True)
        except NodeExistsError:
            pass

    def _live_now(self) -> None:
        self.holding = True
        log.info("cluster: node %s is live (%s)", self.cfg.node_id, self.info.get("inter"))
        self.on_serving(True)

    def watch(self) -> None:
        """Keep `live` current (and call on_change) as nodes come and go."""
        from kazoo.recipe.watchers import ChildrenWatch

        def changed(children: list[str]) -> None:   # kazoo's thread
            self.loop.call_soon_threadsafe(self.refresh_soon)

        self.watching = True
        ChildrenWatch(self.client, self.live_path, changed)

    def refresh_soon(self) -> None:
        """Read the live nodes again, one read at a time, each from ZooKeeper's present
        state (not a watch event's list), and once more if asked while one runs.
        Reads that ran side by side could end out of order and leave an older view in
        place: a pair's node at the address of the broker it replaced (its znode
        deleted and made again between two events), or a node gone that was back."""
        self._stale = True
        if self._refreshing is None and not self._stopping:
            self._refreshing = self.loop.create_task(self._refresh_until_current())

    async def _refresh_until_current(self) -> None:
        try:
            while self._stale and not self._stopping:
                self._stale = False
                try:
                    children = await self._call(self.client.get_children, self.live_path)
                except Exception as exc:   # session in doubt: the next CONNECTED reads again
                    log.warning("cluster: reading the live nodes: %s", exc)
                    if self.session == "CONNECTED":
                        self.loop.call_later(RETRY, self.refresh_soon)
                    return
                await self._refresh(children)
        finally:
            self._refreshing = None

    async def _refresh(self, children: list[str]) -> None:
        from kazoo.exceptions import NoNodeError
        live = {}
        for child in children:
            try:
                data, _ = await self._call(self.client.get, f"{self.live_path}/{child}")
                live[child] = json.loads(data)
            except (NoNodeError, ValueError):
                continue
        gone, came = set(self.live) - set(live), set(live) - set(self.live)
        self.live = live
        for node in sorted(came):
            log.info("cluster: node %s is live", node)
        for node in sorted(gone):
            log.warning("cluster: node %s is gone: its slots are unavailable until it is back", node)
        self.on_change()
        await self._read_reports([n for n in self.map_nodes if n not in live])

    async def _read_reports(self, stopped: list[str]) -> None:
        """What each node that is not live reported at its last stop (GET /api/cluster
        shows it: whether a node about to leave the map is empty).  Written before its
        live znode goes, so it is there when the node is seen gone."""
        reports: dict[str, Holdings | None] = {}
        for node in stopped:
            try:
                reports[node] = await self._call(read_holdings, self.client, self.root, node)
            except Exception as exc:   # session in doubt: the next change reads again
                log.debug("cluster: reading node %s's report: %s", node, exc)
                return
        self.reports = reports

    def describe(self) -> dict:
        return {"zookeeper": self.cfg.zookeeper, "session": self.session, "path": self.root,
                "live": sorted(self.live)}
