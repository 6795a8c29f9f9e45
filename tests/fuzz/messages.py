"""Message mutants: hostile transfer payloads in well-formed transfer frames.

A bad message never breaks its connection (AMQP 1.0: the broker rejects it, or
queues it opaque), so these run many to one connection (`run_messages`).  Kinds:
`msg-bit-flip`, `msg-byte-insert`, `msg-byte-delete`, `msg-truncate`,
`msg-section-value` (a section's value replaced by a random value), `msg-header-field`
and `msg-properties-field` (one field of another type), `msg-app-properties`
(random keys and values, list keys included), `msg-annotations` (scheduling
annotations of random types, odd keys), `msg-deep-nesting`, `msg-huge-count`,
`msg-sections` (sections dropped, repeated, reordered, unknown or symbolic
descriptors).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field

from proton import Delivery, Described, symbol, ulong

from amqpbroker.core import codec
from amqpbroker.core.message import MalformedMessage, Message, selector_accepts
from amqpbroker.core.selectors import compile_selector
from tests.e2e.helpers_conn import RawClient

from . import values
from .corpus import sample_messages

# What the selecting consumer asks for: it reads application-properties, the
# properties (JMSType is the subject) and the header (JMSPriority).
SELECTOR = "colour = 'red' OR weight > 2 OR JMSType LIKE 'f%' OR JMSPriority > 6"


@dataclass
class MessageCase:
    number: int
    kind: str
    note: str
    raw: bytes
    outcome: str = ""        # accepted / rejected:<condition> / state:<n> / connection-closed:<condition> / hung
    seconds: float = 0.0
    started: float = 0.0
    local_port: int = 0      # of the producer's connection (the broker's log names it)
    log_from: int = 0
    log_to: int = 0


# --------------------------------------------------------------------------- mutators


def _sections(raw: bytes) -> list[bytes]:
    """The encoded sections of a well-formed message."""
    out, off = [], 0
    while off < len(raw):
        end = codec.skip(raw, off)
        out.append(raw[off:end])
        off = end
    return out


def _section(code: int, encoded_value: bytes) -> bytes:
    return b"\x00\x53" + bytes((code,)) + encoded_value


def _flip(rng, raw):
    buf = bytearray(raw)
    for _ in range(rng.choice([1, 2, 4])):
        buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
    return bytes(buf), "bits flipped"


def _insert(rng, raw):
    at = rng.randrange(len(raw) + 1)
    junk = bytes(rng.randrange(256) for _ in range(rng.choice([1, 3, 9])))
    return raw[:at] + junk + raw[at:], f"{junk.hex()} inserted at {at}"


def _delete(rng, raw):
    at = rng.randrange(len(raw))
    return raw[:at] + raw[at + rng.choice([1, 2, 8]):], f"bytes deleted at {at}"


def _truncate(rng, raw):
    keep = rng.randrange(len(raw))
    return raw[:keep], f"cut to {keep} of {len(raw)} bytes"


def _section_value(rng, raw):
    parts = _sections(raw)
    i = rng.randrange(len(parts))
    new = values.encode(values.random_value(rng))
    parts[i] = parts[i][:3] + new
    return b"".join(parts), f"section {i} (0x{parts[i][2]:02x}) holds {new[:24].hex()}"


def _list_field(rng, raw, code: int, width: int, what: str):
    """One field of the header (0x70) or properties (0x73) list of another type."""
    fields = [None] * width
    k = rng.randrange(width)
    fields[k] = values.Raw(values.encode(values.random_value(rng)))
    parts = [p for p in _sections(raw) if p[2] != code]
    note = f"{what} field {k} is {values.encode(fields[k])[:16].hex()}"
    return _section(code, values.encode(fields)) + b"".join(parts), note


def _header_field(rng, raw):
    return _list_field(rng, raw, 0x70, 5, "header")


def _properties_field(rng, raw):
    return _list_field(rng, raw, 0x73, 13, "properties")


def _app_properties(rng, raw):
    keys = [b"\xa1\x06colour", b"\xa1\x06weight", values.encode(values.random_value(rng)),
            values.encode([1, 2])]
    pairs = [(rng.choice(keys), values.encode(values.random_value(rng))) for _ in range(rng.choice([1, 2, 4]))]
    parts = [p for p in _sections(raw) if p[2] != 0x74]
    return _section(0x74, values.raw_map(pairs).raw) + b"".join(parts), f"{len(pairs)} random application-properties"


def _annotations(rng, raw):
    keys = [values.encode(symbol("x-opt-delivery-time")), values.encode(symbol("x-opt-delivery-delay")),
            values.encode(symbol("x-opt-jms-dest")), values.encode(values.random_value(rng)),
            values.encode([1])]
    pairs = [(rng.choice(keys), values.encode(values.random_value(rng))) for _ in range(rng.choice([1, 2, 3]))]
    parts = [p for p in _sections(raw) if p[2] != 0x72]
    return _section(0x72, values.raw_map(pairs).raw) + b"".join(parts), f"{len(pairs)} random message-annotations"


def _deep(rng, raw):
    kind = rng.choice(values.DEEP_KINDS)
    depth = values.random_depth(rng)
    code = rng.choice([0x70, 0x71, 0x72, 0x73, 0x74, 0x76, 0x77, 0x78])
    deep = values.deep(kind, depth).raw
    if code in (0x71, 0x72, 0x74, 0x78):      # maps: the deep value under a key
        deep = values.raw_map([(b"\xa1\x06colour", deep)]).raw
    parts = [p for p in _sections(raw) if p[2] != code]
    return _section(code, deep) + b"".join(parts), f"section 0x{code:02x}: {kind} nested {depth} deep"


def _huge(rng, raw):
    name = rng.choice(sorted(values.LIES))
    code = rng.choice([0x70, 0x72, 0x73, 0x74, 0x75, 0x76, 0x77])
    parts = [p for p in _sections(raw) if p[2] != code]
    return _section(code, values.LIES[name]) + b"".join(parts), f"section 0x{code:02x}: {name}"


def _sections_shuffled(rng, raw):
    parts = _sections(raw)
    how = rng.choice(["drop", "repeat", "reverse", "unknown", "symbolic", "empty"])
    if how == "drop" and len(parts) > 1:
        parts.pop(rng.randrange(len(parts)))
    elif how == "repeat":
        parts.insert(rng.randrange(len(parts) + 1), rng.choice(parts))
    elif how == "reverse":
        parts.reverse()
    elif how == "unknown":
        parts.insert(rng.randrange(len(parts) + 1),
                     _section(rng.choice([0x00, 0x6F, 0x79, 0xFF]), b"\x40"))
    elif how == "symbolic":
        i = rng.randrange(len(parts))
        name = rng.choice(["amqp:header:list", "amqp:properties:list", "amqp:data:binary",
                           "amqp:application-properties:map", "amqp:nothing:list"])
        parts[i] = b"\x00" + values.encode(symbol(name)) + parts[i][3:]
    else:
        parts = []
    return b"".join(parts), f"sections: {how}"


MESSAGE_MUTATORS = {
    "msg-bit-flip": _flip,
    "msg-byte-insert": _insert,
    "msg-byte-delete": _delete,
    "msg-truncate": _truncate,
    "msg-section-value": _section_value,
    "msg-header-field": _header_field,
    "msg-properties-field": _properties_field,
    "msg-app-properties": _app_properties,
    "msg-annotations": _annotations,
    "msg-deep-nesting": _deep,
    "msg-huge-count": _huge,
    "msg-sections": _sections_shuffled,
}


def message_mutants(count: int, seed: int):
    rng = random.Random(seed)
    seeds = sample_messages()
    kinds = sorted(MESSAGE_MUTATORS)
    for n in range(count):
        kind = rng.choice(kinds)
        raw, note = MESSAGE_MUTATORS[kind](random.Random(rng.getrandbits(64)), rng.choice(seeds))
        yield MessageCase(n, kind, note, bytes(raw))


# --------------------------------------------------------------------------- expectations (the pure core as oracle)


def expected_match(raw: bytes) -> bool | None:
    """Whether the selecting consumer should get this message: True / False, or
    None when it may never come at all (it expires, or is scheduled for later)."""
    try:
        msg = Message(raw)
        expires, deliver_at, _ = msg.routing_times()
    except (MalformedMessage, TypeError):   # rejected (TypeError: a known codec bug, known.py)
        return None
    if expires is not None or deliver_at is not None:
        return None
    return selector_accepts(compile_selector(SELECTOR), msg, 0)


# --------------------------------------------------------------------------- running them


@dataclass
class MessageRun:
    cases: list[MessageCase] = field(default_factory=list)
    reconnects: int = 0


def run_messages(port: int, cases, address: str, log_position, stop) -> MessageRun:
    """Send each message on one producer link, one at a time (so that an outcome
    names its message), and wait at most 1 s for its disposition.  A connection
    the broker closes is replaced (and counted)."""
    run = MessageRun()
    client = snd = None
    for case in cases:
        if stop():
            break
        if client is None or client.socket_closed or client.conn.state & client.conn.REMOTE_CLOSED:
            if client is not None:
                client.abandon()
                run.reconnects += 1
            client = RawClient("127.0.0.1", port, container_id=f"fuzz-msg-{case.number}").wait_open()
            snd = client.sender(client.session(), address, f"fuzz-msg-producer-{case.number}")
        case.log_from = log_position()
        case.local_port = client.local_port
        case.started = started = time.monotonic()
        dlv = snd.delivery(str(case.number).encode())
        snd.send(case.raw)
        snd.advance()
        deadline = started + 1.0
        while (not dlv.remote_state and not client.socket_closed
               and not client.conn.state & client.conn.REMOTE_CLOSED and time.monotonic() < deadline):
            client.pump(0.01)
        case.seconds = time.monotonic() - started
        case.log_to = log_position()
        state = dlv.remote_state
        if state == Delivery.ACCEPTED:
            case.outcome = "accepted"
        elif state == Delivery.REJECTED:
            cond = dlv.remote.condition
            case.outcome = f"rejected:{cond.name if cond else 'no-condition'}"
        elif state:
            case.outcome = f"state:{state}"
        elif client.socket_closed or client.conn.state & client.conn.REMOTE_CLOSED:
            cond = client.conn.remote_condition
            case.outcome = f"connection-closed:{cond.name if cond else 'no-condition'}"
        else:
            case.outcome = "hung"
        dlv.settle()
        run.cases.append(case)
    if client is not None:
        client.close()
    return run


def drain(port: int, address: str, selector: str | None, quiet: float = 0.5, expect=(),
          limit: float = 20.0) -> list[bytes]:
    """Every message a consumer (with `selector`, if given) gets from `address`
    until none has come for `quiet` seconds and every message in `expect` has
    (or `limit` seconds have passed); each accepted."""
    missing = Counter(expect)
    client = RawClient("127.0.0.1", port, container_id=f"fuzz-drain-{selector is not None}").wait_open()
    ssn = client.session()
    rcv = ssn.receiver("fuzz-drain-selecting" if selector else "fuzz-drain-all")
    rcv.source.address = address
    rcv.target.address = None
    if selector:
        rcv.source.filter.put_map()
        rcv.source.filter.enter()
        rcv.source.filter.put_symbol(symbol("jms-selector"))
        rcv.source.filter.put_object(Described(ulong(0x0000468C00000004), selector))
        rcv.source.filter.exit()
    rcv.open()
    client.wait(lambda: rcv.state & rcv.REMOTE_ACTIVE, 10, "consumer attach")
    rcv.flow(100000)
    got: list[bytes] = []
    last = started = time.monotonic()
    while (time.monotonic() - last < quiet or +missing) and time.monotonic() - started < limit:
        client.pump(0.05)
        dlv = rcv.current
        while dlv is not None and not dlv.partial:
            got.append(bytes(rcv.recv(dlv.pending) or b""))     # an empty message: None
            missing[got[-1]] -= 1
            rcv.advance()
            dlv.update(Delivery.ACCEPTED)
            dlv.settle()
            last = time.monotonic()
            dlv = rcv.current
    client.close()
    return got


__all__ = [
    "MESSAGE_MUTATORS",
    "SELECTOR",
    "MessageCase",
    "drain",
    "expected_match",
    "message_mutants",
    "run_messages",
]
