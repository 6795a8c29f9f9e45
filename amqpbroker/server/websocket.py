"""AMQP over WebSocket: the transport for the `[websocket]` listener.

The AMQP WebSocket binding (OASIS AMQP WebSocket Binding 1.0, §2): the client
opens a WebSocket (RFC 6455 §4) with the subprotocol `amqp`, and then binary
messages carry the AMQP byte stream, protocol headers, SASL and frames alike; a
message boundary means nothing.  So a WebSocket connection is one more transport
under the same `AmqpProtocol` as a TCP or TLS socket: the same SASL layer, frame
guard, handshake deadline, limits and ACLs.  The framing is wsproto's (sans-I/O
RFC 6455); this module only moves bytes between it, the socket and AmqpProtocol.

A request without the `amqp` subprotocol is refused with HTTP 400 and a log line
(binding §2: the server must not accept the connection otherwise); a text
message is a protocol error (RFC 6455 §7.4.1, 1003).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Message,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.utilities import RemoteProtocolError

from .engine import AmqpProtocol

if TYPE_CHECKING:
    from .app import BrokerServer, Listener

log = logging.getLogger("amqpbroker.websocket")

SUBPROTOCOL = "amqp"          # AMQP WebSocket binding §2
UNSUPPORTED_DATA = 1003       # RFC 6455 §7.4.1
NORMAL_CLOSURE = 1000


class WebSocketAmqp(asyncio.Protocol):
    """One accepted socket of a WebSocket listener."""

    def __init__(self, server: "BrokerServer", listener: "Listener"):
        self.listener = listener
        self.ws = WSConnection(ConnectionType.SERVER)
        self.amqp = AmqpProtocol(server, listener)
        self.sock: asyncio.Transport | None = None
        self.peer = "?"
        self.upgraded = False
        self.closing = False
        self._early: list[bytes] = []     # AMQP output before the upgrade is answered (none in practice)
        self.handshake_slot: Any = None   # taken at accept by a TLS listener (wss): AMQP's to adopt

    # ------------------------------------------------------------------ socket side

    def connection_made(self, sock: asyncio.BaseTransport) -> None:
        self.sock = sock  # type: ignore[assignment]
        peer = sock.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        # From accept on, as for TCP: admission, the handshake deadline (which
        # covers the HTTP upgrade too), the authentication throttle.
        self.amqp.handshake_slot = self.handshake_slot
        self.amqp.connection_made(WebSocketTransport(self))

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        try:
            self.ws.receive_data(data)
            for event in self.ws.events():
                self._on_event(event)
        except RemoteProtocolError as exc:
            log.warning("%s: WebSocket protocol error from %s: %s", self.listener.name, self.peer, exc)
            if exc.event_hint is not None and not self.upgraded:
                self._write(self.ws.send(exc.event_hint))
            self._close_socket()

    def eof_received(self) -> bool | None:
        return None   # close the socket: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.amqp.connection_lost(exc)

    def pause_writing(self) -> None:
        self.amqp.pause_writing()

    def resume_writing(self) -> None:
        self.amqp.resume_writing()

    # ------------------------------------------------------------------ WebSocket events

    def _on_event(self, event: Any) -> None:
        if isinstance(event, Request):
            self._upgrade(event)
        elif isinstance(event, BytesMessage):
            if event.data:
                self.amqp.data_received(bytes(event.data))
        elif isinstance(event, TextMessage):
            log.warning("%s: %s sent a text message: the AMQP WebSocket binding carries binary "
                        "messages only; closing", self.listener.name, self.peer)
            self._close_ws(UNSUPPORTED_DATA, "AMQP is carried in binary messages")
        elif isinstance(event, CloseConnection):
            self._write(self.ws.send(event.response()))   # RFC 6455 §5.5.1: answer the close
            self._close_socket()
        elif isinstance(event, Ping):
            self._write(self.ws.send(event.response()))

    def _upgrade(self, request: Request) -> None:
        if SUBPROTOCOL not in request.subprotocols:
            offered = ", ".join(request.subprotocols) or "none"
            why = f"the WebSocket subprotocol 'amqp' is required (offered: {offered})"
            log.warning("%s: upgrade request from %s refused: %s", self.listener.name, self.peer, why)
            body = (why + "\n").encode()
            self._write(self.ws.send(RejectConnection(
                status_code=400, headers=[(b"content-type", b"text/plain"),
                                          (b"content-length", str(len(body)).encode())], has_body=True)))
            self._write(self.ws.send(RejectData(data=body)))
            self._close_socket()
            return
        self._write(self.ws.send(AcceptConnection(subprotocol=SUBPROTOCOL)))
        self.upgraded = True
        early, self._early = self._early, []
        for data in early:
            self.send_bytes(data)

    # ------------------------------------------------------------------ AmqpProtocol's side

    def send_bytes(self, data: bytes) -> None:
        """AMQP output: one binary message per write (binding §2)."""
        if self.closing:
            return
        if not self.upgraded:
            self._early.append(bytes(data))
            return
        self._write(self.ws.send(Message(data=bytes(data))))

    def close(self) -> None:
        """AmqpProtocol is done with the connection (after its close frame, a refusal)."""
        if self.upgraded:
            self._close_ws(NORMAL_CLOSURE, "")
        else:
            self._close_socket()

    def abort(self) -> None:
        self.closing = True
        if self.sock is not None:
            self.sock.abort()

    def _close_ws(self, code: int, reason: str) -> None:
        if not self.closing:
            try:
                self._write(self.ws.send(CloseConnection(code=code, reason=reason)))
            except Exception:   # wsproto refuses a second close: the socket goes anyway
                pass
        self._close_socket()

    def _close_socket(self) -> None:
        self.closing = True
        if self.sock is not None:
            self.sock.close()

    def _write(self, data: bytes) -> None:
        if data and self.sock is not None and not self.sock.is_closing():
            self.sock.write(data)


class WebSocketTransport(asyncio.Transport):
    """What AmqpProtocol sees as its socket: writes become binary messages."""

    def __init__(self, ws: WebSocketAmqp):
        super().__init__()
        self._ws = ws

    def write(self, data: Any) -> None:
        self._ws.send_bytes(bytes(data))

    def close(self) -> None:
        self._ws.close()

    def abort(self) -> None:
        self._ws.abort()

    def is_closing(self) -> bool:
        return self._ws.closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "websocket":
            return True
        sock = self._ws.sock
        return default if sock is None else sock.get_extra_info(name, default)

    def pause_reading(self) -> None:
        if self._ws.sock is not None:
            self._ws.sock.pause_reading()

    def resume_reading(self) -> None:
        if self._ws.sock is not None:
            self._ws.sock.resume_reading()

    def get_write_buffer_size(self) -> int:
        sock = self._ws.sock
        return 0 if sock is None else sock.get_write_buffer_size()


__all__ = ["SUBPROTOCOL", "WebSocketAmqp", "WebSocketTransport"]
