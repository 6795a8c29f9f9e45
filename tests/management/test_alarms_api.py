"""The alarms in the management API (GET / PUT /api/alarms, the overview) and in
/metrics, in process: readings are fed to the server's `Alarms` directly."""

from __future__ import annotations

import logging

from amqpbroker.config import AclRuleDecl, ManagementConfig, Settings, StoreConfig, UserConfig
from tests.management.support import Harness, error_of

GiB = 1 << 30
JSON = {"Content-Type": "application/json"}


def feed(h: Harness, rss: int = 100 << 20, disk_free: int = 10 * GiB) -> None:
    h.server.alarms.feed(rss=rss, physical_memory=10 * GiB, cgroup_limit=None, disk_free=disk_free)


def test_alarms_view_and_overview(h):
    feed(h)
    body = h.get("/api/alarms")
    assert body["blocking"] is False and body["reasons"] == []
    m = body["memory"]
    assert (m["raised"], m["used"], m["limit"], m["basis"], m["high_watermark"], m["available"]) == \
        (False, 100 << 20, 4 * GiB, "physical", 0.4, 10 * GiB)
    assert body["disk"]["enabled"] is False          # the harness has no store: no disk alarm
    assert body["check_interval"] == 1.0
    assert h.get("/api/overview")["alarms"] == []


def test_put_thresholds_raises_and_clears_at_once(h, caplog):
    feed(h)
    caplog.set_level(logging.INFO)
    r = h.request("PUT", "/api/alarms", json={"memory_high_watermark_absolute": 1}, headers=JSON)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["blocking"] is True and body["reasons"] == ["memory"]
    assert body["memory"]["basis"] == "absolute" and body["memory"]["limit"] == 1
    assert h.server.alarms.blocking and h.get("/api/overview")["alarms"] == ["memory"]
    assert "alarm thresholds changed by (loopback): memory_high_watermark_absolute=1" in caplog.text
    # The fraction alone drops the absolute watermark (as rabbitmqctl set_vm_memory_high_watermark).
    body = h.request("PUT", "/api/alarms", json={"memory_high_watermark": 0.5}, headers=JSON).json()
    assert body["blocking"] is False and body["memory"]["high_watermark_absolute"] is None
    assert body["memory"]["limit"] == 5 * GiB and body["memory"]["raised_total"] == 1
    # Fields left out keep their values.
    body = h.request("PUT", "/api/alarms", json={"disk_free_limit": 123}, headers=JSON).json()
    assert body["memory"]["high_watermark"] == 0.5 and body["disk"]["limit"] == 123


def test_put_refuses_bad_values(h):
    for payload in ({"memory_high_watermark": 0}, {"memory_high_watermark": 2},
                    {"memory_high_watermark_absolute": 0}, {"disk_free_limit": -5}, {"disk_free_limit": None}):
        r = h.request("PUT", "/api/alarms", json=payload, headers=JSON)
        assert r.status_code == 422, (payload, r.text)
        assert error_of(r)
    a = h.server.alarms
    assert (a.memory_high_watermark, a.memory_high_watermark_absolute, a.disk_free_limit) == (0.4, None, 50_000_000)


def test_put_needs_manage_on_everything():
    settings = Settings(store=StoreConfig(enabled=False), management=ManagementConfig(),
                        users={"root": UserConfig(password="root-pw"), "mgr": UserConfig(password="mgr-pw")},
                        acl=[AclRuleDecl(user="root", permissions=["all"]),
                             AclRuleDecl(user="mgr", pattern="orders.#", permissions=["manage"])])
    h = Harness(settings, client_addr="10.9.8.7")
    try:
        r = h.request("PUT", "/api/alarms", json={"disk_free_limit": 1}, headers=JSON, auth=("mgr", "mgr-pw"))
        assert r.status_code == 403
        assert h.server.alarms.disk_free_limit == 50_000_000
        assert h.get("/api/alarms", auth=("mgr", "mgr-pw"))["disk"]["limit"] == 50_000_000
        r = h.request("PUT", "/api/alarms", json={"disk_free_limit": 1}, headers=JSON, auth=("root", "root-pw"))
        assert r.status_code == 200 and h.server.alarms.disk_free_limit == 1
    finally:
        h.close()


def test_metrics_alarm_gauges(h):
    text = h.request("GET", "/metrics").text
    assert "amqpbroker_alarm_memory 0.0" in text and "amqpbroker_alarm_disk 0.0" in text
    assert "amqpbroker_memory_used_bytes" not in text       # no reading yet: left out, not 0
    feed(h, rss=5 * GiB)
    text = h.request("GET", "/metrics").text
    for line in ("amqpbroker_alarm_memory 1.0", "amqpbroker_alarm_memory_raised_total 1.0",
                 "amqpbroker_alarm_disk 0.0", "amqpbroker_memory_used_bytes 5.36870912e+09",
                 "amqpbroker_memory_limit_bytes 4.294967296e+09"):
        assert line in text, line
    assert "amqpbroker_disk_free_bytes" not in text         # no store: the disk alarm is off


def test_metrics_disk_figures_with_a_store_enabled_alarms():
    h = Harness()
    try:
        h.server.alarms.disk_enabled = True                  # as with a store (never opened here)
        feed(h, disk_free=10)
        text = h.request("GET", "/metrics").text
        for line in ("amqpbroker_alarm_disk 1.0", "amqpbroker_disk_free_bytes 10.0",
                     "amqpbroker_disk_free_limit_bytes 5e+07"):
            assert line in text, line
    finally:
        h.close()
