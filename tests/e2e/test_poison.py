"""End-to-end: hostile messages (tests/poison.py) never stall a queue, its selector
consumers or its producers, and a malformed routing field is rejected with
`amqp:decode-error` before it is queued.  Durable poison survives a restart harmlessly."""

from __future__ import annotations

import pytest
from proton import Delivery, Message

from amqpbroker.core.codec import encode
from tests.broker_process import BrokerProcess
from tests.client import SourceOptions
from tests.e2e.helpers_conn import RawClient
from tests.e2e.helpers_delivery import (
    connection,
    drain_bodies,
    nothing_arrives,
    receiver,
    sender,
    uid,
    wait_settled,
)
from tests.poison import CASES, OPAQUE, REJECT, section

pytestmark = pytest.mark.e2e

DURABLE_HEADER = section(0x70, encode([True]))


@pytest.fixture(scope="module")
def poison_broker(tmp_path_factory):
    proc = BrokerProcess(tmp_path_factory.mktemp("poison") / "data").start()
    yield proc
    proc.stop()


def send_raw(conn, snd, raw: bytes) -> Delivery:
    dlv = snd.link.delivery(uid("tag").encode())
    snd.link.send(raw)
    snd.link.advance()
    wait_settled(conn, dlv)
    return dlv


def take_raw(broker, q: str, outcome: int) -> bytes:
    """The next message on `q` as the bytes the broker sent (a client library would
    choke on decoding it), settled with `outcome`."""
    client = RawClient("127.0.0.1", broker.port, container_id=uid("raw")).wait_open()
    link = client.receiver(client.session(), q, uid("raw-rcv"))
    link.flow(1)
    client.wait(lambda: link.current is not None and not link.current.partial, what="a delivery")
    dlv = link.current
    raw = link.recv(dlv.pending)
    link.advance()
    dlv.update(outcome)
    dlv.settle()
    client.close()
    return raw


def good(body: str) -> Message:
    return Message(body=body, properties={"color": "red"}, durable=True)


@pytest.mark.parametrize("name", list(CASES))
def test_a_hostile_message_never_stalls_its_queue(poison_broker, name):
    raw, what = CASES[name]
    if what == OPAQUE:
        raw = DURABLE_HEADER + raw         # stored, so it meets recovery too
    q = uid("poison")
    with connection(poison_broker) as conn:
        picky = receiver(conn, q, credit=10, options=SourceOptions(selector="color = 'red'"))
        snd = sender(conn, q)
        snd.send(good("before"))
        dlv = send_raw(conn, snd, raw)
        if what == REJECT:
            assert dlv.remote_state == Delivery.REJECTED
            assert dlv.remote.condition.name == "amqp:decode-error", dlv.remote.condition
        else:
            assert dlv.remote_state == Delivery.ACCEPTED
        snd.send(good("after"))            # the same producer goes on
        sender(conn, q).send(good("later"))  # and so does a new one
        assert drain_bodies(conn, picky) == ["before", "after", "later"]
    if what == REJECT:
        line = poison_broker.wait_for_log(r"message on link '[^']+' rejected: amqp:decode-error")
        assert "connection 127.0.0.1:" in line
        with connection(poison_broker) as conn:
            assert nothing_arrives(conn, receiver(conn, q, credit=10))
        return
    # A consumer without a selector gets the opaque message, byte for byte.
    assert take_raw(poison_broker, q, Delivery.RELEASED) == raw   # left for after the restart
    poison_broker.stop()
    poison_broker.start()
    with connection(poison_broker) as conn:
        picky = receiver(conn, q, credit=10, options=SourceOptions(selector="color = 'red'"))
        snd = sender(conn, q)
        snd.send(good("after-restart"))
        assert drain_bodies(conn, picky) == ["after-restart"]
    assert take_raw(poison_broker, q, Delivery.ACCEPTED) == raw
    with connection(poison_broker) as conn:
        assert nothing_arrives(conn, receiver(conn, q, credit=10))
    assert "Traceback" not in poison_broker.log_text()
    assert "internal-error" not in poison_broker.log_text()
