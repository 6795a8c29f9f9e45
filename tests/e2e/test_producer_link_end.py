"""End-to-end: a producer's link or session ends while its durable transfers wait for
the store commit (their Accepted goes out only once the message is on disk).

Detach and end free the link and the session in proton; the settlements waiting
for the commit must neither touch freed deliveries (the broker died of SIGSEGV:
tests/fuzz/test_regressions.py::test_durable_transfer_then_detach_and_end_before_the_commit)
nor be lost while the session lives, and the messages stay stored either way.
"""

from __future__ import annotations

import pytest
from proton import Delivery
from proton import Message as ProtonMessage

from tests.e2e.helpers_conn import RawClient
from tests.e2e.helpers_delivery import connection, drain_bodies, receiver, uid

pytestmark = pytest.mark.e2e


def _send_durable(snd, bodies: list[str]) -> list:
    sent = []
    for body in bodies:
        dlv = snd.delivery(body.encode())
        snd.send(ProtonMessage(body=body, durable=True).encode())
        snd.advance()
        sent.append(dlv)
    return sent


def _stored(broker, address: str) -> list:
    with connection(broker) as conn:
        return drain_bodies(conn, receiver(conn, address, credit=500))


@pytest.mark.parametrize("ending", ["detach", "close"])
def test_link_ended_before_the_commit_still_gets_accepted_once_stored(broker, ending):
    q = uid("link-end-before-commit")
    client = RawClient("127.0.0.1", broker.port).wait_open()
    try:
        ssn = client.session()
        bodies = []
        for rnd in range(10):
            snd = client.sender(ssn, q, "producer")      # the same name again: the old link is gone
            batch = [f"{rnd}-{i}" for i in range(5)]
            bodies += batch
            sent = _send_durable(snd, batch)
            snd.detach() if ending == "detach" else snd.close()   # at once, before the outcomes
            # The session lives on: the outcomes come (AMQP 1.0 §2.7.6), after the commit.
            client.wait(lambda sent=sent: all(d.remote_state for d in sent), 10, "the outcomes")
            assert [d.remote_state for d in sent] == [Delivery.ACCEPTED] * 5
        # The connection and the session still work.
        snd = client.sender(ssn, q, "after")
        sent = _send_durable(snd, ["last"])
        client.wait(lambda: sent[0].remote_state, 10, "the last outcome")
        assert sent[0].remote_state == Delivery.ACCEPTED
    finally:
        client.close()
    assert broker.proc.poll() is None
    assert sorted(_stored(broker, q)) == sorted(bodies + ["last"])


@pytest.mark.parametrize("ending", ["end", "close-and-end", "detach-and-end"])
def test_session_ended_before_the_commit_keeps_the_messages(broker, ending):
    q = uid("session-end-before-commit")
    bodies = []
    for rnd in range(30):
        client = RawClient("127.0.0.1", broker.port).wait_open()
        try:
            ssn = client.session()
            snd = client.sender(ssn, q, f"producer-{rnd}")
            batch = [f"{rnd}-{i}" for i in range(3)]
            bodies += batch
            _send_durable(snd, batch)
            if ending == "close-and-end":
                snd.close()
            elif ending == "detach-and-end":
                snd.detach()
            ssn.close()                  # nothing can be settled on it any more
            # Another session on the connection works once the commit has come.
            client.pump_for(0.05)
            other = client.sender(client.session(), q, f"other-{rnd}")
            sent = _send_durable(other, [f"{rnd}-other"])
            bodies.append(f"{rnd}-other")
            client.wait(lambda sent=sent: sent[0].remote_state, 10, "the other session's outcome")
            assert sent[0].remote_state == Delivery.ACCEPTED
        finally:
            client.close()
        assert broker.proc.poll() is None, "".join(broker.lines[-20:])
    # Received before the end: stored, though the producer never heard so.
    assert sorted(_stored(broker, q)) == sorted(bodies)
