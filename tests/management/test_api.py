"""Every management API endpoint, in process: the FastAPI app on a BrokerServer
that is never started (no sockets), reached through httpx's ASGI transport."""

from __future__ import annotations


from amqpbroker.management.admin import CONNECTION_FORCED, RESOURCE_DELETED
from tests.management.support import DAY, T0, FakeConsumer, Harness, error_of, shared_durable_source



# ---------------------------------------------------------------------- overview, docs, errors

def test_overview(h):
    h.broker.declare_queue("q1")
    body = h.get("/api/overview")
    assert body["queues"] == 1 and body["exchanges"] == 3 and body["connections"] == 0
    assert body["access_control"] is False and body["store_persistent"] is False


def test_openapi_lists_the_endpoints(h):
    spec = h.get("/openapi.json")
    paths = spec["paths"]
    for path in ("/api/queues", "/api/exchanges", "/api/bindings", "/api/subscriptions",
                 "/api/connections", "/api/queues/{name}/purge", "/api/subscriptions/{name}",
                 "/api/connections/{conn_id}"):
        assert path in paths, sorted(paths)
    assert "abandoned" in spec["components"]["schemas"]["SubscriptionOut"]["properties"]


def test_docs_page(h):
    r = h.request("GET", "/docs")
    assert r.status_code == 200 and "swagger" in r.text.lower()


def test_unknown_route_is_json_404(h):
    r = h.request("GET", "/api/nothing")
    assert r.status_code == 404 and error_of(r) == "Not Found"


def test_validation_error_is_json_422(h):
    r = h.request("POST", "/api/queues", json={"durable": "maybe"})
    assert r.status_code == 422
    assert "name" in error_of(r)


def test_malformed_json_body_is_4xx_json(h):
    r = h.request("POST", "/api/queues", content=b"{not json", headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500
    error_of(r)


# ---------------------------------------------------------------------- exchanges

def test_exchanges_list_create_delete(h):
    names = [e["name"] for e in h.get("/api/exchanges")]
    assert names == ["amq.direct", "amq.fanout", "amq.topic"]
    r = h.request("POST", "/api/exchanges", json={"name": "orders", "type": "topic"})
    assert r.status_code == 201 and r.json() == {"name": "orders", "type": "topic", "durable": True,
                                                 "builtin": False, "bindings": 0}
    assert "orders" in h.broker.exchanges
    r = h.request("DELETE", "/api/exchanges/orders")
    assert r.status_code == 200 and r.json()["deleted"] == "orders"
    assert "orders" not in h.broker.exchanges


def test_exchange_create_conflicts_and_bad_type(h):
    h.request("POST", "/api/exchanges", json={"name": "x", "type": "fanout"})
    r = h.request("POST", "/api/exchanges", json={"name": "x", "type": "fanout"})
    assert r.status_code == 409 and "already exists" in error_of(r)
    r = h.request("POST", "/api/exchanges", json={"name": "y", "type": "headers"})
    assert r.status_code == 422
    h.broker.declare_queue("plainq")
    r = h.request("POST", "/api/exchanges", json={"name": "plainq"})
    assert r.status_code == 409 and "ambiguous" in error_of(r)


def test_exchange_delete_rules(h):
    r = h.request("DELETE", "/api/exchanges/amq.topic")
    assert r.status_code == 409 and "built in" in error_of(r)
    assert h.request("DELETE", "/api/exchanges/nope").status_code == 404
    h.broker.declare_exchange("ex", "direct")
    h.broker.bind("ex", "k", h.broker.declare_queue("q"))
    r = h.request("DELETE", "/api/exchanges/ex")
    assert r.status_code == 409 and "force=true" in error_of(r)
    assert h.request("DELETE", "/api/exchanges/ex", params={"force": "true"}).status_code == 200
    assert "ex" not in h.broker.exchanges and h.broker.bindings_of(h.broker.queues["q"]) == []


# ---------------------------------------------------------------------- queues

def test_queue_create_list_get(h):
    r = h.request("POST", "/api/queues", json={"name": "orders.in", "durable": False,
                                                "max_delivery_attempts": 3})
    assert r.status_code == 201
    q = h.broker.queues["orders.in"]
    assert not q.durable and q.max_delivery_attempts == 3
    h.publish("orders.in", "a", "bb")
    [view] = [x for x in h.get("/api/queues") if x["name"] == "orders.in"]
    assert view["depth"] == 2 and view["ready"] == 2 and view["bytes"] > 0
    assert view["enqueued_total"] == 2 and view["consumers"] == 0 and view["subscription"] is False
    assert h.get("/api/queues/orders.in")["depth"] == 2


def test_queue_rates_come_from_sampled_counters(h):
    h.broker.declare_queue("r")
    h.ops.admin.sample_rates(T0)
    h.publish("r", *"abcdefghij")
    h.ops.admin.sample_rates(T0 + 5)
    view = h.get("/api/queues/r")
    assert view["enqueue_rate"] == 2.0 and view["ack_rate"] == 0.0


def test_queue_create_errors(h):
    h.broker.declare_queue("dup")
    r = h.request("POST", "/api/queues", json={"name": "dup"})
    assert r.status_code == 409 and "already exists" in error_of(r)
    r = h.request("POST", "/api/queues", json={"name": "qpidsub_/x_/y_/durable"})
    assert r.status_code == 400 and "reserved" in error_of(r)
    r = h.request("POST", "/api/queues", json={"name": "   "})
    assert r.status_code == 400 and "empty" in error_of(r)
    r = h.request("POST", "/api/queues", json={"name": "amq.topic"})
    assert r.status_code == 409


def test_queue_get_and_delete_unknown_is_404(h):
    assert error_of(h.request("GET", "/api/queues/nope")) == "no queue 'nope'"
    assert h.request("DELETE", "/api/queues/nope").status_code == 404
    assert h.request("POST", "/api/queues/nope/purge").status_code == 404


def test_queue_delete_reports_dropped_messages(h):
    h.broker.declare_queue("gone")
    h.publish("gone", "1", "2", "3")
    r = h.request("DELETE", "/api/queues/gone")
    assert r.status_code == 200 and r.json() == {"deleted": "gone", "messages_dropped": 3}
    assert "gone" not in h.broker.queues


def test_queue_delete_with_consumers_needs_force(h):
    q = h.broker.declare_queue("busy")
    conn = h.connect("app-1")
    consumer = FakeConsumer(conn, "rcv", q)
    r = h.request("DELETE", "/api/queues/busy")
    assert r.status_code == 409 and "1 consumer(s)" in error_of(r)
    assert h.request("DELETE", "/api/queues/busy", params={"force": "true"}).status_code == 200
    assert consumer.link.closed and consumer.link.condition.name == RESOURCE_DELETED
    assert q.consumers == [] and conn.links == 0


def test_queue_with_slash_in_name(h):
    h.broker.declare_queue("a/b")
    h.publish("a/b", "x")
    assert h.get("/api/queues/a%2Fb")["depth"] == 1
    assert h.request("POST", "/api/queues/a%2Fb/purge").json() == {"queue": "a/b", "purged": 1}


def test_purge_removes_ready_messages(h):
    h.broker.declare_queue("p")
    h.publish("p", "1", "2")
    r = h.request("POST", "/api/queues/p/purge")
    assert r.status_code == 200 and r.json() == {"queue": "p", "purged": 2}
    assert h.broker.queues["p"].depth == 0


def test_subscription_queue_cannot_be_deleted_as_a_queue(h):
    _, queue = h.subscribe("audit", "app")
    r = h.request("DELETE", f"/api/queues/{queue.name}")
    assert r.status_code == 409 and "subscription" in error_of(r)


# ---------------------------------------------------------------------- bindings

def test_bindings_create_list_delete(h):
    h.broker.declare_queue("inv")
    h.broker.declare_exchange("orders", "topic")
    r = h.request("POST", "/api/bindings", json={"exchange": "orders", "queue": "inv", "key": "order.*"})
    assert r.status_code == 201
    assert {"exchange": "orders", "queue": "inv", "key": "order.*", "selector": None, "no_local": False,
            "subscription": False} in h.get("/api/bindings")
    h.publish("orders/order.new", "m")
    assert h.broker.queues["inv"].depth == 1
    r = h.request("DELETE", "/api/bindings", params={"exchange": "orders", "queue": "inv", "key": "order.*"})
    assert r.status_code == 200
    assert h.get("/api/bindings") == []


def test_binding_errors(h):
    h.broker.declare_queue("inv")
    h.broker.declare_exchange("orders", "topic")
    body = {"exchange": "orders", "queue": "inv", "key": "k"}
    assert h.request("POST", "/api/bindings", json=body).status_code == 201
    assert h.request("POST", "/api/bindings", json=body).status_code == 409
    assert h.request("POST", "/api/bindings", json={**body, "queue": "nope"}).status_code == 404
    assert h.request("POST", "/api/bindings", json={**body, "exchange": "nope"}).status_code == 404
    r = h.request("DELETE", "/api/bindings", params={"exchange": "orders", "queue": "inv", "key": "other"})
    assert r.status_code == 404 and "no binding" in error_of(r)
    assert h.request("DELETE", "/api/bindings", params={"exchange": "orders"}).status_code == 422


def test_subscription_binding_is_listed_but_protected(h):
    sub, queue = h.subscribe("audit", "app", binding=None)
    listed = [b for b in h.get("/api/bindings") if b["queue"] == queue.name]
    assert listed and listed[0]["subscription"] is True
    r = h.request("DELETE", "/api/bindings", params={"exchange": "amq.topic", "queue": queue.name,
                                                     "key": "orders.eu"})
    assert r.status_code == 409
    r = h.request("POST", "/api/bindings", json={"exchange": "amq.fanout", "queue": queue.name})
    assert r.status_code == 409


# ---------------------------------------------------------------------- subscriptions

def test_subscription_listing_fields(h):
    h.clock.now = T0
    sub, queue = h.subscribe("audit|global", "app-1", shared_durable_source(global_=True))
    h.publish("amq.topic/orders.eu", "one", "two")
    [s] = h.get("/api/subscriptions")
    assert s["name"] == "audit" and s["namespace"] == "_global_" and s["global"] is True
    assert s["client_id"] is None and s["durable"] and s["shared"] and s["named"]
    assert s["topic"] == "amq.topic/orders.eu" and s["exchange"] == "amq.topic" and s["key"] == "orders.eu"
    assert s["selector"] is None and s["no_local"] is False
    assert s["consumers"] == 0 and s["pending"] == 2 and s["pending_bytes"] == queue.bytes > 0
    assert s["created_at"] == T0 and s["last_delivered_at"] is None and s["abandoned"] is False
    assert s["links"] == ["audit|global"] and s["queue"] == queue.name


def test_subscription_local_namespace_is_the_client_id(h):
    h.subscribe("audit|2", "billing-app")
    [s] = h.get("/api/subscriptions")
    assert s["namespace"] == "billing-app" and s["client_id"] == "billing-app" and s["global"] is False


def test_abandoned_is_computed_from_idle(h):
    h.clock.now = T0
    _, q1 = h.subscribe("idle-sub", "app")
    _, q2 = h.subscribe("busy-sub", "app", shared_durable_source("amq.topic/b"))
    FakeConsumer(h.connect("app"), "busy-sub", q2)
    h.clock.now = T0 + 3 * DAY
    subs = {s["name"]: s for s in h.get("/api/subscriptions", params={"idle": "2d"})}
    assert subs["idle-sub"]["abandoned"] is True and subs["idle-sub"]["idle_seconds"] == 3 * DAY
    assert subs["busy-sub"]["abandoned"] is False and subs["busy-sub"]["idle_seconds"] is None
    assert h.get("/api/subscriptions", params={"idle": "4d"})[0]["abandoned"] is False
    only = h.get("/api/subscriptions", params={"idle": "2d", "abandoned": "true"})
    assert [s["name"] for s in only] == ["idle-sub"]


def test_abandoned_default_idle_is_seven_days(h):
    h.clock.now = T0
    h.subscribe("s", "app")
    h.clock.now = T0 + 6 * DAY
    assert h.get("/api/subscriptions")[0]["abandoned"] is False
    h.clock.now = T0 + 7 * DAY
    assert h.get("/api/subscriptions")[0]["abandoned"] is True


def test_bad_idle_is_400(h):
    r = h.request("GET", "/api/subscriptions", params={"idle": "soon"})
    assert r.status_code == 400 and "idle" in error_of(r)


def test_delete_subscription(h):
    sub, queue = h.subscribe("audit", "app")
    h.publish("amq.topic/orders.eu", "x")
    r = h.request("DELETE", "/api/subscriptions/audit")
    assert r.status_code == 200
    body = r.json()
    assert body["name"] == "audit" and body["pending"] == 1 and body["consumers_detached"] == 0
    assert h.server.subscriptions.by_queue == {} and queue.name not in h.broker.queues
    assert h.request("DELETE", "/api/subscriptions/audit").status_code == 404


def test_delete_subscription_with_consumers_is_409_unless_forced(h):
    sub, queue = h.subscribe("audit", "app")
    conn = h.connect("app")
    c1 = FakeConsumer(conn, "audit", queue, sub)
    c2 = FakeConsumer(conn, "audit|2", queue, sub)
    r = h.request("DELETE", "/api/subscriptions/audit")
    assert r.status_code == 409
    assert error_of(r) == ("subscription 'audit' has 2 consumer(s) attached; "
                           "use force=true to detach them and delete it")
    assert queue.name in h.broker.queues
    r = h.request("DELETE", "/api/subscriptions/audit", params={"force": "true"})
    assert r.status_code == 200 and r.json()["consumers_detached"] == 2
    for c in (c1, c2):
        assert c.link.closed and c.link.condition.name == RESOURCE_DELETED
        assert "deleted by administrator" in c.link.condition.description
    assert queue.name not in h.broker.queues and not h.server.subscriptions.subscriptions
    assert conn.protocol.dirty >= 2


def test_delete_ambiguous_subscription_needs_namespace(h):
    h.subscribe("audit", "app-a")
    h.subscribe("audit", "app-b")
    r = h.request("DELETE", "/api/subscriptions/audit")
    assert r.status_code == 409 and "ambiguous" in error_of(r) and "app-a" in error_of(r)
    r = h.request("DELETE", "/api/subscriptions/audit", params={"namespace": "app-b"})
    assert r.status_code == 200 and r.json()["namespace"] == "app-b"
    assert [s["namespace"] for s in h.get("/api/subscriptions")] == ["app-a"]
    assert h.request("DELETE", "/api/subscriptions/audit", params={"namespace": "zzz"}).status_code == 404


def test_delete_subscription_by_durability(h):
    h.subscribe("s", "app")
    nondurable = shared_durable_source()
    from dataclasses import replace
    from amqpbroker.core.terms import ExpiryPolicy
    h.subscribe("s|volatile1", "app", replace(nondurable, expiry_policy=ExpiryPolicy.LINK_DETACH))
    assert h.request("DELETE", "/api/subscriptions/s").status_code == 409
    r = h.request("DELETE", "/api/subscriptions/s", params={"durable": "false"})
    assert r.status_code == 200 and r.json()["durable"] is False
    [left] = h.get("/api/subscriptions")
    assert left["durable"] is True


# ---------------------------------------------------------------------- connections

def test_connections_list_and_close(h):
    c1 = h.connect("app-1", peer="127.0.0.1:1111", user="alice")
    c2 = h.connect("app-2", peer="127.0.0.1:2222")
    conns = h.get("/api/connections")
    assert [(c["container_id"], c["user"], c["remote_address"]) for c in conns] == [
        ("app-1", "alice", "127.0.0.1:1111"), ("app-2", "anonymous", "127.0.0.1:2222")]
    assert conns[0]["sessions"] == 1 and conns[0]["links"] == 0 and conns[0]["listener"] == "amqp"
    ids = [c["id"] for c in conns]
    assert ids == [c["id"] for c in h.get("/api/connections")], "ids are stable"
    r = h.request("DELETE", f"/api/connections/{ids[1]}")
    assert r.status_code == 200 and r.json()["container_id"] == "app-2"
    assert c2.conn.closed and c2.conn.condition.name == CONNECTION_FORCED
    assert not c1.conn.closed
    assert h.request("DELETE", "/api/connections/999").status_code == 404
    assert h.request("DELETE", "/api/connections/abc").status_code == 422


# ---------------------------------------------------------------------- console

def test_console_is_served(h):
    r = h.request("GET", "/", follow_redirects=False)
    assert r.status_code in (302, 307) and r.headers["location"] == "/console/"
    page = h.request("GET", "/console/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="subscriptions"' in page.text and "console.js" in page.text
    js = h.request("GET", "/console/console.js")
    assert js.status_code == 200 and "POLL_MS = 2000" in js.text
    assert h.request("GET", "/console/console.css").status_code == 200
    assert h.request("GET", "/console/secret.py").status_code == 404


# ---------------------------------------------------------------------- metrics

def test_metrics(h):
    h.broker.declare_queue("mq")
    h.publish("mq", "a", "b")
    h.subscribe("audit", "app")
    h.server.metrics_refused["amqp:unauthorized-access"] = 3
    h.server.metrics_auth_failures = 2
    r = h.request("GET", "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for line in ('amqpbroker_queue_depth{queue="mq"} 2.0', 'amqpbroker_queue_enqueued_total{queue="mq"} 2.0',
                 'amqpbroker_refused_attaches_total{condition="amqp:unauthorized-access"} 3.0',
                 'amqpbroker_auth_failures_total{listener="amqp"} 2.0',
                 'amqpbroker_subscription_pending_messages{durable="true",name="audit",namespace="app"} 0.0',
                 "amqpbroker_connections 0.0", "amqpbroker_links 0.0", "amqpbroker_store_commits_total 0.0",
                 'amqpbroker_expiry_actions_total{action="delete"} 0.0'):
        assert line in text, line


def test_metrics_store_histograms():
    from amqpbroker.store.stats import CommitStats
    h = Harness()
    try:
        store = h.server.store
        store.commits = 2
        store.commit_stats = CommitStats()
        store.commit_stats.observe(0.003, 10)
        store.commit_stats.observe(0.2, 1)
        text = h.request("GET", "/metrics").text
        assert 'amqpbroker_store_commit_seconds_bucket{le="0.005"} 1.0' in text
        assert 'amqpbroker_store_commit_seconds_bucket{le="+Inf"} 2.0' in text
        assert "amqpbroker_store_commit_seconds_count 2.0" in text
        assert 'amqpbroker_store_batch_operations_bucket{le="1.0"} 1.0' in text
        assert "amqpbroker_store_batch_operations_sum 11.0" in text
        assert "amqpbroker_store_commits_total 2.0" in text
    finally:
        h.close()
