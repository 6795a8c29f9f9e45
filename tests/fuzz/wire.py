"""Running mutants against the broker: one socket per mutant, many at a time.

A case sends its frames turn by turn: the client's turns of the captured
conversation.  After a turn the broker answers when the conversation is replayed
unmutated (`calibrate`), the next goes once it has, or after `TURN_WAIT`; after
one that went unanswered, the rest go at once.  Then a *probe*: a `begin` on a
channel nothing else uses.  The verdict, at most `VERDICT_WAIT` after the last
byte went out:

* ``closed:<condition>``: a `close` frame carrying that error condition came;
* ``closed:no-condition``: a `close` frame without one;
* ``dropped``: the socket closed (or was reset) without any `close` frame;
* ``sasl:<code>`` / ``header-refused``: refused before AMQP (a sasl-outcome that is
  not ok, or a protocol header in answer to a wrong one, then the socket closed);
* ``usable``: the probe was answered (a `begin` naming the probe's channel);
* ``hung``: none of these: a failure;
* ``connect-failed:<errno>``: the broker did not accept the connection.

Before the probe the runner pads a frame left incomplete (a size field that lies
upwards, a stream cut short) with zero bytes up to its declared size, when that
size is within the broker's limit (`framing`), so that the broker always has
whole frames and must decide: waiting for more would be right only while a frame
is incomplete, and none is.
"""

from __future__ import annotations

import errno
import selectors
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from proton import uint

from amqpbroker.config import LimitsConfig
from amqpbroker.core import codec

from .corpus import (
    AMQP_HEADER,
    BEGIN,
    CLOSE,
    CONTAINER_ID,
    QUEUE,
    SASL_HEADER,
    frame_bytes,
)
from .mutators import PROBE_CHANNEL, Mutant

TURN_WAIT = 0.3       # seconds a turn waits for the broker's answer before the next goes anyway
VERDICT_WAIT = 1.0    # seconds after the last byte within which the broker must decide
QUEUES = 1000         # queues the cases' conversations use, in turn
MAX_FRAME = LimitsConfig().max_frame_size    # the broker's default, what the test broker runs with
SASL_MAX_FRAME = 64 * 1024                   # server/sasl_frames.MAX_SASL_FRAME_SIZE

PROBE = frame_bytes(b"\x00\x53\x11" + codec.encode([None, uint(0), uint(100), uint(100)]), PROBE_CHANNEL)


# --------------------------------------------------------------------------- framing as the broker sees it


class Framing(NamedTuple):
    tail: int | None      # bytes the broker still waits for; None: it must refuse the stream
    why: str
    first: int | None     # the first performative after the AMQP header (open, if all is well)


def framing(stream: bytes) -> Framing:
    """How the broker frames `stream`: the bytes it still waits for to complete
    a frame (0: the stream ends on a frame boundary), or None when it must refuse
    the stream before its end (a protocol header that is not ours, a size over
    the limit, a data offset below 2 or past the frame's end, SASL that does not
    succeed), so there is nothing to complete.  `why` is "bad-doff-waits" for a
    frame header that is wrong from its first 8 bytes (data offset) but declares
    more bytes than follow it: proton checks the size first and waits for them."""
    off, n = 0, len(stream)
    phase = "sasl-header"
    first = None
    while True:
        left = n - off
        if phase in ("sasl-header", "amqp-header"):
            expected = SASL_HEADER if phase == "sasl-header" else AMQP_HEADER
            if left == 0:
                return Framing(0, "ok", first)
            if not expected.startswith(stream[off:off + 8]):
                return Framing(None, "bad-header", first)
            if left < 8:
                return Framing(8 - left, "short-header", first)
            off += 8
            phase = "sasl" if phase == "sasl-header" else "amqp"
            continue
        if left == 0:
            return Framing(0, "ok", first)
        if left < 8:
            return Framing(8 - left, "short-frame-header", first)
        size, doff = struct.unpack_from(">IB", stream, off)
        limit = SASL_MAX_FRAME if phase == "sasl" else MAX_FRAME
        if size > limit:
            return Framing(None, "size-over-limit", first)
        if doff < 2 or doff * 4 > size:
            return Framing(None, "bad-doff-waits" if size > left else "bad-doff", first)
        if left < size:
            return Framing(size - left, "short-frame", first)
        body = stream[off + doff * 4:off + size]
        if phase == "sasl" and body:
            if body[:3] != b"\x00\x53\x41":
                return Framing(None, "not-sasl-init", first)      # the handshake fails
            phase = "amqp-header"
        elif phase == "amqp" and body and first is None:
            first = body[2] if body[:2] == b"\x00\x53" and len(body) > 2 else -1
        off += size


def padding(stream: bytes) -> Framing:
    """Zero bytes enough to complete whatever frame the stream ends inside (a
    completed header may declare a body, which needs completing too)."""
    pad = 0
    while True:
        f = framing(stream + b"\x00" * pad)
        if not f.tail:
            return Framing(pad, f.why if not pad else f"padded {pad}: {f.why}", f.first)
        pad += f.tail


# --------------------------------------------------------------------------- cases


@dataclass
class Case:
    number: int
    kind: str
    note: str
    turns: list[bytes] = field(repr=False)
    tail: int | None                  # zero bytes padded after the mutant (padding())
    framing: str = ""                 # how the broker frames the mutant's bytes
    first: int | None = None          # the first performative after the AMQP header
    waits: list[bool] = field(default_factory=list, repr=False)     # wait for an answer after turn i
    turn_ids: list[int] = field(default_factory=list, repr=False)   # the conversation's turn each came from
    answered: list[int] = field(default_factory=list, repr=False)   # turns the broker answered
    keep_pacing: bool = False         # wait after every turn even when one went unanswered
    # filled in by the runner
    outcome: str = ""
    local_port: int = 0
    started: float = 0.0
    sent_at: float = 0.0
    finished: float = 0.0
    received: bytes = field(default=b"", repr=False)
    replies: Replies | None = field(default=None, repr=False)
    undecodable: int = 0              # frames the broker sent that do not decode
    log_from: int = 0
    log_to: int = 0

    @property
    def payload(self) -> bytes:
        return b"".join(self.turns)


def case_from(number: int, mutant: Mutant, answered: dict[str, set[int]] | None = None) -> Case:
    """A case sends the mutant's frames turn by turn, then pads and probes.  The
    container-id is made unique, so that cases never steal each other's links,
    and the queue one of QUEUES (same lengths: no size field changes).
    `answered`: the turns of each conversation the broker answers (`calibrate`);
    None: wait after every turn."""
    container = f"fuzz-client-{number:06d}".encode()
    queue = f"fuzz.q.{number % QUEUES:06d}".encode()
    turns: list[bytes] = []
    ids: list[int] = []
    for f in mutant.frames:
        raw = f.raw.replace(CONTAINER_ID.encode(), container).replace(QUEUE.encode(), queue)
        if not ids or f.turn != ids[-1]:
            turns.append(b"")
            ids.append(f.turn)
        turns[-1] += raw
    pad = padding(b"".join(turns))
    turns.append(b"\x00" * pad.tail + PROBE)
    ids.append(-1)
    first = framing(b"".join(turns)).first      # the probe included: it may be the first
    known = answered.get(mutant.conversation) if answered is not None else None
    waits = [known is None or t in known for t in ids]
    return Case(number, mutant.kind, mutant.note, turns, pad.tail, pad.why, first, waits, ids)


def calibrate(port: int, conversations) -> dict[str, set[int]]:
    """Which turns of each (unmutated, close left out) conversation the broker
    answers: a mutant waits after those only."""
    answered: dict[str, set[int]] = {}
    for conv in conversations:
        case = case_from(0, Mutant("calibration", conv.without_close().frames, conv.name, conv.name))
        case.keep_pacing = True
        run_cases(port, [case], parallel=1, on_done=lambda c: None)
        if case.outcome != "usable":
            raise AssertionError(f"conversation {conv.name} replayed unmutated: {case.outcome}")
        answered[conv.name] = {case.turn_ids[i] for i in case.answered}
    return answered


# --------------------------------------------------------------------------- what the broker says


class Replies:
    """The broker's byte stream, parsed as it arrives."""

    def __init__(self) -> None:
        self.buf = b""
        self.off = 0
        self.frames = 0
        self.close_condition: str | None = None     # "" for a close without one
        self.sasl_code: int | None = None
        self.headers = 0
        self.header_last = False    # the last thing the broker sent was a protocol header
        self.probe_answered = False
        self.undecodable = 0                        # frames from the broker we could not read
        self.echoed = 0     # ... because they carry the peer's own invalid text back (a refused link's name)
        self.performatives: Counter[int] = Counter()     # AMQP performatives received, by code

    def feed(self, data: bytes) -> None:
        self.buf += data
        while True:
            left = len(self.buf) - self.off
            if left >= 8 and self.buf.startswith(b"AMQP", self.off):
                self.headers += 1
                self.header_last = True
                self.off += 8
                continue
            if left < 8:
                return
            size, doff, ftype = struct.unpack_from(">IBB", self.buf, self.off)
            if left < size:
                return
            body = self.buf[self.off + doff * 4:self.off + size]
            self.off += size
            self.frames += 1
            self.header_last = False
            if body:
                self._frame(ftype, body)

    def _frame(self, ftype: int, body: bytes) -> None:
        try:
            perf, _ = codec.decode(body)
            code = int(perf.descriptor)
            fields = list(perf.value or [])
        except codec.DecodeError as exc:
            if "utf-8" in str(exc) or "ascii" in str(exc):
                self.echoed += 1
            else:
                self.undecodable += 1
            return
        except (AttributeError, TypeError, ValueError):
            self.undecodable += 1
            return
        if ftype == 0:
            self.performatives[code] += 1
        if ftype == 1 and code == 0x44:
            self.sasl_code = int(fields[0])
        elif ftype == 0 and code == CLOSE:
            err = fields[0] if fields else None
            self.close_condition = str(err.value[0]) if err is not None else ""
        elif ftype == 0 and code == BEGIN and fields and fields[0] == PROBE_CHANNEL:
            self.probe_answered = True


# --------------------------------------------------------------------------- the runner


@dataclass
class _Conn:
    case: Case
    sock: socket.socket
    replies: Replies = field(default_factory=Replies)
    turn: int = -1
    out: bytes = b""
    waiting_since: float | None = None     # a turn's answer is awaited
    frames_before: int = 0
    pacing: bool = True                    # False once a turn went unanswered
    connected: bool = False


def _verdict(r: Replies, eof: bool) -> str | None:
    if r.close_condition is not None:
        return f"closed:{r.close_condition or 'no-condition'}"
    if r.sasl_code not in (None, 0) and eof:
        return f"sasl:{r.sasl_code}"
    if eof and r.header_last:
        return "header-refused"       # a protocol header in answer (§2.2), then the socket closed
    if eof:
        return "dropped"
    if r.probe_answered:
        return "usable"
    return None


def run_cases(port: int, cases: Iterable[Case], *, parallel: int, on_done: Callable[[Case], None],
              log_position: Callable[[], int] = lambda: 0, stop: Callable[[], bool] = lambda: False) -> None:
    """Run every case, `parallel` sockets at a time, on this thread."""
    sel = selectors.DefaultSelector()
    todo = iter(cases)
    live: dict[int, _Conn] = {}

    def start(case: Case) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setblocking(False)
        case.started = time.monotonic()
        case.log_from = log_position()
        err = s.connect_ex(("127.0.0.1", port))
        c = _Conn(case, s)
        if err not in (0, errno.EINPROGRESS):
            live[s.fileno()] = c
            sel.register(s, selectors.EVENT_READ, c)
            finish(c, f"connect-failed:{errno.errorcode.get(err, err)}")
            return
        live[s.fileno()] = c
        sel.register(s, selectors.EVENT_WRITE | selectors.EVENT_READ, c)

    def finish(c: _Conn, outcome: str) -> None:
        case = c.case
        case.outcome = outcome
        case.finished = time.monotonic()
        case.received = c.replies.buf
        case.replies = c.replies
        case.undecodable = c.replies.undecodable
        case.log_to = log_position()
        sel.unregister(c.sock)
        del live[c.sock.fileno()]
        c.sock.close()
        on_done(case)

    def next_turn(c: _Conn, now: float) -> None:
        c.turn += 1
        c.out += c.case.turns[c.turn]
        c.waiting_since = None

    def pump(c: _Conn, now: float, readable: bool, writable: bool) -> None:
        case = c.case
        eof = False
        if writable and not c.connected:
            err = c.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:        # refused, or timed out: the broker is gone or has stopped accepting
                finish(c, f"connect-failed:{errno.errorcode.get(err, err)}")
                return
            c.connected = True
            case.local_port = c.sock.getsockname()[1]
            next_turn(c, now)
        if readable:
            try:
                data = c.sock.recv(65536)
                if data:
                    c.replies.feed(data)
                else:
                    eof = True
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                eof = True
        if c.connected and c.out and not eof:
            try:
                n = c.sock.send(c.out)
                c.out = c.out[n:]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:        # the broker closed: it will show as EOF
                eof = True
        last = c.turn == len(case.turns) - 1
        if c.connected and not c.out and not eof:
            if last and not case.sent_at:
                case.sent_at = now
            elif not last:
                if c.waiting_since is None and c.pacing and case.waits[c.turn]:
                    c.waiting_since, c.frames_before = now, c.replies.frames
                elif c.waiting_since is None or c.replies.frames > c.frames_before:
                    if c.waiting_since is not None:
                        case.answered.append(c.turn)
                    next_turn(c, now)
                elif now - c.waiting_since > TURN_WAIT:
                    c.pacing = case.keep_pacing     # else: off its rails, no more waits
                    next_turn(c, now)
        verdict = _verdict(c.replies, eof)
        if verdict is None and case.sent_at and now - case.sent_at > VERDICT_WAIT:
            verdict = "hung"
        if verdict is not None:
            finish(c, verdict)
        else:
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if c.out or not c.connected else 0)
            sel.modify(c.sock, events, c)

    while True:
        while len(live) < parallel and not stop():
            case = next(todo, None)
            if case is None:
                break
            start(case)
        if not live:
            break
        ready = sel.select(0.01)
        now = time.monotonic()
        seen = set()
        for key, mask in ready:
            c = key.data
            seen.add(id(c))
            pump(c, now, bool(mask & selectors.EVENT_READ), bool(mask & selectors.EVENT_WRITE))
        for c in list(live.values()):      # timers: turn waits and verdict deadlines
            if id(c) not in seen:
                pump(c, now, False, False)
    sel.close()


def converse(port: int, turns: list[bytes], note: str = "") -> Case:
    """One connection: the given turns (the first starts with the protocol
    headers), then the probe; the case with its verdict (regression tests)."""
    pad = padding(b"".join(turns))
    turns = list(turns) + [b"\x00" * pad.tail + PROBE]
    case = Case(0, "regression", note, turns, pad.tail, pad.why, framing(b"".join(turns)).first,
                [True] * len(turns), list(range(len(turns))))
    run_cases(port, [case], parallel=1, on_done=lambda c: None)
    return case


__all__ = ["PROBE", "TURN_WAIT", "VERDICT_WAIT", "Case", "Replies", "calibrate", "case_from", "converse",
           "framing", "padding", "run_cases"]
