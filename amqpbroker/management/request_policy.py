"""Which HTTP requests the management listener answers at all (pure: no I/O).

Two browser attacks reach a management API on the operator's own machine:

* **DNS rebinding.**  A page on `http://evil.example:8161/` makes its name resolve to
  127.0.0.1: to the browser the broker is then *the same origin* as the page, so
  same-origin checks pass and the page reads and changes everything.  What gives it
  away is the `Host` header, which carries the name from the URL.  So a request is
  answered only when its Host names the broker: an IP literal (an address is not a
  name anyone can re-point: a page whose origin is an address was served from that
  address), `localhost`, the listener's configured host name, or a name listed in
  `[management] allowed_hosts` (a reverse proxy's or a DNS name of the broker).
  Otherwise: 421 Misdirected Request.  This applies with and without ACLs.

* **Cross-site request forgery.**  A page on another origin can make the browser send
  "simple" requests without asking first (no CORS preflight): GET, HEAD, or POST
  with a form or text/plain body, or no body.  Every request a browser sends other
  than GET and HEAD carries an `Origin` header.  So a state-changing request
  (POST, PUT, PATCH, DELETE) is answered only when
    - its Content-Type, if any, is application/json (a browser must preflight that
      cross-origin, and no CORS is granted here), and
    - with an Origin header: the origin is the request's own (scheme://host) and the
      Content-Type is application/json (the console sends it on every action);
    - without an Origin header (the CLI, curl, scripts: not a browser): a body needs
      the JSON Content-Type; a body-less request (purge, delete) is fine.
  Refused: 403 for a foreign origin, 415 for a non-JSON content type.

GET and HEAD change nothing, and a foreign page cannot read their answers (no CORS
headers are sent), so only the Host check applies to them.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Iterable

from ..core.numbers import ascii_int

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LOOPBACK_NAMES = frozenset({"localhost"})
DEFAULT_PORTS = {"http": 80, "https": 443}
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_.")


@dataclass(frozen=True)
class Refusal:
    status: int
    error: str


def split_host(value: str) -> tuple[str, int | None] | None:
    """A Host header (or an origin's authority) as (lower-case host, port); None when
    malformed.  IPv6 addresses come bracketed: "[::1]:8161" → ("::1", 8161)."""
    value = value.strip().lower()
    if not value:
        return None
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        host, rest = value[1:end], value[end + 1:]
        try:
            if ipaddress.ip_address(host).version != 6:
                return None
        except ValueError:
            return None
        if not rest:
            return host, None
        if not rest.startswith(":"):
            return None
        port_text = rest[1:]
    else:
        if value.count(":") > 1:          # an unbracketed IPv6 address is not a Host
            return None
        host, sep, port_text = value.partition(":")
        if not host or not set(host) <= _NAME_CHARS:
            return None
        if not sep:
            return host, None
    port = ascii_int(port_text) if len(port_text) <= 5 else None
    if port is None or port > 65535:
        return None
    return host, port


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _name(host: str) -> str:
    return host.lower().rstrip(".")       # "localhost." is "localhost"


class HostPolicy:
    """The host names the listener answers to, besides IP literals."""

    def __init__(self, listener_host: str, allowed_hosts: Iterable[str] = ()):
        names = set(LOOPBACK_NAMES)
        if listener_host and not is_ip_literal(listener_host):
            names.add(_name(listener_host))
        names.update(_name(h) for h in allowed_hosts if h.strip())
        self.names = frozenset(names)

    def allows(self, host: str) -> bool:
        return is_ip_literal(host) or _name(host) in self.names


def media_type(content_type: str | None) -> str | None:
    if content_type is None:
        return None
    return content_type.split(";", 1)[0].strip().lower()


def same_origin(origin: str, scheme: str, host: str, port: int | None) -> bool:
    """Whether an Origin header ("http://127.0.0.1:8161") is the request's own
    (scheme, host, port), default ports filled in."""
    o_scheme, sep, authority = origin.strip().lower().partition("://")
    if not sep or "/" in authority or o_scheme not in DEFAULT_PORTS:
        return False                       # includes "null" (sandboxed or opaque origins)
    parsed = split_host(authority)
    if parsed is None:
        return False
    o_host, o_port = parsed
    default = DEFAULT_PORTS[o_scheme]
    return (o_scheme == scheme and _name(o_host) == _name(host)
            and (o_port or default) == (port or DEFAULT_PORTS.get(scheme, 0)))


def check_request(policy: HostPolicy, *, method: str, scheme: str, host: str | None,
                  origin: str | None, content_type: str | None, has_body: bool) -> Refusal | None:
    """None to answer the request, else why not (module docstring)."""
    if host is None:
        return Refusal(400, "request without a Host header")
    parsed = split_host(host)
    if parsed is None:
        return Refusal(400, f"malformed Host header '{host[:100]}'")
    name, port = parsed
    if not policy.allows(name):
        return Refusal(421, f"this broker does not answer to the host name '{name}' (DNS rebinding "
                            "protection): use its address or localhost, or list the name in "
                            "[management] allowed_hosts")
    if method.upper() in SAFE_METHODS:
        return None
    kind = media_type(content_type)
    if kind is not None and kind != "application/json":
        return Refusal(415, f"changes need Content-Type: application/json, not '{kind}'")
    if origin is not None:
        if not same_origin(origin, scheme, name, port):
            return Refusal(403, f"cross-origin request from {origin[:100]} refused")
        if kind is None:
            return Refusal(415, "changes from a browser need Content-Type: application/json")
    elif has_body and kind is None:
        return Refusal(415, "a request body needs Content-Type: application/json")
    return None


__all__ = ["HostPolicy", "Refusal", "check_request", "media_type", "same_origin", "split_host"]
