"""Hostile messages, byte by byte: what a buggy or malicious producer can send.

Each case is the encoded message and what the broker must do with it:

* ``REJECT``: a field routing or scheduling needs is malformed or of the wrong type:
  the transfer is answered ``rejected`` with ``amqp:decode-error`` and never queued;
* ``OPAQUE``: only the application-properties are malformed: the message is accepted
  and queued as it is; it matches no selector, and consumers without one get it.

Used by the codec/message unit tests and by the end-to-end poison tests.
"""

from __future__ import annotations

import struct

from proton import symbol

from amqpbroker.core.codec import encode

REJECT = "reject"
OPAQUE = "opaque"

BODY = b"\x00\x53\x77\xa1\x06poison"


def section(code: int, value: bytes) -> bytes:
    return b"\x00\x53" + bytes((code,)) + value


def patched(value: object, placeholder: bytes, replacement: bytes) -> bytes:
    """`value` encoded, with the bytes of a placeholder swapped for raw ones (how an
    invalid UTF-8 string or a non-ASCII symbol gets onto the wire)."""
    raw = encode(value)
    assert raw.count(placeholder) == 1 and len(placeholder) == len(replacement)
    return raw.replace(placeholder, replacement)


def deep_list(depth: int) -> bytes:
    inner = b"\x45"
    for _ in range(depth):
        inner = b"\xd0" + struct.pack(">II", len(inner) + 4, 1) + inner
    return inner


def app_props(raw_map: bytes) -> bytes:
    return section(0x74, raw_map) + BODY


def _deep_app_props(depth: int) -> bytes:
    head = encode({"deep": "X"})             # one entry whose value we replace
    value_at = head.index(b"\xa1\x01X")
    body = head[:value_at] + deep_list(depth)
    # the map's size and count are one byte each (0xc1 size count): rewrite as map32
    entries = body[3:]
    return b"\xd1" + struct.pack(">II", len(entries) + 4, 2) + entries


CASES: dict[str, tuple[bytes, str]] = {
    # application-properties a selector reads: opaque
    "app-props invalid UTF-8 string": (app_props(patched({"k": "XXXX"}, b"XXXX", b"\xff\xfe\xfd\xfc")), OPAQUE),
    "app-props non-ASCII symbol": (app_props(patched({"k": symbol("YYY")}, b"YYY", b"\xc3\xa9Y")), OPAQUE),
    "app-props char beyond U+10FFFF": (app_props(b"\xc1\x09\x02\xa1\x01k\x73\x00\x11\x00\x00"), OPAQUE),
    "app-props list 3,000 deep": (app_props(_deep_app_props(3000)), OPAQUE),
    "app-props 10^8 nulls in an array": (
        app_props(b"\xc1\x0e\x02\xa1\x01k\xf0" + struct.pack(">II", 5, 10**8) + b"\x40"), OPAQUE),
    # header fields (§3.2.1) of the wrong type
    "header priority as a string": (section(0x70, encode([True, "high"])) + BODY, REJECT),
    "header ttl inf": (section(0x70, encode([True, None, float("inf")])) + BODY, REJECT),
    "header delivery-count as a string": (section(0x70, encode([True, None, None, None, "3"])) + BODY, REJECT),
    "header durable as a string": (section(0x70, encode(["yes"])) + BODY, REJECT),
    # properties fields (§3.2.4) routing reads
    "absolute-expiry-time as a string": (
        section(0x73, encode([None] * 8 + ["tomorrow"])) + BODY, REJECT),
    "group-id invalid UTF-8": (
        section(0x73, patched([None] * 10 + ["GGGG"], b"GGGG", b"\xff\xfe\xfd\xfc")) + BODY, REJECT),
    "group-id as a list": (section(0x73, encode([None] * 10 + [[1, 2]])) + BODY, REJECT),
    # scheduling annotations
    "x-opt-delivery-time as a string": (
        section(0x72, encode({symbol("x-opt-delivery-time"): "soon"})) + BODY, REJECT),
    "x-opt-delivery-delay NaN": (
        section(0x72, encode({symbol("x-opt-delivery-delay"): float("nan")})) + BODY, REJECT),
    # sections that are not sections
    "symbol as a section descriptor": (b"\x00\xa3\x05hello" + b"\xa1\x01x" + BODY, REJECT),
    "list as a section descriptor": (b"\x00\xc0\x03\x01\x50\x77" + b"\xa1\x01x" + BODY, REJECT),
    "described chain 5,000 deep": (b"\x00" * 5000 + b"\x40" * 5001, REJECT),
}


def well_formed(body: str, **properties: object) -> bytes:
    """A plain message with application-properties."""
    raw = section(0x74, encode(properties)) if properties else b""
    return raw + section(0x77, encode(body))


__all__ = ["CASES", "OPAQUE", "REJECT", "deep_list", "well_formed"]
