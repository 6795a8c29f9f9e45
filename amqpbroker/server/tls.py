"""TLS listeners: the loop's own TLS protocol around each accepted socket, built
here with a waiter, so that a handshake that fails (a client certificate from an
unknown CA, none where one is required, a plaintext client on the TLS port) is
logged naming the peer and the reason: once per source address, then at most one
line every 10 s with the count since (a flood of stalled handshakes is one line,
not one per socket).  `create_server(ssl=…)` drops those without a word (asyncio
and uvloop report an SSLError only in debug mode).  After the handshake the inner
protocol (AmqpProtocol, or the WebSocket layer) gets the TLS transport, as with
`create_server(ssl=…)`: same implementation, same speed.

A TLS socket is a handshake from accept on, like a plain one: it is admitted by
the server's HandshakeGate (core/handshakes.py; `max_handshakes`,
`max_handshakes_per_address`, file descriptors in reserve) before the TLS
handshake, or closed at once; the slot it takes goes to the AMQP layer once TLS is
done, and the deadline to the AMQP open (`sasl_timeout`) counts from accept."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from typing import TYPE_CHECKING, Any, Callable

from ..core.handshakes import LogLimiter

if TYPE_CHECKING:
    from .ports import ConnectionServer, ListenerSpec

log = logging.getLogger("amqpbroker.tls")


def server_context(cert_file: str, key_file: str, client_ca_file: str | None,
                   section: str = "[tls]") -> ssl.SSLContext:
    """The listener's context; with a CA for clients, a client certificate is required
    and verified (RFC 8446 §4.3.2 CertificateRequest).  ValueError naming the file
    for one that is missing or not what it should be."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    load_files(section, ctx.load_cert_chain, cert_file=cert_file, key_file=key_file)
    if client_ca_file is not None:
        load_files(section, lambda ca: ctx.load_verify_locations(cafile=ca), client_ca_file=client_ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def chosen_file(own_key: str, own: Any, tls: Any, tls_key: str) -> tuple[str, Any]:
    """A TLS file that a section may set itself or take from `[tls]`: (the setting it
    came from, its path; None when neither sets it), so that an error names the one
    the user wrote (`load_files`)."""
    if own is not None:
        return own_key, own
    return f"[tls] {tls_key}", getattr(tls, tls_key) if tls is not None else None


def load_files(section: str, load: Callable[..., Any], **files: str) -> None:
    """`load(*files)`, with a failure said as the configuration names it: OpenSSL's
    own errors name no file (`[Errno 2] No such file or directory`, `PEM lib`)."""
    named = ", ".join(f"{key} {path}" for key, path in files.items())
    missing = [f"{key} {path}" for key, path in files.items() if not os.path.isfile(path)]
    if missing:
        raise ValueError(f"{section}: no such file: {', '.join(missing)}")
    try:
        load(*files.values())
    except ssl.SSLError as exc:
        raise ValueError(f"{section} {named}: not PEM of the kind expected, or a key that does not match "
                         f"({exc.reason or exc})") from None
    except OSError as exc:
        raise ValueError(f"{section} {named}: {exc.strerror or exc}") from None


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
        address = "?"
        admit: Callable[[str], Any] | None = None     # set by the factory: the gate's slot, or why not
        inner: Any = None
        slot: Any = None
        refused = False

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            peer = transport.get_extra_info("peername")
            if isinstance(peer, tuple):
                self.peer = f"{peer[0]}:{peer[1]}"
                self.address = str(peer[0])
            admitted = self.admit(self.address) if self.admit is not None else None
            if isinstance(admitted, str):    # refused at accept: logged by the server
                self.refused = True
                super().connection_made(transport)
                transport.abort()
                return
            self.slot = admitted
            if self.inner is not None:
                self.inner.handshake_slot = admitted
            super().connection_made(transport)

        def connection_lost(self, exc: BaseException | None) -> None:
            super().connection_lost(exc)
            if self.slot is not None:       # the TLS handshake never finished (else: AMQP's, once)
                self.slot.release()

    return ListenerTls


def _asyncio_ssl_protocol() -> type:
    from asyncio.sslproto import SSLProtocol
    return SSLProtocol


def tls_protocol_factory(server: "ConnectionServer", listener: "ListenerSpec",
                         inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
    """Protocols for a TLS listener's sockets: the loop's TLS protocol around `inner`
    (which sees the TLS transport once the handshake is done), with a waiter whose
    failure is logged."""
    loop = server.loop
    cls = _ssl_protocol_class(loop)
    timeout = server.settings.limits.sasl_timeout
    failures = LogLimiter(10.0)

    def admit(address: str) -> Any:
        """The gate's slot for a socket just accepted, or why it is refused."""
        if not server.resources.may_accept():
            why: Any = "file descriptors nearly exhausted"
        else:
            why = server.handshakes.slot(address, loop.time())
        if isinstance(why, str):
            server.handshake_refused(address, why)
        return why

    def make() -> asyncio.Protocol:
        waiter = loop.create_future()
        app = inner()
        proto = cls(loop, app, listener.ssl_context, waiter, server_side=True,
                    ssl_handshake_timeout=timeout)
        proto.admit, proto.inner = admit, app
        waiter.add_done_callback(lambda w: _handshake_done(w, listener.name, proto, failures, loop.time))
        return proto

    return make


def _handshake_done(waiter: asyncio.Future, listener: str, proto: Any, failures: LogLimiter,
                    clock: Callable[[], float]) -> None:
    if waiter.cancelled() or waiter.exception() is None or proto.refused:
        return   # done, or refused at accept (logged there)
    skipped = failures.check(proto.address, clock())
    if skipped is None:
        return
    more = f" ({skipped} more from {proto.address} since the last line)" if skipped else ""
    log.warning("%s: TLS handshake with %s failed: %s%s", listener, proto.peer,
                describe_failure(waiter.exception()), more)


__all__ = ["describe_failure", "server_context", "tls_protocol_factory"]
