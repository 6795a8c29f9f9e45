"""Temporary destinations, request/reply, queue browsers and message groups."""

from __future__ import annotations

import uuid

import pytest
from proton import Message, Terminus, Timeout
from proton.utils import LinkDetached

from tests.cluster_process import CLUSTER_KINDS, broker_or_cluster
from tests.client import SourceOptions, connect
from tests.e2e.helpers_conn import RawClient
from tests.e2e.jms_wire import JmsSession, dynamic_target_sender

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=CLUSTER_KINDS)
def broker(request, tmp_path_factory):
    """One broker, and a cluster whose client node owns nothing (every link forwarded)."""
    yield from broker_or_cluster(request.param, tmp_path_factory)


def uniq(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def no_more(receiver, wait: float = 0.5) -> bool:
    try:
        receiver.receive(timeout=wait)   # a short wait is the check that nothing else comes
        return False
    except Timeout:
        return True


def test_dynamic_source_reply_queue_request_reply(broker):
    service_q = uniq("service")
    server = connect(broker.url)
    requests = server.create_receiver(service_q, credit=10)
    replier = server.create_sender(None)   # anonymous relay: replies go by `to`
    client = connect(broker.url)
    reply_rcv = client.create_receiver(None, dynamic=True)
    reply_to = reply_rcv.remote_source.address
    assert reply_to and reply_to.startswith("amqpbroker.temp-queue.")
    client.create_sender(service_q).send(Message(body="ping", reply_to=reply_to, correlation_id="c-1"))
    req = requests.receive(timeout=5)
    requests.accept()
    replier.send(Message(address=req.reply_to, correlation_id=req.correlation_id, body=req.body + "-pong"))
    reply = reply_rcv.receive(timeout=5)
    assert (reply.body, reply.correlation_id) == ("ping-pong", "c-1")
    reply_rcv.close()
    # The temporary queue died with its link: the address is unknown now.
    with pytest.raises(Exception):
        replier.send(Message(address=reply_to, body="late"))
    client.close()
    server.close()


def test_temporary_queue_lives_until_creating_link_closes(broker):
    client = RawClient("127.0.0.1", broker.port, container_id=uniq("jms")).wait_open()
    session = client.session()
    creator = dynamic_target_sender(client, session, "temporary-queue")
    address = creator.remote_target.address
    other = connect(broker.url)
    other.create_sender(address).send(Message(body="to-temp"))   # anyone may send
    consumer = JmsSession(client).consumer(address)               # only its creator consumes
    assert consumer.receive().body == "to-temp"
    consumer.acknowledge()
    consumer.close()
    creator.close()
    client.wait(lambda: creator.state & creator.REMOTE_CLOSED, what="detach")
    other.close()
    fresh = connect(broker.url)
    with pytest.raises(LinkDetached) as gone:
        fresh.create_sender(address)
    assert "amqp:not-found" in str(gone.value)
    fresh.close()
    client.close()


def test_temporary_topic_fans_out_and_goes_with_connection(broker):
    client = RawClient("127.0.0.1", broker.port, container_id=uniq("jms")).wait_open()
    session = client.session()
    creator = dynamic_target_sender(client, session, "temporary-topic")
    address = creator.remote_target.address
    assert address.startswith("amqpbroker.temp-topic.")
    subs = JmsSession(client)
    a = subs.consumer(address, capability="topic")
    b = subs.consumer(address, capability="topic")
    pub = connect(broker.url)
    pub.create_sender(address).send(Message(body="all"))
    assert a.receive().body == "all" and b.receive().body == "all"
    client.close()   # the creating connection ends: the temporary topic goes
    pub.close()
    late = connect(broker.url)
    with pytest.raises(LinkDetached):
        late.create_sender(address)
    late.close()


def test_queue_browser_does_not_consume(broker):
    q = uniq("q")
    conn = connect(broker.url)
    snd = conn.create_sender(q)
    for i in range(3):
        snd.send(Message(body=i))
    browser = conn.create_receiver(q, options=SourceOptions(distribution_mode=Terminus.DIST_MODE_COPY))
    seen = [browser.receive(timeout=5).body for _ in range(3)]
    browser.accept()
    assert seen == [0, 1, 2]
    assert no_more(browser), "each message is browsed once"
    snd.send(Message(body=3))
    assert browser.receive(timeout=5).body == 3, "new arrivals are browsed too"
    browser.close()
    consumer = conn.create_receiver(q, credit=10)
    assert [consumer.receive(timeout=5).body for _ in range(4)] == [0, 1, 2, 3]
    conn.close()


def test_message_groups_stick_then_rebalance(broker):
    q = uniq("q")
    conn = connect(broker.url)
    snd = conn.create_sender(q)
    c1 = connect(broker.url)
    c2 = connect(broker.url)
    r1 = c1.create_receiver(q, credit=100)
    r2 = c2.create_receiver(q, credit=100)
    for i in range(10):
        snd.send(Message(body=f"a{i}", group_id="A"))
        snd.send(Message(body=f"b{i}", group_id="B"))

    def take(r):
        out = []
        while True:
            try:
                out.append(r.receive(timeout=0.5).body)
                r.accept()
            except Timeout:
                return out

    got1, got2 = take(r1), take(r2)
    groups1 = {b[0] for b in got1}
    groups2 = {b[0] for b in got2}
    assert groups1.isdisjoint(groups2) and groups1 | groups2 == {"a", "b"}
    for got in (got1, got2):   # order within each group holds
        for g in "ab":
            seq = [int(x[1:]) for x in got if x[0] == g]
            assert seq == sorted(seq)
    # The owner of group A leaves: A moves to the remaining consumer.
    owner_of_a, other = (c1, r2) if "a" in groups1 else (c2, r1)
    owner_of_a.close()
    snd.send(Message(body="a-after", group_id="A"))
    assert other.receive(timeout=5).body == "a-after"
    conn.close()
    (c2 if owner_of_a is c1 else c1).close()
