"""core/origins.py: which pages may open an AMQP WebSocket (the upgrade's Origin),
row by row."""

from __future__ import annotations

import pytest

from amqpbroker.core.origins import check_allowed, normalise_origin, origin_refusal


@pytest.mark.parametrize("text, normal", [
    ("https://App.Example.com", "https://app.example.com"),
    ("https://app.example.com:443", "https://app.example.com"),
    ("http://app.example.com:80/", "http://app.example.com"),
    ("http://127.0.0.1:8080", "http://127.0.0.1:8080"),
    ("http://[::1]:8080", "http://[::1]:8080"),
    ("https://app.example.com/path", None),
    ("https://user@app.example.com", None),
    ("ftp://app.example.com", None),
    ("app.example.com", None),
    ("http://host:99999", None),
])
def test_origins_normalised_as_rfc6454(text, normal):
    assert normalise_origin(text) == normal


ALLOWED = check_allowed(["https://app.example.com", "same-host"])


@pytest.mark.parametrize("origin, host, allowed, ok", [
    (None, "127.0.0.1:5673", [], True),                                    # not a browser
    ("http://evil.example", "127.0.0.1:5673", [], False),                  # default: no page at all
    ("https://app.example.com", "broker:5673", ALLOWED, True),
    ("https://APP.example.com:443", "broker:5673", ALLOWED, True),
    ("https://app.example.com:8443", "broker:5673", ALLOWED, False),
    ("http://app.example.com", "broker:5673", ALLOWED, False),
    ("http://127.0.0.1:8080", "127.0.0.1:5673", ALLOWED, True),            # same host, other port
    ("http://localhost:3000", "localhost:5673", ALLOWED, True),
    ("http://[::1]:3000", "[::1]:5673", ALLOWED, True),
    ("http://evil.example", "evil.example:5673", ALLOWED, False),          # a rebindable name
    ("http://mq.internal", "mq.internal:5673", ALLOWED, False),
    ("http://127.0.0.1:8080", "127.0.0.2:5673", ALLOWED, False),           # another host
    ("null", "127.0.0.1:5673", ALLOWED, False),
    ("null", "127.0.0.1:5673", ["null"], True),
    ("http://evil.example", "127.0.0.1:5673", ["*"], True),
    ("not an origin", "127.0.0.1:5673", ALLOWED, False),
])
def test_origin_decisions(origin, host, allowed, ok):
    assert (origin_refusal(origin, host, allowed) is None) is ok


def test_the_listeners_own_host_name_counts_as_same_host():
    assert origin_refusal("http://mq.internal", "mq.internal:5673", ["same-host"], listener_host="mq.internal") is None


def test_the_setting_refuses_what_is_no_origin():
    with pytest.raises(ValueError, match="is not an origin"):
        check_allowed(["https://app.example.com/console"])
    assert check_allowed(["HTTPS://A.example:443", "*"]) == ["https://a.example", "*"]
