"""High availability: the decisions of a replicated primary/backup pair (docs/ha.md).

Pure: no sockets, no ZooKeeper client, no clock (times are passed in).  The I/O
lives in amqpbroker/ha/ (the ZooKeeper session, the replication stream, the
backup's applier); each of its choices is one call here.

Who is live is decided by one ephemeral ZooKeeper node (the lock recipe without a
queue: create-if-absent), and *whether a broker may become live at all* by an
activation sequence kept both in ZooKeeper and in each broker's store, as
ActiveMQ Artemis' pluggable quorum does (its "activation sequence").  Every
activation and every decision of a live broker to go on without its backup
raises the sequence in ZooKeeper first (a compare-and-set on the node's
version) and then in its own store.  A store whose sequence is behind
ZooKeeper's missed something that was accepted, so its broker must not become
live: it becomes a backup and copies the live one.  One exception keeps a crash
between the two writes from leaving no broker eligible: the broker that raised
ZooKeeper's sequence (its `owner`) may activate with a store one behind it.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass


class Role(str, enum.Enum):
    """`[ha] role`: which broker of the pair tries to become live first."""
    PRIMARY = "primary"   # takes the lock at start when its store is eligible
    BACKUP = "backup"     # waits for a live broker to copy before it ever takes the lock
    AUTO = "auto"         # as primary: whoever comes first is live


# ------------------------------------------------------------------ activation sequence

@dataclass(frozen=True)
class Activation:
    """ZooKeeper's activation sequence and the node that set it (0, "": none yet)."""
    seq: int = 0
    owner: str = ""

    def encode(self) -> bytes:
        return f"{self.seq} {self.owner}".encode()

    @classmethod
    def decode(cls, data: bytes | None) -> "Activation":
        """Anything unreadable counts as no activation at all would be unsafe (a stale
        store could then activate): it raises ValueError, and the I/O refuses to act."""
        if not data:
            return cls()
        seq, _, owner = data.decode().partition(" ")
        return cls(int(seq), owner)

    def next_by(self, node_id: str) -> "Activation":
        return Activation(self.seq + 1, node_id)


@dataclass(frozen=True)
class Eligibility:
    ok: bool
    reason: str


def may_activate(stored_seq: int, complete: bool, current: Activation, node_id: str) -> Eligibility:
    """Whether a broker whose store holds activation `stored_seq` may become live while
    ZooKeeper holds `current`.  `complete`: the store is not a copy interrupted half
    way (a backup's resynchronisation that did not finish)."""
    if not complete:
        return Eligibility(False, "the store is an unfinished copy of the live broker's")
    if stored_seq == current.seq:
        return Eligibility(True, f"the store is at the current activation {current.seq}")
    if current.owner == node_id and stored_seq == current.seq - 1:
        # This broker raised ZooKeeper's sequence and stopped before its store did.
        return Eligibility(True, f"this node raised the activation to {current.seq} last")
    if stored_seq > current.seq:
        return Eligibility(False, f"the store's activation {stored_seq} is ahead of ZooKeeper's "
                                  f"{current.seq} (ZooKeeper's data was reset?)")
    return Eligibility(False, f"the store's activation {stored_seq} is behind ZooKeeper's {current.seq}: "
                              f"another broker was live since")


def contends(role: Role, eligible: Eligibility, current: Activation) -> bool:
    """Whether to try for the live lock now.  A backup never starts a fresh cluster
    (nothing was ever live: it waits for its primary, so the pair does not race)."""
    if not eligible.ok:
        return False
    return role is not Role.BACKUP or current.seq > 0


# ------------------------------------------------------------------ the ZooKeeper session

class SessionVerdict(str, enum.Enum):
    OK = "ok"          # connected: accept as usual
    HOLD = "hold"      # connection lost, the session may live on: tell no producer Accepted
    FENCED = "fenced"  # the session is (or may be) gone and the lock with it: stop accepting


def session_verdict(state: str, suspended_since: float | None, now: float, session_timeout: float) -> SessionVerdict:
    """What a live broker does with its ZooKeeper session's state (kazoo's CONNECTED /
    SUSPENDED / LOST).  While SUSPENDED the server may still keep the session; once
    a session timeout has passed without hearing from it, the backup may have taken
    the lock (ZooKeeper expired it), so this broker must act as if it had lost it
    (the ZooKeeper programmer's guide: a client cut off cannot learn of its expiry)."""
    if state == "LOST":
        return SessionVerdict.FENCED
    if state == "SUSPENDED":
        if suspended_since is not None and now - suspended_since >= session_timeout:
            return SessionVerdict.FENCED
        return SessionVerdict.HOLD
    return SessionVerdict.OK


# ------------------------------------------------------------------ the backup, seen from the live broker

class PeerState(str, enum.Enum):
    ABSENT = "absent"        # no backup connected; nothing waits for one
    SYNCING = "syncing"      # copying the store, then catching up; nothing waits for it yet
    CATCHING = "catching"    # caught up with what was handed over at attach: commits wait for it
    IN_SYNC = "in-sync"      # has everything ever acknowledged: may take over
    LOST = "lost"            # was waited for and went away (or stopped answering): commits wait
    ALONE = "alone"          # the live broker raised the activation and goes on without it


GATED = (PeerState.CATCHING, PeerState.IN_SYNC, PeerState.LOST)


class ReplicaTracker:
    """The live broker's view of its backup: which store batches were sent and
    acknowledged, up to which batch commit callbacks may run (`gate`), and when to
    stop waiting for it.

    Synchronous replication (Artemis' replication, "sync" mode): a batch's callbacks
    (producers' Accepted, durable subscription attach replies, discharges) run only
    once the local commit *and* the backup's are in.  A backup that connects is first
    brought up to date without being waited for (SYNCING: the store copy, then the
    batches since); once it has acknowledged every batch handed over when it
    attached, commits wait for it (CATCHING), and once it holds everything ever
    settled it is told so and may take over (IN_SYNC)."""

    def __init__(self, synchronous: bool = True, timeout: float = 5.0):
        self.synchronous = synchronous
        self.timeout = timeout
        self.state = PeerState.ABSENT
        self.sent: deque[tuple[int, float]] = deque()   # (batch number, when sent), unacknowledged
        self.last_sent = -1
        self.acked = -1
        self.boundary = -1          # last batch handed over when the backup attached
        self.eligible_at = -1       # settled when commits began to wait: the backup needs this much
        self.released = -1          # highest batch number whose callbacks the gate let run
        self.held = False           # the ZooKeeper session is in doubt (SessionVerdict.HOLD)
        self.lost_at: float | None = None
        self.alone_total = 0        # times the live broker went on without its backup

    # ---- the stream
    def attach(self, first_unsettled: int, last_handed_over: int) -> None:
        """A backup connected.  Batches from `first_unsettled` on are sent after the
        store copy (the copy may or may not hold them: replaying them is harmless)."""
        self.state = PeerState.SYNCING
        self.sent.clear()
        self.last_sent = first_unsettled - 1
        self.acked = first_unsettled - 1
        self.boundary = last_handed_over
        self.lost_at = None

    def should_send(self, number: int) -> bool:
        """Each batch once, in order (a writer replay frames some again)."""
        return self.state in (PeerState.SYNCING, PeerState.CATCHING, PeerState.IN_SYNC) and number > self.last_sent

    def sent_batch(self, number: int, now: float) -> None:
        self.last_sent = number
        self.sent.append((number, now))

    def on_ack(self, number: int, now: float = 0.0) -> bool:
        """The backup committed every batch up to `number` (the first ack, after it
        installed the store copy, may repeat what the copy holds).  True when it has
        just become IN_SYNC (the I/O tells it: it may take over from now on)."""
        if number < self.acked or self.state not in (PeerState.SYNCING, PeerState.CATCHING, PeerState.IN_SYNC):
            return False
        self.acked = number
        sent = self.sent
        while sent and sent[0][0] <= number:
            sent.popleft()
        if self.state is PeerState.SYNCING and number >= self.boundary:
            self.state = PeerState.CATCHING
            # Batches queued while the copy went out count from now, not from when queued.
            self.sent = deque((n, now) for n, _ in sent)
            # What was settled before commits began to wait for it: the backup needs
            # that much before it may take over (afterwards the gate keeps it ahead).
            self.eligible_at = self.released if self.synchronous else number
        if self.state is PeerState.CATCHING and number >= self.eligible_at:
            self.state = PeerState.IN_SYNC
            return True
        return False

    def detach(self, now: float) -> None:
        """The backup's connection ended.  One that commits were waiting for is LOST:
        they go on waiting until the timeout (it may only be slow to reconnect, and
        going on alone needs the activation raised first)."""
        self.sent.clear()
        if self.state in GATED and self.synchronous:
            self.state = PeerState.LOST
            self.lost_at = now
        elif self.state is not PeerState.ALONE:
            self.state = PeerState.ABSENT

    # ---- decisions
    def gate(self, local_committed: int) -> int:
        """The highest batch number whose callbacks may run now."""
        if self.held:
            return self.released
        if self.synchronous and self.state in GATED:
            limit = min(local_committed, self.acked)
        else:
            limit = local_committed
        if limit > self.released:
            self.released = limit
        return self.released

    def due_alone(self, now: float) -> bool:
        """Commits wait for a backup that is gone, or whose oldest unacknowledged batch
        is older than the timeout: time to go on without it (after raising the
        activation sequence, so that it can never take over with what it has)."""
        if not self.synchronous:
            return self.state in (PeerState.CATCHING, PeerState.IN_SYNC) and bool(self.sent) \
                and now - self.sent[0][1] >= self.timeout
        if self.state is PeerState.LOST:
            return self.lost_at is not None and now - self.lost_at >= self.timeout
        if self.state in (PeerState.CATCHING, PeerState.IN_SYNC) and self.sent:
            return now - self.sent[0][1] >= self.timeout
        return False

    def went_alone(self) -> None:
        """The activation was raised: commits stop waiting for the backup."""
        self.state = PeerState.ALONE
        self.sent.clear()
        self.lost_at = None
        self.alone_total += 1

    def lag(self, now: float) -> tuple[int, float]:
        """(batches sent and not acknowledged, age of the oldest in seconds)."""
        if not self.sent:
            return 0, 0.0
        return len(self.sent), now - self.sent[0][1]
