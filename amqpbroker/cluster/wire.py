"""The inter-node handshake: before any AMQP frame, the connecting node proves it
knows the cluster's secret and says which user its client authenticated as.

    owner → edge   nonce_o (16 bytes)
    edge  → owner  nonce_e (16) + user length (2, big-endian; 0xFFFF: none) + user (UTF-8)
                   + the slot map's id (8, big-endian: core/placement.map_id)
                   + HMAC-SHA256(secret, b"edge" + nonce_o + nonce_e + user + map id)
    owner → edge   HMAC-SHA256(secret, b"owner" + nonce_e + nonce_o)

The owner refuses a node whose slot map has another id (core/placement.map_id: the
map's epoch, which changes with every change of the map in ZooKeeper, its owners, and
the pinned exchanges and partitioned destinations of the node's configuration): a
link is only ever forwarded under the placement its owner serves, and two nodes
whose `[cluster]` options differ never forward to each other.  Then plain AMQP 1.0 (the protocol header, no SASL: the handshake authenticated the
node, and the owner takes the user it named as the connection's user, so the owner's
ACLs, per-user limits and link-stealing rules see the client's user, not the node).
Both proofs are compared in constant time (RFC 2104; `hmac.compare_digest`).
These are pure functions over bytes; the sockets are cluster/peer.py's and
cluster/listener.py's.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

NONCE = 16
PROOF = 32
_LEN = struct.Struct(">H")
_MAP_ID = struct.Struct(">Q")
NO_USER = 0xFFFF
MAX_USER = 4096


class HandshakeFailed(Exception):
    """The peer does not know the cluster's secret, or sent something else."""


def new_nonce() -> bytes:
    return os.urandom(NONCE)


def _proof(secret: bytes, role: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, role + b"".join(parts), hashlib.sha256).digest()


def edge_hello(secret: bytes, owner_nonce: bytes, user: str | None, map_id: int = 0) -> tuple[bytes, bytes]:
    """The edge's answer to the owner's nonce, and the proof it then expects back."""
    mine = new_nonce()
    name = b"" if user is None else user.encode("utf-8")
    if len(name) > MAX_USER:
        raise HandshakeFailed("user name too long")
    tail = _MAP_ID.pack(map_id)
    head = mine + _LEN.pack(NO_USER if user is None else len(name)) + name + tail
    return (head + _proof(secret, b"edge", owner_nonce, mine, name, tail),
            _proof(secret, b"owner", mine, owner_nonce))


def read_edge_hello(secret: bytes, owner_nonce: bytes, data: bytes) -> tuple[int, str | None, int, bytes] | None:
    """The owner reads the edge's hello from the bytes received so far: None while
    incomplete; else (bytes used, the user, the edge's map id, the owner's proof to
    send).  Raises HandshakeFailed on a wrong proof."""
    if len(data) < NONCE + _LEN.size:
        return None
    theirs = data[:NONCE]
    (size,) = _LEN.unpack_from(data, NONCE)
    length = 0 if size == NO_USER else size
    if length > MAX_USER:
        raise HandshakeFailed("user name too long")
    name_at = NONCE + _LEN.size
    end = name_at + length + _MAP_ID.size + PROOF
    if len(data) < end:
        return None
    name = data[name_at:name_at + length]
    tail = data[name_at + length:end - PROOF]
    if not hmac.compare_digest(data[end - PROOF:end], _proof(secret, b"edge", owner_nonce, theirs, name, tail)):
        raise HandshakeFailed("the node's proof does not match the cluster's secret")
    try:
        user = None if size == NO_USER else name.decode("utf-8")
    except UnicodeDecodeError:
        raise HandshakeFailed("user name is not UTF-8") from None
    return end, user, _MAP_ID.unpack(tail)[0], _proof(secret, b"owner", theirs, owner_nonce)


def check_owner_proof(expected: bytes, data: bytes) -> bool | None:
    """The edge checks the owner's answer: None while incomplete, else whether it matches."""
    if len(data) < PROOF:
        return None
    if not hmac.compare_digest(data[:PROOF], expected):
        raise HandshakeFailed("the owning node's proof does not match the cluster's secret")
    return True
