"""Settings decisions that do not need a broker."""

from __future__ import annotations

import pytest

from amqpbroker.config import anonymous_allowed, plain_allowed


@pytest.mark.parametrize("setting, host, tls, allowed", [
    (None, "127.0.0.1", False, True),    # loopback: nobody else reads the socket
    (None, "::1", False, True),
    (None, "0.0.0.0", False, False),     # the network, in clear: not by default
    (None, "10.0.0.5", False, False),
    (None, "0.0.0.0", True, True),       # TLS protects the password
    (True, "0.0.0.0", False, True),      # the operator's explicit choice
    (False, "127.0.0.1", False, False),
    (False, "0.0.0.0", True, True),      # never turned off where TLS protects it
])
def test_plain_allowed(setting, host, tls, allowed):
    assert plain_allowed(setting, host, tls) is allowed


@pytest.mark.parametrize("setting, host, allowed", [
    (None, "127.0.0.1", True), (None, "0.0.0.0", False), (True, "0.0.0.0", True), (False, "127.0.0.1", False),
])
def test_anonymous_allowed(setting, host, allowed):
    assert anonymous_allowed(setting, host) is allowed


# ---------------------------------------------------------------------- [alarms]

def _alarms(tmp_path, text: str = ""):
    from amqpbroker.config import load_settings
    cfg = tmp_path / "b.toml"
    cfg.write_text(text)
    return load_settings(cfg).alarms


def test_alarms_defaults_as_rabbitmq(tmp_path):
    a = _alarms(tmp_path)
    assert (a.memory_high_watermark, a.memory_high_watermark_absolute, a.disk_free_limit, a.check_interval) == \
        (0.4, None, 50_000_000, 1.0)


def test_alarms_from_toml_and_env(tmp_path, monkeypatch):
    a = _alarms(tmp_path, '[alarms]\nmemory_high_watermark = 0.6\nmemory_high_watermark_absolute = "512MiB"\n'
                          'disk_free_limit = "2GB"\ncheck_interval = 0.5\n')
    assert (a.memory_high_watermark, a.memory_high_watermark_absolute, a.disk_free_limit, a.check_interval) == \
        (0.6, 512 << 20, 2_000_000_000, 0.5)
    monkeypatch.setenv("AMQPBROKER_ALARMS__DISK_FREE_LIMIT", "1")          # the environment beats the file
    monkeypatch.setenv("AMQPBROKER_ALARMS__MEMORY_HIGH_WATERMARK_ABSOLUTE", "100MB")
    a = _alarms(tmp_path, '[alarms]\ndisk_free_limit = "2GB"\n')
    assert (a.disk_free_limit, a.memory_high_watermark_absolute) == (1, 100_000_000)


@pytest.mark.parametrize("text, field", [
    ("memory_high_watermark = 0", "alarms.memory_high_watermark"),
    ("memory_high_watermark = 1.5", "alarms.memory_high_watermark"),
    ("memory_high_watermark_absolute = 0", "alarms.memory_high_watermark_absolute"),
    ('disk_free_limit = "lots"', "alarms.disk_free_limit"),
    ("disk_free_limit = -1", "alarms.disk_free_limit"),
    ("check_interval = 0", "alarms.check_interval"),
    ("watermark = 0.5", "alarms.watermark"),                                # a typo is named, not ignored
])
def test_alarms_bad_values_name_the_field(tmp_path, text, field):
    from amqpbroker.config import ConfigError
    with pytest.raises(ConfigError, match=f"invalid setting '{field}'"):
        _alarms(tmp_path, f"[alarms]\n{text}\n")


# ---------------------------------------------------------------------- queue limits


def _settings(tmp_path, text: str):
    from amqpbroker.config import load_settings
    cfg = tmp_path / "broker.toml"
    cfg.write_text(text)
    return load_settings(cfg)


def test_no_queue_limits_and_no_flow_control_by_default(tmp_path):
    s = _settings(tmp_path, "")
    assert s.queue_limits == [] and not hasattr(s.limits, "flow_control_depth")


def test_queue_limits_from_patterns_and_declarations(tmp_path):
    from amqpbroker.core.limits import Overflow, QueueLimits
    s = _settings(tmp_path, """
[[queue_limits]]
pattern = "telemetry.#"
max_depth = 500
max_bytes = "1MiB"
overflow = "drop-head"

[[queues]]
name = "invoices"
max_depth = 10
overflow = "reject"

[[queues]]
name = "plain"
""")
    assert s.queue_limits[0].queue_limits() == QueueLimits(500, 1 << 20, Overflow.DROP_HEAD)
    assert s.queues[0].queue_limits() == QueueLimits(10, 0, Overflow.REJECT)
    assert s.queues[1].queue_limits() is None


@pytest.mark.parametrize("text, field", [
    ('[[queue_limits]]\npattern = "#"\noverflow = "drop-tail"\n', "queue_limits.0.overflow"),
    ('[[queue_limits]]\npattern = "#"\nmax_dept = 5\n', "queue_limits.0.max_dept"),
    ('[[queue_limits]]\nmax_depth = 5\n', "queue_limits.0.pattern"),
    ('[[queues]]\nname = "q"\nmax_depth = -1\n', "queues.0.max_depth"),
])
def test_queue_limits_bad_values_name_the_field(tmp_path, text, field):
    from amqpbroker.config import ConfigError
    with pytest.raises(ConfigError, match=f"invalid setting '{field}'"):
        _settings(tmp_path, text)
