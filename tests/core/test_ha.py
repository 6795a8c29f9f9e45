"""core/ha.py row by row: activation fencing, when to contend, what a ZooKeeper
session state means, the live broker's right to accept (LIVE_TABLE, the lease, a
pause), the live broker's view of its backup (REPLICA_TABLE, ReplicaTracker), and
catching a returning backup up (catch_up_plan, BatchWindow).

The table tests drive the real objects into each state through their methods and
fire the event through them too: an expectation per row, and a check that every
row of the table has one."""

import pytest

from amqpbroker.core.ha import (
    LIVE_TABLE,
    REPLICA_TABLE,
    SESSION_TABLE,
    Activation,
    BatchWindow,
    Eligibility,
    Fence,
    Lease,
    LiveEvent,
    LiveFence,
    LiveState,
    PeerAction,
    PeerEvent,
    PeerState,
    ReplicaTracker,
    Role,
    Session,
    catch_up_plan,
    contends,
    may_activate,
)


def test_activation_round_trips_and_counts_up():
    a = Activation(7, "node-a")
    assert Activation.decode(a.encode()) == a
    assert Activation.decode(b"") == Activation(0, "")
    assert Activation.decode(None) == Activation()
    assert a.next_by("node-b") == Activation(8, "node-b")


def test_an_unreadable_activation_is_an_error_not_zero():
    with pytest.raises(ValueError):
        Activation.decode(b"garbage node")


@pytest.mark.parametrize("stored, complete, current, node, ok", [
    (0, True, Activation(0, ""), "a", True),           # a fresh cluster
    (3, True, Activation(3, "b"), "a", True),          # an in-sync copy of b's store
    (2, True, Activation(3, "b"), "a", False),         # b went on alone (or was live) since
    (2, True, Activation(3, "a"), "a", True),          # a raised ZooKeeper's, then crashed
    (2, True, Activation(3, "b"), "b", True),          # (the same, for b)
    (1, True, Activation(3, "a"), "a", False),         # two behind: even the owner missed one
    (3, False, Activation(3, "b"), "a", False),        # a copy interrupted half way
    (4, True, Activation(3, "b"), "a", False),         # ahead of ZooKeeper: its data was reset
])
def test_may_activate(stored, complete, current, node, ok):
    verdict = may_activate(stored, complete, current, node)
    assert verdict.ok is ok
    assert verdict.reason


@pytest.mark.parametrize("role, ok, seq, expected", [
    (Role.PRIMARY, True, 0, True),
    (Role.AUTO, True, 0, True),
    (Role.BACKUP, True, 0, False),    # a backup never starts a fresh cluster
    (Role.BACKUP, True, 5, True),     # but takes over once something was live
    (Role.PRIMARY, False, 5, False),  # nobody contends with a stale store
])
def test_contends(role, ok, seq, expected):
    assert contends(role, Eligibility(ok, "r"), Activation(seq, "x")) is expected


# ---------------------------------------------------------------------------- the ZooKeeper session


@pytest.mark.parametrize("session, may_look, live_event", [
    (Session.CONNECTING, False, LiveEvent.SUSPENDED),
    (Session.CONNECTED, True, LiveEvent.CONNECTED),
    (Session.SUSPENDED, False, LiveEvent.SUSPENDED),
    (Session.LOST, False, LiveEvent.EXPIRED),
])
def test_session_table(session, may_look, live_event):
    meaning = SESSION_TABLE[session]
    assert (meaning.may_look, meaning.live_event) == (may_look, live_event)
    assert "replicating" in meaning.backup or meaning.may_look   # a backup never stops for it


def test_session_table_has_every_state():
    assert set(SESSION_TABLE) == set(Session)


# ---------------------------------------------------------------------------- the live broker's right to accept

Ls, Ev = LiveState, LiveEvent
LIVE_ROWS = {
    # (state, event): (next state, fence, validate, reopen)
    (Ls.OPEN, Ev.SUSPENDED): (Ls.FENCED, Fence.CLOSE, False, False),
    (Ls.OPEN, Ev.LEASE_EXPIRED): (Ls.VALIDATING, Fence.ABORT, True, False),
    (Ls.OPEN, Ev.PAUSED): (Ls.VALIDATING, Fence.ABORT, True, False),
    (Ls.OPEN, Ev.RAISE_FAILED): (Ls.VALIDATING, Fence.CLOSE, True, False),
    (Ls.OPEN, Ev.EXPIRED): (Ls.DEMOTED, Fence.ABORT, False, False),
    (Ls.OPEN, Ev.INVALID): (Ls.DEMOTED, Fence.ABORT, False, False),
    (Ls.OPEN, Ev.CONNECTED): (Ls.OPEN, Fence.NONE, False, False),
    (Ls.OPEN, Ev.VALID): (Ls.OPEN, Fence.NONE, False, False),
    (Ls.FENCED, Ev.CONNECTED): (Ls.VALIDATING, Fence.NONE, True, False),
    (Ls.FENCED, Ev.SUSPENDED): (Ls.FENCED, Fence.NONE, False, False),
    (Ls.FENCED, Ev.LEASE_EXPIRED): (Ls.FENCED, Fence.NONE, False, False),
    (Ls.FENCED, Ev.PAUSED): (Ls.FENCED, Fence.NONE, False, False),
    (Ls.FENCED, Ev.RAISE_FAILED): (Ls.FENCED, Fence.NONE, False, False),
    (Ls.FENCED, Ev.EXPIRED): (Ls.DEMOTED, Fence.NONE, False, False),
    (Ls.FENCED, Ev.VALID): (Ls.FENCED, Fence.NONE, False, False),
    (Ls.FENCED, Ev.INVALID): (Ls.DEMOTED, Fence.NONE, False, False),
    (Ls.VALIDATING, Ev.VALID): (Ls.OPEN, Fence.NONE, False, True),
    (Ls.VALIDATING, Ev.INVALID): (Ls.DEMOTED, Fence.NONE, False, False),
    (Ls.VALIDATING, Ev.SUSPENDED): (Ls.FENCED, Fence.NONE, False, False),
    (Ls.VALIDATING, Ev.EXPIRED): (Ls.DEMOTED, Fence.NONE, False, False),
    (Ls.VALIDATING, Ev.CONNECTED): (Ls.VALIDATING, Fence.NONE, False, False),
    (Ls.VALIDATING, Ev.LEASE_EXPIRED): (Ls.VALIDATING, Fence.NONE, False, False),
    (Ls.VALIDATING, Ev.PAUSED): (Ls.VALIDATING, Fence.NONE, False, False),
    (Ls.VALIDATING, Ev.RAISE_FAILED): (Ls.VALIDATING, Fence.NONE, False, False),
    **{(Ls.DEMOTED, e): (Ls.DEMOTED, Fence.NONE, False, False) for e in LiveEvent},
}


def fence_in(state: LiveState) -> LiveFence:
    """A LiveFence brought to `state` through its own transitions."""
    f = LiveFence(session_timeout=3.0, now=0.0)
    path = {Ls.OPEN: [], Ls.FENCED: [Ev.SUSPENDED], Ls.VALIDATING: [Ev.SUSPENDED, Ev.CONNECTED],
            Ls.DEMOTED: [Ev.EXPIRED]}[state]
    for event in path:
        f.on(event)
    assert f.state is state
    return f


@pytest.mark.parametrize("state, event", sorted(LIVE_ROWS, key=str))
def test_live_table_row(state, event):
    f = fence_in(state)
    row = f.on(event)
    assert (f.state, row.fence, row.validate, row.reopen) == LIVE_ROWS[(state, event)]


def test_every_live_row_is_tested():
    assert set(LIVE_TABLE) == set(LIVE_ROWS)


def test_only_open_accepts_and_only_validation_opens_again():
    for (state, event), row in LIVE_TABLE.items():
        if row.state is Ls.OPEN and state is not Ls.OPEN:
            assert event is Ev.VALID and state is Ls.VALIDATING and row.reopen


def test_the_lease_is_what_a_round_trip_vouches_for():
    lease = Lease(session_timeout=3.0)
    assert not lease.valid(0.0)
    lease.renewed(sent_at=10.0)
    assert lease.valid(11.99) and not lease.valid(12.0)    # 2/3 of the session timeout
    lease.renewed(sent_at=9.0)                             # an older answer never shortens it
    assert lease.until == 12.0
    assert lease.renew_every == 0.5
    # The server expires the session no earlier than sent_at + session timeout:
    # the lease ends a third of it before.
    assert 10.0 + lease.session_timeout - lease.until == pytest.approx(1.0)


def test_check_finds_a_pause_before_anything_is_read():
    f = LiveFence(session_timeout=3.0, now=100.0)
    f.lease.renewed(100.0)
    assert f.check(100.5) is None and f.last_ok == 100.5
    assert f.check(101.0) is None
    assert f.check(104.5) is Ev.PAUSED          # slept 3.5 s: past the session timeout
    assert f.last_ok == 101.0                   # the accept window ended at the last good look


def test_check_finds_the_lease_over():
    f = LiveFence(session_timeout=3.0, now=100.0)
    f.lease.renewed(100.0)
    for now in (100.5, 101.0, 101.5):
        assert f.check(now) is None
    assert f.check(102.0) is Ev.LEASE_EXPIRED   # no renewal: 2 s after the last answer's request


def test_a_polite_close_only_within_the_lease():
    f = LiveFence(session_timeout=3.0, now=0.0)
    f.lease.renewed(0.0)
    row = f.on(Ev.SUSPENDED)
    assert f.fence_style(row, now=1.0) is Fence.CLOSE
    assert f.fence_style(row, now=2.5) is Fence.ABORT


# ---------------------------------------------------------------------------- the backup, seen from the live broker

Ps, Pe, Pa = PeerState, PeerEvent, PeerAction


def tracker_in(state: PeerState, synchronous: bool = True) -> ReplicaTracker:
    """A tracker brought to `state` through its own methods: batches 0..4 settled
    alone before a backup attached with 3..4 handed over, then batch 5."""
    t = ReplicaTracker(synchronous=synchronous, timeout=5.0)
    t.gate(4)
    if state is Ps.ALONE:
        return t
    t.attach(first_unsent=3, last_handed_over=4)
    t.sent_batch(3, 0.0, 100)
    t.sent_batch(4, 0.0, 100)
    t.sent_batch(5, 0.0, 100)
    t.gate(5)                                    # syncing: 5 is released without the backup
    if state is Ps.SYNCING:
        return t
    assert t.on_ack(4, now=1.0) is False         # has what was handed over, not 5
    if state is Ps.CATCHING:
        assert t.state is Ps.CATCHING
        return t
    assert t.on_ack(5, now=1.0) is True
    if state is Ps.IN_SYNC:
        return t
    t.detach(now=2.0)
    assert t.state is Ps.LOST
    return t


def fire(t: ReplicaTracker, event: PeerEvent, condition: str):
    """The event through the tracker's own methods; the row's actions."""
    if event is Pe.ATTACH:
        return t.attach(first_unsent=6, last_handed_over=7, now=3.0).actions
    if event is Pe.ACK:
        number = {"below": 3, "boundary": 4 if t.state is Ps.SYNCING else 5, "all": 6, "": 6}[condition]
        if t.state is Ps.CATCHING and condition == "boundary":
            t.sent_batch(6, 1.0)
            t.gate(6)
            t.eligible_at = 6        # released grew while it caught up
        if t.state is Ps.SYNCING and condition == "all":
            t.sent_batch(6, 1.0)
            t.gate(6)
        before = t.state
        synced = t.on_ack(number, now=2.0)
        return (Pa.SYNCED,) if synced else (t.state,) if before is t.state else ()
    if event is Pe.DETACH:
        return t.detach(now=3.0).actions
    if event is Pe.TIMEOUT:
        if not t.sent and t.state is not Ps.LOST:
            t.sent_batch(6, 1.0)
        assert t.timed_out(100.0)
        return t.on_timeout().actions
    return t.raised().actions


REPLICA_ROWS = {
    # (state, event, condition): (next state, actions)
    (Ps.ALONE, Pe.ATTACH, ""): (Ps.SYNCING, (Pa.CATCH_UP,)),
    (Ps.SYNCING, Pe.ATTACH, ""): (Ps.SYNCING, (Pa.DROP, Pa.CATCH_UP)),
    (Ps.CATCHING, Pe.ATTACH, ""): (Ps.SYNCING, (Pa.DROP, Pa.CATCH_UP)),
    (Ps.IN_SYNC, Pe.ATTACH, ""): (Ps.LOST, (Pa.DROP, Pa.RAISE)),
    (Ps.LOST, Pe.ATTACH, ""): (Ps.LOST, (Pa.RAISE,)),
    (Ps.SYNCING, Pe.ACK, "below"): (Ps.SYNCING, (Ps.SYNCING,)),
    (Ps.SYNCING, Pe.ACK, "boundary"): (Ps.CATCHING, ()),
    (Ps.SYNCING, Pe.ACK, "all"): (Ps.IN_SYNC, (Pa.SYNCED,)),
    (Ps.CATCHING, Pe.ACK, "boundary"): (Ps.CATCHING, (Ps.CATCHING,)),
    (Ps.CATCHING, Pe.ACK, "all"): (Ps.IN_SYNC, (Pa.SYNCED,)),
    (Ps.IN_SYNC, Pe.ACK, ""): (Ps.IN_SYNC, (Ps.IN_SYNC,)),
    (Ps.ALONE, Pe.DETACH, ""): (Ps.ALONE, ()),
    (Ps.SYNCING, Pe.DETACH, ""): (Ps.ALONE, ()),
    (Ps.CATCHING, Pe.DETACH, ""): (Ps.ALONE, ()),
    (Ps.IN_SYNC, Pe.DETACH, ""): (Ps.LOST, ()),
    (Ps.LOST, Pe.DETACH, ""): (Ps.LOST, ()),
    (Ps.CATCHING, Pe.TIMEOUT, ""): (Ps.ALONE, (Pa.DROP,)),
    (Ps.IN_SYNC, Pe.TIMEOUT, ""): (Ps.IN_SYNC, (Pa.RAISE,)),
    (Ps.LOST, Pe.TIMEOUT, ""): (Ps.LOST, (Pa.RAISE,)),
    (Ps.IN_SYNC, Pe.RAISED, ""): (Ps.ALONE, (Pa.DROP,)),
    (Ps.LOST, Pe.RAISED, ""): (Ps.ALONE, ()),
}


@pytest.mark.parametrize("state, event, condition", sorted(REPLICA_ROWS, key=str))
def test_replica_table_row(state, event, condition):
    t = tracker_in(state)
    actions = fire(t, event, condition)
    expected_state, expected_actions = REPLICA_ROWS[(state, event, condition)]
    assert t.state is expected_state
    assert tuple(actions) == expected_actions


def test_every_replica_row_is_tested():
    assert set(REPLICA_TABLE) == set(REPLICA_ROWS)


def test_nothing_is_released_without_the_backup_unless_the_activation_covers_it():
    """The rule behind the table: in a state where the backup may take over
    (IN_SYNC, LOST), the gate never passes the backup's acknowledgement."""
    for state in (Ps.IN_SYNC, Ps.LOST):
        t = tracker_in(state)
        t.sent_batch(6, 3.0) if state is Ps.IN_SYNC else None
        assert t.gate(9) == 5
    t = tracker_in(Ps.LOST)
    t.attach(6, 7, now=3.0)                       # the backup comes back: raise first
    assert t.state is Ps.LOST and t.gate(9) == 5
    t.raised()
    assert t.state is Ps.ALONE and t.gate(9) == 9
    assert t.attach(10, 9).actions == (Pa.CATCH_UP,)


def test_a_syncing_backup_is_not_waited_for():
    t = tracker_in(Ps.SYNCING)
    assert t.gate(12) == 12


def test_commits_wait_for_a_catching_backup_until_it_has_what_was_released():
    t = tracker_in(Ps.CATCHING)
    assert t.eligible_at == 5
    t.sent_batch(6, 1.0)
    assert t.gate(6) == 5              # waits for it now
    assert t.on_ack(6, now=2.0) is True and t.state is Ps.IN_SYNC
    assert t.gate(6) == 6


def test_gate_is_the_lower_of_both_commits():
    t = tracker_in(Ps.IN_SYNC)
    t.sent_batch(6, 1.0)
    t.sent_batch(7, 1.0)
    assert t.gate(7) == 5
    t.on_ack(6)
    assert t.gate(7) == 6
    t.on_ack(7)
    assert t.gate(6) == 6              # the backup is ahead: the local commit decides
    assert t.gate(7) == 7


def test_the_gate_never_goes_back_and_holds_while_the_broker_may_not_accept():
    t = tracker_in(Ps.IN_SYNC)
    t.held = True
    t.sent_batch(6, 0.0)
    t.on_ack(6)
    assert t.gate(6) == 5
    t.held = False
    assert t.gate(6) == 6


def test_asynchronous_mode_never_waits():
    t = ReplicaTracker(synchronous=False)
    t.attach(first_unsent=3, last_handed_over=4)
    t.sent_batch(5, 0.0)
    t.gate(5)
    assert t.on_ack(4) is True and t.state is Ps.IN_SYNC   # has what was handed over: enough
    t.sent_batch(6, 0.0)
    assert t.gate(6) == 6
    t.detach(1.0)
    assert t.gate(8) == 8


def test_timeouts():
    t = tracker_in(Ps.IN_SYNC)
    t.sent_batch(6, now=10.0)
    assert not t.timed_out(14.9) and t.timed_out(15.0)
    t = tracker_in(Ps.LOST)                 # lost at 2.0
    assert not t.timed_out(6.9) and t.timed_out(7.0)
    assert not tracker_in(Ps.SYNCING).timed_out(1000.0)


def test_raised_counts_and_clears():
    t = tracker_in(Ps.LOST)
    t.raised()
    assert t.alone_total == 1 and t.lost_at is None and t.should_send(9) is False


def test_each_batch_is_sent_once_in_order():
    t = ReplicaTracker()
    assert t.should_send(0) is False   # no backup
    t.attach(5, 5)
    assert t.should_send(4) is False   # in the copy
    assert t.should_send(5) is True
    t.sent_batch(5, 0.0)
    assert t.should_send(5) is False   # a writer replay frames it again


def test_lag_in_batches_bytes_and_seconds():
    t = tracker_in(Ps.IN_SYNC)
    assert t.lag(3.0) == (0, 0, 0.0)
    t.sent_batch(6, 1.0, 300)
    t.sent_batch(7, 2.0, 200)
    assert t.lag(3.0) == (2, 500, 2.0)
    t.on_ack(6)
    assert t.lag(3.0) == (1, 200, 1.0)


def test_the_first_ack_after_a_copy_may_repeat_what_it_holds():
    t = ReplicaTracker()
    t.gate(7)
    t.attach(first_unsent=8, last_handed_over=7)   # nothing on its way: the copy has it all
    assert t.on_ack(7, now=1.0) is True
    assert t.state is Ps.IN_SYNC


def test_batches_queued_during_a_copy_are_timed_from_the_catch_up():
    t = ReplicaTracker(timeout=5.0)
    t.attach(0, 0)
    t.sent_batch(0, now=0.0)
    t.sent_batch(1, now=0.0)     # queued while a long copy went out
    t.on_ack(0, now=100.0)
    assert t.state is Ps.IN_SYNC
    assert not t.timed_out(104.0) and t.timed_out(105.0)


# ---------------------------------------------------------------------------- catching up


@pytest.mark.parametrize("backup_lineage, position, full, first", [
    ("L1", 40, False, 41),      # a prefix of this history, within the window
    ("L1", 9, False, 10),       # just before the oldest kept batch
    ("L1", 50, False, 51),      # has everything framed: nothing to send, only to follow
    ("L1", 8, True, 47),        # the window does not reach back that far
    ("L1", 51, True, 47),       # ahead of this broker: not a prefix of its history
    ("L0", 40, True, 47),       # another live broker's run of batch numbers
    (None, -1, True, 47),       # a fresh or unfinished store
])
def test_catch_up_plan(backup_lineage, position, full, first):
    plan = catch_up_plan("L1", window_first=10, window_last=50, first_unsettled=47,
                         backup_lineage=backup_lineage, backup_position=position)
    assert (plan.full, plan.first) == (full, first)
    assert plan.reason


def test_the_window_keeps_the_newest_batches_within_its_bytes():
    w = BatchWindow(max_bytes=30)
    w.start_at(5)
    assert (w.first, w.last) == (5, 4)
    for n in range(5, 10):
        w.add(n, b"x" * 10)
    assert (w.first, w.last, w.bytes) == (7, 9, 30)
    w.add(8, b"replayed")                  # a writer replay: the first framing stays
    assert [n for n, _ in w.after(7)] == [8, 9] and w.after(7)[0][1] == b"x" * 10
    assert w.after(9) == []
