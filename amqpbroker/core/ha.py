"""High availability: the decisions of a replicated primary/backup pair (docs/ha.md).

Pure: no sockets, no ZooKeeper client, no clock (times are passed in).  The I/O
lives in amqpbroker/ha/ (the ZooKeeper session, the replication stream, the
backup's applier); each of its choices is one call here.  Three state machines,
each a table with a row per transition (tests/core/test_ha.py has a test per row):

* `REPLICA_TABLE`: the live broker's view of its backup (ReplicaTracker) — when
  commits wait for the backup, when the activation must be raised first;
* `LIVE_TABLE`: the live broker's own right to accept (its ZooKeeper session, its
  lease, a pause) — when to fence, re-validate, open again, or step down;
* `SESSION_TABLE`: what a ZooKeeper session state means for a node of the pair.

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
    ZooKeeper holds `current`.  `complete`: the store is not a copy or a catch-up in
    progress (a backup marks its store incomplete before it attaches to a live
    broker, and complete again only once the live broker says it is in sync)."""
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

class Session(str, enum.Enum):
    """A node's ZooKeeper session as kazoo reports it (plus CONNECTING: never connected yet)."""
    CONNECTING = "CONNECTING"   # no session yet (ZooKeeper unreachable at start): kazoo keeps trying
    CONNECTED = "CONNECTED"
    SUSPENDED = "SUSPENDED"     # the connection is lost; the session may live on at the server
    LOST = "LOST"               # the session expired (or was closed): a new one is made on reconnect


# ------------------------------------------------------------------ the live broker's right to accept

class LiveState(str, enum.Enum):
    OPEN = "open"               # accepting: the AMQP listener is open, an accept window runs
    FENCED = "fenced"           # accepting nothing: waiting for ZooKeeper
    VALIDATING = "validating"   # ZooKeeper answers: checking the lock and the activation again
    DEMOTED = "demoted"         # the lock is gone: stop the broker, become the backup


class LiveEvent(str, enum.Enum):
    SUSPENDED = "suspended"             # the ZooKeeper connection is lost (the session may live)
    CONNECTED = "connected"             # connected again, the same session
    EXPIRED = "expired"                 # the session is gone, and the lock with it
    LEASE_EXPIRED = "lease-expired"     # no ZooKeeper round trip vouches for the session any more
    PAUSED = "paused"                   # the process slept past the session timeout (SIGSTOP, a stall)
    RAISE_FAILED = "raise-failed"       # going on alone: ZooKeeper did not answer the raise
    VALID = "valid"                     # the lock is this session's and the activation unchanged
    INVALID = "invalid"                 # the lock is another's, or the activation moved: someone else is live


class Fence(str, enum.Enum):
    NONE = "none"
    CLOSE = "close"     # close every connection with amqp:connection:forced (the lease still holds)
    ABORT = "abort"     # drop every socket, write nothing (the lease may be over)


@dataclass(frozen=True)
class LiveStep:
    state: LiveState
    fence: Fence = Fence.NONE
    validate: bool = False    # ask ZooKeeper: the lock, the activation (→ VALID / INVALID / SUSPENDED)
    reopen: bool = False      # open the listener again: a new accept window


O, F, V, D = LiveState.OPEN, LiveState.FENCED, LiveState.VALIDATING, LiveState.DEMOTED
E = LiveEvent

# A live broker accepts only in OPEN.  The moment ZooKeeper is in doubt it stops
# (a lost connection: the session may expire a session timeout after the server
# last heard from it, and the backup takes over then); it opens again only once
# ZooKeeper confirmed, over the same session, that the lock is still its own and
# nobody raised the activation.
LIVE_TABLE: dict[tuple[LiveState, LiveEvent], LiveStep] = {
    (O, E.SUSPENDED): LiveStep(F, Fence.CLOSE),
    (O, E.LEASE_EXPIRED): LiveStep(V, Fence.ABORT, validate=True),
    (O, E.PAUSED): LiveStep(V, Fence.ABORT, validate=True),
    (O, E.RAISE_FAILED): LiveStep(V, Fence.CLOSE, validate=True),
    (O, E.EXPIRED): LiveStep(D, Fence.ABORT),
    (O, E.INVALID): LiveStep(D, Fence.ABORT),
    (O, E.CONNECTED): LiveStep(O),
    (O, E.VALID): LiveStep(O),                  # a lease renewal
    (F, E.CONNECTED): LiveStep(V, validate=True),
    (F, E.SUSPENDED): LiveStep(F),
    (F, E.LEASE_EXPIRED): LiveStep(F),
    (F, E.PAUSED): LiveStep(F),
    (F, E.RAISE_FAILED): LiveStep(F),
    (F, E.EXPIRED): LiveStep(D),
    (F, E.VALID): LiveStep(F),                  # an answer from before the connection was lost again
    (F, E.INVALID): LiveStep(D),
    (V, E.VALID): LiveStep(O, reopen=True),
    (V, E.INVALID): LiveStep(D),
    (V, E.SUSPENDED): LiveStep(F),
    (V, E.EXPIRED): LiveStep(D),
    (V, E.CONNECTED): LiveStep(V),
    (V, E.LEASE_EXPIRED): LiveStep(V),
    (V, E.PAUSED): LiveStep(V),
    (V, E.RAISE_FAILED): LiveStep(V),
}
for _event in LiveEvent:
    LIVE_TABLE[(D, _event)] = LiveStep(D)
del O, F, V, D, E



@dataclass(frozen=True)
class SessionMeaning:
    may_look: bool           # ZooKeeper can be asked now (who is live, the activation, the lock)
    live_event: LiveEvent    # what the change means to a live broker (LIVE_TABLE)
    backup: str              # what a backup does (it never exits for it: docs/ha.md)


SESSION_TABLE: dict[Session, SessionMeaning] = {
    Session.CONNECTING: SessionMeaning(False, LiveEvent.SUSPENDED,
                                       "keeps replicating; cannot take over until connected"),
    Session.CONNECTED: SessionMeaning(True, LiveEvent.CONNECTED, "looks at ZooKeeper again: may take over"),
    Session.SUSPENDED: SessionMeaning(False, LiveEvent.SUSPENDED,
                                      "keeps replicating; cannot take over until connected again"),
    Session.LOST: SessionMeaning(False, LiveEvent.EXPIRED,
                                 "keeps replicating; a new session is made on reconnect (nothing of it was "
                                 "held: a backup holds no lock)"),
}


# ------------------------------------------------------------------ the lease

LEASE_SHARE = 2 / 3      # of the session timeout: what one ZooKeeper round trip vouches for
RENEW_SHARE = 1 / 6      # of the session timeout: how often the live broker asks ZooKeeper


@dataclass
class Lease:
    """How long the live broker may go on accepting on the strength of ZooKeeper's
    last answer.  The server expires a session no earlier than a session timeout
    after it last heard from the client, and it heard from us no earlier than we
    sent the request it answered: so a request sent at `sent_at` and answered
    proves the session (and the lock) live until sent_at + session timeout.  The
    lease ends a third of that earlier (as kazoo's own read timeout does), which
    leaves the backup no way to be live before this broker stopped."""
    session_timeout: float
    until: float = 0.0

    @property
    def length(self) -> float:
        return self.session_timeout * LEASE_SHARE

    @property
    def renew_every(self) -> float:
        return self.session_timeout * RENEW_SHARE

    def renewed(self, sent_at: float) -> None:
        self.until = max(self.until, sent_at + self.length)

    def valid(self, now: float) -> bool:
        return now < self.until

    def paused(self, gap: float) -> bool:
        """A gap between two looks at the clock that long: the process was stopped (or
        starved) past the session timeout, the session may be gone (docs/ha.md)."""
        return gap >= self.session_timeout


class LiveFence:
    """A live broker's right to accept: LIVE_TABLE's state, the lease, and the clock
    as last looked at.  `check(now)` is called before any input is read and any
    output written (the I/O's guard) and by a timer: the first look after a pause
    or past the lease fences, before a socket is read."""

    def __init__(self, session_timeout: float, now: float):
        self.state = LiveState.OPEN
        self.lease = Lease(session_timeout)
        self.last_look = now
        self.last_ok = now        # the last look that found accepting allowed (an accept window's end)

    def on(self, event: LiveEvent) -> LiveStep:
        row = LIVE_TABLE[(self.state, event)]
        self.state = row.state
        return row

    def check(self, now: float) -> LiveEvent | None:
        """None: accepting is allowed now.  Otherwise why not (PAUSED, LEASE_EXPIRED),
        to be applied with `on` (only in OPEN: other states accept nothing anyway)."""
        gap, self.last_look = now - self.last_look, now
        if self.lease.paused(gap):
            return LiveEvent.PAUSED
        if not self.lease.valid(now):
            return LiveEvent.LEASE_EXPIRED
        self.last_ok = now
        return None

    def fence_style(self, row: LiveStep, now: float) -> Fence:
        """A polite close writes what the connections have pending: only while the
        lease holds; past it, sockets are dropped with nothing written."""
        if row.fence is Fence.CLOSE and not self.lease.valid(now):
            return Fence.ABORT
        return row.fence


# ------------------------------------------------------------------ the backup, seen from the live broker

class PeerState(str, enum.Enum):
    ALONE = "alone"          # no backup in sync, and the activation sequence says so: commits go on alone
    SYNCING = "syncing"      # a backup copies / catches up (its store marked incomplete); not waited for
    CATCHING = "catching"    # it has what was handed over when it attached: commits wait for it now
    IN_SYNC = "in-sync"      # it has everything ever acknowledged: it may take over; commits wait for it
    LOST = "lost"            # an in-sync backup went away or stopped answering: commits wait (raise first)


class PeerEvent(str, enum.Enum):
    ATTACH = "attach"        # a backup proved the secret, marked its store incomplete and said where it is
    ACK = "ack"              # the backup committed every batch up to a number
    DETACH = "detach"        # its connection ended
    TIMEOUT = "timeout"      # nothing from it for backup_timeout while commits wait for it
    RAISED = "raised"        # the activation sequence was raised: the backup can no longer take over


class PeerAction(str, enum.Enum):
    CATCH_UP = "catch-up"    # send it what it lacks (copy or batches) and follow
    RAISE = "raise"          # raise the activation sequence before anything is released without it
    DROP = "drop"            # close its connection (it must attach again, marking its store incomplete)
    SYNCED = "synced"        # tell it it is in sync (it may mark its store complete)


@dataclass(frozen=True)
class PeerStep:
    state: PeerState
    actions: tuple[PeerAction, ...] = ()


A, S, C, I, L = PeerState.ALONE, PeerState.SYNCING, PeerState.CATCHING, PeerState.IN_SYNC, PeerState.LOST
P = PeerEvent
R = PeerAction

# Rows keyed by (state, event, condition); the condition of an ACK is "below" (the
# backup lacks part of what was handed over when it attached), "boundary" (it has
# that, not yet all that was released) or "all" (everything released so far).
# Acknowledgements are streamed only to a backup being caught up or in sync; a
# timeout only counts while commits wait for it; a raise only follows RAISE.
REPLICA_TABLE: dict[tuple[PeerState, PeerEvent, str], PeerStep] = {
    (A, P.ATTACH, ""): PeerStep(S, (R.CATCH_UP,)),
    (S, P.ATTACH, ""): PeerStep(S, (R.DROP, R.CATCH_UP)),     # the same backup again: the old link is dead
    (C, P.ATTACH, ""): PeerStep(S, (R.DROP, R.CATCH_UP)),
    # A backup commits were waiting for comes back: it marked its store incomplete,
    # but nothing may be released without it before the activation is raised (then
    # ALONE + ATTACH catches it up).
    (I, P.ATTACH, ""): PeerStep(L, (R.DROP, R.RAISE)),
    (L, P.ATTACH, ""): PeerStep(L, (R.RAISE,)),
    (S, P.ACK, "below"): PeerStep(S),
    (S, P.ACK, "boundary"): PeerStep(C),
    (S, P.ACK, "all"): PeerStep(I, (R.SYNCED,)),
    (C, P.ACK, "boundary"): PeerStep(C),
    (C, P.ACK, "all"): PeerStep(I, (R.SYNCED,)),
    (I, P.ACK, ""): PeerStep(I),
    (A, P.DETACH, ""): PeerStep(A),          # a connection given up before (DROP) ends
    (S, P.DETACH, ""): PeerStep(A),          # its store is incomplete: nothing waited for it
    (C, P.DETACH, ""): PeerStep(A),          # (commits that waited for it are released: it cannot take over)
    (I, P.DETACH, ""): PeerStep(L),
    (L, P.DETACH, ""): PeerStep(L),
    (C, P.TIMEOUT, ""): PeerStep(A, (R.DROP,)),
    (I, P.TIMEOUT, ""): PeerStep(I, (R.RAISE,)),
    (L, P.TIMEOUT, ""): PeerStep(L, (R.RAISE,)),
    (I, P.RAISED, ""): PeerStep(A, (R.DROP,)),
    (L, P.RAISED, ""): PeerStep(A),
}
del A, S, C, I, L, P, R

GATED = (PeerState.CATCHING, PeerState.IN_SYNC, PeerState.LOST)
STREAMING = (PeerState.SYNCING, PeerState.CATCHING, PeerState.IN_SYNC)


class ReplicaTracker:
    """The live broker's view of its backup: which store batches were sent and
    acknowledged, up to which batch commit callbacks may run (`gate`), and what to
    do next (REPLICA_TABLE).

    Synchronous replication (Artemis' replication, "sync" mode): a batch's callbacks
    (producers' Accepted, durable subscription attach replies, discharges) run only
    once the local commit *and* the backup's are in, unless the activation sequence
    was raised since the backup was last in sync (ALONE, SYNCING: the backup's
    store cannot become live, so nothing needs it).  A backup that attaches is
    brought up to date without being waited for (SYNCING); once it acknowledged
    what was handed over when it attached, commits wait for it (CATCHING: it keeps
    up from then on); once it holds everything released so far it is told so and
    may take over (IN_SYNC).  Asynchronous replication never waits."""

    def __init__(self, synchronous: bool = True, timeout: float = 5.0):
        self.synchronous = synchronous
        self.timeout = timeout
        self.state = PeerState.ALONE     # the broker raised the activation when it went live
        self.sent: deque[tuple[int, float]] = deque()   # (batch number, when sent), unacknowledged
        self.sent_bytes: deque[int] = deque()
        self.last_sent = -1
        self.acked = -1
        self.boundary = -1          # last batch handed over when the backup attached
        self.eligible_at = -1       # released when commits began to wait: the backup needs this much
        self.released = -1          # highest batch number whose callbacks the gate let run
        self.held = False           # the broker may not accept now (LIVE_TABLE): nothing is released
        self.lost_at: float | None = None
        self.alone_total = 0        # times the live broker raised the activation to go on without it
        self.attached_total = 0

    def step(self, event: PeerEvent, condition: str = "") -> PeerStep:
        """The row for `event` in the current state, applied (the state changes)."""
        row = REPLICA_TABLE[(self.state, event, condition)]
        self.state = row.state
        return row

    # ---- the stream
    def attach(self, first_unsent: int, last_handed_over: int, now: float = 0.0) -> PeerStep:
        """A backup attached; the batches from `first_unsent` on are sent after what
        it holds (its store, or the copy: replaying what it may have is harmless).
        When the row says RAISE, nothing changed yet: raise, then attach again."""
        row = self.step(PeerEvent.ATTACH)
        if PeerAction.CATCH_UP in row.actions:
            self.sent.clear()
            self.sent_bytes.clear()
            self.last_sent = first_unsent - 1
            self.acked = first_unsent - 1
            self.boundary = last_handed_over
            self.lost_at = None
            self.attached_total += 1
        elif self.state is PeerState.LOST and self.lost_at is None:
            self.sent.clear()
            self.sent_bytes.clear()
            self.lost_at = now
        return row

    def should_send(self, number: int) -> bool:
        """Each batch once, in order (a writer replay frames some again)."""
        return self.state in STREAMING and number > self.last_sent

    def sent_batch(self, number: int, now: float, size: int = 0) -> None:
        self.last_sent = number
        self.sent.append((number, now))
        self.sent_bytes.append(size)

    def _ack_condition(self, number: int) -> str:
        if self.state is PeerState.IN_SYNC:
            return ""
        if self.state is PeerState.CATCHING:
            return "all" if number >= self.eligible_at else "boundary"
        if number < self.boundary:
            return "below"
        return "all" if not self.synchronous or number >= self.released else "boundary"

    def on_ack(self, number: int, now: float = 0.0) -> bool:
        """The backup committed every batch up to `number` (the first ack, after it
        installed a store copy, may repeat what the copy holds).  True when it has
        just become IN_SYNC (the I/O tells it: it may take over from now on)."""
        if self.state not in STREAMING or number < self.acked:
            return False
        self.acked = number
        sent, sizes = self.sent, self.sent_bytes
        while sent and sent[0][0] <= number:
            sent.popleft()
            sizes.popleft()
        before = self.state
        row = self.step(PeerEvent.ACK, self._ack_condition(number))
        if before is PeerState.SYNCING and self.state is not PeerState.SYNCING:
            # Batches queued while the copy went out count from now, not from when queued.
            self.sent = deque((n, now) for n, _ in sent)
            # What was released before commits began to wait for it: the backup needs
            # that much before it may take over (afterwards the gate keeps it ahead).
            self.eligible_at = self.released if self.synchronous else number
        return PeerAction.SYNCED in row.actions

    def detach(self, now: float) -> PeerStep:
        """The backup's connection ended.  One that commits were waiting for is LOST:
        they go on waiting until the activation is raised."""
        self.sent.clear()
        self.sent_bytes.clear()
        row = self.step(PeerEvent.DETACH)
        if self.state is PeerState.LOST and self.lost_at is None:
            self.lost_at = now
        return row

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

    def timed_out(self, now: float) -> bool:
        """Commits wait for a backup that is gone, or whose oldest unacknowledged batch
        is older than the timeout."""
        if self.state is PeerState.LOST:
            return self.lost_at is not None and now - self.lost_at >= self.timeout
        if self.state in (PeerState.CATCHING, PeerState.IN_SYNC) and self.sent:
            return now - self.sent[0][1] >= self.timeout
        return False

    def on_timeout(self) -> PeerStep:
        return self.step(PeerEvent.TIMEOUT)

    def raised(self) -> PeerStep:
        """The activation was raised: commits stop waiting for the backup."""
        row = self.step(PeerEvent.RAISED)
        self.sent.clear()
        self.sent_bytes.clear()
        self.lost_at = None
        self.alone_total += 1
        return row

    def lag(self, now: float) -> tuple[int, int, float]:
        """(batches sent and not acknowledged, their bytes, age of the oldest in seconds)."""
        if not self.sent:
            return 0, 0, 0.0
        return len(self.sent), sum(self.sent_bytes), now - self.sent[0][1]


# ------------------------------------------------------------------ catching up

@dataclass(frozen=True)
class CatchUp:
    full: bool          # a copy of the store first
    first: int          # the first batch number streamed after it (or after the backup's store)
    reason: str


def catch_up_plan(lineage: str, window_first: int, window_last: int, first_unsettled: int,
                  backup_lineage: str | None, backup_position: int) -> CatchUp:
    """What a backup that attaches needs.  `lineage` names this live broker's run of
    batch numbers (they restart with every activation); the window holds the sealed
    batches window_first..window_last it framed most recently (window_last =
    window_first - 1: none yet).  A backup whose store holds every batch of this
    lineage up to `backup_position` (a prefix of this broker's history) gets the
    batches after it from the window, if the window reaches back that far; anything
    else gets a copy of the store, followed by the batches not yet committed here
    when it was taken (from `first_unsettled` on)."""
    if backup_lineage != lineage:
        why = "a store of another lineage" if backup_lineage else "no store position"
        return CatchUp(True, first_unsettled, f"{why}: a copy of the store")
    if backup_position > window_last:
        return CatchUp(True, first_unsettled, f"its position {backup_position} is ahead of this broker's "
                                              f"{window_last}: a copy of the store")
    if backup_position < window_first - 1:
        return CatchUp(True, first_unsettled, f"batches {backup_position + 1}..{window_first - 1} are no longer "
                                              f"kept: a copy of the store")
    return CatchUp(False, backup_position + 1, f"batches {backup_position + 1}..{window_last} from the window")


class BatchWindow:
    """The sealed batches framed most recently, at most `max_bytes` of them (the very
    frames the local writer got), for backups that come back (`catch_up_plan`)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.frames: deque[tuple[int, bytes]] = deque()
        self.bytes = 0
        self.first = 0          # window_first: the oldest number kept (or the next when empty)
        self.last = -1

    def start_at(self, number: int) -> None:
        self.first, self.last = number, number - 1

    def add(self, number: int, data: bytes) -> None:
        if number <= self.last:
            return   # a writer replay frames it again: the first framing stays
        self.frames.append((number, data))
        self.bytes += len(data)
        self.last = number
        while self.bytes > self.max_bytes and self.frames:
            _, old = self.frames.popleft()
            self.bytes -= len(old)
            self.first = self.frames[0][0] if self.frames else self.last + 1

    def after(self, number: int) -> list[tuple[int, bytes]]:
        return [(n, data) for n, data in self.frames if n > number]
