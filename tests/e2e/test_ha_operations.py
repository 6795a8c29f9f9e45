"""Operating a pair (docs/ha.md): the backup's read-only management API and metrics,
the container health check that knows a backup is healthy with its AMQP listener
closed, incremental catch-up of a backup that comes back, TLS on the replication
link.  Real ZooKeeper (Debian's), real broker processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
import uuid

import pytest

from tests.e2e.crash_support import assess, drain, send_durable
from tests.e2e.ha_harness import HaBroker, free_port, pair_config
from tests.e2e.helpers_conn import make_self_signed

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture
def make_pair(zookeeper, tmp_path):
    made: list[HaBroker] = []

    def make(**extra) -> tuple[HaBroker, HaBroker]:
        cluster = uuid.uuid4().hex[:8]
        pair = []
        for name, role in (("a", "primary"), ("b", "backup")):
            port = free_port()
            pair.append(HaBroker(name, tmp_path / name, pair_config(zookeeper, cluster, role, port, **extra), port))
        made.extend(pair)
        return pair[0], pair[1]

    yield make
    for b in made:
        b.kill()


def get(broker: HaBroker, path: str) -> tuple[int, bytes]:
    url = f"http://127.0.0.1:{broker.ports['management']}{path}"
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in the metrics")


def start_pair(a: HaBroker, b: HaBroker) -> None:
    a.start().wait_live()
    b.start().wait_for_log("in sync with the live broker", 60)


def test_the_backup_answers_a_read_only_management_api(make_pair):
    a, b = make_pair()
    start_pair(a, b)
    assert not b.is_listening()
    status, body = get(b, "/api/ha")
    assert status == 200
    view = json.loads(body)
    assert view["status"] == "backup" and view["accepting"] is False
    assert view["backup"]["in_sync"] is True and view["backup"]["store_complete"] is True
    assert view["backup"]["lag_batches"] is not None and view["zookeeper"]["session"] == "CONNECTED"
    status, text = get(b, "/metrics")
    assert status == 200
    text = text.decode()
    assert metric(text, "amqpbroker_ha_live") == 0 and metric(text, "amqpbroker_ha_backup_in_sync") == 1
    assert metric(text, "amqpbroker_ha_zookeeper_connected") == 1
    assert "amqpbroker_ha_replication_lag_bytes" in text
    assert get(b, "/api/health")[0] == 200
    status, body = get(b, "/api/queues")     # nothing else: it has no broker model
    assert status == 503 and b"backup" in body
    # The live broker's view of the same pair.
    live = json.loads(get(a, "/api/ha")[1])
    assert live["status"] == "live" and live["accepting"] is True
    rep = live["replication"]
    assert rep["in_sync"] is True and rep["peer_state"] == "in-sync" and rep["lag_bytes"] == 0
    text = get(a, "/metrics")[1].decode()
    assert metric(text, "amqpbroker_ha_accepting") == 1 and metric(text, "amqpbroker_ha_backup_in_sync") == 1


def health(broker: HaBroker | None, amqp_port: int, management_port: int) -> int:
    env = dict(os.environ, AMQPBROKER_PORT=str(amqp_port), AMQPBROKER_MANAGEMENT__PORT=str(management_port))
    return subprocess.run([sys.executable, "-m", "amqpbroker.ha.health"], env=env, capture_output=True,
                          timeout=30).returncode


def test_the_health_check_knows_a_backup_is_healthy_with_its_listener_closed(make_pair):
    a, b = make_pair()
    start_pair(a, b)
    assert health(a, a.amqp_port, a.ports["management"]) == 0          # live: AMQP answers
    assert health(b, b.amqp_port, b.ports["management"]) == 0          # backup: listener closed, API says backup
    assert health(None, free_port(), free_port()) == 1                 # nothing there at all
    b.kill()
    assert health(None, b.amqp_port, b.ports["management"]) == 1


def test_a_backup_that_comes_back_gets_only_the_batches_it_lacks(make_pair):
    a, b = make_pair()
    start_pair(a, b)
    before = send_durable(a, "incremental", 200, "before")
    b.kill()
    alone = send_durable(a, "incremental", 300, "alone")      # after backup_timeout: alone
    a.wait_for_log("going on alone", 30)
    b.start().wait_for_log("in sync with the live broker", 60)
    assert b.wait_for_log("the live broker sends only what this store lacks", 1)
    assert not any("sends a copy of its store" in line for line in b.lines)
    view = json.loads(get(b, "/api/ha")[1])
    assert view["backup"]["catch_ups"] == {"full": 0, "batches": 1}
    a.kill()
    b.wait_live(30)
    got = drain(b.url, "incremental")
    for traffic in (before, alone):
        assert assess(traffic, got).lost == []


def test_without_a_window_a_backup_that_comes_back_gets_a_copy(make_pair):
    a, b = make_pair(catch_up_window=0)
    start_pair(a, b)
    b.kill()
    alone = send_durable(a, "copied", 100, "copied")
    b.start().wait_for_log("in sync with the live broker", 60)
    assert b.wait_for_log("the live broker sends a copy of its store", 1)
    a.kill()
    b.wait_live(30)
    assert assess(alone, drain(b.url, "copied")).lost == []


def test_the_replication_link_runs_over_tls(make_pair, tmp_path):
    cert, key = make_self_signed(tmp_path)
    a, b = make_pair(replication_tls=True, replication_cert_file=str(cert), replication_key_file=str(key))
    start_pair(a, b)
    assert a.wait_for_log(r"ha: replication listening on \S+ \(TLS\)", 1)
    assert json.loads(get(a, "/api/ha")[1])["replication"]["tls"] is True
    traffic = send_durable(a, "tls", 100, "tls")
    a.kill()
    b.wait_live(30)
    assert assess(traffic, drain(b.url, "tls")).lost == []


def test_a_backup_without_the_right_certificate_does_not_replicate(make_pair, tmp_path):
    cert, key = make_self_signed(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    other_cert, _ = make_self_signed(other)
    a, b = make_pair(replication_tls=True, replication_cert_file=str(cert), replication_key_file=str(key))
    b.config = b.config.replace(f'replication_cert_file = "{cert}"', f'replication_cert_file = "{other_cert}"')
    b.config = b.config.replace(f'replication_key_file = "{key}"',
                                f'replication_key_file = "{other / "key.pem"}"')
    a.start().wait_live()
    b.start()
    line = b.wait_for_log(r"replication from \S+ ended: .*(CERTIFICATE_VERIFY_FAILED|certificate verify failed)", 30)
    assert line
    assert not any("in sync with the live broker" in ln for ln in b.lines)


def test_two_brokers_on_one_machine_with_one_management_port(make_pair):
    """The backup's management listener cannot have the port: it says why and goes on
    replicating (and takes over when the live broker dies)."""
    a, b = make_pair()
    port = free_port()
    a.extra_env = b.extra_env = {"AMQPBROKER_MANAGEMENT__PORT": str(port)}
    a.start().wait_live()
    b.start()
    assert b.wait_for_log(r"management listener on .*need their own \[management\] port", 30)
    b.wait_for_log("in sync with the live broker", 60)
    traffic = send_durable(a, "one-port", 20, "one-port")
    a.kill()
    b.wait_live(30)
    assert b.ports["management"] == port
    assert assess(traffic, drain(b.url, "one-port")).lost == []
