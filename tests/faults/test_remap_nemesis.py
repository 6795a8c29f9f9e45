"""A `[cluster]` of machines remapped again and again (`amqpbroker cluster remap`:
cluster/remap.py, the start gate cluster/zkgate.py, the moves cluster/moves.py) under a
seeded nemesis, Jepsen-style, with a real ZooKeeper and real broker processes.

The walk: nodes a, b; a machine c added; a emptied (weight 0); a left out.  Before each
remap durable messages are published to three topics (each with a durable
subscription made at the start) and two queues, and the nodes stop: cleanly, or all
killed -9 (drawn from the seed).  After it the nodes of the new map start in an order
drawn from the seed, and while the gate is shut and subscriptions move (by count: the
first move under way), the nemesis does one thing drawn from the seed: nothing, kill -9
of one node (started again), SIGSTOP of one node for a time on either side of its
ZooKeeper session timeout, or kill -9 of every node (started again).  Before a node is
left out, its queues are let empty into their owners (what docs/cluster.md asks of an
operator); when the nodes were then killed, the remap leaving it out is refused (it has
not reported being empty) until it is started again and stopped cleanly.

At the end every destination is read to the bottom through a node drawn from the seed,
and the checker holds: every message a producer was told Accepted is there (copies
allowed, counted, within a move's window per fault), nothing arrives that was never
sent, every node reached the last map's gate, and no node logged a traceback.

REMAP_SCHEDULES seeds (2 by default) from REMAP_FIRST_SEED (1).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from proton import ConnectionException
from proton.reactor import Container
from proton.utils import LinkDetached

from tests.client import connect
from tests.e2e.crash_support import Traffic, _UntilSettled
from tests.e2e.helpers_delivery import receiver
from tests.e2e.jms_links import durable_consumer
from tests.e2e.test_cluster_remap import Nodes, read_ids, subscribe

SCHEDULES = int(os.environ.get("REMAP_SCHEDULES", "2"))
FIRST_SEED = int(os.environ.get("REMAP_FIRST_SEED", "1"))

pytestmark = [pytest.mark.e2e, pytest.mark.faults, pytest.mark.timeout(900)]

WALK = ((["a", "b"], {}), (["a", "b", "c"], {}), (["a", "b", "c"], {"a": 0}), (["b", "c"], {}))
TOPICS = ("prices", "orders.eu", "audit.log")
QUEUES = ("jobs", "mail")
PER_STEP = 400
WINDOW = 256        # a move's window (cluster/shovel.py): the most copies one fault can cost
PAUSES = (1.5, 6.0)  # under and over the nodes' ZooKeeper session timeout (4 s)
ACTIONS = ("none", "kill", "pause", "kill all")
RETRIES = 60        # tries of a producer or reader refused while a node takes its place again


def weights_line(weights: dict) -> str:
    return "weights = {" + ", ".join(f"{n} = {w}" for n, w in weights.items()) + "}\n" if weights else ""


class Walk:
    def __init__(self, nodes: Nodes, rng: random.Random):
        self.nodes, self.rng = nodes, rng
        self.accepted: dict[str, set[str]] = {d: set() for d in (*TOPICS, *QUEUES)}
        self.sent: set[str] = set()
        self.faults = 0
        self.epoch = 0
        self.running: list[str] = []
        self.weights: dict = {}

    # --- the nodes

    def config(self, node: str, names: list[str]) -> str:
        return self.nodes.config(node, names) + weights_line(self.weights)

    def start(self, node: str, names: list[str]) -> None:
        proc = self.nodes.procs.get(node)
        if proc is None:
            from tests.broker_process import BrokerProcess
            proc = self.nodes.procs[node] = BrokerProcess(self.nodes.base / node)
        proc.config_text = self.config(node, names)
        proc.start(timeout=90)

    def stop_all(self, kill: bool) -> None:
        for node in self.running:
            proc = self.nodes.procs[node]
            proc.kill() if kill else proc.stop()

    def url(self) -> str:
        return self.nodes.procs[self.rng.choice(self.running)].url

    # --- traffic

    def publish(self, step: int) -> None:
        """PER_STEP durable messages to each destination, through nodes drawn from the
        seed; a producer refused (a node between two ZooKeeper sessions after a pause
        refuses attaches `amqpbroker:resource-unavailable` until it holds its live znode
        again) tries again, as a failover client does."""
        for dest in (*TOPICS, *QUEUES):
            address = f"amq.topic/{dest}" if dest in TOPICS else dest
            for attempt in range(RETRIES):
                sent = send_once(self.nodes.procs[self.rng.choice(self.running)], address,
                                 f"s{step}-{dest}-{attempt}")
                self.accepted[dest] |= sent.accepted
                self.sent |= set(sent.sent)
                if not sent.errors and len(sent.accepted) == PER_STEP:
                    break
                time.sleep(0.5)
            else:
                raise AssertionError(f"no producer to {address} got through in {RETRIES} tries")

    # --- a remap, and the nemesis while the gate is shut

    def _run_remap(self, names: list[str], weights: dict) -> subprocess.CompletedProcess:
        path = self.nodes.base / "remap.toml"
        path.write_text(self.nodes.config(names[0], names) + weights_line(weights))
        deadline = time.monotonic() + 60
        while True:   # nodes killed -9 are live until their sessions expire: the remap waits
            done = subprocess.run([sys.executable, "-m", "amqpbroker.cli", "cluster", "remap", "--config",
                                   str(path)], capture_output=True, text=True, timeout=120)
            if done.returncode == 0 or "live now" not in done.stderr or time.monotonic() > deadline:
                return done
            time.sleep(0.5)

    def report_leaving(self, names: list[str], weights: dict, leaving: list[str]) -> None:
        """The nodes were killed: those about to leave have not reported being empty, so
        the remap is refused; every node is started again, the leaving ones let empty
        (a removal a kill took back is shovelled again) and all stopped cleanly (what an
        operator does); then they have reported."""
        refused = self._run_remap(names, weights)
        assert refused.returncode == 1 and "has not reported what it holds" in refused.stderr, refused.stderr
        print(f"killed before {', '.join(leaving)} left: remap refused (no report); started and stopped again")
        for node in self.running:
            self.start(node, self.running)
        for node in self.running:
            self.nodes.procs[node].wait_for_log(rf"cluster: node {node} of .* \(slot map epoch {self.epoch}\)",
                                                timeout=240)
        for node in leaving:
            self.let_empty(node)
        self.stop_all(kill=False)
        for node in leaving:
            assert f"node {node} stops holding 0 message(s) and 0 durable subscription(s)" in \
                self.nodes.procs[node].log_text()

    def remap(self, names: list[str], weights: dict, step: int) -> None:
        done = self._run_remap(names, weights)
        assert done.returncode == 0, done.stderr
        self.weights = weights
        self.epoch += 1
        order = names[:]
        self.rng.shuffle(order)
        self.running = order
        action = self.rng.choice(ACTIONS)
        print(f"step {step}: remap to {names} {weights}, start order {order}, nemesis: {action}")
        for node in order:
            self.start(node, names)
        if action != "none":
            self._when_moving()
        if action == "kill":
            victim = self.rng.choice(order)
            self.nodes.procs[victim].kill()
            self.start(victim, names)
        elif action == "pause":
            victim, pause = self.rng.choice(order), self.rng.choice(PAUSES)
            pid = self.nodes.procs[victim].proc.pid
            os.kill(pid, signal.SIGSTOP)
            time.sleep(pause)
            os.kill(pid, signal.SIGCONT)
        elif action == "kill all":
            self.stop_all(kill=True)
            for node in order:
                self.start(node, names)
        self.faults += action != "none"
        for node in order:
            self.nodes.procs[node].wait_for_log(rf"cluster: node {node} of .* \(slot map epoch {self.epoch}\)",
                                                timeout=240)

    def _when_moving(self) -> None:
        """By count: once a node has begun a move (or every node is through the gate)."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            logs = [self.nodes.procs[n].log_text() for n in self.running]
            if any("moving durable subscription" in t or "serves clients under slot map" in t for t in logs):
                return
            time.sleep(0.01)

    def let_empty(self, node: str) -> None:
        """A node of weight 0 about to leave: until its queues hold nothing (its shovels
        take each message to its owner)."""
        port = self.nodes.procs[node].ports["management"]
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/queues", timeout=10) as resp:
                queues = json.loads(resp.read())
            if not any(q["depth"] for q in queues):
                return
            time.sleep(0.2)
        raise AssertionError(f"node {node}'s queues never emptied")

    # --- the checker

    def read_all(self) -> dict[str, list[str]]:
        """Every destination read to the bottom (a reader refused or cut tries again)."""
        got: dict[str, list[str]] = {}
        for dest in (*TOPICS, *QUEUES):
            ids: list[str] = []
            for _ in range(RETRIES):
                try:
                    if dest in TOPICS:
                        conn = connect(self.url(), container_id=f"app-sub-{dest}")
                        read_ids(durable_consumer(conn, dest, f"sub-{dest}", credit=500), ids, quiet=5.0)
                    else:
                        conn = connect(self.url())
                        read_ids(receiver(conn, dest, credit=500), ids, quiet=5.0)
                    conn.close()
                    break
                except (LinkDetached, ConnectionException):
                    time.sleep(0.5)
            else:
                raise AssertionError(f"no reader of {dest} got through in {RETRIES} tries")
            got[dest] = ids
        return got


class _Producer(_UntilSettled):
    def on_link_error(self, event):   # refused: this try ends now, the caller tries again
        self.t.errors.append(f"link refused: {event.link.remote_condition}")
        self._stop(event.container)


def send_once(proc, address: str, prefix: str) -> Traffic:
    t = Traffic(prefix)
    handler = _Producer(proc.url, address, t, 10**9, threading.Event(), consume=False, window=100,
                        body=b"p" * 256, max_messages=PER_STEP, deadline=60.0, prefetch=0)
    Container(handler).run()
    return t



@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + SCHEDULES))
def test_remaps_under_a_nemesis_lose_no_accepted_message(seed, tmp_path, zookeeper):
    nodes = Nodes(tmp_path, zookeeper)
    walk = Walk(nodes, random.Random(seed))
    try:
        first, _ = WALK[0]
        walk.running = list(first)
        for node in first:
            walk.start(node, first)
        for node in first:
            nodes.procs[node].wait_for_log(rf"cluster: node {node} is live", timeout=30)
        for dest in TOPICS:
            subscribe(walk.url(), dest, f"sub-{dest}")
        for step, (names, weights) in enumerate(WALK[1:], start=1):
            walk.publish(step)
            leaving = [n for n in walk.running if n not in names]
            for node in leaving:
                walk.let_empty(node)
            killed = walk.rng.random() < 0.3
            walk.stop_all(kill=killed)
            if killed and leaving:
                walk.report_leaving(names, weights, leaving)
            walk.remap(names, weights, step)
        walk.publish(len(WALK))
        got = walk.read_all()
        for dest, ids in got.items():
            lost = walk.accepted[dest] - set(ids)
            assert not lost, f"{dest}: {len(lost)} accepted messages lost, e.g. {sorted(lost)[:5]}"
            unknown = set(ids) - walk.sent
            assert not unknown, f"{dest}: never sent: {sorted(unknown)[:5]}"
            extra = len(ids) - len(set(ids))
            assert extra <= WINDOW * (walk.faults + 3), f"{dest}: {extra} copies"
        for node in walk.running:
            assert "Traceback" not in nodes.procs[node].log_text(), nodes.procs[node].log_text()[-3000:]
    except BaseException:
        for node, proc in nodes.procs.items():   # what each node said, for the failure's reader
            lines = [ln for ln in proc.log_text().splitlines() if " DEBUG " not in ln]
            print(f"--- node {node}, last lines:\n" + "\n".join(lines[-60:]))
        raise
    finally:
        nodes.stop()
