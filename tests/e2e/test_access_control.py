"""Access control ([[acl]], [anonymous]) end to end: attaches refused with
amqp:unauthorized-access and a null terminus, anonymous-relay messages rejected,
and the management API behind HTTP basic + `manage`."""

from __future__ import annotations

import re
import uuid

import httpx
import pytest
from proton import Delivery, Endpoint, Message, Terminus
from proton.utils import LinkDetached, SendException

from tests.broker_process import BrokerProcess
from tests.client import SourceOptions, connect
from tests.e2e.helpers_conn import RawClient
from tests.e2e.jms_links import null_source_attach, shared_consumer

pytestmark = pytest.mark.e2e

CONFIG = """
[users.alice]
password = "alice-pw"
groups = ["orders-app"]
[users.bob]
password = "bob-pw"
groups = ["auditors"]
[users.root]
password = "root-pw"
groups = ["ops"]

[[acl]]
group = "orders-app"
pattern = "orders.#"
permissions = ["send", "consume"]

[[acl]]
group = "auditors"
pattern = "orders.#"
permissions = ["browse"]

[[acl]]
group = "ops"
permissions = ["all"]

[anonymous]
pattern = "public.#"
permissions = ["send", "consume"]
"""

PASSWORDS = {"alice": "alice-pw", "bob": "bob-pw", "root": "root-pw"}


@pytest.fixture(scope="module")
def acl_broker(tmp_path_factory):
    proc = BrokerProcess(tmp_path_factory.mktemp("acl") / "data", config=CONFIG).start()
    yield proc
    proc.stop()


def uniq(prefix: str) -> str:
    return f"{prefix}.{uuid.uuid4().hex[:8]}"


def login(broker, user: str | None, container_id: str | None = None):
    if user is None:
        return connect(broker.url, container_id=container_id or uniq("anon"))
    return connect(broker.url, container_id=container_id or uniq(user), user=user, password=PASSWORDS[user],
                   allowed_mechs="PLAIN", allow_insecure_mechs=True)


def raw(broker, user: str) -> RawClient:
    return RawClient(broker.host, broker.port, container_id=uniq("raw"), sasl_mechs="PLAIN", user=user,
                     password=PASSWORDS[user]).wait_open()


def assert_refused_unauthorized(link) -> None:
    assert link.state & Endpoint.REMOTE_CLOSED, "the attach must be followed by a detach"
    assert link.remote_condition is not None and link.remote_condition.name == "amqp:unauthorized-access"


# ---------------------------------------------------------------------- allowed

def test_allowed_send_and_consume(acl_broker):
    q = uniq("orders")
    conn = login(acl_broker, "alice")
    rcv = conn.create_receiver(q)
    conn.create_sender(q).send(Message(body="ok"))
    assert rcv.receive(timeout=10).body == "ok"
    rcv.accept()
    conn.close()


def test_ops_group_may_do_everything(acl_broker):
    conn = login(acl_broker, "root")
    q = uniq("anything")
    rcv = conn.create_receiver(q)
    conn.create_sender(q).send(Message(body="root"))
    assert rcv.receive(timeout=10).body == "root"
    rcv.accept()
    conn.close()


# ---------------------------------------------------------------------- refused attaches

def test_sender_without_send_permission_gets_null_target(acl_broker):
    c = raw(acl_broker, "alice")
    try:
        snd = c.sender(c.session(), "invoices", "snd-1")
        c.wait(lambda: snd.state & Endpoint.REMOTE_CLOSED, what="detach")
        assert snd.remote_target.address is None
        assert_refused_unauthorized(snd)
        assert "user 'alice' is not allowed to send on 'invoices'" in snd.remote_condition.description
    finally:
        c.close()
    acl_broker.wait_for_log(r"access denied: user 'alice' is not allowed to send on 'invoices'")


def test_receiver_without_consume_permission_gets_null_source(acl_broker):
    c = raw(acl_broker, "alice")
    try:
        rcv = c.receiver(c.session(), "invoices", "rcv-1")
        c.wait(lambda: rcv.state & Endpoint.REMOTE_CLOSED, what="detach")
        assert rcv.remote_source.address is None
        assert_refused_unauthorized(rcv)
    finally:
        c.close()


def test_blocking_client_sees_the_refusal(acl_broker):
    conn = login(acl_broker, "alice")
    with pytest.raises(LinkDetached) as refused:
        conn.create_receiver("secret.q")
    assert "amqp:unauthorized-access" in str(refused.value)
    conn.close()


def test_browse_permission_allows_copy_but_not_consume(acl_broker):
    q = uniq("orders")
    conn = login(acl_broker, "alice")
    conn.create_sender(q).send(Message(body="look"))
    conn.close()
    conn = login(acl_broker, "bob")
    browser = conn.create_receiver(q, name="browser",
                                   options=SourceOptions(distribution_mode=Terminus.DIST_MODE_COPY))
    assert browser.receive(timeout=10).body == "look"
    browser.accept()
    with pytest.raises(LinkDetached) as refused:
        conn.create_receiver(q, name="consumer")
    assert "amqp:unauthorized-access" in str(refused.value)
    with pytest.raises(LinkDetached):
        conn.create_sender(q, name="sender")
    conn.close()


def test_subscriptions_check_the_topic_address(acl_broker):
    conn = login(acl_broker, "alice", container_id=uniq("jms"))
    ok = shared_consumer(conn, "orders.eu", "audit", global_=True, credit=0)
    with pytest.raises(LinkDetached) as refused:
        shared_consumer(conn, "invoices.eu", "inv", global_=True, credit=0)
    assert "amqp:unauthorized-access" in str(refused.value)
    ok.close()                      # closed=true: unsubscribe, allowed by consume on orders.eu
    conn.close()


def test_null_source_lookup_checks_the_stored_subscription_topic(acl_broker):
    alice = login(acl_broker, "alice", container_id=uniq("jms"))
    consumer = shared_consumer(alice, "orders.audit", "g-audit", global_=True, credit=0)
    bob = login(acl_broker, "bob", container_id=uniq("jms"))
    with pytest.raises(LinkDetached) as refused:
        null_source_attach(bob, "g-audit|global")   # bob may only browse orders.#
    assert "amqp:unauthorized-access" in str(refused.value)
    bob.close()
    consumer.close()
    alice.close()


# ---------------------------------------------------------------------- anonymous

def test_anonymous_limited_to_its_section(acl_broker):
    conn = login(acl_broker, None)
    q = uniq("public")
    rcv = conn.create_receiver(q)
    conn.create_sender(q).send(Message(body="hi"))
    assert rcv.receive(timeout=10).body == "hi"
    rcv.accept()
    with pytest.raises(LinkDetached) as refused:
        conn.create_receiver(uniq("orders"))
    assert "amqp:unauthorized-access" in str(refused.value)
    conn.close()


# ---------------------------------------------------------------------- anonymous relay

def test_anonymous_relay_rejects_messages_to_forbidden_addresses(acl_broker):
    q = uniq("orders")
    conn = login(acl_broker, "alice")
    rcv = conn.create_receiver(q)
    relay = conn.create_sender(None)
    relay.send(Message(address=q, body="allowed"))
    assert rcv.receive(timeout=10).body == "allowed"
    rcv.accept()
    with pytest.raises(SendException) as rejected:
        relay.send(Message(address="invoices", body="forbidden"))
    assert rejected.value.state == Delivery.REJECTED
    relay.send(Message(address=q, body="still-open"))
    assert rcv.receive(timeout=10).body == "still-open", "the link stays usable"
    rcv.accept()
    conn.close()
    acl_broker.wait_for_log(r"rejected: amqp:unauthorized-access: user 'alice' is not allowed to send on "
                            r"'invoices'")


# ---------------------------------------------------------------------- management API

def test_management_api_needs_manage(acl_broker):
    url = f"http://127.0.0.1:{acl_broker.ports['management']}"
    r = httpx.get(url + "/api/queues")
    assert r.status_code == 401 and r.json() == {"error": "authentication required"}
    assert r.headers["www-authenticate"] == 'Basic realm="amqpbroker"'
    r = httpx.get(url + "/api/queues", auth=("alice", "alice-pw"))
    assert r.status_code == 403 and "manage" in r.json()["error"]
    r = httpx.get(url + "/api/queues", auth=("root", "wrong"))
    assert r.status_code == 401
    r = httpx.get(url + "/api/overview", auth=("root", "root-pw"))
    assert r.status_code == 200 and r.json()["access_control"] is True and r.json()["user"] == "root"
    text = httpx.get(url + "/metrics", auth=("root", "root-pw")).text
    m = re.search(r'^amqpbroker_refused_attaches_total\{condition="amqp:unauthorized-access"\} (\S+)$',
                  text, re.M)
    assert m and float(m.group(1)) >= 1
    assert re.search(r'^amqpbroker_auth_failures_total\{listener="management"\} [1-9]', text, re.M)
    assert re.search(r'^amqpbroker_acl_denials_total\{action="send"\} [1-9]', text, re.M)


def test_admin_cli_with_credentials(acl_broker):
    import subprocess
    import sys
    url = f"http://127.0.0.1:{acl_broker.ports['management']}"
    cmd = [sys.executable, "-m", "amqpbroker.cli", "admin", "--url", url]
    out = subprocess.run(cmd + ["exchanges"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "authentication required (HTTP 401)" in out.stderr
    out = subprocess.run(cmd + ["--user", "root", "--password", "root-pw", "exchanges"], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0 and "amq.topic" in out.stdout, out.stderr
    out = subprocess.run(cmd + ["exchanges"], capture_output=True, text=True, timeout=30,
                         env={**__import__("os").environ, "AMQPBROKER_ADMIN_USER": "root",
                              "AMQPBROKER_ADMIN_PASSWORD": "root-pw"})
    assert out.returncode == 0, out.stderr
