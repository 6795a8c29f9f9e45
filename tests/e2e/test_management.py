"""The management API, metrics, CLI and idle-expiry policy against the real broker
process, with python-qpid-proton clients making the traffic."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid

import httpx
import pytest
from proton import Message, Timeout
from proton.utils import ConnectionClosed, LinkDetached

from tests.client import connect
from tests.e2e.helpers_conn import make_self_signed
from tests.e2e.helpers_delivery import barrier
from tests.e2e.jms_links import detach, null_source_attach, shared_consumer

pytestmark = pytest.mark.e2e

ADMIN = [sys.executable, "-m", "amqpbroker.cli", "admin"]


def uniq(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def mgmt_url(broker) -> str:
    return f"http://127.0.0.1:{broker.ports['management']}"


def api(broker) -> httpx.Client:
    return httpx.Client(base_url=mgmt_url(broker), timeout=10)


def admin_cli(broker, *args: str, url: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(ADMIN + ["--url", url or mgmt_url(broker), *args], capture_output=True,
                          text=True, timeout=30)


def publish(url: str, address: str, bodies, **fields) -> None:
    conn = connect(url, container_id=uniq("pub"))
    try:
        snd = conn.create_sender(address)
        for body in bodies:
            snd.send(Message(body=body, **fields))
    finally:
        conn.close()


def subscription(client: httpx.Client, name: str, **params) -> dict | None:
    subs = client.get("/api/subscriptions", params=params).json()
    return next((s for s in subs if s["name"] == name), None)


# ---------------------------------------------------------------------- listener

def test_management_listener_port_is_logged(broker):
    line = broker.wait_for_log(r"management listening on")
    assert re.search(rf"management listening on 127\.0\.0\.1:{broker.ports['management']} \(http\)", line)
    with api(broker) as c:
        body = c.get("/api/overview").json()
    assert body["container_id"] == "amqpbroker" and body["store_persistent"] is True
    with api(broker) as c:
        assert "/api/subscriptions" in c.get("/openapi.json").json()["paths"]


def test_management_can_be_disabled(broker_factory):
    b = broker_factory("[management]\nenabled = false\n")
    assert "management" not in b.ports
    assert "management listening" not in b.log_text()


def test_management_port_in_use_exits_2(tmp_path):
    import socket

    from tests.e2e.helpers_conn import run_cli
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = run_cli(["serve", "--port", "0", "--data-dir", str(tmp_path / "data")],
                      env={"AMQPBROKER_MANAGEMENT__PORT": str(port)}, timeout=20)
    assert out.returncode == 2, out.stderr
    assert f"cannot start: management listener on 127.0.0.1:{port}" in out.stderr
    assert "Traceback" not in out.stderr and "Task was destroyed" not in out.stderr


def test_management_over_tls(broker_factory, tmp_path):
    cert, key = make_self_signed(tmp_path)
    b = broker_factory(f'[management]\ncert_file = "{cert}"\nkey_file = "{key}"\n')
    b.wait_for_log(r"management listening on .* \(https\)")
    url = f"https://127.0.0.1:{b.ports['management']}"
    import ssl
    ctx = ssl.create_default_context(cafile=str(cert))
    with httpx.Client(base_url=url, verify=ctx) as c:
        assert c.get("/api/overview").status_code == 200
    out = admin_cli(b, "--cacert", str(cert), "exchanges", url=url)
    assert out.returncode == 0 and "amq.topic" in out.stdout, out.stderr
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/api/overview", timeout=5)      # not trusted without the CA


# ---------------------------------------------------------------------- queues, exchanges, bindings

def test_queue_lifecycle(broker):
    q = uniq("mq")
    with api(broker) as c:
        r = c.post("/api/queues", json={"name": q})
        assert r.status_code == 201, r.text
        publish(broker.url, q, ["a", "bb", "ccc"], durable=True)
        view = c.get(f"/api/queues/{q}").json()
        assert view["depth"] == 3 and view["bytes"] > 0 and view["enqueued_total"] == 3
        assert view["consumers"] == 0 and view["durable"] is True
        conn = connect(broker.url, container_id=uniq("c"))
        rcv = conn.create_receiver(q, credit=1)
        msg = rcv.receive(timeout=10)
        rcv.accept()
        barrier(conn)                       # the accept has reached the broker
        assert msg.body == "a"
        view = c.get(f"/api/queues/{q}").json()
        assert view["consumers"] == 1 and view["acked_total"] == 1 and view["last_delivered_at"] is not None
        r = c.delete(f"/api/queues/{q}")
        assert r.status_code == 409 and "consumer" in r.json()["error"]
        rcv.close()
        conn.close()
        assert c.post(f"/api/queues/{q}/purge").json() == {"queue": q, "purged": 2}
        assert c.get(f"/api/queues/{q}").json()["depth"] == 0
        assert c.delete(f"/api/queues/{q}").json() == {"deleted": q, "messages_dropped": 0}
        assert c.get(f"/api/queues/{q}").status_code == 404


def test_force_delete_queue_detaches_consumers(broker):
    q = uniq("fq")
    with api(broker) as c:
        c.post("/api/queues", json={"name": q, "durable": False})
        conn = connect(broker.url, container_id=uniq("c"))
        rcv = conn.create_receiver(q)
        assert c.delete(f"/api/queues/{q}", params={"force": "true"}).status_code == 200
        with pytest.raises(LinkDetached) as gone:
            rcv.receive(timeout=10)
        assert "amqp:resource-deleted" in str(gone.value)
        conn.close()


def test_exchange_and_binding_routing(broker):
    ex, q = uniq("ex"), uniq("bq")
    with api(broker) as c:
        assert c.post("/api/exchanges", json={"name": ex, "type": "direct"}).status_code == 201
        assert c.post("/api/queues", json={"name": q}).status_code == 201
        assert c.post("/api/bindings", json={"exchange": ex, "queue": q, "key": "k1"}).status_code == 201
        assert {"exchange": ex, "queue": q, "key": "k1", "selector": None, "no_local": False,
                "subscription": False} in c.get("/api/bindings").json()
        publish(broker.url, f"{ex}/k1", ["routed"])
        publish(broker.url, f"{ex}/k2", ["dropped"])
        assert c.get(f"/api/queues/{q}").json()["depth"] == 1
        assert c.delete(f"/api/exchanges/{ex}").status_code == 409
        assert c.delete("/api/bindings", params={"exchange": ex, "queue": q, "key": "k1"}).status_code == 200
        assert c.delete(f"/api/exchanges/{ex}").status_code == 200
        assert ex not in [e["name"] for e in c.get("/api/exchanges").json()]


def test_admin_changes_are_durable(broker_factory):
    b = broker_factory()
    with api(b) as c:
        c.post("/api/exchanges", json={"name": "orders", "type": "topic"})
        c.post("/api/exchanges", json={"name": "lonely", "type": "fanout"})
        c.post("/api/queues", json={"name": "inv"})
        c.post("/api/queues", json={"name": "scratch"})
        c.post("/api/bindings", json={"exchange": "orders", "queue": "inv", "key": "order.#"})
    publish(b.url, "scratch", ["x"], durable=True)
    b.restart()
    with api(b) as c:
        assert {"orders", "lonely"} <= {e["name"] for e in c.get("/api/exchanges").json()}
        assert {"inv", "scratch"} <= {q["name"] for q in c.get("/api/queues").json()}
        assert any(x["exchange"] == "orders" and x["queue"] == "inv" for x in c.get("/api/bindings").json())
        assert c.get("/api/queues/scratch").json()["depth"] == 1
        assert c.delete("/api/queues/scratch").status_code == 200
        c.delete("/api/exchanges/lonely")
    b.restart()
    with api(b) as c:
        assert "scratch" not in {q["name"] for q in c.get("/api/queues").json()}
        assert "lonely" not in {e["name"] for e in c.get("/api/exchanges").json()}


# ---------------------------------------------------------------------- subscriptions

def test_subscription_listing_and_forced_admin_unsubscribe(broker):
    topic, sub, cid = uniq("t"), uniq("sub"), uniq("app")
    conn = connect(broker.url, container_id=cid)
    consumer = shared_consumer(conn, f"amq.topic/{topic}", sub, credit=0, selector="color = 'red'")
    publish(broker.url, f"amq.topic/{topic}", ["r1", "r2"], properties={"color": "red"})
    publish(broker.url, f"amq.topic/{topic}", ["b1"], properties={"color": "blue"})
    with api(broker) as c:
        s = subscription(c, sub)
        assert s is not None, c.get("/api/subscriptions").text
        assert s["namespace"] == cid and s["client_id"] == cid and s["global"] is False
        assert s["durable"] and s["shared"] and s["topic"] == f"amq.topic/{topic}"
        assert s["selector"] == "color = 'red'" and s["no_local"] is False
        assert s["consumers"] == 1 and s["pending"] == 2 and s["pending_bytes"] > 0
        assert s["abandoned"] is False and s["last_consumer_at"] is not None

        r = c.delete(f"/api/subscriptions/{sub}")
        assert r.status_code == 409
        assert r.json() == {"error": f"subscription '{sub}' has 1 consumer(s) attached; "
                                     "use force=true to detach them and delete it"}
        r = c.delete(f"/api/subscriptions/{sub}", params={"namespace": cid, "force": "true"})
        assert r.status_code == 200 and r.json()["consumers_detached"] == 1
        with pytest.raises(LinkDetached) as gone:
            consumer.receive(timeout=10)
        assert "amqp:resource-deleted" in str(gone.value)
        barrier(conn)   # the client's own detach goes out (proton sends attaches before detaches)
        assert subscription(c, sub) is None
    with pytest.raises(LinkDetached) as lookup:
        null_source_attach(conn, sub)
    assert "amqp:not-found" in str(lookup.value)
    conn.close()
    broker.wait_for_log(rf"admin: subscription '{sub}' \(namespace {cid}\) deleted")


def test_abandoned_subscription_report(broker):
    topic, sub, cid = uniq("t"), uniq("abandon"), uniq("app")
    conn = connect(broker.url, container_id=cid)
    consumer = shared_consumer(conn, f"amq.topic/{topic}", sub, global_=True, credit=0)
    assert detach(conn, consumer) is None
    conn.close()
    publish(broker.url, f"amq.topic/{topic}", ["waiting"])
    with api(broker) as c:
        s = subscription(c, sub, idle="0s")
        assert s["abandoned"] is True and s["consumers"] == 0 and s["pending"] == 1
        assert s["namespace"] == "_global_" and s["global"] is True and s["client_id"] is None
        assert subscription(c, sub, idle="1d")["abandoned"] is False
        assert sub in [x["name"] for x in c.get("/api/subscriptions",
                                                params={"idle": "0s", "abandoned": "true"}).json()]
        assert sub not in [x["name"] for x in c.get("/api/subscriptions",
                                                    params={"idle": "1d", "abandoned": "true"}).json()]
        assert c.delete(f"/api/subscriptions/{sub}").status_code == 200


# ---------------------------------------------------------------------- connections

def test_connections_list_and_close(broker):
    cid = uniq("victim")
    conn = connect(broker.url, container_id=cid)
    rcv = conn.create_receiver(uniq("cq"))
    with api(broker) as c:
        [view] = [x for x in c.get("/api/connections").json() if x["container_id"] == cid]
        assert view["user"] == "anonymous" and view["sessions"] >= 1 and view["links"] == 1
        assert view["remote_address"].startswith("127.0.0.1:") and view["listener"] == "amqp"
        r = c.delete(f"/api/connections/{view['id']}")
        assert r.status_code == 200 and r.json()["container_id"] == cid
        with pytest.raises((ConnectionClosed, LinkDetached)) as closed:
            rcv.receive(timeout=10)
        assert "amqp:connection:forced" in str(closed.value)
        broker.wait_for_log(rf"connection closed: .* container={cid}")
        assert cid not in [x["container_id"] for x in c.get("/api/connections").json()]
        assert c.delete(f"/api/connections/{view['id']}").status_code == 404


# ---------------------------------------------------------------------- metrics

def test_metrics_after_traffic(broker):
    q = uniq("metq")
    publish(broker.url, q, ["1", "2"], durable=True)
    with api(broker) as c:
        text = c.get("/metrics").text
    assert f'amqpbroker_queue_depth{{queue="{q}"}} 2.0' in text
    assert f'amqpbroker_queue_enqueued_total{{queue="{q}"}} 2.0' in text
    commits = float(re.search(r"^amqpbroker_store_commits_total (\S+)$", text, re.M).group(1))
    assert commits > 0
    count = float(re.search(r"^amqpbroker_store_commit_seconds_count (\S+)$", text, re.M).group(1))
    assert count == commits
    assert re.search(r'^amqpbroker_store_batch_operations_bucket\{le="\+Inf"\} \d', text, re.M)
    assert re.search(r"^amqpbroker_connections \d", text, re.M)
    assert 'amqpbroker_auth_failures_total{listener="amqp"}' in text


def test_refused_attaches_are_counted(broker):
    conn = connect(broker.url, container_id=uniq("c"))
    with pytest.raises(LinkDetached):
        null_source_attach(conn, uniq("missing"))
    conn.close()
    with api(broker) as c:
        text = c.get("/metrics").text
    m = re.search(r'^amqpbroker_refused_attaches_total\{condition="amqp:not-found"\} (\S+)$', text, re.M)
    assert m and float(m.group(1)) >= 1


# ---------------------------------------------------------------------- CLI

def test_cli_listings(broker):
    q, topic, sub, cid = uniq("cliq"), uniq("t"), uniq("clisub"), uniq("cliapp")
    publish(broker.url, q, ["m"])
    conn = connect(broker.url, container_id=cid)
    consumer = shared_consumer(conn, f"amq.topic/{topic}", sub, credit=0)
    for command, needle in (("queues", q), ("exchanges", "amq.topic"), ("bindings", "amq.topic"),
                            ("connections", cid), ("subscriptions", sub)):
        out = admin_cli(broker, command)
        assert out.returncode == 0, out.stderr
        assert needle in out.stdout, (command, out.stdout)
        out = admin_cli(broker, "--json", command)
        assert out.returncode == 0
        data = json.loads(out.stdout)
        assert isinstance(data, list) and data
    assert detach(conn, consumer) is None
    out = admin_cli(broker, "subscriptions", "--abandoned", "--idle", "0s")
    assert out.returncode == 0 and sub in out.stdout and "ABANDONED" in out.stdout
    out = admin_cli(broker, "subscriptions", "--abandoned", "--idle", "7d", "--json")
    assert sub not in [s["name"] for s in json.loads(out.stdout)]
    conn.close()


def test_cli_actions(broker):
    q, topic, sub, cid = uniq("cliq"), uniq("t"), uniq("clisub"), uniq("cliapp")
    publish(broker.url, q, ["1", "2", "3"])
    out = admin_cli(broker, "purge", q)
    assert out.returncode == 0 and out.stdout.strip() == f"purged 3 message(s) from '{q}'"
    out = admin_cli(broker, "purge", "no-such-queue")
    assert out.returncode == 1 and "no queue 'no-such-queue' (HTTP 404)" in out.stderr

    conn = connect(broker.url, container_id=cid)
    consumer = shared_consumer(conn, f"amq.topic/{topic}", sub, credit=0)
    out = admin_cli(broker, "delete-subscription", sub, "--namespace", cid)
    assert out.returncode == 1 and "consumer(s) attached" in out.stderr and "HTTP 409" in out.stderr
    out = admin_cli(broker, "delete-subscription", sub, "--namespace", cid, "--force")
    assert out.returncode == 0, out.stderr
    assert f"deleted subscription '{sub}' (namespace {cid})" in out.stdout
    assert "1 consumer(s) detached" in out.stdout
    with pytest.raises(LinkDetached):
        consumer.receive(timeout=10)

    with api(broker) as c:
        [view] = [x for x in c.get("/api/connections").json() if x["container_id"] == cid]
    out = admin_cli(broker, "--json", "close-connection", str(view["id"]))
    assert out.returncode == 0 and json.loads(out.stdout)["container_id"] == cid
    with pytest.raises((ConnectionClosed, LinkDetached, Timeout)):
        conn.create_receiver(uniq("after-close"))
    out = admin_cli(broker, "close-connection", "999999")
    assert out.returncode == 1 and "no connection 999999" in out.stderr


def test_cli_through_the_amqpbroker_entry_point(broker):
    out = subprocess.run([sys.executable, "-m", "amqpbroker.cli", "admin", "--url", mgmt_url(broker),
                          "--json", "exchanges"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "amq.fanout" in out.stdout
    out = subprocess.run([sys.executable, "-m", "amqpbroker.cli", "--help"], capture_output=True, text=True)
    assert "admin" in out.stdout


# ---------------------------------------------------------------------- idle-expiry policy

EXPIRY_CONFIG = """
expiry_interval = 0.2
[[expiry_policies]]
pattern = "amq.topic/exp-del.*"
idle = "1s"
action = "delete"
[[expiry_policies]]
pattern = "amq.topic/exp-rep.*"
idle = "1s"
"""


def test_expiry_policy_deletes_and_reports_idle_subscriptions(broker_factory):
    b = broker_factory(EXPIRY_CONFIG)
    conn = connect(b.url, container_id="exp-app")
    doomed = shared_consumer(conn, "amq.topic/exp-del.x", "doomed", credit=0)
    reported = shared_consumer(conn, "amq.topic/exp-rep.x", "watched", credit=0)
    kept = shared_consumer(conn, "amq.topic/exp-del.y", "consumed", credit=0)
    assert detach(conn, doomed) is None
    assert detach(conn, reported) is None
    b.wait_for_log(r"expiry policy: deleted subscription 'doomed' \(namespace exp-app", timeout=15)
    b.wait_for_log(r"expiry policy: abandoned subscription 'watched'", timeout=15)
    with pytest.raises(LinkDetached) as lookup:
        null_source_attach(conn, "doomed")
    assert "amqp:not-found" in str(lookup.value)
    with api(b) as c:
        names = {s["name"] for s in c.get("/api/subscriptions").json()}
        assert names == {"watched", "consumed"}, "reported and consumed subscriptions stay"
        text = c.get("/metrics").text
    assert 'amqpbroker_expiry_actions_total{action="delete"} 1.0' in text
    assert 'amqpbroker_expiry_actions_total{action="report"} 1.0' in text
    assert len(re.findall(r"abandoned subscription 'watched'", b.log_text())) == 1, "reported once"
    assert kept.link.state
    conn.close()
    b.restart()
    conn = connect(b.url, container_id="exp-app")
    with pytest.raises(LinkDetached):
        null_source_attach(conn, "doomed")
    conn.close()
