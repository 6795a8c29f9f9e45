"""The management listener's request guard and authentication throttling against the
real broker process, with httpx: what a browser sends after DNS rebinding or from
another site, and password guessing over HTTP basic."""

from __future__ import annotations

import re
import time
import uuid

import httpx
import pytest
from proton import Message

from tests.client import connect

pytestmark = pytest.mark.e2e


def uniq(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def depth(client: httpx.Client, queue: str) -> int:
    r = client.get(f"/api/queues/{queue}")
    assert r.status_code == 200, r.text
    return r.json()["depth"]


@pytest.fixture
def victim(broker):
    """A queue holding one message, and a client for the broker's management API."""
    port = broker.ports["management"]
    queue = uniq("victim")
    conn = connect(broker.url, container_id=uniq("pub"))
    conn.create_sender(queue).send(Message(body="keep me"))
    conn.close()
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
        assert depth(c, queue) == 1
        yield c, queue, port


# ---------------------------------------------------------------------- DNS rebinding, cross-site

def test_rebound_host_is_refused_and_nothing_is_purged(victim):
    c, queue, port = victim
    evil = {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}",
            "Content-Type": "application/json"}
    r = c.post(f"/api/queues/{queue}/purge", headers=evil)
    assert r.status_code == 421
    assert "evil.example" in r.json()["error"] and "allowed_hosts" in r.json()["error"]
    r = c.get("/api/queues", headers={"Host": f"evil.example:{port}"})
    assert r.status_code == 421, "reads too: a rebound page could read everything"
    assert depth(c, queue) == 1


def test_loopback_host_names_work(victim):
    c, queue, port = victim
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost"):
        assert c.get(f"/api/queues/{queue}", headers={"Host": host}).status_code == 200, host
    own = {"Host": f"localhost:{port}", "Origin": f"http://localhost:{port}", "Content-Type": "application/json"}
    assert c.post(f"/api/queues/{queue}/purge", headers=own).json() == {"queue": queue, "purged": 1}
    assert depth(c, queue) == 0


def test_cross_origin_post_is_refused(victim):
    c, queue, port = victim
    for origin in ("http://evil.example", f"http://127.0.0.1:{port + 1}", "null"):
        r = c.post(f"/api/queues/{queue}/purge", headers={"Origin": origin, "Content-Type": "application/json"})
        assert r.status_code == 403 and "cross-origin" in r.json()["error"], origin
    assert depth(c, queue) == 1


def test_form_encoded_post_is_refused(victim, broker):
    c, queue, port = victim
    r = c.post(f"/api/queues/{queue}/purge", data={"confirm": "yes"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]
    r = c.post(f"/api/queues/{queue}/purge", content=b"", headers={
        "Content-Type": "application/x-www-form-urlencoded", "Origin": f"http://127.0.0.1:{port}"})
    assert r.status_code == 415
    r = c.post("/api/queues", content=b'{"name": "via-text-plain"}', headers={"Content-Type": "text/plain"})
    assert r.status_code == 415
    assert depth(c, queue) == 1
    assert c.get("/api/queues/via-text-plain").status_code == 404
    broker.wait_for_log(r"management API: refused POST /api/queues/.* from 127\.0\.0\.1")
    # The CLI's way (no Origin, no body) and the console's (same origin, JSON) still work.
    assert c.post(f"/api/queues/{queue}/purge").json()["purged"] == 1


# ---------------------------------------------------------------------- throttling

THROTTLE_CONFIG = """
[limits]
auth_free_failures = 2
auth_base_delay = 0.3
auth_max_delay = 1.2

[users.root]
password = "root-pw"
groups = ["ops"]

[[acl]]
group = "ops"
permissions = ["all"]
"""


def timed(client: httpx.Client, auth: tuple[str, str]) -> tuple[int, float]:
    t0 = time.monotonic()
    r = client.get("/api/overview", auth=auth)
    return r.status_code, time.monotonic() - t0


def test_wrong_passwords_slow_their_address_and_no_other(broker_factory):
    b = broker_factory(THROTTLE_CONFIG)
    url = f"http://127.0.0.1:{b.ports['management']}"
    guesser = httpx.Client(base_url=url, timeout=30)
    # Another source address on this machine: Linux routes all of 127.0.0.0/8 to lo.
    operator = httpx.Client(base_url=url, timeout=30, transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    try:
        waits = []
        for _ in range(7):
            status, elapsed = timed(guesser, ("root", "guess"))
            assert status == 401
            waits.append(elapsed)
        # free failures 2: attempts 4 to 7 wait 0.3, 0.6, 1.2, 1.2 s (the ceiling)
        for attempt, least in ((3, 0.3), (4, 0.6), (5, 1.2), (6, 1.2)):
            assert waits[attempt] >= least, (attempt, waits)
        assert waits[6] < 2.4, "the ceiling holds"

        # Meanwhile the right password from another address is answered at once …
        status, elapsed = timed(operator, ("root", "root-pw"))
        assert status == 200 and elapsed < 1.0, elapsed
        # … while from the guessing address it waits its turn too, then clears it.
        status, elapsed = timed(guesser, ("root", "root-pw"))
        assert status == 200 and elapsed >= 1.2, elapsed
        status, elapsed = timed(guesser, ("root", "guess"))
        assert status == 401 and elapsed < 1.0, elapsed

        text = operator.get("/metrics", auth=("root", "root-pw")).text
        assert re.search(r'^amqpbroker_auth_failures_total\{listener="management"\} 8\.0$', text, re.M)
        assert re.search(r'^amqpbroker_auth_throttled_addresses\{listener="all"\} 0\.0$', text, re.M)
        lines = re.findall(r"management API: \d+ failed authentications from [\d.]+.*", b.log_text())
        assert lines == ["management API: 3 failed authentications from 127.0.0.1: its next attempts wait "
                         "(up to 1.2 s)"], "one line as the address starts being slowed"
    finally:
        guesser.close()
        operator.close()


def test_throttled_addresses_gauge(broker_factory):
    b = broker_factory(THROTTLE_CONFIG)
    url = f"http://127.0.0.1:{b.ports['management']}"
    with httpx.Client(base_url=url, timeout=30) as guesser, \
            httpx.Client(base_url=url, timeout=30,
                         transport=httpx.HTTPTransport(local_address="127.0.0.2")) as operator:
        for _ in range(3):
            assert guesser.get("/api/overview", auth=("nobody", "x")).status_code == 401
        text = operator.get("/metrics", auth=("root", "root-pw")).text
    assert re.search(r'^amqpbroker_auth_throttled_addresses\{listener="all"\} 1\.0$', text, re.M)
    assert re.search(r'^amqpbroker_auth_failures_total\{listener="management"\} 3\.0$', text, re.M)
