"""The queue listing's pages and the bounded metrics, in process; `paced` gives the
loop its turns."""

from __future__ import annotations

import asyncio
import re

import pytest

from amqpbroker.config import ManagementConfig, Settings, StoreConfig
from amqpbroker.management.api import _json_bytes, _json_chunks
from amqpbroker.management.pacing import paced
from tests.management.support import Harness


def harness(**management) -> Harness:
    return Harness(Settings(store=StoreConfig(enabled=False), management=ManagementConfig(**management)))


@pytest.fixture
def many():
    h = harness(metrics_queue_limit=3)
    for i in range(30):
        h.broker.declare_queue(f"q{i:02d}")
    h.publish("q07", "a", "b", "c")
    h.publish("q21", "a", "b")
    h.subscribe("audit", "app")
    yield h
    h.close()


def names(r) -> list[str]:
    return [q["name"] for q in r.json()]


def test_default_page_is_everything_by_name_with_the_total(many):
    r = many.request("GET", "/api/queues")
    assert r.status_code == 200 and r.headers["x-total-count"] == "31" and "link" not in r.headers
    assert names(r) == sorted(names(r)) and len(names(r)) == 31
    assert r.json()[7]["depth"] == 3 and set(r.json()[0]) >= {"name", "depth", "enqueue_rate", "subscription"}


def test_offset_limit_and_the_next_link(many):
    r = many.request("GET", "/api/queues", params={"limit": 5, "offset": 10, "subscription": "false"})
    assert names(r) == [f"q{i:02d}" for i in range(10, 15)] and r.headers["x-total-count"] == "30"
    assert r.headers["link"] == '</api/queues?subscription=false&offset=15&limit=5>; rel="next"'
    assert many.request("GET", "/api/queues", params={"offset": 28, "limit": 5, "subscription": "false"}
                        ).headers.get("link") is None


def test_filter_and_sort(many):
    r = many.request("GET", "/api/queues", params={"name": "q2", "sort": "depth", "limit": 2})
    assert names(r) == ["q21", "q20"] and r.headers["x-total-count"] == "10"
    r = many.request("GET", "/api/queues", params={"name": "q?7"})
    assert names(r) == ["q07", "q17", "q27"]
    r = many.request("GET", "/api/queues", params={"subscription": "true"})
    assert [q["subscription"] for q in r.json()] == [True]


@pytest.mark.parametrize("params", [{"limit": 0}, {"limit": 10_001}, {"offset": -1}, {"sort": "colour"}])
def test_bad_paging_parameters_are_422(many, params):
    assert many.request("GET", "/api/queues", params=params).status_code == 422


def test_long_pages_are_encoded_in_chunks_the_same_way():
    items = [{"name": f"q{i}", "rate": i / 3, "none": None, "ü": True} for i in range(1234)]
    assert _json_chunks(items) == _json_bytes(items)
    assert _json_chunks([]) == b"[]"
    h = harness()
    try:
        for i in range(500):
            h.broker.declare_queue(f"big{i:03d}")
        r = h.request("GET", "/api/queues", params={"limit": 450})
        assert names(r) == [f"big{i:03d}" for i in range(450)]
    finally:
        h.close()


def test_metrics_show_the_deepest_queues_and_aggregates(many):
    text = many.request("GET", "/metrics").text
    assert re.findall(r'^amqpbroker_queue_depth\{queue="([^"]+)"\}', text, re.M) == ["q07", "q21", "q00"]
    assert "amqpbroker_queues 31.0" in text and "amqpbroker_messages 5.0" in text
    assert "amqpbroker_metrics_queues_omitted 28.0" in text
    assert "amqpbroker_messages_enqueued_total 5.0" in text
    assert 'amqpbroker_subscription_pending_messages{durable="true",name="audit",namespace="app"} 0.0' in text
    per_object = many.request("GET", "/metrics/per-object").text
    assert len(re.findall(r"^amqpbroker_queue_depth\{", per_object, re.M)) == 31
    assert "amqpbroker_connections" not in per_object
    few = many.request("GET", "/metrics/per-object", params={"name": "q1*"}).text
    assert re.findall(r'^amqpbroker_queue_acked_total\{queue="([^"]+)"\}', few, re.M) == [
        f"q{i}" for i in range(10, 20)]


def test_deleted_queues_do_not_lower_the_broker_wide_counters(many):
    def enqueued() -> float:
        text = many.request("GET", "/metrics").text
        return float(re.search(r"^amqpbroker_messages_enqueued_total (\S+)$", text, re.M).group(1))
    assert enqueued() == 5.0
    assert many.request("DELETE", "/api/queues/q07").status_code == 200
    assert enqueued() == 5.0
    many.publish("q00", "x")
    assert enqueued() == 6.0


def test_big_metrics_are_gzipped_when_asked():
    h = harness()
    try:
        for i in range(2000):
            h.broker.declare_queue(f"queue-with-a-long-name-{i:04d}")
        r = h.request("GET", "/metrics/per-object", headers={"Accept-Encoding": "gzip"})
        assert r.headers["content-encoding"] == "gzip" and r.headers["vary"] == "Accept-Encoding"
        assert len(re.findall(r"^amqpbroker_queue_depth\{", r.text, re.M)) == 2000   # httpx decoded it
        assert int(r.headers["content-length"]) < len(r.content) / 5
        r = h.request("GET", "/metrics/per-object", headers={"Accept-Encoding": "identity"})
        assert "content-encoding" not in r.headers and r.text.count("\n") > 16000
        small = h.request("GET", "/metrics/per-object", params={"name": "queue-with-a-long-name-000"},
                          headers={"Accept-Encoding": "gzip"})
        assert "content-encoding" not in small.headers, "small answers are sent as they are"
        assert len(re.findall(r"^amqpbroker_queue_depth\{", small.text, re.M)) == 10
    finally:
        h.close()


def test_overview_counts_every_queue(many):
    body = many.get("/api/overview")
    assert body["queues"] == 31 and body["messages"] == 5


def test_paced_gives_the_loop_turns():
    loop = asyncio.new_event_loop()
    try:
        async def run(budget: float) -> tuple[list[int], int]:
            turns = 0
            done = False

            def tick() -> None:
                nonlocal turns
                if not done:
                    turns += 1
                    loop.call_soon(tick)

            loop.call_soon(tick)
            out = await paced(range(1000), lambda x: x * 2, budget=budget)
            done = True
            return out, turns

        out, turns = loop.run_until_complete(run(0.0))
        assert out == [x * 2 for x in range(1000)] and turns >= 15, "a turn every 64 items when over budget"
        out, turns = loop.run_until_complete(run(60.0))
        assert turns == 0, "within the budget: no turn given"
    finally:
        loop.close()
