"""The owning side of inter-node connections: a listener (a Unix socket for the
workers of one machine, TCP between machines) whose connections start with the
handshake of cluster/wire.py and then are ordinary AMQP connections of the broker
(server/engine.py AmqpProtocol), with the user the connecting node named.

This is the "protocol in front of AmqpProtocol" shape of server/websocket.py: the
owner runs every JMS rule on a forwarded link exactly as for a client of its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import ssl
from typing import Any

from ..config import ClientIdPolicy
from ..core.placement import map_id
from ..server.app import Listener
from ..server.engine import AmqpProtocol
from ..server.sasl import SaslPolicy
from ..server.tls import tls_protocol_factory
from . import wire

log = logging.getLogger("amqpbroker.cluster")

HANDSHAKE_TIMEOUT = 10.0


def node_listener(host: str, port: int) -> Listener:
    """The inter-node listener's settings.  No SASL (the handshake authenticated the
    node); `restricted` client-id policy: a connection that desires
    sole-connection-for-container is a client-id claim (cluster/forward.py) and is
    refused like a second client with that id would be."""
    return Listener("cluster", host, port, SaslPolicy((), allow_no_sasl=True, handshake_timeout=30.0),
                    ClientIdPolicy.RESTRICTED)


class HandshakeProtocol(asyncio.Protocol):
    """Reads the connecting node's hello, then hands the socket to an AmqpProtocol
    whose user is the one the node named."""

    def __init__(self, server: Any, listener: Listener, secret: bytes):
        self.server = server
        self.listener = listener
        self.secret = secret
        self.nonce = wire.new_nonce()
        self.buf = bytearray()
        self.sock: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.done = False
        # Taken at accept by a TLS listener (server/tls.py): the AMQP layer's to adopt.
        self.handshake_slot: Any = None

    def connection_made(self, sock: asyncio.BaseTransport) -> None:
        self.sock = sock  # type: ignore[assignment]
        sock.write(self.nonce)  # type: ignore[attr-defined]
        self.timer = self.server.loop.call_later(HANDSHAKE_TIMEOUT, self._timeout)

    def _timeout(self) -> None:
        if not self.done and self.sock is not None:
            log.warning("inter-node connection closed: no handshake within %.0f s", HANDSHAKE_TIMEOUT)
            self.sock.abort()

    def data_received(self, data: bytes) -> None:
        if self.done:
            return
        self.buf += data
        try:
            hello = wire.read_edge_hello(self.secret, self.nonce, bytes(self.buf))
        except wire.HandshakeFailed as exc:
            log.warning("inter-node connection refused: %s", exc)
            self.done = True
            self.sock.abort()
            return
        if hello is None:
            return
        used, user, theirs, proof = hello
        self.done = True
        slots = self.server.cluster.slots
        if theirs != map_id(slots):
            log.warning("inter-node connection refused: the other node places addresses under another slot map "
                        "(id %016x, this node's %016x at epoch %d): its map in ZooKeeper, or its [cluster] "
                        "pinned_exchanges / partitioned, differ from this node's", theirs, map_id(slots), slots.epoch)
            self.sock.abort()
            return
        if self.timer is not None:
            self.timer.cancel()
        self.sock.write(proof)
        policy = dataclasses.replace(self.listener.sasl_policy, anonymous_user=user)
        proto = AmqpProtocol(self.server, dataclasses.replace(self.listener, sasl_policy=policy))
        proto.handshake_slot = self.handshake_slot
        self.sock.set_protocol(proto)
        proto.connection_made(self.sock)
        rest = bytes(self.buf[used:])
        self.buf = bytearray()
        if rest:
            proto.data_received(rest)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()


def unix_socket(path: str) -> socket.socket:
    """A listening Unix socket; a path starting with NUL is in the abstract namespace
    (Linux: no file to clean up).  Made here: uvloop refuses abstract paths itself."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(512)
    sock.setblocking(False)
    return sock


async def start_listener(server: Any, secret: bytes, *, unix_path: str | None = None,
                         host: str = "127.0.0.1", port: int = 0,
                         ssl_context: ssl.SSLContext | None = None) -> tuple[asyncio.AbstractServer, str]:
    """Start the inter-node listener; returns it and the address it took.  With
    `ssl_context` (cluster/tls.py): TLS, a failed handshake logged like a client's on
    a TLS listener (server/tls.py), the node handshake inside."""
    loop = server.loop
    lst = node_listener(host, port)
    lst.ssl_context = ssl_context

    def factory() -> asyncio.Protocol:
        return HandshakeProtocol(server, lst, secret)

    if unix_path is not None:
        srv = await loop.create_unix_server(factory, sock=unix_socket(unix_path))
        return srv, "unix:" + unix_path.replace("\0", "@")
    make = factory if ssl_context is None else tls_protocol_factory(server, lst, factory)
    srv = await loop.create_server(make, host, port, reuse_address=True)
    bound = srv.sockets[0].getsockname()
    lst.port = bound[1]
    return srv, f"{bound[0]}:{bound[1]}"
