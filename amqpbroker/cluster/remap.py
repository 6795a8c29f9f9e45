"""`amqpbroker cluster remap --config node.toml`: a new slot map for a `[cluster]` of
machines, from the configuration's `nodes` and `weights` (docs/cluster.md, "Adding a
machine").  With every node stopped: the map is written once (compare-and-set on its
znode's version, which becomes the new epoch), and the nodes started under it move what
it took from each of them before any serves a client (cluster/zkgate.py).  A node left
out must have reported, at its last stop under the current map, that it held nothing
(`holds/<node>`, written by cluster/member.py; core/remap.py `check_leaving`), or be
known never to have served (`served/<node>` absent, cluster/membership.py): the map is
written in one ZooKeeper transaction with a check that each such node still has not, so
one that goes live meanwhile makes the remap fail rather than strand what it took.

The decision is core/remap.py's; here only ZooKeeper is read and written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..config import Settings
from ..core.placement import SlotMap
from ..core.remap import Remap, RemapRefused, check_leaving, describe, never_served, plan_remap
from .membership import read_holdings, served_path

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
    from kazoo.exceptions import NoNodeError

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
        unserved = never_served(current, [n for n in current["nodes"] if client.exists(served_path(root, n))])
        plan = plan_remap(current, cfg.nodes, cfg.weights, unserved=unserved)
        _check_partitioned(settings, plan)
        leaving = [n for n in current["nodes"] if n not in plan.nodes]
        if not force:
            check_leaving(leaving, {n: read_holdings(client, root, n) for n in leaving}, stat.version, unserved)
        text = describe(plan, stat.version) + "".join(f"\n  leaving: {n} ({_why_leaving(n, unserved, force)})"
                                                      for n in leaving)
        if not write:
            return RemapDone(plan, stat.version, text)
        new = _write(client, root, plan.as_map(current.get("pinned", [])), stat.version,
                     [n for n in leaving if n in unserved])
        late = _live(client, root)
        if late:   # started between the look and the write: it placed by the old map
            text += f"\nnode(s) {', '.join(late)} started meanwhile under the old map: stop and start them again"
        return RemapDone(plan, new.version, text)
    finally:
        client.stop()
        client.close()


def _why_leaving(node: str, unserved: frozenset[str], force: bool) -> str:
    if node in unserved:
        return "never served: it holds nothing"
    return "--force: not checked to be empty" if force else "reported empty"


def _write(client: Any, root: str, record: dict, version: int, unserved: list[str]) -> Any:
    """The new map, compare-and-set on the current one's version, in one transaction
    with a check that each node left out as never served still has not (its `served`
    znode made and deleted again: that fails if it is there)."""
    from kazoo.exceptions import BadVersionError, NodeExistsError
    if unserved:
        client.ensure_path(f"{root}/served")
    txn = client.transaction()
    for node in unserved:
        txn.create(served_path(root, node))
        txn.delete(served_path(root, node))
    txn.set_data(f"{root}/map", json.dumps(record).encode(), version=version)
    results = txn.commit()
    if any(isinstance(r, BadVersionError) for r in results):
        raise RemapRefused("the slot map changed meanwhile (another remap?): look again and run it again")
    if any(isinstance(r, NodeExistsError) for r in results):
        raise RemapRefused(f"node(s) {', '.join(unserved)} went live meanwhile: they may hold something now; "
                           f"look again and run it again")
    failed = next((r for r in results if isinstance(r, Exception)), None)
    if failed is not None:
        raise failed
    return results[-1]


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
