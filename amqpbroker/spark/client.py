"""A small synchronous AMQP client for the log-style broker features (docs/spark.md):
queue-info, ack-below, sequence-range reads and pipelined sends.

python-qpid-proton's engine (Transport/Connection) driven from a plain socket, no
reactor: proton's Python event dispatch costs ~100 µs per message, several times
what the broker spends; here the per-message paths call the C API through cffi
(as the broker's links.py does) and no events are generated at all.

No pyspark here: the Spark data source uses it in driver and executor processes,
the tests and the benchmark use it directly.  Nothing connects until a method
needs the connection, so option objects stay picklable.
"""

from __future__ import annotations

import itertools
import os
import select
import socket
import ssl
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator
from urllib.parse import unquote, urlsplit

from cproton import ffi, lib
from proton import Connection, Delivery, Described, Endpoint, Link, Message, Terminus, Transport, symbol, ulong

SEQUENCE_RANGE = "amqpbroker:sequence-range"
SEQUENCE_ANNOTATION = "x-opt-sequence"
QUEUE_INFO_ADDRESS = "$amqpbroker.queue-info"
ACK_ADDRESS = "$amqpbroker.ack"
CLUSTER_INFO_ADDRESS = "$amqpbroker.cluster"
_ACCEPTED = Delivery.ACCEPTED


class BrokerError(Exception):
    """The broker refused a request (rejected delivery or refused link)."""

    def __init__(self, condition: str | None, description: str):
        super().__init__(f"{condition}: {description}" if condition else description)
        self.condition = condition
        self.description = description


class ConnectionLost(Exception):
    """The connection failed or timed out (retryable)."""


def subscription_queue(name: str, client_id: str | None = None, durable: bool = True) -> str:
    """The queue of a JMS subscription (docs/shared-subscriptions.md): `_` doubled in
    the namespace (client-id, or `_global_` for a global subscription) and the name."""
    from ..core.subscriptions import GLOBAL_NAMESPACE, SubscriptionKey

    return SubscriptionKey(GLOBAL_NAMESPACE if client_id is None else client_id, name, durable).queue_name


@dataclass
class ConnectionOptions:
    url: str = "amqp://127.0.0.1:5672"
    user: str | None = None
    password: str | None = None
    tls: bool = False                 # also implied by an amqps:// url
    tls_ca_file: str | None = None    # trusted CA (PEM); default: the system trust store
    tls_verify: bool = True           # verify the peer's certificate and host name
    tls_cert_file: str | None = None  # client certificate (PEM), optional
    tls_key_file: str | None = None
    container_id: str | None = None
    timeout: float = 30.0

    @classmethod
    def from_options(cls, o: dict) -> "ConnectionOptions":
        """From Spark-style options (keys compared lower-case)."""
        o = {k.lower(): v for k, v in o.items()}

        def flag(name: str, default: bool) -> bool:
            v = o.get(name)
            return default if v is None else str(v).strip().lower() in ("1", "true", "yes", "on")

        return cls(url=o.get("url", cls.url), user=o.get("user"), password=o.get("password"),
                   tls=flag("tls", False), tls_ca_file=o.get("tlscafile"), tls_verify=flag("tlsverify", True),
                   tls_cert_file=o.get("tlscertfile"), tls_key_file=o.get("tlskeyfile"),
                   container_id=o.get("containerid"), timeout=float(o.get("timeout", 30.0)))


# ---------------------------------------------------------------------- the engine


class _Engine:
    """One socket, one proton Transport/Connection/Session; no Collector."""

    def __init__(self, opts: ConnectionOptions):
        self.opts = opts
        u = urlsplit(opts.url if "://" in opts.url else f"amqp://{opts.url}")
        tls = opts.tls or u.scheme == "amqps"
        host = u.hostname or "127.0.0.1"
        port = u.port or (5671 if tls else 5672)
        user = opts.user if opts.user is not None else (unquote(u.username) if u.username else None)
        password = opts.password if opts.password is not None else (unquote(u.password) if u.password else None)
        self.address = f"{host}:{port}"
        try:
            sock = socket.create_connection((host, port), timeout=opts.timeout)
        except OSError as exc:
            raise ConnectionLost(f"cannot connect to {self.address}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls:
            ctx = ssl.create_default_context(cafile=opts.tls_ca_file)
            if not opts.tls_verify:
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            if opts.tls_cert_file:
                ctx.load_cert_chain(opts.tls_cert_file, opts.tls_key_file)
            sock = ctx.wrap_socket(sock, server_hostname=host)
        sock.setblocking(False)
        self.sock = sock
        self.transport = Transport()
        sasl = self.transport.sasl()
        if user is not None:
            sasl.allowed_mechs("SCRAM-SHA-256 PLAIN")
            sasl.allow_insecure_mechs = True
        else:
            sasl.allowed_mechs("ANONYMOUS")
        self.conn = Connection()
        self.conn.container = opts.container_id or f"amqpbroker-spark-{uuid.uuid4().hex[:12]}"
        self.conn.hostname = host
        if user is not None:
            self.conn.user = user
            self.conn.password = password or ""
        self.transport.bind(self.conn)
        self.conn.open()
        self.session = self.conn.session()
        self.session.open()
        self.closed = False
        self.wait(lambda: self.conn.state & Endpoint.REMOTE_ACTIVE, "opening the connection")

    # ------------------------------------------------------------------ I/O

    def _flush(self) -> bool:
        """Write what the transport has; True while output remains."""
        t = self.transport
        while True:
            n = t.pending()
            if n < 0:
                return False
            if n == 0:
                return False
            try:
                sent = self.sock.send(t.peek(min(n, 1 << 18)))
            except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                return True
            except OSError as exc:
                self._lost(f"write failed: {exc}")
            t.pop(sent)

    def pump(self, timeout: float) -> None:
        """Write, wait up to `timeout` for input, read what is there."""
        if self.closed:
            raise ConnectionLost(f"connection to {self.address} is closed")
        more_out = self._flush()
        sock = self.sock
        if not (isinstance(sock, ssl.SSLSocket) and sock.pending()):
            r, _, _ = select.select([sock], [sock] if more_out else [], [], timeout)
            if not r:
                self._tick()
                return
        t = self.transport
        while True:
            cap = t.capacity()
            if cap <= 0:
                break
            try:
                data = sock.recv(min(cap, 1 << 18))
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                break
            except OSError as exc:
                self._lost(f"read failed: {exc}")
            if not data:
                t.close_tail()
                self._lost("connection closed by the broker")
            t.push(data)
            if len(data) < min(cap, 1 << 18) and not (isinstance(sock, ssl.SSLSocket) and sock.pending()):
                break
        self._tick()
        self._flush()

    def _tick(self) -> None:
        self.transport.tick(time.monotonic())   # heartbeats and the peer's idle timeout

    def _lost(self, why: str) -> None:
        self.closed = True
        cond = self.conn.remote_condition or self.transport.condition
        if cond is not None:
            why = f"{why}: {cond.name}: {cond.description}"
        raise ConnectionLost(why)

    def wait(self, cond: Callable[[], Any], what: str, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (self.opts.timeout if timeout is None else timeout)
        while not cond():
            if self.conn.state & Endpoint.REMOTE_CLOSED:
                c = self.conn.remote_condition
                self.closed = True
                raise ConnectionLost("connection closed by the broker"
                                     + (f": {c.name}: {c.description}" if c else ""))
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConnectionLost(f"timed out {what} ({self.address})")
            self.pump(min(left, 1.0))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.conn.close()
            self._flush()
        except Exception:
            pass
        try:
            self.sock.close()
        except OSError:
            pass

    # ------------------------------------------------------------------ links

    def open_link(self, link: Link, what: str) -> Link:
        link.open()
        self.wait(lambda: not (link.state & Endpoint.REMOTE_UNINIT), what)
        term = link.remote_source if link.is_receiver else link.remote_target
        if term.address is None and not term.dynamic or link.state & Endpoint.REMOTE_CLOSED:
            # A refusal: null terminus, then a detach carrying the error.
            try:
                self.wait(lambda: link.state & Endpoint.REMOTE_CLOSED, what, timeout=2.0)
            except ConnectionLost:
                pass
            c = link.remote_condition
            link.close()
            raise BrokerError(c.name if c else None, c.description if c else f"{what}: refused")
        return link

    def check_link(self, link: Link) -> None:
        if link.state & Endpoint.REMOTE_CLOSED:
            c = link.remote_condition
            raise BrokerError(c.name if c else "amqp:link:detach-forced",
                              c.description if c else f"link {link.name} closed by the broker")


def _read_ready(impl: Any, out: deque) -> None:
    """Move every complete delivery of a receiving link into `out` (raw bytes)."""
    while True:
        d = lib.pn_link_current(impl)
        if d == ffi.NULL or lib.pn_delivery_partial(d) or not lib.pn_delivery_readable(d):
            return
        n = lib.pn_delivery_pending(d)
        buf = bytearray(n)
        got = lib.pn_link_recv(impl, ffi.from_buffer(buf), n)
        lib.pn_link_advance(impl)
        lib.pn_delivery_settle(d)
        out.append(bytes(buf) if got == n else bytes(buf[:max(got, 0)]))


def _state_error(d: Any) -> BrokerError:
    dlv = Delivery.wrap(d)
    cond = dlv.remote.condition
    if cond is not None:
        return BrokerError(cond.name, cond.description or "")
    return BrokerError(None, f"delivery ended in state {dlv.remote_state}")


# ---------------------------------------------------------------------- the client


class BrokerClient:
    """One connection, opened on first use.  Not thread-safe."""

    def __init__(self, options: ConnectionOptions):
        self.options = options
        self._engine: _Engine | None = None
        self._senders: dict[str, Link] = {}
        self._replies: Link | None = None
        self._reply_buf: deque = deque()
        self._ids = itertools.count(1)
        self._tags = itertools.count(1)

    @property
    def engine(self) -> _Engine:
        if self._engine is None or self._engine.closed:
            self._senders.clear()
            self._replies = None
            self._engine = _Engine(self.options)
        return self._engine

    def close(self) -> None:
        engine, self._engine = self._engine, None
        self._senders.clear()
        self._replies = None
        if engine is not None:
            engine.close()

    def __enter__(self) -> "BrokerClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing

    def _sender(self, address: str) -> Link:
        link = self._senders.get(address)
        if link is None or link.state & Endpoint.REMOTE_CLOSED:
            e = self.engine
            link = e.session.sender(f"send-{uuid.uuid4().hex}")
            link.target.address = address
            link.source.address = None
            self._senders[address] = e.open_link(link, f"attaching a sender to {address}")
        return link

    def _transfer(self, link: Link, data: bytes) -> Any:
        impl = link._impl
        tag = next(self._tags).to_bytes(8, "big")
        d = lib.pn_delivery(impl, (8, ffi.from_buffer(tag)))
        lib.pn_link_send(impl, ffi.from_buffer(data), len(data))
        lib.pn_link_advance(impl)
        return d

    def _send_one(self, address: str, msg: Message) -> None:
        link = self._sender(address)
        e = self.engine
        e.wait(lambda: link.credit > 0 or link.state & Endpoint.REMOTE_CLOSED, f"credit on {address}")
        e.check_link(link)
        d = self._transfer(link, msg.encode())
        e.wait(lambda: lib.pn_delivery_settled(d) or link.state & Endpoint.REMOTE_CLOSED, f"sending to {address}")
        e.check_link(link)
        state = lib.pn_delivery_remote_state(d)
        err = None if state == _ACCEPTED else _state_error(d)
        lib.pn_delivery_settle(d)
        if err is not None:
            raise err

    def _request(self, address: str, properties: dict, body: bool = False) -> Any:
        e = self.engine
        if self._replies is None:
            link = e.session.receiver(f"replies-{uuid.uuid4().hex}")
            link.source.dynamic = True
            link.source.address = None
            self._replies = e.open_link(link, "attaching a reply receiver")
            link.flow(16)
        replies = self._replies
        mid = f"req-{os.getpid()}-{next(self._ids)}"
        self._send_one(address, Message(id=mid, reply_to=replies.remote_source.address, properties=properties))
        impl = replies._impl
        buf = self._reply_buf
        while True:
            e.wait(lambda: (_read_ready(impl, buf) or bool(buf)) or replies.state & Endpoint.REMOTE_CLOSED,
                   f"waiting for the answer from {address}")
            e.check_link(replies)
            if replies.credit < 8:
                replies.flow(16 - replies.credit)
            reply = Message()
            reply.decode(buf.popleft())
            if reply.correlation_id == mid:
                return reply.body if body else dict(reply.properties or {})

    # ------------------------------------------------------------------ log operations

    def queue_info(self, queue: str) -> dict:
        """{'queue', 'status-code', 'durable', 'depth', 'head', 'tail', ['reader', 'acked-below']}:
        head = lowest stored sequence (tail+1 when empty), tail = last committed one."""
        info = self._request(QUEUE_INFO_ADDRESS, {"queue": queue})
        if info.get("status-code") != 200:
            raise BrokerError("amqp:not-found", str(info.get("status-description", info)))
        return info

    def cluster_info(self, address: str | None = None) -> dict | None:
        """The cluster as the broker sees it (`$amqpbroker.cluster`, cluster/info.py):
        {'node', 'nodes': [{'node', 'live', 'amqp': 'host:port'}], and for `address`
        'members': [[queue, node], ...] (absent: any node may hold it) and
        'partitioned'}; None for a broker that is no node of a cluster."""
        try:
            self._sender(CLUSTER_INFO_ADDRESS)
        except BrokerError as exc:
            if exc.condition == "amqp:not-found":
                return None   # the link refused: a single broker has no such control address
            raise
        return self._request(CLUSTER_INFO_ADDRESS, {"address": address} if address else {}, body=True)

    def ack_below(self, queue: str, below: int, reader: str) -> None:
        """Everything of `queue` below sequence `below` is processed by `reader`:
        the broker removes it (the first acknowledgement claims the queue)."""
        self._send_one(ACK_ADDRESS, Message(properties={"queue": queue, "below": int(below), "reader": reader}))

    def release_claim(self, queue: str, reader: str) -> None:
        self._send_one(ACK_ADDRESS, Message(properties={"queue": queue, "release": True, "reader": reader}))

    def ensure_durable_subscription(self, topic: str, name: str, selector: str | None = None) -> str:
        """Create (or keep) the JMS durable subscription `name` on `topic` in this
        connection's container-id namespace, shaped as Qpid JMS does, then detach
        without closing (the subscription stays).  Returns its queue name."""
        if not self.options.container_id:
            raise ValueError("a durable subscription needs ConnectionOptions.container_id (the JMS clientID)")
        e = self.engine
        link = e.session.receiver(name)
        src = link.source
        src.address = topic
        src.durability = Terminus.DELIVERIES
        src.expiry_policy = Terminus.EXPIRE_NEVER
        src.distribution_mode = Terminus.DIST_MODE_COPY
        src.capabilities.put_array(False, 21)   # Data.SYMBOL
        src.capabilities.enter()
        src.capabilities.put_symbol(symbol("topic"))
        src.capabilities.exit()
        if selector:
            src.filter.put_object({symbol("jms-selector"): Described(ulong(0x0000468C00000004), selector)})
        e.open_link(link, f"subscribing {name} to {topic}")   # answered once the subscription is stored
        link.detach()
        queue = subscription_queue(name, self.options.container_id)
        # A detach without close changes no endpoint state (proton signals it only as an
        # event): a request/response round trip shows that the broker has processed it.
        try:
            self.queue_info(queue)
        except BrokerError:
            if self.cluster_info() is None:   # on a cluster the queue lives beside the topic
                raise
        link.free()
        return queue

    def read_range_raw(self, queue: str, start: int, end: int | None, credit: int = 1000) -> Iterator[bytes]:
        """The stored messages of `queue` with start <= seq < end, in order, as raw
        AMQP bytes (each with the x-opt-sequence annotation).  Credit is granted
        with drain: when a round ends short, the broker had nothing more."""
        e = self.engine
        link = e.session.receiver(f"range-{uuid.uuid4().hex}")
        src = link.source
        src.address = queue
        src.distribution_mode = Terminus.DIST_MODE_COPY
        src.filter.put_object({symbol(SEQUENCE_RANGE): Described(
            symbol(SEQUENCE_RANGE), [ulong(start), None if end is None else ulong(end)])})
        link.snd_settle_mode = Link.SND_SETTLED
        e.open_link(link, f"reading {queue} by sequence")
        impl = link._impl
        buf: deque = deque()
        try:
            while True:
                link.drain(credit)
                got = 0
                while True:
                    e.pump(1.0 if not buf else 0)
                    _read_ready(impl, buf)
                    got += len(buf)
                    while buf:
                        yield buf.popleft()
                    if lib.pn_link_credit(impl) == 0 and lib.pn_link_queued(impl) == 0:
                        break
                    e.check_link(link)
                if got < credit:
                    return
        finally:
            if not e.closed:
                try:
                    link.close()
                except Exception:
                    pass

    def read_range(self, queue: str, start: int, end: int | None, credit: int = 1000) -> Iterator[tuple[int, Message]]:
        for raw in self.read_range_raw(queue, start, end, credit):
            msg = Message()
            msg.decode(raw)
            yield int(msg.annotations[SEQUENCE_ANNOTATION]), msg

    def send(self, address: str, messages: Iterable[Message | bytes], window: int = 1000) -> int:
        """Send (proton Messages or encoded bytes) with up to `window` unsettled
        transfers; return once all are accepted.  Raises BrokerError on the first
        refused one."""
        e = self.engine
        link = self._sender(address)
        impl = link._impl
        inflight: deque = deque()
        sent = 0

        def reap() -> None:
            while inflight and lib.pn_delivery_settled(inflight[0]):
                d = inflight.popleft()
                err = None if lib.pn_delivery_remote_state(d) == _ACCEPTED else _state_error(d)
                lib.pn_delivery_settle(d)
                if err is not None:
                    raise err

        for msg in messages:
            while lib.pn_link_credit(impl) <= 0 or len(inflight) >= window:
                e.pump(1.0)
                e.check_link(link)
                reap()
            inflight.append(self._transfer(link, msg if isinstance(msg, (bytes, bytearray)) else msg.encode()))
            sent += 1
            if sent % 64 == 0:
                e.pump(0)
                reap()
        deadline = time.monotonic() + self.options.timeout
        while inflight:
            e.pump(1.0)
            e.check_link(link)
            before = len(inflight)
            reap()
            if len(inflight) < before:
                deadline = time.monotonic() + self.options.timeout
            elif time.monotonic() > deadline:
                raise ConnectionLost(f"timed out settling sends to {address}")
        return sent
