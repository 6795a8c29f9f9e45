"""A client that sends exactly the frame orders Qpid JMS 1.16 sends when an application
closes consumers and sessions (shared/notes/qpid-jms-wire.md), on `RawClient`, so that
the test decides when frames go out together:

* consumer close with prefetched messages: `disposition(accepted)` for what the
  application consumed → `detach(closed=true)` → (the broker's detach) →
  `disposition(released)` for the prefetched rest;
* CLIENT_ACKNOWLEDGE session closed with unacknowledged messages:
  `disposition(modified, delivery-failed=true)` for them → `end`, in one write.

Consumer links carry Qpid JMS's name, `queue` capability and prefetch (1000).  Their
source's default outcome (`modified(delivery-failed=true)` in Qpid JMS) is not written:
proton's engine has no field for it, and the broker must not need it to decide.
"""

from __future__ import annotations

import uuid
from collections import deque
from typing import Any

from proton import Delivery, Endpoint, Message, Terminus, symbol

from tests.e2e.helpers_conn import RawClient

PREFETCH = 1000
REMOTE_CLOSED = Endpoint.REMOTE_CLOSED


class JmsConsumer:
    def __init__(self, session: "JmsSession", address: str, prefetch: int = PREFETCH,
                 capability: str = "queue"):
        self.session = session
        self.client = session.client
        link = session.ssn.receiver(f"qpid-jms:receiver:ID:{uuid.uuid4()}:1:1:1:{address}")
        link.source.address = address
        caps = link.source.capabilities
        caps.put_array(False, 21)   # symbol array
        caps.enter()
        caps.put_symbol(symbol(capability))
        caps.exit()
        link.target.address = None
        link.open()
        link.flow(prefetch)
        self.client.wait(lambda: link.state & (Endpoint.REMOTE_ACTIVE | REMOTE_CLOSED),
                         what=f"attach of {link.name}")
        self.link = link
        self.prefetched: deque[tuple[Message, Delivery]] = deque()
        self.delivered: list[tuple[Message, Delivery]] = []   # given to the application, not acked

    def _take_arrivals(self) -> bool:
        link = self.link
        while link.current is not None and not link.current.partial and link.current.readable:
            dlv = link.current
            msg = Message()
            msg.decode(link.recv(dlv.pending))
            link.advance()
            self.prefetched.append((msg, dlv))
        return bool(self.prefetched)

    def wait_prefetched(self, n: int, timeout: float = 10.0) -> None:
        self.client.wait(lambda: self._take_arrivals() and len(self.prefetched) >= n, timeout,
                         f"{n} prefetched messages on {self.link.name}")

    def receive(self, timeout: float = 10.0) -> Message:
        """MessageConsumer.receive(): the next prefetched message (not yet acknowledged)."""
        self.client.wait(self._take_arrivals, timeout, f"a message on {self.link.name}")
        msg, dlv = self.prefetched.popleft()
        self.delivered.append((msg, dlv))
        return msg

    def acknowledge(self) -> None:
        """AUTO_ACKNOWLEDGE after receive(): accepted for what the application got."""
        for _, dlv in self.delivered:
            dlv.update(Delivery.ACCEPTED)
            dlv.settle()
        self.delivered.clear()

    def close(self) -> None:
        """MessageConsumer.close(): detach(closed) → wait for the broker's detach →
        released for every prefetched message the application never saw."""
        self._take_arrivals()
        self.link.close()
        self.client.wait(lambda: self.link.state & REMOTE_CLOSED, what=f"detach of {self.link.name}")
        self._take_arrivals()
        for _, dlv in self.prefetched:
            dlv.update(Delivery.RELEASED)
            dlv.settle()
        self.prefetched.clear()
        self.client.pump(0)   # the dispositions go out


class JmsSession:
    def __init__(self, client: RawClient):
        self.client = client
        self.ssn = client.session()
        self.consumers: list[JmsConsumer] = []

    def consumer(self, address: str, prefetch: int = PREFETCH, capability: str = "queue") -> JmsConsumer:
        consumer = JmsConsumer(self, address, prefetch, capability)
        self.consumers.append(consumer)
        return consumer

    def close_unacknowledged(self) -> None:
        """Session.close() in CLIENT_ACKNOWLEDGE mode with messages the application
        received but did not acknowledge: modified(delivery-failed) for them, then
        `end`, written together."""
        for consumer in self.consumers:
            for _, dlv in consumer.delivered:
                dlv.local.failed = True
                dlv.update(Delivery.MODIFIED)
                dlv.settle()
            consumer.delivered.clear()
        self.ssn.close()
        self.client.wait(lambda: self.ssn.state & REMOTE_CLOSED, what="end")

    def bodies_arrived(self) -> list[Any]:
        """Bodies of the prefetched messages of this session's consumers (anything the
        broker sent since, included)."""
        for consumer in self.consumers:
            consumer._take_arrivals()
        return [m.body for c in self.consumers for m, _ in c.prefetched]


def dynamic_target_sender(client: RawClient, session: Any, capability: str) -> Any:
    """createTemporaryQueue / createTemporaryTopic: a sender link with a dynamic target
    (`temporary-queue` or `temporary-topic` capability) that the node lives as long as."""
    snd = session.sender(f"qpid-jms:temp-destination:{uuid.uuid4()}")
    snd.target.dynamic = True
    caps = snd.target.capabilities
    caps.put_array(False, 21)
    caps.enter()
    caps.put_symbol(symbol(capability))
    caps.exit()
    snd.target.expiry_policy = Terminus.EXPIRE_WITH_LINK
    snd.open()
    client.wait(lambda: snd.remote_target.address, what="dynamic target address")
    return snd


def jms_client(broker: Any, container_id: str | None = None) -> RawClient:
    return RawClient("127.0.0.1", broker.port,
                     container_id=container_id or f"ID:{uuid.uuid4()}:1").wait_open()


__all__ = ["JmsConsumer", "JmsSession", "dynamic_target_sender", "jms_client", "PREFETCH"]
