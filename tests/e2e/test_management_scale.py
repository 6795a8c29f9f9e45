"""The management listener shares the broker's event loop: with thousands of queues,
scraping /metrics or listing /api/queues must not stall AMQP traffic.  A canary
client in another process makes request/response round trips on its own connection
while the API is scraped over and over; it must be served as well as a control
canary of an idle broker over the same seconds (tests/e2e/canary.py).

Also the bounded /metrics (aggregates + the deepest queues' series), /metrics/per-object,
the paged /api/queues (offset, limit, name, sort, X-Total-Count) and the CLI's --limit
and --name against the same broker."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx
import pytest

from tests.broker_process import BrokerProcess
from tests.e2e.canary import Canary
from tests.management.scale_support import populate

pytestmark = pytest.mark.e2e

QUEUES = 8000
ROUNDS = 3
METRICS_QUEUE_LIMIT = 50      # per-queue series on /metrics (the default is larger)


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    config = f"[management]\nmetrics_queue_limit = {METRICS_QUEUE_LIMIT}\n"
    proc = BrokerProcess(tmp_path_factory.mktemp("scale") / "data", config=config,
                         args=["--log-level", "info"]).start()
    names = [f"scale-{i:05d}" for i in range(QUEUES)]
    populate(proc.url, names)
    populate(proc.url, ["scale-00042"] * 5 + ["scale-07777"] * 3)      # two deeper queues
    yield proc
    proc.stop()


def mgmt(broker) -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{broker.ports['management']}", timeout=60)


def test_scrapes_do_not_stall_amqp(big, control_broker):
    timings: dict[str, list[float]] = {}
    sizes: dict[str, int] = {}
    statuses: dict[str, int] = {}
    requests = [("/metrics", {}), ("/api/queues", {}), ("/api/queues", {"sort": "depth", "limit": 10000}),
                ("/metrics/per-object", {})]
    with mgmt(big) as c, Canary(control_broker) as control, Canary(big.url) as canary:
        for _ in range(ROUNDS):
            for path, params in requests:
                key = path + ("?" + "&".join(f"{k}={v}" for k, v in params.items()) if params else "")
                t0 = time.perf_counter()
                r = c.get(path, params=params)
                timings.setdefault(key, []).append(time.perf_counter() - t0)
                sizes[key] = len(r.content)
                statuses[key] = r.status_code
    report = canary.report
    detail = f"{report.summary()}; scrapes: " + ", ".join(
        f"{k} {max(v) * 1000:.0f} ms / {sizes[k] / 1e6:.2f} MB" for k, v in timings.items())
    print(detail)
    assert len(report.samples) >= 10, detail
    assert set(statuses.values()) == {200}, statuses
    problem = report.unlike(control.report)
    assert problem is None, f"{problem}; {detail}"


def test_metrics_are_bounded_with_aggregates(big):
    with mgmt(big) as c:
        text = c.get("/metrics").text
    queues = float(re.search(r"^amqpbroker_queues (\S+)$", text, re.M).group(1))
    assert queues >= QUEUES
    per_queue = re.findall(r'^amqpbroker_queue_depth\{queue="([^"]*)"\} (\S+)$', text, re.M)
    assert len(per_queue) == METRICS_QUEUE_LIMIT
    assert per_queue[:2] == [("scale-00042", "6.0"), ("scale-07777", "4.0")], "the deepest first"
    omitted = float(re.search(r"^amqpbroker_metrics_queues_omitted (\S+)$", text, re.M).group(1))
    assert omitted == queues - METRICS_QUEUE_LIMIT
    total = float(re.search(r"^amqpbroker_messages (\S+)$", text, re.M).group(1))
    assert total >= QUEUES + 8
    enqueued = float(re.search(r"^amqpbroker_messages_enqueued_total (\S+)$", text, re.M).group(1))
    assert enqueued >= QUEUES + 8


def test_per_object_metrics_cover_every_queue_and_filter(big):
    with mgmt(big) as c:
        r = c.get("/metrics/per-object", headers={"Accept-Encoding": "gzip"})
        assert r.headers.get("content-encoding") == "gzip"      # httpx decodes it for us
        depth = re.findall(r'^amqpbroker_queue_depth\{queue="scale-\d+"\} ', r.text, re.M)
        assert len(depth) == QUEUES
        few = c.get("/metrics/per-object", params={"name": "scale-0001*"}).text
    names = re.findall(r'^amqpbroker_queue_depth\{queue="([^"]*)"\}', few, re.M)
    assert names == [f"scale-{i:05d}" for i in range(10, 20)]


def test_queue_listing_is_paged(big):
    with mgmt(big) as c:
        r = c.get("/api/queues")
        page = r.json()
        total = int(r.headers["x-total-count"])
        assert total >= QUEUES and len(page) == 1000 < total
        assert 'rel="next"' in r.headers["link"]
        assert [q["name"] for q in page[:2]] == sorted(q["name"] for q in page)[:2]
        r = c.get("/api/queues", params={"name": "scale-0004", "sort": "depth", "limit": 3})
        assert int(r.headers["x-total-count"]) == 10
        assert [(q["name"], q["depth"]) for q in r.json()] == [("scale-00042", 6), ("scale-00040", 1),
                                                                ("scale-00041", 1)]
        r = c.get("/api/queues", params={"name": "scale-0*7", "offset": 2, "limit": 2})
        assert [q["name"] for q in r.json()] == ["scale-00027", "scale-00037"]
        assert c.get("/api/queues", params={"limit": 0}).status_code == 422
        assert c.get("/api/queues", params={"sort": "colour"}).status_code == 422


def test_cli_queue_listing_is_paged(big):
    url = f"http://127.0.0.1:{big.ports['management']}"
    base = [sys.executable, "-m", "amqpbroker.cli", "admin", "--url", url]
    out = subprocess.run(base + ["queues", "--name", "scale-0000*", "--limit", "3"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "queues (3 of 10" in out.stdout and "scale-00002" in out.stdout and "scale-00003" not in out.stdout
    out = subprocess.run(base + ["--json", "queues", "--sort", "depth", "--limit", "1"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert [q["name"] for q in json.loads(out.stdout)] == ["scale-00042"]
