"""What a sending link may leave in the protocol engine unsent.  Pure: numbers in,
numbers out (server/links.py and server/sequence.py apply them).

The engine writes a delivery out only while the peer's session incoming window is
open (AMQP 1.0 §2.5.6), and a peer may keep that window closed, or open it a transfer
at a time, while it grants link credit in the millions (§2.6.7 and §2.5.6 are
separate permissions).  Link credit alone would then let the broker copy a whole
queue into the engine's buffers (134 MB seen from one consumer whose session window
stayed closed).  So what a link hands over is bounded by what the engine still holds
unsent, beside its credit:

* one link's deliveries not written yet: LINK_DELIVERIES at most;
* one session's payload bytes not written yet: SESSION_BYTES at most.

Both are above what a loop turn hands a link when the peer keeps up (a dispatch
slice: 256 deliveries or 4 MiB, core/queues.py): a consumer that reads never waits
on them.  Past either, the link hands over nothing until the connection's output
moves, then looks again.

Looking costs two calls into the engine, so a link does not look before every
delivery: after each look it may hand over a `budget` without looking, counted as
payload bytes plus DELIVERY_COST a delivery (so at most LINK_DELIVERIES x
DELIVERY_COST, 512 KiB, between two looks).  A dispatch run reads a link's credit
once for a run of entries, so the bounds may be passed by one run, a dispatch slice
at most.
"""

from __future__ import annotations

LINK_DELIVERIES = 1024        # deliveries of one link the engine may hold unsent
SESSION_BYTES = 8 << 20       # payload bytes of one session the engine may hold unsent
DELIVERY_COST = 512           # what a delivery counts for besides its payload (the engine's record of it)


def budget(link_unsent: int, session_unsent_bytes: int) -> int:
    """What a link may hand the engine before it looks again, counted as payload bytes
    plus DELIVERY_COST a delivery, given what the engine holds unsent: the link's
    deliveries, its session's payload bytes.  0: nothing, wait for the output to move."""
    by_link = (LINK_DELIVERIES - link_unsent) * DELIVERY_COST
    by_session = SESSION_BYTES - session_unsent_bytes
    return max(0, min(by_link, by_session))


def cost(payload_size: int) -> int:
    """What one delivery of `payload_size` bytes takes from a budget."""
    return payload_size + DELIVERY_COST


__all__ = ["DELIVERY_COST", "LINK_DELIVERIES", "SESSION_BYTES", "budget", "cost"]
