"""End-to-end: a huge credit on a deep durable backlog is served in slices (one per
loop turn), so a canary on another connection stays fast, store transactions stay
small, and a consumer that never reads its socket costs bounded memory."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import pytest
from proton import Delivery, Endpoint, Link, Message

from tests.broker_process import BrokerProcess
from tests.e2e.canary import Canary
from tests.e2e.crash_support import send_durable
from tests.e2e.helpers_conn import RawClient
from tests.e2e.helpers_delivery import uid

pytestmark = pytest.mark.e2e

BACKLOG = 100_000
CREDIT = 1_000_000
# Most of the backlog lives only in the store (the paged region), as a deep queue does.
CONFIG = """
[store]
queue_memory_budget = 1048576
"""


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    proc = BrokerProcess(tmp_path_factory.mktemp("big-credit") / "data", config=CONFIG).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def idle(tmp_path_factory):
    """An idle broker whose canary runs beside the busy one's: the same machine load
    (a 2-core machine shared with other work), none of the test's traffic.  The busy
    canary is compared with it (Canary.assert_like), never with an absolute bound:
    a round trip of 105-179 ms on a loaded machine failed the old 100 ms bound on the
    unchanged broker."""
    proc = BrokerProcess(tmp_path_factory.mktemp("big-credit-idle") / "data").start()
    yield proc
    proc.stop()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


def queue_info(broker, queue: str) -> dict:
    url = f"http://127.0.0.1:{broker.ports['management']}/api/queues/{queue}"
    return httpx.get(url, timeout=10).json()


def unacked(broker, queue: str) -> int:
    """Deliveries of `queue` held by consumers, unsettled (the management API)."""
    return queue_info(broker, queue)["unacked"]


def depth(broker, queue: str) -> int:
    return queue_info(broker, queue)["depth"]


def fill(broker, queue: str) -> None:
    sent = send_durable(broker, queue, BACKLOG, queue, window=2000, body=b"x" * 200)
    assert len(sent.accepted) == BACKLOG


def big_credit_receiver(broker, queue: str) -> tuple[RawClient, object]:
    client = RawClient("127.0.0.1", broker.port, container_id=uid("greedy")).wait_open()
    link = client.receiver(client.session(), queue, uid("greedy"))
    link.flow(CREDIT)
    client.pump(0)        # the flow goes out
    return client, link


def test_a_credit_of_a_million_on_a_deep_durable_backlog_keeps_others_served(deep):
    q = uid("deep")
    fill(deep, q)
    with Canary(deep) as canary:
        client, link = big_credit_receiver(deep, q)
        started = time.monotonic()
        got = 0
        first_at = None
        while got < BACKLOG and time.monotonic() - started < 60:
            client.pump(0.01)
            while link.current is not None and not link.current.partial and link.current.readable:
                dlv = link.current
                link.recv(dlv.pending)
                link.advance()
                dlv.update(Delivery.ACCEPTED)
                dlv.settle()
                got += 1
                if first_at is None:
                    first_at = time.monotonic() - started
        client.close()
    assert got == BACKLOG, f"drained {got} of {BACKLOG}"
    assert first_at is not None and first_at < 1.0, f"first message after {first_at:.2f} s"
    canary.assert_served(max_rtt=0.25)
    assert "MDB_TXN_FULL" not in deep.log_text() and "Traceback" not in deep.log_text()


def fill_in_memory(broker, queue: str, n: int) -> None:
    """n non-durable messages, sent pre-settled as fast as credit allows."""
    client = RawClient("127.0.0.1", broker.port, container_id=uid("filler")).wait_open()
    link = client.sender(client.session(), queue, uid("filler"))
    body = Message(body="x" * 200).encode()
    sent = 0
    while sent < n:
        client.wait(lambda: link.credit > 0, what="credit")
        while link.credit > 0 and sent < n:
            dlv = link.delivery(str(sent).encode())
            link.send(body)
            link.advance()
            dlv.settle()
            sent += 1
        client.pump(0)
    client.wait(lambda: unacked(broker, queue) == 0 and depth(broker, queue) == n, timeout=30,
                what="the backlog")
    client.close()


def test_a_consumer_that_never_reads_costs_bounded_memory(deep, idle):
    q = uid("unread")
    fill_in_memory(deep, q, BACKLOG)
    before = rss_mb(deep.proc.pid)
    with Canary(idle) as control, Canary(deep) as canary:
        client, _ = big_credit_receiver(deep, q)     # then it never reads its socket again
        deadline = time.monotonic() + 5
        peak = before
        while time.monotonic() < deadline:
            peak = max(peak, rss_mb(deep.proc.pid))
            time.sleep(0.1)
        held = unacked(deep, q)
        client.abandon()
    canary.assert_like(control)
    # The link's unsettled deliveries are capped (limits.max_unsettled_per_link), so
    # the broker stopped handing messages over long before the credit ran out.
    assert held <= 10_000, f"{held} deliveries handed to a consumer that reads nothing"
    assert peak - before < 200, f"RSS grew from {before:.0f} MB to {peak:.0f} MB"


def test_memory_of_dropped_partial_deliveries_is_given_back(deep, idle):
    """Connections that send most of a large message and drop: the memory their
    partial deliveries took comes back once the broker is quiet (before: 8 x 95 MB
    partials left the broker at 819 MB for good)."""
    base = rss_mb(deep.proc.pid)
    with Canary(idle) as control, Canary(deep) as canary:
        clients = []
        for _ in range(4):
            client = RawClient("127.0.0.1", deep.port, container_id=uid("partial")).wait_open()
            link = client.sender(client.session(), uid("partial-q"), uid("partial"))
            client.wait(lambda: link.credit > 0, what="credit")
            link.delivery(b"big")
            link.send(b"\x00\x53\x75\xb0" + (80 << 20).to_bytes(4, "big"))
            for _ in range(60):                       # 60 MiB of an 80 MiB message
                link.send(b"p" * (1 << 20))
                while client.transport.pending() > 0:
                    client.pump(0.005)
            clients.append(client)
        peak = rss_mb(deep.proc.pid)
        for client in clients:
            client.abandon()                          # and the connections are gone
        deadline = time.monotonic() + 15
        while rss_mb(deep.proc.pid) - base > 60 and time.monotonic() < deadline:
            time.sleep(0.5)
    after = rss_mb(deep.proc.pid)
    canary.assert_like(control)
    assert peak - base > 200, f"the partials never reached the broker ({peak:.0f} MB at the peak)"
    assert after - base <= 60, f"RSS {base:.0f} MB before, {peak:.0f} MB at the peak, {after:.0f} MB when quiet"


class WriterPauses:
    """SIGSTOP / SIGCONT the broker's store writer process on a schedule (a pause is
    not a crash): every commit waits up to `stop` seconds, as on a slow disk."""

    def __init__(self, broker, stop: float = 0.2, run: float = 0.05):
        self.pid = broker.proc.pid
        self.stop, self.run = stop, run
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def writers(self) -> list[int]:
        with open(f"/proc/{self.pid}/task/{self.pid}/children") as f:
            return [int(p) for p in f.read().split()]

    def _loop(self) -> None:
        kids = self.writers()
        assert kids, "no store writer process"
        try:
            while not self.halt.is_set():
                for k in kids:
                    os.kill(k, signal.SIGSTOP)
                self.halt.wait(self.stop)
                for k in kids:
                    os.kill(k, signal.SIGCONT)
                self.halt.wait(self.run)
        finally:
            for k in kids:
                os.kill(k, signal.SIGCONT)

    def __enter__(self) -> "WriterPauses":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.halt.set()
        self.thread.join()


AT_MOST_ONCE = 60_000
# Handed out but not received yet, at most: what the sockets' buffers hold and a slice
# (4,360 and 6,242 in two runs here); before the fix 28,806 at this size (it grows with
# the backlog: 155,000 of 200,000 in a run of the finding's size).
IN_FLIGHT = 15_000


def test_an_at_most_once_consumer_with_a_huge_credit_gets_the_whole_paged_backlog(deep):
    """A consumer with credit gets messages while the queue has some.  The finding:
    settled transfers, one flow of 1,000,000, 200,000 durable messages: the consumer
    stopped at 166k-179k.  A delivery covered by a delivery watermark still on its
    way holds the connection's output until that store batch commits; the queue went
    on handing messages over into the held output (settled ones: nothing bounds
    them), each asking for a newer batch, so the output never went out while the
    backlog lasted.  With commits slowed (the writer paused 200 ms in every 250 ms)
    the same happens at any size; the broker now hands a consumer nothing while its
    connection's output waits for the store."""
    q = uid("at-most-once")
    sent = send_durable(deep, q, AT_MOST_ONCE, q, window=2000, body=b"x" * 1024)
    assert len(sent.accepted) == AT_MOST_ONCE
    client = RawClient("127.0.0.1", deep.port, container_id=uid("amo")).wait_open()
    ssn = client.session()
    link = ssn.receiver(uid("amo"))
    link.source.address = q
    link.target.address = None
    link.snd_settle_mode = Link.SND_SETTLED
    link.open()
    client.wait(lambda: link.state & Endpoint.REMOTE_ACTIVE, what="attach")
    link.flow(CREDIT)
    got = worst = rounds = 0
    last_progress = time.monotonic()
    with WriterPauses(deep):
        while got < AT_MOST_ONCE and time.monotonic() - last_progress < 60:
            client.pump(0.01)
            while link.current is not None and not link.current.partial and link.current.readable:
                dlv = link.current
                link.recv(dlv.pending)
                link.advance()
                dlv.settle()
                got += 1
                last_progress = time.monotonic()
            rounds += 1
            if rounds % 20 == 0 and got < AT_MOST_ONCE:
                handed_out = AT_MOST_ONCE - depth(deep, q)      # settled on hand-over: gone from the queue
                worst = max(worst, handed_out - got)
    client.close()
    assert got == AT_MOST_ONCE, f"received {got} of {AT_MOST_ONCE}; {depth(deep, q)} left in the queue"
    assert worst <= IN_FLIGHT, f"{worst} messages handed out ahead of the consumer (held output)"
