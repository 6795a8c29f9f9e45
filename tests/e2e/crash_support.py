"""Crash-test machinery shared by tests/e2e/test_crash.py and bench/soak.py.

A producer (python-qpid-proton, event-driven, unsettled sends, durable messages with
unique ids) sends as fast as it can, optionally with a consumer accepting on another
connection; once N sends were Accepted another thread SIGKILLs the broker process.
After a restart `drain` empties the queue and `assess` compares what came back with
what the clients saw:

* every message the producer saw Accepted, and the consumer had not taken before the
  crash, is there exactly once (`lost` must be empty);
* a message seen again (taken before the crash, or by an earlier drain whose
  acknowledgement may not have been committed) must be marked redelivered
  (delivery-count > 0);
* a message the producer saw Rejected is not there; nothing unknown is there;
* the queue order is kept (ascending sequence numbers within one producer run).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from proton import Message, Timeout
from proton.handlers import MessagingHandler
from proton.reactor import Container

from tests.client import connect


@dataclass
class Traffic:
    prefix: str
    sent: dict[str, int] = field(default_factory=dict)       # id -> sequence
    accepted: set[str] = field(default_factory=set)
    rejected: dict[str, str] = field(default_factory=dict)   # id -> condition name
    consumed: dict[str, int] = field(default_factory=dict)   # id -> delivery-count when taken
    consumed_twice: list[str] = field(default_factory=list)  # redelivered before the crash
    accepted_at_kill: int = -1
    killed: bool = False
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


class Outcomes:
    """A sender's outcomes to `_outcome(event, accepted)`: Accepted is True; Rejected
    and Released (not taken: the producer may not count it) are False."""

    def on_accepted(self, event):
        self._outcome(event, True)

    def on_rejected(self, event):
        self._outcome(event, False)

    def on_released(self, event):
        self._outcome(event, False)


class _Clients(Outcomes, MessagingHandler):
    def __init__(self, url: str, address: str, traffic: Traffic, kill_after: int,
                 threshold: threading.Event, *, consume: bool, window: int, body: bytes | None,
                 max_messages: int, deadline: float, prefetch: int):
        super().__init__(prefetch=prefetch if consume else 0, auto_accept=False)
        self.url = url
        self.address = address
        self.t = traffic
        self.kill_after = kill_after
        self.threshold = threshold
        self.consume = consume
        self.window = window
        self.body = body
        self.max_messages = max_messages
        self.deadline = deadline
        self.by_tag: dict[Any, str] = {}
        self.in_flight = 0
        self.next_seq = 0
        self.open = 0
        self.stopped = False

    def on_start(self, event):
        c = event.container
        sconn = c.connect(self.url, reconnect=False)
        c.create_sender(sconn, self.address)
        self.open = 1
        if self.consume:
            rconn = c.connect(self.url, reconnect=False)
            c.create_receiver(rconn, self.address)
            self.open += 1
        c.schedule(self.deadline, self)

    def on_timer_task(self, event):  # safety net: never hang a test
        self.t.errors.append("client deadline reached")
        self._stop(event.container)

    def on_sendable(self, event):
        self._pump(event.sender)

    def _pump(self, sender):
        t = self.t
        while (sender.credit > 0 and self.in_flight < self.window
               and self.next_seq < self.max_messages and not self.stopped):
            seq = self.next_seq
            self.next_seq += 1
            mid = f"{t.prefix}-{seq}"
            dlv = sender.send(self._message(mid, seq))
            self.by_tag[dlv.tag] = mid
            t.sent[mid] = seq
            self.in_flight += 1

    def _message(self, mid: str, seq: int) -> Message:
        return Message(id=mid, durable=True, body=self.body if self.body is not None else seq,
                       properties={"seq": seq})

    def _outcome(self, event, accepted: bool):
        mid = self.by_tag.pop(event.delivery.tag, None)
        if mid is None:
            return
        self.in_flight -= 1
        if accepted:
            self.t.accepted.add(mid)
            if len(self.t.accepted) >= self.kill_after and not self.threshold.is_set():
                self.t.accepted_at_kill = len(self.t.accepted)
                self.threshold.set()
        else:
            cond = event.delivery.remote.condition
            self.t.rejected[mid] = cond.name if cond else "?"
        self._pump(event.link)

    def on_message(self, event):
        msg = event.message
        if msg.id in self.t.consumed:
            self.t.consumed_twice.append(msg.id)
        else:
            self.t.consumed[msg.id] = msg.delivery_count
        self.accept(event.delivery)

    def on_disconnected(self, event):
        self.open -= 1
        if self.open <= 0:
            self._stop(event.container)

    def on_transport_error(self, event):
        pass  # the crash: expected (on_disconnected follows)

    def _stop(self, container):
        if not self.stopped:
            self.stopped = True
            container.stop()


def produce_until_crash(broker: Any, address: str, prefix: str, kill_after: int, *,
                        consume: bool = False, window: int = 1000, body: bytes | None = None,
                        max_messages: int = 1_000_000, deadline: float = 30.0,
                        prefetch: int = 100, kill_delay: float = 0.0) -> Traffic:
    """Run the clients against `broker` (a BrokerProcess) until it is SIGKILLed, which
    happens (from another thread) `kill_delay` seconds after `kill_after` sends were
    Accepted (a delay moves the crash point off the commit boundary: mid-batch,
    mid-fsync)."""
    traffic = Traffic(prefix)
    threshold = threading.Event()
    handler = _Clients(broker.url, address, traffic, kill_after, threshold, consume=consume,
                       window=window, body=body, max_messages=max_messages, deadline=deadline,
                       prefetch=prefetch)

    def killer():
        if threshold.wait(deadline) and kill_delay:
            time.sleep(kill_delay)
        broker.kill()
        traffic.killed = True

    thread = threading.Thread(target=killer, name="crash-killer", daemon=True)
    started = time.monotonic()
    thread.start()
    container = Container(handler)
    container.run()
    thread.join(deadline + 10)
    traffic.seconds = time.monotonic() - started
    return traffic


class _UntilSettled(_Clients):
    def _outcome(self, event, accepted):
        super()._outcome(event, accepted)
        if len(self.t.accepted) + len(self.t.rejected) >= self.max_messages:
            self._stop(event.container)


def send_durable(broker: Any, address: str, n: int, prefix: str, *, window: int = 200,
                 body: bytes = b"B" * 1024) -> Traffic:
    """n durable messages, `window` unsettled at a time; every outcome recorded."""
    t = Traffic(prefix)
    handler = _UntilSettled(broker.url, address, t, 10**9, threading.Event(), consume=False, window=window,
                            body=body, max_messages=n, deadline=60.0, prefetch=0)
    Container(handler).run()
    assert not t.errors, t.errors
    assert len(t.accepted) + len(t.rejected) == n
    return t


def drain(url: str, address: str, quiet: float = 1.5, credit: int = 500) -> list[tuple[str, int]]:
    """Receive (and accept) until nothing arrives for `quiet` seconds: [(id, delivery-count)]."""
    conn = connect(url)
    out: list[tuple[str, int]] = []
    try:
        receiver = conn.create_receiver(address, credit=credit)
        while True:
            try:
                msg = receiver.receive(timeout=quiet)
            except Timeout:
                break
            out.append((msg.id, msg.delivery_count))
            receiver.accept()
        receiver.close()
    finally:
        conn.close()
    return out


@dataclass
class Assessment:
    accepted: int
    recovered: int                 # distinct ids of this run found after the restart
    lost: list[str]                # accepted, not taken before the crash, not recovered
    duplicates: int                # copies beyond the first of one id in the drain
    redelivered: int               # recovered copies marked redelivered (count > 0)
    unmarked_repeats: list[str]    # seen before, back again with delivery-count 0
    rejected_present: list[str]    # the producer was told Rejected, yet it is there
    unknown: list[str]             # ids nobody sent
    out_of_order: int              # recovered ids of this run not in sequence order
    taken_before_crash: int = 0
    came_back_after_taken: int = 0

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicates or self.unmarked_repeats or self.rejected_present
                    or self.unknown or self.out_of_order)

    def problems(self) -> str:
        parts = []
        for name in ("lost", "unmarked_repeats", "rejected_present", "unknown"):
            v = getattr(self, name)
            if v:
                parts.append(f"{name}: {len(v)} e.g. {sorted(v)[:5]}")
        if self.duplicates:
            parts.append(f"duplicates in the drain: {self.duplicates}")
        if self.out_of_order:
            parts.append(f"out of order: {self.out_of_order}")
        return "; ".join(parts)


def assess(traffic: Traffic, recovered: list[tuple[str, int]],
           seen_before: dict[str, int] | None = None) -> Assessment:
    """`seen_before`: ids delivered to a client in earlier cycles (their acknowledgement
    may not have been committed when the broker was killed)."""
    seen_before = seen_before or {}
    counts = Counter(mid for mid, _ in recovered)
    this_run = [mid for mid, _ in recovered if mid in traffic.sent]
    taken = set(traffic.consumed)
    lost = sorted(traffic.accepted - taken - set(counts))
    unmarked = []
    first_copy: set[str] = set()
    for mid, count in recovered:
        repeat = mid in taken or mid in seen_before or mid in first_copy
        first_copy.add(mid)
        if repeat and count == 0:
            unmarked.append(mid)
    seqs = [traffic.sent[mid] for mid in dict.fromkeys(this_run)]
    out_of_order = sum(1 for a, b in zip(seqs, seqs[1:]) if b < a)
    return Assessment(
        accepted=len(traffic.accepted),
        recovered=len(set(this_run)),
        lost=lost,
        duplicates=sum(n - 1 for n in counts.values() if n > 1),
        redelivered=sum(1 for _, count in recovered if count > 0),
        unmarked_repeats=unmarked,
        rejected_present=sorted(set(traffic.rejected) & set(counts)),
        unknown=sorted(mid for mid in counts if mid not in traffic.sent and mid not in seen_before),
        out_of_order=out_of_order,
        taken_before_crash=len(taken),
        came_back_after_taken=len(taken & set(counts)),
    )
