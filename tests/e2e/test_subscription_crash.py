"""kill -9 in the middle of a fan-out to many durable subscriptions, and in the middle
of their drain (the topic log: one record per message, a cursor per subscription):
after a restart every message a producer saw Accepted is in every subscription,
exactly once and in order; a message a consumer may have seen before the crash
comes back marked redelivered, never as a first delivery.  The crash points are
drawn from a seed (CRASH_SEED to replay one)."""

from __future__ import annotations

import os
import random
import threading
import time
import uuid

import pytest
from proton import Timeout
from proton.handlers import MessagingHandler
from proton.reactor import Container

from proton import Terminus

from tests.client import SourceOptions, connect
from tests.e2e.crash_support import produce_until_crash, send_durable
from tests.e2e.jms_links import UNSETTLED_STATE, durable_consumer

pytestmark = pytest.mark.e2e

SEED = int(os.environ.get("CRASH_SEED", "0")) or random.randrange(1, 10**6)
SUBSCRIPTIONS = 20
CLIENT = "crash-subscriber"


def subscribe_all(url: str, key: str) -> list[str]:
    """Durable subscriptions sub00.. on amq.topic/<key>, then detached (kept)."""
    names = [f"sub{i:02d}" for i in range(SUBSCRIPTIONS)]
    conn = connect(url, container_id=CLIENT)
    try:
        for name in names:
            durable_consumer(conn, f"amq.topic/{key}", name, credit=0).detach()
    finally:
        conn.close()
    return names


def drain_all(url: str, key: str, names: list[str], quiet: float = 1.0) -> dict[str, list[tuple[str, int]]]:
    """Every subscription emptied (nothing more for `quiet` seconds): name -> [(message
    id, delivery-count)] in arrival order."""
    got: dict[str, list[tuple[str, int]]] = {}
    conn = connect(url, container_id=CLIENT)
    try:
        for name in names:
            rcv = durable_consumer(conn, f"amq.topic/{key}", name, credit=500)
            out = got[name] = []
            while True:
                try:
                    m = rcv.receive(timeout=quiet)
                except Timeout:
                    break
                out.append((m.id, m.delivery_count))
                rcv.accept()
            rcv.detach()
    finally:
        conn.close()
    return got


def seq_of(mid: str) -> int:
    return int(mid.rsplit("-", 1)[1])


def test_sigkill_in_the_middle_of_a_fan_out_loses_nothing_accepted(broker_factory):
    rng = random.Random(SEED)
    b = broker_factory()
    key = f"fan-{uuid.uuid4().hex[:6]}"
    names = subscribe_all(b.url, key)
    kill_after = rng.randint(200, 1500)
    traffic = produce_until_crash(b, f"amq.topic/{key}", "f", kill_after, window=500,
                                  kill_delay=rng.uniform(0, 0.03))
    assert traffic.killed and not traffic.errors, traffic.errors
    assert len(traffic.accepted) >= kill_after and not traffic.rejected
    b.start()
    got = drain_all(b.url, key, names)
    info = f"seed {SEED}: sent {len(traffic.sent)}, accepted {len(traffic.accepted)}"
    for name in names:
        ids = [mid for mid, _ in got[name]]
        assert set(traffic.accepted) <= set(ids), f"{info}: {name} lost {len(set(traffic.accepted) - set(ids))}"
        assert len(ids) == len(set(ids)), f"{info}: {name} has duplicates"
        assert set(ids) <= set(traffic.sent), f"{info}: {name} has unknown messages"
        assert [seq_of(m) for m in ids] == sorted(seq_of(m) for m in ids), f"{info}: {name} out of order"
        assert all(count == 0 for _, count in got[name]), f"{info}: {name}: nothing was delivered before"
    # A second restart changes nothing: everything was acknowledged.
    b.restart()
    assert all(not v for v in drain_all(b.url, key, names, quiet=0.3).values())


class _Drainer(MessagingHandler):
    """Consumes every subscription on one connection, accepting each message, until
    the broker dies; records what it saw."""

    def __init__(self, url: str, key: str, names: list[str], kill_after: int, threshold: threading.Event):
        super().__init__(prefetch=50, auto_accept=False)
        self.url, self.key, self.names = url, key, names
        self.kill_after = kill_after
        self.threshold = threshold
        self.seen: dict[str, list[tuple[str, int]]] = {n: [] for n in names}
        self.total = 0

    def on_start(self, event):
        conn = event.container.connect(self.url, reconnect=False, container_id=CLIENT)
        opts = SourceOptions(capabilities=["topic"], durable=UNSETTLED_STATE, expiry=Terminus.EXPIRE_NEVER,
                             distribution_mode=Terminus.DIST_MODE_COPY)
        for name in self.names:
            event.container.create_receiver(conn, f"amq.topic/{self.key}", name=name, options=opts)
        event.container.schedule(60, self)

    def on_message(self, event):
        self.seen[event.link.name].append((event.message.id, event.message.delivery_count))
        self.accept(event.delivery)
        self.total += 1
        if self.total >= self.kill_after:
            self.threshold.set()

    def on_timer_task(self, event):
        event.container.stop()

    def on_transport_error(self, event):
        pass

    def on_disconnected(self, event):
        event.container.stop()


def test_sigkill_in_the_middle_of_a_drain_loses_nothing_and_marks_what_was_seen(broker_factory):
    rng = random.Random(SEED)
    b = broker_factory()
    key = f"drain-{uuid.uuid4().hex[:6]}"
    names = subscribe_all(b.url, key)
    sent = send_durable(b, f"amq.topic/{key}", 600, "d", body=b"B" * 256)
    assert len(sent.accepted) == 600
    kill_after = rng.randint(500, SUBSCRIPTIONS * 600 - 500)
    threshold = threading.Event()
    drainer = _Drainer(b.url, key, names, kill_after, threshold)

    def killer():
        if threshold.wait(60):
            time.sleep(rng.uniform(0, 0.02))
        b.kill()

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    Container(drainer).run()
    t.join(70)
    assert drainer.total >= kill_after
    b.start()
    after = drain_all(b.url, key, names)
    info = f"seed {SEED}: killed after {drainer.total} deliveries"
    for name in names:
        before = [mid for mid, _ in drainer.seen[name]]
        again = [mid for mid, _ in after[name]]
        assert set(before) | set(again) == set(sent.accepted), f"{info}: {name} lost messages"
        assert len(again) == len(set(again)), f"{info}: {name} duplicates after the restart"
        assert [seq_of(m) for m in again] == sorted(seq_of(m) for m in again), f"{info}: {name} order"
        seen_before = set(before)
        for mid, count in after[name]:
            if mid in seen_before:
                assert count >= 1, f"{info}: {name}: {mid} seen before the crash came back as a first delivery"
