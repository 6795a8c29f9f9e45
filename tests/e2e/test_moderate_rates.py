"""End-to-end: what keeps a moderate-rate producer's messages from waiting behind a
burst (core/credit_window.py, SlicedInput._feed in server/input_slices.py), and the loop trace that shows it
(amqpbroker/looptrace.py).

Nothing here measures time: the credit window is read off the link, and the order
of reads, events and writes off the broker's own trace."""

from __future__ import annotations

import socket
import struct
import time
from collections import defaultdict

import pytest
from proton import Delivery, Message

from amqpbroker.core.credit_window import INITIAL
from tests.e2e.helpers_conn import RawClient
from tests.e2e.helpers_delivery import uid

pytestmark = pytest.mark.e2e


def stamped(seq: int) -> bytes:
    """A message whose body carries bench/loadgen.c's stamp (marker, send time, sequence),
    so the broker's trace names it in reads and writes."""
    body = b"LGBENCH1" + struct.pack("<qQ", time.monotonic_ns(), seq) + b"x" * 232
    return Message(body=body, durable=False).encode()


def write_at_once(client: RawClient) -> int:
    """Everything the client's engine has to say, in one socket write."""
    t = client.transport
    out = bytearray()
    while t.pending() > 0:
        n = t.pending()
        out += t.peek(n)
        t.pop(n)
    client.sock.setblocking(True)
    try:
        client.sock.sendall(out)
    finally:
        client.sock.setblocking(False)
    return len(out)


def burst(client: RawClient, links: list, first_seq: int = 0) -> int:
    """Each link sends all the credit it has, written in one go: how many."""
    seq = first_seq
    for link in links:
        while link.credit > 0:
            dlv = link.delivery(str(seq).encode())
            link.send(stamped(seq))
            link.advance()
            dlv.settle()
            seq += 1
    write_at_once(client)
    return seq - first_seq


def drain(client: RawClient, link, n: int) -> None:
    got = 0

    def take() -> bool:
        nonlocal got
        while link.current is not None and link.current.readable and not link.current.partial:
            dlv = link.current
            link.recv(dlv.pending)
            link.advance()
            dlv.update(Delivery.ACCEPTED)
            dlv.settle()
            got += 1
        if link.credit < 500:
            link.flow(1000 - link.credit)
        return got >= n

    client.wait(take, timeout=30, what=f"{n} messages")


def test_a_producer_starts_with_a_small_window_and_one_bursting_on_and_on_grows_it(broker_factory):
    """A producer is first given INITIAL credit (not the configured link_credit).  One
    burst does not grow it (a catch-up of a few hundred messages comes in a window
    at a time); a producer that keeps sending everything it is given, burst after
    burst, reaches link_credit (core/credit_window.py SUSTAIN).  Bounded by bursts,
    not by time."""
    broker = broker_factory(config="[limits]\nlink_credit = 1000\n")
    q = uid("window")
    consumer = RawClient("127.0.0.1", broker.port, container_id=uid("c")).wait_open()
    rcv = consumer.receiver(consumer.session(), q, uid("rcv"))
    rcv.flow(1000)
    consumer.pump(0)
    producer = RawClient("127.0.0.1", broker.port, container_id=uid("p")).wait_open()
    snd = producer.sender(producer.session(), q, uid("snd"))
    producer.wait(lambda: snd.credit > 0, what="credit")
    assert snd.credit == INITIAL
    seen, sent = [snd.credit], 0
    while max(seen) <= 512 and len(seen) < 2000:
        k = burst(producer, [snd], sent)
        sent += k
        drain(consumer, rcv, k)
        producer.wait(lambda: snd.credit > 0, what="credit back")
        seen.append(snd.credit)
    # The broker tops up when half the window is used, mid-burst, so what is left
    # after a burst is under the window; beyond 512 it can only be the full 1000.
    assert max(seen[:2]) <= INITIAL, f"the first burst grew the window: {seen[:10]}"
    assert max(seen) > 512, f"credit left after each of {len(seen) - 1} bursts: {seen}"
    producer.close()
    consumer.close()


def read_trace(path) -> list[tuple[int, str, int, int]]:
    rows = []
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            continue
        t, kind, conn, n = line.split("\t")
        rows.append((int(t), kind, int(conn), int(n)))
    return rows


def test_a_burst_read_at_once_goes_out_in_slices_while_it_is_handled(broker_factory, tmp_path):
    """512 messages reach the broker in one write (8 links, each sending the 64 credits
    it starts with).  Their first messages are written to the consumer while the
    broker is still handling the rest of that input: output does not wait for the
    whole burst.  Read off the broker's loop trace: a write to the consumer carrying
    burst messages, followed by more transfers handled from the producer's
    connection before its next socket read."""
    trace = tmp_path / "loop.trace"
    broker = broker_factory(env={"AMQPBROKER_LOOP_TRACE": str(trace)})
    q = uid("burst")
    consumer = RawClient("127.0.0.1", broker.port, container_id=uid("c")).wait_open()
    rcv = consumer.receiver(consumer.session(), q, uid("rcv"))
    rcv.flow(1000)
    consumer.pump(0)
    producer = RawClient("127.0.0.1", broker.port, container_id=uid("p")).wait_open()
    producer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    ssn = producer.session()
    links = [producer.sender(ssn, q, uid(f"snd{i}")) for i in range(8)]
    producer.wait(lambda: all(link.credit == INITIAL for link in links), what="credit on every link")
    n = burst(producer, links)
    assert n == 8 * INITIAL
    drain(consumer, rcv, n)
    producer.close()
    consumer.close()
    broker.stop()                                   # the trace is written at exit

    rows = read_trace(trace)
    # The burst's messages, by the connection that read them and the one that wrote them.
    read_by, written_by = defaultdict(int), defaultdict(int)
    for _, kind, conn, seq in rows:
        if kind == "in" and seq < n:
            read_by[conn] += 1
        elif kind == "out" and seq < n:
            written_by[conn] += 1
    # (a stamp cut by a read or write boundary is not seen: most, not all, are counted)
    prod = max(read_by, key=read_by.get)
    cons = max(written_by, key=written_by.get)
    assert read_by[prod] > n * 0.9 and written_by[cons] > n * 0.9
    # The read that brought most of the burst (the kernel may split one write).
    reads = [i for i, r in enumerate(rows) if r[1] == "read" and r[2] == prod]
    ins_after = {i: sum(1 for r in rows[i + 1:next((j for j in reads if j > i), len(rows))]
                        if r[1] == "in" and r[3] < n) for i in reads}
    big = max(ins_after, key=ins_after.get)
    assert ins_after[big] >= 3 * 64, f"the burst came in small reads: {sorted(ins_after.values())[-5:]}"
    nxt = next((j for j in reads if j > big), len(rows))
    window = rows[big:nxt]
    first_out = next(i for i, r in enumerate(window) if r[1] == "out" and r[2] == cons)
    handled_after = sum(1 for r in window[first_out:] if r[1] == "dlv" and r[2] == prod)
    assert handled_after > 0, "the consumer got nothing before the whole burst was handled"
    # and it went out in more than one write to the consumer
    writes = sum(1 for r in window if r[1] == "write" and r[2] == cons)
    assert writes >= 2


def test_the_loop_trace_records_the_store_hand_offs_and_commits(broker_factory, tmp_path):
    trace = tmp_path / "loop.trace"
    broker = broker_factory(env={"AMQPBROKER_LOOP_TRACE": str(trace)})
    q = uid("durable")
    client = RawClient("127.0.0.1", broker.port, container_id=uid("p")).wait_open()
    snd = client.sender(client.session(), q, uid("snd"))
    client.wait(lambda: snd.credit > 0, what="credit")
    dlv = snd.delivery(b"d")
    snd.send(Message(body="keep me", durable=True).encode())
    snd.advance()
    client.wait(lambda: dlv.remote_state == Delivery.ACCEPTED, what="accepted")
    client.close()
    broker.stop()
    kinds = [r[1] for r in read_trace(trace)]
    for kind in ("read", "pump", "dlv", "write", "flush", "handoff", "commit"):
        assert kind in kinds, f"no {kind} row"
    assert kinds.index("handoff") < len(kinds) - 1 - kinds[::-1].index("commit")
