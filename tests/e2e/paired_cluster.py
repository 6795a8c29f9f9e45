"""A `[cluster]` whose node a is an HA pair (docs/cluster.md "A node as an HA pair"):
a real ZooKeeper, a's two brokers (primary and backup sharing node id a) and a plain
node b, each a real broker process with a fixed AMQP port (so that a client can
connect again to the same address after a restart).

Used by the deterministic cases (tests/e2e/test_cluster_pair.py) and the seeded
nemesis (tests/faults/test_pair_cluster_nemesis.py), which passes its own broker
class (one that keeps the log lines of every incarnation).
"""

from __future__ import annotations

import json
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from amqpbroker.core.placement import slot_of, static_map
from tests.e2e.ha_harness import HaBroker, ZooKeeper, free_port, pair_config, zookeeper_jar

SECRET = "cluster-test-secret-0123456789"
NODES = ("a", "b")
OWNERS = static_map(list(NODES), {}).owners
CLUSTER_SESSION_TIMEOUT = 4.0

MakeBroker = Callable[[str, Path, str, int], HaBroker]


def owned_by(node: str, prefix: str = "q") -> str:
    """A fresh queue name whose slot node `node` owns."""
    while True:
        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        if OWNERS[slot_of(name)] == node:
            return name


def cluster_section(zk: ZooKeeper, name: str, node: str,
                    session_timeout: float = CLUSTER_SESSION_TIMEOUT, nodes: tuple[str, ...] = NODES) -> str:
    listed = ", ".join(f'"{n}"' for n in nodes)
    return ("[cluster]\n"
            f'zookeeper = "{zk.hosts}"\nzookeeper_session_timeout = {session_timeout}\nname = "{name}"\n'
            f'node_id = "{node}"\nnodes = [{listed}]\nlisten_port = 0\nsecret = "{SECRET}"\n')


class PairedCluster:
    """ZooKeeper, node a's pair (`pair["primary"]`, `pair["backup"]`) and node b."""

    def __init__(self, tmp_path: Path, make_broker: MakeBroker = HaBroker):
        self.tmp = tmp_path
        self.name = f"c{uuid.uuid4().hex[:8]}"
        self.make_broker = make_broker
        self.zk: ZooKeeper | None = None
        self.pair: dict[str, HaBroker] = {}
        self.b: HaBroker | None = None
        self.others: list[HaBroker] = []   # brokers a test adds (stopped with the rest)

    def start(self) -> "PairedCluster":
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> "PairedCluster":
        self.zk = ZooKeeper(self.tmp / "zk").start()
        cluster = cluster_section(self.zk, self.name, "a")
        for name, role in (("primary", "primary"), ("backup", "backup")):
            port = free_port()
            config = pair_config(self.zk, "unused", role, port).replace('cluster = "unused"\n', "") + cluster
            self.pair[name] = self.make_broker(name, self.tmp / name, config, port)
        self.pair["primary"].start().wait_live()
        self.pair["primary"].wait_for_log(r"cluster: node a is live \(", 30)
        self.pair["backup"].start().wait_for_log("in sync with the live broker", 60)
        port = free_port()
        self.b = self.make_broker("b", self.tmp / "b", f"port = {port}\n" + cluster_section(self.zk, self.name, "b"),
                                  port)
        self.b.start(wait=False)
        self.b.wait_for_log(r"cluster: node b is live \(", timeout=40)
        self.b.wait_for_log(r"cluster: node a is live$", timeout=30)
        return self

    def live_znode(self, node: str) -> dict | None:
        from kazoo.client import KazooClient
        from kazoo.exceptions import NoNodeError
        client = KazooClient(hosts=self.zk.hosts)
        client.start(15)
        try:
            data, _ = client.get(f"/amqpbroker-cluster/{self.name}/live/{node}")
            return json.loads(data)
        except NoNodeError:
            return None
        finally:
            client.stop()
            client.close()

    def brokers(self) -> list[HaBroker]:
        return [*self.pair.values(), *([self.b] if self.b is not None else []), *self.others]

    def stop(self) -> None:
        if self.zk is not None and self.zk.proc is not None:
            self.zk.resume()
        for broker in self.pair.values():
            broker.kill()
        for broker in [self.b, *self.others]:
            if broker is not None:
                broker.stop()
        if self.zk is not None:
            self.zk.stop()


@contextmanager
def running(tmp_path: Path) -> Iterator[PairedCluster]:
    """A started PairedCluster, stopped at the end (the tests' fixture)."""
    zookeeper_jar()   # skips (or fails under CI) when ZooKeeper cannot be had
    cl = PairedCluster(tmp_path).start()
    try:
        yield cl
    finally:
        cl.stop()
