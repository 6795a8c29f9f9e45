"""AMQP local transactions end to end, with frames shaped like Qpid JMS's."""

from __future__ import annotations

import uuid

import pytest
from proton import Delivery, Message, Terminus, Timeout

from tests.client import connect, terminus_capabilities
from tests.cluster_process import CLUSTER_KINDS, broker_or_cluster, colocated
from tests.e2e.helpers_conn import RawClient
from tests.e2e.jms_txn import DECLARED, TxnSession

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=CLUSTER_KINDS)
def broker(request, tmp_path_factory):
    """One broker, and a cluster whose client node owns nothing (every link forwarded)."""
    yield from broker_or_cluster(request.param, tmp_path_factory)


def uniq(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def raw(broker) -> RawClient:
    return RawClient("127.0.0.1", broker.port, container_id=uniq("txn-client")).wait_open()


def bodies_now(url: str, address: str, n: int, timeout: float = 5.0) -> list:
    conn = connect(url)
    try:
        r = conn.create_receiver(address, credit=max(n, 1))
        out = []
        for _ in range(n):
            out.append(r.receive(timeout=timeout))
            r.accept()
        return out
    finally:
        conn.close()


def nothing_on(url: str, address: str) -> bool:
    conn = connect(url)
    try:
        r = conn.create_receiver(address)
        try:
            r.receive(timeout=0.5)   # a short wait is the check that nothing is there
            return False
        except Timeout:
            return True
    finally:
        conn.close()


def test_coordinator_attach_offers_local_transactions(broker):
    client = raw(broker)
    txn = TxnSession(client)
    tgt = txn.coordinator.remote_target
    assert tgt.type == Terminus.COORDINATOR
    assert "amqp:local-transactions" in terminus_capabilities(tgt)
    assert len(txn.declare()) > 0
    client.close()


def test_commit_makes_staged_sends_visible(broker):
    q = uniq("q")
    client = raw(broker)
    s = TxnSession(client)
    snd = s.sender(q)
    txn = s.declare()
    outcomes = [s.send(snd, f"m{i}", txn) for i in range(3)]
    assert all(d.remote_state == 0x34 for d in outcomes)
    assert nothing_on(broker.url, q), "staged sends are invisible before commit"
    assert s.discharge(txn).remote_state == Delivery.ACCEPTED
    assert [m.body for m in bodies_now(broker.url, q, 3)] == ["m0", "m1", "m2"]
    client.close()


def test_rollback_discards_staged_sends(broker):
    q = uniq("q")
    client = raw(broker)
    s = TxnSession(client)
    snd = s.sender(q)
    txn = s.declare()
    s.send(snd, "gone", txn)
    assert s.discharge(txn, fail=True).remote_state == Delivery.ACCEPTED
    s.send(snd, "plain", None)
    assert [m.body for m in bodies_now(broker.url, q, 1)] == ["plain"]
    assert nothing_on(broker.url, q)
    client.close()


def test_mixed_send_and_ack_commit_atomically(broker):
    src = uniq("src")
    dst = colocated(broker, src, "dst")
    conn = connect(broker.url)
    conn.create_sender(src).send(Message(body="work"))
    conn.close()
    client = raw(broker)
    s = TxnSession(client)
    rcv = s.receiver(src)
    snd = s.sender(dst)
    txn = s.declare()
    dlv, msg = s.receive(rcv)
    s.ack(dlv, txn)
    s.send(snd, f"result of {msg.body}", txn)
    assert nothing_on(broker.url, dst)
    assert s.discharge(txn).remote_state == Delivery.ACCEPTED
    assert [m.body for m in bodies_now(broker.url, dst, 1)] == ["result of work"]
    client.close()
    assert nothing_on(broker.url, src), "the acknowledged message is gone"


def test_rollback_returns_acknowledged_messages_redelivered(broker):
    q = uniq("q")
    conn = connect(broker.url)
    conn.create_sender(q).send(Message(body="again"))
    conn.close()
    client = raw(broker)
    s = TxnSession(client)
    rcv = s.receiver(q, credit=1)
    txn = s.declare()
    dlv, msg = s.receive(rcv)
    assert msg.delivery_count == 0
    s.ack(dlv, txn)
    assert s.discharge(txn, fail=True).remote_state == Delivery.ACCEPTED
    rcv.flow(1)
    _, again = s.receive(rcv)
    assert again.body == "again" and again.delivery_count == 1   # JMSRedelivered
    client.close()


def test_unknown_transaction_id_is_refused(broker):
    q = uniq("q")
    client = raw(broker)
    s = TxnSession(client)
    outcome = s.discharge(b"no-such-txn")
    assert outcome.remote_state == Delivery.REJECTED
    assert outcome.remote.condition.name == "amqp:transaction:unknown-id"
    snd = s.sender(q)
    bad = s.send(snd, "x", b"no-such-txn")
    assert bad.remote_state == Delivery.REJECTED
    assert bad.remote.condition.name == "amqp:transaction:unknown-id"
    client.close()


def test_connection_drop_rolls_back(broker):
    q = uniq("q")
    out = colocated(broker, q, "out")
    conn = connect(broker.url)
    conn.create_sender(q).send(Message(body="held"))
    conn.close()
    client = raw(broker)
    s = TxnSession(client)
    rcv = s.receiver(q, credit=1)
    snd = s.sender(out)
    txn = s.declare()
    dlv, _ = s.receive(rcv)
    s.ack(dlv, txn)
    s.send(snd, "staged", txn)
    client.abandon()   # socket gone with the transaction open
    got = bodies_now(broker.url, q, 1)
    assert got[0].body == "held" and got[0].delivery_count >= 1
    assert nothing_on(broker.url, out)


def test_two_sessions_transactions_are_independent(broker):
    q = uniq("q")
    client = raw(broker)
    a, b = TxnSession(client), TxnSession(client)
    sa, sb = a.sender(q), b.sender(q)
    ta, tb = a.declare(), b.declare()
    assert ta != tb
    a.send(sa, "from-a", ta)
    b.send(sb, "from-b", tb)
    assert b.discharge(tb, fail=True).remote_state == Delivery.ACCEPTED
    assert a.discharge(ta).remote_state == Delivery.ACCEPTED
    assert [m.body for m in bodies_now(broker.url, q, 1)] == ["from-a"]
    assert nothing_on(broker.url, q)
    client.close()


def test_next_declare_before_discharge_outcome(broker):
    q = uniq("q")
    client = raw(broker)
    s = TxnSession(client)
    snd = s.sender(q)
    first = s.declare()
    s.send(snd, "one", first)
    from proton import Described, ulong
    discharge = s.request(Described(ulong(0x32), [first, False]))
    declare = s.request(Described(ulong(0x31), [None]))   # sent without waiting
    s.wait_outcome(discharge)
    s.wait_outcome(declare)
    assert discharge.remote_state == Delivery.ACCEPTED
    assert declare.remote_state == DECLARED
    second = bytes(declare.remote.data[0])
    s.send(snd, "two", second)
    assert s.discharge(second).remote_state == Delivery.ACCEPTED
    assert [m.body for m in bodies_now(broker.url, q, 2)] == ["one", "two"]
    client.close()


def test_committed_durable_messages_survive_sigkill(broker_factory):
    b = broker_factory()
    q = uniq("q")
    client = raw(b)
    s = TxnSession(client)
    snd = s.sender(q)
    txn = s.declare()
    for i in range(5):
        s.send(snd, i, txn, durable=True)
    assert s.discharge(txn).remote_state == Delivery.ACCEPTED
    b.kill()   # right after the Accepted discharge
    client.abandon()
    b.start()
    assert [m.body for m in bodies_now(b.url, q, 5)] == [0, 1, 2, 3, 4]


def test_another_connection_cannot_use_or_discharge_a_transaction(broker):
    """txn-ids are the broker's prefix and a counter, so any client that declares a
    transaction of its own can name everyone else's.  Another connection could send
    into it and roll it back: its owner's work was gone and its commit failed with
    unknown-id.  Now the id names nothing outside the connection that declared it."""
    owner, other = raw(broker), raw(broker)
    try:
        mine, theirs = TxnSession(owner), TxnSession(other)
        txn = mine.declare()
        q = uniq("txn.owned")
        snd = mine.sender(q)
        owner.wait(lambda: snd.credit > 0, what="credit")
        mine.send(snd, "mine", txn)
        intruder = theirs.sender(q)
        other.wait(lambda: intruder.credit > 0, what="credit")
        injected = theirs.send(intruder, "injected", txn)
        other.wait(lambda: injected.remote_state, what="the injected transfer's outcome")
        assert injected.remote_state == Delivery.REJECTED
        assert injected.remote.condition.name == "amqp:transaction:unknown-id"
        refused = theirs.discharge(txn, fail=True)
        assert refused.remote_state == Delivery.REJECTED
        assert refused.remote.condition.name == "amqp:transaction:unknown-id"
        committed = mine.discharge(txn)
        assert committed.remote_state == Delivery.ACCEPTED
        assert [m.body for m in bodies_now(broker.url, q, 1)] == ["mine"] and nothing_on(broker.url, q)
    finally:
        owner.close()
        other.close()
