"""Clients that play peers the broker must not trust, or must answer exactly, on
`RawClient` (a real proton engine over a socket the test drives):

* `CreditLiar`: a sender whose engine is told it has far more link credit than the
  broker granted.  Every `flow` frame the broker sends is rewritten on its way in
  (link-credit raised to `LIE`), so proton's own sender sends beyond the broker's
  credit: the transfers on the wire are exactly those of a peer that ignores credit
  (AMQP 1.0 §2.6.7).
* `DispositionLog`: records, in wire order, every `disposition` frame the broker
  sends (first, last, settled, outcome descriptor), so a test can check the order in
  which a session's deliveries were settled.
* `WindowCloser`: a client whose sessions' incoming window stays closed (AMQP 1.0
  §2.5.6) whatever link credit it grants: the incoming-window of every `begin` and
  `flow` it sends is rewritten to 0 on its way out, until `open_window` sends one
  session-level flow (no handle, as rhea does) that opens it.
"""

from __future__ import annotations

import struct
from typing import Any

from proton import Data, Described, uint, ulong

from tests.e2e.helpers_conn import RawClient, amqp_frame

BEGIN = 0x11
ATTACH = 0x12
FLOW = 0x13
TRANSFER = 0x14
DISPOSITION = 0x15
LIE = 1_000_000   # the link-credit the liar's engine is told it has


def _performative(body: bytes) -> tuple[Any, int]:
    """The performative at the start of a frame body, and how many bytes it took."""
    data = Data()
    used = data.decode(body)
    data.rewind()
    data.next()
    return data.get_object(), used


def _encode(performative: Described) -> bytes:
    data = Data()
    data.put_object(performative)
    return data.encode()


class FrameTap:
    """Splits the bytes a client receives into frames (protocol headers pass as they
    are) and lets a hook rewrite or note each AMQP frame's performative."""

    def __init__(self) -> None:
        self.buf = b""

    def feed(self, data: bytes, hook: Any) -> bytes:
        self.buf += data
        out = []
        while True:
            buf = self.buf
            if buf.startswith(b"AMQP"):
                if len(buf) < 8:
                    break
                out.append(buf[:8])
                self.buf = buf[8:]
                continue
            if len(buf) < 8:
                break
            size, doff, ftype, channel = struct.unpack(">IBBH", buf[:8])
            if len(buf) < size:
                break
            frame, self.buf = buf[:size], buf[size:]
            body = frame[doff * 4:]
            if ftype == 0 and body:
                performative, used = _performative(body)
                replaced = hook(channel, performative)
                if replaced is not None:
                    new_body = _encode(replaced) + body[used:]
                    frame = struct.pack(">IBBH", 8 + len(new_body), 2, 0, channel) + new_body
            out.append(frame)
        return b"".join(out)


def _code(performative: Any) -> int | None:
    if isinstance(performative, Described):
        return int(performative.descriptor)
    return None


class CreditLiar(RawClient):
    """A sender that believes it has `LIE` credit on every link."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.tap = FrameTap()
        self.flows_seen = 0
        self.granted: dict[int, int] = {}   # handle → the link-credit the broker really sent last

    def _lie(self, channel: int, performative: Any) -> Any:
        if _code(performative) != FLOW:
            return None
        fields = list(performative.value) + [None] * 11
        if fields[4] is None:       # a session-level flow: nothing to lie about
            return None
        self.flows_seen += 1
        self.granted[int(fields[4])] = int(fields[6] or 0)
        fields[6] = uint(LIE)
        while fields and fields[-1] is None:
            fields.pop()
        return Described(ulong(FLOW), fields)

    def _push(self, data: bytes) -> None:
        super()._push(self.tap.feed(data, self._lie))


class DeliveryCountRewinder(CreditLiar):
    """A CreditLiar that can also send a `flow` of its own moving its sender
    delivery-count back (AMQP 1.0 §2.6.7 lets only the sender change it, and only
    forward).  proton's receiving side adds the unsigned difference to the link's
    credit: a broker that trusted proton's count would take that many transfers more."""

    def rewind(self, transfers_sent: int, back: int, handle: int = 0, channel: int = 0) -> None:
        """A flow for link `handle` whose delivery-count is `back` behind the
        `transfers_sent` it sent on it (its first session, sending only)."""
        from tests.e2e.helpers_conn import amqp_frame
        self.pump(0)
        frame = amqp_frame(channel, FLOW, [uint(0), uint(2147483647), uint(transfers_sent), uint(2147483647),
                                           uint(handle), uint((transfers_sent - back) % (1 << 32)), uint(0)])
        self.sock.setblocking(True)
        try:
            self.sock.sendall(frame)
        finally:
            self.sock.setblocking(False)


class _TappedSocket:
    """The client's socket, with what it sends shown to a FrameTap on the way out."""

    def __init__(self, sock: Any, tap: FrameTap, hook: Any):
        self._sock, self._tap, self._hook = sock, tap, hook

    def send(self, data: bytes) -> int:
        n = self._sock.send(data)
        self._tap.feed(bytes(data[:n]), self._hook)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class DispositionLog(RawClient):
    """Notes the broker's dispositions in the order they come off the wire, and the
    client's own attaches and transfers (delivery-id → handle, tag) as they go out."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.tap = FrameTap()
        self.dispositions: list[tuple[int, int, bool, int | None]] = []   # (first, last, settled, outcome)
        self.transfers: dict[int, tuple[int, bytes]] = {}
        self.link_names: dict[int, str] = {}
        self.sock = _TappedSocket(self.sock, FrameTap(), self._note_out)

    def _note_out(self, channel: int, performative: Any) -> None:
        code = _code(performative)
        if code == ATTACH:
            fields = list(performative.value)
            self.link_names[int(fields[1])] = str(fields[0])
        elif code == TRANSFER:
            fields = list(performative.value) + [None] * 3
            if fields[1] is not None:   # the first frame of a delivery
                self.transfers[int(fields[1])] = (int(fields[0]), bytes(fields[2]))
        return None

    def _note(self, channel: int, performative: Any) -> None:
        if _code(performative) == DISPOSITION:
            fields = list(performative.value) + [None] * 6
            first = int(fields[1])
            last = int(fields[2]) if fields[2] is not None else first
            state = fields[4]
            outcome = int(state.descriptor) if isinstance(state, Described) else None
            self.dispositions.append((first, last, bool(fields[3]), outcome))
        return None

    def _push(self, data: bytes) -> None:
        super()._push(self.tap.feed(data, self._note))


class _RewritingSocket:
    """The client's socket, with what it sends rewritten by a FrameTap hook on the way
    out (whole frames only; the engine's output is small control frames here)."""

    def __init__(self, sock: Any, hook: Any):
        self._sock, self._tap, self._hook = sock, FrameTap(), hook

    def send(self, data: bytes) -> int:
        out = self._tap.feed(bytes(data), self._hook)
        self._sock.setblocking(True)
        try:
            self._sock.sendall(out)
        finally:
            self._sock.setblocking(False)
        return len(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class WindowCloser(RawClient):
    """A receiver whose session incoming window stays closed until `open_window`."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.window_closed = True
        self.sock = _RewritingSocket(self.sock, self._close_window)

    def _close_window(self, channel: int, performative: Any) -> Any:
        code = _code(performative)
        if not self.window_closed or code not in (BEGIN, FLOW):
            return None
        fields = list(performative.value)
        fields[2 if code == BEGIN else 1] = uint(0)     # begin / flow incoming-window
        return Described(ulong(code), fields)

    def open_window(self, channel: int = 0, window: int = 2**31 - 1) -> None:
        """Open the window of the session on `channel` with a session-level flow (no
        handle: no link event at the broker), the client's own engine untouched: it
        has received nothing and sent no transfer, so both ids are 0."""
        self.pump(0)                      # whatever the engine had to say goes first
        self.window_closed = False
        frame = amqp_frame(channel, FLOW, [uint(0), uint(window), uint(0), uint(window)])
        self.sock.send(frame)


__all__ = ["CreditLiar", "DispositionLog", "FrameTap", "LIE", "WindowCloser"]
