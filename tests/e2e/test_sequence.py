"""Log-style reads of durable queues (docs/spark.md) against the real broker:
the sequence-range filter, $amqpbroker.queue-info, $amqpbroker.ack and duplicate
detection, including across restarts."""

from __future__ import annotations

import uuid

import pytest
from proton import Described, Message, Terminus, Timeout, symbol, ulong
from proton.reactor import LinkOption
from proton.utils import LinkDetached

from amqpbroker.spark.client import BrokerClient, BrokerError, ConnectionOptions, subscription_queue
from tests.client import connect, receive_all, terminus_filters
from tests.e2e.jms_links import durable_consumer

pytestmark = pytest.mark.e2e

CONFIG = """
[[queues]]
name = "volatile"
durable = false

[[duplicate_detection]]
pattern = "dd.*"
window = 3

[[duplicate_detection]]
pattern = "big-*"
"""

RANGE = symbol("amqpbroker:sequence-range")
# Several brokers may run at once: no fixed port for the management listener (ignored
# by a broker without one).
ENV = {"AMQPBROKER_MANAGEMENT__PORT": "0"}


def uniq(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def seqbroker(tmp_path_factory):
    from tests.broker_process import BrokerProcess

    proc = BrokerProcess(tmp_path_factory.mktemp("seq") / "data", config=CONFIG, env=ENV).start()
    yield proc
    proc.stop()


@pytest.fixture
def client(seqbroker):
    c = BrokerClient(ConnectionOptions(url=seqbroker.url, container_id=uniq("reader")))
    yield c
    c.close()


def send(url, address, bodies, durable=True, ids=None, **fields):
    conn = connect(url)
    try:
        sender = conn.create_sender(address)
        for i, body in enumerate(bodies):
            kw = dict(fields)
            if ids is not None:
                kw["id"] = ids[i]
            sender.send(Message(body=body, durable=durable, **kw))
    finally:
        conn.close()


class RangeOption(LinkOption):
    def __init__(self, value, mode=Terminus.DIST_MODE_COPY):
        self.value, self.mode = value, mode

    def apply(self, link):
        if self.mode is not None:
            link.source.distribution_mode = self.mode
        link.source.filter.put_object({RANGE: Described(RANGE, self.value)})


# ---------------------------------------------------------------------- sequence-range


def test_range_reads_stored_messages_in_order_with_sequence_annotation(seqbroker, client):
    q = uniq("log")
    send(seqbroker.url, q, [f"m{i}" for i in range(10)], annotations={symbol("x-opt-origin"): "test"},
         subject="s", properties={"k": 1})
    info = client.queue_info(q)
    assert (info["head"], info["tail"], info["durable"]) == (1, 10, True)
    got = list(client.read_range(q, 3, 7))
    assert [s for s, _ in got] == [3, 4, 5, 6]
    assert [m.body for _, m in got] == ["m2", "m3", "m4", "m5"]
    for seq, m in got:
        assert m.annotations[symbol("x-opt-sequence")] == seq
        assert isinstance(m.annotations[symbol("x-opt-sequence")], ulong)
        assert m.annotations[symbol("x-opt-origin")] == "test"    # the producer's annotations kept
        assert m.subject == "s" and m.properties == {"k": 1} and m.durable
    # Non-acquiring: a competing consumer still gets all ten afterwards.
    assert [m.body for m in receive_all(seqbroker.url, q)] == [f"m{i}" for i in range(10)]


def test_range_without_annotations_section_gets_one(seqbroker, client):
    q = uniq("log")
    send(seqbroker.url, q, [b"\x00\x01binary"])
    [(seq, m)] = list(client.read_range(q, 0, None))
    assert seq == 1 and m.body == b"\x00\x01binary"
    assert dict(m.annotations) == {symbol("x-opt-sequence"): 1}


def test_null_end_means_tail_at_attach_and_is_echoed(seqbroker):
    q = uniq("log")
    send(seqbroker.url, q, ["a", "b", "c"])
    conn = connect(seqbroker.url)
    try:
        rcv = conn.create_receiver(q, credit=0, options=[RangeOption([ulong(2), None])])
        flt = terminus_filters(rcv.link.remote_source)
        assert flt[RANGE].value == [2, 4]                     # served range [from, tail+1)
        send(seqbroker.url, q, ["d"])                         # after attach: not in the range
        rcv.link.drain(10)
        got = [rcv.receive(timeout=5).body for _ in range(2)]
        conn.wait(lambda: rcv.link.credit == 0, timeout=5)    # drain completed with credit 0
        assert got == ["b", "c"]
        with pytest.raises(Timeout):
            rcv.receive(timeout=0.3)
    finally:
        conn.close()


def test_drain_with_nothing_left_completes_at_once(seqbroker):
    q = uniq("log")
    send(seqbroker.url, q, ["a"])
    conn = connect(seqbroker.url)
    try:
        rcv = conn.create_receiver(q, credit=0, options=[RangeOption([ulong(5), ulong(9)])])
        assert terminus_filters(rcv.link.remote_source)[RANGE].value == [5, 5]   # empty: beyond the tail
        rcv.link.drain(50)
        conn.wait(lambda: rcv.link.credit == 0, timeout=5)
    finally:
        conn.close()


def test_end_beyond_tail_is_capped_and_credit_without_drain_just_stops(seqbroker):
    q = uniq("log")
    send(seqbroker.url, q, [str(i) for i in range(5)])
    conn = connect(seqbroker.url)
    try:
        rcv = conn.create_receiver(q, credit=100, options=[RangeOption([ulong(4), ulong(1000)])])
        assert terminus_filters(rcv.link.remote_source)[RANGE].value == [4, 6]
        assert [rcv.receive(timeout=5).body for _ in range(2)] == ["3", "4"]
        with pytest.raises(Timeout):
            rcv.receive(timeout=0.3)
    finally:
        conn.close()


def test_range_sees_acquired_messages_but_not_acknowledged_ones(seqbroker, client):
    q = uniq("log")
    send(seqbroker.url, q, [f"m{i}" for i in range(6)])
    conn = connect(seqbroker.url)
    try:
        rcv = conn.create_receiver(q, credit=3)
        held = [rcv.receive(timeout=5) for _ in range(3)]    # acquired, not settled
        assert [m.body for m in held] == ["m0", "m1", "m2"]
        assert [s for s, _ in client.read_range(q, 0, None)] == [1, 2, 3, 4, 5, 6]
        rcv.accept()                                          # m0 acknowledged: removed
    finally:
        conn.close()                                           # m1, m2 released back
    for _ in range(50):
        seqs = [s for s, _ in client.read_range(q, 0, None)]
        if seqs == [2, 3, 4, 5, 6]:
            break
    assert seqs == [2, 3, 4, 5, 6]


def test_many_messages_span_several_credit_rounds(seqbroker, client):
    q = uniq("log")
    n = 2500
    with BrokerClient(ConnectionOptions(url=seqbroker.url)) as producer:
        producer.send(q, (Message(body=f"m{i}", durable=True) for i in range(n)), window=500)
    got = list(client.read_range(q, 0, None, credit=300))
    assert [s for s, _ in got] == list(range(1, n + 1))
    assert got[-1][1].body == f"m{n - 1}"
    assert [s for s, _ in client.read_range(q, 1000, 1010)] == list(range(1000, 1010))


def test_durable_subscription_queue_is_readable_by_sequence(seqbroker, client):
    topic = uniq("prices")
    sub = uniq("sub")
    cid = uniq("jms_client")
    jms = connect(seqbroker.url, container_id=cid)
    try:
        durable_consumer(jms, topic, sub, credit=0)      # stays attached, takes nothing
        send(seqbroker.url, f"amq.topic/{topic}", [f"p{i}" for i in range(4)])
        queue = subscription_queue(sub, cid)
        assert "__" in queue                              # `_` doubled in the client-id
        info = client.queue_info(queue)
        assert info["tail"] - info["head"] == 3
        got = [m.body for _, m in client.read_range(queue, info["head"], None)]
        assert got == ["p0", "p1", "p2", "p3"]
    finally:
        jms.close()


@pytest.mark.parametrize("value, mode, condition", [
    ([ulong(5), ulong(2)], Terminus.DIST_MODE_COPY, "amqp:invalid-field"),
    (["a", "b"], Terminus.DIST_MODE_COPY, "amqp:invalid-field"),
    ([ulong(1), ulong(2)], Terminus.DIST_MODE_MOVE, "amqp:invalid-field"),
])
def test_bad_range_attach_refused(seqbroker, value, mode, condition):
    q = uniq("log")
    send(seqbroker.url, q, ["x"])
    conn = connect(seqbroker.url)
    try:
        with pytest.raises(LinkDetached) as err:
            conn.create_receiver(q, credit=0, options=[RangeOption(value, mode)])
        assert err.value.condition == condition
    finally:
        conn.close()


def test_range_on_missing_or_non_durable_queue_refused(seqbroker):
    conn = connect(seqbroker.url)
    try:
        with pytest.raises(LinkDetached) as err:
            conn.create_receiver(uniq("missing"), credit=0, options=[RangeOption([ulong(0), None])])
        assert err.value.condition == "amqp:not-found"
        with pytest.raises(LinkDetached) as err:
            conn.create_receiver("volatile", credit=0, options=[RangeOption([ulong(0), None])])
        assert err.value.condition == "amqp:not-implemented"
    finally:
        conn.close()


# ---------------------------------------------------------------------- queue-info


def test_queue_info_of_empty_and_missing_queue(seqbroker, client):
    q = uniq("log")
    send(seqbroker.url, q, ["a", "b"])
    receive_all(seqbroker.url, q)
    info = client.queue_info(q)
    assert info["tail"] == 2 and info["head"] == 3 and info["depth"] == 0    # empty: head = tail + 1
    with pytest.raises(BrokerError):
        client.queue_info(uniq("missing"))
    vol = client.queue_info("volatile")
    assert vol["durable"] is False and "tail" not in vol


def test_queue_info_without_reply_to_is_rejected(seqbroker):
    conn = connect(seqbroker.url)
    try:
        snd = conn.create_sender("$amqpbroker.queue-info")
        from proton.utils import SendException
        with pytest.raises(SendException):
            snd.send(Message(properties={"queue": "volatile"}))
    finally:
        conn.close()


# ---------------------------------------------------------------------- ack-below


def test_ack_below_removes_claims_and_survives_restart(broker_factory):
    b = broker_factory(CONFIG, env=ENV)
    q = uniq("log")
    send(b.url, q, [f"m{i}" for i in range(10)])
    r1 = BrokerClient(ConnectionOptions(url=b.url))
    r2 = BrokerClient(ConnectionOptions(url=b.url))
    try:
        r1.ack_below(q, 6, reader="r1")
        info = r1.queue_info(q)
        assert (info["head"], info["tail"], info["depth"]) == (6, 10, 5)
        assert (info["reader"], info["acked-below"]) == ("r1", 6)
        with pytest.raises(BrokerError) as err:
            r2.ack_below(q, 8, reader="r2")
        assert err.value.condition == "amqp:resource-locked"
        r1.ack_below(q, 3, reader="r1")          # going back changes nothing
        assert r1.queue_info(q)["acked-below"] == 6
    finally:
        r1.close()
        r2.close()
    b.restart()
    r1 = BrokerClient(ConnectionOptions(url=b.url))
    r2 = BrokerClient(ConnectionOptions(url=b.url))
    try:
        info = r1.queue_info(q)
        assert (info["head"], info["tail"], info["reader"]) == (6, 10, "r1")   # entries deleted from the store
        assert [s for s, _ in r1.read_range(q, 0, None)] == [6, 7, 8, 9, 10]
        with pytest.raises(BrokerError):
            r2.ack_below(q, 8, reader="r2")       # the claim was stored
        r1.release_claim(q, reader="r1")
        r2.ack_below(q, 8, reader="r2")
        assert [m.body for m in receive_all(b.url, q)] == ["m7", "m8", "m9"]
        send(b.url, q, ["after"])
        assert r2.queue_info(q)["tail"] == 11    # sequences never go back
    finally:
        r1.close()
        r2.close()


def test_ack_below_skips_messages_held_by_a_consumer(seqbroker, client):
    q = uniq("log")
    send(seqbroker.url, q, [f"m{i}" for i in range(5)])
    conn = connect(seqbroker.url)
    try:
        rcv = conn.create_receiver(q, credit=1)
        assert rcv.receive(timeout=5).body == "m0"      # seq 1 acquired
        client.ack_below(q, 4, reader=uniq("r"))
        assert client.queue_info(q)["depth"] == 3       # held seq 1, plus 4 and 5
    finally:
        conn.close()
    assert [m.body for m in receive_all(seqbroker.url, q)] == ["m0", "m3", "m4"]


def test_ack_on_missing_or_non_durable_queue_rejected(seqbroker, client):
    with pytest.raises(BrokerError) as err:
        client.ack_below(uniq("missing"), 3, reader="r")
    assert err.value.condition == "amqp:not-found"
    with pytest.raises(BrokerError) as err:
        client.ack_below("volatile", 3, reader="r")
    assert err.value.condition == "amqp:not-implemented"


# ---------------------------------------------------------------------- duplicate detection


def test_duplicates_dropped_per_address_with_bounded_window(seqbroker):
    q = f"dd.{uuid.uuid4().hex[:8]}"
    send(seqbroker.url, q, ["a", "b", "a-again"], ids=["a", "b", "a"])
    assert [m.body for m in receive_all(seqbroker.url, q)] == ["a", "b"]
    # Window 3, LRU by arrival: after c, d, e the window is c, d, e; a and b are forgotten.
    send(seqbroker.url, q, ["c", "d", "e", "a2", "d2"], ids=["c", "d", "e", "a", "d"])
    assert [m.body for m in receive_all(seqbroker.url, q)] == ["c", "d", "e", "a2"]
    # Typed ids: ulong 1 and string "1" differ; messages without an id are never duplicates.
    send(seqbroker.url, q, ["u1", "s1", "u1-again"], ids=[ulong(1), "1", ulong(1)])
    send(seqbroker.url, q, ["n1", "n2"])
    assert [m.body for m in receive_all(seqbroker.url, q)] == ["u1", "s1", "n1", "n2"]


def test_duplicate_detection_only_where_configured(seqbroker):
    q = uniq("plain")
    send(seqbroker.url, q, ["a", "b"], ids=["x", "x"])
    assert [m.body for m in receive_all(seqbroker.url, q)] == ["a", "b"]


def test_anonymous_relay_dedups_by_to(seqbroker):
    q = f"dd.{uuid.uuid4().hex[:8]}"
    conn = connect(seqbroker.url)
    try:
        snd = conn.create_sender(None)
        for body in ("one", "two"):
            snd.send(Message(address=q, id="same", body=body, durable=True))
    finally:
        conn.close()
    assert [m.body for m in receive_all(seqbroker.url, q)] == ["one"]


def test_duplicate_window_survives_restart(broker_factory):
    b = broker_factory(CONFIG, env=ENV)
    q = f"big-{uuid.uuid4().hex[:8]}"
    send(b.url, q, [f"m{i}" for i in range(20)], ids=[f"id{i}" for i in range(20)])
    b.restart()
    send(b.url, q, [f"again{i}" for i in range(25)], ids=[f"id{i}" for i in range(25)])
    bodies = [m.body for m in receive_all(b.url, q)]
    assert bodies == [f"m{i}" for i in range(20)] + [f"again{i}" for i in range(20, 25)]
    b.kill()   # a crash: ids were committed with their messages
    b.start()
    send(b.url, q, ["late"], ids=["id24"])
    assert receive_all(b.url, q) == []


def test_client_creates_a_durable_subscription_that_collects_while_detached(seqbroker):
    topic, sub, cid = uniq("events"), uniq("pipeline"), uniq("app")
    with BrokerClient(ConnectionOptions(url=seqbroker.url, container_id=cid)) as c:
        queue = c.ensure_durable_subscription(topic, sub)
        assert queue == subscription_queue(sub, cid)
        send(seqbroker.url, f"amq.topic/{topic}", ["e1", "e2"])
        assert [m.body for _, m in c.read_range(queue, 0, None)] == ["e1", "e2"]
        assert c.ensure_durable_subscription(topic, sub) == queue      # again: the same subscription
        assert c.queue_info(queue)["depth"] == 2


ACL_CONFIG = """
[users.alice]
password = "alice-secret"
groups = ["pipelines"]

[[acl]]
group = "pipelines"
pattern = "#"
permissions = ["all"]

[anonymous]
pattern = "#"
permissions = ["send", "browse"]
"""


def test_acl_browse_reads_and_consume_acknowledges(broker_factory):
    b = broker_factory(ACL_CONFIG, env=ENV)
    q = uniq("log")
    send(b.url, q, ["a", "b", "c"])
    with BrokerClient(ConnectionOptions(url=b.url)) as anon:
        assert anon.queue_info(q)["tail"] == 3                       # browse
        assert [s for s, _ in anon.read_range(q, 0, None)] == [1, 2, 3]
        with pytest.raises(BrokerError) as err:
            anon.ack_below(q, 3, reader="anon")                      # removing needs consume
        assert err.value.condition == "amqp:unauthorized-access"
    with BrokerClient(ConnectionOptions(url=b.url, user="alice", password="alice-secret")) as alice:
        alice.ack_below(q, 3, reader="alice")
        assert alice.queue_info(q)["head"] == 3
