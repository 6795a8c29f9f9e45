"""End to end: a receiver that lowers its credit below what is already on its way
(AMQP 1.0 §2.6.7 lets it set link-credit at any time; python-qpid-proton's
BlockingReceiver does so).  proton then holds a negative credit for the sending link,
which the broker read as a grant of about 2^32: it sent whatever it had (the single
broker: up to the per-link unsettled limit), and a node passing the credit on to
another node (a forwarded consumer, a partitioned destination's fan-in) failed with
"integer 4294967295 does not fit '32-bit int'" and closed the client's connection
(amqp:internal-error).  An overdraft now counts as no credit (server/links.py
`link_credit`); a grant of 2^31 or more is still served (test_malformed_frames.py).

The cluster's placements run the same check in tests/e2e/test_cluster_fanin.py."""

from __future__ import annotations

import pytest
from proton import Delivery, Message, uint

from tests.client import connect
from tests.e2e.helpers_conn import RawClient, amqp_frame
from tests.e2e.helpers_delivery import QUIET, sender, uid

pytestmark = pytest.mark.e2e

FLOW = 0x13
WINDOW = 2**31 - 1


def lower_credit(client: RawClient, seen: int, credit: int, handle: int = 0) -> None:
    """A flow for the client's (first session's) receiving link `handle` that counts
    `seen` transfers (delivery-count) and grants `credit` from there."""
    client.pump(0)
    frame = amqp_frame(0, FLOW, [uint(seen), uint(WINDOW), uint(0), uint(WINDOW), uint(handle), uint(seen),
                                 uint(credit)])
    client.sock.setblocking(True)
    try:
        client.sock.sendall(frame)
    finally:
        client.sock.setblocking(False)


def overdraft_run(port: int, address: str, total: int) -> tuple[int, int]:
    """Grant 2, take the two transfers, then lower the credit to 1 counted from none of
    them (the broker is overdrawn by one).  (transfers while overdrawn, transfers
    once a proper grant of `total` follows)."""
    client = RawClient("127.0.0.1", port, container_id=uid("overdraft")).wait_open()
    try:
        ssn = client.session()
        rcv = client.receiver(ssn, address, uid("rcv"))
        assert rcv.remote_source.address == address, "attached"
        rcv.flow(2)
        client.wait(lambda: rcv.queued >= 2, what="the first two transfers")
        client.pump_for(QUIET)
        first = rcv.queued
        lower_credit(client, seen=0, credit=1)
        client.pump_for(QUIET)
        overdrawn = rcv.queued - first
        rcv.flow(total)   # counted from what the client has seen: the rest may come
        try:
            client.wait(lambda: rcv.queued == total, what=f"all {total} after a proper grant")
        except AssertionError:
            raise AssertionError(f"{rcv.queued} of {total} after a proper grant ({first + overdrawn} before it, "
                                 f"credit {rcv.credit})") from None
        received = rcv.queued
        while rcv.current is not None:   # accepted: nothing is left for the next test
            dlv = rcv.current
            rcv.recv(dlv.pending)
            rcv.advance()
            dlv.update(Delivery.ACCEPTED)
            dlv.settle()
        client.pump_for(QUIET)
        return first + overdrawn, received
    finally:
        client.close()


def fill(url: str, address: str, n: int) -> None:
    conn = connect(url)
    try:
        snd = sender(conn, address)
        for i in range(n):
            snd.send(Message(body=i))
        snd.close()
    finally:
        conn.close()


def test_a_receiver_that_lowers_its_credit_below_what_is_in_flight_is_sent_nothing_more(broker):
    q = uid("overdraft")
    fill(broker.url, q, 6)
    while_overdrawn, after = overdraft_run(broker.port, q, 6)
    assert while_overdrawn == 2, f"{while_overdrawn} transfers while the broker had no credit (2 were granted)"
    assert after == 6
    assert "Traceback" not in broker.log_text()
