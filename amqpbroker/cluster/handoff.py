"""Connection hand-off between the workers of one machine (`serve --workers N`).

The kernel spreads a shared port's connections over the workers at random, so about
half of a client's links would be forwarded (cluster/forward.py), and forwarding a
link costs about what owning it costs.  Instead, a connection whose **first attach**
names an address another worker owns is handed, socket and all, to that worker
before anything of it exists elsewhere: the owner serves it whole, and only its later
links to other workers' addresses are forwarded.

How, without the client noticing:

* Its SASL exchange is done here (the owner trusts this node's authentication: the
  user goes with the socket); everything the client sent after SASL — its AMQP header,
  Open, Begins, the Attach and whatever followed in the same reads — is *replayed*
  into the owner's engine, which so reaches the state this node's engine had.
* A client that waits for the Open's answer (Qpid JMS, proton's BlockingConnection)
  was already answered (Open, Begins) by this node: the owner produces the same
  frames (same settings, same engine, same input) and drops exactly the bytes this
  node wrote, after checking they are the same (`SkipTransport`; a difference closes
  the connection: its client reconnects).  A client that pipelines Open, Begin and
  Attach (the C load tool, rhea) got nothing yet: the owner answers everything.
* The socket itself goes over a Unix socket between the workers (SCM_RIGHTS), with an
  HMAC of the message under the workers' secret; this node then drops its copy without
  writing a byte.  The hand-off is decided inside the attach's event: this node's
  engine handles no further event of that connection.

What is never handed off (forwarded as before): TLS and WebSocket connections (their
state cannot move), a connection that holds a client-id at another node
(sole-connection-for-container), one whose first attach goes nowhere else, one that
sent or was sent more than HANDOFF_MAX bytes or received a heartbeat before its first
attach, one with output still in this node's transport buffer (not in the socket), and
any connection when the owner's hand-off socket cannot be reached (the attach is then
forwarded).
"""

from __future__ import annotations

import array
import asyncio
import dataclasses
import hashlib
import hmac
import json
import logging
import socket
import struct
from typing import Any, Callable

from ..core.handoff import HANDOFF_MAX, amqp_start, has_empty_frame
from ..server.engine import AmqpProtocol

log = logging.getLogger("amqpbroker.cluster")

_LEN = struct.Struct(">I")
RECEIVE_TIMEOUT = 2.0     # seconds an accepted hand-off socket may take to deliver its message


# ---------------------------------------------------------------------- this node's side


class RecordingTransport:
    """The transport an AmqpProtocol of a hand-off candidate writes to: records what it
    writes until the decision, writes nothing once the connection is handed off."""

    def __init__(self, real: asyncio.Transport, recorder: "Recorder"):
        self._real = real
        self._recorder = recorder

    def write(self, data: Any) -> None:
        rec = self._recorder
        if rec.handed:
            return
        if rec.recording:
            rec.output += data
            if len(rec.output) > HANDOFF_MAX:
                rec.stop()
        self._real.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class Recorder(asyncio.Protocol):
    """In front of a client listener's AmqpProtocol: passes everything on, and keeps
    the connection's bytes both ways until its first attach is decided."""

    def __init__(self, amqp: AmqpProtocol):
        self.amqp = amqp
        self.input = bytearray()
        self.output = bytearray()
        self.recording = True
        self.handed = False
        self.real: asyncio.Transport | None = None
        amqp.handoff = self   # how the router finds it (ConnectionHandler.protocol.handoff)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.real = transport  # type: ignore[assignment]
        self.amqp.connection_made(RecordingTransport(transport, self))  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        if self.handed:
            return
        if self.recording:
            self.input += data
            if len(self.input) > HANDOFF_MAX:
                self.stop()
        self.amqp.data_received(data)

    def eof_received(self) -> bool | None:
        return self.amqp.eof_received() if hasattr(self.amqp, "eof_received") else None

    def connection_lost(self, exc: Exception | None) -> None:
        self.amqp.connection_lost(exc)

    def pause_writing(self) -> None:
        self.amqp.pause_writing()

    def resume_writing(self) -> None:
        self.amqp.resume_writing()

    def stop(self) -> None:
        """No hand-off for this connection any more: stop recording."""
        self.recording = False
        self.input = bytearray()
        self.output = bytearray()

    def payload(self) -> tuple[bytes, bytes] | None:
        """(AMQP input to replay, AMQP output already written), or None when this
        connection cannot be handed off."""
        if not self.recording:
            return None
        if self.real is None or self.real.get_write_buffer_size():
            # Written to the transport but not to the socket yet: the client would never
            # get it (our copy goes), while the owner takes it as received.
            return None
        i, o = amqp_start(self.input), amqp_start(self.output, written=True)
        if i is None or o is None:
            return None
        sent = bytes(self.output[o:])
        if has_empty_frame(sent):
            return None
        return bytes(self.input[i:]), sent


def encode_message(secret: bytes, meta: dict, replay: bytes, sent: bytes) -> bytes:
    head = json.dumps(meta).encode()
    body = _LEN.pack(len(head)) + head + _LEN.pack(len(replay)) + replay + sent
    return hmac.new(secret, b"handoff" + body, hashlib.sha256).digest() + body


def decode_message(secret: bytes, data: bytes) -> tuple[dict, bytes, bytes]:
    mac, body = data[:32], data[32:]
    if not hmac.compare_digest(mac, hmac.new(secret, b"handoff" + body, hashlib.sha256).digest()):
        raise ValueError("hand-off message with a wrong HMAC")
    (n,) = _LEN.unpack_from(body, 0)
    meta = json.loads(body[4:4 + n])
    (m,) = _LEN.unpack_from(body, 4 + n)
    replay = body[8 + n:8 + n + m]
    return meta, replay, body[8 + n + m:]


def send_socket(path: str, message: bytes, fd: int) -> None:
    """One hand-off: the message and the socket (SCM_RIGHTS) on a SOCK_SEQPACKET Unix
    socket of the owner.  Raises OSError when the owner cannot take it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(1.0)
        s.connect(path)
        s.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


def hand_off(handler: Any, payload: tuple[bytes, bytes], path: str, node: str, secret: bytes) -> bool:
    """Give this client connection to `node` (core/handoff.py decided it may go): True
    when it went (this node then drops it without a word), False when it stays here
    (the attach is then forwarded)."""
    proto = handler.protocol
    rec: Recorder = proto.handoff
    rec.stop()                    # decided now, whichever way
    sock = rec.real.get_extra_info("socket") if rec.real is not None else None
    if sock is None:
        return False
    replay, sent = payload
    meta = {"user": proto.user, "listener": proto.listener.name, "peer": proto.peer}
    try:
        send_socket(path, encode_message(secret, meta, replay, sent), sock.fileno())
    except OSError as exc:
        log.warning("connection %s not handed to node %s (forwarded instead): %s", proto.peer, node, exc)
        return False
    rec.handed = True
    proto.pause_events()          # this node's engine handles nothing more of it
    log.debug("connection %s (container %s) handed to node %s", proto.peer, handler.container_id, node)
    rec.real.abort()              # our copy of the socket only: the owner holds the connection
    return True


class _HandedOff:
    """What a handed-off connection's attach leaves in this node's handler: nothing to
    do (the connection is being dropped here)."""

    forwarded = True

    def on_delivery(self, dlv: Any) -> None:
        pass

    def on_flow(self) -> None:
        pass

    def detached(self, closed: bool) -> None:
        pass

    def released(self, ending: Any) -> None:
        pass


HANDED_OFF = _HandedOff()


# ---------------------------------------------------------------------- the owner's side


class SkipTransport:
    """The transport of an adopted connection: drops the first bytes the engine writes
    when they are the ones the other node already wrote (checked)."""

    def __init__(self, real: asyncio.Transport, sent: bytes, peer: str):
        self._real = real
        self._expect = sent
        self._peer = peer

    def write(self, data: Any) -> None:
        expect = self._expect
        if expect:
            n = min(len(expect), len(data))
            if bytes(data[:n]) != expect[:n]:
                log.error("adopted connection %s: this node's answers differ from the ones the client got "
                          "(the nodes' settings differ?): closed", self._peer)
                self._expect = b""
                self._real.abort()
                return
            self._expect = expect[n:]
            data = data[n:]
            if not data:
                return
        self._real.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class Adopted(asyncio.Protocol):
    """A handed-off socket on the owner: an AmqpProtocol (no SASL: the user came with
    it) fed the replayed bytes, then the socket's."""

    def __init__(self, server: Any, listener: Any, user: str | None, replay: bytes, sent: bytes, peer: str):
        from ..server.sasl import SaslPolicy
        policy = SaslPolicy((), allow_no_sasl=True, handshake_timeout=listener.sasl_policy.handshake_timeout,
                            anonymous_user=user)
        self.amqp = AmqpProtocol(server, dataclasses.replace(listener, sasl_policy=policy))
        self.replay, self.sent, self.peer = replay, sent, peer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.amqp.connection_made(SkipTransport(transport, self.sent, self.peer))  # type: ignore[arg-type]
        replay, self.replay = self.replay, b""
        if replay:
            self.amqp.data_received(replay)

    def data_received(self, data: bytes) -> None:
        self.amqp.data_received(data)

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.amqp.connection_lost(exc)

    def pause_writing(self) -> None:
        self.amqp.pause_writing()

    def resume_writing(self) -> None:
        self.amqp.resume_writing()


class HandoffListener:
    """The owner's Unix socket (SOCK_SEQPACKET) where other workers hand connections."""

    def __init__(self, server: Any, path: str, secret: bytes, listener_of: Callable[[str], Any]):
        self.server = server
        self.loop = server.loop
        self.secret = secret
        self.listener_of = listener_of
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(path)
        self.sock.listen(128)
        self.sock.setblocking(False)
        self.loop.add_reader(self.sock.fileno(), self._accept)
        self.adopted_total = 0

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("hand-off socket: accept failed: %s", exc)
                return
            # Never wait for the message on the loop: a peer that connects and sends
            # nothing (the socket's name is visible to local processes) stalls nothing.
            conn.setblocking(False)
            if not self._receive(conn):
                self.loop.add_reader(conn.fileno(), self._receive, conn)
                self.loop.call_later(RECEIVE_TIMEOUT, self._give_up, conn)

    def _receive(self, conn: socket.socket) -> bool:
        """Read the one message of an accepted hand-off socket: False while it has not come."""
        try:
            data, fds, _, _ = socket.recv_fds(conn, HANDOFF_MAX * 2 + 4096, 1)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            log.warning("hand-off socket: receive failed: %s", exc)
            data, fds = b"", []
        self._give_up(conn)
        for fd in fds[1:]:
            socket.close(fd)
        if fds:
            self._adopt(data, fds[0])
        return True

    def _give_up(self, conn: socket.socket) -> None:
        if conn.fileno() >= 0:
            self.loop.remove_reader(conn.fileno())
            conn.close()

    def _adopt(self, data: bytes, fd: int) -> None:
        try:
            meta, replay, sent = decode_message(self.secret, data)
            listener = self.listener_of(meta["listener"])
            if listener is None:
                raise ValueError(f"no listener {meta['listener']!r} here")
        except (ValueError, KeyError, struct.error) as exc:
            log.warning("hand-off refused: %s", exc)
            socket.close(fd)
            return
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
        adopted = Adopted(self.server, listener, meta.get("user"), replay, sent, meta.get("peer", "?"))
        self.adopted_total += 1
        self.loop.create_task(self._connect(sock, adopted))

    async def _connect(self, sock: socket.socket, adopted: Adopted) -> None:
        try:
            await self.loop.connect_accepted_socket(lambda: adopted, sock)
        except OSError as exc:
            log.warning("adopted connection %s: %s", adopted.peer, exc)
            sock.close()

    def close(self) -> None:
        self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
