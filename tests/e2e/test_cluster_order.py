"""End to end: a node answers a client's frames in the order the single broker would,
when one of them is an attach it forwards to another node (`serve --workers 3`, n0
owning nothing).

Alone, the broker handles a connection's frames in order: a sender's attach (and its
credit) is answered before a Declare sent after it.  A client that declares at once
and sends its transactional messages and the Discharge as soon as the Declare is
answered (python-qpid-proton's reactor does: its transfers wait for credit, the
Discharge on the coordinator link does not) relies on that order.  If the node
answered the Declare before the forwarded attach, the Discharge would overtake the
transfers: the transaction committed empty, the messages rejected
`amqp:transaction:unknown-id` (seen with the interop suite's transaction scenario)."""

from __future__ import annotations

import os
import signal

import pytest
from proton import Described, Message, Terminus, symbol, ulong

from tests.client import connect
from tests.cluster_process import ClusterProcess
from tests.e2e.helpers_conn import REMOTE_ACTIVE, REMOTE_CLOSED, RawClient
from tests.e2e.helpers_delivery import QUIET, drain_bodies, receiver, uid
from tests.e2e.test_cluster import owned_by

pytestmark = pytest.mark.e2e

DECLARE, DISCHARGE, DECLARED, TXN_STATE = 0x31, 0x32, 0x33, 0x34


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    proc = ClusterProcess(tmp_path_factory.mktemp("cluster-order") / "data").start()
    yield proc
    proc.stop()


def coordinator(ssn):
    c = ssn.sender(f"coordinator-{uid()}")
    c.target.type = Terminus.COORDINATOR
    c.target.capabilities.put_array(False, 21)
    c.target.capabilities.enter()
    c.target.capabilities.put_symbol(symbol("amqp:local-transactions"))
    c.target.capabilities.exit()
    c.open()
    return c


def test_a_declare_after_a_forwarded_attach_is_answered_after_it(cluster):
    """The owner stopped: the forwarded attach cannot be answered, and neither is the
    Declare pipelined after it; once the owner goes on, the attach (with credit) comes
    first."""
    q = owned_by("n2")
    pid = cluster.worker_pid("n2")
    client = RawClient("127.0.0.1", cluster.port, container_id=uid("order")).wait_open()
    ssn = client.session()
    os.kill(pid, signal.SIGSTOP)
    try:
        snd = ssn.sender(uid("snd"))
        snd.target.address = q
        snd.open()
        coord = coordinator(ssn)
        client.pump_for(QUIET)
        assert not snd.state & REMOTE_ACTIVE, "the owner is stopped"
        assert not coord.state & REMOTE_ACTIVE, "the coordinator's attach waits behind the forwarded one"
    finally:
        os.kill(pid, signal.SIGCONT)
    client.wait(lambda: coord.state & (REMOTE_ACTIVE | REMOTE_CLOSED), what="the coordinator attach")
    assert snd.state & REMOTE_ACTIVE and snd.credit > 0, "the forwarded attach, with its credit, came first"
    client.close()


def test_transfers_sent_once_declared_are_in_the_transaction_that_the_discharge_commits(cluster):
    """The reactor's order: sender attach, coordinator attach, Declare, all at once;
    on Declared: two transactional transfers and the Discharge at once."""
    q = owned_by("n1")
    client = RawClient("127.0.0.1", cluster.port, container_id=uid("txn")).wait_open()
    ssn = client.session()
    snd = ssn.sender(uid("snd"))
    snd.target.address = q
    snd.open()
    coord = coordinator(ssn)
    client.wait(lambda: coord.credit > 0, what="coordinator credit")
    declare = coord.send(Message(body=Described(ulong(DECLARE), [None])), tag="d")
    client.wait(lambda: declare.remote_state, what="Declared")
    assert declare.remote_state == DECLARED
    txn = bytes(declare.remote.data[0])
    sent = []
    for body in ("t1", "t2"):
        dlv = snd.delivery(uid("tag"))
        dlv.local.data = [txn]
        dlv.update(TXN_STATE)
        snd.stream(Message(body=body).encode())
        snd.advance()
        sent.append(dlv)
    discharge = coord.send(Message(body=Described(ulong(DISCHARGE), [txn, False])), tag="c")
    client.wait(lambda: discharge.remote_state and all(d.remote_state for d in sent), what="every outcome")
    assert [d.remote_state for d in sent] == [TXN_STATE, TXN_STATE]
    assert discharge.remote_state == 0x24   # accepted: committed
    client.close()
    conn = connect(cluster.url)
    try:
        assert drain_bodies(conn, receiver(conn, q, credit=10)) == ["t1", "t2"]
    finally:
        conn.close()
