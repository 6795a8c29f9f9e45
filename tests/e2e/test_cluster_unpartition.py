"""End to end: partitioned destinations made plain again (`serve --workers 3` started
again without their `[[cluster.partitioned]]`; cluster/unpartition.py).

How it could fail, and the test for each:
* a member queue's messages left under its member's name, which nobody reads any more:
  the plain queue holds every message, once, each member's in order (member 0's moved
  in-process at the queue's owner, the others shovelled there), and the member queues
  are deleted once empty (so is the plain queue's own name once it is partitioned
  again and its messages went into member 0);
* a plain queue that merely looks like a member (`look.p1`, never partitioned) taken
  for one: it keeps its messages;
* partitioned again: what was sent to the plain queue meanwhile left under a name nobody
  reads: it goes into member 0, read through the partitioned name;
* a crash in the middle of the merge (kill -9 of the whole cluster once the plain queue
  holds part of it, by count): the next start finds the former destination in the
  stores' records again and merges the rest; every message at least once, each
  member's first copies in order;
* a topic's member copies of a durable subscription (not merged yet) moved by the hash
  of their member names, where they collide, or replaced by an attach on the plain
  topic, backlog and all: the start is refused, naming them, with `--workers` and with
  ZooKeeper; started again with the previous configuration, every message is there.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.client import connect
from tests.cluster_process import ClusterProcess, ZkCluster
from tests.e2e.helpers_delivery import drain_bodies, receiver, send_bodies
from tests.e2e.jms_links import durable_consumer

pytestmark = pytest.mark.e2e

TOPIC, QUEUE, LOOKALIKE = "unp-t", "unp-q", "look.p1"


def config(topic: bool = False, queue: bool = False) -> str | None:
    entries = ([f'{{ address = "{TOPIC}", members = 3, topic = true }}'] if topic else []) + \
              ([f'{{ address = "{QUEUE}", members = 3 }}'] if queue else [])
    return f'[cluster]\npartitioned = [{", ".join(entries)}]\n' if entries else None


def send(url: str, address: str, bodies) -> None:
    conn = connect(url)
    send_bodies(conn, address, list(bodies), durable=True)
    conn.close()


def member_bodies(m: int, count: int) -> list[int]:
    return [100_000 * m + i for i in range(count)]


def assert_each_member_in_order(seen: list[int], count: int, members: int = 3, copies: int = 0) -> None:
    """Every message of every member at least once (`copies`: at most this many twice),
    each member's first copies in its order."""
    every = {b for m in range(members) for b in member_bodies(m, count)}
    assert set(seen) == every, f"{len(every - set(seen))} message(s) lost"
    assert len(seen) - len(every) <= copies, f"{len(seen) - len(every)} copies"
    for m in range(members):
        assert list(dict.fromkeys(b for b in seen if b // 100_000 == m)) == member_bodies(m, count)


def depths(cl: ClusterProcess, names: list[str]) -> dict[str, int]:
    """Each queue's depth summed over every node's management API."""
    out = dict.fromkeys(names, 0)
    for node in cl.management_ports():
        for q in json.loads(cl.get(node, "/api/queues?limit=1000")):
            if q["name"] in out:
                out[q["name"]] += q["depth"]
    return out


def fill_members(data, count: int) -> None:
    """The queue over 3 members, each given `count` messages by its member name (so
    that each surely holds some), and a plain queue that looks like a member."""
    cl = ClusterProcess(data, workers=3, weights=None, config=config(queue=True)).start()
    try:
        for m in range(3):
            send(cl.url, f"{QUEUE}.p{m}", member_bodies(m, count))
        send(cl.url, LOOKALIKE, [7, 8, 9])
    finally:
        cl.stop()


def listed(cl: ClusterProcess, names: list[str]) -> list[str]:
    """Those of `names` that some node's management API lists as a queue."""
    return [q["name"] for node in cl.management_ports()
            for q in json.loads(cl.get(node, "/api/queues?limit=1000")) if q["name"] in names]


def wait_gone(cl: ClusterProcess, names: list[str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while listed(cl, names) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not listed(cl, names), f"still listed: {listed(cl, names)}"


def wait_members_empty(cl: ClusterProcess, timeout: float = 90.0) -> None:
    members = [f"{QUEUE}.p{m}" for m in range(3)]
    deadline = time.monotonic() + timeout
    while any(depths(cl, members).values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert depths(cl, members) == dict.fromkeys(members, 0)


def test_a_partitioned_queue_made_plain_keeps_every_message_under_its_name(tmp_path):
    data = tmp_path / "data"
    fill_members(data, 6)
    cl = ClusterProcess(data, workers=3, weights=None, config=None).start()
    members = [f"{QUEUE}.p{m}" for m in range(3)]
    try:
        wait_members_empty(cl)
        wait_gone(cl, members)
        conn = connect(cl.url)
        queued = drain_bodies(conn, receiver(conn, QUEUE, credit=50), timeout=3.0)
        kept = drain_bodies(conn, receiver(conn, LOOKALIKE, credit=10), timeout=3.0)
        conn.close()
        send(cl.url, QUEUE, range(20, 26))   # and partitioned again: they go into member 0
        # Emptied too, and kept: the plain queue, and the plain one named like a member.
        assert sorted(listed(cl, [QUEUE, LOOKALIKE])) == sorted([QUEUE, LOOKALIKE])
        log_text = cl.log_text()
    finally:
        cl.stop()
    assert_each_member_in_order(queued, 6)
    assert kept == [7, 8, 9]
    assert f"queue '{QUEUE}.p0': moving 6 message(s) into '{QUEUE}'" in log_text
    assert f"queue '{QUEUE}.p1' deleted: empty, its messages went into '{QUEUE}'" in log_text
    cl = ClusterProcess(data, workers=3, weights=None, config=config(queue=True)).start()
    try:
        wait_gone(cl, [QUEUE])   # its messages went into member 0
        conn = connect(cl.url)
        again = drain_bodies(conn, receiver(conn, QUEUE, credit=50), timeout=3.0)
        conn.close()
        log_text += cl.log_text()
    finally:
        cl.stop()
    assert again == list(range(20, 26))
    assert "Traceback" not in log_text


def test_a_merge_cut_by_kill_9_goes_on_at_the_next_start_and_loses_nothing(tmp_path):
    data, count = tmp_path / "data", 2000
    fill_members(data, count)
    names = [QUEUE] + [f"{QUEUE}.p{m}" for m in range(3)]
    cl = ClusterProcess(data, workers=3, weights=None, config=None).start(wait=False)
    deadline, seen = time.monotonic() + 90, dict.fromkeys(names, 0)
    while seen[QUEUE] <= count and time.monotonic() < deadline:   # by count: member 0's and part of another
        if len(cl.management_ports()) == 3:
            seen = depths(cl, names)
        time.sleep(0.02)
    os.killpg(cl.proc.pid, signal.SIGKILL)
    cl.proc.wait()
    assert seen[QUEUE] > count and sum(seen[n] for n in names[1:]) > 0, seen   # cut in the middle

    cl = ClusterProcess(data, workers=3, weights=None, config=None).start()
    try:
        wait_members_empty(cl)
        conn = connect(cl.url)
        queued = drain_bodies(conn, receiver(conn, QUEUE, credit=200), timeout=3.0)
        conn.close()
        log_text = cl.log_text()
    finally:
        cl.stop()
    assert_each_member_in_order(queued, count, copies=2 * 256)   # at most a shovel's window twice
    assert "moved into" in log_text and "Traceback" not in log_text


def make_copies(url: str) -> None:
    conn = connect(url, container_id="app-unp")
    durable_consumer(conn, TOPIC, "sub-unp").detach()   # a copy on each member
    conn.close()
    for m in range(3):
        send(url, f"amq.topic/{TOPIC}.p{m}", member_bodies(m, 6))


def read_copies(url: str) -> list[int]:
    conn = connect(url, container_id="app-unp")
    got = drain_bodies(conn, durable_consumer(conn, TOPIC, "sub-unp", credit=50), timeout=3.0)
    conn.close()
    return got


def test_a_topics_member_copies_refuse_the_start_until_it_is_partitioned_again(tmp_path):
    data = tmp_path / "data"
    cl = ClusterProcess(data, workers=3, weights=None, config=config(topic=True)).start()
    try:
        make_copies(cl.url)
    finally:
        cl.stop()
    with pytest.raises(RuntimeError) as refused:
        ClusterProcess(data, workers=3, weights=None, config=None).start()
    text = str(refused.value)
    assert f"'sub-unp' (topic amq.topic/{TOPIC}.p" in text, text[-3000:]
    assert f"amq.topic/{TOPIC} is no longer partitioned, and its members' copies are not merged" in text
    cl = ClusterProcess(data, workers=3, weights=None, config=config(topic=True)).start()
    try:
        got = read_copies(cl.url)
    finally:
        cl.stop()
    assert_each_member_in_order(got, 6)


def test_with_zookeeper_a_topics_member_copies_refuse_the_start_too(tmp_path):
    partitioned = f'partitioned = [{{ address = "{TOPIC}", members = 2, topic = true }}]\n'
    cl = ZkCluster(tmp_path, cluster_extra=partitioned).start()
    try:
        conn = connect(cl.url, container_id="app-unp")
        durable_consumer(conn, TOPIC, "sub-unp").detach()   # a copy on each member (b and c)
        conn.close()
        for m in range(2):
            send(cl.url, f"amq.topic/{TOPIC}.p{m}", member_bodies(m, 6))
        for proc in cl.members.values():
            proc.stop()
        cl.cluster_extra = ""
        for node in ("b", "c"):
            cl.members[node].config_text = cl.member_config(node)
            with pytest.raises(RuntimeError) as refused:
                cl.members[node].start(timeout=40)
            assert "no longer partitioned" in str(refused.value) and "'sub-unp'" in str(refused.value)
        cl.cluster_extra = partitioned
        for node, proc in cl.members.items():
            proc.config_text = cl.member_config(node)
            proc.start(timeout=40)
        for node, proc in cl.members.items():
            proc.wait_for_log(rf"cluster: node {node} is live", timeout=20)
        got = read_copies(cl.url)
    finally:
        cl.stop()
    assert_each_member_in_order(got, 6, members=2)
