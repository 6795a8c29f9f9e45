"""End to end: a machine added to a `[cluster]` whose node a is an HA pair
(`amqpbroker cluster remap`; docs/cluster.md "Adding or removing a machine" and "A node
as an HA pair"), with a real ZooKeeper and real broker processes.

How it could fail, and the test for it:
* the pair's live broker is killed (SIGKILL) in the middle of moving a big backlog to
  the new machine (by count: once the new owner holds part of it): its backup takes
  over with the store it was sent, goes through the same gate, moves the rest, and no
  message a producer saw Accepted is lost (at least once: one accepted at c but not yet
  removed at a comes twice, never more than one move's worth), in the order it was sent;
* the backup serving clients before its moves are done, or moving the subscription a
  second time once the first broker had finished it.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from amqpbroker.core.placement import slot_of
from amqpbroker.core.remap import plan_remap
from tests.e2e.ha_harness import HaBroker, free_port
from tests.e2e.paired_cluster import NODES, OWNERS, PairedCluster, cluster_section, running
from tests.e2e.test_cluster_remap import api, assert_backlog_kept, subscribe, subscription_ids, wait_serving

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(480)]

GROWN = ("a", "b", "c")
NEW = plan_remap({"nodes": list(NODES), "weights": {n: 1 for n in NODES}, "owners": list(OWNERS)}, list(GROWN),
                 {}).owners


def moving_topic(prefix: str, old: str, new: str) -> str:
    """A topic whose durable subscriptions' slot goes from `old` to `new` under the remap."""
    return next(name for name in (f"{prefix}-{i}" for i in range(10000))
                if OWNERS[slot_of(f"amq.topic/{name}")] == old and NEW[slot_of(f"amq.topic/{name}")] == new)


@pytest.fixture
def paired(tmp_path):
    with running(tmp_path) as cl:
        yield cl


def grown(config: str) -> str:
    """The same broker's configuration with c in `nodes`."""
    old = "nodes = [" + ", ".join(f'"{n}"' for n in NODES) + "]"
    assert old in config
    return config.replace(old, "nodes = [" + ", ".join(f'"{n}"' for n in GROWN) + "]")


def remap(paired: PairedCluster) -> subprocess.CompletedProcess:
    path = paired.tmp / "remap.toml"
    path.write_text(cluster_section(paired.zk, paired.name, "a", nodes=GROWN))
    return subprocess.run([sys.executable, "-m", "amqpbroker.cli", "cluster", "remap", "--config", str(path)],
                          capture_output=True, text=True, timeout=120)


def wait_part_moved(c: HaBroker, sub: str, at_least: int, timeout: float = 120.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        held = [s["pending"] for s in api(c, "/api/subscriptions") if s["name"] == sub]
        if held and held[0] >= at_least:
            return held[0]
        time.sleep(0.02)
    raise AssertionError(f"c never held {at_least} messages of {sub}")


def test_the_backup_of_a_pair_killed_in_the_middle_of_its_moves_moves_the_rest(paired):
    from tests.e2e.crash_support import send_durable
    primary, backup, b = paired.pair["primary"], paired.pair["backup"], paired.b
    topic, count = moving_topic("tp", "a", "c"), 20000
    subscribe(b.url, topic, "sub-pair")
    sent = send_durable(primary, f"amq.topic/{topic}", count, "pair", window=500, body=b"m" * 64)
    assert len(sent.accepted) == count
    for broker in (backup, primary, b):
        broker.stop()
    done = remap(paired)
    assert done.returncode == 0, done.stderr

    for broker in (primary, backup, b):
        broker.config = grown(broker.config)
    primary.start().wait_for_log(r"cluster: node a is live \(", 60)
    backup.start().wait_for_log("in sync with the live broker", 90)
    b.start(wait=False).wait_for_log(r"cluster: node b is live \(", 60)
    primary.wait_for_log(r"durable subscription 'sub-pair' .* waits for node c to be live", 60)
    port = free_port()
    c = HaBroker("c", paired.tmp / "c", f"port = {port}\n" + cluster_section(paired.zk, paired.name, "c",
                                                                             nodes=GROWN), port)
    paired.others.append(c)
    c.start(wait=False).wait_for_log(r"cluster: node c is live \(", 60)
    c.wait_for_log("management listening", 30)
    moved_part = wait_part_moved(c, "sub-pair", 1000)
    primary.kill()
    assert moved_part < count, "the move ended before the kill: the test did not cut it"
    assert "durable subscription 'sub-pair' moved to node c" not in primary.log_text()

    backup.wait_for_log(r"cluster: node a is live \(", 90)
    wait_serving((backup, b, c), 1, timeout=120)
    assert backup.log_text().count("durable subscription 'sub-pair' moved to node c") == 1
    assert_backlog_kept(sent, subscription_ids(b.url, topic, "sub-pair"))
    for broker in (backup, b, c):
        assert "Traceback" not in broker.log_text()
