"""Hot backup of a running broker's store (POST /api/backup, `amqpbroker admin
backup`) under durable load, restored with `amqpbroker store restore` into a new
data dir, where a new broker finds every message accepted before the backup began."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
from proton.reactor import Container

from tests.e2e.crash_support import Traffic, _UntilSettled, drain
from tests.e2e.test_management import admin_cli, api, uniq

pytestmark = pytest.mark.e2e


def accepted_now(t: Traffic) -> set[str]:
    while True:   # the producer thread adds meanwhile
        try:
            return set(t.accepted)
        except RuntimeError:
            continue


def test_backup_under_load_restores_everything_accepted_before_it(broker_factory, tmp_path):
    b = broker_factory()
    q = uniq("backed")
    t = Traffic("bk")
    started = threading.Event()
    handler = _UntilSettled(b.url, q, t, 2000, started, consume=False, window=200, body=b"B" * 512,
                            max_messages=30_000, deadline=120.0, prefetch=0)
    producer = threading.Thread(target=Container(handler).run, daemon=True)
    producer.start()
    assert started.wait(60), t.errors
    before = accepted_now(t)
    dest = tmp_path / "backup-1"
    out = admin_cli(b, "backup", str(dest))
    assert out.returncode == 0, out.stderr
    assert f"backed up the store to {dest}" in out.stdout and "whole" in out.stdout
    during = len(accepted_now(t)) - len(before)
    b.wait_for_log(r"admin: backup of the store to .* done")
    producer.join(120)
    assert not t.errors, t.errors
    assert len(before) >= 2000 and during > 0, "the backup did not run under load"

    restored = tmp_path / "restored"
    r = subprocess.run([sys.executable, "-m", "amqpbroker.cli", "store", "restore", str(dest),
                        "--data-dir", str(restored)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    b2 = broker_factory(name="restored")
    assert b2.data_dir == restored
    got = [mid for mid, _ in drain(b2.url, q)]
    assert len(got) == len(set(got))
    missing = before - set(got)
    assert not missing, f"{len(missing)} message(s) accepted before the backup are not in it"
    assert set(got) <= set(t.sent)


def test_backup_refusals(broker_factory, tmp_path):
    b = broker_factory()
    with api(b) as c:
        r = c.post("/api/backup", json={"dest": "relative/dir"})
        assert r.status_code == 400 and "absolute" in r.json()["error"]
        (tmp_path / "full").mkdir()
        (tmp_path / "full" / "x").write_text("x")
        r = c.post("/api/backup", json={"dest": str(tmp_path / "full")})
        assert r.status_code == 409 and "not an empty directory" in r.json()["error"]
        r = c.post("/api/backup", json={})
        assert r.status_code == 422 and "dest" in r.json()["error"]
    b.wait_for_log(r"management API: POST /api/backup refused \(409\)")


@pytest.mark.parametrize("dest, why", [
    ("/tmp/a\x00b", "NUL"),
    ("/tmp/" + "n" * 300, "longer than"),
    ("/tmp" + "/d" * 2100, "longer than"),
    ("relative/dir", "absolute path"),
])
def test_a_bad_backup_destination_is_a_clean_4xx(broker_factory, dest, why):
    """A NUL or an over-long name used to answer 500 with a traceback in the log."""
    b = broker_factory()
    with api(b) as http:
        r = http.post("/api/backup", json={"dest": dest})
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert set(r.json()) == {"error"} and why in r.json()["error"]
    assert "Traceback" not in b.log_text()
    with api(b) as http:       # and the broker still answers
        assert http.get("/api/overview").status_code == 200


def test_restore_of_a_store_onto_itself_keeps_it(broker_factory):
    """`store restore D --data-dir D --force` used to move the store aside and then
    fail to copy it: no store left."""
    from tests.e2e.crash_support import send_durable
    b = broker_factory()
    q = uniq("kept")
    sent = send_durable(b, q, 20, "k")
    b.stop()
    store = b.data_dir / "store"
    size = (store / "data.mdb").stat().st_size
    for src in (b.data_dir, store):
        r = subprocess.run([sys.executable, "-m", "amqpbroker.cli", "store", "restore", str(src),
                            "--data-dir", str(b.data_dir), "--force"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "is the store it would replace" in r.stderr
        assert (store / "data.mdb").stat().st_size == size
    b.start()
    got = {mid for mid, _ in drain(b.url, q)}
    assert got == sent.accepted and len(got) == 20
