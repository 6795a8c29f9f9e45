"""End to end: `serve --workers N` started again with another N on the same data dir.

A queue whose slot moved is shovelled to its new owner (tests/cluster/test_misplaced.py),
but a durable subscription lives beside its topic and nothing moves one yet: left on
its old node, its topic's messages would go to the new owner, where it does not exist,
and attaching it again there would delete it on the old node with its backlog
(cluster/guard.py).  A store of a node that fewer workers no longer run would never be
served, and neither would a single broker's store under `--workers` (nor the workers'
under a single broker: store/layout.py).  All are refused at start, with the reason,
and nothing is lost: the previous mode finds everything where it was.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from proton import Message

from amqpbroker.core.placement import slot_of, static_map
from tests.broker_process import BrokerProcess
from tests.client import connect
from tests.cluster_process import ClusterProcess
from tests.e2e.helpers_delivery import drain_bodies, receiver, sender, uid
from tests.e2e.jms_links import durable_consumer

pytestmark = pytest.mark.e2e


def owner(topic_key: str, workers: int) -> str:
    return static_map([f"n{i}" for i in range(workers)]).owners[slot_of(topic_key)]


def serve(data_dir, workers: int | None, timeout: float = 60.0) -> tuple[int, str]:
    """`serve --workers N` (None: `serve` alone) run to its exit: (status, stderr).  A
    broker that starts instead (the behaviour this file guards against) is stopped
    after `timeout`."""
    cmd = [sys.executable, "-m", "amqpbroker.cli", "serve", "--port", "0", "--data-dir", str(data_dir)]
    if workers is not None:
        cmd += ["--workers", str(workers)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, AMQPBROKER_MANAGEMENT__PORT="0"), start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"serve (--workers {workers}) started on a data dir it must refuse:\n{err[-3000:]}")
    return proc.returncode, err


def put_one(proc, address: str, body) -> None:
    """Start `proc` (a broker or a cluster), send one durable message, stop it."""
    proc.start()
    try:
        conn = connect(proc.url)
        sender(conn, address).send(Message(body=body, durable=True))
        conn.close()
    finally:
        proc.stop()


def take_all(proc, address: str) -> list:
    """Start `proc`, receive what `address` holds, stop it."""
    proc.start()
    try:
        conn = connect(proc.url)
        got = drain_bodies(conn, receiver(conn, address, credit=10), timeout=2.0)
        conn.close()
    finally:
        proc.stop()
    return got


def test_a_durable_subscription_whose_topic_would_move_stops_the_start_and_loses_nothing(tmp_path):
    topic = next(t for t in (f"moved-{i}" for i in range(1000))
                 if owner(f"amq.topic/{t}", 2) != owner(f"amq.topic/{t}", 3))
    data = tmp_path / "data"
    cl = ClusterProcess(data, workers=2, weights=None).start()
    try:
        conn = connect(cl.url, container_id="app-moved")
        durable_consumer(conn, topic, "sub-moved").detach()   # durable: kept while away
        conn.close()
        pub = connect(cl.url)
        snd = sender(pub, f"amq.topic/{topic}")
        for i in range(10):
            snd.send(Message(body=i, durable=True))
        pub.close()
    finally:
        cl.stop()

    status, err = serve(data, 3)
    assert status == 3, err[-3000:]
    assert "'sub-moved'" in err and f"amq.topic/{topic}" in err and "stopping every worker" in err

    cl = ClusterProcess(data, workers=2, weights=None).start()   # the map they were made under
    try:
        conn = connect(cl.url, container_id="app-moved")
        got = drain_bodies(conn, durable_consumer(conn, topic, "sub-moved"), timeout=2.0)
        conn.close()
    finally:
        cl.stop()
    assert got == list(range(10)), "the subscription's backlog is whole"


def test_fewer_workers_than_the_data_dir_has_stores_refuse_to_start(tmp_path):
    queue = next(q for q in (uid("q") for _ in range(1000)) if owner(q, 3) == "n2")
    data = tmp_path / "data"
    put_one(ClusterProcess(data, workers=3, weights=None), queue, "kept")
    status, err = serve(data, 2)
    assert status == 2 and "node-2" in err and "--workers 3" in err, err[-3000:]
    assert take_all(ClusterProcess(data, workers=3, weights=None), queue) == ["kept"]


def test_a_single_brokers_store_and_the_workers_stores_are_never_hidden_by_the_other_mode(tmp_path):
    alone, workers = tmp_path / "alone", tmp_path / "workers"
    put_one(BrokerProcess(alone), "kept-alone", "alone")
    status, err = serve(alone, 2)
    assert status == 2 and "single broker's store" in err and "node-0" in err, err[-3000:]

    cl = ClusterProcess(workers, workers=2, weights=None).start()
    cl.stop()
    status, err = serve(workers, None)
    assert status == 2 and "node-0, node-1" in err and "--workers 2" in err, err[-3000:]

    assert take_all(BrokerProcess(alone), "kept-alone") == ["alone"]   # the mode it was made in: all there
