"""A node's view of the live nodes (cluster/membership.py) ends at ZooKeeper's latest
state, whatever order the reads behind two watch events finish in.

Found under load by tests/e2e/test_cluster_pair.py (a pair's backup took node a over,
and node b went on connecting to the old live broker's address: "node a cannot be
reached ... Connection refused").  Two reads of the live nodes, one per ZooKeeper
event, ran side by side; the earlier one (the old broker's data) finished last and its
view stayed.  The ZooKeeper side is a stand-in here (the race needs one read held back
on purpose); the same path with a real ZooKeeper runs in tests/e2e/test_cluster_pair.py.
"""

from __future__ import annotations

import asyncio
import json
import threading

import kazoo.recipe.watchers as watchers

from amqpbroker.cluster.membership import Membership
from amqpbroker.config import ClusterConfig

OLD = {"inter": "127.0.0.1:1111", "amqp": "127.0.0.1:5671"}
NEW = {"inter": "127.0.0.1:2222", "amqp": "127.0.0.1:5672"}


class LiveNodes:
    """ZooKeeper's /live children as a node reads them: the first read of node a is
    held until `release` (it read the old broker's data), later reads see the new."""

    def __init__(self):
        self.release = threading.Event()
        self.first_read_started = threading.Event()
        self.reads = 0
        self.lock = threading.Lock()

    def get_children(self, path, watch=None):
        return ["a", "b"]

    def get(self, path):
        node = path.rsplit("/", 1)[1]
        if node == "b":
            return json.dumps(NEW).encode(), None
        with self.lock:
            self.reads += 1
            first = self.reads == 1
        if first:
            self.first_read_started.set()
            self.release.wait(10)
            return json.dumps(OLD).encode(), None
        return json.dumps(NEW).encode(), None


def test_two_watch_events_end_with_the_latest_state(monkeypatch):
    events = []
    monkeypatch.setattr(watchers, "ChildrenWatch", lambda client, path, func: events.append(func))
    loop = asyncio.new_event_loop()
    try:
        cfg = ClusterConfig(zookeeper="127.0.0.1:1", name="t", node_id="b", nodes=["a", "b"],
                            secret="cluster-test-secret-0123456789")
        membership = Membership(cfg, loop)
        zk = membership.client = LiveNodes()
        membership.watch()
        [changed] = events

        async def scenario():
            changed(["a", "b"])                  # a's znode as the old live broker made it
            await loop.run_in_executor(None, zk.first_read_started.wait, 10)
            changed(["a", "b"])                  # deleted and made again by the new one
            for _ in range(200):                 # the second event's read is answered
                await asyncio.sleep(0.01)
                if membership.live.get("a") == NEW:
                    break
            zk.release.set()                     # then the first read's (old data)
            for _ in range(200):
                await asyncio.sleep(0.01)
                if zk.reads >= 2 and getattr(membership, "_refreshing", None) is None and \
                        len(asyncio.all_tasks(loop)) <= 1:
                    break

        loop.run_until_complete(scenario())
        assert membership.live["a"] == NEW, "the view kept the replaced broker's address"
    finally:
        loop.close()
