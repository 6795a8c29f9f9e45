"""The `amqp` Python data source for Spark (pyspark >= 4.2; the `spark` extra).

    spark.dataSource.register(AmqpDataSource)          # or amqpbroker.spark.register(spark)
    spark.readStream.format("amqp").option("url", ...).option("address", "orders-log").load()

Reading is by sequence number from durable queues (docs/spark.md): a micro-batch is
a range [start, end) per queue, offsets are `{"<queue>": next_seq}`, and a replayed
batch reads exactly the same stored messages.  `commit(end)` acknowledges below
`end` (the broker removes what the query has processed).  Writing gives every row a
deterministic message-id `<query id>:<batch id>:<partition>:<row>`, so a replayed
batch is dropped by the broker's duplicate detection: exactly-once into the broker.

Where things run: the DataSource/reader/writer objects are pickled to the Python
workers, so nothing connects in `__init__`; `read()`/`write()` open their own
connection in the executor, the driver-side reader keeps one connection for
queue-info polls and acknowledgements.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    BinaryType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from proton import symbol

from ..core.codec import encode
from ..core.message import APPLICATION_PROPERTIES, PROPERTIES
from ..core.message import Message as CoreMessage
from .client import BrokerClient, BrokerError, ConnectionOptions, subscription_queue
from .cluster import Streams, query, with_url, write_target

log = logging.getLogger("amqpbroker.spark")

SCHEMA = StructType([
    StructField("body", BinaryType()),
    StructField("body_text", StringType()),
    StructField("subject", StringType()),
    StructField("message_id", StringType()),
    StructField("correlation_id", StringType()),
    StructField("creation_time", TimestampType()),
    StructField("properties", MapType(StringType(), StringType())),
    StructField("application_properties", MapType(StringType(), StringType())),
    StructField("sequence", LongType()),
    StructField("queue", StringType()),
])

def _flag(value: Any, default: bool) -> bool:
    return default if value is None else str(value).strip().lower() in ("1", "true", "yes", "on")


@dataclass
class AmqpOptions:
    """Data source options (Spark lower-cases the keys)."""
    connection: ConnectionOptions
    queues: list[str] = field(default_factory=list)
    credit: int = 1000
    batch_size: int = 1000                  # writes: unsettled transfers in flight
    num_partitions: int = 1                 # reads: tasks per queue and micro-batch
    max_records_per_batch: int | None = None
    starting_offsets: str = "earliest"      # earliest | latest | JSON {"queue": seq}
    ending_offsets: str = "latest"          # batch reads: latest | JSON {"queue": seq}
    reader: str = ""
    ack_on_commit: bool = True
    durable: bool = True
    write_id: str | None = None

    @classmethod
    def parse(cls, options: Any) -> "AmqpOptions":
        o = {str(k).lower(): v for k, v in dict(options).items()}
        queues = [q.strip() for q in str(o.get("address", "")).split(",") if q.strip()]
        if o.get("subscription"):
            queues.append(subscription_queue(o["subscription"], o.get("clientid"),
                                             durable=_flag(o.get("subscriptiondurable"), True)))
        mrb = o.get("maxrecordsperbatch")
        return cls(
            connection=ConnectionOptions.from_options(o),
            queues=queues,
            credit=int(o.get("credit", 1000)),
            batch_size=int(o.get("batchsize", 1000)),
            num_partitions=max(1, int(o.get("numpartitions", 1))),
            max_records_per_batch=int(mrb) if mrb else None,
            starting_offsets=str(o.get("startingoffsets", "earliest")),
            ending_offsets=str(o.get("endingoffsets", "latest")),
            reader=str(o.get("reader") or ("spark:" + ",".join(queues))),
            ack_on_commit=_flag(o.get("ackoncommit"), True),
            durable=_flag(o.get("durable"), True),
            write_id=o.get("writeid"),
        )

    def need_queues(self) -> list[str]:
        if not self.queues:
            raise ValueError("the amqp source needs option 'address' (queue names, comma-separated) "
                             "or 'subscription' (+ 'clientId')")
        return sorted(set(self.queues))


# ---------------------------------------------------------------------- reading


class RangePartition(InputPartition):
    """[start, end) of one queue; in a cluster, of one queue on one node (`url`), the
    row's `queue` column then `<queue>@<node>` (the offsets key)."""

    def __init__(self, queue: str, start: int, end: int, url: str | None = None, key: str | None = None):
        super().__init__((queue, start, end, url))
        self.queue, self.start, self.end = queue, start, end
        self.url = url
        self.key = key or queue


def split(queue: str, start: int, end: int, parts: int, url: str | None = None,
          key: str | None = None) -> list[RangePartition]:
    """[start, end) in up to `parts` contiguous ranges of (nearly) equal span."""
    span = end - start
    if span <= 0:
        return []
    parts = max(1, min(parts, span))
    step, extra = divmod(span, parts)
    out, s = [], start
    for i in range(parts):
        e = s + step + (1 if i < extra else 0)
        out.append(RangePartition(queue, s, e, url, key))
        s = e
    return out


def _text(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, str):
        return str.__str__(v)                 # symbol, char: plain text
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v).decode("utf-8", "replace")
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(int(v))                    # ulong(7) → "7"
    if isinstance(v, float):
        return repr(float(v))
    return str(v)


_SEQ_KEY = "x-opt-sequence"
# Index in the AMQP properties list (§3.2.4) → key in the `properties` map.
_OTHER_PROPERTIES = ((2, "to"), (4, "reply-to"), (6, "content-type"), (7, "content-encoding"),
                     (1, "user-id"), (8, "absolute-expiry-time"), (10, "group-id"),
                     (11, "group-sequence"), (12, "reply-to-group-id"))


def to_row(queue: str, raw: bytes) -> tuple:
    """One message (raw AMQP bytes, as the broker sent it) as a row of SCHEMA,
    creation_time in microseconds.  Decoded with the broker's own lazy codec:
    only the sections a column needs."""
    m = CoreMessage(raw)
    body = m.body()
    text = None
    if isinstance(body, str):
        text, data = body, body.encode("utf-8")
    elif isinstance(body, (bytes, bytearray, memoryview)):
        data = bytes(body)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = None
    elif body is None:
        data = None
    else:  # amqp-value map/list/number: JSON when possible
        try:
            text = json.dumps(body, default=str)
        except (TypeError, ValueError):
            text = str(body)
        data = text.encode("utf-8")
    subject = message_id = correlation_id = created = None
    props: dict = {}
    if m.has_section(PROPERTIES):
        p = m.properties
        subject, message_id, correlation_id = _text(p[3]), _text(p[0]), _text(p[5])
        created = None if p[9] is None else int(p[9]) * 1000
        for i, key in _OTHER_PROPERTIES:
            if p[i] is not None:
                props[key] = _text(p[i])
    app = m.application_properties if m.has_section(APPLICATION_PROPERTIES) else {}
    seq = m.annotations.get(_SEQ_KEY)
    return (data, text, subject, message_id, correlation_id, created, props,
            {str(k): _text(v) for k, v in app.items()}, None if seq is None else int(seq), queue)


def arrow_batches(rows: Iterator[tuple], size: int = 4096) -> Iterator[Any]:
    """Rows of SCHEMA as pyarrow RecordBatches (Spark takes them without a
    per-row conversion)."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_schema

    schema = to_arrow_schema(SCHEMA, timezone="UTC")
    types = [f.type for f in schema]
    batch: list[tuple] = []
    for row in rows:
        batch.append(row)
        if len(batch) >= size:
            yield _record_batch(pa, schema, types, batch)
            batch = []
    if batch:
        yield _record_batch(pa, schema, types, batch)


def _record_batch(pa: Any, schema: Any, types: list, rows: list[tuple]) -> Any:
    columns = list(zip(*rows))
    return pa.RecordBatch.from_arrays([pa.array(c, type=t) for c, t in zip(columns, types)], schema=schema)


def read_partition(conn: ConnectionOptions, part: RangePartition, credit: int) -> Iterator[Any]:
    """The range of one partition as Arrow record batches."""
    def rows() -> Iterator[tuple]:
        with BrokerClient(with_url(conn, part.url)) as client:   # the node that holds it
            for raw in client.read_range_raw(part.queue, part.start, part.end, credit):
                yield to_row(part.key, raw)

    return arrow_batches(rows())


def _parse_offsets(text: str, what: str) -> dict | None:
    t = text.strip()
    if t in ("earliest", "latest"):
        return None
    try:
        value = json.loads(t)
    except ValueError:
        raise ValueError(f"{what} must be 'earliest', 'latest' or JSON {{\"queue\": seq}}, got {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object")
    return {str(k): int(v) for k, v in value.items()}


class _Driver:
    """The driver-side connections (queue-info, acknowledgements), opened lazily: the
    configured broker's, and on a cluster one per node that holds a queue read
    (spark/cluster.py).  Offsets keys: the queue names on a single broker,
    `<queue>@<node>` on a cluster."""

    def __init__(self, opts: AmqpOptions):
        self.opts = opts
        self._clients: dict[str | None, Any] = {}
        self._streams: Streams | None = None

    @property
    def streams(self) -> Streams:
        if self._streams is None:
            self._streams = Streams(self.opts.connection, self.opts.need_queues(), BrokerClient)
        return self._streams

    def locate(self, key: str) -> tuple[str, str | None]:
        """(queue, node URL or None: the configured broker) of an offsets key."""
        stream = self.streams.locate(key)
        return stream.queue, stream.url

    def client_for(self, url: str | None) -> Any:
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = BrokerClient(with_url(self.opts.connection, url))
        return client

    def infos(self) -> dict[str, dict]:
        """queue-info of every stream, each from its node; one reconnect on a lost
        connection (the broker restarted, or closed a connection idle longer than its
        idle timeout)."""
        for attempt in (1, 2):
            try:
                return query(self.opts.connection, self.streams.get(), self._clients, BrokerClient)
            except BrokerError:
                raise
            except Exception:
                self.close()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        clients, self._clients = self._clients, {}
        for client in clients.values():
            client.close()
        if self._streams is not None:
            self._streams.expire()


class AmqpStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options: AmqpOptions):
        self.opts = options
        self.queues = options.need_queues()
        self._driver: _Driver | None = None
        self._target: dict | None = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_driver"] = None
        return state

    @property
    def driver(self) -> _Driver:
        if self._driver is None:
            self._driver = _Driver(self.opts)
        return self._driver

    def _ends(self) -> dict:
        """{queue: tail + 1}: everything committed to the store now."""
        return {q: int(i["tail"]) + 1 for q, i in sorted(self.driver.infos().items())}

    def initialOffset(self) -> dict:
        given = _parse_offsets(self.opts.starting_offsets, "startingOffsets")
        infos = self.driver.infos()
        out = {}
        for key in sorted(infos):
            if given is not None and key in given:
                out[key] = given[key]
            elif self.opts.starting_offsets.strip() == "latest":
                out[key] = int(infos[key]["tail"]) + 1
            else:
                out[key] = int(infos[key]["head"])
        return out

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_records_per_batch:
            return ReadMaxRows(self.opts.max_records_per_batch)
        return ReadAllAvailable()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        ends = self._target if self._target is not None else self._ends()
        budget = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        out = {}
        # Every stream: those of the start, and any found since (a member's node
        # back, a subscription's queue made on a node), read from their beginning.
        for q in sorted(set(start) | set(ends)):
            s = int(start.get(q, 0))
            e = max(s, int(ends.get(q, s)))   # a node away: no progress on its streams
            if budget is not None:
                # At most `budget` rows: sequence numbers bound the row count (gaps
                # only make a batch smaller).
                e = min(e, s + budget)
                budget -= e - s
            out[q] = e
        return out

    def reportLatestOffset(self) -> dict | None:
        return self._target

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._ends()

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        parts: list[InputPartition] = []
        for key in sorted(end):
            s, e = int(start.get(key, 0)), int(end.get(key, 0))
            if e > s:
                queue, url = self.driver.locate(key)   # a replay reads the same node's log
                parts += split(queue, s, e, self.opts.num_partitions, url, key)
        return parts

    def read(self, partition: RangePartition) -> Iterator[tuple]:
        return read_partition(self.opts.connection, partition, self.opts.credit)

    def commit(self, end: dict) -> None:
        """Spark processed everything below `end`: let the broker drop it."""
        if not self.opts.ack_on_commit:
            return
        for key in sorted(end):
            try:
                queue, url = self.driver.locate(key)
                self.driver.client_for(url).ack_below(queue, int(end[key]), self.opts.reader)
            except BrokerError:
                raise        # e.g. the queue belongs to another reader: a configuration error
            except Exception as exc:   # the broker is away: the next commit acknowledges more
                log.warning("acknowledging %s below %s failed: %s", key, end[key], exc)
                self.driver.close()

    def stop(self) -> None:
        if self._driver is not None:
            self._driver.close()


class AmqpBatchReader(DataSourceReader):
    """A range (startingOffsets/endingOffsets) or the whole backlog (default)."""

    def __init__(self, options: AmqpOptions):
        self.opts = options
        self.queues = options.need_queues()

    def partitions(self) -> Sequence[InputPartition]:
        starts = _parse_offsets(self.opts.starting_offsets, "startingOffsets")
        ends = _parse_offsets(self.opts.ending_offsets, "endingOffsets")
        driver = _Driver(self.opts)
        try:
            infos = driver.infos()
            streams = driver.streams.get()
        finally:
            driver.close()
        parts: list[InputPartition] = []
        for key in sorted(infos):
            head, tail = int(infos[key]["head"]), int(infos[key]["tail"])
            s = starts[key] if starts and key in starts else (
                tail + 1 if self.opts.starting_offsets.strip() == "latest" else head)
            e = ends[key] if ends and key in ends else tail + 1
            stream = streams[key]
            parts += split(stream.queue, s, min(e, tail + 1), self.opts.num_partitions, stream.url, key)
        return parts

    def read(self, partition: RangePartition) -> Iterator[tuple]:
        return read_partition(self.opts.connection, partition, self.opts.credit)


# ---------------------------------------------------------------------- writing


_HEADER_DURABLE = b"\x00\x53\x70" + encode([True])
_ROW_COLUMNS = ("body", "subject", "application_properties", "correlation_id", "content_type")


def to_message(row: dict, message_id: str, durable: bool = True) -> bytes:
    """One row (a dict) as an encoded AMQP message.  Columns: body (binary → data
    section, string → amqp-value string), subject, application_properties (map),
    correlation_id, content_type; a row without a body column is sent whole as
    JSON (content-type application/json).  message-id: the deterministic id."""
    if "body" in row:
        body = row["body"]
        content_type = row.get("content_type")
    else:
        body = json.dumps(row, default=str)
        content_type = row.get("content_type") or "application/json"
    props = [message_id, None, None, row.get("subject"), None, row.get("correlation_id"),
             None if content_type is None else symbol(str(content_type))]
    while props[-1] is None:
        props.pop()
    out = [_HEADER_DURABLE if durable else b"", b"\x00\x53\x73", encode(props)]
    app = row.get("application_properties")
    if app:
        if not isinstance(app, dict):      # Arrow maps arrive as (key, value) pairs
            app = dict(app)
        out += [b"\x00\x53\x74", encode({str(k): v for k, v in app.items()})]
    if isinstance(body, (bytes, bytearray, memoryview)):
        out += [b"\x00\x53\x75", encode(bytes(body))]
    else:
        out += [b"\x00\x53\x77", encode(body)]
    return b"".join(out)


def _rows(batches: Iterator[Any]) -> Iterator[dict]:
    for rb in batches:
        if hasattr(rb, "to_pylist"):
            yield from rb.to_pylist()
        else:                                # a Spark Row (non-Arrow callers)
            yield rb.asDict(recursive=True)


def write_rows(opts: AmqpOptions, batches: Iterator[Any], prefix: str) -> "AmqpCommitMessage":
    from pyspark import TaskContext

    if len(opts.queues) != 1:
        raise ValueError("the amqp sink needs exactly one 'address'")
    ctx = TaskContext.get()
    part = ctx.partitionId() if ctx is not None else 0
    messages = (to_message(row, f"{prefix}:{part}:{i}", opts.durable) for i, row in enumerate(_rows(batches)))
    # On a cluster: the owner of the address, or member `part mod K` of a partitioned
    # one (the same for a retried task: its ids meet that member's dedup window).
    address, conn = write_target(opts.connection, opts.queues[0], part)
    with BrokerClient(conn) as client:
        n = client.send(address, messages, window=opts.batch_size)
    return AmqpCommitMessage(part, n)


@dataclass
class AmqpCommitMessage(WriterCommitMessage):
    partition: int
    count: int


class AmqpStreamWriter(DataSourceStreamArrowWriter):
    """Each micro-batch row becomes a message with id `<query id>:<batch id>:<partition>:<row>`
    (the query id survives restarts from the checkpoint): a replayed batch sends the
    same ids, which the broker's duplicate detection drops."""

    def __init__(self, options: AmqpOptions):
        self.opts = options

    def write(self, iterator: Iterator[Any]) -> AmqpCommitMessage:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        batch = ctx.getLocalProperty("streaming.sql.batchId") if ctx else None
        query = self.opts.write_id or (ctx.getLocalProperty("sql.streaming.queryId") if ctx else None)
        if batch is None or query is None:
            raise RuntimeError("the amqp stream writer runs in a streaming query task only")
        return write_rows(self.opts, iterator, f"{query}:{batch}")

    def commit(self, messages: list, batchId: int) -> None:
        n = sum(m.count for m in messages if m is not None)
        log.info("amqp sink: batch %d committed, %d message(s) to %s", batchId, n, self.opts.queues)

    def abort(self, messages: list, batchId: int) -> None:
        log.warning("amqp sink: batch %d aborted; its replay is deduplicated by message-id", batchId)


class AmqpBatchWriter(DataSourceArrowWriter):
    def __init__(self, options: AmqpOptions):
        self.opts = options
        # Made on the driver and pickled to every task: retried tasks reuse the ids.
        self.write_id = options.write_id or uuid.uuid4().hex

    def write(self, iterator: Iterator[Any]) -> AmqpCommitMessage:
        return write_rows(self.opts, iterator, f"{self.write_id}:0")

    def commit(self, messages: list) -> None:
        pass

    def abort(self, messages: list) -> None:
        pass


# ---------------------------------------------------------------------- the source


class AmqpDataSource(DataSource):
    """format("amqp"): see the module docstring and docs/spark.md."""

    @classmethod
    def name(cls) -> str:
        return "amqp"

    def schema(self) -> StructType:
        return SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return AmqpBatchReader(AmqpOptions.parse(self.options))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return AmqpStreamReader(AmqpOptions.parse(self.options))

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        return AmqpBatchWriter(AmqpOptions.parse(self.options))

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        return AmqpStreamWriter(AmqpOptions.parse(self.options))


__all__ = ["AmqpDataSource", "AmqpOptions", "SCHEMA", "RangePartition", "split", "to_row", "to_message"]
