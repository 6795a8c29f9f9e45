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
message is a protocol error (RFC 6455 §7.4.1, 1003).  A request from a web page
whose origin `[websocket] allowed_origins` does not list is refused with 403
(core/origins.py: cross-site WebSocket hijacking).

What one client can make the broker do stays bounded, as on the TCP listener:

* **Read budget.**  A socket read (up to 256 KiB) of tiny WebSocket messages is
  tens of thousands of frames, each parsed in Python; parsed in one go it held the
  loop for a quarter of a second per read and starved every other client.  At most
  `FRAMES_PER_TURN` frames (and `BYTES_PER_TURN` of payload) are handled per loop
  turn; the rest waits for the next turn with the socket's reading paused.  Binary
  messages parsed in one turn reach the AMQP layer as one chunk (message
  boundaries mean nothing, binding §2).
* **Control frames.**  A pong answers a ping (RFC 6455 §5.5.2) only while the
  client reads what it is sent: while the socket's writes are paused (its buffer
  full), only the latest ping is remembered (§5.5.3 allows answering just that
  one) and answered when writing resumes.  A client that goes on pinging without
  reading — `MAX_UNREAD_PINGS` pings while paused — is disconnected, with a log
  line: pongs it never reads cannot pile up in the broker's memory.
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

from ..core.handshakes import LogLimiter
from ..core.origins import origin_refusal
from .engine import AmqpProtocol

if TYPE_CHECKING:
    from .ports import ConnectionServer, ListenerSpec

log = logging.getLogger("amqpbroker.websocket")

SUBPROTOCOL = "amqp"          # AMQP WebSocket binding §2
UNSUPPORTED_DATA = 1003       # RFC 6455 §7.4.1
NORMAL_CLOSURE = 1000
POLICY_VIOLATION = 1008
FRAMES_PER_TURN = 128         # WebSocket frames handled per loop turn and connection
BYTES_PER_TURN = 256 * 1024   # ... and bytes of their payload (asyncio's read size)
MAX_UNREAD_PINGS = 1024       # pings while the client reads nothing, before it is disconnected

_refusals = LogLimiter(10.0)  # refused upgrades: one log line per address, then one per 10 s


class WebSocketAmqp(asyncio.Protocol):
    """One accepted socket of a WebSocket listener."""

    def __init__(self, server: "ConnectionServer", listener: "ListenerSpec"):
        self.listener = listener
        self.ws = WSConnection(ConnectionType.SERVER)
        self.amqp = AmqpProtocol(server, listener)
        self.sock: asyncio.Transport | None = None
        self.peer = "?"
        self.upgraded = False
        self.closing = False
        self._early: list[bytes] = []     # AMQP output before the upgrade is answered (none in practice)
        self.handshake_slot: Any = None   # taken at accept by a TLS listener (wss): AMQP's to adopt
        self.loop = server.loop
        self._events: Any = None          # wsproto's events not handled yet (read budget)
        self._budget_paused = False       # reading paused until they are
        self._write_paused = False
        self._pong_due: bytes | None = None   # the latest ping's payload, while writes are paused
        self._unread_pings = 0

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
        except RemoteProtocolError as exc:
            self._protocol_error(exc)
            return
        self._events = self.ws.events()
        self._drain()

    def _drain(self) -> None:
        """Handle the parsed events within this turn's budget; the rest next turn."""
        events, frames, pending = self._events, 0, bytearray()
        try:
            while events is not None and not self.closing:
                event = next(events, None)
                if event is None:
                    events = None
                    break
                frames += 1
                if isinstance(event, BytesMessage):
                    pending += event.data
                else:
                    self._pass_on(pending)
                    self._on_event(event)
                if frames >= FRAMES_PER_TURN or len(pending) >= BYTES_PER_TURN:
                    break
        except RemoteProtocolError as exc:
            self._pass_on(pending)
            self._protocol_error(exc)
            return
        self._pass_on(pending)
        self._events = events
        if events is not None and not self.closing:      # more than one turn's worth
            if not self._budget_paused and self.sock is not None:
                self._budget_paused = True
                self.sock.pause_reading()
            self.loop.call_soon(self._drain)
        elif self._budget_paused:
            self._budget_paused = False
            if self.sock is not None and not self.closing:
                self.sock.resume_reading()

    def _pass_on(self, pending: bytearray) -> None:
        if pending and not self.closing:
            self.amqp.data_received(bytes(pending))
            pending.clear()

    def _protocol_error(self, exc: RemoteProtocolError) -> None:
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
        self._write_paused = True
        self.amqp.pause_writing()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._unread_pings = 0
        pong, self._pong_due = self._pong_due, None
        if pong is not None and not self.closing:
            self._write(self.ws.send(Ping(payload=pong).response()))
        self.amqp.resume_writing()

    # ------------------------------------------------------------------ WebSocket events

    def _on_event(self, event: Any) -> None:
        if isinstance(event, Request):       # (binary messages: _drain passes them on)
            self._upgrade(event)
        elif isinstance(event, Ping):
            self._on_ping(event)
        elif isinstance(event, TextMessage):
            log.warning("%s: %s sent a text message: the AMQP WebSocket binding carries binary "
                        "messages only; closing", self.listener.name, self.peer)
            self._close_ws(UNSUPPORTED_DATA, "AMQP is carried in binary messages")
        elif isinstance(event, CloseConnection):
            self._write(self.ws.send(event.response()))   # RFC 6455 §5.5.1: answer the close
            self._close_socket()

    def _on_ping(self, ping: Ping) -> None:
        if not self._write_paused:
            self._write(self.ws.send(ping.response()))
            return
        # The client is not reading: remember the latest ping only (RFC 6455 §5.5.3).
        self._pong_due = bytes(ping.payload)
        self._unread_pings += 1
        if self._unread_pings >= MAX_UNREAD_PINGS:
            log.warning("%s: %s sent %d pings without reading the answers: disconnected",
                        self.listener.name, self.peer, self._unread_pings)
            self.abort()     # a close frame it would not read either

    def _upgrade(self, request: Request) -> None:
        headers = {name.decode("latin-1").lower(): value.decode("latin-1")
                   for name, value in request.extra_headers}
        config = self.amqp.server.settings.websocket
        refusal = origin_refusal(headers.get("origin"), request.host,
                                 config.allowed_origins if config is not None else (), self.listener.host)
        if refusal is not None:
            self._refuse(403, refusal)
            return
        if SUBPROTOCOL not in request.subprotocols:
            offered = ", ".join(request.subprotocols) or "none"
            self._refuse(400, f"the WebSocket subprotocol 'amqp' is required (offered: {offered})")
            return
        self._write(self.ws.send(AcceptConnection(subprotocol=SUBPROTOCOL)))
        self.upgraded = True
        early, self._early = self._early, []
        for data in early:
            self.send_bytes(data)

    def _refuse(self, status: int, why: str) -> None:
        """An HTTP answer instead of the upgrade, and a log line (one per address,
        then one every 10 s with the count: a hostile page can retry in a loop)."""
        skipped = _refusals.check(self.amqp.address, self.loop.time())
        if skipped is not None:
            more = f" ({skipped} more from {self.amqp.address} since the last line)" if skipped else ""
            log.warning("%s: upgrade request from %s refused: %s%s", self.listener.name, self.peer, why, more)
        body = (why + "\n").encode()
        self._write(self.ws.send(RejectConnection(
            status_code=status, headers=[(b"content-type", b"text/plain"),
                                         (b"content-length", str(len(body)).encode())], has_body=True)))
        self._write(self.ws.send(RejectData(data=body)))
        self._close_socket()

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
