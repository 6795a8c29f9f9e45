"""Dead-letter origin annotations, browsing, replay and move against the real broker
process, with python-qpid-proton clients; and a SIGKILL in the middle of a large
replay, after which every message is found exactly once, on one side or the other."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from proton import Delivery, Message, symbol

from tests.client import SourceOptions, connect, receive_all
from tests.e2e.canary import Canary
from tests.e2e.crash_support import Traffic, _UntilSettled, drain
from tests.e2e.helpers_delivery import barrier, connection, fetch, receiver, settle
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
    b.wait_for_log(rf"admin: replay of queue 'DLQ' by \(loopback\) \(job replay-\d+\): 2 moved \({q}: 2\)")
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
        r = c.post("/api/queues/DLQ/replay?wait=30", json={})
        assert r.status_code == 200 and r.json()["report"]["moved"] == 1
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
    long = "a = '" + "x" * 4096 + "'"     # the AMQP side's limit (limits.max_selector_length) holds here too
    for args in (["messages", src, "--selector", long], ["move", src, "--to", dst, "--filter", long]):
        refused = admin_cli(b, *args)
        assert refused.returncode == 1 and "longer than 4096 characters" in refused.stderr, refused.stderr
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


# ---------------------------------------------------------------------- defaults and provenance


def test_a_fresh_broker_dead_letters_to_DLQ_and_replays_it(broker_factory):
    """Safe defaults (no configuration at all): a rejected message goes to the queue
    DLQ, which exists from the start, so `admin dlq replay DLQ` works before and after."""
    b = broker_factory()
    before = admin_cli(b, "dlq", "replay", "DLQ")
    assert before.returncode == 0 and "replay: 0 message(s) moved from 'DLQ'" in before.stdout, before.stderr
    q = uniq("orders")
    publish(b.url, q, ["a"], durable=True)
    reject_all(b.url, q, 1)
    b.wait_for_log(rf"queue {q}: message seq=\d+ dead-lettered to DLQ \(rejected\)")
    done = admin_cli(b, "dlq", "replay", "DLQ")
    assert done.returncode == 0 and f"replay: 1 message(s) moved from 'DLQ' (1 to {q})" in done.stdout, done.stderr
    assert [m.body for m in receive_all(b.url, q)] == ["a"]


def test_ten_failed_deliveries_dead_letter_a_message_by_default(broker_factory):
    b = broker_factory()
    q = uniq("poison")
    publish(b.url, q, ["p"], durable=True)
    with connection(b) as conn:
        rcv = receiver(conn, q, credit=None)
        for attempt in range(10):
            rcv.link.flow(1)
            msg, dlv = fetch(conn, rcv)
            assert msg.delivery_count == attempt
            settle(dlv, Delivery.MODIFIED, failed=True)      # one failed attempt
            barrier(conn)
    b.wait_for_log(rf"queue {q}: message seq=\d+ dead-lettered to DLQ \(delivery attempts reached 10\)")
    (dead,) = receive_all(b.url, "DLQ")
    assert dead.body == "p" and dead.properties["_AMQPBROKER_DLQ_REASON"] == "max-delivery-attempts"


def test_dead_letter_provenance_is_readable_as_application_properties(broker_factory):
    """A plain JMS application reads properties, not annotations: getObjectProperty
    ("_AMQPBROKER_DLQ_QUEUE") and selectors see the provenance; a replay takes it out
    again and gives the producer's properties back as they were."""
    b = broker_factory()
    q = uniq("orders")
    publish(b.url, q, ["a", "b"], properties={"kind": "order"}, durable=True)
    reject_all(b.url, q, 2)
    b.wait_for_log(rf"queue {q}: message seq=\d+ dead-lettered to DLQ")
    conn = connect(b.url)
    try:
        rcv = conn.create_receiver("DLQ", credit=10,
                                   options=SourceOptions(selector=f"_AMQPBROKER_DLQ_QUEUE = '{q}' AND "
                                                                  "_AMQPBROKER_DLQ_REASON = 'rejected'"))
        msg = rcv.receive(timeout=10)
        props = msg.properties
        assert props["kind"] == "order" and props["_AMQPBROKER_DLQ_QUEUE"] == q
        assert props["_AMQPBROKER_DLQ_ADDRESS"] == q and props["_AMQPBROKER_DLQ_REASON"] == "rejected"
        assert isinstance(props["_AMQPBROKER_DLQ_TIME"], int) and props["_AMQPBROKER_DLQ_TIME"] > 0
        rcv.release()
    finally:
        conn.close()
    with api(b) as c:
        assert c.post("/api/queues/DLQ/replay?wait=30", json={}).json()["report"]["moved"] == 2
    back = receive_all(b.url, q)
    assert [m.properties for m in back] == [{"kind": "order"}, {"kind": "order"}]
    history = back[0].annotations[symbol("x-opt-amqpbroker-history")]
    assert [(r["queue"], r["reason"], r["count"]) for r in history] == [(q, "rejected", 1), ("DLQ", "replayed", 1)]


# ---------------------------------------------------------------------- no self-feeding loops

LOOPS = """
[[exchanges]]
name = "fan"
type = "fanout"

[[queues]]
name = "src"

[[queues]]
name = "other"

[[bindings]]
exchange = "fan"
queue = "src"

[[bindings]]
exchange = "fan"
queue = "other"
"""


def test_a_move_into_an_exchange_bound_back_to_its_source_ends(broker_factory):
    """Finding 1: 20 messages became 640,000 copies, and the HTTP client's time-out
    did not stop it.  Now the move is a job that ends: every message once in `other`,
    none back in `src`."""
    b = broker_factory(LOOPS)
    publish(b.url, "src", [f"m{i}" for i in range(20)], durable=True)
    with api(b) as c:
        r = c.post("/api/queues/src/move?wait=30", json={"to": "fan"})
        assert r.status_code == 200 and r.json()["state"] == "done", r.text
        assert r.json()["report"]["moved"] == 20
        assert c.get("/api/queues/src").json()["depth"] == 0
        assert c.get("/api/queues/other").json()["depth"] == 20


DROP_HEAD_LOOP = """
[policy]
dead_letter_address = "dlx"

[[exchanges]]
name = "dlx"
type = "fanout"

[[queues]]
name = "DLQ"
max_depth = 3
overflow = "drop-head"

[[bindings]]
exchange = "dlx"
queue = "DLQ"
"""


def test_a_drop_head_dlq_behind_a_fanout_dead_letter_address_keeps_the_broker_going(broker_factory,
                                                                                     control_broker):
    """Finding 3: one message froze the event loop for good (1.2 million log lines).
    What dies in a queue the dead-letter address routes to is dropped, counted, and
    the lines about it are rate-limited."""
    b = broker_factory(DROP_HEAD_LOOP)
    q = uniq("orders")
    publish(b.url, q, [f"m{i}" for i in range(10)], durable=True)
    with Canary(control_broker) as control, Canary(b) as canary:
        reject_all(b.url, q, 10)
        with api(b) as c:
            deadline = time.monotonic() + 30
            while c.get("/api/queues/DLQ").json()["enqueued_total"] < 10 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c.get("/api/queues/DLQ").json()["depth"] == 3
    canary.assert_like(control)           # (a frozen loop fails the canary's 30 s receive)
    assert [m.body for m in receive_all(b.url, "DLQ")] == ["m7", "m8", "m9"]
    assert len([line for line in b.lines if "dead-letter" in line]) < 30, "the log is flooded"


REPLAY_INTO_DROP_HEAD = """
[policy]
dead_letter_address = "DLQ"

[[queues]]
name = "q"
max_depth = 5
overflow = "drop-head"
"""


def test_a_replay_into_a_full_drop_head_queue_that_dead_letters_back_ends(broker_factory):
    """Finding 2: 81,000 dead-letter enqueues in 14 s, the request never answered.
    The replay takes only what DLQ held when it started."""
    b = broker_factory(REPLAY_INTO_DROP_HEAD)
    publish(b.url, "q", [f"m{i}" for i in range(5)], durable=True)
    reject_all(b.url, "q", 5)
    publish(b.url, "q", [f"f{i}" for i in range(5)], durable=True)   # q is full again
    with api(b) as c:
        r = c.post("/api/queues/DLQ/replay?wait=30", json={})
        assert r.status_code == 200 and r.json()["state"] == "done", r.text
        assert r.json()["report"]["moved"] == 5
        depths = [c.get(f"/api/queues/{n}").json()["depth"] for n in ("q", "DLQ")]
    assert depths == [5, 5], depths       # each replayed message pushed one out: nothing more
