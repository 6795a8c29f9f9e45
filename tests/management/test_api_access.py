"""Management API access control (loopback-only without ACLs, HTTP basic +
`manage` with them, cross-origin refusal) and the idle-expiry runner, in process."""

from __future__ import annotations


from amqpbroker.config import AclRuleDecl, AnonymousDecl, Settings, StoreConfig, UserConfig
from amqpbroker.core.queues import ExclusivityPolicy
from tests.management.support import DAY, T0, Harness, error_of, shared_durable_source



# ---------------------------------------------------------------------- access

def test_cross_origin_changes_are_refused(h):
    h.broker.declare_queue("victim")
    h.publish("victim", "keep")
    r = h.request("POST", "/api/queues/victim/purge", headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and "cross-origin" in error_of(r)
    assert h.broker.queues["victim"].depth == 1
    assert h.request("GET", "/api/queues", headers={"Origin": "http://evil.example"}).status_code == 200
    r = h.request("POST", "/api/queues/victim/purge", headers={"Origin": "http://mgmt"})
    assert r.status_code == 200, "same origin (the console) is fine"


def test_without_acls_only_loopback_clients(h):
    r = h.request("GET", "/api/queues", client="10.1.2.3")
    assert r.status_code == 403 and "loopback" in error_of(r)
    assert h.request("GET", "/api/queues", client="::1").status_code == 200


def acl_harness() -> Harness:
    settings = Settings(
        store=StoreConfig(enabled=False),
        users={"root": UserConfig(password="root-pw", groups=["ops"]),
               "mgr": UserConfig(password="mgr-pw"),
               "app": UserConfig(password="app-pw", groups=["apps"])},
        acl=[AclRuleDecl(group="ops", permissions=["all"]),
             AclRuleDecl(user="mgr", pattern="orders.#", permissions=["manage"]),
             AclRuleDecl(group="apps", permissions=["send", "consume"])],
        anonymous=AnonymousDecl(permissions=["consume"]))
    return Harness(settings, client_addr="10.9.8.7")


def test_acl_api_requires_basic_auth_with_manage():
    h = acl_harness()
    try:
        r = h.request("GET", "/api/queues")
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic")
        r = h.request("GET", "/api/queues", auth=("root", "wrong"))
        assert r.status_code == 401 and h.ops.auth_failures == 1
        r = h.request("GET", "/api/queues", auth=("app", "app-pw"))
        assert r.status_code == 403 and "manage" in error_of(r)
        assert h.request("GET", "/api/queues", auth=("root", "root-pw")).status_code == 200
        assert h.get("/api/overview", auth=("mgr", "mgr-pw"))["user"] == "mgr"
        r = h.request("GET", "/api/queues", headers={"Authorization": "Basic !!!"})
        assert r.status_code == 401
    finally:
        h.close()


def test_acl_manage_is_scoped_to_the_pattern():
    h = acl_harness()
    try:
        mgr = ("mgr", "mgr-pw")
        assert h.request("POST", "/api/queues", json={"name": "orders.in"}, auth=mgr).status_code == 201
        r = h.request("POST", "/api/queues", json={"name": "invoices"}, auth=mgr)
        assert r.status_code == 403 and "may not manage 'invoices'" in error_of(r)
        h.broker.declare_queue("invoices")
        assert h.request("POST", "/api/queues/invoices/purge", auth=mgr).status_code == 403
        assert h.request("POST", "/api/queues/invoices/purge", auth=("root", "root-pw")).status_code == 200
        conn = h.connect("app")
        cid = h.get("/api/connections", auth=mgr)[0]["id"]
        assert h.request("DELETE", f"/api/connections/{cid}", auth=mgr).status_code == 403
        assert h.request("DELETE", f"/api/connections/{cid}", auth=("root", "root-pw")).status_code == 200
        assert conn.conn.closed
    finally:
        h.close()


def test_acl_subscription_delete_checks_the_topic():
    h = acl_harness()
    try:
        h.subscribe("s1", "app", shared_durable_source("orders.eu"))
        h.subscribe("s2", "app", shared_durable_source("invoices"), binding=None)
        mgr = ("mgr", "mgr-pw")
        assert h.request("DELETE", "/api/subscriptions/s2", auth=mgr).status_code == 403
        assert h.request("DELETE", "/api/subscriptions/s1", auth=mgr).status_code == 200
    finally:
        h.close()


# ---------------------------------------------------------------------- expiry runner

def test_expiry_runner_reports_once_and_deletes(caplog):
    from amqpbroker.config import ExpiryPolicyDecl
    settings = Settings(store=StoreConfig(enabled=False), expiry_policies=[
        ExpiryPolicyDecl(pattern="amq.topic/orders.*", idle="1d", action="delete"),
        ExpiryPolicyDecl(pattern="*", idle="1h")])
    h = Harness(settings)
    try:
        h.ops = type(h.ops)(h.server, clock=h.clock)
        h.clock.now = T0
        h.subscribe("old-orders", "app")                                   # delete after 1 day
        _, q = h.subscribe("reports", "app", shared_durable_source("amq.topic/reports"))
        h.clock.now = T0 + 2 * 3600
        caplog.set_level("INFO", "amqpbroker")
        done = h.ops.run_expiry()
        assert [(a.sub.name, a.action) for a in done] == [("reports", "report")]
        assert "abandoned subscription 'reports'" in caplog.text
        assert h.ops.run_expiry() == [], "reported once"
        h.clock.now = T0 + 2 * DAY
        done = h.ops.run_expiry()
        assert [(a.sub.name, a.action) for a in done] == [("old-orders", "delete")]
        assert [s.key.name for s in h.server.subscriptions.subscriptions.values()] == ["reports"]
        assert "expiry policy: deleted subscription 'old-orders'" in caplog.text
        assert h.ops.expiry_actions == {"report": 1, "delete": 1}
        assert q.exclusivity is ExclusivityPolicy.SHARED_SUBSCRIPTION
    finally:
        h.close()
