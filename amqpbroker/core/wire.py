"""Checks on the AMQP frame stream that proton's engine does not make (sans-I/O).

proton decodes frames and keeps endpoint state, but it lets some protocol violations
through silently: a `begin` on a channel that is already in use opens a second session
on it, an `attach` reuses a handle that is still attached, an `open` comes twice.  The
peer then waits, and so does the broker, until the idle timeout.  `FrameGuard` is fed
the same bytes as the engine (after SASL) and names the first violation, so the
connection is closed at once with the error AMQP 1.0 gives for it:

* `begin` on a channel in use (§2.5.1: a channel carries one session at a time),
  `open` twice (§2.4.1): `amqp:not-allowed`;
* `attach` with a handle in use on its session (§2.6.2, §2.8.16): `amqp:session:handle-in-use`;
* a performative before `open` (§2.4.1: open is the first frame): `amqp:not-allowed`;
* a frame header with a size below 8 or a data offset below 2 (§2.3.1), refused as
  soon as the header is in rather than after `size` bytes arrive:
  `amqp:connection:framing-error`;
* a watched performative that does not decode (truncated, nested too deep, arrays
  that declare more elements than they have bytes: proton would spend a second of
  the loop building millions of values): `amqp:decode-error`.

It keeps only what it must: the 8-byte frame header, and the body of the few
performatives it looks into (open, begin, attach, detach, end: small frames).
Transfer bodies, however large, are skipped without being copied.
"""

from __future__ import annotations

import struct

from proton import Described, symbol, ulong

from .codec import DecodeError, TextError, decode, encode

AMQP_HEADER = b"AMQP\x00\x01\x00\x00"

OPEN, BEGIN, ATTACH, DETACH, END = 0x10, 0x11, 0x12, 0x16, 0x17
_WATCHED = frozenset((OPEN, BEGIN, ATTACH, DETACH, END))
_HEADER = struct.Struct(">IBBH")
# A watched performative's body is read whole; bigger than this it is not a control
# frame any client sends (the engine's own max-frame-size check applies as well).
MAX_WATCHED_BODY = 1 << 20

NOT_ALLOWED = "amqp:not-allowed"
HANDLE_IN_USE = "amqp:session:handle-in-use"
FRAMING_ERROR = "amqp:connection:framing-error"
DECODE_ERROR = "amqp:decode-error"


class FrameGuard:
    def __init__(self) -> None:
        self._buf = bytearray()      # a frame header, or a watched frame being collected
        self._skip = 0               # bytes of an unwatched frame body still to pass
        self._header_done = False
        self._frame: tuple[int, int, int] | None = None   # (size, data offset, channel)
        self._watched = False        # the current frame's body is being collected
        self._frame_at = 0           # where in the chunk being fed the current frame began
        self.violation_at = 0
        self._opened = False
        self._handles: dict[int, set[int]] = {}           # channel → handles attached

    def feed(self, data: bytes) -> tuple[str, str] | None:
        """Bytes as they came from the socket: (condition, description) of the first
        violation they hold, else None.  Once a violation is found, stop feeding;
        `violation_at` is where in `data` the offending frame starts (0 when it began
        in an earlier chunk): the bytes before it are good to hand to the engine."""
        total = len(data)
        pos = 0
        self._frame_at = 0   # a frame under way began in an earlier chunk
        unpack = _HEADER.unpack_from
        while pos < total:
            if self._skip:
                n = min(self._skip, total - pos)
                self._skip -= n
                pos += n
                continue
            if self._header_done and self._frame is None and not self._buf and total - pos >= 11:
                # Fast path (every transfer): a whole header and the performative code
                # are in this chunk, and the frame is not one to look into: step over it.
                size, doff, kind, _ = unpack(data, pos)
                body_at = pos + doff * 4
                if size >= _HEADER.size and doff >= 2 and (
                        kind != 0 or size == _HEADER.size
                        or (size >= doff * 4 + 3 and body_at + 3 <= total
                            and (data[body_at + 2] not in _WATCHED
                                 or data[body_at] != 0 or data[body_at + 1] != 0x53))):
                    end = pos + size
                    if end > total:
                        self._skip = end - total
                        return None
                    pos = end
                    continue
            if self._header_done and self._frame is None and not self._buf:
                self._frame_at = pos
            rest = self._take(memoryview(data)[pos:])
            pos = total - len(rest)
            problem = self._step()
            if problem is not None:
                self.violation_at = self._frame_at
                return problem
            if self._frame is None and not self._buf:
                self._frame_at = 0
        return None

    def _take(self, view: memoryview) -> memoryview:
        """Move as many bytes as the current step needs into the buffer."""
        if not self._header_done:
            need = len(AMQP_HEADER)
        elif self._frame is None:
            need = _HEADER.size
        else:
            size, body_at, _ = self._frame
            need = size if self._watched else min(size, body_at + 3)
        n = min(need - len(self._buf), len(view))
        self._buf += view[:n]
        return view[n:]

    def _step(self) -> tuple[str, str] | None:
        buf = self._buf
        if not self._header_done:
            if len(buf) == len(AMQP_HEADER):
                self._header_done = True
                buf.clear()
            return None
        if self._frame is None:
            if len(buf) < _HEADER.size:
                return None
            size, doff, kind, channel = _HEADER.unpack(buf)
            if size < _HEADER.size or doff < 2:
                return FRAMING_ERROR, f"frame header with size {size} and data offset {doff}"
            if size < doff * 4:
                return FRAMING_ERROR, f"frame of {size} bytes with its body at {doff * 4}"
            self._frame = (size, doff * 4, channel)
            if kind != 0 or size == _HEADER.size:   # not an AMQP frame, or an empty one
                return self._pass()
            return None
        size, body_at, channel = self._frame
        if not self._watched:
            if len(buf) < min(size, body_at + 3):
                return None
            if _body_too_short(size, body_at):
                return DECODE_ERROR, f"frame body of {size - body_at} bytes holds no performative"
            code = buf[body_at + 2] if buf[body_at:body_at + 2] == b"\x00\x53" else None
            if code not in _WATCHED or size - body_at > MAX_WATCHED_BODY:
                return self._pass()
            self._watched = True
        if len(buf) < size:
            return None
        code = buf[body_at + 2]
        body = bytes(buf[body_at + 3:size])
        buf.clear()
        self._frame = None
        self._watched = False
        try:
            fields, _ = decode(body)
        except TextError:
            # Sound structure, a string or symbol that does not decode: the link or
            # connection that carries it is answered by the reader of that field
            # (server/peer_fields.py), the rest of the connection goes on.
            fields = []
        except DecodeError as exc:
            return DECODE_ERROR, f"performative 0x{code:02x} does not decode: {exc}"
        if not isinstance(fields, list):
            return DECODE_ERROR, f"performative 0x{code:02x} is not a list"
        return self._check(code, channel, fields)

    def _pass(self) -> None:
        """Skip the rest of the current frame (its bytes are not needed)."""
        size = self._frame[0]
        self._skip = size - len(self._buf)
        self._buf.clear()
        self._frame = None

    def _check(self, code: int, channel: int, fields: list) -> tuple[str, str] | None:
        if code != OPEN and not self._opened:
            return NOT_ALLOWED, f"performative 0x{code:02x} before open"
        if code == OPEN:
            if self._opened:
                return NOT_ALLOWED, "open received twice on one connection"
            self._opened = True
        elif code == BEGIN:
            if channel in self._handles:
                return NOT_ALLOWED, f"begin on channel {channel}, which already carries a session"
            self._handles[channel] = set()
        elif code == END:
            self._handles.pop(channel, None)
        elif code == ATTACH:
            handles = self._handles.get(channel)
            handle = _field(fields, 1)
            if handles is not None and isinstance(handle, int):
                if handle in handles:
                    return HANDLE_IN_USE, f"attach with handle {int(handle)}, already in use on channel {channel}"
                handles.add(handle)
        elif code == DETACH:
            handles = self._handles.get(channel)
            handle = _field(fields, 0)
            if handles is not None and isinstance(handle, int):
                handles.discard(handle)
        return None


CLOSE, ERROR = 0x18, 0x1D


def close_frame(condition: str, description: str) -> bytes:
    """A `close` frame carrying an error (AMQP 1.0 §2.7.9, §2.8.14), for a peer
    whose `open` never came: the engine writes its own `open` but holds its
    `close` until the peer's `open` arrives, which after a violation it will not."""
    error = Described(ulong(ERROR), [symbol(condition), description[:512]])
    body = b"\x00\x53\x18" + encode([error])
    return _HEADER.pack(_HEADER.size + len(body), 2, 0, 0) + body


def _body_too_short(size: int, body_at: int) -> bool:
    """A frame with a body too short for a performative's descriptor and code (an
    empty body is a heartbeat, AMQP 1.0 §2.4.5)."""
    return body_at < size < body_at + 3


def _field(fields: list, index: int) -> object:
    return fields[index] if index < len(fields) else None


__all__ = ["DECODE_ERROR", "FRAMING_ERROR", "HANDLE_IN_USE", "NOT_ALLOWED", "FrameGuard", "close_frame"]
