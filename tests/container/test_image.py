"""Properties of the image itself: non-root, health check, data volume, env config."""

from __future__ import annotations

import os
import tempfile
import uuid

import pytest
from proton import Message

from tests.client import connect

pytestmark = pytest.mark.container


def test_runs_as_non_root_and_reports_healthy(broker):
    code, out = broker.exec("id", "-u")
    assert code == 0 and out.strip() != "0"
    import time
    deadline = time.monotonic() + 60
    while broker.health() != "healthy":
        assert time.monotonic() < deadline, f"health: {broker.health()}"
        time.sleep(0.5)   # the engine runs the health check on its own schedule


def test_config_through_environment(container_factory):
    b = container_factory(env={"AMQPBROKER_CONTAINER_ID": "from-env"}).start()
    conn = connect(b.url)
    assert conn.conn.remote_container == "from-env"
    conn.close()


def test_durable_messages_survive_container_restart_on_the_data_volume(container_factory):
    volume = tempfile.mkdtemp(prefix="amqpbroker-vol-")
    os.chmod(volume, 0o777)   # the image runs as an unprivileged user
    q = f"q-{uuid.uuid4().hex[:8]}"
    first = container_factory(volume=volume).start()
    conn = connect(first.url)
    sender = conn.create_sender(q)
    for i in range(3):
        sender.send(Message(body=i, durable=True))
    conn.close()
    first.stop()
    second = container_factory(volume=volume).start()
    conn = connect(second.url)
    rcv = conn.create_receiver(q, credit=3)
    assert [rcv.receive(timeout=10).body for _ in range(3)] == [0, 1, 2]
    rcv.accept()
    conn.close()


def test_management_listens_on_every_interface_and_says_how_to_open_it(container_factory):
    """`-p 8161:8161` reaches the management listener (0.0.0.0 in the image); without
    a user who may manage, the log line says how to configure one."""
    from tests.container.container_broker import free_port
    port = free_port()
    b = container_factory(env={"AMQPBROKER_MANAGEMENT__ENABLED": "true",
                               "AMQPBROKER_MANAGEMENT__PORT": str(port)}).start()
    b.wait_for_log(rf"management listening on 0\.0\.0\.0:{port}")
    b.wait_for_log(r"management API on 0\.0\.0\.0 answers loopback clients only: .*AMQPBROKER_ACL=")


def test_management_with_a_manager_from_the_environment(container_factory):
    import httpx

    from amqpbroker.security.users import hash_password
    from tests.container.container_broker import free_port
    port = free_port()
    b = container_factory(env={"AMQPBROKER_MANAGEMENT__ENABLED": "true", "AMQPBROKER_MANAGEMENT__PORT": str(port),
                               "AMQPBROKER_USERS__ADMIN__PASSWORD": hash_password("admin-pw"),
                               "AMQPBROKER_ACL": '[{"user": "admin", "permissions": ["manage"]}]',
                               "AMQPBROKER_ANONYMOUS__PERMISSIONS": '["send", "consume"]'}).start()
    b.wait_for_log(rf"management listening on 0\.0\.0\.0:{port}")
    url = f"http://127.0.0.1:{port}/api/overview"
    assert httpx.get(url, auth=("admin", "admin-pw"), timeout=10).json()["user"] == "admin"
    assert httpx.get(url, timeout=10).status_code == 401
    assert "answers loopback clients only" not in b.log_text()
