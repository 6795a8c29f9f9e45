"""`amqpbroker cluster remap --config node.toml`: a new slot map for a `[cluster]` of
machines, from the configuration's `nodes` and `weights` (docs/cluster.md, "Adding a
machine").  With every node stopped: the map is written once (compare-and-set on its
znode's version, which becomes the new epoch), and the nodes started under it move what
it took from each of them before any serves a client (cluster/zkgate.py).  A node left
out must have reported, at its last stop under the current map, that it held nothing
(`holds/<node>`, written by cluster/member.py; core/remap.py `check_leaving`).

The decision is core/remap.py's; here only ZooKeeper is read and written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..config import Settings
from ..core.placement import SlotMap
from ..core.remap import Remap, RemapRefused, check_leaving, describe, plan_remap
from .membership import read_holdings

TIMEOUT = 15.0


@dataclass
class RemapDone:
    plan: Remap
    epoch: int          # the new map's epoch
    text: str


def remap(settings: Settings, *, write: bool = True, force: bool = False) -> RemapDone:
    """Plan (and with `write`, write) the new map.  RemapRefused: what would strand or
    lose something (a node left out that has not reported being empty, unless `force`),
    a node still live, the map changed meanwhile; OSError: ZooKeeper cannot be had."""
    from kazoo.client import KazooClient
    from kazoo.exceptions import BadVersionError, NoNodeError

    cfg = settings.cluster
    root = f"/amqpbroker-cluster/{cfg.name}"
    client = KazooClient(hosts=cfg.zookeeper, timeout=TIMEOUT)
    try:
        client.start(TIMEOUT)
    except Exception as exc:
        raise OSError(f"ZooKeeper at {cfg.zookeeper}: {exc}") from None
    try:
        try:
            data, stat = client.get(f"{root}/map")
        except NoNodeError:
            raise RemapRefused(f"cluster '{cfg.name}' has no slot map yet: the first node to start makes it "
                               f"from its configuration") from None
        current = json.loads(data)
        live = _live(client, root)
        if live:
            raise RemapRefused(f"stop every node first (a node serving under the old map would place addresses "
                               f"differently): live now: {', '.join(live)}")
        plan = plan_remap(current, cfg.nodes, cfg.weights)
        _check_partitioned(settings, plan)
        leaving = [n for n in current["nodes"] if n not in plan.nodes]
        if not force:
            check_leaving(leaving, {n: read_holdings(client, root, n) for n in leaving}, stat.version)
        text = describe(plan, stat.version)
        if leaving:
            text += f"\n  leaving: {', '.join(leaving)}" + (" (--force: not checked to be empty)" if force else "")
        if not write:
            return RemapDone(plan, stat.version, text)
        try:
            new = client.set(f"{root}/map", json.dumps(plan.as_map(current.get("pinned", []))).encode(),
                             version=stat.version)
        except BadVersionError:
            raise RemapRefused("the slot map changed meanwhile (another remap?): look again and run it again") \
                from None
        late = _live(client, root)
        if late:   # started between the look and the write: it placed by the old map
            text += f"\nnode(s) {', '.join(late)} started meanwhile under the old map: stop and start them again"
        return RemapDone(plan, new.version, text)
    finally:
        client.stop()
        client.close()


def _live(client: Any, root: str) -> list[str]:
    from kazoo.exceptions import NoNodeError
    try:
        return sorted(client.get_children(f"{root}/live"))
    except NoNodeError:
        return []


def _check_partitioned(settings: Settings, plan: Remap) -> None:
    """A partitioned destination needs as many owning nodes as it has members, as at a
    node's start (cluster/options.py): refused here rather than by every node."""
    from .options import check_partitioned, cluster_options
    _, partitioned = cluster_options(settings)
    try:
        check_partitioned(SlotMap(plan.owners, partitioned=partitioned))
    except ValueError as exc:
        raise RemapRefused(str(exc)) from None
