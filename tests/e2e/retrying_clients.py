"""At-least-once clients for the fault tests of the cluster, as a JMS client on a
failover URI behaves: each runs in a thread, connects, works until stopped or until
its connection or link fails, then connects again.

* `AcceptedProducer` sends n = 0, 1, ... durable, each again until its outcome is
  Accepted; `acked` holds what the broker answered Accepted (the checker's truth).
* `AcceptingConsumer` receives and accepts on the link `attach(conn)` makes; a
  detach that proton's blocking client does not raise for (a non-closing detach
  leaves the link REMOTE_ACTIVE, only its remote condition shows it) ends the link
  too, and the consumer attaches again.
* `kill_or_pause` is one nemesis fault on a node of `serve --workers N`.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Any, Callable

from proton import Delivery, Message, Timeout

from tests.client import connect
from tests.e2e.helpers_delivery import sender, uid


class RetryingClient(threading.Thread):
    """Connects to `url_of()` (asked again at each connection), does `work`, and
    connects again after any failure; `reasons` says why each connection ended."""

    def __init__(self, name: str, url_of: Callable[[], str]):
        super().__init__(daemon=True)
        self.name_ = name
        self.url_of = url_of
        self.stop = threading.Event()
        self.reasons: list[str] = []

    @property
    def failures(self) -> int:
        return len(self.reasons)

    def run(self) -> None:
        while not self.stop.is_set():
            conn = None
            try:
                conn = connect(self.url_of(), container_id=uid(self.name_), timeout=5)
                self.work(conn)
            except Exception as exc:   # noqa: BLE001 - a node or the way to it went: connect again
                self.reasons.append(f"{type(exc).__name__}: {str(exc)[:120]}")
                time.sleep(0.2)
            finally:
                if conn is not None:
                    try:
                        conn.close()
                    except Exception:   # noqa: BLE001 - already gone with its node
                        pass

    def work(self, conn: Any) -> None:
        raise NotImplementedError


class AcceptedProducer(RetryingClient):
    """Sends `body(n)` for n = 0, 1, ... to `address`, durable, each until Accepted."""

    def __init__(self, name: str, url_of: Callable[[], str], address: str,
                 body: Callable[[int], Any] | None = None):
        super().__init__(name, url_of)
        self.address = address
        self.body = body or (lambda n: [name, n])
        self.acked: list[int] = []

    def work(self, conn: Any) -> None:
        snd = sender(conn, self.address)
        while not self.stop.is_set():
            n = len(self.acked)
            dlv = snd.send(Message(body=self.body(n), durable=True), timeout=10)
            if dlv.remote_state != Delivery.ACCEPTED:
                raise RuntimeError(f"outcome {dlv.remote_state}")
            self.acked.append(n)


class AcceptingConsumer(RetryingClient):
    """Receives and accepts on `attach(conn)`'s link; `pace` seconds between two."""

    def __init__(self, name: str, url_of: Callable[[], str], attach: Callable[[Any], Any], pace: float = 0.0):
        super().__init__(name, url_of)
        self.attach = attach
        self.pace = pace
        self.got: list[Any] = []
        self.last = time.monotonic()

    def work(self, conn: Any) -> None:
        rcv = self.attach(conn)
        while not self.stop.is_set():
            try:
                msg = rcv.receive(timeout=0.5)
            except Timeout:
                if rcv.link.remote_condition is not None:
                    raise RuntimeError(f"detached: {rcv.link.remote_condition.name}") from None
                continue
            self.got.append(tuple(msg.body) if isinstance(msg.body, list) else msg.body)
            self.last = time.monotonic()
            rcv.accept()
            if self.pace:
                time.sleep(self.pace)


def acknowledged(producers: list[AcceptedProducer]) -> int:
    return sum(len(p.acked) for p in producers)


def wait_for_more_acks(producers: list[AcceptedProducer], more: int, timeout: float = 120.0) -> None:
    """Until `more` sends than now have been Accepted (by count: a slow machine only
    makes it longer; the deadline only stops a hung test, whose checker then fails)."""
    target = acknowledged(producers) + more
    deadline = time.monotonic() + timeout
    while acknowledged(producers) < target and time.monotonic() < deadline:
        time.sleep(0.05)


def stop_all(clients: list[RetryingClient]) -> None:
    for c in clients:
        c.stop.set()
    for c in clients:
        c.join(30)


def kill_or_pause(cluster: Any, node: str, rng: random.Random) -> str:
    """One fault on a node of `serve --workers N`, drawn from `rng`: kill -9 (the
    supervisor starts it again on its store; returns once it listens) or SIGSTOP for
    0.3–1.5 s (a pause is not a crash: it wakes up believing stale things)."""
    if rng.random() < 0.5:
        mark = len(cluster.lines)
        cluster.kill_node(node)
        cluster.wait_nodes(after=mark, timeout=60)
        return f"kill {node}"
    pid = cluster.worker_pid(node)
    os.kill(pid, signal.SIGSTOP)
    time.sleep(rng.uniform(0.3, 1.5))
    os.kill(pid, signal.SIGCONT)
    return f"pause {node}"
