"""The data source's driver-side logic without a SparkSession: offsets, admission
control, Trigger.AvailableNow, partitions, commit → ack, row (de)coding."""

from __future__ import annotations

import json
import pickle

import pytest
from proton import Message, symbol, ulong
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

from amqpbroker.core.sequence import with_sequence
from amqpbroker.spark.client import ConnectionLost, subscription_queue
from amqpbroker.spark.source import (
    AmqpOptions,
    AmqpStreamReader,
    arrow_batches,
    split,
    to_message,
    to_row,
)

pytestmark = pytest.mark.spark


class FakeClient:
    def __init__(self, fail=False):
        self.acks = []
        self.fail = fail

    def ack_below(self, queue, below, reader):
        if self.fail:
            raise ConnectionLost("broker away")
        self.acks.append((queue, below, reader))


class FakeDriver:
    def __init__(self, infos):
        self._infos = infos
        self.client = FakeClient()
        self.closed = 0

    def infos(self):
        return {q: dict(i) for q, i in self._infos.items()}

    def locate(self, key):
        return key, None          # a single broker: the key is the queue

    def client_for(self, url):
        return self.client

    def close(self):
        self.closed += 1


def reader(infos, **options):
    opts = {"url": "amqp://127.0.0.1:1", "address": ",".join(infos)}
    opts.update({k: str(v) for k, v in options.items()})
    r = AmqpStreamReader(AmqpOptions.parse(opts))
    r._driver = FakeDriver(infos)
    return r


def test_options_parse_and_subscription_queue_name():
    o = AmqpOptions.parse({"url": "amqp://h:1", "address": "b, a", "credit": "50", "numpartitions": "3",
                           "maxrecordsperbatch": "7", "subscription": "my_sub", "clientid": "app_1"})
    assert o.queues == ["b", "a", "qpidsub_/app__1_/my__sub_/durable"]
    assert (o.credit, o.num_partitions, o.max_records_per_batch) == (50, 3, 7)
    assert o.need_queues() == sorted(o.queues)
    assert o.connection.url == "amqp://h:1"
    assert subscription_queue("s") == "qpidsub_/__global___/s_/durable"       # global subscription
    with pytest.raises(ValueError):
        AmqpOptions.parse({}).need_queues()


def test_initial_offsets_earliest_latest_and_json_in_fixed_key_order():
    infos = {"b": {"head": 5, "tail": 9}, "a": {"head": 1, "tail": 3}}
    assert reader(infos).initialOffset() == {"a": 1, "b": 5}
    assert list(reader(infos).initialOffset()) == ["a", "b"]
    assert reader(infos, startingOffsets="latest").initialOffset() == {"a": 4, "b": 10}
    assert reader(infos, startingOffsets='{"b": 7}').initialOffset() == {"a": 1, "b": 7}
    assert json.dumps(reader(infos).initialOffset()) == '{"a": 1, "b": 5}'


def test_latest_offset_respects_read_limits():
    r = reader({"q": {"head": 1, "tail": 100}}, maxRecordsPerBatch=30)
    assert r.getDefaultReadLimit() == ReadMaxRows(30)
    assert r.latestOffset({"q": 1}, ReadMaxRows(30)) == {"q": 31}
    assert r.latestOffset({"q": 91}, ReadMaxRows(30)) == {"q": 101}
    assert r.latestOffset({"q": 101}, ReadMaxRows(30)) == {"q": 101}     # nothing new: same as start
    assert r.latestOffset({"q": 1}, ReadAllAvailable()) == {"q": 101}    # the engine's limit wins
    assert reader({"q": {"head": 1, "tail": 5}}).getDefaultReadLimit() == ReadAllAvailable()


def test_read_limit_is_shared_across_queues():
    r = reader({"a": {"head": 1, "tail": 10}, "b": {"head": 1, "tail": 10}})
    assert r.latestOffset({"a": 1, "b": 1}, ReadMaxRows(15)) == {"a": 11, "b": 6}


def test_trigger_available_now_stops_at_the_tail_seen_when_prepared():
    r = reader({"q": {"head": 1, "tail": 20}})
    r.prepareForTriggerAvailableNow()
    r._driver._infos["q"]["tail"] = 500                    # more arrive afterwards
    assert r.latestOffset({"q": 1}, ReadMaxRows(15)) == {"q": 16}
    assert r.latestOffset({"q": 16}, ReadMaxRows(15)) == {"q": 21}
    assert r.latestOffset({"q": 21}, ReadMaxRows(15)) == {"q": 21}
    assert r.reportLatestOffset() == {"q": 21}


def test_partitions_split_ranges():
    r = reader({"a": {"head": 1, "tail": 10}, "b": {"head": 1, "tail": 10}}, numPartitions=3)
    parts = r.partitions({"a": 1, "b": 4}, {"a": 11, "b": 6})
    assert [(p.queue, p.start, p.end) for p in parts] == [
        ("a", 1, 5), ("a", 5, 8), ("a", 8, 11), ("b", 4, 5), ("b", 5, 6)]
    assert r.partitions({"a": 3, "b": 3}, {"a": 3, "b": 3}) == []
    assert [(p.start, p.end) for p in split("q", 0, 10, 4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_commit_acknowledges_below_end_and_survives_a_broker_outage():
    r = reader({"q": {"head": 1, "tail": 10}})
    r.commit({"q": 11})
    assert r._driver.client.acks == [("q", 11, "spark:q")]
    r._driver.client.fail = True
    r.commit({"q": 12})                                    # logged, not raised
    assert r._driver.closed == 1
    off = reader({"q": {"head": 1, "tail": 10}}, ackOnCommit="false")
    off.commit({"q": 11})
    assert off._driver.client.acks == []


def test_reader_pickles_without_its_connection():
    r = reader({"q": {"head": 1, "tail": 10}})
    copy = pickle.loads(pickle.dumps(r))
    assert copy._driver is None and copy.queues == ["q"]


def test_to_row_columns():
    raw = Message(body="héllo", id="m1", correlation_id=ulong(7), subject="s", durable=True,
                  creation_time=1700000000.25, content_type="text/plain", address="q", reply_to="r",
                  properties={"a": 1, "b": None}, annotations={symbol("x-opt-x"): 1}).encode()
    row = to_row("q", with_sequence(bytes(raw), 42))
    body, text, subject, mid, corr, created, props, app, seq, queue = row
    assert (body, text, subject, mid, corr) == ("héllo".encode(), "héllo", "s", "m1", "7")
    assert created == 1700000000250000
    assert props == {"to": "q", "reply-to": "r", "content-type": "text/plain"}
    assert app == {"a": "1", "b": None} and (seq, queue) == (42, "q")
    binary = to_row("q", with_sequence(bytes(Message(body=b"\xff\x00").encode()), 1))
    assert binary[:3] == (b"\xff\x00", None, None) and binary[6] == {}
    mapped = to_row("q", with_sequence(bytes(Message(body={"k": 1}).encode()), 1))
    assert json.loads(mapped[1]) == {"k": 1}


def test_arrow_batches_match_the_spark_schema():
    rows = [to_row("q", with_sequence(bytes(Message(body=f"m{i}").encode()), i)) for i in range(10)]
    batches = list(arrow_batches(iter(rows), size=4))
    assert [b.num_rows for b in batches] == [4, 4, 2]
    assert batches[0].column("sequence").to_pylist() == [0, 1, 2, 3]


def test_to_message_encodings():
    m = Message()
    m.decode(to_message({"body": b"\x01", "subject": "s", "application_properties": [("k", "v")]}, "id-1"))
    assert (bytes(m.body), m.subject, m.properties, m.id, m.durable) == (b"\x01", "s", {"k": "v"}, "id-1", True)
    m = Message()
    m.decode(to_message({"body": "text", "correlation_id": "c"}, "id-2", durable=False))
    assert (m.body, m.correlation_id, m.durable) == ("text", "c", False)
    m.decode(to_message({"key": "a", "n": 2}, "id-3"))
    assert (json.loads(m.body), m.content_type) == ({"key": "a", "n": 2}, "application/json")


def test_driver_reconnects_once_after_a_lost_connection(monkeypatch):
    import amqpbroker.spark.source as source

    made = []

    class Flaky:
        def __init__(self, opts):
            self.n = len(made)
            made.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def cluster_info(self, address=None):
            return None           # a single broker

        def queue_info(self, q):
            if self.n == 1:       # (client 0 asked whether it is a cluster)
                raise ConnectionLost("idle timeout")
            return {"head": 1, "tail": 2}

        def close(self):
            pass

    monkeypatch.setattr(source, "BrokerClient", Flaky)
    d = source._Driver(AmqpOptions.parse({"address": "q"}))
    assert d.infos() == {"q": {"head": 1, "tail": 2}} and len(made) == 4   # discovery, lost, discovery, queue-info
