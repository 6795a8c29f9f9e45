"""End-to-end: what the broker hands its protocol engine that cannot go out yet stays
bounded.

* A consumer whose session incoming window stays closed (AMQP 1.0 §2.5.6) while it
  grants a link credit of a million.  The engine writes nothing out on such a session;
  what the broker hands it meanwhile stays within core/outbound.py's bounds (before:
  everything the credit allowed, the whole backlog here; 134 MB seen from one rhea
  consumer), and every message arrives once the window opens, with a session-level
  flow that raises no link event at the broker.
* A range reader on a connection whose output waits for a store commit (a consumer
  on the same connection was handed a durable message whose delivery mark is not on
  disk yet: AmqpProtocol.hold_for_store) hands nothing over until the commit (before:
  the whole range its credit allowed went into the held output).

Memory is the broker's anonymous memory (the store's map is file-backed), measured
on a broker restarted after the backlog was stored: what the producers' messages
took is not in it to be reused.
"""

from __future__ import annotations

import os
import re
import signal
import time
from contextlib import contextmanager

import httpx
import pytest
from proton import Described, Endpoint, Link, Message, Terminus, symbol, ulong

from amqpbroker.core.outbound import LINK_DELIVERIES, SESSION_BYTES
from amqpbroker.core.queues import DISPATCH_SLICE, DISPATCH_SLICE_BYTES
from tests.broker_process import BrokerProcess
from tests.e2e.crash_support import send_durable
from tests.e2e.helpers_conn import RawClient
from tests.e2e.helpers_delivery import uid
from tests.e2e.wire_peers import WindowCloser

pytestmark = pytest.mark.e2e

BACKLOG = 4000
SIZE = 32 * 1024                 # 128 MiB of backlog
CREDIT = 1_000_000
CLOSED_FOR = 3.0                 # seconds the window stays closed while the test watches
RANGE = symbol("amqpbroker:sequence-range")
# What the engine may hold of one consumer unsent: the session's bytes, passed by one
# dispatch run at most (core/outbound.py), and never more deliveries than the link's bound.
MAX_HANDED_OUT = min((SESSION_BYTES + DISPATCH_SLICE_BYTES) // SIZE + 1, LINK_DELIVERIES + DISPATCH_SLICE)
# Broker memory (anonymous: the store's map is file-backed) the closed window may cost:
# the bound above with room for the allocator (the whole backlog went in before).
MAX_GROWTH_MB = 64


@pytest.fixture(scope="module")
def windows(tmp_path_factory):
    # Most of the backlog lives only in the store (the paged region), as a deep queue does.
    proc = BrokerProcess(tmp_path_factory.mktemp("closed-window") / "data",
                         config="[store]\nqueue_memory_budget = 1048576\n").start()
    yield proc
    proc.stop()


def rss_anon_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"RssAnon:\s+(\d+)", f.read()).group(1)) / 1024


def queue_info(broker, queue: str) -> dict:
    return httpx.get(f"http://127.0.0.1:{broker.ports['management']}/api/queues/{queue}", timeout=10).json()


def handed_out(broker, queue: str, kind: str) -> int | None:
    """What the broker handed the consumer (into its engine: nothing went out)."""
    info = queue_info(broker, queue)
    if kind == "at-most-once":
        return BACKLOG - info["depth"]          # settled on hand-over: gone from the queue
    if kind == "at-least-once":
        return info["unacked"]
    return None                                 # a range reader reads the store: no queue figure


def attach(client: RawClient, queue: str, kind: str):
    link = client.session().receiver(uid(kind))
    link.source.address = queue
    link.target.address = None
    if kind == "at-most-once":
        link.snd_settle_mode = Link.SND_SETTLED
    if kind == "range":
        link.source.distribution_mode = Terminus.DIST_MODE_COPY
        link.source.filter.put_object({RANGE: Described(RANGE, [ulong(0), None])})
    link.open()
    client.wait(lambda: link.state & (Endpoint.REMOTE_ACTIVE | Endpoint.REMOTE_CLOSED), what="attach")
    assert link.state & Endpoint.REMOTE_ACTIVE, link.remote_condition
    return link


def fill(broker, queue: str) -> None:
    """The backlog, stored; then a restart, so that it is in the store only."""
    sent = send_durable(broker, queue, BACKLOG, queue, window=500, body=b"x" * SIZE)
    assert len(sent.accepted) == BACKLOG
    broker.restart()


def receive(client, link, n: int) -> list[str]:
    """Up to n messages (accepted and settled), until none comes for 30 s: their ids."""
    got: list[str] = []
    last_progress = time.monotonic()
    while len(got) < n and time.monotonic() - last_progress < 30:
        client.pump(0.01)
        while link.current is not None and not link.current.partial:
            dlv = link.current
            msg = Message()
            msg.decode(link.recv(dlv.pending))
            link.advance()
            dlv.update(dlv.ACCEPTED)
            dlv.settle()
            got.append(msg.id)
            last_progress = time.monotonic()
    return got


@pytest.mark.parametrize("kind", ["at-most-once", "at-least-once", "range"])
def test_a_closed_session_window_bounds_what_the_broker_buffers(windows, kind):
    q = uid(f"closed-window-{kind}")
    fill(windows, q)
    before = rss_anon_mb(windows.proc.pid)
    client = WindowCloser("127.0.0.1", windows.port, container_id=uid("closed")).wait_open()
    link = attach(client, q, kind)
    link.flow(CREDIT)
    peak, most = before, 0
    deadline = time.monotonic() + CLOSED_FOR
    while time.monotonic() < deadline:
        client.pump(0.1)
        peak = max(peak, rss_anon_mb(windows.proc.pid))
        most = max(most, handed_out(windows, q, kind) or 0)
    assert link.current is None, "a transfer came through a closed window"

    client.open_window()
    got = receive(client, link, BACKLOG)
    client.close()

    assert got == [f"{q}-{i}" for i in range(BACKLOG)], f"received {len(got)} of {BACKLOG}"
    if kind != "range":
        assert most <= MAX_HANDED_OUT, f"{most} of {BACKLOG} messages handed to a closed window"
    assert peak - before < MAX_GROWTH_MB, f"broker memory grew {peak - before:.0f} MB behind a closed window"
    if kind != "range":
        info = queue_info(windows, q)
        assert info["depth"] == 0 and info["unacked"] == 0, info


@contextmanager
def store_writer_stopped(broker):
    """SIGSTOP the broker's store writer process (a pause, not a crash): no batch
    commits until SIGCONT."""
    with open(f"/proc/{broker.proc.pid}/task/{broker.proc.pid}/children") as f:
        writers = [int(p) for p in f.read().split()]
    assert writers, "no store writer process"
    for pid in writers:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in writers:
            os.kill(pid, signal.SIGCONT)


def test_a_range_reader_hands_nothing_over_while_its_connections_output_waits_for_the_store(windows):
    q, other = uid("held-range"), uid("held-consumer")
    sent = send_durable(windows, other, 1, other)
    assert len(sent.accepted) == 1
    fill(windows, q)
    client = RawClient("127.0.0.1", windows.port, container_id=uid("held")).wait_open()
    consumer = attach(client, other, "at-least-once")
    reader = attach(client, q, "range")
    before = rss_anon_mb(windows.proc.pid)
    with store_writer_stopped(windows):
        consumer.flow(1)       # its delivery's mark cannot commit: the connection's output is held
        client.pump_for(0.5)
        assert consumer.current is None, "the output went out before its delivery mark was stored"
        reader.flow(CREDIT)
        peak = before
        deadline = time.monotonic() + CLOSED_FOR
        while time.monotonic() < deadline:
            client.pump(0.1)
            peak = max(peak, rss_anon_mb(windows.proc.pid))
        assert reader.current is None
    assert receive(client, consumer, 1) == [f"{other}-0"]
    got = receive(client, reader, BACKLOG)
    client.close()
    assert got == [f"{q}-{i}" for i in range(BACKLOG)], f"received {len(got)} of {BACKLOG}"
    # Nothing is handed over while the output is held (0.0 MB here); the engine's
    # bounds alone (core/outbound.py) would let SESSION_BYTES in (9 MB here), and
    # before either, the whole range went in (143 MB).
    growth = peak - before
    assert growth < SESSION_BYTES / 2**21, f"broker memory grew {growth:.1f} MB while the output was held"
