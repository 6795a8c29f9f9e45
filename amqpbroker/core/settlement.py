"""What happens to deliveries a consumer still holds when its link goes away.

Pure rules, no I/O (server/links.py and server/handlers.py apply them).

**Why a normal end does not count.**  The source's default outcome (AMQP 1.0 §3.5.3)
is for deliveries "that have not reached a terminal state ... when the transfer is
settled, including when the source is destroyed".  Qpid JMS sets it to
`modified(delivery-failed)`, yet a normal detach, end or close does not destroy the
delivery state: dispositions name delivery-ids on the *session* (§2.7.6), so the peer
can still settle a detached link's deliveries, and Qpid JMS does exactly that: it
accepts what the application consumed, sends `detach`, and only after the broker's
detach releases its prefetch (shared/notes/qpid-jms-wire.md).  A prefetched message
the application never saw has not failed, so every normal ending (detach, end, close,
and the broker ending a link itself) puts unsettled deliveries back *released*: same
delivery-count, first in line again (ActiveMQ Artemis does the same on a consumer's
close).  Explicit outcomes sent before the ending count as they always do (§3.4).

Only a connection lost without a close (socket error, heartbeat timeout, a killed
client) counts them as failed attempts: the application may have processed them and
died before it could settle (§3.4.5 modified, delivery-failed), so they come back with
delivery-count + 1 (JMSRedelivered).

**Late outcomes.**  A disposition that arrives after the link ended (Qpid JMS's
`released` above) is honoured as far as it still can be: the entry went back to its
queue at the ending, so `released` changes nothing, `modified(delivery-failed)` counts
the failed attempt once, and `accepted` / `rejected` take the entry out only while it
is still waiting in the queue (if another consumer holds it by then, that consumer's
outcome decides).
"""

from __future__ import annotations

import enum


class Outcome(str, enum.Enum):
    """The terminal delivery states a consumer can choose (AMQP 1.0 §3.4)."""

    ACCEPTED = "accepted"
    RELEASED = "released"
    MODIFIED = "modified"
    REJECTED = "rejected"


class LinkEnding(str, enum.Enum):
    """How a consumer link stopped (AMQP 1.0 §2.6.4 detach, §2.6.6 close, §2.5.2 end,
    §2.4.3 connection close)."""

    DETACHED = "detached"                    # the peer detached or closed the link
    SESSION_ENDED = "session-ended"          # the peer ended the link's session
    CONNECTION_CLOSED = "connection-closed"  # the peer closed the connection
    BROKER_ENDED = "broker-ended"            # stolen (§2.6.1), refused late, limits
    CONNECTION_LOST = "connection-lost"      # no close: socket error, idle timeout


def counts_as_failed(ending: LinkEnding) -> bool:
    """Whether the unsettled deliveries of a consumer that ended this way count as a
    failed delivery attempt (delivery-count + 1) when they go back to their queue."""
    return ending is LinkEnding.CONNECTION_LOST


class Place(str, enum.Enum):
    """Where an entry that went back at a link's ending is when a late outcome arrives."""

    WAITING = "waiting"      # in its queue's ready list
    ACQUIRED = "acquired"    # handed to another consumer since
    GONE = "gone"            # consumed, expired, dead-lettered or purged since


class LateAction(str, enum.Enum):
    NOTHING = "nothing"
    COUNT = "count"              # one more failed delivery attempt
    CONSUME = "consume"          # take it out as consumed
    DEAD_LETTER = "dead-letter"  # take it out as rejected


def late_outcome(outcome: Outcome, delivery_failed: bool, place: Place) -> LateAction:
    """The action for an outcome the peer sent for a delivery of a link that has
    ended since; the entry went back to its queue (released) at the ending."""
    if place is Place.GONE:
        return LateAction.NOTHING
    if outcome is Outcome.MODIFIED:
        return LateAction.COUNT if delivery_failed else LateAction.NOTHING
    if place is not Place.WAITING:
        return LateAction.NOTHING   # another consumer holds it: its outcome decides
    if outcome is Outcome.ACCEPTED:
        return LateAction.CONSUME
    if outcome is Outcome.REJECTED:
        return LateAction.DEAD_LETTER
    return LateAction.NOTHING       # released: it went back released already


__all__ = ["Outcome", "LinkEnding", "counts_as_failed", "Place", "LateAction", "late_outcome"]
