"""Moving waiting messages from one queue to another address: `replay` of a
dead-letter queue (each message back to the address its origin annotation names,
core/deadletters.py) and the general `move`.  Pure: no I/O.

A `Move` advances one slice per call (`step`), which the caller runs once per loop
turn: bounded work, as dispatch does (docs/architecture.md "Bounded work per loop
turn").  Each message moves atomically: its copy is published to the destination
first, and only when some queue took it is the source entry removed (core/waiting.py
take_waiting); both writes land in the loop turn's store batch, which commits whole
or not at all (store/batch.py), so a crash leaves it on one side, never both or
neither.  A copy routed nowhere leaves the message where it was.

Only waiting messages move (ready, and those of the paged region): a message a
consumer holds is not the queue's to give away (its outcome is still to come), and
a scheduled one waits for its time.

No self-feeding loops (core/history.py): a move only examines what its source held
when it started (it takes a sequence number as its bound: whatever arrives later,
its own copies included, is above it), and a copy never goes back into its source
(an exchange bound back to it), nor, for a replay, into the dead-letter queue it
came from: the copy carries a history record naming the queue, the reason
(`moved` / `replayed`) and the operation (`op`), and the routing leaves out the
queues the history names for this reason and operation.  A move can be cancelled
between slices (`cancel`); its report counts what it examined of `total`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

from . import history
from .broker import QueueLimit
from .addresses import AddressKind, AddressNotFound, Resolution
from .deadletters import AnnotationError, history_of, mark_moved, origin
from .message import APPLICATION_PROPERTIES, MalformedMessage, Message, selector_lookup
from .queues import Queue
from .selectors import TURN_BUDGET, SelectorBudgetExceeded, spent

SLICE = 256                # messages examined per step (one loop turn)
SLICE_BYTES = 4 << 20      # … or this many bytes moved, or TURN_BUDGET selector steps spent


class MoveRefused(ValueError):
    """The move cannot start (no such destination, the source itself)."""


@dataclass
class MoveReport:
    """What a move did, as the management API shows it."""
    queue: str
    total: int = 0                                   # waiting in the source when it started
    moved: int = 0
    examined: int = 0
    skipped: int = 0                                 # left in place (see `reasons`)
    destinations: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, int] = field(default_factory=dict)
    stopped: str | None = None                       # why it ended before the queue's end

    def skip(self, why: str) -> None:
        self.skipped += 1
        self.reasons[why] = self.reasons.get(why, 0) + 1

    def view(self) -> dict:
        return {"queue": self.queue, "total": self.total, "moved": self.moved, "examined": self.examined,
                "skipped": self.skipped, "destinations": dict(self.destinations),
                "skip_reasons": dict(self.reasons), "stopped": self.stopped}


_ops = itertools.count(1)


class Move:
    """One move in progress.  `to`: the destination address (None: each message's
    dead-letter origin, a replay); `replay` also takes the dead-letter annotations out
    and gives the message a fresh delivery-count (below); `selector`: a compiled JMS
    selector; `limit`: at most this many moved (0: all); `permit(address)`: whether
    the requester may send there (a dead-letter origin is whatever the message says);
    `op`: the operation's name in the copies' history (a job id)."""

    def __init__(self, broker: Any, queue: Queue, *, to: str | None, replay: bool,
                 selector: Any = None, limit: int = 0, permit: Callable[[str], bool] | None = None,
                 op: str | None = None):
        self.broker = broker
        self.permit = permit     # may the requester send there (management: `manage` on it)
        self.queue = queue
        self.to = to
        self.replay = replay
        self.selector = selector
        self.limit = limit
        self.op = op or f"{'replay' if replay else 'move'}-{next(_ops)}"
        self.reason = history.REPLAYED if replay else history.MOVED
        self.cursor = 0
        self.done = False
        self.report = MoveReport(queue.name, total=queue.depth - queue.acquired)
        self._targets: dict[str, Resolution | str] = {}
        # The bound: every entry that arrives from now on (our copies included) has a
        # higher sequence number than this one, taken now.
        self.until = queue.next_seq()
        if to is not None:
            target = self._resolve(to, explicit=True)
            if isinstance(target, str):
                raise MoveRefused(target)

    def cancel(self, why: str = "cancelled") -> None:
        """Stop before the next slice (what moved stays moved)."""
        if not self.done:
            self.done = True
            self.report.stopped = why

    def step(self) -> bool:
        """Move up to one slice; True when the move is over."""
        if self.done or self.queue.deleted:
            self.done = True
            return True
        room = SLICE_BYTES
        started = spent()       # selector steps: at most TURN_BUDGET a slice (and one evaluation)
        batch = self.queue.waiting_after(self.cursor, SLICE)
        if not batch or batch[0][0].seq > self.until:
            self.done = True
        for entry, state in batch:
            if entry.seq > self.until or (self.limit and self.report.moved >= self.limit):
                self.done = True
                break
            self.cursor = entry.seq
            room -= self._one(entry, state)
            if self.done or room <= 0 or spent() - started > TURN_BUDGET:
                break
        return self.done

    def _one(self, entry: Any, state: str) -> int:
        """Move one entry if it is chosen; the bytes moved."""
        report = self.report
        report.examined += 1
        msg = self.queue.peek_body(entry)
        if msg is None:
            report.skip("unreadable")
            return 0
        try:
            if self.selector is not None and not selects(self.selector, msg, entry.delivery_count):
                return 0
        except SelectorBudgetExceeded as exc:
            self.cancel(f"message seq={entry.seq}: {exc}")
            return 0
        address = self.to if self.to is not None else self._origin_address(msg)
        if address is None:
            report.skip("no dead-letter origin")
            return 0
        if self.permit is not None and not self.permit(address):
            report.skip(f"not allowed to manage {address}")
            return 0
        target = self._resolve(address, explicit=self.to is not None)
        if isinstance(target, str):
            report.skip(target)
            return 0
        try:
            raw = self._payload(entry, msg)
            copy = Message(raw, publisher=msg.publisher)
            avoid = history.excluded(history_of(raw), self.reason, self.op)
            if not [q for q in self.broker.destinations(copy, target) if q.name not in avoid]:
                report.skip(f"routed back into queue {self.queue.name} only" if self.queue.name in avoid
                            else f"routed nowhere from {address}")
                return 0
            routed = self.broker.publish(copy, target, exclude=avoid)
        except (MalformedMessage, AnnotationError):
            report.skip("unreadable")
            return 0
        except AddressNotFound as exc:
            report.skip(f"destination gone: {exc.why}")
            return 0
        except QueueLimit as exc:   # a full destination with overflow reject
            report.stopped = str(exc)
            self.done = True
            return 0
        if not routed:
            report.skip(f"routed nowhere from {address}")
            return 0
        self.queue.take_waiting(entry, state)
        report.moved += 1
        report.destinations[address] = report.destinations.get(address, 0) + 1
        return copy.size

    def _origin_address(self, msg: Message) -> str | None:
        try:
            return origin(msg.annotations)[1] if msg.has_section(0x72) else None
        except MalformedMessage:
            return None

    def _payload(self, entry: Any, msg: Message) -> bytes:
        """The bytes the copy carries, with one more history record (core/deadletters.py
        mark_moved).  A replay takes out the annotations and properties the
        dead-lettering added and sets delivery-count 0 (§3.2.1): the message is given
        its attempts again, or a queue with max_delivery_attempts would dead-letter it
        again at its first failure.  A move keeps the count (JMSRedelivered stays
        true for a message that was delivered)."""
        raw = msg.encoded(0 if self.replay else entry.delivery_count)
        return mark_moved(raw, self.queue.name, self.op, int(self.broker.clock() * 1000), replay=self.replay)

    def _resolve(self, address: str, *, explicit: bool) -> Resolution | str:
        """The destination of `address`, or why there is none.  An explicit `to` must
        exist (a typo must not create a queue); a recorded origin may name a queue that
        was deleted since, created again as an AMQP address would be."""
        known = self._targets.get(address)
        if known is not None:
            return known
        try:
            target: Resolution | str = self.broker.resolve(address)
        except AddressNotFound as exc:
            target = f"no destination {address}: {exc.why}"
        else:
            if target.kind is AddressKind.NEW_QUEUE and explicit:
                target = f"no queue or exchange '{address}'"
            elif target.kind is AddressKind.QUEUE and target.name == self.queue.name:
                target = f"destination {address} is the queue itself"
        self._targets[address] = target
        return target


def compile_filter(text: str | None, max_length: int) -> Any:
    """A JMS selector (JMS 2.0 §3.8.1) for a move or a browse; None for none.
    Raises ValueError with the selector's own message when it is longer than
    `max_length` (limits.max_selector_length, as on an AMQP attach) or does not compile."""
    if text is None or not text.strip():
        return None
    from .selectors import SelectorError, check_length, compile_selector
    try:
        check_length(text, max_length)
        return compile_selector(text)
    except SelectorError as exc:
        raise ValueError(f"bad selector: {exc}") from None


def selects(selector: Any, msg: Message, delivery_count: int) -> bool:
    """Whether the selector accepts the message, as core/message.py selector_accepts
    decides, except that an evaluation over its budget raises
    SelectorBudgetExceeded: an operator's browse or move says so instead of skipping."""
    try:
        if msg.has_section(APPLICATION_PROPERTIES):
            msg.application_properties   # one that does not decode fails every selector
        return selector.matches(selector_lookup(msg, delivery_count))
    except SelectorBudgetExceeded:
        raise
    except (MalformedMessage, TypeError, ValueError, ArithmeticError, RecursionError):
        return False

