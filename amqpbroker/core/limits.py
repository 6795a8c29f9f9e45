"""Queue limits and what happens when a message meets a full queue.  Pure: no I/O.

A queue may have a limit on the messages it holds (`max_depth`) and on their bytes
(`max_bytes`), set per queue at declare time or by a `[[queue_limits]]` pattern, and
an overflow policy for when it is full:

* `block`: its producers are granted link credit in proportion to the room it has left
  (AMQP 1.0 §2.6.7: credit is how a receiver paces a sender; core/credit.py), shared
  between the producers that feed it, and none while it is full; they are topped up
  when it has room again.  ActiveMQ Artemis's `address-full-policy=BLOCK` paces
  producers with credits the same way (it grants a fixed window, which goes over).
* `reject`: a transfer that would go over is answered `rejected` with
  `amqp:resource-limit-exceeded`; nothing already queued is touched.  RabbitMQ's
  `x-overflow=reject-publish` (a nack under publisher confirms); Artemis's `FAIL`.
* `drop-head`: the oldest ready messages are dead-lettered (when a dead-letter
  address is configured) or dropped until the new one fits.  RabbitMQ's default
  `x-overflow=drop-head`.

What counts (`depth`, `bytes`) is every message the queue holds: ready, scheduled,
paged out, and delivered but not settled yet (Artemis counts an address's size until
acknowledgement; RabbitMQ counts ready messages only).  Only ready messages can be
dropped by `drop-head`.  A limit of 0 is no limit.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .topics import topic_matches


OVERFLOW_REASON = "queue full (overflow drop-head)"   # the dead-letter reason of make_room


class Overflow(str, enum.Enum):
    BLOCK = "block"
    REJECT = "reject"
    DROP_HEAD = "drop-head"


class Admission(enum.Enum):
    ACCEPT = "accept"          # queue it
    REJECT = "reject"          # rejected, amqp:resource-limit-exceeded
    DROP_HEAD = "drop-head"    # drop (or dead-letter) ready messages from the head, then queue it


@dataclass(frozen=True)
class QueueLimits:
    max_depth: int = 0         # messages; 0: no limit
    max_bytes: int = 0         # bytes of message bodies; 0: no limit
    overflow: Overflow = Overflow.BLOCK

    @property
    def limited(self) -> bool:
        return bool(self.max_depth or self.max_bytes)

    def describe(self) -> dict:
        """As the management API shows it (and the store keeps declared limits)."""
        return {"max_depth": self.max_depth, "max_bytes": self.max_bytes,
                "overflow": self.overflow.value}

    @classmethod
    def from_dict(cls, d: dict) -> "QueueLimits":
        """The inverse of `describe`."""
        return cls(int(d.get("max_depth", 0)), int(d.get("max_bytes", 0)), Overflow(d.get("overflow", "block")))


@dataclass(frozen=True)
class LimitRule:
    """A `[[queue_limits]]` entry: the limits of every queue whose name matches."""
    pattern: str               # topic-style on `.` words, as ACL patterns: `*` one word, `#` any
    limits: QueueLimits


def full(limits: QueueLimits, depth: int, size: int) -> bool:
    """At (or beyond) a limit: nothing more fits."""
    return ((limits.max_depth > 0 and depth >= limits.max_depth)
            or (limits.max_bytes > 0 and size >= limits.max_bytes))


def fits(limits: QueueLimits, depth: int, size: int, incoming: int) -> bool:
    """Whether one more message of `incoming` bytes stays within the limits."""
    return ((limits.max_depth <= 0 or depth + 1 <= limits.max_depth)
            and (limits.max_bytes <= 0 or size + incoming <= limits.max_bytes))


def admit(limits: QueueLimits | None, depth: int, size: int, incoming: int) -> Admission:
    """What to do with a message of `incoming` bytes arriving at a queue holding
    `depth` messages of `size` bytes."""
    if limits is None or fits(limits, depth, size, incoming):
        return Admission.ACCEPT
    if limits.overflow is Overflow.REJECT:
        return Admission.REJECT
    if limits.overflow is Overflow.DROP_HEAD:
        if limits.max_bytes > 0 and incoming > limits.max_bytes:
            return Admission.REJECT   # dropping every other message would not make room
        return Admission.DROP_HEAD
    # BLOCK: the producer had credit for it (§2.6.7); credit is where it is held back.
    return Admission.ACCEPT


def fits_batch(limits: QueueLimits, depth: int, size: int, count: int, nbytes: int) -> bool:
    """Whether `count` more messages of `nbytes` in all stay within the limits: what
    `fits` says of each, one after the other (a transaction's commit, all or nothing)."""
    return ((limits.max_depth <= 0 or depth + count <= limits.max_depth)
            and (limits.max_bytes <= 0 or size + nbytes <= limits.max_bytes))


def may_grant(limits: QueueLimits | None, depth: int, size: int) -> bool:
    """Whether a producer to this queue may get more credit."""
    return limits is None or limits.overflow is not Overflow.BLOCK or not full(limits, depth, size)


def limits_for(name: str, rules: Iterable[LimitRule],
               declared: QueueLimits | None = None) -> QueueLimits | None:
    """A queue's limits: those it was declared with, else the first rule whose pattern
    matches its name (config order), else none."""
    if declared is not None:
        return declared if declared.limited else None
    for rule in rules:
        if rule.pattern == "#" or topic_matches(rule.pattern, name):
            return rule.limits if rule.limits.limited else None
    return None


class LimitedQueue:
    """The part of core.queues.Queue that applies its limits (a mixin in its own
    file, as core/paging.py is): it uses the queue's `limits`, `depth`, `bytes`,
    ready list and drop path."""
    __slots__ = ()

    def admission(self, incoming: int) -> Admission:
        """What a message of `incoming` bytes meets here (core/limits.py)."""
        return admit(self.limits, self.depth, self.bytes, incoming)

    def may_grant(self) -> bool:
        """Whether producers to this queue may get more credit (overflow `block`)."""
        limits = self.limits
        return limits is None or may_grant(limits, self.depth, self.bytes)

    def wait_for_room(self, callback: Callable[[Any], None]) -> None:
        """Call `callback(queue)` once, at the next moment this queue may have room for
        a waiting producer: a message leaves it while it is below its limit, its limits
        change, it is deleted, or `notify_room` says so.  Woken by events, never by
        polling; the caller decides again (room may be promised to other producers)."""
        self._room = callback

    def notify_room(self) -> None:
        """Room may have come without a message leaving (a transaction that staged
        messages for this queue was rolled back, a producer holding credit for it went)."""
        self._room_check()

    def set_limits(self, limits: QueueLimits | None, declared: QueueLimits | None) -> None:
        """New limits at run time (a live reload): producers held for room are woken
        at once when the new limits leave some (or none apply any more)."""
        self.limits = limits
        self.declared_limits = declared
        self._room_check()

    def _room_check(self) -> None:
        room = self._room
        if room is not None and (self.deleted or self.may_grant()):
            self._room = None
            room(self)

    def make_room(self, incoming: int) -> int:
        """Overflow `drop-head`: dead-letter (the broker's dead-letter address, if any)
        or drop ready messages from the head until one of `incoming` bytes fits.
        Scheduled and delivered messages are not dropped: with nothing ready the new
        message goes over the limit.  Returns how many were dropped."""
        limits = self.limits
        dropped = 0
        while limits is not None and not fits(limits, self.depth, self.bytes, incoming):
            if not self._ready and self.paged_count:
                self._page_in()
            entry = self._ready.pop_first()
            if entry is None:
                break
            if entry.msg is None and not self._load(entry):
                continue   # unreadable: _load dropped (and counted) it
            self.overflow_dropped_total += 1
            dropped += 1
            if self.dead_letter is not None:
                self.dead_letter(entry, OVERFLOW_REASON)
            self._drop(entry)
        return dropped


__all__ = ["OVERFLOW_REASON", "Admission", "LimitRule", "LimitedQueue", "Overflow", "QueueLimits", "admit", "fits",
           "fits_batch", "full", "limits_for", "may_grant"]
