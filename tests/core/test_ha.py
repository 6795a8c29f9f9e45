"""core/ha.py row by row: activation fencing, when to contend, the ZooKeeper
session's verdict, and the live broker's view of its backup (ReplicaTracker)."""

import pytest

from amqpbroker.core.ha import (
    Activation,
    Eligibility,
    PeerState,
    ReplicaTracker,
    Role,
    SessionVerdict,
    contends,
    may_activate,
    session_verdict,
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


@pytest.mark.parametrize("state, since, now, verdict", [
    ("CONNECTED", None, 100.0, SessionVerdict.OK),
    ("SUSPENDED", 99.0, 100.0, SessionVerdict.HOLD),
    ("SUSPENDED", 98.0, 100.0, SessionVerdict.FENCED),   # a whole session timeout without ZooKeeper
    ("LOST", None, 100.0, SessionVerdict.FENCED),
])
def test_session_verdict(state, since, now, verdict):
    assert session_verdict(state, since, now, session_timeout=2.0) is verdict


def synced_tracker() -> ReplicaTracker:
    """A backup that attached with batches 0..4 handed over and caught up."""
    t = ReplicaTracker(synchronous=True, timeout=5.0)
    t.gate(4)                      # 0..4 settled alone before it attached
    t.attach(first_unsettled=3, last_handed_over=4)
    for n in (3, 4):
        t.sent_batch(n, now=0.0)
    assert t.on_ack(4) is True     # it has everything settled so far
    return t


def test_a_syncing_backup_is_not_waited_for():
    t = ReplicaTracker()
    t.attach(first_unsettled=10, last_handed_over=12)
    assert t.state is PeerState.SYNCING
    assert t.gate(12) == 12
    t.sent_batch(10, 0.0)
    assert t.on_ack(10) is False and t.state is PeerState.SYNCING   # not yet at the boundary


def test_commits_wait_for_the_backup_once_it_caught_up():
    t = ReplicaTracker()
    t.attach(first_unsettled=0, last_handed_over=1)
    t.sent_batch(0, 0.0)
    t.sent_batch(1, 0.0)
    assert t.gate(1) == 1              # settled alone while syncing
    t.sent_batch(2, 0.0)
    assert t.gate(2) == 2              # still syncing: batch 2 settles alone too
    assert t.on_ack(1) is False        # catching up: it lacks batch 2, which was settled
    assert t.state is PeerState.CATCHING
    t.sent_batch(3, 0.0)
    assert t.gate(3) == 2              # batch 3 waits for the backup now
    assert t.on_ack(3) is True and t.state is PeerState.IN_SYNC
    assert t.gate(3) == 3


def test_gate_is_the_lower_of_both_commits():
    t = synced_tracker()
    t.sent_batch(5, 1.0)
    t.sent_batch(6, 1.0)
    assert t.gate(6) == 4          # local has 6, the backup 4
    t.on_ack(5)
    assert t.gate(6) == 5
    t.on_ack(6)
    assert t.gate(5) == 6 - 1      # the backup is ahead: the local commit decides
    assert t.gate(6) == 6


def test_the_gate_never_goes_back():
    t = synced_tracker()
    assert t.gate(4) == 4
    t.held = True
    t.sent_batch(5, 0.0)
    t.on_ack(5)
    assert t.gate(5) == 4          # held (ZooKeeper in doubt): nothing more is released
    t.held = False
    assert t.gate(5) == 5


def test_asynchronous_mode_never_waits():
    t = ReplicaTracker(synchronous=False)
    t.attach(0, 3)
    t.sent_batch(0, 0.0)
    t.on_ack(3)
    t.sent_batch(4, 0.0)
    assert t.gate(4) == 4


def test_a_slow_backup_is_given_up_after_the_timeout():
    t = synced_tracker()
    t.sent_batch(5, now=10.0)
    assert t.due_alone(14.9) is False
    assert t.due_alone(15.0) is True
    t.went_alone()
    assert t.state is PeerState.ALONE and t.alone_total == 1
    assert t.gate(7) == 7
    assert t.should_send(8) is False   # nothing goes to a backup that was given up


def test_a_lost_backup_is_waited_for_until_the_timeout():
    t = synced_tracker()
    t.sent_batch(5, 1.0)
    t.detach(now=2.0)
    assert t.state is PeerState.LOST
    assert t.gate(5) == 4              # still waiting: it may have it, it may come back
    assert t.due_alone(6.9) is False
    assert t.due_alone(7.0) is True


def test_a_backup_lost_while_syncing_is_simply_absent():
    t = ReplicaTracker()
    t.attach(0, 10)
    t.detach(1.0)
    assert t.state is PeerState.ABSENT
    assert t.gate(12) == 12 and not t.due_alone(100.0)


def test_each_batch_is_sent_once_in_order():
    t = ReplicaTracker()
    assert t.should_send(0) is False   # no backup
    t.attach(5, 5)
    assert t.should_send(4) is False   # in the copy
    assert t.should_send(5) is True
    t.sent_batch(5, 0.0)
    assert t.should_send(5) is False   # a writer replay frames it again


def test_lag():
    t = synced_tracker()
    assert t.lag(3.0) == (0, 0.0)
    t.sent_batch(5, 1.0)
    t.sent_batch(6, 2.0)
    assert t.lag(3.0) == (2, 2.0)


def test_the_first_ack_after_the_copy_may_repeat_what_it_holds():
    t = ReplicaTracker()
    t.gate(7)
    t.attach(first_unsettled=8, last_handed_over=7)   # nothing on its way: the copy has it all
    assert t.on_ack(7, now=1.0) is True                # the backup installed the copy
    assert t.state is PeerState.IN_SYNC


def test_acks_of_a_given_up_backup_change_nothing():
    t = synced_tracker()
    t.went_alone()
    assert t.on_ack(9) is False and t.state is PeerState.ALONE


def test_batches_queued_during_the_copy_are_timed_from_the_catch_up():
    t = ReplicaTracker(timeout=5.0)
    t.attach(0, 0)
    t.sent_batch(0, now=0.0)
    t.sent_batch(1, now=0.0)     # queued while a long copy went out
    t.on_ack(0, now=100.0)
    assert t.state is PeerState.IN_SYNC   # nothing was settled before: it has it all
    assert t.due_alone(104.0) is False
    assert t.due_alone(105.0) is True
