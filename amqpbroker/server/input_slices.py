"""A connection's input, a slice per loop turn (the part of AmqpProtocol that feeds the
engine, server/engine.py).

One socket read can carry hundreds of transfers (a client with a backlog, a burst it
was given credit for).  Handled at once, the first message of it would wait for the
last before anything is written, and every other connection for all of them.  So at
most INPUT_SLICE bytes of one connection go into the engine per loop turn; the rest
waits, with the socket's reading paused, for a later turn.  The frame guard
(core/wire.py) reads each slice as its turn comes, for the same reason.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from cproton import ffi, lib

# Bytes of one connection's input handled per loop turn before its output (and
# every other connection) gets a turn: ~50 transfers of 256 B, well under a ms.
INPUT_SLICE = 16 * 1024

log = logging.getLogger("amqpbroker.engine")


class SlicedInput:
    """Mixed into AmqpProtocol: the attributes named here are its own (transport,
    guard, handler, server, sock, loop, _backlog, _reading_paused, _discard_input ...)."""

    transport: Any
    guard: Any
    handler: Any
    server: Any
    sock: Any
    loop: Any
    closed: bool
    input_seq: int
    _backlog: "deque[memoryview] | None"
    _reading_paused: bool
    _discard_input: bool
    _dirty: bool

    def _push(self, data: bytes) -> None:
        self.server.resources.bytes_moved(len(data))
        if self._backlog is not None:   # earlier input waits for its turn: this goes behind it
            self._backlog.append(memoryview(data))
            return
        rest, _ = self._feed(memoryview(data), INPUT_SLICE)
        if rest is not None and not self._discard_input:
            self._defer_input(deque((rest,)))

    def _feed(self, view: memoryview, budget: int) -> tuple[memoryview | None, int]:
        """Push bytes into the engine and handle what they raise, until `budget` bytes
        went in: (what is left of `view`, or None; the budget left).  A slice at a
        time: a burst read in one go (hundreds of transfers) would otherwise all be
        handled before the flush writes anything, so its first message would wait
        for the last, and every other connection for all of them."""
        # Raw proton calls, as in flush: no copy of the bytes, no wrapper objects.
        impl = self.transport._impl
        rest = None
        while view:
            if budget <= 0:
                rest = view
                break
            capacity = lib.pn_transport_capacity(impl)
            if capacity < 0:
                break  # input side closed: ignore the rest
            if capacity == 0:
                self._process()
                if lib.pn_transport_capacity(impl) <= 0:
                    break
                continue
            take = min(capacity, budget)
            chunk, view = view[:take], view[take:]
            budget -= take
            # The frame guard reads each slice as its turn comes (not a whole socket
            # read at once: 256 KiB of empty frames is ~6 ms of Python, which every
            # other connection would wait for).
            guard = self.guard
            if guard is not None:
                problem = guard.feed(chunk)
                if problem is not None:
                    self._violation(chunk[:guard.violation_at], problem)
                    return None, 0
            self.input_seq += 1
            n = lib.pn_transport_push(impl, ffi.from_buffer(chunk), len(chunk))
            if n != len(chunk):   # proton refused the bytes: a framing error
                why = ffi.string(lib.pn_error_text(lib.pn_transport_error(impl))).decode(errors="replace")
                log.warning("connection %s: transport error: [%d]: %s", self.peer, n, why)
                break
            self._process()
        self._process()   # after a break: what the bytes before it raised
        # Input that raised no event (an empty frame, a heartbeat) may still leave
        # engine output (a session's window, AMQP 1.0 §2.5.6) or an ended transport.
        if not self._dirty and lib.pn_transport_pending(impl) != 0:
            self.mark_dirty()
        return rest, budget

    def _violation(self, good: memoryview, problem: tuple[str, str]) -> None:
        """The frame guard found a violation: the engine gets the frames before the
        offending one (`good`: it must have seen the AMQP header to answer at all),
        then nothing more."""
        self.guard = None
        self._backlog = None
        self._feed(good, len(good))
        if self.handler is not None and not self.handler.ended:
            self.handler.protocol_violation(*problem)
            self._process()
        else:
            self.stop_reading()   # ended already: nothing more is read, the socket closes

    def _feed_all(self, view: memoryview) -> None:
        """Whatever input still waits, then `view`, all at once (the socket is going,
        or a protocol violation follows these bytes)."""
        backlog, self._backlog = self._backlog, None
        for part in (*(backlog or ()), view):
            if self.transport is None or self._discard_input:
                return
            self._feed(part, len(part))

    def _defer_input(self, backlog: deque) -> None:
        """Input beyond this turn's slice waits for the next turn (the flush that
        is due runs first); the socket is not read meanwhile."""
        self._backlog = backlog
        self.loop.call_soon(self._more_input)
        if not self._reading_paused:
            self._reading_paused = True
            try:
                self.sock.pause_reading()
            except (AttributeError, RuntimeError):
                pass   # a closing transport: nothing more comes anyway

    def _more_input(self) -> None:
        backlog, self._backlog = self._backlog, None
        if backlog is None:
            return
        if self.closed or self.transport is None or self._discard_input:
            return
        guard = self.server.guard
        if guard is not None and not guard():
            return   # HA: read before the fence, handled after it: dropped, as new input is
        budget = INPUT_SLICE
        while backlog:
            rest, budget = self._feed(backlog.popleft(), budget)
            if rest is not None:
                backlog.appendleft(rest)
                self._defer_input(backlog)
                return
            if self.transport is None or self._discard_input:
                return
        if self._reading_paused and not self.closed:
            self._reading_paused = False
            try:
                self.sock.resume_reading()
            except (AttributeError, RuntimeError):
                pass
