"""A session's transfers are settled in the order they arrived on that session.

Qpid JMS completes asynchronous sends (CompletionListener) by matching the broker's
settlements to its sends in send order across the whole session.  Two producers on one
session, one to a normal queue (persistent: Accepted once stored) and one to a full
`overflow = "reject"` queue (Rejected at once), sending alternately: a broker that
settles each link in order but lets a reject overtake an earlier accept of the other
link has the client report accepted sends as failed and refused sends as completed.
The frames are Qpid JMS's (tests/e2e/jms_producers.py); the dispositions are read
off the wire (tests/e2e/wire_peers.py)."""

from __future__ import annotations

from collections import deque

import pytest
from proton import Delivery

from tests.e2e.flow_support import api, broker_without_errors
from tests.e2e.helpers_delivery import uid
from tests.e2e.jms_producers import JmsProducer
from tests.e2e.wire_peers import DispositionLog

pytestmark = pytest.mark.e2e

ACCEPTED, REJECTED = 0x24, 0x25
CONFIG = """
[[queues]]
name = "full"
max_depth = 1
overflow = "reject"
"""


@pytest.fixture
def broker(broker_factory):
    yield from broker_without_errors(broker_factory, CONFIG)


def settled_ids(log: DispositionLog) -> list[tuple[int, int | None]]:
    """(delivery-id, outcome) of every settlement, in wire order."""
    out = []
    for first, last, settled, outcome in log.dispositions:
        if settled:
            out.extend((i, outcome) for i in range(first, last + 1))
    return out


def client_view(transfers: dict[int, str], settlements: list[tuple[int, int | None]]) -> dict[str, int | None]:
    """What Qpid JMS reports to each send: it completes its oldest pending send of the
    session with the outcome of each settlement as it comes."""
    pending = deque(transfers[i] for i in sorted(transfers))
    return {pending.popleft(): outcome for _, outcome in settlements}


def test_two_producers_on_one_session_are_settled_in_arrival_order(broker):
    n = 300
    with api(broker) as c:
        # Fill the reject queue to its limit first.
        setup = DispositionLog("127.0.0.1", broker.port, container_id=f"fill-{uid()}").wait_open()
        p = JmsProducer(setup, setup.session(), "full")
        assert p.send_sync("filler").remote_state == Delivery.ACCEPTED
        setup.close()
        normal = uid("normal")
        client = DispositionLog("127.0.0.1", broker.port, container_id=f"ID:{uid()}:1").wait_open()
        try:
            ssn = client.session()
            to_normal, to_full = JmsProducer(client, ssn, normal), JmsProducer(client, ssn, "full")
            client.wait(lambda: to_normal.link.credit > 0 and to_full.link.credit > 0, what="credit")
            sends = []
            for i in range(n):   # asynchronous sends, alternating, as the application made them
                sends.append(("normal", to_normal.send_async(f"n{i}")))
                sends.append(("full", to_full.send_async(f"f{i}")))
                if i % 20 == 19:
                    client.pump(0)
            client.wait(lambda: all(d.remote_state or d.settled for _, d in sends), 60, "every outcome")
            client.pump_for(0.1)
        finally:
            client.close()
        assert c.get(f"/api/queues/{normal}").json()["depth"] == n
        assert c.get("/api/queues/full").json()["depth"] == 1
    # Each delivery's own outcome is right ...
    assert [kind for kind, d in sends if d.remote_state != (ACCEPTED if kind == "normal" else REJECTED)] == []
    # ... and so is the order they were settled in: ascending delivery-ids on the session.
    transfers = {tid: tag for tid, (_, tag) in client.transfers.items()}
    settlements = settled_ids(client)
    assert len(settlements) == 2 * n
    ids = [i for i, _ in settlements]
    out_of_order = sum(1 for a, b in zip(ids, sorted(ids)) if a != b)   # settled out of their place
    # What the application sees through Qpid JMS's completion matching.
    truth = {tag: (ACCEPTED if "normal" in name else REJECTED)
             for tag, name in ((t, client.link_names[h]) for h, t in client.transfers.values())}
    seen = client_view(transfers, settlements)
    wrong = sum(1 for tag, outcome in seen.items() if outcome != truth[tag])
    assert out_of_order == 0 and wrong == 0, \
        f"{out_of_order} settlements out of arrival order; {wrong} of {2 * n} sends would be " \
        "reported to the application with another send's outcome"


def test_one_link_accept_then_rejects_are_settled_in_order_on_the_wire(broker):
    """One producer, asynchronous persistent sends into a `max_depth = 1` reject queue
    left empty: the first is accepted once stored, the rest rejected at once but held
    behind it.  proton sends a plain `accepted` batched with the next ones and a
    `rejected` carrying its error at once, so written in one go they left the broker
    swapped: the outcomes must reach the wire in arrival order too."""
    q = "full"
    drain = DispositionLog("127.0.0.1", broker.port, container_id=f"drain-{uid()}").wait_open()
    try:   # the filler of the module's other test may be there: start from an empty queue
        rcv = drain.receiver(drain.session(), q, f"drain-{uid()}")
        rcv.flow(10)
        drain.pump_for(0.3)
        while rcv.current is not None:
            dlv = rcv.current
            rcv.recv(dlv.pending)
            rcv.advance()
            dlv.update(Delivery.ACCEPTED)
            dlv.settle()
        drain.pump_for(0.2)
    finally:
        drain.close()
    client = DispositionLog("127.0.0.1", broker.port, container_id=f"ID:{uid()}:1").wait_open()
    try:
        p = JmsProducer(client, client.session(), q)
        client.wait(lambda: p.link.credit > 0, what="credit")
        sends = [p.send_async(f"m{i}") for i in range(10)]
        client.wait(lambda: all(d.remote_state for d in sends), 30, "every outcome")
        client.pump_for(0.1)
    finally:
        client.close()
    assert [d.remote_state for d in sends] == [ACCEPTED] + [REJECTED] * 9
    ids = [i for i, _ in settled_ids(client)]
    assert ids == sorted(ids), f"settled on the wire in the order {ids}"
