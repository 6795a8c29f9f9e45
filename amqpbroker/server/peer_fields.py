"""Performative fields a peer sent, checked before anything acts on them.

proton decodes frames but hands strings and symbols to Python lazily, so invalid
UTF-8 in a container-id, a link name or an address, a symbol that is not ASCII, or
a field of the wrong type (an integer where capabilities are an array of symbols)
only shows up when the broker reads the field.  Read here first, such a field is
answered with the condition AMQP 1.0 gives for it (§2.8.15 `amqp:decode-error` for
bytes that do not decode, `amqp:invalid-field` for a field of the wrong type) and
closes only the link or connection that carried it, never `amqp:internal-error`.
"""

from __future__ import annotations

from typing import Any

from cproton import ffi, lib
from proton import Condition

from .terminus import read_source, read_target

DECODE_ERROR = "amqp:decode-error"
INVALID_FIELD = "amqp:invalid-field"


# What reading a field the peer sent can raise.  RecursionError: proton builds
# nested values recursively, and a field nested deeper than the guard's decode
# limit can still come in a frame too big for core/wire.py to look into.
_UNREADABLE = (UnicodeDecodeError, TypeError, ValueError, AttributeError, RecursionError)


def _problem(field: str, exc: Exception) -> tuple[str, str]:
    if isinstance(exc, UnicodeDecodeError):
        return DECODE_ERROR, f"{field} is not valid {exc.encoding} text"
    if isinstance(exc, RecursionError):
        return DECODE_ERROR, f"{field} is nested too deep"
    return INVALID_FIELD, f"{field} has the wrong type ({exc})"


def open_problem(conn: Any) -> tuple[str, str] | None:
    """(condition, description) when a field of the peer's open cannot be read."""
    for field, read in (("container-id", lambda: _mandatory(conn.remote_container)),
                        ("hostname", lambda: conn.remote_hostname),
                        ("desired-capabilities", lambda: symbols(conn.remote_desired_capabilities)),
                        ("offered-capabilities", lambda: symbols(conn.remote_offered_capabilities)),
                        ("properties", lambda: conn.remote_properties)):
        try:
            read()
        except _UNREADABLE as exc:
            return _problem(field, exc)
    return None


def attach_problem(link: Any) -> tuple[str, str] | None:
    """(condition, description) when a field of the peer's attach cannot be read."""
    for field, read in (("name", lambda: _mandatory(link.name)),
                        ("source", lambda: read_source(link.remote_source)),
                        ("target", lambda: read_target(link.remote_target))):
        try:
            read()
        except _UNREADABLE as exc:
            return _problem(f"link {field}", exc)
    return None


def _mandatory(value: Any) -> Any:
    """A field AMQP 1.0 marks mandatory (open's container-id §2.7.1, attach's name
    §2.7.3): null is the wrong type."""
    if value is None:
        raise TypeError("a mandatory field is null")
    return value


def link_property(link: Any, key: Any) -> Any:
    """One entry of the link properties the peer's attach carried (AMQP 1.0 §2.7.3),
    or None: none sent (the common case: nothing is decoded), that key absent, or a
    properties field that does not read as a map (never an error: a property only
    ever asks the broker for something it may as well not do)."""
    if lib.pn_link_remote_properties(link._impl) == ffi.NULL:
        return None
    try:
        props = link.remote_properties
    except _UNREADABLE:
        return None
    return props.get(key) if isinstance(props, dict) else None


def symbols(value: Any) -> list[str]:
    """A capabilities field as strings: a symbol, an array or list of them, or None."""
    if value is None:
        return []
    if hasattr(value, "elements"):   # proton Array
        value = value.elements
    if isinstance(value, (str, bytes)):
        value = [value]
    return [str(v) for v in value]


def link_name(link: Any) -> str:
    """The link's name for a log line, whatever bytes it holds."""
    raw = lib.pn_link_name(link._impl)
    return ffi.string(raw).decode("utf-8", "replace") if raw != ffi.NULL else "?"


def condition_text(cond: Condition | None) -> str:
    """' (name: description)' of a peer's error condition for a log line, '' without
    one; never raises on what the peer put in it."""
    if cond is None:
        return ""
    try:
        return f" ({cond.name}: {cond.description})"
    except (UnicodeDecodeError, TypeError, ValueError):
        return " (a condition that does not decode)"


__all__ = ["DECODE_ERROR", "INVALID_FIELD", "attach_problem", "condition_text", "link_name",
           "open_problem", "symbols"]
