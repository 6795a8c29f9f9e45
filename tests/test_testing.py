"""The embeddable broker for users' tests (amqpbroker.testing and its pytest plugin),
exercised the way a user would: the `amqp_broker` fixture, real AMQP through
python-qpid-proton, the admin handle, restarts, several brokers at once."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from proton import Message, Timeout

from amqpbroker.testing import AmqpBroker, BrokerStartError, running_broker
from tests.client import connect
from tests.e2e.jms_links import close, detach, shared_consumer

pytestmark = pytest.mark.e2e


def send(url: str, address: str, bodies: list, durable: bool = True) -> None:
    conn = connect(url)
    try:
        snd = conn.create_sender(address)
        for body in bodies:
            snd.send(Message(body=body, durable=durable))
    finally:
        conn.close()


def receive(url: str, address: str, n: int, timeout: float = 5) -> list:
    conn = connect(url)
    try:
        rcv = conn.create_receiver(address, credit=n)
        out = []
        for _ in range(n):
            out.append(rcv.receive(timeout=timeout).body)
            rcv.accept()
        return out
    finally:
        conn.close()


def nothing_waiting(url: str, address: str) -> bool:
    conn = connect(url)
    try:
        rcv = conn.create_receiver(address, credit=1)
        try:
            rcv.receive(timeout=0.3)
        except Timeout:
            return True
        return False
    finally:
        conn.close()


def test_fixture_is_a_running_broker_reached_over_amqp(amqp_broker):
    assert amqp_broker.mode == "inprocess"
    assert amqp_broker.url == f"amqp://127.0.0.1:{amqp_broker.port}"
    assert amqp_broker.host == "127.0.0.1" and amqp_broker.port > 0
    assert amqp_broker.data_dir.is_dir()
    assert amqp_broker.settings.data_dir == amqp_broker.data_dir
    send(amqp_broker.url, "greetings", ["hello", "world"])
    assert receive(amqp_broker.url, "greetings", 2) == ["hello", "world"]


def test_admin_queue_depth_follows_sends_receives_and_purge(amqp_broker):
    admin = amqp_broker.admin
    with pytest.raises(KeyError):
        admin.queue_depth("orders")
    send(amqp_broker.url, "orders", [f"order-{i}" for i in range(5)])
    assert "orders" in admin.queues()
    assert admin.queue_depth("orders") == 5
    assert receive(amqp_broker.url, "orders", 2) == ["order-0", "order-1"]
    assert admin.queue_depth("orders") == 3
    assert admin.purge("orders") == 3
    assert admin.queue_depth("orders") == 0
    assert nothing_waiting(amqp_broker.url, "orders")
    deadline = time.monotonic() + 5   # the broker counts a connection out when its socket ends
    while admin.connections() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert admin.connections() == 0


def test_admin_lists_subscriptions(amqp_broker):
    conn = connect(amqp_broker.url, container_id="client-1")
    try:
        rcv = shared_consumer(conn, "prices", "ticker")
        [sub] = amqp_broker.admin.subscriptions()
        assert (sub["namespace"], sub["name"], sub["durable"], sub["shared"]) == ("client-1", "ticker", True, True)
        assert sub["consumers"] == 1 and sub["queue"] in amqp_broker.admin.queues()
        assert (sub["exchange"], sub["key"]) == ("amq.topic", "prices")
        send(amqp_broker.url, "amq.topic/prices", ["p1"])
        assert rcv.receive(timeout=5).body == "p1"
        rcv.accept()
        assert detach(conn, rcv) is None   # durable consumer close: the subscription stays
        assert amqp_broker.admin.subscriptions()[0]["consumers"] == 0
    finally:
        conn.close()


@pytest.mark.parametrize("amqp_broker", ["inprocess", "subprocess"], indirect=True)
def test_restart_keeps_durable_messages(amqp_broker):
    port = amqp_broker.port
    send(amqp_broker.url, "ledger", ["entry-1", "entry-2"], durable=True)
    amqp_broker.restart()
    assert amqp_broker.port == port   # same port when it is still free: saved URLs keep working
    assert receive(amqp_broker.url, "ledger", 2) == ["entry-1", "entry-2"]


def test_restart_keeps_durable_subscription_backlog(amqp_broker):
    conn = connect(amqp_broker.url, container_id="app")
    rcv = shared_consumer(conn, "events", "audit")
    assert detach(conn, rcv) is None
    conn.close()
    send(amqp_broker.url, "amq.topic/events", ["e1", "e2"])
    amqp_broker.restart()
    [sub] = amqp_broker.admin.subscriptions()
    assert sub["depth"] == 2
    conn = connect(amqp_broker.url, container_id="app")
    try:
        rcv = shared_consumer(conn, "events", "audit")
        got = [rcv.receive(timeout=5).body for _ in range(2)]
        rcv.accept()
        assert got == ["e1", "e2"]
        assert close(conn, rcv) is None
    finally:
        conn.close()


def test_two_brokers_at_once(amqp_broker_factory):
    a = amqp_broker_factory()
    b = amqp_broker_factory()
    assert a.port != b.port and a.data_dir != b.data_dir
    send(a.url, "jobs", ["for-a"])
    send(b.url, "jobs", ["for-b-1", "for-b-2"])
    assert (a.admin.queue_depth("jobs"), b.admin.queue_depth("jobs")) == (1, 2)
    assert receive(a.url, "jobs", 1) == ["for-a"]
    assert receive(b.url, "jobs", 2) == ["for-b-1", "for-b-2"]


@pytest.mark.amqp_broker(mode="subprocess", queues=[{"name": "invoices"}],
                         policy={"max_delivery_attempts": 3})
def test_marker_configures_a_subprocess_broker(amqp_broker):
    assert amqp_broker.mode == "subprocess" and amqp_broker.running
    assert amqp_broker.settings.policy.max_delivery_attempts == 3
    send(amqp_broker.url, "invoices", ["inv-1"])
    assert receive(amqp_broker.url, "invoices", 1) == ["inv-1"]
    assert "amqp listening on" in amqp_broker.log_text()
    with pytest.raises(RuntimeError, match="inprocess"):
        amqp_broker.admin.queue_depth("invoices")


@pytest.mark.amqp_broker(queues=[{"name": "invoices"}], store={"enabled": False})
def test_marker_settings_reach_an_inprocess_broker(amqp_broker):
    assert amqp_broker.admin.queues() == ["DLQ", "invoices"]   # and the dead-letter queue, on by default
    assert amqp_broker.settings.store.enabled is False


def test_running_broker_context_manager_cleans_up():
    with running_broker() as broker:
        data_dir = broker.data_dir
        send(broker.url, "q", ["x"])
        assert broker.admin.queue_depth("q") == 1
    assert not broker.running
    assert not data_dir.exists()
    with socket.socket() as s:   # the listener is gone: the port can be bound again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", broker.port))


def test_running_broker_keeps_a_given_data_dir(tmp_path: Path):
    with running_broker(data_dir=tmp_path / "d") as broker:
        send(broker.url, "kept", ["k"])
    with running_broker(data_dir=tmp_path / "d") as broker:
        assert receive(broker.url, "kept", 1) == ["k"]


def test_bad_settings_are_reported():
    with pytest.raises(BrokerStartError, match="limits.max_frame_size"):
        AmqpBroker(limits={"max_frame_size": 1})


def test_port_in_use_is_reported(amqp_broker):
    with pytest.raises(BrokerStartError, match="did not start"):
        AmqpBroker(port=amqp_broker.port).start()
