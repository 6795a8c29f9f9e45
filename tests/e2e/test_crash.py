"""Crash safety of durable messaging: the broker process is SIGKILLed while a producer
sends durable messages as fast as it can (unsettled, a window of 1000), optionally
with a consumer taking them at the same time; after a restart every message the
producer saw Accepted is there, exactly once, and anything seen before comes back
marked redelivered.  Also: a full store rejects durable sends and keeps serving, and
a store of an unknown format version stops the broker at start-up.

The machinery (clients, drain, assessment) is in crash_support; bench/soak.py runs
the same logic for many cycles.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import uuid

import lmdb
import pytest
from proton import Delivery, Message
from proton.reactor import Container

from amqpbroker.store.writer import recover
from tests.broker_process import BrokerProcess
from tests.client import connect
from tests.e2e.crash_support import Traffic, _Clients, assess, drain, produce_until_crash

pytestmark = pytest.mark.e2e

SEED = int(os.environ.get("CRASH_SEED", "0")) or random.randrange(1, 10**6)


def uniq(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def test_sigkill_mid_stream_loses_no_accepted_message(broker_factory):
    """Three crash/restart cycles on the same store and queue; nothing was delivered
    before a crash, so nothing may come back marked redelivered."""
    rng = random.Random(SEED)
    b = broker_factory()
    q = uniq("crash")
    drained_before: dict[str, int] = {}
    for cycle in range(3):
        kill_after = rng.randint(500, 3000)
        traffic = produce_until_crash(b, q, f"c{cycle}", kill_after, kill_delay=rng.uniform(0, 0.05))
        assert traffic.killed and not traffic.errors, traffic.errors
        assert len(traffic.accepted) >= kill_after
        assert not traffic.rejected
        b.start()
        got = drain(b.url, q)
        a = assess(traffic, got, drained_before)
        info = (f"seed {SEED} cycle {cycle}: sent {len(traffic.sent)}, accepted {a.accepted}, "
                f"recovered {a.recovered}")
        assert a.ok, f"{info}: {a.problems()}"
        assert a.recovered >= a.accepted, info
        assert a.redelivered == 0, f"{info}: nothing was delivered before the crash"
        assert not set(drained_before) & {mid for mid, _ in got}, \
            f"{info}: messages drained (and acknowledged) in an earlier cycle came back"
        drained_before.update(got)


def test_sigkill_while_consuming_loses_nothing_not_yet_consumed(broker_factory):
    """A consumer accepts while the producer sends; after the crash every accepted
    message not yet consumed is there, and a consumed one may only come back marked
    redelivered (its acknowledgement was not committed yet)."""
    rng = random.Random(SEED + 1)
    b = broker_factory()
    q = uniq("crash-consume")
    drained_before: dict[str, int] = {}
    for cycle in range(3):
        kill_after = rng.randint(1000, 4000)
        traffic = produce_until_crash(b, q, f"k{cycle}", kill_after, consume=True,
                                      kill_delay=rng.uniform(0, 0.05))
        assert traffic.killed and not traffic.errors, traffic.errors
        assert traffic.consumed, "the consumer took messages before the crash"
        assert not traffic.consumed_twice
        b.start()
        got = drain(b.url, q)
        a = assess(traffic, got, drained_before)
        info = (f"seed {SEED + 1} cycle {cycle}: sent {len(traffic.sent)}, accepted {a.accepted}, "
                f"consumed before the crash {a.taken_before_crash}, recovered {a.recovered} "
                f"(of which consumed before: {a.came_back_after_taken})")
        assert a.ok, f"{info}: {a.problems()}"
        drained_before.update(got)


# ---------------------------------------------------------------------- full store


FULL_CONFIG = """
[store]
initial_map_size = 1048576
max_map_size = 2097152
queue_memory_budget = 0
"""


def send_one_by_one(url: str, address: str, body: bytes, prefix: str, limit: int):
    """Send big durable messages, each waiting for its outcome, until one is not
    Accepted or `limit` were: (accepted ids, None or (state, condition name))."""
    conn = connect(url)
    accepted: list[str] = []
    try:
        sender = conn.create_sender(address)
        for i in range(limit):
            mid = f"{prefix}-{i}"
            dlv = sender.send(Message(id=mid, body=body, durable=True), timeout=10, error_states=[])
            if dlv.remote_state != Delivery.ACCEPTED:
                cond = dlv.remote.condition
                return accepted, (dlv.remote_state, cond.name if cond else None)
            accepted.append(mid)
    finally:
        conn.close()
    return accepted, None


def test_full_store_rejects_durable_sends_and_keeps_serving(broker_factory):
    b = broker_factory(FULL_CONFIG)
    q = uniq("full")
    body = b"F" * (100 << 10)
    accepted, refusal = send_one_by_one(b.url, q, body, "big", 200)
    assert refusal == (Delivery.REJECTED, "amqp:resource-limit-exceeded"), refusal
    assert len(accepted) >= 5

    # Non-durable messages still flow, and consumers are served.
    conn = connect(b.url)
    transient = conn.create_sender(q + "-transient")
    transient.send(Message(body="t", durable=False), timeout=10)
    conn.close()
    got = drain(b.url, q, quiet=1.0)
    assert [mid for mid, _ in got] == accepted, \
        "every accepted message is there, once and in order, and no rejected one"

    # Drained: the store takes durable messages again.
    again, refusal = send_one_by_one(b.url, q, body, "again", 3)
    assert refusal is None and len(again) == 3, refusal

    # Nothing accepted is lost over a restart.
    b.stop()
    b.start()
    assert [mid for mid, _ in drain(b.url, q, quiet=1.0)] == again


# ---------------------------------------------------------------------- writer process


def writer_pid(broker) -> int:
    """The broker's store writer process (store/writer.py), from /proc."""
    pid = broker.proc.pid
    children = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            children += [int(c) for c in f.read().split()]
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"amqpbroker.store.writer" in f.read():
                return child
    raise AssertionError(f"no store writer among the children {children} of broker {pid}")


def gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"),
                    reason="finds the broker's writer process through /proc/<pid>/task/*/children (Linux)")
def test_store_writer_process_dies_with_a_killed_broker(broker_factory):
    b = broker_factory()
    child = writer_pid(b)
    b.kill()
    assert gone(child), "the writer outlived its broker (it would hold the store's write lock)"
    b.start()
    assert writer_pid(b) != child


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"),
                    reason="finds the broker's writer process through /proc/<pid>/task/*/children (Linux)")
def test_a_lost_store_writer_is_replaced_and_nothing_accepted_is_lost(broker_factory):
    b = broker_factory()
    q = uniq("writer-lost")
    before, refusal = send_one_by_one(b.url, q, b"before", "before", 3)
    assert refusal is None and len(before) == 3
    first = writer_pid(b)
    os.kill(first, signal.SIGKILL)
    b.wait_for_log("store writer process lost")
    after, refusal = send_one_by_one(b.url, q, b"after", "after", 3)
    assert refusal is None and len(after) == 3, refusal
    assert writer_pid(b) != first
    b.kill()
    b.start()
    assert [mid for mid, _ in drain(b.url, q, quiet=1.0)] == before + after


def test_unsettled_burst_into_full_store_rejects_without_phantoms(broker_factory):
    """An unsettled burst (window 200) of big durable messages into a tiny store: the
    ones the broker rejects are never delivered; the accepted ones all are."""
    b = broker_factory(FULL_CONFIG)
    q = uniq("burst")
    total = 120
    t = Traffic("burst")
    handler = _StopWhenSettled(b.url, q, t, 10**9, threading.Event(), consume=False, window=200,
                               body=b"P" * (50 << 10), max_messages=total, deadline=30.0,
                               prefetch=0)
    Container(handler).run()
    assert not t.errors, t.errors
    assert len(t.accepted) + len(t.rejected) == total
    assert t.rejected, "a 2 MiB store cannot take 6 MiB"
    assert set(t.rejected.values()) == {"amqp:resource-limit-exceeded"}
    got = drain(b.url, q, quiet=1.0)
    a = assess(t, got)
    assert a.ok, a.problems()
    assert {mid for mid, _ in got} == t.accepted


class _StopWhenSettled(_Clients):
    def _outcome(self, event, accepted):
        super()._outcome(event, accepted)
        if len(self.t.accepted) + len(self.t.rejected) >= self.max_messages:
            self._stop(event.container)


# ---------------------------------------------------------------------- format version


def test_store_of_unknown_format_version_stops_the_broker(broker_factory):
    b = broker_factory()
    b.stop()
    # A start sets LMDB back to the journal's last checkpoint and applies the journal
    # again (store/journal.py: LMDB is written without syncs), so an edit made behind
    # the journal's back is undone.  What it holds is applied and the journal removed
    # first: then the store is one without a journal, as an older broker left it.
    recover(b.data_dir / "store")
    (b.data_dir / "store" / "journal").unlink()
    env = lmdb.open(str(b.data_dir / "store"), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.put(b"format", b"42", db=env.open_db(b"meta", txn=txn))
    env.close()
    with pytest.raises(RuntimeError, match="exited during start-up") as failed:
        b.start()
    assert b.proc.returncode == 2
    text = str(failed.value)
    assert "format version 42" in text and "reads version 1 only" in text
    assert "Traceback" not in text


def test_a_sigterm_right_after_start_is_a_clean_stop(tmp_path):
    """The broker's SIGTERM handler came after its listeners: a SIGTERM as soon as it
    listened (a supervisor stopping it, a test's teardown) killed it (status -15) with
    its store's last checkpoint unwritten, 2 times in 6, so the next start set LMDB
    back and replayed the journal.  Now it stops cleanly: status 0, the journal empty."""
    for attempt in range(8):
        b = BrokerProcess(tmp_path / f"data-{attempt}").start()
        assert b.stop() == 0, f"attempt {attempt}: {b.log_text()[-2000:]}"
        assert "broker stopped" in b.log_text()
        assert recover(b.data_dir / "store") == 0, "a clean stop leaves nothing in the journal"
