"""Dead-letter origin annotations, browsing, replay and move against the real broker
process, with python-qpid-proton clients; and a SIGKILL in the middle of a large
replay, after which every message is found exactly once, on one side or the other."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from proton import Message, Timeout, symbol

from tests.client import connect, receive_all
from tests.e2e.crash_support import Traffic, _UntilSettled, drain
from tests.e2e.helpers_delivery import barrier
from tests.e2e.test_management import admin_cli, api, publish, uniq

pytestmark = pytest.mark.e2e

DLQ_CONFIG = '[policy]\ndead_letter_address = "DLQ"\n'
PAGED = "[store]\nqueue_memory_budget = 262144\n"   # most of a deep queue only in the store


def reject_all(url: str, address: str, n: int) -> None:
    conn = connect(url)
    try:
        rcv = conn.create_receiver(address, credit=n)
        for _ in range(n):
            rcv.receive(timeout=10)
            rcv.reject()
    finally:
        conn.close()


def test_rejected_message_is_annotated_browsed_and_replayed_by_the_cli(broker_factory):
    b = broker_factory(DLQ_CONFIG)
    q = uniq("orders")
    publish(b.url, q, ["a", "b", "c"], properties={"kind": "order"}, subject="new", durable=True)
    reject_all(b.url, q, 3)
    b.wait_for_log(r"dead-lettered to DLQ \(rejected\)")

    shown = admin_cli(b, "--json", "messages", "DLQ")
    assert shown.returncode == 0, shown.stderr
    page = json.loads(shown.stdout)
    assert [m["body"]["preview"] for m in page["messages"]] == ["a", "b", "c"]
    ann = page["messages"][0]["message_annotations"]
    assert ann["x-opt-amqpbroker-dlq-queue"] == q and ann["x-opt-amqpbroker-dlq-address"] == q
    assert ann["x-opt-amqpbroker-dlq-reason"] == "rejected" and ann["x-opt-amqpbroker-dlq-time"] > 0
    table = admin_cli(b, "messages", "DLQ")
    assert table.returncode == 0 and f"{q} (rejected)" in table.stdout

    done = admin_cli(b, "dlq", "replay", "DLQ", "--filter", "kind = 'order'", "--limit", "2")
    assert done.returncode == 0, done.stderr
    assert f"replay: 2 message(s) moved from 'DLQ' (2 to {q})" in done.stdout
    b.wait_for_log(rf"admin: replay of queue 'DLQ' by \(loopback\): 2 moved \({q}: 2\)")
    back = receive_all(b.url, q)
    assert [m.body for m in back] == ["a", "b"]
    assert all(m.properties == {"kind": "order"} and m.subject == "new" for m in back)
    assert all(not any(str(k).startswith("x-opt-amqpbroker-dlq") for k in (m.annotations or {})) for m in back)
    assert all(m.delivery_count == 0 for m in back)
    assert [m.body for m in receive_all(b.url, "DLQ")] == ["c"]


def test_subscription_dead_letters_replay_to_the_topic(broker_factory):
    b = broker_factory(DLQ_CONFIG + "max_delivery_attempts = 1\n")
    topic = uniq("prices")
    conn = connect(b.url, container_id=uniq("sub"))
    sub = conn.create_receiver(f"amq.topic/{topic}", credit=10)
    publish(b.url, f"amq.topic/{topic}", ["p1"], durable=True)
    sub.receive(timeout=10)
    sub.reject()
    barrier(conn)
    b.wait_for_log(r"dead-lettered to DLQ")
    with api(b) as c:
        ann = c.get("/api/queues/DLQ/messages").json()["messages"][0]["message_annotations"]
        assert ann["x-opt-amqpbroker-dlq-queue"].startswith("qpidsub_/")
        assert ann["x-opt-amqpbroker-dlq-address"] == f"amq.topic/{topic}"
        r = c.post("/api/queues/DLQ/replay", json={})
        assert r.status_code == 200 and r.json()["moved"] == 1
    assert sub.receive(timeout=10).body == "p1"
    sub.accept()
    conn.close()


def test_move_cli_and_bad_input(broker_factory):
    b = broker_factory()
    src, dst = uniq("src"), uniq("dst")
    publish(b.url, src, ["x", "y"], durable=True)
    publish(b.url, dst, [], durable=True)
    out = admin_cli(b, "move", src, "--to", dst)
    assert out.returncode == 0 and "2 message(s) moved" in out.stdout, out.stderr
    assert [m.body for m in receive_all(b.url, dst)] == ["x", "y"]
    bad = admin_cli(b, "move", src, "--to", dst, "--filter", "a >>> 1")
    assert bad.returncode == 1 and "bad selector" in bad.stderr
    missing = admin_cli(b, "dlq", "replay", uniq("none"))
    assert missing.returncode == 1 and "no queue" in missing.stderr and "HTTP 404" in missing.stderr
    assert admin_cli(b, "move", src, "--to", dst, "--limit", "-1").returncode == 2
    b.wait_for_log(r"management API: POST /api/queues/.*/replay refused \(404\)")


# ---------------------------------------------------------------------- crash in the middle


class _AnnotatedSender(_UntilSettled):
    """Durable messages straight into the dead-letter queue, as dead-lettering
    leaves them (origin annotations), at full speed."""

    origin = "orders"

    def _message(self, mid: str, seq: int) -> Message:
        ann = {symbol("x-opt-amqpbroker-dlq-queue"): self.origin,
               symbol("x-opt-amqpbroker-dlq-address"): self.origin,
               symbol("x-opt-amqpbroker-dlq-reason"): "rejected"}
        return Message(id=mid, durable=True, body=self.body, annotations=ann)


def fill_dlq(b, origin: str, n: int) -> Traffic:
    from proton.reactor import Container

    t = Traffic("dl")
    handler = _AnnotatedSender(b.url, "DLQ", t, 10**9, threading.Event(), consume=False, window=500,
                               body=b"D" * 512, max_messages=n, deadline=120.0, prefetch=0)
    handler.origin = origin
    Container(handler).run()
    assert not t.errors and len(t.accepted) == n
    return t


def test_sigkill_in_the_middle_of_a_large_replay_loses_and_duplicates_nothing(broker_factory):
    b = broker_factory(DLQ_CONFIG + PAGED)
    origin = uniq("orders")
    n = 20_000
    traffic = fill_dlq(b, origin, n)
    with api(b) as c:
        c.post("/api/queues", json={"name": origin})
    mgmt = f"http://127.0.0.1:{b.ports['management']}"

    def replay() -> None:
        try:
            httpx.post(f"{mgmt}/api/queues/DLQ/replay", json={}, timeout=120)
        except httpx.HTTPError:
            pass   # the broker is killed under it

    thread = threading.Thread(target=replay, daemon=True)
    thread.start()
    moved = 0
    deadline = time.monotonic() + 60
    with httpx.Client(base_url=mgmt, timeout=10) as c:
        while moved < n // 4 and time.monotonic() < deadline:
            moved = c.get(f"/api/queues/{origin}").json()["depth"]
            time.sleep(0.01)
    b.kill()
    thread.join(10)
    assert n // 4 <= moved < n, f"the kill came at {moved} of {n}: not in the middle"

    b.start()
    left = drain(b.url, "DLQ")
    back = drain(b.url, origin)
    ids = [mid for mid, _ in left] + [mid for mid, _ in back]
    assert len(ids) == len(set(ids)), f"{len(ids) - len(set(ids))} message(s) on both sides"
    assert set(ids) == traffic.accepted, f"{len(traffic.accepted - set(ids))} message(s) lost"
    assert back and left, (len(back), len(left))
