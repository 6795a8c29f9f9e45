"""Mutators: each takes a corpus conversation and a seeded `random.Random` and
returns a `Mutant` (the frames to send, turn by turn, and a note saying what was
done).  Kinds:

* bytes: `bit-flip` (anywhere, frame header included), `body-bit-flip`,
  `byte-insert`, `byte-delete`, `truncate-frame` (frame sizes kept right, so the
  performative is what breaks), `truncate-stream` (the stream just stops);
* framing: `size-too-big`, `size-too-small`, `random-channel`;
* values: `field-type` (a field, or a value nested in one, replaced by a random
  AMQP value of another type), `random-performative` (codes 0x10-0x18 with random
  field lists), `deep-nesting` (lists / maps / described values / arrays 10..5000
  deep, in a field or in a message section), `huge-count` (counts and sizes that
  the bytes cannot hold);
* order: `begin-twice`, `attach-used-handle`, `transfer-before-attach`,
  `flow-unknown-handle`, `disposition-range`, `detach-unknown-handle`,
  `end-twice`, `frames-after-end`, `duplicate-frame`, `swap-frames`, `drop-frame`.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace

from proton import Described, symbol, uint, ulong

from amqpbroker.core import codec

from . import values
from .corpus import (
    ATTACH,
    BEGIN,
    DETACH,
    DISPOSITION,
    END,
    FLOW,
    OPEN,
    TRANSFER,
    Conversation,
    Frame,
    frame_bytes,
)

# The channel the runner's probe `begin` uses; mutants leave it alone so that the
# probe always asks for a new session.
PROBE_CHANNEL = 250


@dataclass(frozen=True)
class Mutant:
    kind: str
    frames: tuple[Frame, ...]
    note: str
    conversation: str = ""      # the corpus conversation it was made from


# --------------------------------------------------------------------------- helpers


def _amqp(frames, *codes: int) -> list[int]:
    """Indices of AMQP frames after the open (with one of `codes`, if given)."""
    opened = False
    out = []
    for i, f in enumerate(frames):
        if f.kind == "amqp" and f.code == OPEN:
            opened = True
            continue
        if opened and f.kind == "amqp" and (not codes or f.code in codes):
            out.append(i)
    return out


def _with_body(frame: Frame, body: bytes) -> Frame:
    """The frame with a new body and a size field that is right for it."""
    head = frame.raw[:frame.doff]
    raw = struct.pack(">I", len(head) + len(body)) + head[4:] + body
    return replace(frame, raw=raw)


def _split(body: bytes) -> tuple[bytes, list[bytes], bytes] | None:
    """(descriptor bytes, encoded fields, payload) of a performative body whose
    fields are a list; None when it is something else."""
    try:
        if body[:1] != b"\x00":
            return None
        list_at = codec.skip(body, 1)
        code = body[list_at]
        if code == 0x45:
            return body[:list_at], [], body[list_at + 1:]
        if code == 0xC0:
            count, off = body[list_at + 2], list_at + 3
        elif code == 0xD0:
            count, off = struct.unpack_from(">I", body, list_at + 5)[0], list_at + 9
        else:
            return None
        fields = []
        for _ in range(count):
            end = codec.skip(body, off)
            fields.append(body[off:end])
            off = end
        return body[:list_at], fields, body[codec.skip(body, list_at):]
    except (codec.DecodeError, IndexError, struct.error):
        return None


def _join(descriptor: bytes, fields: list[bytes], payload: bytes) -> bytes:
    return descriptor + values.compound(0xC0, fields) + payload


def _insert(frames: list[Frame], at: int, frame: Frame) -> list[Frame]:
    """Insert `frame` at `at`, in the turn of the frame it follows."""
    turn = frames[max(at - 1, 0)].turn
    return frames[:at] + [replace(frame, turn=turn)] + frames[at:]


def _perf(channel: int, code: int, fields: list, payload: bytes = b"") -> Frame:
    body = b"\x00\x53" + bytes((code,)) + values.encode(fields) + payload
    return Frame(frame_bytes(body, channel), "amqp", channel, code)


def _flip(rng: random.Random, data: bytes, start: int) -> tuple[bytes, str]:
    buf = bytearray(data)
    spots = []
    for _ in range(rng.choice([1, 1, 2, 4])):
        at = rng.randrange(start, len(buf))
        buf[at] ^= 1 << rng.randrange(8)
        spots.append(at)
    return bytes(buf), f"bits flipped at {spots}"


def _pick(rng: random.Random, frames, *codes: int) -> int:
    choices = _amqp(frames, *codes) or _amqp(frames)
    return rng.choice(choices)


# --------------------------------------------------------------------------- bytes


def bit_flip(rng, conv):
    frames = list(conv.frames)
    # mostly frames after the open; now and then the protocol headers and SASL
    i = rng.randrange(len(frames)) if rng.random() < 0.2 else _pick(rng, frames)
    raw, note = _flip(rng, frames[i].raw, 0)
    frames[i] = replace(frames[i], raw=raw)
    return frames, f"{frames[i].name} #{i}: {note}"


def body_bit_flip(rng, conv):
    frames = list(conv.frames)
    i = _pick(rng, frames)
    f = frames[i]
    body, note = _flip(rng, f.body, 0)
    frames[i] = _with_body(f, body)
    return frames, f"{f.name} #{i} body: {note}"


def byte_insert(rng, conv):
    frames = list(conv.frames)
    i = _pick(rng, frames)
    f = frames[i]
    at = rng.randrange(len(f.body) + 1)
    junk = bytes(rng.randrange(256) for _ in range(rng.choice([1, 1, 3, 16])))
    frames[i] = _with_body(f, f.body[:at] + junk + f.body[at:])
    return frames, f"{f.name} #{i}: {junk.hex()} inserted at body offset {at}"


def byte_delete(rng, conv):
    frames = list(conv.frames)
    i = _pick(rng, frames)
    f = frames[i]
    at = rng.randrange(len(f.body))
    n = rng.choice([1, 1, 2, 8])
    frames[i] = _with_body(f, f.body[:at] + f.body[at + n:])
    return frames, f"{f.name} #{i}: {n} bytes deleted at body offset {at}"


def truncate_frame(rng, conv):
    frames = list(conv.frames)
    i = _pick(rng, frames)
    f = frames[i]
    keep = rng.randrange(len(f.body))
    frames[i] = _with_body(f, f.body[:keep])
    return frames, f"{f.name} #{i}: body cut to {keep} of {len(f.body)} bytes"


def truncate_stream(rng, conv):
    frames = list(conv.frames)
    i = rng.randrange(1, len(frames))
    keep = rng.randrange(len(frames[i].raw))
    frames = frames[:i] + [replace(frames[i], raw=frames[i].raw[:keep])]
    return frames, f"stream stops {keep} bytes into {frames[i].name} #{i}"


# --------------------------------------------------------------------------- framing


def _set_size(frame: Frame, size: int) -> Frame:
    return replace(frame, raw=struct.pack(">I", size & 0xFFFFFFFF) + frame.raw[4:])


def size_too_big(rng, conv):
    frames = list(conv.frames)
    i = _pick(rng, frames)
    f = frames[i]
    size = len(f.raw) + rng.choice([1, 7, 100, 5000, 65536, 2**31, 2**32 - 1 - len(f.raw)])
    frames[i] = _set_size(f, size)
    return frames, f"{f.name} #{i}: size field {size} for {len(f.raw)} bytes"


def size_too_small(rng, conv):
    frames = list(conv.frames)
    i = _pick(rng, frames)
    f = frames[i]
    size = rng.choice([0, 1, 7, 8, max(len(f.raw) - 1, 0), rng.randrange(len(f.raw))])
    frames[i] = _set_size(f, size)
    return frames, f"{f.name} #{i}: size field {size} for {len(f.raw)} bytes"


def random_channel(rng, conv):
    frames = list(conv.frames)
    i = _pick(rng, frames)
    f = frames[i]
    channel = rng.choice([1, 2, 255, 256, 32767, 65535, rng.randrange(1 << 16)])
    if channel == PROBE_CHANNEL:
        channel += 1
    frames[i] = replace(f, raw=f.raw[:6] + struct.pack(">H", channel) + f.raw[8:], channel=channel)
    return frames, f"{f.name} #{i} sent on channel {channel}"


# --------------------------------------------------------------------------- values


def _value_slots(value, path=()):
    """Paths to every value nested in a decoded value (list items, map keys and
    values, descriptors and described values)."""
    yield path
    if isinstance(value, list):
        for k, v in enumerate(value):
            yield from _value_slots(v, path + (("item", k),))
    elif isinstance(value, dict):
        for k, (key, v) in enumerate(value.items()):
            yield path + (("key", k),)
            yield from _value_slots(v, path + (("value", k),))
    elif isinstance(value, Described):
        yield from _value_slots(value.descriptor, path + (("descriptor", 0),))
        yield from _value_slots(value.value, path + (("described", 0),))


def _get(value, path):
    for step, k in path:
        if step == "item":
            value = value[k]
        elif step == "key":
            value = list(value.keys())[k]
        elif step == "value":
            value = list(value.values())[k]
        elif step == "descriptor":
            value = value.descriptor
        else:
            value = value.value
    return value


def _put(value, path, new):
    """A copy of `value` with the value at `path` replaced (maps become raw maps,
    so that any key fits)."""
    if not path:
        return new
    (step, k), rest = path[0], path[1:]
    if step == "item":
        items = list(value)
        items[k] = _put(items[k], rest, new)
        return items
    if step in ("key", "value"):
        pairs = [(values.encode(key), values.encode(v)) for key, v in value.items()]
        key, v = list(value.items())[k]
        if step == "key":
            pairs[k] = (values.encode(_put(key, rest, new)), pairs[k][1])
        else:
            pairs[k] = (pairs[k][0], values.encode(_put(v, rest, new)))
        return values.raw_map(pairs)
    if step == "descriptor":
        return Described(_put(value.descriptor, rest, new), value.value)
    return Described(value.descriptor, _put(value.value, rest, new))


def _replace_in_field(rng, conv, make_new: Callable[[object], object], what: str):
    """Replace a random value (a field of a performative, or a value nested in a
    field) with make_new(old); the other fields keep their bytes."""
    frames = list(conv.frames)
    for _ in range(20):
        i = _pick(rng, frames)
        f = frames[i]
        parts = _split(f.body)
        if parts is None or not parts[1]:
            continue
        descriptor, fields, payload = parts
        k = rng.randrange(len(fields))
        try:
            field_value = codec.decode(fields[k])[0]
        except codec.DecodeError:
            continue
        path = rng.choice(list(_value_slots(field_value)))
        new = make_new(_get(field_value, path))
        fields = list(fields)
        fields[k] = values.encode(_put(field_value, path, new))
        frames[i] = _with_body(f, _join(descriptor, fields, payload))
        return frames, f"{f.name} #{i} field {k} at {list(path)}: {what}"
    return frames, "no field found: conversation unchanged"


def field_type(rng, conv):
    holder = {}

    def new(old):
        holder["v"] = values.different_value(rng, old)
        return holder["v"]

    frames, note = _replace_in_field(rng, conv, new, "")
    return frames, f"{note}replaced by {holder.get('v')!r:.80}"


def random_performative(rng, conv):
    frames = list(conv.frames)
    code = rng.randrange(0x10, 0x19)
    fields = [values.random_value(rng) for _ in range(rng.choice([0, 1, 2, 4, 8, 12]))]
    channel = rng.choice([0, 0, 1, rng.randrange(1 << 16)])
    channel = channel + 1 if channel == PROBE_CHANNEL else channel
    at = rng.randrange(min(_amqp(frames)), len(frames) + 1)
    frames = _insert(frames, at, _perf(channel, code, fields))
    return frames, f"performative 0x{code:02x} on channel {channel} at #{at} with {len(fields)} random fields"


def _hostile_section(rng, raw_value: bytes) -> bytes:
    """A message whose one section holds `raw_value`."""
    code = rng.choice([0x70, 0x71, 0x72, 0x73, 0x74, 0x75, 0x76, 0x77, 0x78])
    body = b"" if code in (0x75, 0x76, 0x77) else b"\x00\x53\x77\xa1\x02ok"
    return b"\x00\x53" + bytes((code,)) + raw_value + body


def _in_field_or_section(rng, conv, raw_value: bytes, what: str):
    """Put a hostile encoded value in a performative field, or as a section of a
    transfer's message."""
    if rng.random() < 0.5:
        frames, note = _replace_in_field(rng, conv, lambda old: values.Raw(raw_value), what)
        return frames, note
    frames = list(conv.frames)
    i = _pick(rng, frames, TRANSFER)
    f = frames[i]
    parts = _split(f.body)
    descriptor, fields, _ = parts
    message = _hostile_section(rng, raw_value)
    frames[i] = _with_body(f, _join(descriptor, fields, message))
    return frames, f"{f.name} #{i}: message section 0x{message[2]:02x} holds {what}"


def deep_nesting(rng, conv):
    kind = rng.choice(values.DEEP_KINDS)
    depth = values.random_depth(rng)
    return _in_field_or_section(rng, conv, values.deep(kind, depth).raw, f"{kind} nested {depth} deep")


def huge_count(rng, conv):
    name = rng.choice(sorted(values.LIES))
    return _in_field_or_section(rng, conv, values.LIES[name], name)


# --------------------------------------------------------------------------- order


def _fields(frame: Frame) -> list:
    return frame.performative()[0]


def begin_twice(rng, conv):
    frames = list(conv.frames)
    i = _amqp(frames, BEGIN)[0]
    return _insert(frames, i + 1, frames[i]), f"begin #{i} sent twice"


def attach_used_handle(rng, conv):
    frames = list(conv.frames)
    attaches = _amqp(frames, ATTACH)
    i = rng.choice(attaches)
    fields = _fields(frames[i])
    fields[0] = fields[0] + "-again"          # another link, the same handle
    dup = _perf(frames[i].channel, ATTACH, fields)
    at = rng.randrange(i + 1, len(frames) + 1)
    return _insert(frames, at, dup), f"attach #{i}'s handle {fields[1]} attached again at #{at}"


def transfer_before_attach(rng, conv):
    frames = list(conv.frames)
    transfers = _amqp(frames, TRANSFER)
    i = rng.choice(transfers)
    first = _amqp(frames, BEGIN)[0] + 1
    moved = frames.pop(i)
    return _insert(frames, first, moved), f"transfer #{i} moved before any attach"


def flow_unknown_handle(rng, conv):
    frames = list(conv.frames)
    handle = uint(rng.choice([7, 99, 2**31, 2**32 - 1]))
    flow = _perf(0, FLOW, [uint(0), uint(100), uint(0), uint(100), handle, uint(0), uint(10), None,
                           rng.random() < 0.5])
    at = rng.randrange(_amqp(frames, BEGIN)[0] + 1, len(frames) + 1)
    return _insert(frames, at, flow), f"flow for handle {handle} at #{at}"


def disposition_range(rng, conv):
    frames = list(conv.frames)
    first, last = rng.choice([(0, 2**32 - 1), (5, 2), (2**32 - 1, None), (0, 10**6), (3, 3), (2**31, 0)])
    state = rng.choice([Described(ulong(0x24), []), Described(ulong(0x27), [True, True]),
                        Described(ulong(0x34), [b"no-such-txn", Described(ulong(0x24), [])]), None])
    fields = [rng.random() < 0.5, uint(first), None if last is None else uint(last), rng.random() < 0.5, state]
    at = rng.randrange(_amqp(frames, BEGIN)[0] + 1, len(frames) + 1)
    return _insert(frames, at, _perf(0, DISPOSITION, fields)), \
        f"disposition first={first} last={last} role={fields[0]} state={state!r:.40} at #{at}"


def detach_unknown_handle(rng, conv):
    frames = list(conv.frames)
    handle = uint(rng.choice([7, 99, 2**32 - 1]))
    at = rng.randrange(_amqp(frames, BEGIN)[0] + 1, len(frames) + 1)
    detach = _perf(0, DETACH, [handle, rng.random() < 0.5])
    return _insert(frames, at, detach), f"detach of handle {handle} at #{at}"


def end_twice(rng, conv):
    frames = list(conv.frames)
    ends = _amqp(frames, END)
    i = rng.choice(ends)
    return _insert(frames, i + 1, frames[i]), f"end #{i} sent twice"


def frames_after_end(rng, conv):
    """The session ends early; the frames that follow use its channel still."""
    frames = list(conv.frames)
    begin = _amqp(frames, BEGIN)[0]
    at = rng.randrange(begin + 1, len(frames))
    end = _perf(frames[begin].channel, END, [])
    return _insert(frames, at, end), f"end of channel {frames[begin].channel} at #{at}, frames go on"


def duplicate_frame(rng, conv):
    frames = list(conv.frames)
    i = _pick(rng, frames)
    at = rng.randrange(i + 1, len(frames) + 1)
    return _insert(frames, at, frames[i]), f"{frames[i].name} #{i} again at #{at}"


def swap_frames(rng, conv):
    frames = list(conv.frames)
    i, j = sorted(rng.sample(_amqp(frames), 2))
    a, b = frames[i], frames[j]
    frames[i], frames[j] = replace(b, turn=a.turn), replace(a, turn=b.turn)
    return frames, f"{a.name} #{i} and {b.name} #{j} swapped"


def drop_frame(rng, conv):
    frames = list(conv.frames)
    i = _pick(rng, frames)
    dropped = frames.pop(i)
    return frames, f"{dropped.name} #{i} dropped"


MUTATORS: dict[str, Callable] = {
    "bit-flip": bit_flip,
    "body-bit-flip": body_bit_flip,
    "byte-insert": byte_insert,
    "byte-delete": byte_delete,
    "truncate-frame": truncate_frame,
    "truncate-stream": truncate_stream,
    "size-too-big": size_too_big,
    "size-too-small": size_too_small,
    "random-channel": random_channel,
    "field-type": field_type,
    "random-performative": random_performative,
    "deep-nesting": deep_nesting,
    "huge-count": huge_count,
    "begin-twice": begin_twice,
    "attach-used-handle": attach_used_handle,
    "transfer-before-attach": transfer_before_attach,
    "flow-unknown-handle": flow_unknown_handle,
    "disposition-range": disposition_range,
    "detach-unknown-handle": detach_unknown_handle,
    "end-twice": end_twice,
    "frames-after-end": frames_after_end,
    "duplicate-frame": duplicate_frame,
    "swap-frames": swap_frames,
    "drop-frame": drop_frame,
}
# How often each kind is drawn: the value mutators find the most, the fixed
# order mutations have few distinct outcomes.
WEIGHTS = {kind: 1.0 for kind in MUTATORS}
WEIGHTS.update({"field-type": 4, "random-performative": 3, "deep-nesting": 2, "huge-count": 2,
                "body-bit-flip": 2, "bit-flip": 2, "byte-insert": 1.5, "byte-delete": 1.5,
                "begin-twice": 0.3, "end-twice": 0.5, "transfer-before-attach": 0.5})


def mutants(corpus: list[Conversation], count: int, seed: int):
    """`count` mutants, the same ones for the same seed."""
    rng = random.Random(seed)
    kinds = sorted(MUTATORS)
    weights = [WEIGHTS[k] for k in kinds]
    convs = [c.without_close() for c in corpus]
    for n in range(count):
        kind = rng.choices(kinds, weights)[0]
        conv = rng.choice(convs)
        case_rng = random.Random(rng.getrandbits(64))
        frames, note = MUTATORS[kind](case_rng, conv)
        yield Mutant(kind, tuple(frames), f"{conv.name}: {note}", conv.name)


__all__ = ["MUTATORS", "PROBE_CHANNEL", "Mutant", "mutants", "symbol"]
