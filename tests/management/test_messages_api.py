"""The message endpoints in process (management/message_api.py, messages.py):
browsing, move, replay of a dead-letter queue, bad input, `manage` with ACLs, and
the backup's refusals (the backup itself runs against a real broker:
tests/e2e/test_backup.py)."""

from __future__ import annotations

import logging

from amqpbroker.core.broker import BrokerPolicy
from amqpbroker.core.deadletters import DLQ_KEYS
from amqpbroker.core.queues import Outcome
from tests.core.helpers import RecordingConsumer, bodies
from tests.management.support import error_of
from tests.management.test_api_access import acl_harness


def reject_all(h, queue: str, n: int) -> None:
    q = h.broker.queues[queue]
    c = RecordingConsumer(credit=n)
    q.add_consumer(c)
    for e in list(c.delivered):
        q.settle(e, Outcome.REJECTED)
    q.remove_consumer(c, [], failed=False)


def job(h, path: str, *, auth=None, **kw):
    """POST a move or replay and wait for it to end: (status, the job)."""
    r = h.request("POST", f"{path}?wait=30", auth=auth, **kw)
    return r.status_code, (r.json() if r.status_code < 400 else None), r


def with_dlq(h, n: int = 3) -> None:
    h.broker.policy = BrokerPolicy(dead_letter_address="DLQ")
    h.broker.declare_queue("DLQ")
    h.broker.declare_queue("orders")
    for i in range(n):
        h.publish("orders", f"m{i}", properties={"i": i}, subject=f"s{i}")
    reject_all(h, "orders", n)


def test_browse_shows_sections_and_changes_nothing(h):
    with_dlq(h, 3)
    page = h.get("/api/queues/DLQ/messages?limit=2")
    assert page["depth"] == 3 and len(page["messages"]) == 2
    first = page["messages"][0]
    assert first["state"] == "ready" and first["sequence"] == 1
    assert first["application_properties"] == {   # the provenance, as JMS reads it too
        "i": 0, "_AMQPBROKER_DLQ_QUEUE": "orders", "_AMQPBROKER_DLQ_ADDRESS": "orders",
        "_AMQPBROKER_DLQ_REASON": "rejected", "_AMQPBROKER_DLQ_TIME": int(h.clock() * 1000)}
    assert first["properties"]["subject"] == "s0"
    assert first["message_annotations"]["x-opt-amqpbroker-dlq-queue"] == "orders"
    assert first["message_annotations"]["x-opt-amqpbroker-dlq-reason"] == "rejected"
    assert first["body"]["type"] == "string" and first["body"]["preview"] == "m0"
    assert first["delivery_count"] == 0 and first["redelivered"] is False   # rejected is no failed attempt
    nxt = h.get("/api/queues/DLQ/messages?offset=2")
    assert [m["application_properties"]["i"] for m in nxt["messages"]] == [2]
    sel = h.get("/api/queues/DLQ/messages", params={"selector": "i = 1"})
    assert [m["properties"]["subject"] for m in sel["messages"]] == ["s1"]
    q = h.broker.queues["DLQ"]
    assert q.depth == 3 and q.delivered_total == 0 and q.acquired == 0


def test_replay_all_back_to_origin(h, caplog):
    with_dlq(h, 3)
    with caplog.at_level(logging.INFO, logger="amqpbroker.admin"):
        status, done, r = job(h, "/api/queues/DLQ/replay", json={})
    assert status == 200 and done["state"] == "done", r.text
    assert done["report"]["moved"] == 3 and done["report"]["destinations"] == {"orders": 3}
    assert done["progress"] == {"examined": 3, "total": 3}
    assert f"admin: replay of queue 'DLQ' by (loopback) (job {done['id']}): 3 moved (orders: 3)" in caplog.text
    entries = h.broker.queues["orders"].entries()
    assert bodies(entries) == ["m0", "m1", "m2"] and h.broker.queues["DLQ"].depth == 0
    page = h.get("/api/queues/orders/messages")
    assert all(not set(m["message_annotations"] or {}) & {str(k) for k in DLQ_KEYS} for m in page["messages"])


def test_replay_with_a_body_less_post_and_filters(h):
    with_dlq(h, 4)
    _, done, _ = job(h, "/api/queues/DLQ/replay", json={"selector": "i >= 1", "limit": 2})
    assert done["report"]["moved"] == 2
    assert bodies(h.broker.queues["orders"].entries()) == ["m1", "m2"]
    status, done, _ = job(h, "/api/queues/DLQ/replay")
    assert status == 200 and done["report"]["moved"] == 2


def test_move_between_queues(h):
    h.broker.declare_queue("a")
    h.broker.declare_queue("b")
    h.publish("a", "x", "y")
    status, done, _ = job(h, "/api/queues/a/move", json={"to": "b", "limit": 1})
    assert status == 200 and done["report"]["moved"] == 1
    assert bodies(h.broker.queues["b"].entries()) == ["x"] and bodies(h.broker.queues["a"].entries()) == ["y"]


def test_a_move_is_a_job_that_runs_on_reports_progress_and_can_be_cancelled(h):
    h.broker.declare_queue("a")
    h.broker.declare_queue("b")
    for i in range(2000):
        h.publish("a", f"m{i}")
    r = h.request("POST", "/api/queues/a/move", json={"to": "b"})     # no wait: answered at once
    assert r.status_code == 202 and r.json()["state"] == "running"
    started = r.json()
    assert started["href"] == f"/api/jobs/{started['id']}" and started["progress"]["total"] == 2000
    busy = h.request("POST", "/api/queues/a/move", json={"to": "b"})
    assert busy.status_code == 409 and started["href"] in error_of(busy)
    r = h.request("DELETE", started["href"])
    assert r.status_code == 200 and r.json()["state"] == "cancelled", r.text
    report = r.json()["report"]
    assert report["stopped"] == "cancelled by (loopback)" and report["moved"] < 2000
    a, b = h.broker.queues["a"], h.broker.queues["b"]
    assert a.depth + b.depth == 2000 and b.depth == report["moved"]
    assert [j["id"] for j in h.get("/api/jobs")] == [started["id"]]
    assert h.get(started["href"])["state"] == "cancelled"
    assert h.request("GET", "/api/jobs/move-999").status_code == 404
    status, done, _ = job(h, "/api/queues/a/move", json={"to": "b"})    # the rest, to its end
    assert done["state"] == "done" and a.depth == 0 and b.depth == 2000


def test_selectors_have_the_amqp_length_limit_and_a_budget(h):
    h.broker.declare_queue("a")
    limit = h.settings.limits.max_selector_length
    h.publish("a", "m", properties={"v": "a" * 20_000})
    long = "v = '" + "x" * limit + "'"
    for r in (h.request("GET", "/api/queues/a/messages", params={"selector": long}),
              h.request("POST", "/api/queues/a/move", json={"to": "b", "selector": long})):
        assert r.status_code == 400 and f"longer than {limit} characters (limits.max_selector_length)" in error_of(r)
    costly = "v LIKE '%a" + "_" * 3000 + "b%'"
    r = h.request("GET", "/api/queues/a/messages", params={"selector": costly})
    assert r.status_code == 400 and "over its budget" in error_of(r) and "seq=1" in error_of(r)
    h.broker.declare_queue("b")
    status, done, _ = job(h, "/api/queues/a/move", json={"to": "b", "selector": costly})
    assert done["state"] == "stopped" and "over its budget" in done["report"]["stopped"]
    assert h.broker.queues["a"].depth == 1


def test_bad_input_is_a_clear_4xx_with_a_log_line(h, caplog):
    h.broker.declare_queue("a")
    with caplog.at_level(logging.INFO, logger="amqpbroker.management"):
        r = h.request("POST", "/api/queues/nope/replay", json={})
        assert r.status_code == 404 and "no queue 'nope'" in error_of(r)
        r = h.request("POST", "/api/queues/a/move", json={"to": "b", "selector": "x >>> 1"})
        assert r.status_code == 400 and "bad selector" in error_of(r)
        r = h.request("POST", "/api/queues/a/move", json={"to": "b", "limit": -1})
        assert r.status_code == 422 and "limit" in error_of(r)
        r = h.request("POST", "/api/queues/a/move", json={"to": "nowhere"})
        assert r.status_code == 404 and "nowhere" in error_of(r)
        r = h.request("POST", "/api/queues/a/move", json={"to": "a"})
        assert r.status_code == 400 and "itself" in error_of(r)
        r = h.request("POST", "/api/queues/a/move", json={})
        assert r.status_code == 400 and "'to' is required" in error_of(r)
        r = h.request("GET", "/api/queues/a/messages?limit=-5")
        assert r.status_code == 422
        r = h.request("GET", "/api/queues/a/messages", params={"selector": "("})
        assert r.status_code == 400 and "bad selector" in error_of(r)
    assert "POST /api/queues/nope/replay refused (404): no queue 'nope'" in caplog.text
    assert "refused (422): limit" in caplog.text


def test_backup_refusals(h, tmp_path):
    r = h.request("POST", "/api/backup", json={"dest": str(tmp_path / "b")})
    assert r.status_code == 409 and "without a store" in error_of(r)


def test_manage_is_needed_on_source_and_destination():
    h = acl_harness()
    try:
        mgr = ("mgr", "mgr-pw")            # manage on orders.# only
        h.broker.declare_queue("orders.in")
        h.broker.declare_queue("orders.parked")
        h.broker.declare_queue("invoices")
        h.publish("orders.in", "o1")
        r = h.request("POST", "/api/queues/orders.in/move", json={"to": "invoices"}, auth=mgr)
        assert r.status_code == 403 and "invoices" in error_of(r)
        r = h.request("GET", "/api/queues/invoices/messages", auth=mgr)
        assert r.status_code == 403
        r = h.request("POST", "/api/backup", json={"dest": "/tmp/x"}, auth=mgr)
        assert r.status_code == 403
        status, done, _ = job(h, "/api/queues/orders.in/move", json={"to": "orders.parked"}, auth=mgr)
        assert status == 200 and done["report"]["moved"] == 1
    finally:
        h.close()


def test_replay_skips_origins_the_user_may_not_manage():
    h = acl_harness()
    try:
        h.broker.policy = BrokerPolicy(dead_letter_address="orders.dlq")
        h.broker.declare_queue("orders.dlq")
        for name in ("orders.in", "invoices"):
            h.broker.declare_queue(name)
            h.publish(name, f"from-{name}")
            reject_all(h, name, 1)
        status, done, _ = job(h, "/api/queues/orders.dlq/replay", json={}, auth=("mgr", "mgr-pw"))
        assert status == 200
        assert done["report"]["moved"] == 1 and done["report"]["skip_reasons"] == {"not allowed to manage invoices": 1}
        assert bodies(h.broker.queues["orders.dlq"].entries()) == ["from-invoices"]
    finally:
        h.close()


def test_metrics_count_dead_letters_dropped(h):
    with_dlq(h, 2)                  # two in DLQ; what dies there is dropped, not dead-lettered again
    reject_all(h, "DLQ", 2)
    text = h.request("GET", "/metrics").text
    assert "amqpbroker_dead_letters_dropped_total 2.0" in text
    assert "amqpbroker_selector_budget_exceeded_total" in text


def test_browsing_with_a_costly_selector_yields_the_loop_between_evaluations(h, monkeypatch):
    """Each evaluation within its budget (ten LIKEs against a 256 KiB property), a
    browse still evaluated a whole slice of 256 messages in one loop turn: seconds
    for the other clients.  Now a slice ends once it spent TURN_BUDGET selector steps."""
    import asyncio

    import httpx

    from amqpbroker.management import messages
    from tests.core.test_selector_cost import COSTLY, COSTLY_VALUE
    from tests.management.support import BASE_URL

    h.broker.declare_queue("a")
    for i in range(20):
        h.publish("a", f"m{i}", properties={"p": COSTLY_VALUE})
    evaluated = 0
    real = messages.selects

    def counting(*args):
        nonlocal evaluated
        evaluated += 1
        return real(*args)
    monkeypatch.setattr(messages, "selects", counting)
    per_turn: list[int] = []

    async def go() -> httpx.Response:
        done = False

        async def ticker() -> None:
            seen = 0
            while not done:
                per_turn.append(evaluated - seen)
                seen = evaluated
                await asyncio.sleep(0)
        tick = asyncio.ensure_future(ticker())
        transport = httpx.ASGITransport(app=h.app, client=("127.0.0.1", 50000))
        async with httpx.AsyncClient(transport=transport, base_url=BASE_URL) as c:
            r = await c.get("/api/queues/a/messages", params={"selector": COSTLY})
        done = True
        await tick
        return r
    r = h.loop.run_until_complete(go())
    assert r.status_code == 200 and r.json()["messages"] == [] and evaluated == 20
    assert max(per_turn) <= 2, f"{max(per_turn)} costly evaluations in one loop turn"
