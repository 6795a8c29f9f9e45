"""Management API access control (loopback-only without ACLs, HTTP basic +
`manage` with them), the request guard (Host against DNS rebinding, Origin and
Content-Type of changes), authentication throttling, and the idle-expiry runner,
in process."""

from __future__ import annotations

import asyncio
import logging

from amqpbroker.config import AclRuleDecl, AnonymousDecl, LimitsConfig, ManagementConfig, Settings, StoreConfig, UserConfig
from amqpbroker.core.queues import ExclusivityPolicy
from tests.management.support import BASE_URL, DAY, T0, Harness, error_of, shared_durable_source



# ---------------------------------------------------------------------- access

def test_cross_origin_changes_are_refused(h):
    """Changed behaviour: a same-origin change must now say Content-Type:
    application/json (the console does); body-less changes without Origin (CLI, curl)
    are still taken."""
    h.broker.declare_queue("victim")
    h.publish("victim", "keep")
    r = h.request("POST", "/api/queues/victim/purge", headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and "cross-origin" in error_of(r)
    r = h.request("POST", "/api/queues/victim/purge",
                  headers={"Origin": "http://evil.example", "Content-Type": "application/json"})
    assert r.status_code == 403 and "cross-origin" in error_of(r)
    assert h.broker.queues["victim"].depth == 1
    assert h.request("GET", "/api/queues", headers={"Origin": "http://evil.example"}).status_code == 200
    r = h.request("POST", "/api/queues/victim/purge", headers={"Origin": BASE_URL})
    assert r.status_code == 415 and "application/json" in error_of(r)
    assert h.broker.queues["victim"].depth == 1
    r = h.request("POST", "/api/queues/victim/purge",
                  headers={"Origin": BASE_URL, "Content-Type": "application/json"})
    assert r.status_code == 200, "same origin with JSON (the console) is fine"
    assert h.broker.queues["victim"].depth == 0


def test_rebound_host_is_refused_before_anything_happens(h):
    h.broker.declare_queue("victim")
    h.publish("victim", "keep")
    evil = {"Host": "evil.example:8161", "Origin": "http://evil.example:8161",
            "Content-Type": "application/json"}
    r = h.request("POST", "/api/queues/victim/purge", headers=evil)
    assert r.status_code == 421 and "allowed_hosts" in error_of(r)
    assert h.broker.queues["victim"].depth == 1
    for path in ("/api/queues", "/metrics", "/console/", "/console/console.js", "/openapi.json", "/nothing"):
        assert h.request("GET", path, headers={"Host": "evil.example"}).status_code == 421, path
    assert h.request("GET", "/api/queues", headers={"Host": "localhost:8161"}).status_code == 200


def test_allowed_hosts_setting():
    settings = Settings(store=StoreConfig(enabled=False),
                        management=ManagementConfig(allowed_hosts=["broker.example.com"]))
    h = Harness(settings)
    try:
        h.broker.declare_queue("q")
        headers = {"Host": "broker.example.com:8161", "Origin": "http://broker.example.com:8161",
                   "Content-Type": "application/json"}
        assert h.request("POST", "/api/queues/q/purge", headers=headers).status_code == 200
        assert h.request("GET", "/api/queues", headers={"Host": "other.example.com"}).status_code == 421
    finally:
        h.close()


def test_changes_need_json(h):
    h.broker.declare_queue("q")
    r = h.request("POST", "/api/queues", data={"name": "formq"})
    assert r.status_code == 415 and "application/json" in error_of(r)
    r = h.request("POST", "/api/queues", content=b'{"name": "textq"}', headers={"Content-Type": "text/plain"})
    assert r.status_code == 415
    r = h.request("POST", "/api/queues", content=b'{"name": "bareq"}')
    assert r.status_code == 415, "a body without a content type"
    assert set(h.broker.queues) == {"q"}
    assert h.request("POST", "/api/queues", json={"name": "jsonq"}).status_code == 201
    assert h.request("DELETE", "/api/queues/jsonq").status_code == 200, "body-less, no Origin: the CLI"


def test_without_acls_only_loopback_clients(h):
    r = h.request("GET", "/api/queues", client="10.1.2.3")
    assert r.status_code == 403 and "loopback" in error_of(r)
    assert h.request("GET", "/api/queues", client="::1").status_code == 200


def acl_harness(**limits) -> Harness:
    """`limits`: [limits] settings (the authentication throttle's auth_*)."""
    settings = Settings(
        store=StoreConfig(enabled=False), management=ManagementConfig(), limits=LimitsConfig(**limits),
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
    from tests.management.support import FakeConsumer
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
        FakeConsumer(conn, "rcv", h.broker.queues["orders.in"])     # listed: it uses orders.in
        cid = h.get("/api/connections", auth=mgr)[0]["id"]
        assert h.request("DELETE", f"/api/connections/{cid}", auth=mgr).status_code == 403
        assert h.request("DELETE", f"/api/connections/{cid}", auth=("root", "root-pw")).status_code == 200
        assert conn.conn.closed
    finally:
        h.close()


def test_a_manage_grant_lists_only_what_it_covers():
    """`manage` on orders.# used to list every tenant's queues and connections."""
    from tests.management.support import FakeConsumer
    h = acl_harness()
    try:
        mgr, root = ("mgr", "mgr-pw"), ("root", "root-pw")
        for name in ("orders.in", "orders.eu.paid", "invoices", "hr.salaries"):
            h.broker.declare_queue(name)
        h.subscribe("s1", "app", shared_durable_source("orders.eu"))
        h.subscribe("s2", "app", shared_durable_source("invoices"), binding=None)
        ours = h.connect("orders-app", user="app")
        FakeConsumer(ours, "rcv", h.broker.queues["orders.in"])
        theirs = h.connect("hr-app", user="app")
        FakeConsumer(theirs, "rcv", h.broker.queues["hr.salaries"])
        h.connect("idle-app", user="app")

        names = sorted(q["name"] for q in h.get("/api/queues", auth=mgr))
        assert names[:2] == ["orders.eu.paid", "orders.in"] and len(names) == 3     # + s1's queue
        assert h.request("GET", "/api/queues", auth=mgr).headers["x-total-count"] == "3"
        assert all("invoices" not in n and "hr." not in n for n in names)
        assert [c["container_id"] for c in h.get("/api/connections", auth=mgr)] == ["orders-app"]
        assert [s["name"] for s in h.get("/api/subscriptions", auth=mgr)] == ["s1"]
        assert {b["queue"] for b in h.get("/api/bindings", auth=mgr)} <= set(names)
        assert h.request("GET", "/api/queues/hr.salaries", auth=mgr).status_code == 403
        assert h.request("GET", "/api/queues/orders.in", auth=mgr).status_code == 200
        assert h.request("GET", "/metrics", auth=mgr).status_code == 403
        # manage on '#' sees everything.
        assert len(h.get("/api/queues", auth=root)) == 6
        assert len(h.get("/api/connections", auth=root)) == 3
    finally:
        h.close()


def test_anonymous_never_reaches_the_api_without_the_explicit_setting():
    """`[anonymous] permissions = ["all"]` on public.# is for AMQP clients: it used
    to let any request without credentials, from any address, use the API."""
    def harness(allow: bool) -> Harness:
        settings = Settings(store=StoreConfig(enabled=False), management=ManagementConfig(allow_anonymous=allow),
                            users={"root": UserConfig(password="root-pw")},
                            acl=[AclRuleDecl(user="root", permissions=["all"])],
                            anonymous=AnonymousDecl(permissions=["all"], pattern="public.#"))
        return Harness(settings, client_addr="10.9.8.7")
    h = harness(False)
    try:
        h.broker.declare_queue("public.news")
        h.broker.declare_queue("private.payroll")
        for path in ("/api/queues", "/api/overview", "/api/connections"):
            r = h.request("GET", path)
            assert r.status_code == 401, (path, r.status_code)
        assert h.request("POST", "/api/queues/public.news/purge").status_code == 401
    finally:
        h.close()
    h = harness(True)
    try:
        h.broker.declare_queue("public.news")
        h.broker.declare_queue("private.payroll")
        assert [q["name"] for q in h.get("/api/queues")] == ["public.news"]
        assert h.request("POST", "/api/queues/private.payroll/purge").status_code == 403
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


# ---------------------------------------------------------------------- throttling

class Sleeps:
    """Stands in for asyncio.sleep in the authenticator: records the waits."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)


def test_wrong_passwords_slow_down_their_address_only(caplog):
    h = acl_harness(auth_free_failures=2, auth_base_delay=0.5, auth_max_delay=3.0)
    sleeps = h.ops.authenticator.sleep = Sleeps()
    caplog.set_level(logging.WARNING, "amqpbroker.management")
    try:
        waits = []
        for _ in range(7):
            before = len(sleeps.waits)
            r = h.request("GET", "/api/queues", auth=("root", "guess"), client="10.0.0.66")
            assert r.status_code == 401
            waits.append(sum(sleeps.waits[before:]))
        assert waits == [0, 0, 0, 0.5, 1.0, 2.0, 3.0], "free failures, then doubling up to the ceiling"
        # Meanwhile, the right password from another address is not slowed at all …
        before = len(sleeps.waits)
        assert h.request("GET", "/api/queues", auth=("root", "root-pw"), client="10.0.0.7").status_code == 200
        assert h.request("GET", "/api/queues", auth=("app", "nope"), client="10.0.0.7").status_code == 401
        assert sleeps.waits[before:] == []
        # … while from the guessing address it waits too, and then clears the address.
        assert h.request("GET", "/api/queues", auth=("root", "root-pw"), client="10.0.0.66").status_code == 200
        assert sleeps.waits[-1] == 3.0
        before = len(sleeps.waits)
        assert h.request("GET", "/api/queues", auth=("root", "wrong"), client="10.0.0.66").status_code == 401
        assert sleeps.waits[before:] == []
        slowed = [r.getMessage() for r in caplog.records if "failed authentications from" in r.getMessage()]
        assert slowed == ["management API: 3 failed authentications from 10.0.0.66: its next attempts wait "
                          "(up to 3 s)"], "one line when the address starts being slowed"
        assert h.ops.auth_failures == 9
        text = h.request("GET", "/metrics", auth=("root", "root-pw"), client="10.0.0.7").text
        assert 'amqpbroker_auth_failures_total{listener="management"} 9.0' in text
        assert 'amqpbroker_auth_throttled_addresses{listener="all"} 0.0' in text
    finally:
        h.close()


def test_a_good_login_between_guesses_does_not_clear_the_guesses():
    """Alternating one good login with a guess at another user's password: each
    success used to clear the address, so every guess went unslowed (552 a second)."""
    h = acl_harness(auth_free_failures=2, auth_base_delay=0.5, auth_max_delay=4.0)
    sleeps = h.ops.authenticator.sleep = Sleeps()
    try:
        guess_waits = []
        for _ in range(6):
            assert h.request("GET", "/api/queues", auth=("root", "root-pw"), client="10.0.0.66").status_code == 200
            before = len(sleeps.waits)
            assert h.request("GET", "/api/queues", auth=("app", "guess"), client="10.0.0.66").status_code == 401
            guess_waits.append(sum(sleeps.waits[before:]))
        assert guess_waits == [0, 0, 0, 0.5, 1.0, 2.0], "the guesses at 'app' keep counting"
        # The right password for the name that was guessed clears that name's failures
        # (a typo, then the right one), and only those.
        assert h.request("GET", "/api/queues", auth=("root", "wrong"), client="10.0.0.67").status_code == 401
        assert h.request("GET", "/api/queues", auth=("root", "root-pw"), client="10.0.0.67").status_code == 200
        assert h.ops.auth_throttle.failures("10.0.0.67") == 0
    finally:
        h.close()


def test_guesses_at_one_name_from_many_addresses_are_slowed_by_name():
    h = acl_harness(auth_free_failures=2, auth_free_failures_per_user=4, auth_base_delay=0.5,
                    auth_max_delay=4.0)
    sleeps = h.ops.authenticator.sleep = Sleeps()
    try:
        waits = []
        for i in range(7):     # a new address for every guess: no address is ever slowed
            before = len(sleeps.waits)
            assert h.request("GET", "/api/queues", auth=("root", f"guess{i}"),
                             client=f"10.1.0.{i + 1}").status_code == 401
            waits.append(sum(sleeps.waits[before:]))
        assert waits == [0, 0, 0, 0, 0, 0.5, 1.0]
        before = len(sleeps.waits)     # another name from another address: not slowed
        assert h.request("GET", "/api/queues", auth=("mgr", "mgr-pw"), client="10.2.0.1").status_code == 200
        assert sleeps.waits[before:] == []
    finally:
        h.close()


def test_throttled_gauge_and_malformed_credentials_count():
    h = acl_harness(auth_free_failures=0)
    h.ops.authenticator.sleep = Sleeps()
    try:
        r = h.request("GET", "/api/queues", headers={"Authorization": "Basic !!!"}, client="10.0.0.66")
        assert r.status_code == 401 and h.ops.auth_failures == 1
        text = h.request("GET", "/metrics", auth=("root", "root-pw")).text
        assert 'amqpbroker_auth_throttled_addresses{listener="all"} 1.0' in text
    finally:
        h.close()


def test_parallel_guesses_from_one_address_are_taken_one_at_a_time():
    h = acl_harness(auth_free_failures=0, auth_base_delay=1.0)
    release = asyncio.Event()
    inside: list[int] = []

    async def held_sleep(seconds: float) -> None:
        inside.append(1)
        await release.wait()

    h.ops.authenticator.sleep = held_sleep
    try:
        assert h.request("GET", "/api/queues", auth=("root", "x"), client="10.0.0.66").status_code == 401

        async def burst():
            import httpx
            transport = httpx.ASGITransport(app=h.app, client=("10.0.0.66", 50000))
            async with httpx.AsyncClient(transport=transport, base_url=BASE_URL, auth=("root", "x")) as c:
                tasks = [asyncio.ensure_future(c.get("/api/queues")) for _ in range(12)]
                while len(inside) < 1 or sum(t.done() for t in tasks) < 4:
                    await asyncio.sleep(0)
                done_early = [t.result().status_code for t in tasks if t.done()]
                assert len(inside) == 1, "one attempt waits its turn at a time"
                release.set()
                return done_early, [r.status_code for r in await asyncio.gather(*tasks)]

        early, statuses = h.loop.run_until_complete(burst())
        assert early == [429] * 4, "beyond 8 queued attempts, answered at once without checking"
        assert sorted(statuses) == [401] * 8 + [429] * 4
        assert h.ops.auth_failures == 9
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


def test_manage_on_one_word_is_not_manage_on_everything():
    """Broker-wide actions asked for `manage` on the address '#', and the pattern `*`
    (any one word) matches the one-word text '#': a user granted `manage` on `*` read
    /metrics, reloaded the configuration, took backups, changed the alarms, closed
    connections and saw every tenant's queues.  What covers everything needs a grant
    on every address (pattern '#')."""
    settings = Settings(
        store=StoreConfig(enabled=False), management=ManagementConfig(),
        users={"star": UserConfig(password="star-pw"), "root": UserConfig(password="root-pw")},
        acl=[AclRuleDecl(user="star", pattern="*", permissions=["manage"]),
             AclRuleDecl(user="root", pattern="#.#", permissions=["manage"])])
    h = Harness(settings, client_addr="10.9.8.7")
    try:
        star, root = ("star", "star-pw"), ("root", "root-pw")
        for name in ("invoices", "hr.salaries"):
            h.broker.declare_queue(name)
        json = {"Content-Type": "application/json"}
        for method, path, kw in [("GET", "/metrics", {}), ("GET", "/metrics/per-object", {}),
                                 ("POST", "/api/reload", {"headers": json}),
                                 ("POST", "/api/backup", {"json": {"dest": "/nonexistent/x"}}),
                                 ("PUT", "/api/alarms", {"json": {"disk_free_limit": 1}}),
                                 ("DELETE", "/api/connections/1", {})]:
            r = h.request(method, path, auth=star, **kw)
            assert r.status_code == 403, (method, path, r.status_code, r.text)
        names = [q["name"] for q in h.get("/api/queues", auth=star)]
        assert "invoices" in names and "hr.salaries" not in names          # one word: its grant
        assert h.request("GET", "/metrics", auth=root).status_code == 200   # '#.#' covers everything
        assert "hr.salaries" in [q["name"] for q in h.get("/api/queues", auth=root)]
    finally:
        h.close()
