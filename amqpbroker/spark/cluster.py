"""The `amqp` source and sink on a cluster of brokers (docs/cluster.md, docs/spark.md).

A cluster node answers `$amqpbroker.cluster` (cluster/info.py): its nodes with the
address clients reach each at, and for an address where a reader of it reads.  The
source reads every queue from the node that holds it, so that each *member* of a
partitioned queue (and each member's copy of a subscription of a partitioned topic)
is its own log with its own offsets, its own Spark input partitions and its own
acknowledgements: the exactly-once and replay guarantees of one broker hold per
member.  `$amqpbroker.queue-info` and `$amqpbroker.ack` are node-local, so they go to
that node too.

* A **stream** is one queue on one node: its offsets key is `<queue>@<node>` in a
  cluster, the queue name alone on a single broker (so a single broker's checkpoints
  are unchanged).
* A queue with one owner is read from its owner; a partitioned queue from each
  member's owner; a subscription's queue (it lives beside its topic, on every member
  of a partitioned topic) from every live node whose queue-info knows it.
* The sink writes task `p` of a batch to member `p mod K` on its owner, always the
  same member for the same task, so a replayed task meets its own message-ids in that
  member's duplicate-detection window.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from .client import BrokerClient, BrokerError, ConnectionLost, ConnectionOptions

log = logging.getLogger("amqpbroker.spark")

REFRESH_SECONDS = 30.0     # how long a discovery is used before it is made again
_UNSPECIFIED = ("", "0.0.0.0", "::", "[::]")


@dataclass(frozen=True)
class Stream:
    queue: str           # the queue read on that node
    url: str | None      # the node's AMQP URL; None: the configured one (a single broker)


def node_url(base: str, advertised: str) -> str:
    """The configured URL (scheme, user, password) pointed at a node's `host:port`; a
    node that listens on every interface (0.0.0.0) keeps the configured host."""
    u = urlsplit(base if "://" in base else f"amqp://{base}")
    host, _, port = advertised.rpartition(":")
    if host in _UNSPECIFIED:
        host = u.hostname or "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    userinfo = u.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@{host}:{port}" if userinfo else f"{host}:{port}"
    return urlunsplit((u.scheme or "amqp", netloc, u.path, u.query, u.fragment))


def stream_key(queue: str, node: str) -> str:
    return f"{queue}@{node}"


def with_url(conn: ConnectionOptions, url: str | None) -> ConnectionOptions:
    return conn if url is None else dataclasses.replace(conn, url=url)


def discover(conn: ConnectionOptions, queues: list[str], factory: Any = BrokerClient) -> dict[str, Stream] | None:
    """{key: Stream} for every queue to read, or None for a single broker."""
    with factory(conn) as client:
        if client.cluster_info() is None:
            return None
        out: dict[str, Stream] = {}
        for queue in queues:
            info = client.cluster_info(queue)
            urls = {n["node"]: node_url(conn.url, n["amqp"]) for n in info["nodes"]}
            members = info.get("members")
            if members is None:   # any node may hold it (a subscription's queue)
                members = [(queue, n["node"]) for n in info["nodes"]
                           if n["live"] and _holds(with_url(conn, urls[n["node"]]), queue, factory)]
            for member, node in members:
                out[stream_key(member, node)] = Stream(member, urls[node])
        return out


def _holds(conn: ConnectionOptions, queue: str, factory: Any) -> bool:
    try:
        with factory(conn) as client:
            client.queue_info(queue)
        return True
    except BrokerError:
        return False            # 404: not there
    except (ConnectionLost, OSError) as exc:
        log.warning("node at %s not asked about %s (found again at the next discovery): %s", conn.url, queue, exc)
        return False


def write_target(conn: ConnectionOptions, address: str, partition: int) -> tuple[str, ConnectionOptions]:
    """(address, connection) a sink task writes to: on a cluster, member
    `partition mod K` of a partitioned address (or the address itself) on its owner."""
    with BrokerClient(conn) as client:
        info = client.cluster_info(address)
    if info is None or not info.get("members"):
        return address, conn
    urls = {n["node"]: node_url(conn.url, n["amqp"]) for n in info["nodes"]}
    member, node = info["members"][partition % len(info["members"])]
    return member, with_url(conn, urls[node])


class Streams:
    """The driver's discovery, made again every REFRESH_SECONDS (and after a failure)."""

    def __init__(self, conn: ConnectionOptions, queues: list[str], factory: Any = BrokerClient):
        self.conn = conn
        self.queues = queues
        self.factory = factory
        self.cluster: bool | None = None     # unknown until asked
        self._streams: dict[str, Stream] = {}
        self._at = -REFRESH_SECONDS

    def get(self, now: float | None = None) -> dict[str, Stream]:
        now = time.monotonic() if now is None else now
        if now - self._at >= REFRESH_SECONDS:
            found = discover(self.conn, self.queues, self.factory)
            self.cluster = found is not None
            if found is None:
                found = {q: Stream(q, None) for q in self.queues}
            self._streams.update(found)   # a node away keeps its known streams (no progress on them)
            self._at = now
        return self._streams

    def locate(self, key: str) -> Stream:
        stream = self.get().get(key)
        if stream is None:
            self._at = -REFRESH_SECONDS   # a key of the checkpoint not seen yet: ask again
            stream = self.get().get(key)
        if stream is None:
            raise LookupError(f"no broker node holds '{key}' now: its range cannot be read (or acknowledged)")
        return stream

    def expire(self) -> None:
        self._at = -REFRESH_SECONDS


def query(conn: ConnectionOptions, streams: dict[str, Stream], clients: dict[str | None, Any],
          factory: Any) -> dict[str, dict]:
    """queue-info of every stream, each from its node (clients kept per node URL); a
    node that cannot be reached is left out (logged): its streams make no progress."""
    out: dict[str, dict] = {}
    for key, stream in sorted(streams.items()):
        client = clients.get(stream.url)
        if client is None:
            client = clients[stream.url] = factory(with_url(conn, stream.url))
        try:
            out[key] = client.queue_info(stream.queue)
        except BrokerError:
            raise
        except (ConnectionLost, OSError) as exc:
            clients.pop(stream.url, None)
            client.close()
            if stream.url is None:
                raise
            log.warning("node at %s not reached for %s: %s", stream.url, key, exc)
    return out
