"""The replication stream between the live broker and its backup: framing and the
handshake that proves both know the pair's secret before any store data crosses.

A frame is a 4-byte big-endian length, a 1-byte kind and a payload:

  live → backup   S  a piece of the store copy (LMDB's Environment.copy, compacted)
                  E  the copy is complete: JSON {"through": last batch number it is sent for}
                  B  one sealed store batch, the very frame the live writer got
                     (store/writer.py: 4-byte length + pickle of ("batch", number, fields))
                  Y  the backup holds everything ever acknowledged: it may take over
  backup → live   A  u64+1: every batch up to this number is committed (ack; 0 means -1)

The live broker never decodes anything but acknowledgements; the backup hands B
payloads to its own writer process unread.  A batch frame is a pickle, so the
handshake comes first: each side sends a nonce and answers the other's with
HMAC-SHA256(secret, role + both nonces) (RFC 2104), compared in constant time.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import ssl
import struct

from ..server.tls import load_files

SECTION = "[ha] replication_tls"
HEAD = struct.Struct(">IB")
U64 = struct.Struct(">Q")
MAX_FRAME = 64 << 20     # a batch is at most GROUP_BYTES-sized in practice; a copy piece 1 MiB
NONCE = 16
COPY_PIECE = 1 << 20

SNAPSHOT, SNAPSHOT_END, BATCH, SYNCED, ACK = b"S"[0], b"E"[0], b"B"[0], b"Y"[0], b"A"[0]
HELLO, START, HEARTBEAT = b"L"[0], b"T"[0], b"H"[0]
HEARTBEAT_EVERY = 0.5    # seconds between heartbeats on an idle link
SILENT_LINK = 4.0        # seconds without a frame after which the backup takes the link for dead


class HandshakeFailed(Exception):
    """The peer does not know the pair's secret (or is not a broker of this pair)."""


def frame(kind: int, payload: bytes = b"") -> bytes:
    return HEAD.pack(len(payload), kind) + payload


def batch_frame(number: int, data: bytes) -> bytes:
    return HEAD.pack(8 + len(data), BATCH) + U64.pack(number) + data


def batch_payload(payload: bytes) -> tuple[int, memoryview]:
    """(the batch number, the writer frame) of a B frame's payload."""
    return U64.unpack_from(payload)[0], memoryview(payload)[8:]


def ack_frame(number: int) -> bytes:
    return frame(ACK, U64.pack(number + 1))


def ack_number(payload: bytes) -> int:
    return U64.unpack(payload)[0] - 1


def json_frame(kind: int, value: dict) -> bytes:
    return frame(kind, json.dumps(value).encode())


def json_payload(payload: bytes) -> dict:
    value = json.loads(payload)
    if not isinstance(value, dict):
        raise ValueError("replication frame: a JSON object expected")
    return value


def server_context(cert_file: str, key_file: str,
                   names: tuple[str, str] = ("cert_file", "key_file")) -> ssl.SSLContext:
    """The live broker's side of a TLS replication link.  ValueError naming the
    settings (`names`) and files when one is missing or unusable (server/tls.py
    `load_files`): OpenSSL's own words name no file."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    load_files(SECTION, ctx.load_cert_chain, **{names[0]: cert_file, names[1]: key_file})
    return ctx


def client_context(ca_file: str, name: str = "ca_file") -> ssl.SSLContext:
    """The backup's side: the live broker's certificate must chain to `ca_file`.  The
    host name is not checked (brokers are often reached by address); the pair's
    secret proves the peer, TLS keeps the store's content private on the way."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    load_files(SECTION, lambda ca: ctx.load_verify_locations(cafile=ca), **{name: ca_file})
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    return ctx


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    size, kind = HEAD.unpack(await reader.readexactly(HEAD.size))
    if size > MAX_FRAME:
        raise ValueError(f"replication frame of {size} bytes")
    return kind, await reader.readexactly(size)


def _proof(secret: str, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret.encode(), role + first + second, hashlib.sha256).digest()


async def prove_live(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: str) -> None:
    """The live side: challenge the backup, then answer its challenge."""
    mine = os.urandom(NONCE)
    writer.write(mine)
    await writer.drain()
    theirs = await reader.readexactly(NONCE)
    proof = await reader.readexactly(32)
    if not hmac.compare_digest(proof, _proof(secret, b"backup", mine, theirs)):
        raise HandshakeFailed("the backup's proof does not match the pair's secret")
    writer.write(_proof(secret, b"live", theirs, mine))
    await writer.drain()


async def prove_backup(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: str) -> None:
    """The backup side: answer the live broker's challenge and check its answer."""
    theirs = await reader.readexactly(NONCE)
    mine = os.urandom(NONCE)
    writer.write(mine + _proof(secret, b"backup", theirs, mine))
    await writer.drain()
    proof = await reader.readexactly(32)
    if not hmac.compare_digest(proof, _proof(secret, b"live", mine, theirs)):
        raise HandshakeFailed("the live broker's proof does not match the pair's secret")
