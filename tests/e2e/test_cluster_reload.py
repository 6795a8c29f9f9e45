"""End to end: a live reload (SIGHUP to `serve --workers 2`, passed on to every
worker) re-checks the ACL of a producer on a partitioned queue the way its attach was
checked.  At a node that owns a member the producer is served in-process as that
member (server/ports.py AttachHere) and needed `send` on the name it gave *and* on
the member (server/refusal.py check_access, as the member's node checks a forwarded
producer); a reload that takes the member away detaches it
(`amqp:unauthorized-access`), one that keeps both leaves it working."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
from proton import Endpoint, Message

from tests.cluster_process import ClusterProcess
from tests.e2e.helpers_conn import RawClient

pytestmark = pytest.mark.e2e

USERS = """
[users.alice]
password = "alice-pw"
groups = ["orders-app"]
"""
CLUSTER = """
[cluster]
handoff = false   # each client stays at the node it connects to
partitioned = [{ address = "orders", members = 2 }]
"""


def config(pattern: str) -> str:
    return USERS + f"""
[[acl]]
group = "orders-app"
pattern = "{pattern}"
permissions = ["send"]
""" + CLUSTER


def producer_at(cl: ClusterProcess, node: str) -> tuple[RawClient, object]:
    client = RawClient(cl.host, cl.nodes()[node], container_id=f"alice-{uuid.uuid4().hex[:6]}", sasl_mechs="PLAIN",
                       user="alice", password="alice-pw").wait_open()
    return client, client.sender(client.session(), "orders", f"p-{node}")


def accepted(client: RawClient, snd, body: str) -> bool:
    client.wait(lambda: snd.credit > 0, what="credit")
    dlv = snd.delivery(body.encode())
    snd.send(Message(body=body, durable=True).encode())
    snd.advance()
    client.wait(lambda: dlv.remote_state, what="outcome")
    return dlv.remote_state == dlv.ACCEPTED


def reload(cl: ClusterProcess, text: str, times: int) -> None:
    """The new file, SIGHUP to the supervisor; then each worker's `times`-th reload line."""
    cl.config_path.write_text(text)
    os.kill(cl.proc.pid, signal.SIGHUP)
    deadline = time.monotonic() + 30

    def reloads(node: str) -> int:
        return sum(f"[{node}]" in line and "configuration reloaded from" in line
                   for line in cl.log_text().splitlines())

    while not all(reloads(node) >= times for node in ("n0", "n1")):
        assert time.monotonic() < deadline, "no reload:\n" + cl.log_text()[-3000:]
        time.sleep(0.1)


def test_a_reload_rechecks_a_member_producer_on_its_member_too(tmp_path):
    cl = ClusterProcess(tmp_path / "data", workers=2, weights=None, config=config("orders.#")).start()
    clients = []
    try:
        producers = []
        for node in ("n0", "n1"):   # two members over two nodes: each node owns one
            client, snd = producer_at(cl, node)
            clients.append(client)
            assert accepted(client, snd, f"before {node}")
            producers.append((client, snd))

        reload(cl, config("orders.#") + "\n# edited, nothing taken away\n", 1)
        for client, snd in producers:
            assert snd.state & Endpoint.REMOTE_ACTIVE
            assert accepted(client, snd, "after an edit")

        reload(cl, config("orders"), 2)   # the name stays allowed, its members no longer
        for client, snd in producers:
            client.wait(lambda: bool(snd.state & Endpoint.REMOTE_CLOSED), what="the producer's detach")
            cond = snd.remote_condition
            assert cond is not None and cond.name == "amqp:unauthorized-access"
            assert "no longer allowed to send on 'orders.p" in cond.description
    finally:
        for client in clients:
            client.close()
        cl.stop()


def test_a_reload_rechecks_a_consumer_through_the_one_name_on_its_own_member_too(tmp_path):
    """The consumer's side (cluster/fanin.py): at a node that owns a member, a consumer of
    the one name is that member's consumer in-process, its attach checked on the member
    too.  A reload that keeps the name and the other member but takes this node's member
    away detaches it, naming its member (the other member's node has nothing to say)."""
    from amqpbroker.core.placement import partition_members, static_map
    (own, node), (other, _) = partition_members("orders", 2, static_map(["n0", "n1"]))

    def consume_on(*patterns: str) -> str:
        return USERS + "".join(f'\n[[acl]]\ngroup = "orders-app"\npattern = "{p}"\npermissions = ["consume"]\n'
                               for p in patterns) + CLUSTER

    cl = ClusterProcess(tmp_path / "data", workers=2, weights=None, config=consume_on("orders", "orders.#")).start()
    client = None
    try:
        client = RawClient(cl.host, cl.nodes()[node], container_id=f"alice-{uuid.uuid4().hex[:6]}",
                           sasl_mechs="PLAIN", user="alice", password="alice-pw").wait_open()
        rcv = client.receiver(client.session(), "orders", "c-own")
        assert rcv.state & Endpoint.REMOTE_ACTIVE and rcv.remote_source.address == "orders"
        reload(cl, consume_on("orders", other), 1)
        client.wait(lambda: bool(rcv.state & Endpoint.REMOTE_CLOSED), what="the consumer's detach")
        cond = rcv.remote_condition
        assert cond is not None and cond.name == "amqp:unauthorized-access"
        assert f"no longer allowed to consume on '{own}'" in cond.description, cond.description
    finally:
        if client is not None:
            client.close()
        cl.stop()
