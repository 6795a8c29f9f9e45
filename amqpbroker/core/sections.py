"""The byte-level rewrite of a message's map sections: message-annotations (AMQP 1.0
§3.2.3, described by 0x72) and application-properties (§3.2.5, 0x74).  Pure: no I/O.

Only the section changed is re-encoded: the other sections keep the producer's bytes
(the properties a consumer checks, the body).  Within the section the pairs already
there keep their bytes too: keys are decoded to find ours, values are only stepped
over (a re-encoding would turn an array into a list, for one), and the map keeps the
width it came in, so taking out what was added gives back the producer's bytes.
A footer computed over the bare message (§3.2.9) no longer matches a section changed
here; the broker adds only `x-opt-` annotations and its own `_AMQPBROKER_` properties.
"""

from __future__ import annotations

import struct
from typing import Any, Iterable, Mapping

from .codec import DecodeError, decode, decode_bounded, encode, skip
from .message import MAX_PROPERTY_VALUES

MESSAGE_ANNOTATIONS = 0x72
APPLICATION_PROPERTIES = 0x74

# §3.2: header, delivery-annotations, message-annotations, properties,
# application-properties, body (data / amqp-sequence / amqp-value), footer.
_SYMBOLIC = {"amqp:header:list": 0x70, "amqp:delivery-annotations:map": 0x71,
             "amqp:message-annotations:map": 0x72, "amqp:properties:list": 0x73,
             "amqp:application-properties:map": 0x74, "amqp:data:binary": 0x75,
             "amqp:amqp-sequence:list": 0x76, "amqp:amqp-value:*": 0x77, "amqp:footer:map": 0x78}


class SectionError(ValueError):
    """The message's sections or the map section cannot be walked."""


def rewrite_map(raw: bytes, code: int, put: Mapping[Any, Any] | None = None, drop: Iterable[Any] = ()) -> bytes:
    """`raw` with the map section `code` changed: the keys in `drop` and in `put` taken
    out, then `put`'s pairs added.  A section left empty is removed; one that was
    absent is created where §3.2 places it.  Raises SectionError when the sections or
    the map cannot be walked."""
    put = dict(put or {})
    gone = set(drop) | set(put)
    start, value_start, end, insert_at = _locate(raw, code)
    kept = _pairs(raw, value_start, end, gone) if start is not None else []
    kept += [encode(k) + encode(v) for k, v in put.items()]
    # The map keeps the width it came in (proton writes map32 even for small maps).
    wide = start is not None and raw[value_start] == 0xD1
    descriptor = raw[start:value_start] if start is not None else b"\x00\x53" + bytes((code,))
    section = (descriptor + _map_bytes(kept, wide)) if kept else b""
    if start is None:
        return raw[:insert_at] + section + raw[insert_at:]
    return raw[:start] + section + raw[end:]


def read_map(raw: bytes, code: int) -> dict:
    """The map section `code` decoded ({} when absent or null); SectionError."""
    start, value_start, end, _ = _locate(raw, code)
    if start is None:
        return {}
    try:
        value, _ = decode_bounded(raw, value_start, MAX_PROPERTY_VALUES)
    except (DecodeError, IndexError) as exc:
        raise SectionError(f"section 0x{code:02x} cannot be decoded: {exc} (at most {MAX_PROPERTY_VALUES:,} "
                           "values)") from exc
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SectionError(f"section 0x{code:02x} is not a map")
    return value


def _locate(raw: bytes, code: int) -> tuple[int | None, int, int, int]:
    """(section start, value start, end) of section `code` (start None when absent)
    and the offset where a new one goes (before the first section that follows it)."""
    off, n = 0, len(raw)
    try:
        while off < n:
            if raw[off] != 0x00:
                raise SectionError(f"expected a described section at offset {off}")
            descriptor, value_start = decode(raw, off + 1)
            end = skip(raw, value_start)
            found = _code(descriptor)
            if found == code:
                return off, value_start, end, off
            if found > code or found < 0:
                return None, 0, 0, off
            off = end
    except (DecodeError, IndexError) as exc:
        raise SectionError(f"message sections cannot be walked: {exc}") from exc
    return None, 0, 0, off


def _code(descriptor: Any) -> int:
    """A section's code from its descriptor, ulong or symbolic (§3.2); -1 otherwise."""
    if isinstance(descriptor, int) and not isinstance(descriptor, bool):
        return descriptor
    return _SYMBOLIC.get(descriptor, -1) if isinstance(descriptor, str) else -1


def _pairs(raw: bytes, value_start: int, end: int, gone: set) -> list[bytes]:
    """The encoded key+value pairs of the map at `value_start` whose key is not in `gone`."""
    c = raw[value_start]
    if c == 0x40:          # a null value: an empty map
        return []
    try:
        if c == 0xC1:
            count, off = raw[value_start + 2], value_start + 3
        elif c == 0xD1:
            count, off = struct.unpack_from(">I", raw, value_start + 5)[0], value_start + 9
        else:
            raise SectionError(f"the section is not a map (constructor 0x{c:02x})")
        if count > MAX_PROPERTY_VALUES:   # every key is decoded: bounded as message.py's decode is
            raise SectionError(f"a map of {count:,} values (at most {MAX_PROPERTY_VALUES:,})")
        out = []
        for _ in range(count // 2):
            key, after_key = decode(raw, off)
            after_value = skip(raw, after_key)
            if key not in gone:
                out.append(bytes(raw[off:after_value]))
            off = after_value
    except (DecodeError, IndexError, struct.error, TypeError) as exc:
        raise SectionError(f"the map cannot be read: {exc}") from exc
    if off != end:
        raise SectionError("map size mismatch")
    return out


def _map_bytes(pairs: list[bytes], wide: bool = False) -> bytes:
    """A map (§1.6.23) of already encoded key+value pairs: map8 when it fits and
    `wide` is not asked for."""
    body = b"".join(pairs)
    count = 2 * len(pairs)
    if not wide and len(body) + 1 < 256 and count < 256:
        return bytes((0xC1, len(body) + 1, count)) + body
    return b"\xd1" + struct.pack(">II", len(body) + 4, count) + body
