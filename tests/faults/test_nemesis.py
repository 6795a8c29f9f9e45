"""The HA pair under a seeded nemesis (tests/faults/nemesis.py), Jepsen-style.

For each seed: a pair behind relays on one ZooKeeper; producers — durable and
non-durable, to a queue and to a topic, each on its own connection, failing over
between both brokers and sending again what was in doubt — and consumers — the
queue, and a JMS shared durable subscription on the topic — run while the
nemesis kills, pauses and cuts for FAULT_SECONDS.  Then everything is healed and
restarted, producers stop and settle what is in doubt, consumers read until
nothing more comes, and the checker (tests/faults/checker.py) holds: no durable
message told Accepted is lost, no two brokers accepted at the same time, no
broker process ended on its own.  Duplicates are counted and printed.

FAULT_SCHEDULES seeds of FAULT_SECONDS (60) each: 14 in CI (.ci/run sets it; about
65 s a seed on a busy 2-core machine, ~15 minutes), 8 by default in a local run of
the suite; bench/ha_soak.py runs more and longer ones.
"""

from __future__ import annotations

import os
import time

import pytest

from proton import ConnectionException, Timeout

from tests.client import connect
from tests.e2e.crash_support import drain
from tests.e2e.jms_links import shared_consumer
from tests.e2e.ha_harness import ZooKeeper
from tests.faults.checker import check
from tests.faults.clients import ClientSet, FailoverConsumer, FailoverProducer, Ledger
from tests.faults.harness import FaultPair
from tests.faults.nemesis import Nemesis, schedule

SCHEDULES = int(os.environ.get("FAULT_SCHEDULES", "8"))
SECONDS = float(os.environ.get("FAULT_SECONDS", "60"))
FIRST_SEED = int(os.environ.get("FAULT_FIRST_SEED", "1"))
SESSION_TIMEOUT = 3.0      # the defaults ([ha] zookeeper_session_timeout, backup_timeout)
BACKUP_TIMEOUT = 2.0
RATE = 60                  # messages per second per producer
QUEUE, TOPIC, SUBSCRIPTION = "faults", "amq.topic/faults", "faults-sub"

pytestmark = [pytest.mark.e2e, pytest.mark.faults, pytest.mark.timeout(SECONDS + 400)]


@pytest.fixture(scope="module")
def zookeeper(tmp_path_factory):
    zk = ZooKeeper(tmp_path_factory.mktemp("zk")).start()
    yield zk
    zk.resume()
    zk.stop()


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def subscribe(url: str) -> None:
    """The shared durable subscription exists before anything is published to the topic."""
    conn = connect(url)
    shared_consumer(conn, TOPIC, SUBSCRIPTION, global_=True, credit=0)
    conn.close()


def drain_subscription(url: str, quiet: float = 1.0) -> set[str]:
    conn = connect(url)
    got = set()
    try:
        receiver = shared_consumer(conn, TOPIC, SUBSCRIPTION, global_=True, credit=500)
        while True:
            try:
                msg = receiver.receive(timeout=quiet)
            except Timeout:
                break
            got.add(msg.id)
            receiver.accept()
    finally:
        conn.close()
    return got


def drain_what_waits(pair: FaultPair, attempts: int = 20) -> dict[str, set[str]]:
    """Read what still waits on the queue and the subscription, from the live broker.

    The last fault may still be playing out (a ZooKeeper pause ends with sessions that
    expire only once it resumes): the broker live a moment ago may fence or step
    down under this drain, aborting its connection.  Then the drain goes on at
    whichever broker is live next, like every client of the run; what was read
    before the abort is kept (a message read twice is one message here)."""
    got: dict[str, set[str]] = {"queue": set(), "subscription": set()}
    for _ in range(attempts):
        live = pair.wait_any_live(60)
        try:
            got["queue"] |= {m for m, _ in drain(live.url, QUEUE, quiet=1.0)}
            got["subscription"] |= drain_subscription(live.url)
            return got
        except ConnectionException as exc:
            print(f"  final drain at {live.name} cut ({exc}): again at the live broker")
            time.sleep(0.5)
    raise AssertionError(f"the final drain was cut {attempts} times:\n" + pair.tails())


def clients_for(pair: FaultPair, ledger: Ledger) -> tuple[ClientSet, dict[str, str]]:
    urls = pair.urls
    producers = [
        FailoverProducer("dq1", urls, QUEUE, ledger, durable=True, rate=RATE),
        FailoverProducer("dq2", urls[::-1], QUEUE, ledger, durable=True, rate=RATE),
        FailoverProducer("dt", urls, TOPIC, ledger, durable=True, rate=RATE),
        FailoverProducer("nq", urls, QUEUE, ledger, durable=False, rate=RATE),
        FailoverProducer("nt", urls[::-1], TOPIC, ledger, durable=False, rate=RATE),
    ]
    consumers = [FailoverConsumer("queue", urls, QUEUE, ledger),
                 FailoverConsumer("subscription", urls, TOPIC, ledger, subscription=SUBSCRIPTION)]
    streams = {"dq1": "queue", "dq2": "queue", "nq": "queue", "dt": "subscription", "nt": "subscription"}
    return ClientSet(producers + consumers), streams


def run_schedule(zookeeper: ZooKeeper, root, seed: int, seconds: float):
    """One seed's schedule, start to verdict (tests/faults/checker.py Verdict); the
    printed lines say what was done and what the checker found."""
    faults = schedule(seed, seconds, SESSION_TIMEOUT)
    pair = FaultPair(zookeeper, root, session_timeout=SESSION_TIMEOUT, backup_timeout=BACKUP_TIMEOUT)
    ledger = Ledger()
    clients, streams = clients_for(pair, ledger)
    nemesis = Nemesis(pair, faults)
    try:
        pair.start()
        subscribe(pair.a.url)
        clients.start()
        assert wait_for(lambda: ledger.accepted_count() >= 50, 60), "nothing was accepted before the faults"
        nemesis.start().join(seconds * 3 + 120)
        nemesis.settle()
        pair.wait_any_live(120)
        clients.stop_producers()
        # What was in doubt is sent again once a broker is live; then consumers read
        # until everything Accepted arrived or nothing more comes.
        assert wait_for(lambda: clients.unsettled() == 0, 120), (
            f"{clients.unsettled()} sends still in doubt: {clients.describe()}\n" + pair.tails())
        last = [len(ledger.all_received()), time.monotonic()]

        def settled() -> bool:
            received = ledger.all_received()
            if len(received) != last[0]:
                last[:] = [len(received), time.monotonic()]
            return ledger.durable_accepted() <= received or time.monotonic() - last[1] > 10

        wait_for(settled, 180)
        clients.stop()
        # Anything still waiting (delivered to a consumer that went, not yet back).
        extra = drain_what_waits(pair)
        verdict = check(ledger, streams, list(pair.brokers.values()), extra, spans=nemesis.spans,
                        slack=3 * SESSION_TIMEOUT)
        print(f"\nseed {seed}: {len(faults)} faults: " + "; ".join(f.describe() for f in faults))
        print("  done: " + "; ".join(what for _, what in nemesis.done))
        print(f"  {verdict.summary()}")
        verdict.details = ("\n".join(t for b in pair.brokers.values() for t in b.exit_tails) + "\n"
                           + pair.tails())
        return verdict
    finally:
        nemesis.stop.set()
        try:
            clients.stop(5)
        except Exception:
            pass
        pair.close()


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + SCHEDULES))
def test_nemesis_schedule(zookeeper, tmp_path, seed):
    verdict = run_schedule(zookeeper, tmp_path, seed, SECONDS)
    assert verdict.accepted_durable > 0
    assert not verdict.lost, f"{len(verdict.lost)} Accepted durable message(s) lost: {verdict.lost[:10]}"
    assert not verdict.overlaps, "accept windows overlap:\n" + "\n".join(verdict.overlaps)
    assert not any(verdict.exits.values()), f"broker processes ended on their own: {verdict.exits}\n{verdict.details}"
    assert not verdict.stepdowns, "\n".join(verdict.stepdowns) + "\n" + verdict.details
