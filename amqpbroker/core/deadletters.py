"""Dead-letter and move provenance: what the broker writes into a message it takes
out of a queue and sends elsewhere, in one place.  Pure: no I/O.

A dead-lettered copy carries where it came from and why, so that `replay` can send
it back and an operator (or a plain JMS application) can see the reason, twice:

message annotations (AMQP 1.0 §3.2.3; `x-opt-` keys are left to implementations):

    x-opt-amqpbroker-dlq-queue    the queue it was dead-lettered from
    x-opt-amqpbroker-dlq-address  the address a replay sends it to (the queue, or for a
                                  subscription's queue the topic it was bound to)
    x-opt-amqpbroker-dlq-reason   rejected | max-delivery-attempts | overflow | expired
    x-opt-amqpbroker-dlq-time     when, ms since the epoch (a timestamp)

application properties (§3.2.5), which JMS reads with getObjectProperty / selectors
(as ActiveMQ Artemis exposes `_AMQ_ORIG_*`), with the prefix `_AMQPBROKER_DLQ_`:

    _AMQPBROKER_DLQ_QUEUE, _AMQPBROKER_DLQ_ADDRESS, _AMQPBROKER_DLQ_REASON (strings),
    _AMQPBROKER_DLQ_TIME (a long, ms since the epoch)

and every such copy, moved or replayed ones too, one more record of its history
(core/history.py, `x-opt-amqpbroker-history`).  A replay takes the dead-letter
annotations and properties out again (the history stays).  The sections are
rewritten by core/sections.py: only the two map sections change, the rest keeps
the producer's bytes.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from proton import symbol, timestamp

from . import history
from .sections import APPLICATION_PROPERTIES, MESSAGE_ANNOTATIONS, SectionError, read_map, rewrite_map

DLQ_QUEUE = symbol("x-opt-amqpbroker-dlq-queue")
DLQ_ADDRESS = symbol("x-opt-amqpbroker-dlq-address")
DLQ_REASON = symbol("x-opt-amqpbroker-dlq-reason")
DLQ_TIME = symbol("x-opt-amqpbroker-dlq-time")
DLQ_KEYS = (DLQ_QUEUE, DLQ_ADDRESS, DLQ_REASON, DLQ_TIME)

PROPERTY_PREFIX = "_AMQPBROKER_DLQ_"
PROP_QUEUE, PROP_ADDRESS, PROP_REASON, PROP_TIME = (PROPERTY_PREFIX + k for k in ("QUEUE", "ADDRESS", "REASON", "TIME"))
PROPERTY_KEYS = (PROP_QUEUE, PROP_ADDRESS, PROP_REASON, PROP_TIME)

REJECTED = "rejected"
MAX_ATTEMPTS = "max-delivery-attempts"
OVERFLOW = "overflow"
EXPIRED = "expired"


AnnotationError = SectionError   # the message's sections or a map section cannot be walked


def reason_code(reason: str) -> str:
    """The short reason a dead-letter annotation carries, from the queue's own text
    (core/queues.py and core/limits.py word them for the log)."""
    text = reason.lower()
    if text.startswith("delivery attempts"):
        return MAX_ATTEMPTS
    if "overflow" in text or "full" in text:
        return OVERFLOW
    if "expir" in text:
        return EXPIRED
    if text.startswith("rejected"):
        return REJECTED
    return text


def dead_letter_annotations(queue: str, address: str, reason: str, now_ms: int) -> dict:
    """The annotations a dead-lettered copy gets (keys in DLQ_KEYS)."""
    return {DLQ_QUEUE: queue, DLQ_ADDRESS: address, DLQ_REASON: reason_code(reason),
            DLQ_TIME: timestamp(now_ms)}


SUBSCRIPTION_PREFIX = "qpidsub_/"   # core/subscriptions.py: every subscription's queue


def return_address(queue: str, bindings: Iterable[tuple[str, str]]) -> str:
    """Where a replay sends a message dead-lettered from `queue`: the queue itself,
    but for a topic subscription's queue the topic it was bound to (its own queue may
    be gone by then, and a subscriber that comes back gets it from the topic).  A
    binding key without wildcards becomes `exchange/key` (core/addresses.py); with
    wildcards, the exchange alone (routing by the message's subject)."""
    if queue.startswith(SUBSCRIPTION_PREFIX):
        for exchange, key in bindings:
            if key and not any(w in key.split(".") for w in ("*", "#")):
                return f"{exchange}/{key}"
            return exchange
    return queue


def origin(annotations: Mapping[Any, Any]) -> tuple[str | None, str | None]:
    """(queue, address) a dead-lettered message came from; None where absent."""
    queue = annotations.get(DLQ_QUEUE)
    address = annotations.get(DLQ_ADDRESS)
    return (queue if isinstance(queue, str) else None, address if isinstance(address, str) else None)


# ---------------------------------------------------------------------- the marks


def rewrite_annotations(raw: bytes, put: Mapping[Any, Any] | None = None, drop: Iterable[Any] = ()) -> bytes:
    """`raw` with its message-annotations changed (core/sections.py rewrite_map)."""
    return rewrite_map(raw, MESSAGE_ANNOTATIONS, put, drop)


def history_of(raw: bytes) -> list[history.Record]:
    """The history a message carries ([] when none or unreadable)."""
    try:
        return history.parse(read_map(raw, MESSAGE_ANNOTATIONS).get(history.HISTORY))
    except SectionError:
        return []


def mark_dead_lettered(raw: bytes, queue: str, address: str, reason: str, now_ms: int) -> bytes:
    """A dead-lettered copy's bytes: origin annotations, the same as application
    properties, one more history record.  Raises SectionError when the annotations
    cannot be walked; application-properties that cannot be walked are left as they
    are (the annotations still say it all)."""
    code = reason_code(reason)
    records = history.add(history_of(raw), queue, code, history.DEAD_LETTER_OP, now_ms)
    marks = dead_letter_annotations(queue, address, reason, now_ms)
    marks[history.HISTORY] = history.encode(records)
    out = rewrite_annotations(raw, marks)
    try:
        return rewrite_map(out, APPLICATION_PROPERTIES, {PROP_QUEUE: queue, PROP_ADDRESS: address,
                                                         PROP_REASON: code, PROP_TIME: int(now_ms)})
    except SectionError:
        return out


def mark_moved(raw: bytes, queue: str, op: str, now_ms: int, *, replay: bool) -> bytes:
    """A moved or replayed copy's bytes: one more history record; a replay also
    loses the dead-letter annotations and properties (it goes back as it was sent)."""
    reason = history.REPLAYED if replay else history.MOVED
    records = history.add(history_of(raw), queue, reason, op, now_ms)
    out = rewrite_annotations(raw, {history.HISTORY: history.encode(records)}, DLQ_KEYS if replay else ())
    if not replay:
        return out
    try:
        return rewrite_map(out, APPLICATION_PROPERTIES, drop=PROPERTY_KEYS)
    except SectionError:
        return out
