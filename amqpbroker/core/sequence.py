"""Reading a durable queue by sequence number: the pure part.  No I/O.

Every entry of a queue has a sequence number (`Entry.seq`) that only grows and
survives restarts (the store keeps the last one per queue).  A receiver that
attaches with distribution-mode `copy` and the source filter
`amqpbroker:sequence-range` = [from, to) reads the *stored* entries with
from <= seq < to, in order, without acquiring them, each with the message
annotation `x-opt-sequence`.  That is a replayable, ordered log: what an
exactly-once stream processor (Spark) needs.  See docs/spark.md.

This module holds the rules; `server/sequence.py` does the I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proton import symbol, ulong

from .codec import DecodeError, decode, encode, skip

SEQUENCE_RANGE = "amqpbroker:sequence-range"      # filter key and descriptor symbol
SEQUENCE_ANNOTATION = symbol("x-opt-sequence")
QUEUE_INFO_ADDRESS = "$amqpbroker.queue-info"
ACK_ADDRESS = "$amqpbroker.ack"
CONTROL_ADDRESSES = (QUEUE_INFO_ADDRESS, ACK_ADDRESS)

MESSAGE_ANNOTATIONS = 0x72
_SECTION_SYMBOLS = {
    "amqp:header:list": 0x70, "amqp:delivery-annotations:map": 0x71,
    "amqp:message-annotations:map": 0x72, "amqp:properties:list": 0x73,
    "amqp:application-properties:map": 0x74, "amqp:data:binary": 0x75,
    "amqp:amqp-sequence:list": 0x76, "amqp:amqp-value:*": 0x77, "amqp:footer:map": 0x78,
}
_MAX_SEQ = (1 << 64) - 1


class RangeError(ValueError):
    """The sequence-range filter value is not a list [from, to) of ulongs."""


@dataclass(frozen=True)
class SeqRange:
    start: int            # first sequence number wanted (inclusive)
    end: int | None       # first sequence number not wanted; None: the tail at attach time

    def bound(self, tail: int) -> "SeqRange":
        """The range actually served: `end` capped at the last stored sequence + 1
        *at attach time* (the committed tail), so that a range read is
        deterministic: replaying it later returns the same messages unless
        some were removed (acknowledged) in between."""
        limit = tail + 1
        end = limit if self.end is None else min(self.end, limit)
        return SeqRange(self.start, max(end, self.start))

    @property
    def empty(self) -> bool:
        return self.end is not None and self.end <= self.start

    def as_filter_value(self) -> list:
        return [ulong(self.start), None if self.end is None else ulong(self.end)]


def parse_range(value: Any) -> SeqRange:
    """The described value of the filter: a list [from, to] of ulong (`to` may be
    null).  from >= 0; to >= from or null."""
    if isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, list) or len(value) not in (1, 2):
        raise RangeError(f"{SEQUENCE_RANGE} must be a list [from, to) of ulongs, got {value!r}")
    start = value[0]
    end = value[1] if len(value) == 2 else None
    if not _is_uint(start) or (end is not None and not _is_uint(end)):
        raise RangeError(f"{SEQUENCE_RANGE} bounds must be unsigned integers, got {value!r}")
    start = int(start)
    end = None if end is None else int(end)
    if end is not None and end < start:
        raise RangeError(f"{SEQUENCE_RANGE} [{start}, {end}) ends before it starts")
    return SeqRange(start, end)


def _is_uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _MAX_SEQ


# ---------------------------------------------------------------------- annotations


def _sections(raw: bytes) -> list[tuple[int, int, int, int]]:
    """(code, section start, value start, end) for every section."""
    out = []
    off, n = 0, len(raw)
    while off < n:
        if raw[off] != 0x00:
            raise DecodeError(f"expected a described section at offset {off}")
        if raw[off + 1] == 0x53:
            code, value_start = raw[off + 2], off + 3
        else:
            descriptor, value_start = decode(raw, off + 1)
            code = _SECTION_SYMBOLS.get(str(descriptor), 0) if isinstance(descriptor, str) else int(descriptor)
        end = skip(raw, value_start)
        out.append((code, off, value_start, end))
        off = end
    return out


def add_annotations(raw: bytes, extra: dict) -> bytes:
    """The message with `extra` added to its message-annotations section (created
    when absent).  Every other byte is the producer's: the existing map is
    extended in place (size and count rewritten) rather than re-encoded."""
    sections = _sections(raw)
    ma = next((s for s in sections if s[0] == MESSAGE_ANNOTATIONS), None)
    if ma is None:
        at = next((s[1] for s in sections if s[0] > MESSAGE_ANNOTATIONS), len(raw))
        return raw[:at] + b"\x00\x53\x72" + encode(dict(extra)) + raw[at:]
    _, start, value_start, end = ma
    body = raw[value_start:end]
    if any(str(k).encode() in body for k in extra):
        # A key we add is already there: rebuild the map (rare; keys must be unique).
        current, _ = decode(raw, value_start)
        if not isinstance(current, dict):
            raise DecodeError("message-annotations section is not a map")
        current = {k: v for k, v in current.items() if str(k) not in {str(x) for x in extra}}
        current.update(extra)
        return raw[:value_start] + encode(current) + raw[end:]
    code = body[0]
    if code == 0xC1:
        count, items = body[2], body[3:]
    elif code == 0xD1:
        count = int.from_bytes(body[5:9], "big")
        items = body[9:]
    else:
        raise DecodeError(f"message-annotations section is not a map (0x{code:02x})")
    added = b"".join(encode(k) + encode(v) for k, v in extra.items())
    items = items + added
    count += 2 * len(extra)
    if code == 0xC1 and len(items) + 1 < 256 and count < 256:   # keep the producer's width
        head = bytes((0xC1, len(items) + 1, count))
    else:
        head = b"\xd1" + (len(items) + 4).to_bytes(4, "big") + count.to_bytes(4, "big")
    return raw[:value_start] + head + items + raw[end:]


def with_sequence(raw: bytes, seq: int) -> bytes:
    return add_annotations(raw, {SEQUENCE_ANNOTATION: ulong(seq)})


# ---------------------------------------------------------------------- reader ownership


@dataclass
class ReaderClaim:
    """Who may acknowledge (remove) a queue's messages by sequence number.

    A queue is owned by the first reader that acknowledges on it (or claims it
    with below=0); the claim is stored.  It names the queue instance (store id),
    so a queue deleted and created again under the same name starts unowned."""
    queue: str
    queue_id: int
    reader: str
    below: int = 0

    def to_json(self) -> dict:
        return {"queue": self.queue, "queue_id": self.queue_id, "reader": self.reader, "below": self.below}

    @classmethod
    def from_json(cls, d: dict) -> "ReaderClaim":
        return cls(d["queue"], int(d["queue_id"]), d["reader"], int(d.get("below", 0)))


class AckRefused(Exception):
    def __init__(self, condition: str, description: str):
        super().__init__(description)
        self.condition = condition
        self.description = description


def decide_ack(claim: ReaderClaim | None, queue: str, queue_id: int, reader: str, below: int,
               release: bool = False) -> ReaderClaim | None:
    """The claim after reader `reader` acknowledges everything below `below` on
    `queue` (or releases its claim).  Raises AckRefused for another reader's queue."""
    if not reader:
        raise AckRefused("amqp:invalid-field", "an acknowledgement needs a reader name")
    if below < 0:
        raise AckRefused("amqp:invalid-field", "'below' must be >= 0")
    if claim is not None and claim.queue_id != queue_id:
        claim = None            # the queue was deleted and created again: stale claim
    if claim is not None and claim.reader != reader:
        raise AckRefused("amqp:resource-locked",
                         f"queue '{queue}' is owned by reader '{claim.reader}'")
    if release:
        return None
    if claim is None:
        return ReaderClaim(queue, queue_id, reader, below)
    return ReaderClaim(queue, queue_id, reader, max(claim.below, below))
