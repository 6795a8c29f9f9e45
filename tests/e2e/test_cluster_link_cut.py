"""End to end: the TCP link between two nodes of a `[cluster]` (with ZooKeeper) cut and
healed under load, through a relay the test controls (tests/faults/relay.py): node
b advertises the relay's address to the other nodes, so node a's inter-node
connection to b goes through it, while clients and ZooKeeper reach b directly.

How it could fail, and what is checked:
* a cut while a forwarded durable send is in flight loses it or reports it Accepted
  without b's commit: every message a producer at a was told Accepted is at b;
* a reset leaves a's pooled connection to b dead, or a partition (bytes held both
  ways, as a pulled cable; the held bytes delivered at the heal, as TCP retransmits
  would) leaves a's links hanging for ever: the partition is held until a's idle
  timeout has ended the consumer's link; after the heal, sends through a are
  Accepted again and the consumer at a goes on reading (liveness, by count);
* a consumer at a of b's queue, cut mid-delivery, never loses a message: what it
  received plus what is left at b holds everything that was put there;
* a partition healed well inside the idle timeout (a stall, not a loss) makes a
  give up its connection to b anyway, or fails clients that only had to wait: the
  connections carry on (the relay sees none end), no client fails, and the
  same two checks hold.
Both producer and consumer are at-least-once clients (sent again until Accepted;
attached again after a failure), as a JMS client on a failover URI is.
"""

from __future__ import annotations

import time

import pytest
from proton import Message

from tests.client import connect
from tests.cluster_process import ZkCluster
from tests.e2e.ha_harness import free_port
from tests.e2e.helpers_delivery import drain_bodies, receiver, sender
from tests.e2e.retrying_clients import AcceptedProducer, AcceptingConsumer, stop_all
from tests.e2e.test_cluster_zk import eventually, owned_by
from tests.faults.relay import PARTITION, RESET, Relay

pytestmark = pytest.mark.e2e

BEFORE, DURING, AFTER = 150, 1, 150   # Accepted sends before the cut, failures during it, Accepted after the heal
FILL = 400                            # messages waiting at b for the consumer at a
WAIT = 120.0                          # seconds before a wait is given up (a hung test)
STALL = 1.5                           # a brief partition, seconds: a tenth of the idle timeout (cluster/peer.py)


def _start(tmp_path):
    """A ZooKeeper cluster whose node b is reached by the other nodes through a relay;
    FILL messages wait in a queue b owns. Returns (cluster, relay, produced-to, consumed-from)."""
    b_port = free_port()
    relay = Relay(lambda: ("127.0.0.1", b_port), name="a-b").start()
    cl = ZkCluster(tmp_path, node_extra={"b": f'listen_port = {b_port}\nadvertised = "127.0.0.1:{relay.port}"\n'})
    try:
        cl.start()
        qp, qc = owned_by("b"), owned_by("b")
        filler = connect(cl.node_url("b"))
        try:
            snd = sender(filler, qc)
            for i in range(FILL):
                snd.send(Message(body=i, durable=True))
        finally:
            filler.close()
    except BaseException:
        cl.stop()
        relay.stop()
        raise
    return cl, relay, qp, qc


def _clients_at_a(cl, qp: str, qc: str) -> tuple[AcceptedProducer, AcceptingConsumer]:
    at_a = lambda: cl.node_url("a")   # noqa: E731
    producer = AcceptedProducer("producer", at_a, qp, body=lambda n: n)
    # Slower than the producer: the cut finds it in the middle of the queue.
    consumer = AcceptingConsumer("consumer", at_a, lambda c: receiver(c, qc, credit=10), pace=0.01)
    producer.start()
    consumer.start()
    eventually(lambda: len(producer.acked) >= BEFORE, WAIT, "sends Accepted through a before the cut")
    eventually(lambda: len(consumer.got) >= 20, WAIT, "the consumer at a reading b's queue")
    return producer, consumer


def _check_nothing_lost(cl, qp: str, qc: str, producer: AcceptedProducer, consumer: AcceptingConsumer) -> str:
    direct = connect(cl.node_url("b"))
    try:
        stored = drain_bodies(direct, receiver(direct, qp, credit=5000), timeout=2.0)
        left = drain_bodies(direct, receiver(direct, qc, credit=5000), timeout=1.0)
    finally:
        direct.close()
    lost = sorted(set(producer.acked) - set(stored))
    assert not lost, f"Accepted through a, not at b: {lost[:10]} ({len(lost)})"
    missing = sorted(set(range(FILL)) - set(consumer.got) - set(left))
    assert not missing, f"put at b, neither received at a nor left at b: {missing[:10]}"
    assert "Traceback" not in cl.log_text()
    return (f"{len(producer.acked)} Accepted, {len(stored)} at b ({len(stored) - len(set(stored))} copies); "
            f"producer failures {producer.failures}, consumer failures {consumer.failures}, "
            f"{len(consumer.got) - len(set(consumer.got))} deliveries again; consumer: {consumer.reasons}")


@pytest.mark.parametrize("how", [RESET, PARTITION])
def test_a_cut_and_healed_link_between_nodes_loses_nothing_accepted_and_recovers(tmp_path, how):
    cl, relay, qp, qc = _start(tmp_path)
    try:
        producer, consumer = _clients_at_a(cl, qp, qc)
        try:
            # Counts, not clocks: the deadlines (WAIT) only stop a hung test.
            relay.cut(how)
            failed = producer.failures
            eventually(lambda: producer.failures >= failed + DURING, WAIT, "a send through a to fail in the cut")
            if how == PARTITION:   # held until a's idle timeout gives the connection up (cluster/peer.py)
                eventually(lambda: consumer.failures >= 1, WAIT, "the consumer's link at a to end in the cut")
            relay.heal()
            healed = len(producer.acked)
            eventually(lambda: len(producer.acked) >= healed + AFTER, WAIT, "sends Accepted through a after the heal")
            eventually(lambda: len(set(consumer.got)) >= FILL, 1.5 * WAIT, "the consumer to go on after the heal")
        finally:
            stop_all([producer, consumer])
        print(f"{how}: " + _check_nothing_lost(cl, qp, qc, producer, consumer))
        assert any("amqpbroker:resource-unavailable" in r for r in consumer.reasons), consumer.reasons
    finally:
        cl.stop()
        relay.stop()


def test_a_brief_partition_between_nodes_is_a_stall_not_a_failure(tmp_path):
    cl, relay, qp, qc = _start(tmp_path)
    try:
        producer, consumer = _clients_at_a(cl, qp, qc)
        try:
            ended = relay.ended
            relay.cut(PARTITION)
            stalled_at = len(producer.acked)
            time.sleep(STALL)
            # Forwarded sends wait for b's outcome: none can be Accepted while the way is held
            # but the one whose outcome was already past the relay (the producer sends one at a time).
            assert len(producer.acked) <= stalled_at + 1, "a forwarded send was Accepted across the partition"
            relay.heal()
            healed = len(producer.acked)
            eventually(lambda: len(producer.acked) >= healed + AFTER, WAIT, "sends Accepted through a after the heal")
            eventually(lambda: len(set(consumer.got)) >= FILL, 1.5 * WAIT, "the consumer to go on after the heal")
            # (A client's connection at a has its own to b: those end when the clients stop.)
            assert relay.ended == ended, f"a connection to b was given up in a {STALL} s stall"
        finally:
            stop_all([producer, consumer])
        print("brief partition: " + _check_nothing_lost(cl, qp, qc, producer, consumer))
        assert (producer.failures, consumer.failures) == (0, 0), (producer.reasons, consumer.reasons)
    finally:
        cl.stop()
        relay.stop()
