"""TLS listeners: the loop's own TLS protocol around each accepted socket, built
here with a waiter, so that a handshake that fails (a client certificate from an
unknown CA, none where one is required, a plaintext client on the TLS port) is one
log line naming the peer and the reason.  `create_server(ssl=…)` drops those
without a word (asyncio and uvloop report an SSLError only in debug mode).  After
the handshake the inner protocol (AmqpProtocol, or the WebSocket layer) gets the
TLS transport, as with `create_server(ssl=…)`: same implementation, same speed."""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from .app import BrokerServer, Listener

log = logging.getLogger("amqpbroker.tls")


def server_context(cert_file: str, key_file: str, client_ca_file: str | None) -> ssl.SSLContext:
    """The listener's context; with a CA for clients, a client certificate is required
    and verified (RFC 8446 §4.3.2 CertificateRequest)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert_file, key_file)
    if client_ca_file is not None:
        ctx.load_verify_locations(cafile=client_ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def describe_failure(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"client certificate refused: {exc.verify_message or exc.reason}"
    if isinstance(exc, ssl.SSLError):
        return exc.reason or exc.strerror or str(exc)
    if isinstance(exc, asyncio.TimeoutError):
        return "no TLS handshake within the handshake timeout"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _ssl_protocol_class(loop: asyncio.AbstractEventLoop) -> type:
    """The TLS protocol `create_server(ssl=…)` would use on this loop (uvloop's own,
    in Cython, on a uvloop loop; else asyncio's), with the peer's address kept for
    the log line of a failed handshake."""
    base: type
    try:
        import uvloop
        from uvloop.loop import SSLProtocol as UvSSLProtocol
        base = UvSSLProtocol if isinstance(loop, uvloop.Loop) else _asyncio_ssl_protocol()
    except ImportError:   # pragma: no cover - uvloop is a dependency
        base = _asyncio_ssl_protocol()

    class ListenerTls(base):  # type: ignore[misc, valid-type]
        peer = "a client"

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            peer = transport.get_extra_info("peername")
            if isinstance(peer, tuple):
                self.peer = f"{peer[0]}:{peer[1]}"
            super().connection_made(transport)

    return ListenerTls


def _asyncio_ssl_protocol() -> type:
    from asyncio.sslproto import SSLProtocol
    return SSLProtocol


def tls_protocol_factory(server: "BrokerServer", listener: "Listener",
                         inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
    """Protocols for a TLS listener's sockets: the loop's TLS protocol around `inner`
    (which sees the TLS transport once the handshake is done), with a waiter whose
    failure is logged."""
    loop = server.loop
    cls = _ssl_protocol_class(loop)
    timeout = server.settings.limits.sasl_timeout

    def make() -> asyncio.Protocol:
        waiter = loop.create_future()
        proto = cls(loop, inner(), listener.ssl_context, waiter, server_side=True,
                    ssl_handshake_timeout=timeout)
        waiter.add_done_callback(lambda w: _handshake_done(w, listener.name, proto))
        return proto

    return make


def _handshake_done(waiter: asyncio.Future, listener: str, proto: Any) -> None:
    if waiter.cancelled() or waiter.exception() is None:
        return
    log.warning("%s: TLS handshake with %s failed: %s", listener, proto.peer, describe_failure(waiter.exception()))


__all__ = ["describe_failure", "server_context", "tls_protocol_factory"]
