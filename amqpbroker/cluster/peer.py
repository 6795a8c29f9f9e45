"""One AMQP connection from this node to another, on behalf of one client connection
(its "mirror" there): a proton client Transport driven from the broker's own loop.

It carries the client's container-id and user (cluster/wire.py handshake), one
session per client session, and one link per forwarded client link (same name and
terms), so the owning node applies every connection-, session- and link-scoped rule
(JMS client-id, subscription names, no-local, temporary destinations, expiry
policies, link stealing, transactions) exactly as it would to the client itself.

Like server/engine.py, the per-message events (deliveries, flow) are read as raw
pointers and the output goes out once per loop turn with the broker's other
connections (`BrokerServer.dirty`, `flush`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import TYPE_CHECKING, Any, Callable

from cproton import ffi, lib
from proton import Collector, Condition, Connection, Event, Transport, symbol

from . import wire

if TYPE_CHECKING:
    from .forward import ForwardedLink

log = logging.getLogger("amqpbroker.cluster")

_DELIVERY = lib.PN_DELIVERY
_LINK_FLOW = lib.PN_LINK_FLOW
_LINK_REMOTE_OPEN = lib.PN_LINK_REMOTE_OPEN
_LINK_REMOTE_DETACH = lib.PN_LINK_REMOTE_DETACH
_LINK_REMOTE_CLOSE = lib.PN_LINK_REMOTE_CLOSE
_SESSION_REMOTE_CLOSE = lib.PN_SESSION_REMOTE_CLOSE
_CONNECTION_REMOTE_OPEN = lib.PN_CONNECTION_REMOTE_OPEN
_CONNECTION_REMOTE_CLOSE = lib.PN_CONNECTION_REMOTE_CLOSE
_TRANSPORT_CLOSED = lib.PN_TRANSPORT_CLOSED
_TRANSPORT_ERROR = lib.PN_TRANSPORT_ERROR
# A silent owner (a machine gone without a reset) is noticed in about this long.
IDLE_TIMEOUT = 16.0
HANDSHAKE_TIMEOUT = 10.0
ESTABLISHMENT_FAILED = symbol("amqp:connection-establishment-failed")


def connect_socket(address: str) -> tuple[str, Any]:
    """("unix", connected socket) or ("tcp", (host, port)) for a node's inter-node
    address (`unix:@name` abstract, `unix:/path`, `host:port`)."""
    if address.startswith("unix:"):
        path = address[5:]
        path = "\0" + path[1:] if path.startswith("@") else path
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(2.0)
        sock.connect(path)
        sock.setblocking(False)
        return "unix", sock
    host, _, port = address.rpartition(":")
    return "tcp", (host.strip("[]"), int(port))


class PeerConnection(asyncio.Protocol):
    """The connection to `node` for one client connection."""

    def __init__(self, server: Any, node: str, address: str, secret: bytes, *, container_id: str,
                 user: str | None, desired_capabilities: list[str], on_lost: Callable[["PeerConnection"], None],
                 map_id: int = 0, tls: Any = None):
        self.server = server
        self.tls = tls                # cluster/tls.py NodeTls: TLS to a node's TCP address
        self.loop = server.loop
        self.node = node
        self.address = address
        self.secret = secret
        self.user = user
        self.map_id = map_id          # core/placement.map_id (cluster/wire.py: the owner checks it)
        self.on_lost = on_lost
        self.sock: asyncio.Transport | None = None
        self.closed = False
        self.lost_condition: Condition | None = None
        self.remote_open = False
        self.refused: Condition | None = None         # the owner refused the connection (client-id claim)
        self.open_waiters: list[Callable[["PeerConnection"], None]] = []
        self.links: dict[Any, "ForwardedLink"] = {}     # raw pn_link_t* (ours) → forwarded link
        self.sessions: dict[Any, Any] = {}               # raw client pn_session_t* → our Session
        self.free_after_output: list[Any] = []           # our raw links to free once written
        self._dirty = False
        self._handshake: bytearray | None = bytearray()  # until the owner's proof came
        self._expected_proof = b""
        self._timer: asyncio.TimerHandle | None = None
        t = Transport()
        t.idle_timeout = IDLE_TIMEOUT
        conn = Connection()
        conn.container = container_id
        conn.desired_capabilities = [symbol(c) for c in desired_capabilities] or None
        coll = Collector()
        conn.collect(coll)
        t.bind(conn)
        conn.open()
        self.transport, self.connection, self.collector = t, conn, coll
        self.loop.create_task(self._connect())

    # ------------------------------------------------------------------ socket

    async def _connect(self) -> None:
        try:
            kind, where = connect_socket(self.address)
            if kind == "unix":
                await self.loop.create_unix_connection(lambda: self, sock=where)
            elif self.tls is not None:
                await self.loop.create_connection(
                    lambda: self, where[0], where[1], ssl=self.tls.client,
                    server_hostname=where[0] if self.tls.verify_hostname else "",
                    ssl_handshake_timeout=HANDSHAKE_TIMEOUT)
            else:
                await self.loop.create_connection(lambda: self, where[0], where[1])
        except (OSError, asyncio.TimeoutError) as exc:   # ssl.SSLError is an OSError
            self._lost(Condition("amqpbroker:resource-unavailable",
                                 f"node {self.node} cannot be reached ({self.address}): {exc}"))

    def connection_made(self, sock: asyncio.BaseTransport) -> None:
        self.sock = sock  # type: ignore[assignment]
        if self.closed:
            sock.abort()
            return
        # A node that accepts but never answers (stopped, SIGSTOP): given up on like
        # one that refuses; after the handshake the transport's idle timeout watches.
        self.loop.call_later(HANDSHAKE_TIMEOUT, self._handshake_overdue)

    def _handshake_overdue(self) -> None:
        if self._handshake is not None and not self.closed:
            self._lost(Condition("amqpbroker:resource-unavailable",
                                 f"node {self.node} did not answer within {HANDSHAKE_TIMEOUT:.0f} s"))

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        if self._handshake is not None:
            data = self._feed_handshake(data)
            if not data:
                return
        self._push(data)

    def _feed_handshake(self, data: bytes) -> bytes:
        """The owner's nonce, then its proof: returns the AMQP bytes after them."""
        hs = self._handshake
        hs += data
        try:
            if not self._expected_proof:
                if len(hs) < wire.NONCE:
                    return b""
                hello, self._expected_proof = wire.edge_hello(self.secret, bytes(hs[:wire.NONCE]), self.user,
                                                              self.map_id)
                del hs[:wire.NONCE]
                self.sock.write(hello)
            if wire.check_owner_proof(self._expected_proof, bytes(hs)) is None:
                return b""
        except wire.HandshakeFailed as exc:
            self._lost(Condition("amqpbroker:resource-unavailable", f"node {self.node}: {exc}"))
            return b""
        rest = bytes(hs[wire.PROOF:])
        self._handshake = None
        self.mark_dirty()   # the AMQP header and everything queued meanwhile
        return rest

    def connection_lost(self, exc: Exception | None) -> None:
        why = f": {exc}" if exc else ""
        self._lost(Condition("amqpbroker:resource-unavailable", f"connection to node {self.node} lost{why}"))

    def _push(self, data: bytes) -> None:
        impl = self.transport._impl
        view = memoryview(data)
        while view:
            capacity = lib.pn_transport_capacity(impl)
            if capacity <= 0:
                self._process()
                if lib.pn_transport_capacity(impl) <= 0:
                    break
                continue
            chunk, view = view[:capacity], view[capacity:]
            if lib.pn_transport_push(impl, ffi.from_buffer(chunk), len(chunk)) != len(chunk):
                break
            self._process()
        self._process()

    # ------------------------------------------------------------------ output

    def mark_dirty(self) -> None:
        if not self._dirty:
            self._dirty = True
            self.server.dirty.append(self)
            self.server.flush_soon()

    def flush(self) -> None:
        """Called by BrokerServer._flush once per loop turn while marked dirty."""
        if lib.pn_collector_peek(self.collector._impl) != ffi.NULL:
            self._process()
        self._dirty = False
        if self.sock is None or self._handshake is not None or self.closed:
            return   # output stays in the transport until the handshake is over
        impl = self.transport._impl
        pending = lib.pn_transport_pending(impl)
        while pending > 0:
            buf = bytearray(pending)
            n = lib.pn_transport_peek(impl, ffi.from_buffer(buf), pending)
            if n < 0:
                break
            lib.pn_transport_pop(impl, pending)
            self.sock.write(buf)
            pending = lib.pn_transport_pending(impl)
        if self.free_after_output:
            links, self.free_after_output = self.free_after_output, []
            for link in links:
                lib.pn_link_free(link)
        if pending < 0:
            self.sock.close()
            return
        if self._timer is None:
            deadline = lib.pn_transport_tick(impl, int(self.loop.time() * 1000)) / 1000
            if deadline > 0:
                self._timer = self.loop.call_at(deadline, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self.closed:
            return
        self.transport.tick(self.loop.time())
        self._process()
        self.mark_dirty()

    # ------------------------------------------------------------------ events

    def _process(self) -> None:
        coll = self.collector._impl
        peek, pop, etype = lib.pn_collector_peek, lib.pn_collector_pop, lib.pn_event_type
        null = ffi.NULL
        ev = peek(coll)
        if ev == null:
            return
        links = self.links
        while ev != null:
            t = etype(ev)
            try:
                if t == _DELIVERY:
                    dlv = lib.pn_event_delivery(ev)
                    fwd = links.get(lib.pn_delivery_link(dlv))
                    if fwd is not None:
                        fwd.on_peer_delivery(dlv)
                    else:
                        lib.pn_delivery_settle(dlv)
                elif t == _LINK_FLOW:
                    fwd = links.get(lib.pn_event_link(ev))
                    if fwd is not None:
                        fwd.on_peer_flow()
                elif t == _LINK_REMOTE_OPEN:
                    fwd = links.get(lib.pn_event_link(ev))
                    if fwd is not None:
                        fwd.on_peer_attach()
                elif t == _LINK_REMOTE_DETACH or t == _LINK_REMOTE_CLOSE:
                    fwd = links.get(lib.pn_event_link(ev))
                    if fwd is not None:
                        fwd.on_peer_detach(t == _LINK_REMOTE_CLOSE)
                elif t == _SESSION_REMOTE_CLOSE:
                    self._session_ended(Event.wrap(ev).session)
                elif t == _CONNECTION_REMOTE_OPEN:
                    self._opened()
                elif t == _CONNECTION_REMOTE_CLOSE:
                    cond = self.connection.remote_condition
                    self._lost(cond or Condition("amqpbroker:resource-unavailable",
                                                 f"node {self.node} closed the connection"))
                elif t == _TRANSPORT_ERROR or t == _TRANSPORT_CLOSED:
                    self._lost(Condition("amqpbroker:resource-unavailable",
                                         f"connection to node {self.node} ended"))
            except Exception:
                log.exception("node %s: error handling event %d", self.node, t)
            pop(coll)
            ev = peek(coll)
        self.mark_dirty()

    def _opened(self) -> None:
        props = self.connection.remote_properties or {}
        if props.get(ESTABLISHMENT_FAILED):   # refused (a client-id claim): the close follows
            self.refused = self.connection.remote_condition or Condition("amqp:invalid-field",
                                                                         "container-id already connected")
        self.remote_open = True
        waiters, self.open_waiters = self.open_waiters, []
        for waiter in waiters:
            waiter(self)

    def _session_ended(self, session: Any) -> None:
        """The owner ended a session (its links went with it)."""
        for fwd in [f for f in self.links.values() if f.mirror_session is session]:
            fwd.on_peer_detach(False, session.remote_condition)
        if session.state & session.LOCAL_ACTIVE:
            session.close()

    # ------------------------------------------------------------------ sessions

    def session_for(self, client_session: Any) -> Any:
        """Our session standing for a client session (raw pn_session_t*)."""
        ssn = self.sessions.get(client_session)
        if ssn is None:
            ssn = self.connection.session()
            ssn.open()
            self.sessions[client_session] = ssn
        return ssn

    def end_session(self, client_session: Any) -> None:
        """The client ended its session: end ours, so the owner applies session-end rules."""
        ssn = self.sessions.pop(client_session, None)
        if ssn is None:
            return
        for raw, fwd in list(self.links.items()):
            if fwd.mirror_session is ssn:
                del self.links[raw]
        if not self.closed:
            ssn.close()
            self.mark_dirty()

    # ------------------------------------------------------------------ ending

    def close(self, lost: bool = False) -> None:
        """The client connection ended: close ours the same way (a lost client is
        a lost connection at the owner too: its deliveries count as failed)."""
        if self.closed:
            return
        self.links.clear()
        if lost or self.sock is None or self._handshake is not None:
            self.closed = True
            self._cancel_timer()
            if self.sock is not None:
                self.sock.abort()
            return
        self.connection.close()
        self.mark_dirty()
        self.closed = True
        self._final_flush()

    def _final_flush(self) -> None:
        impl = self.transport._impl
        pending = lib.pn_transport_pending(impl)
        while pending > 0:
            buf = bytearray(pending)
            lib.pn_transport_peek(impl, ffi.from_buffer(buf), pending)
            lib.pn_transport_pop(impl, pending)
            self.sock.write(buf)
            pending = lib.pn_transport_pending(impl)
        self._cancel_timer()
        self.sock.close()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _lost(self, condition: Condition) -> None:
        if self.lost_condition is not None:
            return
        self.lost_condition = condition
        was_closed, self.closed = self.closed, True
        self._cancel_timer()
        if self.sock is not None:
            self.sock.abort()
        if was_closed:
            return
        links, self.links = list(self.links.values()), {}
        for fwd in links:
            fwd.on_peer_lost(condition)
        waiters, self.open_waiters = self.open_waiters, []
        for waiter in waiters:
            waiter(self)
        self.on_lost(self)
