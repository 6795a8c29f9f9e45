"""A message's move / replay / dead-letter history, and the rule that keeps those
operations from feeding themselves.  Pure: no I/O.

Each time the broker takes a message out of a queue and sends a copy elsewhere (it
dies there and is dead-lettered, an operator moves or replays it) the copy carries
one more record, in the message annotation `x-opt-amqpbroker-history` (AMQP 1.0
§3.2.3 leaves `x-opt-` keys to implementations): a list of maps

    queue   the queue it left
    reason  rejected | max-delivery-attempts | overflow | expired (dead-lettered),
            moved | replayed (an operator's move or replay)
    count   how many times it left that queue for that reason
    op      the operation that did it the last time: a move or replay job's id, or
            `dead-letter` for the broker's own dead-lettering
    time    when, ms since the epoch (a timestamp)

one record per (queue, reason), newest last, at most MAX_RECORDS (the oldest go).
RabbitMQ's `x-death` header is the same idea.

The rule (`excluded`): a copy is never delivered into a queue it already left for
the same reason in the same operation.  A move's copy does not go back into its
source (an exchange bound back to it), a replay's copy does not go back into the
dead-letter queue it came from.  Dead-lettering has a rule of its own, which
makes a dead-letter cycle impossible (core/broker.py): a message that dies in a
queue the dead-letter address routes to is dropped, never dead-lettered again,
and a dead letter never goes back into the queue it died in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from proton import symbol, timestamp, ulong

HISTORY = symbol("x-opt-amqpbroker-history")
MAX_RECORDS = 16

MOVED = "moved"
REPLAYED = "replayed"
DEAD_LETTER_OP = "dead-letter"


@dataclass(frozen=True)
class Record:
    queue: str
    reason: str
    count: int
    op: str
    time: int

    def encoded(self) -> dict:
        return {"queue": self.queue, "reason": self.reason, "count": ulong(self.count), "op": self.op,
                "time": timestamp(self.time)}


def parse(value: Any) -> list[Record]:
    """The records of an annotation value; what is not a well-formed record is left
    out (a producer may have sent anything under that key)."""
    if not isinstance(value, (list, tuple)):
        return []
    out = []
    for item in value:
        if not isinstance(item, dict):
            continue
        queue, reason, op = item.get("queue"), item.get("reason"), item.get("op")
        count, when = item.get("count"), item.get("time")
        if isinstance(queue, str) and isinstance(reason, str):
            out.append(Record(queue, reason, int(count) if isinstance(count, int) else 1,
                              op if isinstance(op, str) else "", int(when) if isinstance(when, int) else 0))
    return out


def add(records: list[Record], queue: str, reason: str, op: str, now_ms: int) -> list[Record]:
    """The history after the message left `queue` for `reason` in operation `op`."""
    count = 1
    kept = []
    for r in records:
        if r.queue == queue and r.reason == reason:
            count = r.count + 1
        else:
            kept.append(r)
    kept.append(Record(queue, reason, count, op, now_ms))
    return kept[-MAX_RECORDS:]


def encode(records: Iterable[Record]) -> list:
    return [r.encoded() for r in records]


def excluded(records: Iterable[Record], reason: str, op: str) -> set[str]:
    """The queues a copy leaving for `reason` in operation `op` must not be delivered
    into: those it already left for that reason in that operation."""
    return {r.queue for r in records if r.reason == reason and r.op == op}
