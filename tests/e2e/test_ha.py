"""A replicated pair against a real ZooKeeper and two real broker processes (docs/ha.md):
the backup's listener is closed until it is live; kill -9 of the live broker under
durable load from several producers loses nothing that was Accepted; durable and
shared durable subscriptions keep their backlog; a failover-capable consumer goes
on; ten kills in a row, alternating; a broker cut off from ZooKeeper stops accepting.

ZooKeeper comes from the Debian package (tests/e2e/ha_harness.py): missing and not
installable, these tests are skipped locally with the reason and fail in CI."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
import uuid

import pytest
from proton import Message
from proton.handlers import MessagingHandler
from proton.reactor import Container

from tests.client import connect
from tests.e2e.crash_support import Outcomes, Traffic, assess, drain, send_durable
from tests.e2e.ha_harness import HaBroker, ZooKeeper, free_port, pair_config
from tests.e2e.jms_links import durable_consumer, shared_consumer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


class Pair:
    def __init__(self, zk: ZooKeeper, tmp_path):
        cluster = uuid.uuid4().hex[:8]
        self.brokers = {}
        for name, role in (("a", "primary"), ("b", "backup")):
            port = free_port()
            self.brokers[name] = HaBroker(name, tmp_path / name, pair_config(zk, cluster, role, port), port)

    def start(self) -> "Pair":
        a, b = self.brokers["a"], self.brokers["b"]
        a.start().wait_live()
        b.start().wait_for_log("in sync with the live broker", 30)
        return self

    def other(self, broker: HaBroker) -> HaBroker:
        return self.brokers["b"] if broker is self.brokers["a"] else self.brokers["a"]

    @property
    def urls(self) -> list[str]:
        return [b.url for b in self.brokers.values()]

    def close(self) -> None:
        for b in self.brokers.values():
            b.kill()


@pytest.fixture
def pair(zookeeper, tmp_path):
    p = Pair(zookeeper, tmp_path)
    yield p
    p.close()


def ha_view(broker: HaBroker) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{broker.ports['management']}/api/ha", timeout=5) as r:
        return json.loads(r.read())


class FailoverConsumer(MessagingHandler):
    """A consumer given both brokers' addresses (proton's reconnect walks the list)."""

    def __init__(self, urls: list[str], address: str):
        super().__init__(prefetch=50)
        self.urls, self.address = urls, address
        self.ids: set[str] = set()
        self.opened = 0
        self.stop_flag = threading.Event()

    def on_start(self, event):
        conn = event.container.connect(urls=self.urls)
        event.container.create_receiver(conn, self.address)
        event.container.schedule(0.2, self)

    def on_connection_opened(self, event):
        self.opened += 1

    def on_message(self, event):
        self.ids.add(event.message.id)

    def on_transport_error(self, event):
        pass   # the live broker was killed: reconnect does the rest

    def on_timer_task(self, event):
        if self.stop_flag.is_set():
            event.container.stop()
        else:
            event.container.schedule(0.2, self)


class SeveralProducers(Outcomes, MessagingHandler):
    """Producers on their own connections in one container (proton's containers are
    not to be run in several threads of one process), durable unsettled sends, each
    outcome recorded per producer as crash_support's Traffic."""

    def __init__(self, url: str, addresses: list[str], kill_after: int, threshold: threading.Event):
        super().__init__(prefetch=0, auto_accept=False)
        self.url, self.kill_after, self.threshold = url, kill_after, threshold
        self.traffic = {addr: Traffic(addr) for addr in addresses}
        self.next = dict.fromkeys(addresses, 0)
        self.by_tag: dict = {}
        self.open = 0

    def on_start(self, event):
        for addr in self.traffic:
            event.container.create_sender(event.container.connect(self.url, reconnect=False), addr)
            self.open += 1
        event.container.schedule(60, self)

    def on_sendable(self, event):
        sender = event.sender
        addr = sender.target.address
        t = self.traffic[addr]
        while sender.credit > 0 and len(t.sent) - len(t.accepted) - len(t.rejected) < 500:
            seq = self.next[addr]
            self.next[addr] += 1
            mid = f"{addr}-{seq}"
            self.by_tag[(addr, sender.send(Message(id=mid, durable=True, body=seq)).tag)] = mid
            t.sent[mid] = seq

    def _outcome(self, event, accepted: bool):
        addr = event.link.target.address
        mid = self.by_tag.pop((addr, event.delivery.tag), None)
        if mid is None:
            return
        t = self.traffic[addr]
        (t.accepted.add(mid) if accepted else t.rejected.__setitem__(mid, "?"))
        if sum(len(x.accepted) for x in self.traffic.values()) >= self.kill_after:
            self.threshold.set()
        self.on_sendable(event)

    def on_transport_error(self, event):
        pass

    def on_disconnected(self, event):
        self.open -= 1
        if self.open <= 0:
            event.container.stop()

    def on_timer_task(self, event):
        event.container.stop()


def produce_several_until_kill(broker: HaBroker, addresses: list[str], kill_after: int) -> dict:
    threshold = threading.Event()
    handler = SeveralProducers(broker.url, addresses, kill_after, threshold)

    def killer():
        threshold.wait(60)
        broker.kill()

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    Container(handler).run()
    thread.join(10)
    return handler.traffic


def test_the_backup_listens_only_once_live(pair):
    pair.start()
    a, b = pair.brokers["a"], pair.brokers["b"]
    assert a.is_listening()
    assert not b.is_listening(), "a backup must keep its AMQP listener closed"
    view = ha_view(a)
    assert view["status"] == "live" and view["replication"]["peer_state"] == "in-sync"
    a.kill()
    started = time.monotonic()
    b.wait_live(15)
    assert b.is_listening()
    assert time.monotonic() - started < 8


def test_kill_the_live_broker_under_durable_load(pair):
    pair.start()
    a, b = pair.brokers["a"], pair.brokers["b"]
    topic = f"amq.topic/news-{uuid.uuid4().hex[:6]}"
    # A durable and a shared durable subscription, detached, with a backlog.
    conn = connect(a.url, container_id="sub-client")
    durable_consumer(conn, topic, "dsub")
    shared_consumer(conn, topic, "ssub", global_=True)
    conn.close()
    published = send_durable(a, topic, 50, "topic")
    assert len(published.accepted) == 50
    # A consumer that fails over, and a producer for it on the other queue.
    follower = FailoverConsumer(pair.urls, "followed")
    follower_thread = threading.Thread(target=Container(follower).run, daemon=True)
    follower_thread.start()
    before = send_durable(a, "followed", 100, "before")
    # Several producers at full speed, each on its own connection; once 1,200 sends
    # were Accepted in all, the live broker is killed.
    results = produce_several_until_kill(a, [f"load{i}" for i in range(3)], kill_after=1200)
    assert a.proc.poll() is not None, "the live broker was not killed:\n" + "".join(a.lines[-30:])
    b.wait_live(15)
    for name, traffic in results.items():
        got = drain(b.url, name)
        verdict = assess(traffic, got)
        assert traffic.accepted, f"{name}: nothing was accepted before the kill"
        assert verdict.lost == [], f"{name}: {len(verdict.lost)} Accepted message(s) lost"
        assert verdict.rejected_present == []
    # Subscriptions kept their backlog.
    conn = connect(b.url, container_id="sub-client")
    for receiver in (durable_consumer(conn, topic, "dsub", credit=100),
                     shared_consumer(conn, topic, "ssub", global_=True, credit=100)):
        ids = set()
        while True:
            try:
                msg = receiver.receive(timeout=2)
            except Exception:
                break
            ids.add(msg.id)
            receiver.accept()
        assert ids == published.accepted
    conn.close()
    # The follower went on against the new live broker.
    after = send_durable(b, "followed", 100, "after")
    deadline = time.monotonic() + 20
    while not (before.accepted | after.accepted) <= follower.ids and time.monotonic() < deadline:
        time.sleep(0.2)
    follower.stop_flag.set()
    follower_thread.join(10)
    assert after.accepted <= follower.ids, "the failover consumer did not go on"
    assert before.accepted <= follower.ids
    assert follower.opened >= 2
    # The old live broker comes back as the backup.
    a.start()
    a.wait_for_log("in sync with the live broker", 30)
    assert not a.is_listening()


def test_ten_kills_alternating(pair):
    pair.start()
    live = pair.brokers["a"]
    failovers = []
    for cycle in range(10):
        backup = pair.other(live)
        traffic = send_durable(live, f"cycle{cycle}", 200, f"c{cycle}", body=b"x" * 256)
        assert len(traffic.accepted) == 200
        mark = len(backup.lines)
        live.kill()
        started = time.monotonic()
        backup.wait_live(20)
        failovers.append(time.monotonic() - started)
        # Every queue of every cycle so far is whole on the new live broker (only this
        # cycle's is drained: earlier ones were drained already).
        got = drain(backup.url, f"cycle{cycle}", quiet=1.0)
        assert assess(traffic, got).lost == [], f"cycle {cycle}: lost messages"
        assert backup.wait_for_log("is live", 1, after=mark)
        live.start()
        live.wait_for_log("in sync with the live broker", 30)
        live = backup
    assert max(failovers) < 8, failovers


def test_a_live_broker_cut_off_from_zookeeper_stops_accepting(pair, zookeeper):
    pair.start()
    a = pair.brokers["a"]
    conn = connect(a.url)
    sender = conn.create_sender("partitioned")
    sender.send(Message(id="before", durable=True, body="x"))   # Accepted: ZooKeeper is there
    mark = len(a.lines)
    zookeeper.pause()    # SIGSTOP: the session can no longer be kept alive
    try:
        a.wait_for_log("ha: accept window closed", 15, after=mark)
        assert not a.is_listening(), "a fenced live broker must close its listener"
        assert a.proc.poll() is None, "a ZooKeeper outage is no reason to exit"
    finally:
        zookeeper.resume()
        try:
            conn.close()
        except Exception:
            pass
    # ZooKeeper back: one broker of the pair is live again (this one, re-validated,
    # or the other one), and the message is there.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(b.is_listening() for b in pair.brokers.values()):
        time.sleep(0.1)
    live = next(b for b in pair.brokers.values() if b.is_listening())
    assert [mid for mid, _ in drain(live.url, "partitioned")] == ["before"]


def test_the_live_broker_goes_on_alone_and_the_backup_copies_again(pair):
    pair.start()
    a, b = pair.brokers["a"], pair.brokers["b"]
    b.kill()
    traffic = send_durable(a, "alone", 50, "alone")   # waits backup_timeout (2 s), then alone
    assert len(traffic.accepted) == 50
    a.wait_for_log("going on alone at activation 2", 10)
    view = ha_view(a)
    assert view["activation"] == 2 and view["replication"]["alone_total"] == 1
    b.start().wait_for_log("in sync with the live broker", 30)
    a.kill()
    b.wait_live(15)
    assert assess(traffic, drain(b.url, "alone")).lost == []


def test_a_backup_left_behind_never_takes_over(pair):
    pair.start()
    a, b = pair.brokers["a"], pair.brokers["b"]
    b.kill()
    a.wait_for_log("going on alone at activation 2", 10)
    a.kill()                      # the only store with everything is gone with it
    b.start()
    b.wait_for_log(r"not contending for live.*: the store.s activation 1 is behind ZooKeeper.s 2", 15)
    time.sleep(SESSION_TIMEOUT_MARGIN)
    assert not b.is_listening(), "a stale backup must not become live"
    a.start().wait_live(15)       # the broker with the latest store comes back: it is live again
    b.wait_for_log("in sync with the live broker", 30)


SESSION_TIMEOUT_MARGIN = 3.0


def test_a_broker_gives_back_only_a_live_lock_its_own_session_holds(zookeeper):
    """The live lock is deleted on release, and its data published, only while this
    session holds it.  A live broker paused until the backup took over is demoted when
    it wakes, and by then its new session is connected: its release deleted the new
    live broker's lock (ZooKeeper lets any session delete any node), the new live
    broker failed its next lease renewal and stepped down too, and the pair had no live
    broker (found by tests/e2e/test_cluster_pair.py's paused owner, one run in five to
    eight)."""
    import asyncio

    from amqpbroker.config import HaConfig
    from amqpbroker.core.ha import Session
    from amqpbroker.ha.zk import ZkSession, ZkUnavailable

    async def connected(*sessions: ZkSession) -> None:
        for s in sessions:
            s.start()
        deadline = time.monotonic() + 30
        while any(s.state is not Session.CONNECTED for s in sessions):
            assert time.monotonic() < deadline, "ZooKeeper sessions did not connect"
            await asyncio.sleep(0.05)

    async def scenario() -> None:
        cfg = HaConfig(zookeeper=f"127.0.0.1:{zookeeper.port}", cluster=uuid.uuid4().hex[:8], secret="s" * 16)
        loop = asyncio.get_running_loop()
        demoted, live = ZkSession(cfg, loop), ZkSession(cfg, loop)
        await connected(demoted, live)
        try:
            assert await live.try_lock({"node": "new-live"})
            with pytest.raises(ZkUnavailable):    # a late publish of the broker that lost the lock
                await demoted.publish({"node": "old-live", "replication": "127.0.0.1:1"})
            await live.publish({"node": "new-live", "replication": "127.0.0.1:2"})
            await demoted.release_lock()          # the demoted broker's clean-up
            info, mine = await live.live()
            assert (info, mine) == ({"node": "new-live", "replication": "127.0.0.1:2"}, True), \
                "another session deleted or overwrote the live lock"
            assert await live.holds_lock()
            await live.release_lock()             # its own: given back
            assert (await demoted.live())[0] is None
        finally:
            await demoted.stop()
            await live.stop()

    asyncio.run(scenario())
