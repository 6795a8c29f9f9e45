"""Builders for pure-core tests: encoded messages and an in-memory consumer."""

from __future__ import annotations

from proton import Message as PnMessage

from amqpbroker.core.message import Message


def bodies(entries) -> list:
    """The decoded bodies of queue entries, as a consumer would see them."""
    out = []
    for e in entries:
        m = PnMessage()
        m.decode(e.payload())
        out.append(m.body)
    return out


def make_message(body="x", *, publisher=None, arrival=None, **fields) -> Message:
    """Encode a real AMQP message with proton and wrap it as the broker does."""
    return Message(PnMessage(body=body, **fields).encode(), publisher=publisher, arrival=arrival)


def queue_of(n: int, **kw):
    """A Queue holding messages with bodies 0 .. n-1 (kw: Queue's own)."""
    from amqpbroker.core.queues import Queue
    q = Queue(kw.pop("name", "q"), **kw)
    for i in range(n):
        q.enqueue(make_message(i))
    return q


class Clock:
    """A settable clock for a Queue (`clock=`): tests move `t` forward."""

    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


class RecordingConsumer:
    """A ConsumerPort that records deliveries; credit is set by the test."""

    _ids = iter(range(1, 10**9))
    standby = False

    def __init__(self, credit=0, accept=None, browser=False):
        self.consumer_id = next(self._ids)
        self._credit = credit
        self._accept = accept
        self.filtered = accept is not None
        self.browser = browser
        self.browse_cursor = 0
        self.delivered = []
        self.copies = []

    def deliver_copy(self, entry):
        self._credit -= 1
        self.copies.append(entry)

    def credit(self):
        return self._credit

    def grant(self, n, queue=None):
        self._credit += n
        if queue is not None:
            queue.dispatch()

    def accepts(self, entry):
        return self._accept(entry) if self._accept else True

    def deliver(self, entry):
        self._credit -= 1
        self.delivered.append(entry)

    def bodies(self):
        return [PnMessage().decode(e.payload()) or None for e in self.delivered]


class NoStore:
    """A StoreHooks (core/entries.py) that stores nothing; tests override what they watch."""

    def entry_added(self, queue, entry):
        pass

    def entry_removed(self, queue, entry):
        pass

    def entry_updated(self, queue, entry, delivered):
        pass

    def load_body(self, entry):
        raise RuntimeError(f"no body for seq {entry.seq}")

    def page_out(self, queue, entry):
        pass

    def read_paged(self, queue, after, limit):
        return []

    def drop_paged(self, queue, after, below, skip):
        return 0, 0
