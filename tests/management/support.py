"""An in-process broker model behind the management API (no sockets): a
BrokerServer that is never started, its FastAPI app reached through httpx's ASGI
transport, fake connections and consumers, and an injected clock."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from amqpbroker.config import Settings, StoreConfig
from amqpbroker.core.subscriptions import BindingSpec, Decision
from amqpbroker.core.terms import Durability, ExpiryPolicy, SourceTerms
from amqpbroker.management.api import build_app
from amqpbroker.management.service import Operations
from amqpbroker.server.app import BrokerServer
from tests.core.helpers import make_message

T0 = 1_700_000_000.0
BASE_URL = "http://127.0.0.1:8161"     # the Host the in-process API sees


class Clock:
    def __init__(self, now: float = T0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeLink:
    def __init__(self, name: str, address: str | None = None, conn: "FakeConn | None" = None):
        self.name = name
        self.condition = None
        self.closed = False
        self.is_sender = True
        self.remote_source = type("Source", (), {"address": address})()
        self.conn = conn
        if conn is not None:
            conn.links.append(self)

    def close(self) -> None:
        self.closed = True
        if self.conn is not None and self in self.conn.links:
            self.conn.links.remove(self)

    def next(self, mask: int) -> "FakeLink | None":
        links = self.conn.links if self.conn is not None else []
        i = links.index(self) + 1 if self in links else len(links)
        return links[i] if i < len(links) else None


class FakeProtocol:
    def __init__(self, peer: str, user: str | None):
        self.peer = peer
        self.user = user
        self.listener = type("L", (), {"name": "amqp", "ssl_context": None})()
        self.dirty = 0
        self.aborted = False

    def mark_dirty(self) -> None:
        self.dirty += 1

    def abort(self) -> None:
        self.aborted = True


class FakeConn:
    def __init__(self) -> None:
        self.condition = None
        self.closed = False
        self.links: list[FakeLink] = []      # proton's link list, as link_head / next walk it

    def link_head(self, mask: int) -> FakeLink | None:
        return self.links[0] if self.links else None

    def close(self) -> None:
        self.closed = True


class FakeHandler:
    """What the admin layer reads from a ConnectionHandler."""

    def __init__(self, server: Any, container_id: str, peer: str = "127.0.0.1:40000", user: str = "anonymous"):
        self.server = server
        self.container_id = container_id
        self.protocol = FakeProtocol(peer, user)
        self.conn = FakeConn()
        self.sessions = 1
        self.links = 0
        self.consumers: list = []
        self.ended = False
        self.endpoints: dict = {}

    def link_ended(self, link: FakeLink) -> None:
        consumer = self.endpoints.pop(link.name, None)
        if consumer is not None:
            self.links -= 1
            consumer.queue.remove_consumer(consumer, [], failed=False)
            if consumer.subscription is not None:
                self.server.subscriptions.detach(consumer.subscription, link.name, closed=False)


class FakeConsumer:
    """A ConsumerPort with the handler/link the admin layer detaches."""

    _ids = iter(range(1, 10**9))

    def __init__(self, handler: FakeHandler, link_name: str, queue: Any, subscription: Any = None):
        self.consumer_id = next(self._ids)
        self.handler = handler
        address = subscription.source.address if subscription is not None else queue.name
        self.link = FakeLink(link_name, address, handler.conn)
        self.queue = queue
        self.subscription = subscription
        self.browser = False
        self.filtered = False
        self.standby = False
        self.browse_cursor = 0
        handler.endpoints[link_name] = self
        handler.links += 1
        handler.consumers.append(self)
        queue.add_consumer(self)

    def credit(self) -> int:
        return 0

    def accepts(self, entry: Any) -> bool:
        return True

    def deliver(self, entry: Any) -> None:  # no credit: never called
        raise AssertionError

    def deliver_copy(self, entry: Any) -> None:
        raise AssertionError


def shared_durable_source(address: str = "amq.topic/orders.eu", global_: bool = False) -> SourceTerms:
    caps = {"topic", "shared"} | ({"global"} if global_ else set())
    return SourceTerms(address=address, durable=Durability.UNSETTLED_STATE, expiry_policy=ExpiryPolicy.NEVER,
                       capabilities=frozenset(caps))


class Harness:
    def __init__(self, settings: Settings | None = None, client_addr: str = "127.0.0.1"):
        self.loop = asyncio.new_event_loop()
        self.settings = settings or Settings(store=StoreConfig(enabled=False))
        self.server = BrokerServer(self.settings, self.loop)
        self.clock = Clock()
        self.server.broker.clock = self.clock
        self.ops = Operations(self.server, clock=self.clock)
        self.server.operations = self.ops
        self.app = build_app(self.ops)
        self.client_addr = client_addr

    @property
    def broker(self):
        return self.server.broker

    def request(self, method: str, path: str, *, auth: tuple[str, str] | None = None,
                client: str | None = None, **kw: Any) -> httpx.Response:
        async def go() -> httpx.Response:
            transport = httpx.ASGITransport(app=self.app, client=(client or self.client_addr, 50000))
            async with httpx.AsyncClient(transport=transport, base_url=BASE_URL, auth=auth) as c:
                return await c.request(method, path, **kw)
        return self.loop.run_until_complete(go())

    def get(self, path: str, **kw: Any) -> Any:
        r = self.request("GET", path, **kw)
        assert r.status_code == 200, r.text
        return r.json()

    # ------------------------------------------------------------------ state builders

    def subscribe(self, link_name: str, container: str, source: SourceTerms | None = None,
                  binding: BindingSpec | None = None):
        source = source or shared_durable_source()
        if binding is None:
            exchange, sep, key = (source.address or "amq.topic/#").partition("/")
            binding = BindingSpec(exchange, key) if sep else BindingSpec("amq.topic", exchange)
        reg = self.server.subscriptions
        d = reg.decide(link_name, container, source, binding)
        assert d.decision is not Decision.REFUSE, d
        sub, queue = reg.apply(d, link_name=link_name, container_id=container, owner=None, now=self.clock())
        return sub, queue

    def connect(self, container: str, **kw: Any) -> FakeHandler:
        h = FakeHandler(self.server, container, **kw)
        self.server.handlers_by_container.setdefault(container, []).append(h)
        return h

    def publish(self, address: str, *bodies: str, **fields: Any) -> None:
        target = self.broker.resolve(address)
        for body in bodies:
            self.broker.publish(make_message(body, **fields), target)

    def close(self) -> None:
        self.loop.close()


DAY = 86400.0


def error_of(r) -> str:
    """The message of a JSON error body, checking it has that shape exactly."""
    body = r.json()
    assert set(body) == {"error"}, body
    return body["error"]
