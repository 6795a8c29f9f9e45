"""The pure request policy (management/request_policy.py), decision by decision:
which Host headers the listener answers (DNS rebinding), and which state-changing
requests it takes (cross-site request forgery)."""

from __future__ import annotations

import pytest

from amqpbroker.management.request_policy import HostPolicy, check_request, same_origin, split_host

LOCAL = HostPolicy("127.0.0.1")
NAMED = HostPolicy("0.0.0.0", ["broker.example.com", "Proxy.Example.NET."])


@pytest.mark.parametrize("value,expected", [
    ("127.0.0.1:8161", ("127.0.0.1", 8161)),
    ("127.0.0.1", ("127.0.0.1", None)),
    ("LOCALHOST:8161", ("localhost", 8161)),
    ("[::1]:8161", ("::1", 8161)),
    ("[::1]", ("::1", None)),
    ("evil.example:8161", ("evil.example", 8161)),
    ("localhost.:80", ("localhost.", 80)),
    ("", None),
    ("::1", None),                       # IPv6 must be bracketed
    ("[::1", None),
    ("[::1]x", None),
    ("[127.0.0.1]:80", None),            # brackets are for IPv6 only
    ("host:", None),
    (":8161", None),
    ("host:99999", None),
    ("host:8a", None),
    ("host:²", None),
    ("user@host", None),
    ("ho st", None),
    ("höst", None),
])
def test_split_host(value, expected):
    assert split_host(value) == expected


@pytest.mark.parametrize("policy,host,allowed", [
    (LOCAL, "127.0.0.1", True),
    (LOCAL, "::1", True),
    (LOCAL, "localhost", True),
    (LOCAL, "localhost.", True),
    (LOCAL, "10.1.2.3", True),           # an address is not a name anyone can re-point
    (LOCAL, "evil.example", False),
    (LOCAL, "localhost.evil.example", False),
    (LOCAL, "broker.example.com", False),
    (NAMED, "broker.example.com", True),
    (NAMED, "BROKER.example.com.", True),
    (NAMED, "proxy.example.net", True),
    (NAMED, "sub.broker.example.com", False),
    (HostPolicy("mq.internal"), "mq.internal", True),   # the listener's own configured name
    (HostPolicy("mq.internal"), "other.internal", False),
])
def test_host_policy(policy, host, allowed):
    assert policy.allows(host) is allowed


@pytest.mark.parametrize("origin,scheme,host,port,same", [
    ("http://127.0.0.1:8161", "http", "127.0.0.1", 8161, True),
    ("http://LOCALHOST:8161", "http", "localhost", 8161, True),
    ("http://[::1]:8161", "http", "::1", 8161, True),
    ("http://127.0.0.1", "http", "127.0.0.1", None, True),
    ("http://127.0.0.1:80", "http", "127.0.0.1", None, True),        # default port either way
    ("https://127.0.0.1", "https", "127.0.0.1", 443, True),
    ("http://127.0.0.1:8161", "https", "127.0.0.1", 8161, False),    # another scheme
    ("http://127.0.0.1:8162", "http", "127.0.0.1", 8161, False),     # another port: another origin
    ("http://localhost:8161", "http", "127.0.0.1", 8161, False),     # another name: another origin
    ("http://evil.example:8161", "http", "127.0.0.1", 8161, False),
    ("null", "http", "127.0.0.1", 8161, False),
    ("http://127.0.0.1:8161/path", "http", "127.0.0.1", 8161, False),
    ("ftp://127.0.0.1:8161", "http", "127.0.0.1", 8161, False),
    ("127.0.0.1:8161", "http", "127.0.0.1", 8161, False),
])
def test_same_origin(origin, scheme, host, port, same):
    assert same_origin(origin, scheme, host, port) is same


JSON = "application/json"
FORM = "application/x-www-form-urlencoded"
OWN = "http://127.0.0.1:8161"


# (method, host, origin, content type, has body) → None (answered) or the refusal's status
ROWS = [
    # -- Host: every method
    ("GET", "127.0.0.1:8161", None, None, False, None),
    ("GET", "localhost:8161", None, None, False, None),
    ("GET", "[::1]:8161", None, None, False, None),
    ("GET", "evil.example:8161", None, None, False, 421),
    ("GET", "evil.example:8161", "http://evil.example:8161", None, False, 421),
    ("POST", "evil.example:8161", "http://evil.example:8161", JSON, True, 421),   # DNS rebinding
    ("DELETE", "evil.example:8161", None, None, False, 421),
    ("GET", None, None, None, False, 400),
    ("GET", "a b", None, None, False, 400),
    # -- reads: Origin and Content-Type do not matter (nothing changes, nothing readable cross-origin)
    ("GET", "127.0.0.1:8161", "http://evil.example", None, False, None),
    ("HEAD", "127.0.0.1:8161", "http://evil.example", FORM, False, None),
    ("OPTIONS", "127.0.0.1:8161", "http://evil.example", None, False, None),
    # -- changes without Origin (CLI, curl, scripts)
    ("POST", "127.0.0.1:8161", None, JSON, True, None),
    ("POST", "127.0.0.1:8161", None, "application/json; charset=utf-8", True, None),
    ("POST", "127.0.0.1:8161", None, None, False, None),           # body-less purge
    ("DELETE", "127.0.0.1:8161", None, None, False, None),
    ("DELETE", "127.0.0.1:8161", None, JSON, False, None),
    ("POST", "127.0.0.1:8161", None, None, True, 415),             # a body must say it is JSON
    ("POST", "127.0.0.1:8161", None, FORM, True, 415),             # an HTML form
    ("POST", "127.0.0.1:8161", None, FORM, False, 415),            # an empty HTML form
    ("POST", "127.0.0.1:8161", None, "text/plain", True, 415),
    ("POST", "127.0.0.1:8161", None, "multipart/form-data; boundary=x", True, 415),
    ("PUT", "127.0.0.1:8161", None, "text/plain", True, 415),
    # -- changes with an Origin (a browser)
    ("POST", "127.0.0.1:8161", OWN, JSON, False, None),            # the console
    ("DELETE", "127.0.0.1:8161", OWN, JSON, False, None),
    ("PATCH", "127.0.0.1:8161", OWN, JSON, True, None),
    ("POST", "127.0.0.1:8161", OWN, None, False, 415),             # a browser must send JSON
    ("POST", "127.0.0.1:8161", OWN, FORM, True, 415),
    ("POST", "127.0.0.1:8161", "http://evil.example", JSON, True, 403),
    ("POST", "127.0.0.1:8161", "http://evil.example", None, False, 403),   # no-cors fetch
    ("POST", "127.0.0.1:8161", "http://evil.example", FORM, True, 415),    # cross-site form
    ("POST", "127.0.0.1:8161", "null", JSON, True, 403),
    ("DELETE", "127.0.0.1:8161", "http://127.0.0.1:3000", JSON, False, 403),  # another local port
    ("POST", "localhost:8161", "http://localhost:8161", JSON, True, None),
    ("post", "127.0.0.1:8161", "http://evil.example", JSON, True, 403),
]


@pytest.mark.parametrize("method,host,origin,ctype,body,status", ROWS)
def test_check_request(method, host, origin, ctype, body, status):
    refusal = check_request(LOCAL, method=method, scheme="http", host=host, origin=origin,
                            content_type=ctype, has_body=body)
    assert (refusal and refusal.status) == status, refusal


def test_refusals_say_why():
    def error(**kw):
        base = dict(method="POST", scheme="http", host="127.0.0.1:8161", origin=None, content_type=None,
                    has_body=False)
        return check_request(LOCAL, **{**base, **kw}).error
    assert "allowed_hosts" in error(host="evil.example:8161") and "evil.example" in error(host="evil.example")
    assert "cross-origin request from http://evil.example refused" == error(origin="http://evil.example")
    assert "application/json" in error(content_type=FORM) and FORM in error(content_type=FORM)


def test_https_listener_origin():
    assert check_request(LOCAL, method="POST", scheme="https", host="127.0.0.1:8161",
                         origin="https://127.0.0.1:8161", content_type=JSON, has_body=True) is None
    refusal = check_request(LOCAL, method="POST", scheme="https", host="127.0.0.1:8161",
                            origin="http://127.0.0.1:8161", content_type=JSON, has_body=True)
    assert refusal is not None and refusal.status == 403
