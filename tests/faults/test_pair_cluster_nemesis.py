"""A cluster whose node a is an HA pair, under a seeded nemesis, Jepsen-style
(tests/faults/pair_cluster_nemesis.py; docs/cluster.md "A node as an HA pair").

For each seed: ZooKeeper, node a's pair (primary and backup) and node b
(tests/e2e/paired_cluster.py).  Producers send durable messages, each sent again
until Accepted (a failover client: a lost connection or an ended link puts its
unsettled sends in doubt, sent again):

  via-b    through b to a queue owned by a (forwarded to a's live broker)
  direct   to the same queue at a's live broker (failing over between the pair)
  via-a    through a's live broker to a queue owned by b (forwarded to b)

while the nemesis kills, pauses and restarts a's live broker, a's backup, ZooKeeper
and b.  Then every queue is read to the bottom through its owner, and the checker
holds: every message a producer was told Accepted is there (copies allowed and
counted), no broker process ended on its own, no two accept windows of the pair's
brokers overlap (their logs), nor do the spans in which clients saw each of them
answer Accepted.

PAIR_SCHEDULES seeds (2 by default) of PAIR_SECONDS (60) of faults each, from
PAIR_FIRST_SEED (1).
"""

from __future__ import annotations

import os
import time
import uuid
from collections import Counter

import pytest
from proton import Timeout

from tests.client import connect
from tests.e2e.paired_cluster import CLUSTER_SESSION_TIMEOUT, PairedCluster, owned_by
from tests.e2e.ha_harness import SESSION_TIMEOUT as PAIR_SESSION_TIMEOUT
from tests.faults.checker import check
from tests.faults.clients import ClientSet, FailoverProducer, Ledger
from tests.faults.harness import FaultBroker
from tests.faults.pair_cluster_nemesis import Nemesis, producer_view_overlaps, schedule

SCHEDULES = int(os.environ.get("PAIR_SCHEDULES", "2"))
SECONDS = float(os.environ.get("PAIR_SECONDS", "60"))
FIRST_SEED = int(os.environ.get("PAIR_FIRST_SEED", "1"))
RATE = 25                  # messages per second per producer

pytestmark = [pytest.mark.e2e, pytest.mark.faults, pytest.mark.timeout(SECONDS * 8 + 600)]


class LinkAwareProducer(FailoverProducer):
    """A link the broker ends is lost like the connection: unsettled sends are in
    doubt, and the client connects again.  A forwarded link whose owner went is
    closed with `amqpbroker:resource-unavailable` (AMQP 1.0 §2.6.6)."""

    def on_link_remote_close(self, event):
        if event.link == self.link and self.conn is not None:
            self.lost(event)


def fault_broker(name, data_dir, config, port) -> FaultBroker:
    return FaultBroker(name, data_dir, config, port, None, None)


def drain_into(url: str, address: str, into: list[str], quiet: float = 2.0) -> None:
    """Receive and accept until nothing comes for `quiet` seconds; every id read is
    appended to `into` at once (kept if the connection is cut under the drain)."""
    conn = connect(url)
    try:
        receiver = conn.create_receiver(address, name=f"drain-{uuid.uuid4().hex[:6]}", credit=500)
        while True:
            try:
                msg = receiver.receive(timeout=quiet)
            except Timeout:
                if receiver.link.remote_condition is not None:
                    raise ConnectionError(f"drain link ended: {receiver.link.remote_condition}")
                break
            into.append(msg.id)
            receiver.accept()
    finally:
        try:
            conn.close()
        except Exception:   # noqa: BLE001 - cut already
            pass


def drain_through_owner(nemesis: Nemesis, url_of, address: str, attempts: int = 20) -> list[str]:
    """Read `address` at its owner's live broker (`url_of()`); if that broker fences or
    steps down under the drain, go on at whichever is live next."""
    got: list[str] = []
    for _ in range(attempts):
        nemesis.wait_healed()
        try:
            drain_into(url_of(), address, got)
            return got
        except Exception as exc:   # noqa: BLE001 - cut, refused, ended: again at the live broker
            print(f"  drain of {address} cut ({type(exc).__name__}: {exc}): again")
            time.sleep(0.5)
    raise AssertionError(f"the final drain of {address} was cut {attempts} times:\n" + nemesis.tails())


def run_schedule(root, seed: int, seconds: float) -> dict:
    faults = schedule(seed, seconds, PAIR_SESSION_TIMEOUT, CLUSTER_SESSION_TIMEOUT)
    cluster = PairedCluster(root, make_broker=fault_broker)
    ledger = Ledger()
    qa, qb = owned_by("a", "qa"), owned_by("b", "qb")
    nemesis = clients = None
    try:
        cluster.start()
        pair_urls = [b.url for b in cluster.pair.values()]
        producers = [LinkAwareProducer("via-b", [cluster.b.url], qa, ledger, rate=RATE, window=20),
                     LinkAwareProducer("direct", pair_urls, qa, ledger, rate=RATE, window=20),
                     LinkAwareProducer("via-a", pair_urls[::-1], qb, ledger, rate=RATE, window=20)]
        streams = {"via-b": qa, "direct": qa, "via-a": qb}
        clients = ClientSet(producers).start()

        def progress() -> int:
            with ledger.lock:
                counts = Counter(mid.rsplit("-", 1)[0] for mid in ledger.accepted)
            return min(counts.get(p.name, 0) for p in producers)

        def describe() -> str:
            with ledger.lock:
                counts = Counter(mid.rsplit("-", 1)[0] for mid in ledger.accepted)
            return f"Accepted per producer {dict(counts)}; {clients.describe()}"

        nemesis = Nemesis(cluster, faults, progress, describe)
        nemesis.wait_progress(30)            # every path works before the first fault
        nemesis.start().join(seconds * 8 + 300)
        nemesis.wait_healed()
        clients.stop_producers()
        deadline = time.monotonic() + 180
        while clients.unsettled() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert clients.unsettled() == 0, f"sends still in doubt: {clients.describe()}\n" + nemesis.tails()
        clients.stop()
        live_a = lambda: (nemesis.live() or cluster.pair["primary"]).url   # noqa: E731
        drained = {qa: drain_through_owner(nemesis, live_a, qa),
                   qb: drain_through_owner(nemesis, lambda: cluster.b.url, qb)}
        verdict = check(ledger, streams, cluster.brokers(), {q: set(ids) for q, ids in drained.items()},
                        spans=nemesis.spans, slack=3 * max(PAIR_SESSION_TIMEOUT, CLUSTER_SESSION_TIMEOUT))
        names = {b.url: b.name for b in cluster.pair.values()}
        with ledger.lock:
            seen = [(names[url], at) for url, at in ledger.accepted.values() if url in names]
        view, spans = producer_view_overlaps(seen, [w for w in verdict.windows if w.broker in names.values()])
        copies = sum(n - 1 for ids in drained.values() for n in Counter(ids).values())
        verdict.duplicates = copies     # copies in the drains (messages sent again after an outcome was lost)
        per_producer = Counter(mid.rsplit("-", 1)[0] for mid in ledger.accepted)
        print(f"\nseed {seed}: {len(faults)} faults: " + "; ".join(f.describe() for f in faults))
        print("  done: " + "; ".join(what for _, what in nemesis.done))
        print(f"  Accepted per producer {dict(per_producer)}; drained {[len(v) for v in drained.values()]}; "
              f"connections {ledger.connections}")
        print(f"  {verdict.summary()}")
        print(f"  client-seen accept spans of node a's brokers: {spans}")
        tails = "\n".join(t for b in cluster.brokers() for t in b.exit_tails) + "\n" + nemesis.tails()
        return {"verdict": verdict, "view": view, "tails": tails}
    finally:
        if nemesis is not None:
            nemesis.stop.set()
        if clients is not None:
            try:
                clients.stop(5)
            except Exception:   # noqa: BLE001 - stopping after a failure
                pass
        cluster.stop()


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + SCHEDULES))
def test_pair_cluster_nemesis_schedule(tmp_path, seed):
    from tests.e2e.ha_harness import zookeeper_jar
    zookeeper_jar()   # skips (or fails under CI) when ZooKeeper cannot be had
    found = run_schedule(tmp_path, seed, SECONDS)
    verdict = found["verdict"]
    assert verdict.accepted_durable > 0
    assert not verdict.lost, f"{len(verdict.lost)} Accepted message(s) lost: {verdict.lost[:20]}\n{found['tails']}"
    assert not any(verdict.exits.values()), f"broker processes ended on their own: {verdict.exits}\n{found['tails']}"
    assert not verdict.overlaps, "accept windows of node a overlap:\n" + "\n".join(verdict.overlaps)
    assert not found["view"], "two brokers of node a accepted at once:\n" + "\n".join(found["view"])
    assert not verdict.stepdowns, "\n".join(verdict.stepdowns) + "\n" + found["tails"]
