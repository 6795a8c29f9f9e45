"""Which web pages may open an AMQP WebSocket (pure): the `Origin` check on the
upgrade request, against cross-site WebSocket hijacking.

A browser lets any page open a WebSocket to any address, loopback included, and
sends the page's origin (RFC 6454) in the `Origin` header of the upgrade (RFC 6455
§4.1, §10.2); the same-origin policy does not apply to WebSockets.  So a page on
any site, opened in the browser of someone on the broker's machine, could read
every message of an anonymous loopback broker.  Clients that are not browsers
(rhea on Node, Qpid JMS, proton) send no `Origin`: they are not affected.

`[websocket] allowed_origins` lists what may connect from a browser:

* an origin, `scheme://host[:port]` (`https://console.example.com`), compared after
  RFC 6454 §4 normalisation (case, default ports);
* `"same-host"`: a page served from the host the client connected to (the `Host`
  header's name, any port), when that name is an IP address, `localhost` or the
  listener's own `host` — never any other name, which a DNS rebinding attacker
  could point at the broker;
* `"null"`: the opaque origin (sandboxed frames, `file:` pages);
* `"*"`: any page (for brokers whose every address needs credentials).

Empty (the default): no page at all; only clients without `Origin`.
"""

from __future__ import annotations

import ipaddress
from typing import Iterable
from urllib.parse import urlsplit

DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
SPECIAL = ("*", "same-host", "null")


def normalise_origin(text: str) -> str | None:
    """`scheme://host[:port]` in RFC 6454 form (lower case, default port left out);
    None when `text` is not such an origin (a path, a user, no host)."""
    text = text.strip()
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS or not parts.hostname or parts.username is not None \
            or parts.password is not None or parts.path not in ("", "/") or parts.query or parts.fragment:
        return None
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    if port is None or port == DEFAULT_PORTS[scheme]:
        return f"{scheme}://{host}"
    return f"{scheme}://{host}:{port}"


def check_allowed(entries: Iterable[str]) -> list[str]:
    """The setting's entries, validated (ValueError names the bad one)."""
    out = []
    for entry in entries:
        if entry in SPECIAL:
            out.append(entry)
            continue
        origin = normalise_origin(entry)
        if origin is None:
            raise ValueError(f"'{entry}' is not an origin: use scheme://host[:port] (http or https, no path), "
                             f"or one of {', '.join(SPECIAL)}")
        out.append(origin)
    return out


def _host_name(host_header: str | None) -> str | None:
    if not host_header:
        return None
    parts = urlsplit("//" + host_header.strip())
    try:
        parts.port
    except ValueError:
        return None
    return parts.hostname.lower() if parts.hostname else None


def _fixed_name(name: str, listener_host: str) -> bool:
    """A name no one else can point at this broker: an address, localhost, or the
    listener's own configured host name."""
    if name == "localhost" or (listener_host and name == listener_host.lower()):
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def origin_refusal(origin: str | None, host_header: str | None, allowed: Iterable[str],
                   listener_host: str = "") -> str | None:
    """None when the upgrade may go on; else why not (for the 403 and the log)."""
    if origin is None:
        return None                       # not a browser
    allowed = list(allowed)
    if "*" in allowed:
        return None
    if origin.strip() == "null":
        return None if "null" in allowed else "the opaque origin 'null' is not in [websocket] allowed_origins"
    normal = normalise_origin(origin)
    if normal is None:
        return f"'{origin}' is not an origin"
    if normal in allowed:
        return None
    if "same-host" in allowed:
        page, asked = urlsplit(normal).hostname, _host_name(host_header)
        if page and asked and page == asked and _fixed_name(asked, listener_host):
            return None
    if not allowed:
        return (f"a page from {normal} may not connect: [websocket] allowed_origins is empty "
                "(clients that are not browsers only)")
    return f"a page from {normal} may not connect: it is not in [websocket] allowed_origins"


__all__ = ["check_allowed", "normalise_origin", "origin_refusal"]
