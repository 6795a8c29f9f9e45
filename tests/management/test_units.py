"""Small pure pieces: rate sampling, commit histograms, the CLI's tables and
argument handling, the new configuration sections."""

from __future__ import annotations

import io

import pytest

from amqpbroker.config import ConfigError, load_settings
from amqpbroker.management import cli
from amqpbroker.management.rates import RateTracker
from amqpbroker.store.stats import CommitStats, Histogram

NOW = 1_700_000_000.0


# ---------------------------------------------------------------------- rates

def test_rates_over_the_last_interval():
    r = RateTracker()
    r.sample(100.0, {"q": (0, 0, 0)})
    assert r.rates("q") == (0.0, 0.0, 0.0), "one sample: no rate yet"
    r.sample(110.0, {"q": (50, 20, 10)})
    assert r.rates("q") == (5.0, 2.0, 1.0)
    r.sample(120.0, {"q": (50, 20, 10)})
    assert r.rates("q") == (0.0, 0.0, 0.0)


def test_rates_forget_deleted_and_ignore_counter_resets():
    r = RateTracker()
    r.sample(0.0, {"q": (100, 0, 0)})
    r.sample(10.0, {"q": (5, 0, 0)})           # the queue was deleted and re-created
    assert r.rates("q") == (0.0, 0.0, 0.0)
    r.sample(20.0, {})
    assert r.rates("q") == (0.0, 0.0, 0.0) and len(r) == 0


def test_rates_from_columns_and_a_clock_going_back():
    r = RateTracker()
    r.sample_columns(0.0, ["a", "b"], [[0, 10], [0, 0], [0, 0]])
    r.sample_columns(2.0, ["b", "c", "a"], [[20, 7, 4], [2, 0, 0], [0, 0, 1]])
    assert (r.rates("a"), r.rates("b"), r.rates("c")) == ((2.0, 0.0, 0.5), (5.0, 1.0, 0.0), (0.0, 0.0, 0.0))
    r.sample_columns(1.0, ["a"], [[100], [0], [0]])
    assert r.rates("a") == (2.0, 0.0, 0.5) and len(r) == 3, "an earlier time is ignored"


def test_rates_unknown_name_is_zero():
    assert RateTracker().rates("nope") == (0.0, 0.0, 0.0)


# ---------------------------------------------------------------------- commit histograms

def test_histogram_buckets_are_cumulative():
    h = Histogram((1.0, 2.0))
    for v in (0.5, 1.0, 1.5, 3.0):
        h.observe(v)
    assert h.cumulative() == [("1.0", 2), ("2.0", 3), ("+Inf", 4)]
    assert h.sum == 6.0 and h.count == 4


def test_commit_stats_observe_latency_and_batch():
    s = CommitStats()
    s.observe(0.004, 120)
    assert s.latency.count == 1 and s.batch.sum == 120
    assert dict(s.batch.cumulative())["200.0"] == 1 and dict(s.batch.cumulative())["100.0"] == 0


def test_lmdb_store_records_commit_stats(tmp_path):
    import asyncio
    from amqpbroker.store.lmdb_store import LmdbStore

    loop = asyncio.new_event_loop()
    store = LmdbStore(tmp_path / "store")
    try:
        store.open(loop)
        store.save_exchange("x", "topic")
        store.flush()
        assert store.commits >= 1 and store.commit_stats.latency.count == store.commits
        assert store.commit_stats.batch.sum >= 1
    finally:
        store.close()
        loop.close()


# ---------------------------------------------------------------------- CLI tables

QUEUE = {"name": "orders", "depth": 3, "bytes": 2048, "consumers": 1, "enqueue_rate": 1.25,
         "ack_rate": 0.5, "enqueued_total": 10, "delivered_total": 8, "acked_total": 7,
         "last_delivered_at": NOW - 120}
SUB = {"name": "audit", "namespace": "app", "topic": "orders.eu", "selector": "x > 1", "durable": True,
       "shared": True, "global": False, "consumers": 0, "pending": 12, "pending_bytes": 100,
       "created_at": NOW - 10 * 86400, "last_delivered_at": None, "last_consumer_at": NOW - 8 * 86400,
       "abandoned": True}


def test_table_for_queues():
    cols, rows = cli.table_for("queues", [QUEUE], now=NOW)
    assert cols[:3] == ["name", "depth", "bytes"]
    assert rows == [["orders", "3", "2.0 KiB", "1", "1.2", "0.5", "10", "8", "7", "2.0m ago"]]


def test_table_for_subscriptions_marks_abandoned():
    cols, rows = cli.table_for("subscriptions", [SUB], now=NOW)
    row = dict(zip(cols, rows[0]))
    assert row["kind"] == "durable, shared" and row["abandoned"] == "ABANDONED"
    assert row["last delivered"] == "never" and row["created"] == "10d ago"
    assert row["selector"] == "x > 1" and row["pending"] == "12"


def test_table_for_other_listings():
    assert cli.table_for("exchanges", [{"name": "amq.topic", "type": "topic", "durable": True,
                                        "builtin": True, "bindings": 2}])[1] == [
        ["amq.topic", "topic", "yes", "yes", "2"]]
    assert cli.table_for("bindings", [{"exchange": "e", "key": "k", "queue": "q", "selector": None,
                                       "no_local": False}])[1] == [["e", "k", "q", "", "no"]]
    assert cli.table_for("connections", [{"id": 1, "container_id": "c", "user": None,
                                          "remote_address": "127.0.0.1:5", "listener": "amqp",
                                          "sessions": 1, "links": 2}])[1] == [
        ["1", "c", "", "127.0.0.1:5", "amqp", "1", "2"]]
    with pytest.raises(ValueError):
        cli.table_for("purge", [])


def test_print_table_renders_with_rich():
    out = io.StringIO()
    cli.print_table("subscriptions", [SUB], out)
    text = out.getvalue()
    assert "audit" in text and "ABANDONED" in text and "subscriptions (1)" in text


def test_cli_options_before_or_after_the_command():
    p = cli._parser()
    a = p.parse_args(["--json", "--url", "http://h:1", "queues"])
    assert a.json and a.url == "http://h:1"
    b = p.parse_args(["queues", "--json", "--url", "http://h:2"])
    assert b.json and b.url == "http://h:2"
    c = p.parse_args(["delete-subscription", "s", "--namespace", "ns", "--force", "--non-durable"])
    assert (c.name, c.namespace, c.force, c.durable) == ("s", "ns", True, False)


def test_cli_queue_paging_options():
    a = cli._parser().parse_args(["queues", "--name", "orders.*", "--sort", "depth", "--limit", "5",
                                  "--offset", "10"])
    assert (a.name, a.sort, a.limit, a.offset) == ("orders.*", "depth", 5, 10)
    d = cli._parser().parse_args(["queues"])
    assert (d.name, d.sort, d.limit, d.offset) == (None, "name", cli.DEFAULT_QUEUE_LIMIT, 0)
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["queues", "--sort", "colour"])


@pytest.mark.parametrize("argv", [["queues", "--limit", "0"], ["queues", "--limit", "10001"],
                                  ["queues", "--offset", "-1"]])
def test_cli_bad_paging_is_a_usage_error(argv, capsys):
    assert cli.main(argv) == 2
    assert "--limit" in capsys.readouterr().err


def test_table_titles_tell_a_page_from_the_whole():
    assert cli.title_for("queues", 3) == "queues (3)"
    assert cli.title_for("queues", 3, 3) == "queues (3)"
    assert cli.title_for("queues", 3, 10) == "queues (3 of 10; --offset 3 for more)"
    assert cli.title_for("queues", 3, 10, offset=3) == "queues (3 of 10, from 4; --offset 6 for more)"
    assert cli.title_for("queues", 1, 10, offset=9) == "queues (1 of 10, from 10)"
    out = io.StringIO()
    cli.print_table("queues", [QUEUE], out, cli.title_for("queues", 1, 500))
    assert "queues (1 of 500; --offset 1 for more)" in out.getvalue()


def test_cli_bad_idle_is_a_usage_error(capsys):
    assert cli.main(["subscriptions", "--idle", "later"]) == 2
    assert "--idle" in capsys.readouterr().err


def test_cli_unreachable_broker_exits_3(capsys):
    assert cli.main(["--url", "http://127.0.0.1:9", "--timeout", "2", "queues"]) == 3
    assert "cannot reach the broker" in capsys.readouterr().err


# ---------------------------------------------------------------------- configuration

def _load(tmp_path, text):
    cfg = tmp_path / "b.toml"
    cfg.write_text(text)
    return load_settings(cfg)


def test_config_defaults(tmp_path, monkeypatch):
    monkeypatch.delenv("AMQPBROKER_MANAGEMENT__PORT", raising=False)
    s = _load(tmp_path, "")
    m = s.management
    assert (m.enabled, m.host, m.port, m.cert_file) == (True, "127.0.0.1", 8161, None)
    assert (m.allowed_hosts, m.metrics_queue_limit) == ([], 1000)
    lim = s.limits
    assert (lim.auth_free_failures, lim.auth_base_delay, lim.auth_max_delay) == (5, 0.2, 10.0)
    assert s.expiry_policies == [] and s.expiry_interval == 60.0 and s.acl == [] and s.anonymous is None


def test_config_sections(tmp_path):
    s = _load(tmp_path, """
expiry_interval = 5
[management]
enabled = false
allowed_hosts = ["broker.example.com"]
metrics_queue_limit = 50
[limits]
auth_free_failures = 2
[[expiry_policies]]
pattern = "orders.*"
idle = "7d"
max_backlog = 10000
action = "delete"
[[acl]]
group = "ops"
pattern = "orders.#"
permissions = ["send", "consume", "browse", "manage"]
[anonymous]
permissions = ["consume"]
""")
    assert s.management.enabled is False and s.expiry_interval == 5
    assert s.management.allowed_hosts == ["broker.example.com"] and s.management.metrics_queue_limit == 50
    assert s.limits.auth_free_failures == 2
    p = s.expiry_policies[0]
    assert (p.pattern, p.idle, p.max_backlog, p.action, p.match) == ("orders.*", 7 * 86400, 10000, "delete", "any")
    assert s.acl[0].group == "ops" and s.anonymous.permissions == ["consume"]


@pytest.mark.parametrize("text,field", [
    ('[[expiry_policies]]\npattern = "x"\n', "expiry_policies.0"),
    ('[[expiry_policies]]\npattern = "x"\nidle = "soon"\n', "expiry_policies.0.idle"),
    ('[[expiry_policies]]\npattern = "x"\nidle = "1d"\naction = "archive"\n', "expiry_policies.0.action"),
    ('[[acl]]\npattern = "#"\npermissions = ["send"]\n', "acl.0"),
    ('[[acl]]\nuser = "a"\ngroup = "b"\npermissions = ["send"]\n', "acl.0"),
    ('[[acl]]\nuser = "a"\npermissions = ["write"]\n', "acl.0.permissions.0"),
    ('[management]\ncert_file = "c.pem"\n', "management"),
    ('[management]\nport = 70000\n', "management.port"),
    ('[management]\nmetrics_queue_limit = -1\n', "management.metrics_queue_limit"),
    ('[management]\nallowed_hosts = "broker.example.com"\n', "management.allowed_hosts"),
    ('[limits]\nauth_max_delay = -1\n', "limits.auth_max_delay"),
])
def test_config_errors_name_the_field(tmp_path, text, field):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, text)
    assert f"'{field}'" in str(err.value), str(err.value)
