"""`serve --workers N` restarted again and again with another map, under a seeded
nemesis, Jepsen-style (cluster/moves.py, cluster/shovel.py, docs/cluster.md "Another
N").

For each seed a walk through maps (2 or 3 workers, weights that empty a node, back
to 2 workers: a store no worker runs drains into the others).  At every start, while
the start gate is shut and queues and durable subscriptions move to their new nodes,
the nemesis does one thing drawn from the seed: nothing, kill -9 of one worker (the
supervisor starts it again), SIGSTOP of one worker for a time on either side of the
inter-node idle timeout, kill -9 of the whole cluster (started again on the same
map), or a full disk (every worker's store fails one commit, by count: a moved
subscription's record, moved messages, a deletion).  Once every node serves, durable
messages are published to three topics (each with a durable subscription) and two
queues, each one sent again until Accepted, and a few are consumed; the cluster then
stops cleanly or is killed -9.

At the end every destination is read to the bottom, and the checker holds: every
message a producer was told Accepted and nobody consumed is there (copies allowed,
counted, within a shovel's window per fault), nothing arrives that was never sent,
no worker ended on its own, and no node logged an unexpected error.

MAP_SCHEDULES seeds (3 by default) from MAP_FIRST_SEED (1), MAP_STEPS (4) starts each.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from collections import Counter
from dataclasses import dataclass

import pytest
from proton import ConnectionException, Delivery, LinkException, Message, Timeout
from proton.utils import SendException


from tests.client import connect
from tests.cluster_process import ClusterProcess
from tests.e2e.helpers_delivery import fetch, receiver, sender, settle
from tests.e2e.jms_links import durable_consumer

SCHEDULES = int(os.environ.get("MAP_SCHEDULES", "3"))
FIRST_SEED = int(os.environ.get("MAP_FIRST_SEED", "1"))
STEPS = int(os.environ.get("MAP_STEPS", "4"))

pytestmark = [pytest.mark.e2e, pytest.mark.faults, pytest.mark.timeout(STEPS * 240 + 300)]

MAPS = ((2, None), (3, None), (3, "1,1,0"), (3, "0,1,1"))
TOPICS = ("prices", "orders.eu", "audit.log")
QUEUES = ("jobs", "mail")
CONTAINER = "nemesis-app"
PER_STEP = 60            # messages per destination per start
PAD = b"x" * 4000
WINDOW = 256             # a shovel's window (cluster/shovel.py): the most copies one fault can cost
# A pause the inter-node idle timeout (cluster/peer.py, 16 s) does not see, and one it does.
PAUSES = (1.0, 4.0, 20.0)
WAIT_MISSING = 30.0      # seconds without a delivery before a reader with messages missing gives up


@dataclass(frozen=True)
class Step:
    workers: int
    weights: str | None
    fault: str           # none | kill-node | pause | kill-all | disk-full
    node: str            # the fault's worker
    delay: float         # seconds after the start before the fault
    pause: float         # a pause's length
    ending: str          # stop | kill-all: how the cluster ends after its traffic
    consume: int         # messages consumed from `taken` after publishing
    taken: str           # the destination they are consumed from
    full_at: int         # disk-full: each worker's store fails its commit after this many (store/faults.py)

    def describe(self) -> str:
        what = {"none": "no fault", "kill-node": f"kill -9 {self.node}", "kill-all": "kill -9 of the cluster",
                "pause": f"SIGSTOP {self.node} for {self.pause:.0f} s",
                "disk-full": f"every worker's commit {self.full_at + 1} fails (disk full)"}[self.fault]
        return (f"--workers {self.workers} weights {self.weights or 'equal'}: {what} after {self.delay:.1f} s, "
                f"{self.consume} consumed from {self.taken}, then {self.ending}")


def schedule(seed: int, steps: int) -> list[Step]:
    """The same seed, the same walk: each start's map differs from the one before."""
    rng = random.Random(seed)
    out, previous = [], MAPS[0]
    for i in range(steps):
        choices = [m for m in MAPS if m != previous] if i else [MAPS[0]]
        workers, weights = previous = rng.choice(choices)
        fault = "none" if i == 0 else rng.choices(["none", "kill-node", "pause", "kill-all", "disk-full"],
                                                  [1, 2, 2, 1, 2])[0]
        out.append(Step(workers, weights, fault, f"n{rng.randrange(workers)}", rng.uniform(0.0, 1.5),
                        rng.choice(PAUSES), rng.choice(["stop", "stop", "kill-all"]), rng.randrange(0, 40),
                        rng.choice(TOPICS + QUEUES), rng.randrange(1, 8)))
    return out


class Ledger:
    """What producers were told Accepted, what consumers took, what came at the end."""

    def __init__(self):
        self.accepted: dict[str, set[str]] = {d: set() for d in TOPICS + QUEUES}
        self.consumed: dict[str, set[str]] = {d: set() for d in TOPICS + QUEUES}
        self.final: dict[str, Counter] = {d: Counter() for d in TOPICS + QUEUES}
        self.resent = 0   # sends in doubt (a node restarting), sent again


def address(dest: str) -> str:
    return f"amq.topic/{dest}" if dest in TOPICS else dest


def open_reader(conn, dest: str, credit: int):
    if dest in TOPICS:
        return durable_consumer(conn, dest, f"sub-{dest}", credit=credit)
    return receiver(conn, dest, credit=credit)


def subscribe_all(url: str) -> None:
    conn = connect(url, container_id=CONTAINER)
    for topic in TOPICS:
        durable_consumer(conn, topic, f"sub-{topic}").detach()
    conn.close()


def publish(url: str, step: int, ledger: Ledger) -> int:
    """PER_STEP messages to each destination, each sent again (a new connection)
    until Accepted; the number of sends that had to be repeated."""
    again = 0
    for dest in TOPICS + QUEUES:
        i, tries = 0, 0
        while i < PER_STEP:
            try:
                conn = connect(url)
                snd = sender(conn, address(dest))
                while i < PER_STEP:
                    tag = f"{dest}|{step}|{i}"
                    dlv = snd.send(Message(body=tag.encode() + PAD, durable=True))
                    assert dlv.remote_state == Delivery.ACCEPTED, f"{tag}: {dlv.remote_state}"
                    ledger.accepted[dest].add(tag)
                    i += 1
                conn.close()
            except (ConnectionException, LinkException, SendException, Timeout) as exc:   # sent again
                tries += 1
                again += 1
                assert tries < 120, f"{dest}: no send accepted after {tries} tries: {exc}"
                time.sleep(0.5)
    return again


def take(url: str, dest: str, limit: int | None, into: dict, expect: frozenset = frozenset()) -> None:
    """Up to `limit` messages of `dest` (None: to the bottom), each settled Accepted
    and counted in `into`.  While some of `expect` has not come, a quiet spell of
    WAIT_MISSING is needed to give up (a busy machine is slow, not empty); then one
    of a second ends it."""
    conn = connect(url, container_id=CONTAINER)
    rcv = open_reader(conn, dest, 100 if limit is None else max(limit, 1))
    got = 0
    while limit is None or got < limit:
        try:
            msg, dlv = fetch(conn, rcv, WAIT_MISSING if not expect <= into.keys() else 1.0)
        except Timeout:
            break
        tag = bytes(msg.body[:-len(PAD)]).decode()
        settle(dlv, Delivery.ACCEPTED)
        into[tag] = into.get(tag, 0) + 1
        got += 1
    rcv.detach() if dest in TOPICS else rcv.close()
    conn.close()


def pid_of(cl: ClusterProcess, node: str) -> int:
    for _ in range(100):   # the supervisor may still be starting it
        try:
            return cl.worker_pid(node)
        except RuntimeError:
            time.sleep(0.1)
    raise RuntimeError(f"no process for {node}")


def inflict(cl: ClusterProcess, step: Step) -> int:
    """The step's fault, healed; the number of worker exits it causes."""
    time.sleep(step.delay)
    if step.fault == "kill-node":
        pid = pid_of(cl, step.node)
        mark = len(cl.lines)
        os.kill(pid, signal.SIGKILL)
        cl.wait_nodes(timeout=240, after=mark)   # it serves again (before the gate opened: all do)
        return 1
    if step.fault == "pause":
        pid = pid_of(cl, step.node)
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(step.pause)   # the fault's length, not a bound on the broker
        finally:
            os.kill(pid, signal.SIGCONT)
    if step.fault == "kill-all":
        os.killpg(cl.proc.pid, signal.SIGKILL)
        cl.proc.wait()
    return 0


UNEXPECTED = re.compile(r"Traceback|error handling event|refused durable subscription")


def run_walk(data, steps: list[Step]) -> tuple[Ledger, list[str], int]:
    ledger, logs, kills = Ledger(), [], 0
    cl = None
    try:
        for i, step in enumerate(steps):
            env = {"AMQPBROKER_STORE_FAULTS": f"commit:DiskError@{step.full_at}*1"} \
                if step.fault == "disk-full" else None
            cl = ClusterProcess(data, workers=step.workers, weights=step.weights, env=env).start(wait=False)
            kills += inflict(cl, step)
            if step.fault == "kill-all":
                logs.append(cl.log_text())
                cl = ClusterProcess(data, workers=step.workers, weights=step.weights).start(wait=False)
            cl.wait_nodes(timeout=240)
            try:
                if i == 0:
                    subscribe_all(cl.url)
                ledger.resent += publish(cl.url, i, ledger)
                consumed: dict = {}
                take(cl.url, step.taken, step.consume, consumed)
            except Exception as exc:
                raise AssertionError(f"start {i} ({step.describe()}): {exc}\n{cl.log_text()[-6000:]}") from exc
            ledger.consumed[step.taken] |= set(consumed)
            if step.ending == "kill-all":
                os.killpg(cl.proc.pid, signal.SIGKILL)
                cl.proc.wait()
            else:
                assert cl.stop() == 0, "a clean stop"
            logs.append(cl.log_text())
        last = steps[-1]
        cl = ClusterProcess(data, workers=last.workers, weights=last.weights).start(timeout=240)
        for dest in TOPICS + QUEUES:
            got: dict = {}
            take(cl.url, dest, None, got, frozenset(ledger.accepted[dest] - ledger.consumed[dest]))
            ledger.final[dest].update(got)
        cl.stop()
        logs.append(cl.log_text())
    finally:
        if cl is not None:
            cl.stop()
    return ledger, logs, kills


def check(ledger: Ledger, logs: list[str], kills: int, faults: int) -> list[str]:
    problems = []
    for dest in TOPICS + QUEUES:
        lost = ledger.accepted[dest] - ledger.consumed[dest] - set(ledger.final[dest])
        if lost:
            problems.append(f"{dest}: {len(lost)} accepted message(s) lost, e.g. {sorted(lost)[:3]}")
        phantom = set(ledger.final[dest]) - ledger.accepted[dest]
        if phantom:
            problems.append(f"{dest}: {len(phantom)} message(s) never sent, e.g. {sorted(phantom)[:3]}")
        copies = sum(n - 1 for n in ledger.final[dest].values()) + len(ledger.consumed[dest] & set(ledger.final[dest]))
        if copies > WINDOW * max(faults, 1):
            problems.append(f"{dest}: {copies} copies, beyond a shovel's window per fault")
    text = "".join(logs)
    exits = len(re.findall(r"worker n\d+ exited", text))
    if exits > kills:
        problems.append(f"{exits} worker exit(s), {kills} caused by the nemesis")
    problems += [f"log: {line.strip()[:300]}" for line in text.splitlines() if UNEXPECTED.search(line)][:5]
    return problems


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + SCHEDULES))
def test_every_accepted_message_survives_changes_of_the_map_under_a_nemesis(tmp_path, seed):
    steps = schedule(seed, STEPS)
    plan = "\n".join(f"  {s.describe()}" for s in steps)
    ledger, logs, kills = run_walk(tmp_path / "data", steps)
    faults = sum(s.fault != "none" for s in steps) + sum(s.ending == "kill-all" for s in steps)
    problems = check(ledger, logs, kills, faults)
    total = sum(len(a) for a in ledger.accepted.values())
    assert total == PER_STEP * len(TOPICS + QUEUES) * len(steps), "every send was answered Accepted"
    assert not problems, f"seed {seed} ({ledger.resent} send(s) repeated):\n{plan}\n" + "\n".join(problems)
    assert any(ledger.final.values()), "the walk left messages to read at the end"
