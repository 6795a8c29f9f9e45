"""The I/O pump: one asyncio Protocol per socket drives a proton Transport.

Bytes in → (SASL handshake, our own state machine) → Transport.push → Collector
events → ConnectionHandler; Transport output → socket.  Timers come from
Transport.tick.  Nothing here decides anything about messages.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from typing import TYPE_CHECKING, Any

from cproton import ffi, lib
from proton import Collector, Connection, Event, Transport

from ..core.entries import held_batch
from ..core.wire import FrameGuard
from ..looptrace import TRACE
from ..security.throttle import source_address
from .input_slices import SlicedInput
from .sasl import Handshake, HandshakeState, SaslCode

if TYPE_CHECKING:
    from .ports import ConnectionServer, ListenerSpec

log = logging.getLogger("amqpbroker.engine")

_PASSWORD_MECHANISMS = frozenset({"PLAIN", "SCRAM-SHA-256"})   # guessable: throttled by user name
_DELIVERY = lib.PN_DELIVERY
_LINK_FLOW = lib.PN_LINK_FLOW
# Engine bookkeeping the broker does not act on.
_SKIPPED = frozenset({
    lib.PN_TRANSPORT, lib.PN_CONNECTION_INIT, lib.PN_CONNECTION_BOUND, lib.PN_CONNECTION_LOCAL_OPEN,
    lib.PN_CONNECTION_LOCAL_CLOSE, lib.PN_SESSION_INIT, lib.PN_SESSION_LOCAL_OPEN,
    lib.PN_SESSION_LOCAL_CLOSE, lib.PN_SESSION_FINAL, lib.PN_LINK_INIT, lib.PN_LINK_LOCAL_OPEN,
    lib.PN_LINK_LOCAL_CLOSE, lib.PN_LINK_LOCAL_DETACH, lib.PN_LINK_FINAL,
})


class OutputHold:
    """When a connection's output may go out, given the store batches that must commit
    first (see AmqpProtocol.hold_for_store).  It waits for the *latest* such batch:
    output held since an earlier turn must not go out when that earlier batch commits
    while a later one is still on its way (a crash then would bring a message the
    consumer saw back as a first delivery)."""

    __slots__ = ("held", "_until")

    def __init__(self) -> None:
        self.held = False
        self._until = -1

    def need(self, batch: int) -> int | None:
        """Output must wait for store batch `batch` (-1: nothing, or one that has
        not settled yet): the batch to wait for, if a new one."""
        if batch < 0 or self._until >= batch:
            return None   # nothing to wait for, or already waiting for it (or a later one)
        self._until = batch
        self.held = True
        return batch

    def committed(self, batch: int) -> bool:
        """Batch `batch` committed (batches commit in order): True when that releases."""
        if batch < self._until:
            return False
        self.held = False
        return True


class AmqpProtocol(SlicedInput, asyncio.Protocol):
    def __init__(self, server: "ConnectionServer", listener: "ListenerSpec"):
        self.server = server
        self.listener = listener
        self.loop = server.loop
        self.sock: asyncio.Transport | None = None
        self.peer = "?"
        self.handshake: Handshake | None = None
        self.user: str | None = None
        self.transport: Transport | None = None
        self.connection: Connection | None = None
        self.collector: Collector | None = None
        self.handler: Any = None
        self.write_paused = False
        self.closed = False
        # Counts what may change the peer's endpoint states (input pushed to the
        # engine, a tick, the socket's end): a consumer that saw its link open at one
        # count need not ask the engine again before the next (LinkConsumer.credit).
        self.input_seq = 0
        self.reads = 0       # socket reads so far (producer credit windows count transfers per read)
        self.read_at = 0.0   # and when the last one was made (the loop's clock)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._timer_remote_idle = 0        # the peer's idle-timeout when the timer was armed
        self._dirty = False
        self._hs_timer: asyncio.TimerHandle | None = None
        self.hold = OutputHold()   # output waits for a store commit (hold_for_store)
        # Sending links that wait until output moves: the engine holds as much of them
        # unsent as it may (server/outbound.py BoundedOutput); the next flush that writes wakes them.
        self.output_waiters: list[Any] = []
        self.guard: FrameGuard | None = None   # protocol checks proton does not make
        self._discard_input = False             # after a protocol violation: closing
        self._last_words = b""                  # a close frame to write after the engine's output
        self.address = "?"                      # the peer's source address (limits, throttling)
        self._handshaking = False               # counted by the server's HandshakeGate
        self._held: bytearray | None = None     # input held while a throttle delay runs
        # Taken at accept by a TLS listener, before the TLS handshake (server/tls.py):
        # adopted here instead of a second admission.
        self.handshake_slot: Any = None
        self._answer_timed = False              # the attempt's user name took its throttle turn
        self._held_answer: bytes | None = None  # a SASL outcome waiting for that turn
        self.events_paused = False              # the open waits for another node (pause_events)
        self._backlog: deque[memoryview] | None = None   # input beyond a turn's slice (_feed)
        self._reading_paused = False

    # ------------------------------------------------------------------ socket events

    def connection_made(self, sock: asyncio.BaseTransport) -> None:
        self.sock = sock  # type: ignore[assignment]
        guard = self.server.guard
        if guard is not None and not guard():   # HA: this broker may not accept now
            self.closed = True
            sock.abort()
            return
        peer = sock.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.address = peer[0] if isinstance(peer, tuple) else source_address(self.peer)
        slot = self.handshake_slot
        if slot is not None:
            refusal = None             # admitted at accept, before TLS
        elif not self.server.resources.may_accept():
            refusal = "file descriptors nearly exhausted"
        else:
            refusal = self.server.handshakes.admit(self.address)
        if refusal is not None:
            self.server.handshake_refused(self.address, refusal)
            self.closed = True
            sock.abort()
            return
        self._handshaking = True
        # The user store in force when the client authenticates, not at accept (a
        # live reload may remove a user meanwhile).
        server = self.server
        self.handshake = Handshake(self.listener.sasl_policy, lambda: server.users, clock=self.loop.time,
                                   external=self.listener.external_identity(sock))
        if slot is not None:
            self.handshake.started_at = slot.accepted_at
        self.server.protocols.add(self)
        # One deadline from accept to the AMQP open: TLS, SASL, the protocol header and
        # the open itself.  Bytes trickling in do not move it.
        deadline = self.handshake.deadline
        self._hs_timer = self.loop.call_at(deadline, self._handshake_timeout) if deadline is not None else None
        # An address whose last authentications failed waits its turn before it is
        # answered (security/throttle.py); other addresses are not slowed.
        delay = self.server.auth_throttle.address_turn(self.address)
        if delay is None:
            self.server.handshake_refused(self.address, "too many authentication attempts from it waiting "
                                                        "(failed authentications)")
            self.closed = True
            sock.abort()
        elif delay > 0:
            self._held = bytearray()   # what arrives meanwhile waits (pause_reading does
            self.loop.call_later(delay, self._release_held)   # not hold before reading starts)

    def _release_held(self) -> None:
        held, self._held = self._held, None
        if held and not self.closed:
            self.data_received(bytes(held))

    def opened(self) -> None:
        """The AMQP open arrived and was answered: the handshake is over."""
        self._end_handshake()

    def _end_handshake(self) -> None:
        if self._hs_timer is not None:
            self._hs_timer.cancel()
            self._hs_timer = None
        if self._handshaking:
            self._handshaking = False
            if self.handshake_slot is not None:
                self.handshake_slot.release()
            else:
                self.server.handshakes.done(self.address)

    def _handshake_timeout(self) -> None:
        """A socket that never reaches `open` must not hold a slot forever."""
        self._hs_timer = None
        if self.closed:
            return
        hs = self.handshake
        if hs is not None and self._held_answer is not None:
            why = "its authentication's answer waited for the throttle past the handshake deadline"
        elif hs is not None:
            if not hs.check_timeout():  # fired a little early: try again at the deadline
                self._hs_timer = self.loop.call_at(hs.deadline + 0.01, self._handshake_timeout)
                return
            out = hs.data_to_send()
            if out:
                self.sock.write(out)
            why = hs.error
        elif self.handler is not None and not self.handler.opened and not self.handler.ended:
            why = "no AMQP open within the handshake timeout"
        else:
            return
        log.warning("connection from %s closed: %s", self.peer, why)
        self.server.handshakes.timed_out_total += 1
        self.closed = True
        self.sock.close()

    def data_received(self, data: bytes) -> None:
        self.reads += 1
        self.read_at = self.loop.time()
        if TRACE is not None:
            TRACE.mark("read", id(self), len(data))
            TRACE.stamps("in", id(self), data)
        if self.closed or self._discard_input:
            return
        guard = self.server.guard
        if guard is not None and not guard():
            return   # HA: this broker may not accept now (ha/node.py): its connections are being closed
        if self._held is not None:     # an authentication throttle delay runs
            if len(self._held) < 65536:
                self._held += data
            return
        if self.handshake is not None:
            self._feed_handshake(data)
        else:
            self._push(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._backlog is not None and not self.closed and not self._discard_input:
            self._feed_all(memoryview(b""))   # what the peer sent before it went
        self.server.protocols.discard(self)
        self.server.resources.connection_closed()
        if self._timer is not None:
            self._timer.cancel()
        self._end_handshake()
        was_closed, self.closed = self.closed, True   # before the engine's events: the socket is gone
        self.input_seq += 1
        if self.transport is not None and not was_closed:
            self.transport.close_tail()
            self._process()
        if self.handler is not None:
            self.handler.socket_closed()
            self.handler.release()
        # No cycle left through this protocol: it and proton's transport (with any
        # partial deliveries it buffered) are freed as soon as nothing refers to them.
        self.handler = None
        self.output_waiters = []
        self.transport = self.connection = self.collector = None
        self.server.flush_soon()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.handler is not None:
            self.handler.writable_again()
            self.mark_dirty()

    # ------------------------------------------------------------------ SASL

    def _feed_handshake(self, data: bytes) -> None:
        hs = self.handshake
        hs.feed(data)
        if hs.outcome is not None and not self._answer_timed and hs.mechanism in _PASSWORD_MECHANISMS:
            # Guesses at one user name from many addresses: the answer (success or
            # not, so its timing tells nothing) waits for the name's turn.
            self._answer_timed = True
            wait = self.server.auth_throttle.user_turn(hs.attempted_user)
            if wait is None:
                hs.refuse(f"too many authentication attempts for user {hs.attempted_user!r} waiting")
            elif wait > 0:
                self._held_answer = hs.data_to_send()
                self._held = bytearray()
                self.loop.call_later(wait, self._release_answer)
                return
        self._answer(hs, hs.data_to_send())

    def _release_answer(self) -> None:
        out, self._held_answer = self._held_answer, None
        held, self._held = self._held, None
        if self.closed or self.handshake is None or out is None:
            return
        self._answer(self.handshake, out)
        if held and not self.closed:
            self.data_received(bytes(held))

    def _answer(self, hs: Handshake, out: bytes) -> None:
        if out:
            self.sock.write(out)
        if hs.state is HandshakeState.FAILED:
            log.warning("connection from %s refused during SASL: %s", self.peer, hs.error)
            self.server.metrics_auth_failures += 1
            if hs.outcome is SaslCode.AUTH:
                self.server.authentication_failed(self.address, hs.attempted_user)
            self.closed = True
            self.sock.close()
        elif hs.state is HandshakeState.DONE:
            self.handshake = None
            if hs.mechanism not in (None, "ANONYMOUS"):
                self.server.auth_throttle.succeeded(self.address, hs.user)
            self.user = hs.user
            self._start_amqp(hs.leftover)
        elif hs.close_after_send:
            self.closed = True
            self.sock.close()

    def _start_amqp(self, leftover: bytes) -> None:

        limits = self.server.settings.limits
        t = Transport(Transport.SERVER)
        t.require_auth(False)  # authentication already happened in our SASL layer
        t.max_frame_size = limits.max_frame_size
        t.channel_max = limits.max_sessions_per_connection - 1
        if limits.idle_timeout:
            t.idle_timeout = limits.idle_timeout
        conn = Connection()
        coll = Collector()
        conn.collect(coll)
        t.bind(conn)
        self.transport, self.connection, self.collector = t, conn, coll
        self.handler = self.server.make_handler(self)   # handlers.ConnectionHandler (app.py)
        self.guard = FrameGuard()
        if leftover:
            self._push(leftover)

    # ------------------------------------------------------------------ proton pump

    def _process(self) -> None:
        """Pop every collector event.  Deliveries and flow (the per-message events)
        go to the handler as raw pointers; engine bookkeeping events are skipped
        without building Python wrappers; the rest are wrapped and dispatched."""
        if self.events_paused:
            return
        coll = self.collector._impl
        handler = self.handler
        peek, pop, etype = lib.pn_collector_peek, lib.pn_collector_pop, lib.pn_event_type
        null = ffi.NULL
        ev = peek(coll)
        if ev == null:
            return   # nothing happened: no flush for this connection
        trace = TRACE
        if trace is not None:
            trace.mark("pump", id(self))
        while ev != null:
            t = etype(ev)
            if trace is not None and t == _DELIVERY:
                trace.mark("dlv", id(self))
            try:
                if t == _DELIVERY:
                    handler.on_delivery_raw(lib.pn_event_delivery(ev))
                elif t == _LINK_FLOW:
                    handler.on_link_flow_raw(lib.pn_event_link(ev))
                elif t not in _SKIPPED:
                    handler.dispatch(Event.wrap(ev))
                    if self.events_paused:   # the open waits (pause_events): the rest waits too
                        pop(coll)
                        break
            except Exception:
                log.exception("connection %s: error handling event %d", self.peer, t)
                handler.internal_error()
            pop(coll)
            ev = peek(coll)
        self.mark_dirty()

    def pause_events(self) -> None:
        """Handle no more engine events until resume_events (the AMQP open waits for
        another node's answer in a cluster: the client's next frames must not be
        handled before it).  Input still goes into the engine, where it waits."""
        self.events_paused = True

    def resume_events(self) -> None:
        self.events_paused = False
        if self.collector is not None:
            self._process()
            self.mark_dirty()

    def stop_reading(self, last_words: bytes = b"") -> None:
        """A protocol violation: read nothing more, close once the output is written
        (followed by `last_words`: a close frame the engine would not send)."""
        self._discard_input = True
        self._last_words = last_words
        self.mark_dirty()

    def mark_dirty(self) -> None:
        if not self._dirty:
            self._dirty = True
            self.server.dirty.append(self)
            self.server.flush_soon()

    def hold_for_store(self, stored_in: int) -> None:
        """A durable delivery went into the transport.  A message a consumer has seen
        must come back after a crash marked redelivered (delivery-count + 1), never as
        a first delivery, so the output stays off the socket until what says so has
        committed.  `stored_in` is the entry's: the current batch when the entry is
        new in it (the LMDB transaction makes entry and mark durable or neither: a
        crash before the commit loses a message no producer was told Accepted for),
        so nothing waits; else the store's decision at hand-over as a hold code
        (core/entries.py; store/durability.py, store/marks.py): nothing when the
        queue's committed delivery watermark covers it, else the batch with its
        watermark or its own mark, or the one still storing the entry."""
        store = self.server.store
        if not store.persistent:
            return
        if stored_in == store.batch:
            return   # the entry and its mark commit together
        wait = held_batch(stored_in)
        if wait < 0 or store.settled(wait):
            return
        batch = self.hold.need(wait)
        if batch is not None:
            store.after_batch(batch, functools.partial(self._store_committed, batch))

    def _store_committed(self, batch: int, error: BaseException | None) -> None:
        if self.hold.committed(batch):
            self.mark_dirty()
            # Consumers got no credit while the output was held (LinkConsumer.credit):
            # their queues go on at the next loop turn, not inside the store's callback.
            self.loop.call_soon(self.writable_again)

    def writable_again(self) -> None:
        if self.handler is not None and not self.closed:
            self.handler.writable_again()

    def flush(self) -> None:
        """Move pending transport output to the socket and re-arm the timer."""
        t = self.transport
        if t is None or self.sock is None or self.hold.held:
            self._dirty = False
            return  # held: _store_committed flushes
        # Raw proton calls (no Python wrapper objects): a flush runs for every
        # connection touched in a loop turn, which at moderate rates is once or twice
        # per message, and the wrappers cost more than the work.  Events our own
        # calls raised are handled while the connection still counts as dirty (it
        # is being flushed now: no second flush for them).
        if lib.pn_collector_peek(self.collector._impl) != ffi.NULL:
            self._process()
        self._dirty = False
        # pending hands out at most one output-buffer's worth (8 KiB at first) per
        # call: loop until the transport has nothing more, or its output has ended.
        impl = t._impl
        pending = lib.pn_transport_pending(impl)
        if pending > 0 and self.output_waiters:
            self._wake_output_waiters()
        while pending > 0:
            buf = bytearray(pending)
            n = lib.pn_transport_peek(impl, ffi.from_buffer(buf), pending)
            if n < 0:
                pending = n
                break
            lib.pn_transport_pop(impl, pending)
            if not self.closed:
                self.sock.write(buf)
                if TRACE is not None:
                    TRACE.mark("write", id(self), len(buf))
                    TRACE.stamps("out", id(self), buf)
            pending = lib.pn_transport_pending(impl)
        handler = self.handler
        if handler is not None and handler.free_after_output:
            handler.output_written()   # links whose last dispositions just went out
        if (pending < 0 or self._discard_input) and not self.closed:
            # Output side finished (close frame sent, or a transport error), or a
            # protocol violation: whatever the engine would still say has been written
            # (it sends no close before the peer's open, which will not come now:
            # the handler gave that close as last words).
            if self._discard_input and self._last_words:
                self.sock.write(self._last_words)
            self.closed = True
            self.sock.close()
            return
        if not self.closed:
            self._arm_timer()

    def _wake_output_waiters(self) -> None:
        """Output moves: the links waiting for it look again, at the next loop turn."""
        waiters, self.output_waiters = self.output_waiters, []
        call_soon = self.loop.call_soon
        for link in waiters:
            call_soon(link.output_moved)

    def _arm_timer(self) -> None:
        """Keep a timer for the transport's next deadline (idle-timeout frames and
        checks, AMQP 1.0 §2.4.5).  Traffic only moves deadlines later, so a timer
        already armed stays: when it fires early, `_on_timer` ticks, and the flush
        that follows arms the next one.  No tick per flush.  The exception is the
        peer's open: its idle-timeout asks for frames from us sooner than any
        deadline known before, so a change of it re-arms."""
        impl = self.transport._impl
        remote_idle = lib.pn_transport_get_remote_idle_timeout(impl)
        if self._timer is not None:
            if remote_idle == self._timer_remote_idle:
                return
            self._timer.cancel()
            self._timer = None
        self._timer_remote_idle = remote_idle
        # pn_transport_tick takes and returns milliseconds (0: no deadline).
        deadline = lib.pn_transport_tick(impl, int(self.loop.time() * 1000)) / 1000
        if deadline <= 0:
            return
        self._timer_at = deadline
        self._timer = self.loop.call_at(deadline, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if TRACE is not None:
            TRACE.mark("timer", id(self))
        if self.closed or self.transport is None:
            return
        self.input_seq += 1
        self.transport.tick(self.loop.time())
        self._process()
        self.mark_dirty()   # a tick writes heartbeats without raising events

    def abort(self) -> None:
        """Drop the socket without a close handshake (shutdown after the grace period)."""
        self.closed = True
        if self.sock is not None:
            self.sock.abort()
