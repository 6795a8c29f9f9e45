"""Encoding and decoding of AMQP 1.0 protocol headers and SASL frames.

Pure functions, no I/O.  Frame bodies are encoded/decoded with ``proton.Data``
(the AMQP type codec of our pinned proton dependency).  Everything here is
described in AMQP 1.0 Part 2 §2.2-§2.3 (headers, framing) and Part 5 §5.3
(SASL).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from proton import Data, Described, symbol

__all__ = [
    "AMQP_HEADER",
    "SASL_HEADER",
    "TLS_HEADER",
    "HEADER_SIZE",
    "FRAME_HEADER_SIZE",
    "SASL_FRAME_TYPE",
    "MAX_SASL_FRAME_SIZE",
    "SaslCode",
    "SaslFrameType",
    "SaslFrame",
    "FrameError",
    "encode_frame",
    "encode_mechanisms",
    "encode_challenge",
    "encode_outcome",
    "encode_init",
    "encode_response",
    "decode_body",
    "FrameReader",
]

# AMQP 1.0 §2.2: "AMQP" + protocol-id + major + minor + revision.
# protocol-id 0 = AMQP, 2 = TLS (§5.2.1), 3 = SASL (§5.3.1).
AMQP_HEADER = b"AMQP\x00\x01\x00\x00"
TLS_HEADER = b"AMQP\x02\x01\x00\x00"
SASL_HEADER = b"AMQP\x03\x01\x00\x00"
HEADER_SIZE = 8

# AMQP 1.0 §2.3.1: SIZE (uint32), DOFF (ubyte, in 4-byte words), TYPE (ubyte),
# 2 type-specific bytes (ignored for SASL frames, §5.3.1).
FRAME_HEADER_SIZE = 8
_FRAME_HEADER = struct.Struct(">IBBH")
SASL_FRAME_TYPE = 0x01  # §5.3.1
# The spec only guarantees 512 bytes (MIN-MAX-FRAME-SIZE) during SASL; we
# accept more (long SCRAM messages, big tokens) but cap it to bound memory.
MAX_SASL_FRAME_SIZE = 64 * 1024


class SaslCode(enum.IntEnum):
    """AMQP 1.0 §5.3.3.6 sasl-code."""

    OK = 0
    AUTH = 1
    SYS = 2
    SYS_PERM = 3
    SYS_TEMP = 4


class SaslFrameType(enum.IntEnum):
    """Descriptor codes of the SASL frame bodies, AMQP 1.0 §5.3.3.1-§5.3.3.5."""

    MECHANISMS = 0x40
    INIT = 0x41
    CHALLENGE = 0x42
    RESPONSE = 0x43
    OUTCOME = 0x44


_SYMBOLIC = {
    "amqp:sasl-mechanisms:list": SaslFrameType.MECHANISMS,
    "amqp:sasl-init:list": SaslFrameType.INIT,
    "amqp:sasl-challenge:list": SaslFrameType.CHALLENGE,
    "amqp:sasl-response:list": SaslFrameType.RESPONSE,
    "amqp:sasl-outcome:list": SaslFrameType.OUTCOME,
}


class FrameError(ValueError):
    """The peer sent bytes that are not a valid SASL frame."""


@dataclass(frozen=True)
class SaslFrame:
    type: SaslFrameType
    fields: tuple  # the list fields, trailing nulls possibly omitted by the sender

    def field(self, index: int):
        return self.fields[index] if index < len(self.fields) else None


# --------------------------------------------------------------------------
# encoding
# --------------------------------------------------------------------------


def encode_frame(body: bytes) -> bytes:
    """Wrap an encoded SASL frame body in a frame header (§2.3.1, §5.3.1)."""
    return _FRAME_HEADER.pack(FRAME_HEADER_SIZE + len(body), 2, SASL_FRAME_TYPE, 0) + body


def _described_list(code: SaslFrameType) -> Data:
    d = Data()
    d.put_described()
    d.enter()
    d.put_ulong(int(code))
    d.put_list()
    d.enter()
    return d


def _finish(d: Data) -> bytes:
    d.exit()
    d.exit()
    return encode_frame(bytes(d.encode()))


def encode_mechanisms(mechanisms: tuple[str, ...] | list[str]) -> bytes:
    """sasl-mechanisms, §5.3.3.1: [sasl-server-mechanisms: symbol[] mandatory]."""
    d = _described_list(SaslFrameType.MECHANISMS)
    d.put_array(False, Data.SYMBOL)
    d.enter()
    for mech in mechanisms:
        d.put_symbol(symbol(mech))
    d.exit()
    return _finish(d)


def encode_challenge(challenge: bytes) -> bytes:
    """sasl-challenge, §5.3.3.3: [challenge: binary mandatory]."""
    d = _described_list(SaslFrameType.CHALLENGE)
    d.put_binary(bytes(challenge))
    return _finish(d)


def encode_outcome(code: SaslCode, additional_data: bytes | None = None) -> bytes:
    """sasl-outcome, §5.3.3.5: [code: ubyte mandatory, additional-data: binary]."""
    d = _described_list(SaslFrameType.OUTCOME)
    d.put_ubyte(int(code))
    if additional_data is not None:
        d.put_binary(bytes(additional_data))
    return _finish(d)


def encode_init(mechanism: str, initial_response: bytes | None = None,
                hostname: str | None = None) -> bytes:
    """sasl-init, §5.3.3.2 (client side; used by tests and tools)."""
    d = _described_list(SaslFrameType.INIT)
    d.put_symbol(symbol(mechanism))
    if initial_response is None:
        d.put_null()
    else:
        d.put_binary(bytes(initial_response))
    if hostname is not None:
        d.put_string(hostname)
    return _finish(d)


def encode_response(response: bytes) -> bytes:
    """sasl-response, §5.3.3.4 (client side)."""
    d = _described_list(SaslFrameType.RESPONSE)
    d.put_binary(bytes(response))
    return _finish(d)


# --------------------------------------------------------------------------
# decoding
# --------------------------------------------------------------------------


def _plain(value):
    """Turn proton's decoded objects into plain Python values."""
    if isinstance(value, memoryview | bytearray):
        return bytes(value)
    return value


def decode_body(body: bytes) -> SaslFrame:
    """Decode one SASL frame body: exactly one described list (§5.3.1)."""
    if not body:
        raise FrameError("empty SASL frame body")
    d = Data()
    try:
        consumed = d.decode(body)
        d.rewind()
        if not d.next():
            raise FrameError("SASL frame body holds no value")
        value = d.get_object()
    except FrameError:
        raise
    except Exception as exc:  # proton.DataException and friends
        raise FrameError(f"undecodable SASL frame body: {exc}") from None
    if consumed != len(body):
        raise FrameError(
            f"SASL frame body has {len(body) - consumed} trailing byte(s) after the performative")
    if not isinstance(value, Described):
        raise FrameError("SASL frame body is not a described type")
    descriptor = value.descriptor
    if isinstance(descriptor, symbol):
        code = _SYMBOLIC.get(str(descriptor))
    elif isinstance(descriptor, int) and not isinstance(descriptor, bool):
        try:
            code = SaslFrameType(int(descriptor))
        except ValueError:
            code = None
    else:
        code = None
    if code is None:
        raise FrameError(f"unknown SASL frame descriptor {descriptor!r}")
    if not isinstance(value.value, list):
        raise FrameError(f"SASL frame {code.name.lower()} body is not a list")
    return SaslFrame(code, tuple(_plain(v) for v in value.value))


class FrameReader:
    """Incremental splitter of a byte stream into SASL frames (§2.3.1)."""

    def __init__(self, max_frame_size: int = MAX_SASL_FRAME_SIZE) -> None:
        self.max_frame_size = max_frame_size

    def next_frame(self, buf: bytearray) -> SaslFrame | None:
        """Consume one complete frame from ``buf``.

        Returns None if ``buf`` does not yet hold a whole frame; raises
        FrameError on malformed framing (checked as soon as the 8-byte frame
        header is available, so an oversized frame is refused before its body
        is buffered).  Empty frames (size 8) are skipped like heartbeats.
        """
        while True:
            if len(buf) < FRAME_HEADER_SIZE:
                return None
            size, doff, ftype, _ = _FRAME_HEADER.unpack_from(buf)
            if size > self.max_frame_size:
                raise FrameError(
                    f"SASL frame of {size} bytes exceeds the limit of {self.max_frame_size} bytes")
            if doff < 2:
                raise FrameError(f"invalid frame data offset {doff} (must be >= 2)")
            if size < doff * 4:
                raise FrameError(f"frame size {size} smaller than its data offset {doff * 4}")
            if ftype != SASL_FRAME_TYPE:
                raise FrameError(
                    f"expected a SASL frame (type 0x01) but got frame type 0x{ftype:02x}")
            if len(buf) < size:
                return None
            body = bytes(buf[doff * 4:size])
            del buf[:size]
            if body:
                return decode_body(body)
