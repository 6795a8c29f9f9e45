"""The three fault schedules that broke the pair's guarantees, each as a
deterministic test (docs/ha.md, "Fault cases"): every step waits for an event (a
log line, a count of Accepted sends, a connection), never for a time.

1. A backup rejoins (its replication connection dropped, or it was restarted) and
   the live broker dies before the backup has caught up: nothing Accepted may be
   lost — the backup must not take over with a store that lacks it.
2. A backup's ZooKeeper session is lost (connection cut until the session
   expired, ZooKeeper paused, ZooKeeper unreachable at start): the backup keeps
   running, keeps replicating, and takes over when the live broker dies.
3. A live broker that was paused (SIGSTOP) or cut off from ZooKeeper until the
   backup took over must answer nothing: no AMQP open, no Accepted.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
from proton import Message
from proton.handlers import MessagingHandler
from proton.reactor import Container

from tests.e2e.crash_support import Outcomes, drain
from tests.faults.clients import ClientSet, FailoverProducer, Ledger
from tests.faults.relay import PARTITION, RESET

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def wait_until(predicate, timeout: float, what, every: float = 0.05) -> None:
    """A generous bound that only turns a hang into a failure with a reason (`what`:
    text, or a function giving it, for what was seen at the end)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout} s for {what() if callable(what) else what}")
        time.sleep(every)


def session_of(broker) -> str | None:
    """The ZooKeeper session a broker holds now, as its log names it (ha/zk.py)."""
    found = re.findall(r"ZooKeeper session CONNECTED \((?:a new|the same) session (0x[0-9a-f]+)\)",
                       broker.log_text())
    return found[-1] if found else None


def lost_messages(ledger: Ledger, received: set[str]) -> list[str]:
    return sorted(mid for mid in ledger.accepted if ledger.sent.get(mid) and mid not in received)


# ---------------------------------------------------------------------------- 1. rejoin


@pytest.mark.parametrize("how", ["link-dropped", "backup-restarted"])
def test_live_dies_while_the_backup_rejoins(make_pair, how):
    pair = make_pair().start()
    a, b = pair.a, pair.b
    ledger = Ledger()
    # A steady rate and a wide window: new sends keep coming while earlier ones wait.
    clients = ClientSet([FailoverProducer("rejoin", [a.url], "rejoin", ledger, window=2000, rate=300)]).start()
    try:
        wait_until(lambda: ledger.accepted_count() >= 200, 60, "200 Accepted sends")
        mark = a.mark()
        # The backup's next replication connection gets the handshake (48 bytes from
        # the live side) and then nothing: it cannot finish catching up.
        a.replication_relay.hold_after(48)
        if how == "link-dropped":
            a.replication_relay.drop()
        else:
            b.kill()
            b.start(wait=False)
        a.wait_for_log(r"ha: backup \S+ attached", 60, after=mark)
        attached_at = ledger.accepted_count()
        wait_until(lambda: ledger.accepted_count() >= attached_at + 200, 60,
                   "200 more Accepted sends after the backup attached again")
        b_mark = b.mark()
        a.kill()
    finally:
        clients.stop()
    # The backup either takes over or says why it may not.
    line = b.wait_for_log(r"ha: (node \S+ is live|not contending for live)", 60, after=b_mark)
    survivor = b
    if "not contending" not in line:
        b.wait_live(60)
    else:
        a.replication_relay.heal()
        a.start().wait_live(60)
        survivor = a
    received = {mid for mid, _ in drain(survivor.url, "rejoin")}
    lost = lost_messages(ledger, received)
    print(f"{survivor.name} took over: {line.strip()}; {len(ledger.accepted)} Accepted, {len(lost)} lost")
    assert not lost, (f"{len(lost)} of {len(ledger.accepted)} Accepted messages lost after {survivor.name} "
                      f"took over: {lost[:5]}")
    if survivor is a:   # the backup copies the store again and may take over from then on
        b.wait_for_log("in sync with the live broker", 60, after=b_mark)


# ---------------------------------------------------------------------------- 2. backup and ZooKeeper


def _load(pair, name: str) -> tuple[Ledger, ClientSet]:
    ledger = Ledger()
    clients = ClientSet([FailoverProducer(name, pair.urls, name, ledger, window=20, rate=200)]).start()
    wait_until(lambda: ledger.accepted_count() >= 100, 60, "100 Accepted sends")
    return ledger, clients


def _zookeeper_lines(broker, after: int) -> list[str]:
    return [ln for ln in broker.lines[after:] if "ZooKeeper" in ln]


def test_backup_survives_its_zookeeper_session_expiring(make_pair, zookeeper):
    pair = make_pair().start()
    a, b = pair.a, pair.b
    ledger, clients = _load(pair, "expiry")
    try:
        mark = b.mark()
        own = session_of(b)
        assert own is not None and own in zookeeper.sessions(), f"the backup's session {own} is in ZooKeeper"
        before = zookeeper.sessions()      # the live broker's and the backup's
        b.zk_relay.cut(PARTITION)
        b.wait_for_log("ZooKeeper session SUSPENDED", 60, after=mark)
        # Only the backup's link is cut: its own session is the one that must leave (the
        # live broker's may be renewed too on a loaded machine).
        wait_until(lambda: own not in zookeeper.sessions() or not b.alive(), 60,
                   lambda: f"ZooKeeper to expire the backup's session {own} (before the cut: {sorted(before)}; "
                           f"now: {sorted(zookeeper.sessions())})")
        n = ledger.accepted_count()
        wait_until(lambda: ledger.accepted_count() >= n + 100, 60, "Accepted sends while the backup is cut off")
        b.zk_relay.heal()
        b.wait_for_log("ZooKeeper session CONNECTED", 60, after=mark)
        assert b.alive(), f"the backup exited ({b.proc.returncode}):\n" + "".join(b.lines[-30:])
        # Each state once, not once per look at ZooKeeper.
        assert len(_zookeeper_lines(b, mark)) <= 8, "".join(_zookeeper_lines(b, mark))
        n = ledger.accepted_count()
        wait_until(lambda: ledger.accepted_count() >= n + 100, 60, "Accepted sends after the backup reconnected")
        b_mark = b.mark()
        a.kill()
        b.wait_live(60)
        assert "is live" in b.wait_for_log(r"ha: node \S+ is live", 5, after=b_mark)
    finally:
        clients.stop()
    received = {mid for mid, _ in drain(b.url, "expiry")}
    assert not lost_messages(ledger, received)


def test_pair_survives_zookeeper_pausing(make_pair, zookeeper):
    pair = make_pair().start()
    ledger, clients = _load(pair, "zkpause")
    try:
        marks = {x.name: x.mark() for x in (pair.a, pair.b)}
        zookeeper.pause()
        for x in (pair.a, pair.b):
            x.wait_for_log("ZooKeeper session SUSPENDED", 60, after=marks[x.name])
        # Long enough for ZooKeeper to expire both sessions once it runs again.
        time.sleep(3 * 2.0)
        zookeeper.resume()
        n = ledger.accepted_count()
        wait_until(lambda: ledger.accepted_count() >= n + 100 or not (pair.a.alive() and pair.b.alive()), 90,
                   "Accepted sends after ZooKeeper came back")
        for x in (pair.a, pair.b):
            assert x.alive(), f"{x.name} exited ({x.proc.returncode}):\n" + "".join(x.lines[-30:])
    finally:
        clients.stop()
    live = pair.wait_any_live(60)
    backup = pair.other(live)
    backup.wait_for_log("in sync with the live broker", 90, after=0)
    received = {mid for mid, _ in drain(live.url, "zkpause")}
    assert not lost_messages(ledger, received)


def test_backup_starts_while_zookeeper_is_unreachable(make_pair):
    pair = make_pair()
    a, b = pair.a, pair.b
    a.start().wait_live(30)
    b.zk_relay.cut(RESET)
    b.start(wait=False)
    wait_until(lambda: not b.alive() or any("ZooKeeper" in ln and "CONNECTING" in ln for ln in b.lines), 60,
               "the backup to wait for ZooKeeper (or exit)")
    assert b.alive(), f"the backup exited ({b.proc.returncode}):\n" + "".join(b.lines[-30:])
    b.zk_relay.heal()
    b.wait_for_log("in sync with the live broker", 60)
    assert b.alive()


# ---------------------------------------------------------------------------- 3. a stale live broker


class StaleProbe(Outcomes, MessagingHandler):
    """A connection to the old live broker made while it was live; on `go`, ten
    non-durable sends on it and three new connections to it.  Records what the
    broker answered: opens of the new connections, Accepted outcomes."""

    def __init__(self, url: str):
        super().__init__(prefetch=0, auto_accept=False)
        self.url = url
        self.go = threading.Event()
        self.ready = threading.Event()      # the first connection's sender has credit
        self.issued = threading.Event()     # the sends were written and the connections initiated
        self.done = threading.Event()
        self.stop = threading.Event()
        self.sender = None
        self.conns: list = []
        self.ended: set = set()
        self.answered_opens = 0
        self.accepted = 0
        self.outcomes = 0
        self.went = False

    def on_start(self, event):
        conn = event.container.connect(self.url, reconnect=False)
        self.conns.append(conn)
        self.sender = event.container.create_sender(conn, "stale")
        event.container.schedule(0.02, self)

    def on_sendable(self, event):
        self.ready.set()

    def on_connection_opened(self, event):
        if event.connection != self.conns[0]:
            self.answered_opens += 1

    def _outcome(self, event, accepted):
        self.outcomes += 1
        self.accepted += int(accepted)

    def _ended(self, event):
        self.ended.add(event.connection)

    on_connection_remote_close = _ended
    on_disconnected = _ended

    def on_transport_error(self, event):
        pass

    def on_timer_task(self, event):
        c = event.container
        if self.go.is_set() and not self.went:
            self.went = True
            if self.conns[0] not in self.ended:
                for i in range(10):
                    self.sender.send(Message(id=f"stale-{i}", durable=False, body=i))
            for _ in range(3):
                self.conns.append(c.connect(self.url, reconnect=False))
            self.issued.set()
        if self.went and all(x in self.ended for x in self.conns):
            self.done.set()
        if self.stop.is_set():
            for x in self.conns:
                x.close()
            return
        c.schedule(0.02, self)


def _run_probe(url: str) -> tuple[StaleProbe, threading.Thread]:
    probe = StaleProbe(url)
    thread = threading.Thread(target=Container(probe).run, daemon=True)
    thread.start()
    wait_until(probe.ready.is_set, 30, "the probe's sender to get credit")
    return probe, thread


def _finish_probe(probe: StaleProbe, thread: threading.Thread, why: str) -> None:
    wait_until(probe.done.is_set, 60, why)
    probe.stop.set()
    thread.join(10)


def test_a_paused_live_broker_answers_nothing_once_it_wakes(make_pair):
    pair = make_pair().start()
    a, b = pair.a, pair.b
    probe, thread = _run_probe(a.url)
    a.pause()
    try:
        b.wait_live(60)
        probe.go.set()
        wait_until(probe.issued.is_set, 30, "the probe to write while the old live broker is stopped")
        time.sleep(0.3)   # (the probe's frames reach the stopped broker's socket buffers)
    finally:
        a.resume()
    _finish_probe(probe, thread, "every probe connection to the old live broker to end")
    assert probe.accepted == 0, f"the paused live broker Accepted {probe.accepted} message(s) after waking"
    assert probe.answered_opens == 0, f"the paused live broker answered {probe.answered_opens} new connection(s)"


def test_a_live_broker_cut_off_from_zookeeper_answers_nothing_once_the_backup_is_live(make_pair):
    # The documented session timeout of the time the fault was found: the gap
    # between the backup taking over and the old live broker fencing itself grew
    # with it.
    pair = make_pair(session_timeout=10.0).start()
    a, b = pair.a, pair.b
    probe, thread = _run_probe(a.url)
    try:
        a.zk_relay.cut(PARTITION)
        b.wait_live(90)
        probe.go.set()
        _finish_probe(probe, thread, "every probe connection to the old live broker to end")
    finally:
        a.zk_relay.heal()
    assert probe.accepted == 0, f"the cut-off live broker Accepted {probe.accepted} message(s) after the backup took over"
    assert probe.answered_opens == 0, (f"the cut-off live broker answered {probe.answered_opens} new connection(s) "
                                       f"after the backup took over")
