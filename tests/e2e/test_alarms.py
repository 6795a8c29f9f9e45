"""Memory and disk alarms in the real broker process: raised by the configuration
(file or environment) or at run time through PUT /api/alarms, seen in the log, in
/metrics and in the management API; cleared the same ways.  Readings are the
process's own (RSS, statvfs): the thresholds are what the tests move (1 byte of
memory, more free disk than any disk has)."""

from __future__ import annotations

import re

import httpx
import pytest
from proton import Message

from tests.client import connect, receive_all

pytestmark = pytest.mark.e2e

HUGE = 10**18            # bytes: more free space than any disk has


def api(broker) -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{broker.ports['management']}", timeout=10)


def metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def put(c: httpx.Client, **thresholds) -> dict:
    r = c.put("/api/alarms", json=thresholds)
    assert r.status_code == 200, r.text
    return r.json()


def index_of(broker, pattern: str) -> int:
    lines = broker.log_text().splitlines()
    return next(i for i, line in enumerate(lines) if re.search(pattern, line))


def test_disk_alarm_from_config_then_cleared_through_the_api(broker_factory):
    b = broker_factory(f"[alarms]\ndisk_free_limit = {HUGE}\n")
    line = b.wait_for_log(r"disk alarm raised")
    assert "WARNING" in line and "below disk_free_limit" in line and "producers get no credit" in line
    assert str(b.data_dir.resolve()) in line
    # Raised by the first check, before the AMQP listener accepted anyone.
    assert index_of(b, "disk alarm raised") < index_of(b, "amqp listening on")
    with api(b) as c:
        body = c.get("/api/alarms").json()
        assert body["blocking"] is True and body["reasons"] == ["disk"]
        assert body["disk"]["enabled"] is True and 0 < body["disk"]["free"] < HUGE
        assert c.get("/api/overview").json()["alarms"] == ["disk"]
        text = c.get("/metrics").text
        assert metric(text, "amqpbroker_alarm_disk") == 1 and metric(text, "amqpbroker_alarm_memory") == 0
        assert metric(text, "amqpbroker_disk_free_limit_bytes") == HUGE
        assert metric(text, "amqpbroker_disk_free_bytes") == pytest.approx(body["disk"]["free"], rel=0.05)

        body = put(c, disk_free_limit=1000)
        assert body["blocking"] is False and body["disk"]["raised_total"] == 1
        line = b.wait_for_log(r"disk alarm cleared")
        assert "INFO" in line and "producers get credit again" in line
        assert metric(c.get("/metrics").text, "amqpbroker_alarm_disk") == 0
        assert c.get("/api/overview").json()["alarms"] == []


def test_memory_alarm_raised_and_cleared_at_run_time(broker_factory):
    b = broker_factory()
    with api(b) as c:
        before = c.get("/api/alarms").json()
        assert before["blocking"] is False and before["memory"]["used"] > 10 << 20   # a Python process
        assert before["memory"]["basis"] in ("physical", "cgroup") and before["memory"]["high_watermark"] == 0.4

        body = put(c, memory_high_watermark_absolute=1)
        assert body["reasons"] == ["memory"] and body["memory"]["limit"] == 1
        line = b.wait_for_log(r"memory alarm raised")
        assert "WARNING" in line and "broker RSS" in line and "memory_high_watermark_absolute" in line
        assert "producers get no credit" in line
        text = c.get("/metrics").text
        assert metric(text, "amqpbroker_alarm_memory") == 1 and metric(text, "amqpbroker_memory_limit_bytes") == 1
        assert metric(text, "amqpbroker_memory_used_bytes") > 10 << 20

        body = put(c, memory_high_watermark=1.0)          # back to a fraction: all the memory there is
        assert body["blocking"] is False and body["memory"]["high_watermark_absolute"] is None
        line = b.wait_for_log(r"memory alarm cleared")
        assert "INFO" in line and "producers get credit again" in line
        text = c.get("/metrics").text
        assert metric(text, "amqpbroker_alarm_memory") == 0
        assert metric(text, "amqpbroker_alarm_memory_raised_total") == 1


def test_alarm_from_the_environment_and_consumers_keep_draining(broker_factory):
    b = broker_factory(env={"AMQPBROKER_ALARMS__MEMORY_HIGH_WATERMARK_ABSOLUTE": "1"})
    b.wait_for_log(r"memory alarm raised")
    with api(b) as c:
        assert c.get("/api/alarms").json()["reasons"] == ["memory"]
        # Thresholds change at run time, and come back from the configuration at a restart.
        put(c, memory_high_watermark_absolute=HUGE)
    b.wait_for_log(r"memory alarm cleared")
    conn = connect(b.url)
    try:
        snd = conn.create_sender("alarm-drain")
        for i in range(5):
            snd.send(Message(body=f"m{i}"))
    finally:
        conn.close()
    with api(b) as c:
        assert put(c, memory_high_watermark_absolute=1)["blocking"] is True   # raised again, messages waiting
    assert [m.body for m in receive_all(b.url, "alarm-drain", timeout=2.0)] == [f"m{i}" for i in range(5)]
    b.restart()
    b.wait_for_log(r"memory alarm raised")
    with api(b) as c:
        assert c.get("/api/alarms").json()["memory"]["high_watermark_absolute"] == 1


def test_no_disk_alarm_without_a_store(broker_factory):
    b = broker_factory(f"[store]\nenabled = false\n[alarms]\ndisk_free_limit = {HUGE}\n")
    with api(b) as c:
        body = c.get("/api/alarms").json()
        assert body["disk"]["enabled"] is False and body["disk"]["free"] is None and body["blocking"] is False
        text = c.get("/metrics").text
        assert metric(text, "amqpbroker_alarm_disk") == 0 and metric(text, "amqpbroker_disk_free_bytes") is None
    assert "disk alarm" not in b.log_text()


def test_a_misspelt_threshold_stops_the_broker(broker_factory):
    b = broker_factory("[alarms]\nmemory_watermark = 0.5\n", start=False)
    with pytest.raises(RuntimeError, match="alarms.memory_watermark"):
        b.start()


def test_producers_get_no_credit_while_an_alarm_is_raised(broker_factory):
    """The alarm's effect (server/flow.py, via Alarms.subscribe): a producer attaching
    during the alarm gets no credit, its send waits (no refusal, the connection stays
    open), a consumer still drains; when the alarm clears the waiting send goes
    through."""
    from proton import Timeout

    b = broker_factory()
    conn = connect(b.url)
    try:
        conn.create_sender("alarm-backlog").send(Message(body="queued before"))
    finally:
        conn.close()
    with api(b) as c:
        assert put(c, memory_high_watermark_absolute=1)["blocking"] is True
    producer = connect(b.url)
    try:
        snd = producer.create_sender("alarm-credit")
        with pytest.raises(Timeout):
            snd.send(Message(body="held"), timeout=1.0)
        # No credit came: the message waits in the client (proton counts it as credit -1).
        assert snd.link.queued == 1 and snd.link.credit == -1 and snd.link.state & snd.link.REMOTE_ACTIVE
        with api(b) as c:                     # the held producer is counted
            assert c.get("/api/alarms").json()["producers_held"] == 1
            text = c.get("/metrics").text
            assert metric(text, "amqpbroker_producers_held") == 1
            assert metric(text, "amqpbroker_producers_held_total") >= 1
        # Consumers keep draining during the alarm.
        assert [m.body for m in receive_all(b.url, "alarm-backlog", timeout=2.0)] == ["queued before"]
        with api(b) as c:
            assert put(c, memory_high_watermark_absolute=HUGE)["blocking"] is False
        snd.send(Message(body="after"), timeout=5.0)      # settled: the held one went first
        with api(b) as c:
            assert c.get("/api/alarms").json()["producers_held"] == 0
    finally:
        producer.close()
    assert [m.body for m in receive_all(b.url, "alarm-credit", timeout=2.0)] == ["held", "after"]
