"""The fault tests' clients: producers that send uniquely numbered messages and
consumers that read them, each on its own connection, failing over between the
pair's two addresses the way a failover-capable client (Qpid JMS `failover:`)
does: on a lost connection, the next address; sends whose outcome never came
are sent again there (so duplicates are possible, and counted).

Everything a client was told is written to a `Ledger` (thread-safe), the
checker's input: which ids were sent, which a producer was told Accepted (by
which broker, when), and which a consumer received (how often).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from proton import Message, Terminus
from proton.handlers import MessagingHandler
from proton.reactor import Container

from tests.client import SourceOptions
from tests.e2e.crash_support import Outcomes
from tests.e2e.jms_links import UNSETTLED_STATE, sub_link_name

RECONNECT_DELAY = 0.3     # seconds before trying the next address
TICK = 0.05


@dataclass
class Ledger:
    sent: dict[str, bool] = field(default_factory=dict)                   # id -> durable
    accepted: dict[str, tuple[str, float]] = field(default_factory=dict)  # id -> (url, time.time())
    refused: dict[str, str] = field(default_factory=dict)                 # id -> outcome (rejected, released...)
    received: dict[str, dict[str, int]] = field(default_factory=dict)     # stream -> id -> times
    connections: dict[str, int] = field(default_factory=dict)             # url -> connections opened
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note_sent(self, mid: str, durable: bool) -> None:
        with self.lock:
            self.sent[mid] = durable

    def note_accepted(self, mid: str, url: str) -> None:
        with self.lock:
            self.accepted.setdefault(mid, (url, time.time()))
            self.refused.pop(mid, None)

    def note_refused(self, mid: str, outcome: str) -> None:
        with self.lock:
            if mid not in self.accepted:
                self.refused[mid] = outcome

    def note_received(self, stream: str, mid: str) -> None:
        with self.lock:
            got = self.received.setdefault(stream, {})
            got[mid] = got.get(mid, 0) + 1

    def note_connection(self, url: str) -> None:
        with self.lock:
            self.connections[url] = self.connections.get(url, 0) + 1

    def accepted_count(self) -> int:
        with self.lock:
            return len(self.accepted)

    def durable_accepted(self) -> set[str]:
        with self.lock:
            return {mid for mid in self.accepted if self.sent[mid]}

    def all_received(self) -> set[str]:
        with self.lock:
            return set().union(*self.received.values()) if self.received else set()


class _Failover(MessagingHandler):
    """One connection at a time to one of `urls`; the next one after a loss."""

    def __init__(self, name: str, urls: list[str], ledger: Ledger, **kw):
        super().__init__(**kw)
        self.name = name
        self.urls = list(urls)
        self.index = 0
        self.ledger = ledger
        self.conn = None
        self.url = ""
        self.link = None
        self.reconnect_at: float | None = 0.0
        self.stopping = threading.Event()
        self.opened = 0

    def on_start(self, event):
        event.container.schedule(0, self)

    def on_timer_task(self, event):
        c = event.container
        if self.stopping.is_set():
            if self.conn is not None:
                self.conn.close()
                self.conn = None
            return
        if self.reconnect_at is not None and time.monotonic() >= self.reconnect_at:
            self.reconnect_at = None
            self.url = self.urls[self.index % len(self.urls)]
            self.conn = c.connect(self.url, reconnect=False, idle_timeout=5, handler=self)
            self.link = self.attach(c, self.conn)
        self.tick()
        c.schedule(TICK, self)

    def attach(self, container, conn):
        raise NotImplementedError

    def tick(self) -> None:
        pass

    def on_connection_opened(self, event):
        if event.connection == self.conn:
            self.opened += 1
            self.ledger.note_connection(self.url)

    def on_transport_error(self, event):
        pass   # on_disconnected follows

    def on_connection_remote_close(self, event):
        if event.connection == self.conn:
            self.lost(event)

    def on_disconnected(self, event):
        if event.connection == self.conn:
            self.lost(event)

    def lost(self, event) -> None:
        conn, self.conn, self.link = self.conn, None, None
        try:
            conn.close()
        except Exception:
            pass
        self.in_doubt()
        self.index += 1
        self.reconnect_at = time.monotonic() + RECONNECT_DELAY

    def in_doubt(self) -> None:
        pass


class FailoverProducer(Outcomes, _Failover):
    """Sends `<name>-<n>` (n = 0, 1, ...) to `address`, durable or not, at most
    `window` unsettled and (with `rate`) at most `rate` new ones per second."""

    def __init__(self, name: str, urls: list[str], address: str, ledger: Ledger, *, durable: bool = True,
                 window: int = 50, rate: float | None = None):
        super().__init__(name, urls, ledger, prefetch=0, auto_accept=False)
        self.address = address
        self.durable = durable
        self.window = window
        self.rate = rate
        self.budget = 0.0
        self.next_n = 0
        self.resend: deque[str] = deque()
        self.in_flight: dict[object, str] = {}
        self.no_new = threading.Event()     # finish what is in doubt, send nothing new

    def attach(self, container, conn):
        # A link name of its own (one container runs every client: the default name,
        # container id + address, would make two producers steal each other's link).
        return container.create_sender(conn, self.address, name=f"{self.name}-sender")

    def tick(self) -> None:
        if self.rate is not None:
            self.budget = min(self.budget + self.rate * TICK, self.rate)
        self.pump()

    def on_sendable(self, event):
        if event.link == self.link:
            self.pump()

    def pump(self) -> None:
        link = self.link
        while (link is not None and link.credit > 0 and len(self.in_flight) < self.window
               and not self.stopping.is_set()
               and (self.resend or (not self.no_new.is_set() and (self.rate is None or self.budget >= 1)))):
            if self.resend:
                mid = self.resend.popleft()
            else:
                mid = f"{self.name}-{self.next_n}"
                self.next_n += 1
                self.budget -= 1
                self.ledger.note_sent(mid, self.durable)
            dlv = link.send(Message(id=mid, durable=self.durable, body=mid))
            self.in_flight[dlv] = mid

    def _outcome(self, event, accepted: bool):
        mid = self.in_flight.pop(event.delivery, None)
        if mid is None or event.link != self.link:
            return
        if accepted:
            self.ledger.note_accepted(mid, self.url)
        else:
            self.ledger.note_refused(mid, str(event.delivery.remote_state))
            self.resend.append(mid)    # not taken: a failover client sends it again
        self.pump()

    def in_doubt(self) -> None:
        """The connection went with sends unsettled: they may or may not have been
        taken; sent again on the next connection (a duplicate if they were)."""
        self.resend.extendleft(reversed(list(self.in_flight.values())))
        self.in_flight.clear()


class FailoverConsumer(_Failover):
    """Receives and accepts from a queue, or from a JMS shared durable subscription
    (`subscription`: its name; `address` the topic), recording every id."""

    def __init__(self, name: str, urls: list[str], address: str, ledger: Ledger, *,
                 subscription: str | None = None, prefetch: int = 100):
        super().__init__(name, urls, ledger, prefetch=prefetch, auto_accept=False)
        self.address = address
        self.subscription = subscription
        self.last_received = time.monotonic()

    def attach(self, container, conn):
        if self.subscription is None:
            return container.create_receiver(conn, self.address, name=f"{self.name}-receiver")
        opts = SourceOptions(capabilities=["topic", "shared", "global"], durable=UNSETTLED_STATE,
                             expiry=Terminus.EXPIRE_NEVER, distribution_mode=Terminus.DIST_MODE_COPY)
        return container.create_receiver(conn, self.address,
                                         name=sub_link_name(self.subscription, 1, global_=True), options=opts)

    def on_message(self, event):
        self.ledger.note_received(self.name, event.message.id)
        self.last_received = time.monotonic()
        self.accept(event.delivery)


class ClientSet:
    """Clients run in one proton Container on a thread of their own."""

    def __init__(self, clients: list[_Failover]):
        self.clients = clients
        self.thread = threading.Thread(target=self._run, name="fault-clients", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            container = Container(*self.clients)
            container.run()
        except BaseException as exc:   # reported by stop()
            self.error = exc

    def start(self) -> "ClientSet":
        self.thread.start()
        return self

    def stop_producers(self) -> None:
        """Producers send nothing new; what is in doubt is still sent until settled."""
        for c in self.producers():
            c.no_new.set()

    def stop(self, timeout: float = 20.0) -> None:
        for c in self.clients:
            c.stopping.set()
        self.thread.join(timeout)
        if self.error is not None:
            raise self.error

    def producers(self) -> list[FailoverProducer]:
        return [c for c in self.clients if isinstance(c, FailoverProducer)]

    def consumers(self) -> list[FailoverConsumer]:
        return [c for c in self.clients if isinstance(c, FailoverConsumer)]

    def describe(self) -> str:
        return "; ".join(f"{p.name}: {p.url} link={'up' if p.link is not None else 'down'} "
                         f"credit={p.link.credit if p.link is not None else '-'} in flight {len(p.in_flight)}, "
                         f"to resend {len(p.resend)}, connections {p.opened}" for p in self.producers())

    def unsettled(self) -> int:
        return sum(len(p.in_flight) + len(p.resend) for p in self.producers())
