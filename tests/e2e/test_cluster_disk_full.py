"""End to end: the owner's disk is full while a node in front forwards durable sends
to it (`serve --workers 3`; every worker's store fails commits by count,
store/faults.py).

How it could fail, and what is checked:
* the node in front answers Accepted before, or without, the owner's commit (its own
  store is not the one that failed): every send the client was told Accepted is at
  the owner after the owner is killed -9 and started again on its store;
* the owner's refusal is lost on the way back (the client waits for ever, or sees
  Accepted): the client sees each refusal as a refusal, and sends the message again;
* a refused message is stored anyway, or a resend is stored twice: each message is
  at the owner exactly once;
* the node in front or the owner stops serving after the fault: both go on, and the
  last sends are Accepted at once.
A queue of one owner and a partitioned queue reached through its one name (at a node
with no member of it, so each send is forwarded to a member) are both checked; and
* a consumer at another node whose accepts' removals fail to commit at the owner loses
  a message, or stops: each is received or still at the owner after its kill -9.
"""

from __future__ import annotations

import re
import time

import pytest
from proton import Delivery, Message
from proton.utils import SendException

from tests.client import connect
from tests.cluster_process import ClusterProcess
from tests.e2e.helpers_delivery import drain_bodies, receiver, sender
from tests.e2e.test_cluster import NO_HANDOFF, owned_by
from tests.e2e.test_cluster_jms import members

pytestmark = pytest.mark.e2e

COUNT = 200
# Each worker's writer: commits 31 to 33 fail with a full disk (LMDB DiskError); a
# synchronous send is one commit at its owner, so the fault comes in the middle.
FAULT = {"AMQPBROKER_STORE_FAULTS": "commit:DiskError@30*3"}
PARTITIONED = "pfull"
CONFIG = NO_HANDOFF + f'partitioned = [{{address = "{PARTITIONED}", members = 2}}]\n'
FAILED_COMMIT = r"store commit of \d+ batch\(es\) failed: disk full"


def send_each_until_accepted(url: str, address: str, count: int) -> list[int]:
    """Bodies 0..count-1, durable, one at a time, each sent again until its outcome is
    Accepted; the refusals each met."""
    conn = connect(url)
    try:
        snd = sender(conn, address)
        refused = []
        for i in range(count):
            tries = 0
            while True:
                try:
                    dlv = snd.send(Message(body=i, durable=True), timeout=30)
                    if dlv.remote_state == Delivery.ACCEPTED:
                        break
                except SendException:
                    pass
                tries += 1
                assert tries < 100, f"message {i} refused {tries} times: the store did not recover"
                time.sleep(0.1)   # a store that failed refuses durable sends until a commit passes again
            refused.append(tries)
        return refused
    finally:
        conn.close()


def stored_after_restart(cl: ClusterProcess, owners: list[str], address: str, at: str) -> list[int]:
    """kill -9 of each owner in turn (the supervisor starts it again on its store), then
    everything `address` holds, read at node `at`; no node logged a traceback."""
    for node in owners:
        mark = len(cl.lines)
        cl.kill_node(node)
        cl.wait_nodes(after=mark, timeout=60)
    conn = connect(cl.node_url(at))
    try:
        stored = drain_bodies(conn, receiver(conn, address, credit=COUNT), timeout=3.0)
    finally:
        conn.close()
    assert "Traceback" not in cl.log_text()
    return stored


@pytest.mark.parametrize("kind", ["queue", "partitioned"])
def test_a_full_disk_at_the_owner_of_forwarded_sends_refuses_them_and_loses_nothing_accepted(tmp_path, kind):
    cl = ClusterProcess(tmp_path / "data", config=CONFIG, env=FAULT).start()
    try:
        if kind == "queue":
            address, owners = owned_by("n1"), ["n1"]
        else:
            address, owners = PARTITIONED, sorted({node for _, node in members(cl, PARTITIONED)})
            assert "n0" not in owners, owners   # n0 has no member: each send is forwarded
        mark = len(cl.log_text())
        refused = send_each_until_accepted(cl.node_url("n0"), address, COUNT)
        failed = re.findall(FAILED_COMMIT, cl.log_text()[mark:])
        assert failed, "the injected full disk happened under the sends"
        assert sum(refused) >= 1, "a send met the owner's full disk and the client was told so"
        assert refused[-20:] == [0] * 20, f"the sends after the fault are Accepted at once: {refused}"
        stored = stored_after_restart(cl, owners, address, at="n0")
    finally:
        cl.stop()
    print(f"{kind}: {len(failed)} failed commit(s); refusals {sum(refused)} "
          f"(messages {[i for i, n in enumerate(refused) if n]}); {len(stored)} stored")
    lost = sorted(set(range(COUNT)) - set(stored))
    assert not lost, f"Accepted, not at the owner after its restart: {lost[:10]} ({len(lost)})"
    assert sorted(stored) == list(range(COUNT)), "each message is stored exactly once"


def test_a_full_disk_at_the_owner_while_a_consumer_elsewhere_accepts_loses_nothing(tmp_path):
    """The owner's removals fail to commit (a consumer at n0 accepting, forwarded): the
    owner keeps them to write with its next commit (store/channel.py `_carry`). Every
    message is received at n0 or still at the owner after its kill -9: none lost, and
    the consumer reads on after the fault."""
    fault = {"AMQPBROKER_STORE_FAULTS": f"commit:DiskError@{COUNT + 50}*3"}   # in the middle of the reading
    cl = ClusterProcess(tmp_path / "data", config=CONFIG, env=fault).start()
    try:
        address = owned_by("n1")
        assert send_each_until_accepted(cl.node_url("n1"), address, COUNT) == [0] * COUNT
        mark = len(cl.log_text())
        got = []
        conn = connect(cl.node_url("n0"))
        try:
            rcv = receiver(conn, address, credit=1)   # one accept, one removal commit, at a time
            while len(got) < COUNT:
                try:
                    msg = rcv.receive(timeout=10)
                except Exception as exc:   # noqa: BLE001 - the checker below says what was lost
                    raise AssertionError(f"the consumer at n0 stopped after {len(got)}: {exc}") from None
                got.append(msg.body)
                rcv.accept()
        finally:
            conn.close()
        failed = re.findall(FAILED_COMMIT, cl.log_text()[mark:])
        assert failed, "the injected full disk happened under the accepts"
        left = stored_after_restart(cl, ["n1"], address, at="n1")
    finally:
        cl.stop()
    print(f"{len(failed)} failed commit(s); {len(got)} received ({len(got) - len(set(got))} again), "
          f"{len(left)} left at the owner: {left[:10]}")
    missing = sorted(set(range(COUNT)) - set(got) - set(left))
    assert not missing, f"neither received nor left at the owner: {missing[:10]}"
    assert not set(left) - set(range(COUNT)), left
