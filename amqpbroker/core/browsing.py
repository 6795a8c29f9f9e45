"""What an operator sees of one waiting message: plain JSON-ready values.  Pure.

The sections (AMQP 1.0 §3.2) are decoded from the stored bytes into a fresh
`Message`: browsing never touches the queue's entry (no delivery, no delivery-count,
no body kept in memory).  Values keep what JSON can say of them: symbols and
strings as text, timestamps as ms integers, binary as text when it is UTF-8 and as
hex otherwise, described values as {"descriptor", "value"}.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

from proton import Described

from .message import (
    APPLICATION_PROPERTIES, MESSAGE_ANNOTATIONS, PROPERTIES, MalformedMessage, Message, _PROPERTY_FIELDS)

PREVIEW_BYTES = 256        # the body's first bytes shown
MAX_DEPTH = 8              # nested values beyond this are shown as text


def message_view(entry: Any, msg: Message, state: str, preview: int = PREVIEW_BYTES) -> dict:
    """One message as `GET /api/queues/{name}/messages` lists it."""
    return {
        "sequence": entry.seq,
        "state": state,
        "size": msg.size,
        "delivery_count": entry.delivery_count,
        "redelivered": entry.delivery_count > 0,
        "header": {"durable": msg.durable, "priority": msg.priority, "ttl": msg.ttl,
                   "first_acquirer": msg.first_acquirer, "delivery_count": entry.delivery_count},
        "properties": _section(msg, PROPERTIES, _properties),
        "application_properties": _section(msg, APPLICATION_PROPERTIES, lambda m: m.application_properties),
        "message_annotations": _section(msg, MESSAGE_ANNOTATIONS, lambda m: m.annotations),
        "body": body_preview(msg, preview),
    }


def _properties(msg: Message) -> dict:
    return {name: value for name, value in zip(_PROPERTY_FIELDS, msg.properties) if value is not None}


def _section(msg: Message, code: int, read: Any) -> Any:
    if not msg.has_section(code):
        return None
    try:
        return jsonable(read(msg))
    except MalformedMessage as exc:
        return {"error": str(exc)}


def body_preview(msg: Message, limit: int = PREVIEW_BYTES) -> dict:
    """The body's kind, its encoded size and a preview of at most `limit` bytes."""
    try:
        body = msg.body()
    except MalformedMessage as exc:
        return {"type": "unreadable", "error": str(exc)}
    if body is None:
        return {"type": "none", "preview": None, "truncated": False}
    if isinstance(body, (bytes, bytearray, memoryview)):
        raw = bytes(body)
        shown = raw[:limit]
        return {"type": "data", "bytes": len(raw), "preview": _text_or_hex(shown), "truncated": len(raw) > limit}
    if isinstance(body, str):
        return {"type": "string", "bytes": len(body.encode()), "preview": body[:limit],
                "truncated": len(body) > limit}
    text = repr(jsonable(body))
    return {"type": type(body).__name__, "preview": text[:limit], "truncated": len(text) > limit}


def _text_or_hex(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "hex:" + raw.hex()


def jsonable(value: Any, depth: int = 0) -> Any:
    """A decoded AMQP value as JSON can carry it."""
    if depth > MAX_DEPTH:
        return repr(value)
    if value is None or isinstance(value, (bool, str)):
        return str(value) if isinstance(value, str) else value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _text_or_hex(bytes(value))
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, dict):
        return {str(jsonable(k, depth + 1)): jsonable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v, depth + 1) for v in value]
    if isinstance(value, Described):
        return {"descriptor": jsonable(value.descriptor, depth + 1), "value": jsonable(value.value, depth + 1)}
    return repr(value)
