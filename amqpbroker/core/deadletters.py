"""Dead-letter origin annotations and the byte-level rewrite of a message's
message-annotations section.  Pure: no I/O.

A dead-lettered copy carries where it came from and why, as message annotations
(AMQP 1.0 §3.2.3, described by 0x72: a map with symbol or ulong keys), so that
`replay` can send it back and an operator can see the reason:

    x-opt-amqpbroker-dlq-queue    the queue it was dead-lettered from
    x-opt-amqpbroker-dlq-address  the address a replay sends it to (the queue, or for a
                                  subscription's queue the topic it was bound to)
    x-opt-amqpbroker-dlq-reason   rejected | max-delivery-attempts | overflow | expired
    x-opt-amqpbroker-dlq-time     when, ms since the epoch (a timestamp)

Only the message-annotations section is re-encoded: the other sections keep the
producer's bytes (the properties and application-properties a consumer checks, a
footer's checksum over them).  Within the section, the annotations already there
keep their bytes too: keys are decoded to find ours, values are only stepped over
(a re-encoding would turn an array into a list, for one).  `x-opt-` keys are the
ones §3.2.3 leaves to implementations.
"""

from __future__ import annotations

import struct
from typing import Any, Iterable, Mapping

from proton import symbol, timestamp

from .codec import DecodeError, decode, encode, skip

MESSAGE_ANNOTATIONS = 0x72
_BEFORE_ANNOTATIONS = (0x70, 0x71)   # header, delivery-annotations (§3.2: the order of sections)

DLQ_QUEUE = symbol("x-opt-amqpbroker-dlq-queue")
DLQ_ADDRESS = symbol("x-opt-amqpbroker-dlq-address")
DLQ_REASON = symbol("x-opt-amqpbroker-dlq-reason")
DLQ_TIME = symbol("x-opt-amqpbroker-dlq-time")
DLQ_KEYS = (DLQ_QUEUE, DLQ_ADDRESS, DLQ_REASON, DLQ_TIME)

REJECTED = "rejected"
MAX_ATTEMPTS = "max-delivery-attempts"
OVERFLOW = "overflow"
EXPIRED = "expired"


class AnnotationError(ValueError):
    """The message's sections or its message-annotations map cannot be walked."""


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


# ---------------------------------------------------------------------- the section rewrite

def rewrite_annotations(raw: bytes, put: Mapping[Any, Any] | None = None,
                        drop: Iterable[Any] = ()) -> bytes:
    """`raw` with its message-annotations map changed: the keys in `drop` and in `put`
    taken out, then `put`'s pairs added.  A section left empty is removed; one that
    was absent is created where §3.2 places it (after header and delivery-annotations).
    Raises AnnotationError when the sections or the map cannot be walked."""
    put = dict(put or {})
    gone = set(drop) | set(put)
    start, value_start, end, insert_at = _locate(raw)
    kept = _pairs(raw, value_start, end, gone) if start is not None else []
    kept += [encode(k) + encode(v) for k, v in put.items()]
    # The map keeps the width it came in (proton writes map32 even for small maps):
    # dropping what was added gives back the bytes the producer sent.
    wide = start is not None and raw[value_start] == 0xD1
    descriptor = raw[start:value_start] if start is not None else b"\x00\x53\x72"
    section = (descriptor + _map_bytes(kept, wide)) if kept else b""
    if start is None:
        return raw[:insert_at] + section + raw[insert_at:]
    return raw[:start] + section + raw[end:]


def _locate(raw: bytes) -> tuple[int | None, int, int, int]:
    """(section start, value start, end) of the message-annotations section (start
    None when absent) and the offset where a new one goes."""
    off, n = 0, len(raw)
    insert_at = 0
    try:
        while off < n:
            if raw[off] != 0x00:
                raise AnnotationError(f"expected a described section at offset {off}")
            descriptor, value_start = decode(raw, off + 1)
            end = skip(raw, value_start)
            code = _code(descriptor)
            if code == MESSAGE_ANNOTATIONS:
                return off, value_start, end, off
            if code not in _BEFORE_ANNOTATIONS:
                return None, 0, 0, off
            insert_at = off = end
    except (DecodeError, IndexError) as exc:
        raise AnnotationError(f"message sections cannot be walked: {exc}") from exc
    return None, 0, 0, insert_at


_SYMBOLIC = {"amqp:header:list": 0x70, "amqp:delivery-annotations:map": 0x71,
             "amqp:message-annotations:map": MESSAGE_ANNOTATIONS}


def _code(descriptor: Any) -> int:
    """A section's code from its descriptor, ulong or symbolic (§3.2); -1 otherwise."""
    if isinstance(descriptor, int) and not isinstance(descriptor, bool):
        return descriptor
    return _SYMBOLIC.get(descriptor, -1) if isinstance(descriptor, str) else -1


def _pairs(raw: bytes, value_start: int, end: int, gone: set) -> list[bytes]:
    """The encoded key+value pairs of the map at `value_start` whose key is not in `gone`."""
    c = raw[value_start]
    if c == 0x40:          # a null value: no annotations
        return []
    try:
        if c == 0xC1:
            count, off = raw[value_start + 2], value_start + 3
        elif c == 0xD1:
            count, off = struct.unpack_from(">I", raw, value_start + 5)[0], value_start + 9
        else:
            raise AnnotationError(f"message-annotations is not a map (constructor 0x{c:02x})")
        out = []
        for _ in range(count // 2):
            key, after_key = decode(raw, off)
            after_value = skip(raw, after_key)
            if key not in gone:
                out.append(bytes(raw[off:after_value]))
            off = after_value
    except (DecodeError, IndexError, struct.error, TypeError) as exc:
        raise AnnotationError(f"message-annotations cannot be read: {exc}") from exc
    if off != end:
        raise AnnotationError("message-annotations map size mismatch")
    return out


def _map_bytes(pairs: list[bytes], wide: bool = False) -> bytes:
    """A map (§1.6.23) of already encoded key+value pairs: map8 when it fits and
    `wide` is not asked for."""
    body = b"".join(pairs)
    count = 2 * len(pairs)
    if not wide and len(body) + 1 < 256 and count < 256:
        return bytes((0xC1, len(body) + 1, count)) + body
    return b"\xd1" + struct.pack(">II", len(body) + 4, count) + body
