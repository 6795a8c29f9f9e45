"""A message as the raw bytes its producer sent, with lazily decoded sections.

AMQP 1.0 §3.2 lays a bare message out as a sequence of described sections; the
broker only ever changes the header (delivery-count on redelivery, §3.2.1), so a
message keeps the producer's bytes and splices a new header in front of the rest
when it must.  Sections other than the header are decoded on first use and cached.
"""

from __future__ import annotations

import struct
import time
from typing import Any, Callable

from proton import symbol, ubyte, uint

from .codec import DecodeError, decode, decode_bounded, encode, skip

# Section descriptor codes, AMQP 1.0 §3.2.
HEADER = 0x70
DELIVERY_ANNOTATIONS = 0x71
MESSAGE_ANNOTATIONS = 0x72
PROPERTIES = 0x73
APPLICATION_PROPERTIES = 0x74
DATA = 0x75
AMQP_SEQUENCE = 0x76
AMQP_VALUE = 0x77
FOOTER = 0x78

# Values (keys, values, list and array elements together) of an application-properties
# or message-annotations section the broker decodes: a JMS message has a few dozen; a million took 2.9 s of the
# loop at the first selector that asked.  Beyond, the section is malformed to the
# broker (no selector matches the message; its bytes go on untouched).
MAX_PROPERTY_VALUES = 20_000

_SECTION_SYMBOLS = {
    "amqp:header:list": HEADER,
    "amqp:delivery-annotations:map": DELIVERY_ANNOTATIONS,
    "amqp:message-annotations:map": MESSAGE_ANNOTATIONS,
    "amqp:properties:list": PROPERTIES,
    "amqp:application-properties:map": APPLICATION_PROPERTIES,
    "amqp:data:binary": DATA,
    "amqp:amqp-sequence:list": AMQP_SEQUENCE,
    "amqp:amqp-value:*": AMQP_VALUE,
    "amqp:footer:map": FOOTER,
}

# Field positions of the properties list, AMQP 1.0 §3.2.4.
_PROPERTY_FIELDS = (
    "message_id", "user_id", "to", "subject", "reply_to", "correlation_id",
    "content_type", "content_encoding", "absolute_expiry_time", "creation_time",
    "group_id", "group_sequence", "reply_to_group_id",
)
_PROPERTY_INDEX = {name: i for i, name in enumerate(_PROPERTY_FIELDS)}
_ABSOLUTE_EXPIRY_TIME = _PROPERTY_INDEX["absolute_expiry_time"]
_GROUP_ID = _PROPERTY_INDEX["group_id"]

DEFAULT_PRIORITY = 4  # AMQP 1.0 §3.2.1

DELIVERY_TIME = symbol("x-opt-delivery-time")
DELIVERY_DELAY = symbol("x-opt-delivery-delay")
JMS_DEST = symbol("x-opt-jms-dest")


class MalformedMessage(ValueError):
    """The transfer payload is not a valid AMQP bare/annotated message."""


class Message:
    """Raw message bytes plus the few header fields the broker routes on."""

    __slots__ = (
        "raw", "size", "durable", "priority", "ttl", "first_acquirer", "delivery_count",
        "_header_end", "_spans", "_props", "_app", "_annotations", "_routing",
        "publisher", "arrival", "store_id", "store_refs",
    )

    def __init__(self, raw: bytes, publisher: Any = None, arrival: float | None = None):
        self.raw = raw
        self.size = len(raw)
        self.publisher = publisher  # opaque id of the publishing connection (no-local)
        self.store_id: int | None = None   # set once the store holds the bytes
        self.store_refs = 0                # durable entries referring to those bytes
        self.arrival = time.time() if arrival is None else arrival
        self.durable = False
        self.priority = DEFAULT_PRIORITY
        self.ttl: int | None = None
        self.first_acquirer = False
        self.delivery_count = 0
        self._header_end = 0
        self._props: list | None = None
        self._app: dict | None = None
        self._annotations: dict | None = None
        self._routing: tuple[float | None, float | None, str | None] | None = None
        self._spans = _scan(raw)
        span = self._spans.get(HEADER)
        if span is not None:
            self._read_header(span)

    def _read_header(self, span: tuple[int, int]) -> None:
        start, end = span
        fields = _header_fields(self.raw, start)
        if fields is None:   # an encoding the fast path does not take: the general decoder
            try:
                fields, _ = decode(self.raw, start)
            except DecodeError as exc:
                raise MalformedMessage(f"bad header section: {exc}") from exc
            if not isinstance(fields, list):
                raise MalformedMessage("header section is not a list")
            fields = fields + [None] * (5 - len(fields))
        self.durable = _flag(fields[0], "durable")
        self.priority = DEFAULT_PRIORITY if fields[1] is None else _count(fields[1], "priority")
        self.ttl = None if fields[2] is None else _count(fields[2], "ttl")
        self.first_acquirer = _flag(fields[3], "first-acquirer")
        self.delivery_count = 0 if fields[4] is None else _count(fields[4], "delivery-count")
        self._header_end = end

    # ------------------------------------------------------------------ sections

    def has_section(self, code: int) -> bool:
        return code in self._spans

    def _section(self, code: int) -> Any:
        span = self._spans.get(code)
        if span is None:
            return None
        try:
            return decode(self.raw, span[0])[0]
        except DecodeError as exc:
            raise MalformedMessage(f"bad section 0x{code:02x}: {exc}") from exc

    def _bounded_section(self, code: int) -> Any:
        span = self._spans.get(code)
        if span is None:
            return None
        try:
            return decode_bounded(self.raw, span[0], MAX_PROPERTY_VALUES)[0]
        except DecodeError as exc:
            raise MalformedMessage(f"bad section 0x{code:02x}: {exc} (at most {MAX_PROPERTY_VALUES:,} "
                                   "values)") from exc

    @property
    def properties(self) -> list:
        if self._props is None:
            fields = self._section(PROPERTIES) or []
            if not isinstance(fields, list):
                raise MalformedMessage("properties section is not a list")
            self._props = fields + [None] * (len(_PROPERTY_FIELDS) - len(fields))
        return self._props

    def prop(self, name: str) -> Any:
        return self.properties[_PROPERTY_INDEX[name]]

    def _props_at(self, first: int, second: int) -> tuple[Any, Any]:
        """Two properties fields (first < second) without decoding the list: routing
        reads absolute-expiry-time and group-id of every message.  Absent when the
        list is shorter; the fields before them are skipped over in one walk."""
        if self._props is not None:
            return self._props[first], self._props[second]
        span = self._spans.get(PROPERTIES)
        if span is None:
            return None, None
        raw = self.raw
        try:
            head = _list_head(raw, span[0])
        except (IndexError, struct.error) as exc:
            raise MalformedMessage(f"bad properties section: {exc}") from exc
        if head is None:   # not a list: properties raises the error
            return self.properties[first], self.properties[second]
        count, off = head
        if first >= count:
            return None, None
        try:
            for _ in range(first):
                off = skip(raw, off)
            a, off = decode(raw, off)
            if second >= count:
                return a, None
            for _ in range(second - first - 1):
                off = skip(raw, off)
            return a, decode(raw, off)[0]
        except (DecodeError, IndexError, struct.error) as exc:
            raise MalformedMessage(f"bad properties section: {exc}") from exc

    @property
    def application_properties(self) -> dict:
        """Decoded on first use (selectors).  A section that does not decode raises
        MalformedMessage every time, without decoding again; so does one of more than
        MAX_PROPERTY_VALUES values (its decoding would hold the loop)."""
        app = self._app
        if app is None:
            try:
                value = self._bounded_section(APPLICATION_PROPERTIES) or {}
                if not isinstance(value, dict):
                    raise MalformedMessage("application-properties section is not a map")
            except MalformedMessage as exc:
                self._app = exc
                raise
            self._app = app = value
        elif app.__class__ is MalformedMessage:
            raise app
        return app

    @property
    def annotations(self) -> dict:
        """Decoded on first use; more than MAX_PROPERTY_VALUES values are malformed
        (a message naming x-opt-delivery- has them decoded at the edge)."""
        if self._annotations is None:
            value = self._bounded_section(MESSAGE_ANNOTATIONS) or {}
            if not isinstance(value, dict):
                raise MalformedMessage("message-annotations section is not a map")
            self._annotations = value
        return self._annotations

    def group_id(self) -> str | None:
        """JMSXGroupID (properties group-id, §3.2.4), or None."""
        return self.routing_times()[2]

    def body(self) -> Any:
        """The decoded body (first body section): bytes for data, else the value."""
        for code in (DATA, AMQP_VALUE, AMQP_SEQUENCE):
            if code in self._spans:
                return self._section(code)
        return None

    # ------------------------------------------------------------------ derived

    def expiry_time(self) -> float | None:
        """Absolute expiry in epoch seconds, from header ttl (§3.2.1) or
        properties absolute-expiry-time (§3.2.4), the earlier of the two."""
        return self.routing_times()[0]

    def routing_times(self) -> tuple[float | None, float | None, str | None]:
        """(expiry_time(), delivery_time(), group_id()) in one go: what every queue
        entry reads at enqueue, with one walk over the properties list.  Read once
        (the connection handler reads it before routing, so a wrong-typed field is
        rejected there as MalformedMessage, never met by a queue)."""
        routing = self._routing
        if routing is not None:
            return routing
        ttl = self.ttl
        expires = None if ttl is None else self.arrival + ttl / 1000.0
        absolute, group = self._props_at(_ABSOLUTE_EXPIRY_TIME, _GROUP_ID)
        if absolute is not None:
            absolute = _count(absolute, "absolute-expiry-time") / 1000.0
            if absolute:
                expires = absolute if expires is None else min(expires, absolute)
        if group is not None and not isinstance(group, str):
            raise MalformedMessage(f"group-id is a {type(group).__name__}, not a string")
        self._routing = routing = (expires, self.delivery_time(), group)
        return routing

    def delivery_time(self) -> float | None:
        """Scheduled delivery time (x-opt-delivery-time / x-opt-delivery-delay)."""
        span = self._spans.get(MESSAGE_ANNOTATIONS)
        if span is None or b"x-opt-delivery-" not in self.raw[span[0]:span[1]]:
            return None
        annotations = self.annotations
        when = annotations.get(DELIVERY_TIME)
        if when is not None:
            return _integer(when, "x-opt-delivery-time") / 1000.0
        delay = annotations.get(DELIVERY_DELAY)
        if delay is not None and _integer(delay, "x-opt-delivery-delay") > 0:
            return self.arrival + delay / 1000.0
        return None

    def encoded(self, delivery_count: int) -> bytes:
        """The bytes to transfer with this delivery-count in the header (§3.2.1)."""
        if delivery_count == self.delivery_count:
            return self.raw
        header = encode_header(self.durable, self.priority, self.ttl, self.first_acquirer, delivery_count)
        return header + self.raw[self._header_end:]


def _integer(value: Any, field: str) -> int:
    """An integer field of any AMQP integer type; anything else is MalformedMessage
    (a string, a double such as inf or NaN, a boolean)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise MalformedMessage(f"{field} is a {type(value).__name__}, not an integer")


def _count(value: Any, field: str) -> int:
    """A non-negative integer field (priority, ttl, delivery-count, times)."""
    value = _integer(value, field)
    if value < 0:
        raise MalformedMessage(f"{field} is negative ({value})")
    return value


def _flag(value: Any, field: str) -> bool:
    if value is None or isinstance(value, bool):
        return bool(value)
    raise MalformedMessage(f"{field} is a {type(value).__name__}, not a boolean")


def encode_header(durable: bool, priority: int, ttl: int | None, first_acquirer: bool,
                  delivery_count: int) -> bytes:
    fields = [durable, ubyte(priority), None if ttl is None else uint(ttl), first_acquirer,
              uint(delivery_count)]
    return b"\x00\x53\x70" + encode(fields)


_u32 = struct.Struct(">I").unpack_from
# Constructors whose size follows in one byte / four bytes (binary, string, symbol,
# list, map, array: AMQP 1.0 §1.6): a section's end without walking its contents.
_SIZE8 = frozenset((0xA0, 0xA1, 0xA3, 0xC0, 0xC1, 0xE0))
_SIZE32 = frozenset((0xB0, 0xB1, 0xB3, 0xD0, 0xD1, 0xF0))


def _scan(raw: bytes) -> dict[int, tuple[int, int]]:
    """Map section code → (value start, section end). Body sections may repeat
    (several data sections): the first one is recorded."""
    spans: dict[int, tuple[int, int]] = {}
    off = 0
    n = len(raw)
    try:
        while off < n:
            if raw[off] != 0x00:
                raise MalformedMessage(f"expected a described section at offset {off}")
            if raw[off + 1] == 0x53:  # smallulong descriptor, the common case
                code = raw[off + 2]
                value_start = off + 3
            else:
                descriptor, value_start = decode(raw, off + 1)
                code = _section_code(descriptor)
            if not HEADER <= code <= FOOTER:
                raise MalformedMessage(f"unknown section descriptor {code!r}")
            c = raw[value_start]
            if c in _SIZE8:
                end = value_start + 2 + raw[value_start + 1]
            elif c in _SIZE32:
                end = value_start + 5 + _u32(raw, value_start + 1)[0]
            else:
                end = skip(raw, value_start)
            if end > n:
                raise MalformedMessage("section runs past the end of the message")
            spans.setdefault(code, (value_start, end))
            off = end
    except (DecodeError, IndexError, struct.error) as exc:
        raise MalformedMessage(f"malformed message: {exc}") from exc
    return spans


def _section_code(descriptor: Any) -> int:
    """A section descriptor (§3.2): a ulong code or its symbolic name; -1 for anything
    else (a list, a string, a double ...: not a section)."""
    if isinstance(descriptor, str):
        return _SECTION_SYMBOLS.get(descriptor, -1)
    if isinstance(descriptor, int) and not isinstance(descriptor, bool):
        return descriptor
    return -1


def _list_head(raw: bytes, off: int) -> tuple[int, int] | None:
    """(element count, offset of the first element) of the list at `off`; None
    when the value there is not a list."""
    c = raw[off]
    if c == 0x45:
        return 0, off + 1
    if c == 0xC0:
        return raw[off + 2], off + 3
    if c == 0xD0:
        return _u32(raw, off + 5)[0], off + 9
    return None


def _header_fields(raw: bytes, start: int) -> list | None:
    """The five header fields (§3.2.1) in the encodings clients use (null, booleans,
    ubyte, uint in its three forms), read without the general decoder; None for
    anything else (the caller decodes, and reports what is wrong)."""
    try:
        head = _list_head(raw, start)
        if head is None:
            return None
        count, off = head
        fields = [None, None, None, None, None]
        for i in range(count if count < 5 else 5):
            c = raw[off]
            if c == 0x40:
                off += 1
            elif c == 0x41 or c == 0x42:
                fields[i] = c == 0x41
                off += 1
            elif c == 0x50 or c == 0x52:
                fields[i] = raw[off + 1]
                off += 2
            elif c == 0x56:
                fields[i] = raw[off + 1] != 0
                off += 2
            elif c == 0x43:
                fields[i] = 0
                off += 1
            elif c == 0x70:
                fields[i] = _u32(raw, off + 1)[0]
                off += 5
            else:
                return None
        return fields
    except (IndexError, struct.error):
        return None


# JMS header names → how to read them, per the AMQP JMS Mapping (OASIS amqp-bindmap-jms)
# that Qpid JMS implements; JMS 2.0 §3.8.1.1 lists the identifiers a selector may use.
def _jms_delivery_mode(msg: Message, count: int) -> str:
    return "PERSISTENT" if msg.durable else "NON_PERSISTENT"


_JMS_HEADERS: dict[str, Callable[[Message, int], Any]] = {
    "JMSMessageID": lambda m, c: _jms_id(m.prop("message_id")),
    "JMSCorrelationID": lambda m, c: _jms_id(m.prop("correlation_id")),
    "JMSType": lambda m, c: m.prop("subject"),
    "JMSPriority": lambda m, c: m.priority,
    "JMSTimestamp": lambda m, c: m.prop("creation_time"),
    "JMSExpiration": lambda m, c: m.prop("absolute_expiry_time"),
    "JMSDeliveryMode": _jms_delivery_mode,
    "JMSRedelivered": lambda m, c: c > 0,
    "JMSXDeliveryCount": lambda m, c: c + 1,
    "JMSXGroupID": lambda m, c: m.prop("group_id"),
    "JMSXGroupSeq": lambda m, c: m.prop("group_sequence"),
    "JMSXUserID": lambda m, c: _text(m.prop("user_id")),
}


def _jms_id(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    return f"ID:{value}"


def _text(value: Any) -> Any:
    if isinstance(value, (bytes, memoryview)):
        return bytes(value).decode("utf-8", "replace")
    return value


def selector_accepts(selector: Any, msg: Message, delivery_count: int) -> bool:
    """Whether a JMS selector accepts the message.  Never raises: a message whose
    sections do not decode, or whose values the selector cannot compare, matches no
    selector (it stays in its queue for consumers without one)."""
    try:
        if APPLICATION_PROPERTIES in msg._spans:
            msg.application_properties   # one that does not decode fails every selector
        return selector.matches(selector_lookup(msg, delivery_count))
    except (MalformedMessage, TypeError, ValueError, ArithmeticError, RecursionError):
        return False


def selector_lookup(msg: Message, delivery_count: int) -> Callable[[str], Any]:
    """The identifier resolver a JMS selector evaluates against (JMS 2.0 §3.8.1)."""

    def lookup(name: str) -> Any:
        header = _JMS_HEADERS.get(name)
        if header is not None:
            return header(msg, delivery_count)
        return msg.application_properties.get(name)

    return lookup
