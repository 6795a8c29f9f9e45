"""Producer credit: whether a transfer came beyond the credit granted, how many more
messages a `block` queue has room for, and how much of that room one producer may be
granted.  Pure: numbers in, numbers out (server/flow.py and server/producers.py apply them).

**Credit is a promise the peer may break** (AMQP 1.0 §2.6.7: "it is illegal to send
more messages" than link-credit allows).  proton counts a receiving link's credit down
for every transfer that arrives, below zero when the peer ignores it, but does not
refuse anything; the broker checks each delivery it takes off a link (`beyond_credit`)
and ends the link with `amqp:link:transfer-limit-exceeded` (a link error, §2.8.16) at
the first one beyond.  The broker never lowers credit it has granted (it only withholds
more), so a transfer beyond it is always the peer's fault, never a race with a flow.
proton counts a transfer against the credit when the broker takes it, not when it
arrives: so no credit is granted while transfers beyond it are already here (they
would look sent within it), and the first of them is found when it is taken.
A producer's *outstanding* credit is what proton counts as its credit: granted and
not taken yet, which includes the transfers that arrived but are not taken yet.

**Credit in proportion to room** (`overflow = "block"`, core/limits.py).  A block
queue's room is what it may still take: its limit, minus what it holds, minus what
open transactions have staged for it (`room`).  The producers whose target reaches it
share that room as credit (`share`): each may hold at most an even share of it (one
share kept for whoever comes next), and all of them together never more than the room,
counting the outstanding credit each already holds.  So producers with a
target never take a block queue over `max_depth`; credit a producer holds but does not
use is room the others wait for.  A bytes limit is turned into messages with the size
expected of one message; with none known yet, one message at a time.
"""

from __future__ import annotations

from .limits import Overflow, QueueLimits


def beyond_credit(credit_left: int) -> bool:
    """Whether a delivery came beyond the credit granted.  `credit_left`: the link's
    credit as proton counts it on a receiving link, not counting this delivery (proton
    counts a delivery when the broker moves past it: granted minus taken), so the
    delivery is the first beyond when nothing was left for it."""
    return credit_left <= 0


def room(limits: QueueLimits | None, depth: int, size: int, staged: int = 0, staged_bytes: int = 0,
         message_size: int = 0) -> int | None:
    """How many more messages a queue takes before its `block` limit, counting what
    open transactions staged for it; None when it has no block limit (credit is none of
    its business).  `message_size`: the bytes one message is expected to take, for a
    bytes limit (0: unknown, then one at a time).  Like `limits.full`, a bytes limit
    with any room left takes one more message, whatever it weighs."""
    if limits is None or limits.overflow is not Overflow.BLOCK or not limits.limited:
        return None
    messages = None
    if limits.max_depth > 0:
        messages = max(0, limits.max_depth - depth - staged)
    if limits.max_bytes > 0:
        free = limits.max_bytes - size - staged_bytes
        if free <= 0:
            by_bytes = 0
        elif message_size <= 0:
            by_bytes = 1
        else:
            by_bytes = -(-free // message_size)   # the last may go over, as `full` allows
        messages = by_bytes if messages is None else min(messages, by_bytes)
    return messages


def share(room_left: int, reserved_by_others: int, producers: int, window: int) -> int:
    """The credit one of `producers` feeding a block queue may hold: an even share of
    the room between them and one more (rounded up: the room is never all promised to
    the producers that asked first, so one that comes next, or a relay transfer, finds
    some; a lone producer is given half of what is left at a time), no more than what
    the other producers' outstanding credit leaves of the room, and no more than its
    window (`limits.link_credit`)."""
    if room_left <= 0:
        return 0
    even = -(-room_left // (max(producers, 1) + 1))
    return max(0, min(window, even, room_left - reserved_by_others))


def top_up_below(target: int) -> int:
    """Top a producer up once its credit falls below half of what it was last allowed
    (AMQP 1.0 §2.6.7 leaves the policy to the receiver): one flow per half window, and
    after every transfer when it was allowed one."""
    return max(1, (target + 1) // 2)


__all__ = ["beyond_credit", "room", "share", "top_up_below"]
